// The module as the module cases draw it (case_module.cpp,
// case_module_half.cpp): its sizes, weights, data and parameters.
#pragma once

#include <fuzzer/FuzzedDataProvider.h>
#include <mha/mha.h>

#include <cstdint>
#include <vector>

#include "fuzz_common.h"
#include "module_reference.h"
#include "test_util.h"

namespace mha_fuzz {

// A [B, L, F] float tensor over a guarded buffer, batch- or sequence-first.
mha_tensor rows3(Guarded& g, int64_t b, int64_t l, int64_t f, bool seq_first);

// A module and the data and parameters of one call, drawn from the fuzzer's
// bytes for the forward and the backward cases alike: any feature sizes,
// self-attention (inputs 2), key = value (1) or three inputs (0), either
// layout, every mask and variant, dropout in training mode; the weights and
// the data random.  The bytes are read in one fixed order, so that the
// corpus's module entries keep their meaning.  `dout` (the backward's output
// gradient) is drawn only when asked for.
struct ModuleSetup {
  int64_t B = 0, H = 0, E = 0, Lq = 0, Lk = 0, Eq = 0, Ek = 0, Ev = 0;
  int inputs = 0;
  bool bias = false, seq_first = false, with_sinks = false;
  int kpm_kind = 0, am_kind = 0;
  mha_test::Rng rng{0};
  mha_module_config config{};
  mha_module* module = nullptr;
  mha_test::ModuleWeights w;
  Guarded xq{0}, xk{0}, xv{0}, gout{0};
  mha_tensor query{}, key{}, value{}, dout{};
  mha_module_forward_params params{};
  mha_test::ModuleInputs in;
  std::vector<uint8_t> kpm_bool, am_bool;
  std::vector<float> kpm_f32, am_f32, slopes, sinks;
  std::vector<int32_t> lens;
  mha_tensor tkpm{}, tam{}, tlens{}, tslopes{}, tsinks{};

  ModuleSetup(FuzzedDataProvider& fdp, bool with_dout);
  ~ModuleSetup() { mha_module_destroy(module); }
  ModuleSetup(const ModuleSetup&) = delete;
  ModuleSetup& operator=(const ModuleSetup&) = delete;

 private:
  void set(const char* name, int64_t rows, int64_t cols, std::vector<double>& kept);
  void set_weights();
  void draw_data(bool with_dout);
  void draw_params(FuzzedDataProvider& fdp);
};

// A forward call's out and attention weights (weights_kind: 0 none, 1 per
// head, 2 averaged over the heads) against the module's float64 reference
// on m's inputs, within its bounds; otherwise a finding named by `prefix`.
// `activations`: the reference's ModuleInputs::activations (a module with
// MHA_ACTIVATIONS_INPUT on a half-precision query: the query's dtype).
void check_against_reference(const char* prefix, const ModuleSetup& m, const mha_tensor& out,
                             int weights_kind, const mha_tensor& weights,
                             int32_t activations = MHA_DTYPE_F32);

}  // namespace mha_fuzz
