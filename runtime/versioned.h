// Versioned parameter structs.  Each starts with struct_size, which the
// caller's *_init() sets to the size the caller was compiled with.  A struct
// only ever grows at its end, so a caller built against an older mha passes
// one of the older sizes: the fields it does not know take their defaults.  A
// size this library never had (a newer caller's, or garbage) is refused.
#pragma once

#include <mha/mha.h>

#include <cstdint>
#include <cstring>
#include <iterator>

#include "error.h"

namespace mha::rt {

// Every size each struct has had, oldest first; the last is this version's.
// Add the new sizeof when a field is added, never remove an entry.
// 0.1, 0.2 (int8 row scales), 0.3 (sliding window; then sinks, softcap,
// ALiBi), 0.4 (a block of a larger problem)
constexpr uint32_t kAttentionParamsSizes[] = {56, 72, 88, 112, 144};
constexpr uint32_t kModuleConfigSizes[] = {56, 64};  // 0.1, 0.4 (activations)
// 0.1, 0.3 (window, sinks, softcap, ALiBi)
constexpr uint32_t kModuleForwardParamsSizes[] = {64, 104};
constexpr uint32_t kVarlenParamsSizes[] = {40};      // 0.4
constexpr uint32_t kBackwardParamsSizes[] = {24};    // 0.4
constexpr uint32_t kModuleGradientsSizes[] = {104};  // 0.4
static_assert(kAttentionParamsSizes[std::size(kAttentionParamsSizes) - 1] ==
              sizeof(mha_attention_params));
static_assert(kBackwardParamsSizes[std::size(kBackwardParamsSizes) - 1] ==
              sizeof(mha_backward_params));
static_assert(kModuleGradientsSizes[std::size(kModuleGradientsSizes) - 1] ==
              sizeof(mha_module_gradients));
static_assert(kModuleConfigSizes[std::size(kModuleConfigSizes) - 1] == sizeof(mha_module_config));
static_assert(kVarlenParamsSizes[std::size(kVarlenParamsSizes) - 1] == sizeof(mha_varlen_params));
static_assert(kModuleForwardParamsSizes[std::size(kModuleForwardParamsSizes) - 1] ==
              sizeof(mha_module_forward_params));

// What the attention parameters' *_init() functions (mha_attention_params,
// mha_module_forward_params) set: zero everywhere but struct_size, no causal
// mask and no window (-1 leaves a side unbounded).
template <class T>
void init_attention_defaults(T* params) {
  std::memset(static_cast<void*>(params), 0, sizeof *params);
  params->struct_size = static_cast<uint32_t>(sizeof *params);
  params->causal = MHA_CAUSAL_NONE;
  params->window_left = -1;
  params->window_right = -1;
}

// *out = the caller's struct `given` (named `name` in messages; `init` is the
// function that fills it), completed with `defaults` past its struct_size.
template <class T, size_t N>
mha_status read_versioned(const T* given, const T& defaults, const uint32_t (&sizes)[N],
                          const char* name, const char* init, T* out) {
  const uint32_t size = given->struct_size;
  bool known = false;
  for (uint32_t s : sizes) known = known || s == size;
  if (!known) {
    return fail(MHA_ERR_INVALID_PARAMS,
                "%s->struct_size is %u; this library (mha %s) knows %u%s (call %s, and check "
                "that the program was built against these headers)",
                name, size, mha_version(), sizes[N - 1], N > 1 ? " and older sizes" : "", init);
  }
  *out = defaults;
  std::memcpy(static_cast<void*>(out), static_cast<const void*>(given), size);
  out->struct_size = static_cast<uint32_t>(sizeof(T));
  return MHA_OK;
}

}  // namespace mha::rt
