// mha-run's command line: the attention flags sit on the top-level command;
// further modes come as subcommands (`mha-run module ...`), each registered
// here and dispatched when parsed, without changing the flags above.
#include <mha/mha.h>

#include <CLI/CLI.hpp>
#include <exception>
#include <string>
#include <string_view>

#include "attention_run.h"
#include "backward_run.h"
#include "module_run.h"
#include "mpi_run.h"
#include "tool_main.h"
#include "tool_util.h"

namespace mha_tools {
namespace {

// Whether this process is a rank other than 0 of an mpirun job whose command
// line names an MPI mode (--mpi-ring, --mpi-decode, --mpi-layout): every rank
// then has the same command line, and rank 0 alone says what is wrong with
// it.  Elsewhere -- mha-run started by one rank of a user's own MPI program,
// say -- every process reports its errors.
//
// Such a rank exits with status 0 on a bad command line and leaves the job's
// status to rank 0: mpirun kills the whole job as soon as one rank exits
// non-zero, and a quiet rank that did so first could kill rank 0 before it
// had said what is wrong (CI saw it: tools.mpi.parse_error_once printed only
// mpirun's abort).  mpirun's status is then rank 0's.
bool quiet_rank(int argc, const char* const* argv) {
  if (!secondary_mpi_rank()) return false;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg(argv[i]);
    for (const std::string_view flag : {"--mpi-ring", "--mpi-decode", "--mpi-layout"}) {
      if (arg.substr(0, flag.size()) == flag &&
          (arg.size() == flag.size() || arg[flag.size()] == '=')) {
        return true;
      }
    }
  }
  return false;
}

// The top-level flag (attention mode's) given before a mode's name, as in
// `mha-run --causal backward ...`: the top level parses it and the mode would
// run without it, so it is refused.  Empty when there is none.
std::string flag_before_mode(const CLI::App& app) {
  for (const CLI::Option* option : app.get_options()) {
    if (option->count() > 0) return option->get_name();
  }
  return {};
}

std::string one_line_failure(const CLI::App* /*app*/, const CLI::Error& e) {
  return "mha-run: " + escape(e.what()) + " (see mha-run --help)\n";
}

int run(int argc, const char* const* argv) {
  CLI::App app{"Scaled dot-product attention on .npy files with the mha library.", "mha-run"};
  app.failure_message(one_line_failure);
  app.require_subcommand(0, 1);
  const std::string version = std::string("mha-run ") + mha_version();
  app.set_version_flag("--version", version, "print the version of the mha library and exit");
  app.footer(kRunExitStatusHelp);

  AttentionOptions attention;
  add_attention_options(app, attention);

  ModuleOptions module_options;
  CLI::App* module = app.add_subcommand(
      "module", "The multi-head attention module (PyTorch's nn.MultiheadAttention) on .npy files");
  add_module_options(*module, module_options);
  module->set_version_flag("--version", version, "print the version of the mha library and exit");
  module->footer(kRunExitStatusHelp);

  BackwardOptions backward_options;
  CLI::App* backward = app.add_subcommand(
      "backward",
      "The gradients of attention (mha_attention_backward) on .npy files: --dq, --dk, --dv from "
      "--dout, for the call the attention flags describe");
  add_backward_options(*backward, backward_options);
  backward->set_version_flag("--version", version, "print the version of the mha library and exit");
  backward->footer(kRunExitStatusHelp);

  const bool quiet = quiet_rank(argc, argv);
  const auto usage_error = [quiet](const std::string& message) {
    if (quiet) return kExitOk;  // rank 0 says it, with the job's status
    print_error(message);
    return kExitUsage;
  };
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (quiet) return kExitOk;  // rank 0 says it, with the job's status
    return app.exit(e);
  }
  if (module->parsed()) {
    // The module computes in fp32: the attention mode's dtype flags, given
    // before `module`, would otherwise be ignored without a word.
    for (const char* flag : {"--dtype", "--kv-dtype"}) {
      if (app.count(flag) == 0) continue;
      return usage_error(std::string(flag) +
                         " is a flag of attention mode: mha-run module computes in "
                         "float32 (float16 and float64 files are converted to float32)");
    }
    for (const char* flag : {"--mpi-ring", "--mpi-decode", "--mpi-layout"}) {
      if (app.count(flag) == 0) continue;
      return usage_error(std::string(flag) +
                         " is a flag of attention mode: mha-run module runs in one process");
    }
    for (const char* flag : {"--cu-seqlens-q", "--cu-seqlens-k"}) {
      if (app.count(flag) == 0) continue;
      return usage_error(std::string(flag) +
                         " is a flag of attention mode: mha-run module takes batches of [B,L,E] "
                         "inputs, not packed variable-length batches");
    }
    if (const std::string flag = flag_before_mode(app); !flag.empty()) {
      return usage_error(flag +
                         " comes before 'module': a mode's flags follow its name "
                         "(mha-run module --help lists them)");
    }
    return run_module_command(module_options);
  }
  if (backward->parsed()) {
    // The MPI flags (shared with attention mode) would be ignored, and every
    // rank under mpirun would run the whole backward.
    for (const char* flag : {"--mpi-ring", "--mpi-decode", "--mpi-layout"}) {
      if (app.count(flag) == 0 && backward->count(flag) == 0) continue;
      return usage_error(std::string(flag) +
                         " is a flag of attention mode: mha-run backward runs in one process");
    }
    if (const std::string flag = flag_before_mode(app); !flag.empty()) {
      return usage_error(flag +
                         " comes before 'backward': a mode's flags follow its name "
                         "(mha-run backward --help lists them)");
    }
    return run_backward_command(backward_options);
  }
  if (attention.mpi_ring || attention.mpi_decode) return run_mpi_attention_command(attention);
  return run_attention_command(attention);
}

}  // namespace

int mha_run_main(int argc, const char* const* argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    print_error(e.what());
  } catch (...) {
    print_error("unknown exception");
  }
  return kExitFailure;
}

}  // namespace mha_tools
