// The module tests' shared part: a case of the multi-head attention module
// (ModuleCase), run on the selected backend against the float64 reference of
// module_reference.h (run_case: every output checked, nothing outside them
// written, the inputs unmodified), its weights and handles, and the fixture
// over every backend (Module) whose cases live in test_module*.cpp.
#pragma once

#include <gtest/gtest.h>
#include <mha/mha.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "backend_param.h"
#include "module_reference.h"
#include "test_util.h"

namespace mha_test {

inline constexpr float kInfF = std::numeric_limits<float>::infinity();

enum class Inputs { Separate, SharedKeyValue, SelfAttention };
enum class MaskKind { None, Bool, F32 };
enum class Lens { None, PerBatch, PerQuery };

struct ModuleCase {
  int64_t B = 2, Lq = 5, Lk = 7, E = 16, H = 4;
  int64_t Eq = 0, Ek = 0, Ev = 0;  // 0: E
  bool bias = true;
  int32_t activations = MHA_ACTIVATIONS_F32;  // config.activations
  bool d2l_names = false;                     // W_q.weight, ... instead of PyTorch's names
  bool separate_proj = false;                 // q/k/v_proj_weight even when in_proj_weight fits
  bool transposed_weight_storage = false;     // weights set from column-major views
  Inputs inputs = Inputs::Separate;
  bool ones_inputs = false;  // every input element 1 (the d2l example)
  bool seq_first = false;    // inputs [L, B, F] in memory
  bool out_seq_first = false;
  int64_t pad = 0;                  // unused floats after each row of the inputs and out
  int64_t feature_stride = 1;       // of the value input (2: a general-stride operand)
  bool kv_batch_broadcast = false;  // key and value with batch stride 0
  Lens lens = Lens::None;
  mha_dtype lens_dtype = MHA_DTYPE_I32;
  std::vector<int64_t> lens_values;  // empty: generated
  MaskKind kpm = MaskKind::None;
  MaskKind am = MaskKind::None;
  bool am_3d = false;
  bool kpm_dead_batch = false;  // key_padding_mask ignores every key of batch 0
  int32_t causal = MHA_CAUSAL_NONE;
  bool need_weights = false, average = false;
  bool weights_permuted = false;  // per-head weights stored [B, Lq, H, Lk]
  bool training = false;
  float dropout = 0.0f;  // the module's configuration
  uint64_t dropout_seed = 7;
  bool null_params = false;
  uint64_t seed = 1;
  // The attention variants.
  int64_t window_left = -1, window_right = -1;
  float softcap = 0.0f;
  bool sinks = false;
  float sink_value = NAN;  // NaN: random sinks in [-2, 4); else every head's sink
  bool alibi = false, alibi_per_batch = false;
  float slope_value = NAN;        // NaN: ALiBi's geometric slopes 2^(-8 (h + 1) / H); else each
  float qk_amplitude = 1.0f;      // query and key inputs in [-a, a) (separate inputs only)
  bool params_struct_64 = false;  // struct_size 64 (0.1's), the variants' fields garbage

  int64_t eq() const { return Eq != 0 ? Eq : E; }
  int64_t ek() const { return Ek != 0 ? Ek : E; }
  int64_t ev() const { return Ev != 0 ? Ev : E; }

  std::string describe() const;  // the case in one line (for SCOPED_TRACE)
};

struct Outcome {
  bool ok = false;
  std::vector<float> out, weights;  // C order of the logical shapes
  ModuleReference ref;
};

// A [B, L, F] tensor in an arena: batch-first or sequence-first, rows padded.
mha_tensor make_input(Arena& arena, int64_t B, int64_t L, int64_t F, bool seq_first, int64_t pad,
                      int64_t feature_stride, bool batch_broadcast);

// The module's weights, random (PyTorch's default ranges: U(-1/sqrt(fan_in),
// 1/sqrt(fan_in))), kept as floats (what is set) and doubles (the reference).
struct WeightSet {
  std::vector<float> w_q, w_k, w_v, w_o, b_q, b_k, b_v, b_o;
  ModuleWeights ref;
};

WeightSet make_weights(const ModuleCase& c, Rng& rng);

// Sets the weights of `w` under the case's names (d2l's, in_proj_*, or q/k/v_proj_*).
bool load_weights(mha_module* m, const ModuleCase& c, const WeightSet& w);

struct ModuleHandle {
  mha_module* m = nullptr;
  ~ModuleHandle() { mha_module_destroy(m); }
};

::testing::AssertionResult create_module(const ModuleCase& c, ModuleHandle& h);

// A BoundCheck of `what` in one line, for a failure message.
std::string report(const char* what, const BoundCheck& check);

// Runs one case on the selected backend and checks everything.
Outcome run_case(const ModuleCase& c);

bool bits_equal(const std::vector<float>& a, const std::vector<float>& b);

// Whether mha_attention implements dropout yet (until it does, it refuses
// dropout_p != 0, and the module's fused path with it).
bool kernel_dropout_available();

// The fixture of the module's cases over every backend; its one instantiation
// (INSTANTIATE_TEST_SUITE_P) is in test_module.cpp.
class Module : public BackendTest {};

}  // namespace mha_test
