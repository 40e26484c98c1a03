// The steps of `mha-run module`: the multi-head attention module
// (nn.MultiheadAttention) on .npy files, with weights read from a directory of
// .npy files named as PyTorch's state_dict keys (tools/export_torch_weights.py
// writes them):
//
//   mha-run module --weights DIR --query Q.npy [--key K.npy] [--value V.npy]
//                  --out O.npy [--heads N] [--valid-lens VL.npy]
//                  [--key-padding-mask M.npy] [--attn-mask M.npy]
//                  [--causal [none|top-left|bottom-right]]
//                  [--window L,R] [--sinks S.npy] [--softcap C] [--alibi SLOPES.npy]
//                  [--need-weights W.npy [--average-weights]]
//                  [--sequence-first | --batch-first] [--allow-missing-weights]
//                  [--threads N] [--backend NAME] [--repeat N]
//
// The configuration is read from the files: E from out_proj.weight (or
// in_proj_weight), the input sizes from q/k/v_proj_weight when present; from
// DIR/config.json (which tools/export_torch_weights.py writes) the number of
// heads (unless --heads), batch_first (the layout of the inputs and the
// output, unless a flag says the same) and bias (whether the biases exist;
// without it, biases are on when a bias file is present).  A weight the
// module needs that has no file is refused unless --allow-missing-weights.
#pragma once

#include <mha/mha.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "cli_options.h"
#include "npy.h"

namespace CLI {
class App;
}

namespace mha_tools {

struct ModuleOptions : RunOptions, VariantOptions {
  std::string weights_dir, query, key, value, out;
  std::optional<int64_t> heads;
  std::string valid_lens, key_padding_mask, attn_mask, need_weights;  // empty: not given
  std::string causal = "none";  // none | top-left | bottom-right
  bool average_weights = false;
  bool sequence_first = false;  // --sequence-first
  bool batch_first = false;     // --batch-first
  bool allow_missing_weights = false;
};

void add_module_options(CLI::App& app, ModuleOptions& options);
// Throws UsageError.
void check_module_options(const ModuleOptions& options);

// DIR/config.json: nn.MultiheadAttention's constructor arguments (each may be
// missing; null counts as missing).
struct ModuleConfigFile {
  bool present = false;
  std::optional<int64_t> num_heads, embed_dim, kdim, vdim;
  std::optional<bool> bias, batch_first, add_bias_kv, add_zero_attn;
  std::optional<double> dropout;
};
// Throws ToolError for a file that is not a JSON object or holds a known key
// of the wrong type.
ModuleConfigFile read_module_config(const std::string& dir);

// The weight files of a directory and the configuration they imply.
struct ModuleWeightFiles {
  std::map<std::string, NpyArray> arrays;  // state_dict key -> array
  mha_module_config config{};
  ModuleConfigFile file;             // config.json
  std::vector<std::string> missing;  // files of weights taken as zero
};
ModuleWeightFiles load_module_weights(const std::string& dir, std::optional<int64_t> heads,
                                      bool allow_missing_weights = false);

// Whether the inputs and the output are [L, B, E]: config.json's batch_first
// when it has one (a flag that contradicts it is a UsageError), else
// --sequence-first.
bool sequence_first_layout(const ModuleOptions& options, const ModuleConfigFile& config);

// The whole command: prints errors as "mha-run: ..." on stderr and returns
// the exit status.
int run_module_command(const ModuleOptions& options);

}  // namespace mha_tools
