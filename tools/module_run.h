// The steps of `mha-run module`: the multi-head attention module
// (nn.MultiheadAttention) on .npy files, with weights read from a directory of
// .npy files named as PyTorch's state_dict keys (tools/export_torch_weights.py
// writes them):
//
//   mha-run module --weights DIR --query Q.npy [--key K.npy] [--value V.npy]
//                  --out O.npy [--heads N] [--valid-lens VL.npy]
//                  [--key-padding-mask M.npy] [--attn-mask M.npy] [--causal]
//                  [--need-weights W.npy [--average-weights]] [--sequence-first]
//                  [--threads N] [--backend NAME] [--repeat N]
//
// The configuration is read from the files: E from out_proj.weight (or
// in_proj_weight), the input sizes from q/k/v_proj_weight when present, biases
// on when a bias file is present; the number of heads from --heads, else from
// DIR/config.json ("num_heads"), which the export script writes.
#pragma once

#include <mha/mha.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "npy.h"

namespace CLI {
class App;
}

namespace mha_tools {

struct ModuleOptions {
  std::string weights_dir, query, key, value, out;
  std::optional<int64_t> heads;
  std::string valid_lens, key_padding_mask, attn_mask, need_weights;  // empty: not given
  bool causal = false;
  bool average_weights = false;
  bool sequence_first = false;
  std::string backend;
  std::optional<int> threads;
  int repeat = 0;
};

void add_module_options(CLI::App& app, ModuleOptions& options);
void check_module_options(const ModuleOptions& options);

// The weight files of a directory and the configuration they imply.
struct ModuleWeightFiles {
  std::map<std::string, NpyArray> arrays;  // state_dict key -> array
  mha_module_config config{};
};
ModuleWeightFiles load_module_weights(const std::string& dir, std::optional<int64_t> heads);

// The whole command: prints errors as "mha-run: ..." on stderr and returns
// the exit status.
int run_module_command(const ModuleOptions& options);

}  // namespace mha_tools
