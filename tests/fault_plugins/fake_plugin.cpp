// A backend plugin with one fault, chosen by a macro at build time, for the
// plugin-fault tests.  It never computes: every fault keeps it unusable, and
// its attend fails should the runtime ever call it.
//   FAULT_NAME           the name in its table (default: FAULT_FILE_NAME)
//   FAULT_ABI            its ABI version (default: the runtime's)
//   FAULT_FEATURES       required_cpu_features (default: none)
//   FAULT_INIT_MESSAGE   init fails with this message ("" for none)
//   FAULT_NULL_TABLE     mha_plugin_entry returns NULL
//   FAULT_NO_ATTEND      a table without attend (malformed)
//   FAULT_NO_ENTRY       no mha_plugin_entry symbol at all
//   FAULT_ABORT_ON_LOAD  aborts the process when loaded: a trap for files the
//                        runtime must never dlopen
// Priority 1000: if the runtime did not refuse it, auto would pick it.
#include <mha/plugin_abi.h>

#include <cstddef>
#include <cstdio>
#include <cstdlib>

#define FAULT_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

#ifdef FAULT_ABORT_ON_LOAD
__attribute__((constructor)) void trap() {
  std::fprintf(stderr, "FAULT: the runtime loaded %s, a file it must never load\n",
               "libmha-backend-" FAULT_FILE_NAME ".so");
  std::abort();
}
#endif

#ifndef FAULT_NAME
#define FAULT_NAME FAULT_FILE_NAME
#endif
#ifndef FAULT_ABI
#define FAULT_ABI MHA_PLUGIN_ABI_VERSION
#endif
#ifndef FAULT_FEATURES
#define FAULT_FEATURES 0u
#endif

size_t scratch_bytes(const mha_kernel_problem*, int64_t) {
  return 64;
}

[[maybe_unused]] int attend(const mha_kernel_problem*, const mha_work_item*, void*) {
  return 99;  // never reached: the plugin is never usable
}

#ifdef FAULT_INIT_MESSAGE
int init(char* message, size_t message_size) {
  std::snprintf(message, message_size, "%s", FAULT_INIT_MESSAGE);
  return 1;
}
#endif

const mha_plugin kTable = {
    FAULT_ABI,
    sizeof(mha_plugin),
    FAULT_NAME,
    "a plugin with a fault, for tests",
    FAULT_FEATURES,
    1000,
    1,
    16,
    64,
#ifdef FAULT_INIT_MESSAGE
    init,
#else
    nullptr,
#endif
    scratch_bytes,
#ifdef FAULT_NO_ATTEND
    nullptr,
#else
    attend,
#endif
    nullptr,
    nullptr,
    nullptr,  // no backward pass
    nullptr,
    nullptr,  // choose_tiles: the table's
    nullptr,  // gemm_ukernel: BLIS's own
    nullptr,  // bf16_gemm: none
    nullptr,  // narrow_floats: the runtime rounds
};

}  // namespace

#ifdef FAULT_NO_ENTRY
FAULT_EXPORT int mha_not_the_plugin_entry(void) {
  return kTable.priority;
}
#else
FAULT_EXPORT const mha_plugin* mha_plugin_entry(void) {
#ifdef FAULT_NULL_TABLE
  return kTable.priority > 0 ? nullptr : &kTable;
#else
  return &kTable;
#endif
}
#endif
