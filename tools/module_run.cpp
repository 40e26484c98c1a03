#include "module_run.h"

#include <sys/stat.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <new>
#include <nlohmann/json.hpp>
#include <type_traits>
#include <vector>

#include "attention_run.h"
#include "common/visibility.h"
#include "output_files.h"
#include "tool_util.h"

namespace mha_tools {
namespace {

namespace fs = std::filesystem;

// The state_dict keys mha-run understands: PyTorch's, then d2l's.
const char* const kWeightKeys[] = {
    "in_proj_weight",  "q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias",
    "out_proj.weight", "out_proj.bias", "W_q.weight",    "W_k.weight",    "W_v.weight",
    "W_o.weight",      "W_q.bias",      "W_k.bias",      "W_v.bias",      "W_o.bias"};

bool is_weight_key(const std::string& key) {
  return std::find(std::begin(kWeightKeys), std::end(kWeightKeys), key) != std::end(kWeightKeys);
}

bool is_bias_key(const std::string& key) {
  return key.size() > 4 && key.compare(key.size() - 4, 4, "bias") == 0;
}

std::string known_keys() {
  std::string s;
  for (const char* k : kWeightKeys) s += (s.empty() ? "" : ", ") + std::string(k);
  return s;
}

// The state_dict names of one part of the module: PyTorch's packed and
// separate names, then d2l's.
struct Part {
  const char* packed;    // in_proj_weight / in_proj_bias, or nullptr
  const char* separate;  // q_proj_weight, ..., out_proj.weight, out_proj.bias
  const char* d2l;       // W_q.weight, ...
};
const Part kWeightParts[] = {{"in_proj_weight", "q_proj_weight", "W_q.weight"},
                             {"in_proj_weight", "k_proj_weight", "W_k.weight"},
                             {"in_proj_weight", "v_proj_weight", "W_v.weight"},
                             {nullptr, "out_proj.weight", "W_o.weight"}};
// PyTorch has one in_proj_bias even with separate projection weights.
const Part kBiasParts[] = {{"in_proj_bias", nullptr, "W_q.bias"},
                           {"in_proj_bias", nullptr, "W_k.bias"},
                           {"in_proj_bias", nullptr, "W_v.bias"},
                           {nullptr, "out_proj.bias", "W_o.bias"}};

// The files of the parts that none of their names provides, named in the
// style of the directory (d2l's when it has a W_ file; PyTorch's packed
// in_proj_* unless it has separate q/k/v_proj_weight files or kdim/vdim differ).
std::vector<std::string> missing_files(const std::map<std::string, NpyArray>& arrays,
                                       const Part (&parts)[4], bool packed) {
  const auto has = [&arrays](const char* key) { return key != nullptr && arrays.count(key) != 0; };
  bool d2l = false;
  for (const auto& entry : arrays) d2l = d2l || entry.first.rfind("W_", 0) == 0;
  std::vector<std::string> missing;
  for (const Part& part : parts) {
    if (has(part.packed) || has(part.separate) || has(part.d2l)) continue;
    const char* name = d2l ? part.d2l : (packed && part.packed ? part.packed : part.separate);
    if (name == nullptr) name = part.packed;  // PyTorch's q/k/v biases: in_proj_bias
    const std::string file = std::string(name) + ".npy";
    if (std::find(missing.begin(), missing.end(), file) == missing.end()) missing.push_back(file);
  }
  return missing;
}

std::string joined(const std::vector<std::string>& items) {
  std::string s;
  for (const auto& item : items) s += (s.empty() ? "" : ", ") + item;
  return s;
}

// A descriptor over an array of rank <= 4, in the array's own layout; with
// swap01 the first two dimensions are exchanged ([L, B, E] memory as [B, L, E]).
mha_tensor describe(NpyArray& a, mha_dtype dtype, bool swap01 = false) {
  mha_tensor t{};
  t.data = a.data();
  t.dtype = dtype;
  t.ndim = a.rank();
  for (int d = 0; d < a.rank(); ++d) {
    const int from = swap01 && d < 2 ? 1 - d : d;
    t.shape[d] = a.shape()[static_cast<size_t>(from)];
    t.strides[d] = a.strides()[static_cast<size_t>(from)];
  }
  return t;
}

mha_dtype mask_dtype(const NpyArray& a) {
  return a.dtype() == NpyDtype::F32 ? MHA_DTYPE_F32 : MHA_DTYPE_BOOL;
}

NpyArray load_sequence(const char* flag, const std::string& path, const char* role,
                       bool seq_first) {
  NpyArray a = read_float_input(flag, path);
  if (a.dtype() != NpyDtype::F32 || a.rank() != 3) {
    throw ToolError(std::string(flag) + " " + path + ": " + role +
                    " must be float32 (<f4; float16 <f2 or float64 <f8, converted) of rank 3, " +
                    (seq_first ? "[L, B, features] (sequence-first)" : "[B, L, features]") +
                    "; the file holds " + a.describe());
  }
  return a;
}

NpyArray load_mask(const char* flag, const std::string& path, int min_rank, int max_rank,
                   const char* shapes) {
  NpyArray a = read_float_input(flag, path);
  if (a.dtype() != NpyDtype::Bool && a.dtype() != NpyDtype::U8 && a.dtype() != NpyDtype::F32) {
    throw ToolError(std::string(flag) + " " + path +
                    ": the mask must be bool (|b1, or |u1; true = not allowed) or float32 (<f4, "
                    "or float16 <f2, float64 <f8; added to the scores); the file holds " +
                    a.describe());
  }
  if (a.rank() < min_rank || a.rank() > max_rank) {
    throw ToolError(std::string(flag) + " " + path + ": the mask must be " + shapes +
                    "; the file holds " + a.describe());
  }
  return a;
}

// The integer, boolean or number under a key of config.json; null and a
// missing key give nullopt, any other type is an error.
template <typename T>
std::optional<T> config_value(const nlohmann::json& j, const char* key, const std::string& file) {
  if (!j.contains(key) || j[key].is_null()) return std::nullopt;
  const nlohmann::json& v = j[key];
  bool ok = false;
  if constexpr (std::is_same_v<T, bool>) {
    ok = v.is_boolean();
  } else if constexpr (std::is_integral_v<T>) {
    ok = v.is_number_integer();
  } else {
    ok = v.is_number();
  }
  if (!ok) {
    const char* want = std::is_same_v<T, bool>
                           ? "true or false"
                           : (std::is_integral_v<T> ? "an integer" : "a number");
    throw ToolError(file + ": \"" + key + "\" must be " + want + ", not " + v.dump());
  }
  return v.get<T>();
}

// Pairs (b, h, i, j) that take part, as the module masks them (the window,
// causal, valid lengths, the masks).
double count_pairs(const mha_module_forward_params& p, int64_t batch, int64_t heads, int64_t lq,
                   int64_t lk) {
  const auto allowed = [](const mha_tensor* m, int64_t offset) {
    if (m->dtype == MHA_DTYPE_BOOL) return static_cast<const uint8_t*>(m->data)[offset] == 0;
    return static_cast<const float*>(m->data)[offset] != -INFINITY;
  };
  const bool per_head = p.attn_mask != nullptr && p.attn_mask->ndim == 3;
  double pairs = 0.0;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < (per_head ? heads : 1); ++h) {
      for (int64_t i = 0; i < lq; ++i) {
        int64_t valid_length = lk;
        if (const mha_tensor* vl = p.valid_lens; vl != nullptr) {
          valid_length = mha_rules::valid_length_at(
              vl->data, vl->dtype == MHA_DTYPE_I64,
              b * vl->strides[0] + (vl->ndim == 2 ? i * vl->strides[1] : 0));
        }
        const int64_t end = mha_rules::visible_keys(
            i, lk, mha_rules::upper_diagonal(p.causal, p.window_right, lq, lk), valid_length);
        const int64_t first = mha_rules::first_visible_key(
            i, mha_rules::window_lower_diagonal(p.window_left, lq, lk));
        for (int64_t j = first; j < end; ++j) {
          if (const mha_tensor* m = p.key_padding_mask;
              m != nullptr && !allowed(m, b * m->strides[0] + j * m->strides[1])) {
            continue;
          }
          if (const mha_tensor* m = p.attn_mask; m != nullptr) {
            const int64_t at = m->ndim == 2 ? i * m->strides[0] + j * m->strides[1]
                                            : (b * heads + h) * m->strides[0] + i * m->strides[1] +
                                                  j * m->strides[2];
            if (!allowed(m, at)) continue;
          }
          pairs += per_head ? 1.0 : static_cast<double>(heads);
        }
      }
    }
  }
  return pairs;
}

struct ModuleHandle {
  mha_module* m = nullptr;
  ModuleHandle() = default;
  ModuleHandle(const ModuleHandle&) = delete;
  ModuleHandle& operator=(const ModuleHandle&) = delete;
  ~ModuleHandle() { mha_module_destroy(m); }
};

}  // namespace

// ---------------------------------------------------------------- options

void add_module_options(CLI::App& app, ModuleOptions& o) {
  const CLI::Validator& filled = non_empty();
  app.add_option("--weights", o.weights_dir,
                 "directory of .npy weights named as the state_dict keys (in_proj_weight.npy, "
                 "out_proj.weight.npy, ...) and config.json; mha-export-torch-weights writes them")
      ->check(filled);
  app.add_option("--query", o.query,
                 "queries: float32 [B,Lq,Eq] .npy ([Lq,B,Eq] when sequence-first); float16 and "
                 "float64 files (here and in every other input) are converted to float32: the "
                 "module computes in float32 and has no --dtype")
      ->check(filled);
  app.add_option("--key", o.key, "keys: float32 [B,Lk,Ek] .npy (default: the queries)")
      ->check(filled);
  app.add_option("--value", o.value, "values: float32 [B,Lk,Ev] .npy (default: the keys)")
      ->check(filled);
  app.add_option("--out", o.out,
                 "output: float32 [B,Lq,E] .npy to write ([Lq,B,E] when sequence-first); "
                 "replaced only once every output is written")
      ->check(filled);
  app.add_option_function<int64_t>(
         "--heads", [&o](const int64_t& n) { o.heads = n; },
         "number of heads (default: num_heads of DIR/config.json)")
      ->check(filled);
  app.add_option("--valid-lens", o.valid_lens, "valid lengths .npy, int32 or int64, [B] or [B,Lq]")
      ->check(filled);
  app.add_option("--key-padding-mask", o.key_padding_mask,
                 "key padding mask .npy [B,Lk]: bool (true = ignore the key) or float32 (added)")
      ->check(filled);
  app.add_option(
         "--attn-mask", o.attn_mask,
         "attention mask .npy [Lq,Lk] or [B*H,Lq,Lk]: bool (true = not allowed) or float32 (added)")
      ->check(filled);
  add_causal_option(app, o.causal,
                    "causal mask: none (the default), top-left (query i sees keys j <= i; also "
                    "--causal alone) or bottom-right (j <= i + Lk - Lq)");
  add_variant_options(app, o);
  app.add_option("--need-weights", o.need_weights,
                 "attention weights: float32 [B,H,Lq,Lk] .npy to write")
      ->check(filled);
  app.add_flag("--average-weights", o.average_weights,
               "write the weights averaged over the heads, [B,Lq,Lk]");
  CLI::Option* seq =
      app.add_flag("--sequence-first", o.sequence_first,
                   "inputs and output are [L,B,E] (PyTorch's batch_first=False; the default when "
                   "config.json says \"batch_first\": false, an error when it says true)");
  CLI::Option* batch = app.add_flag(
      "--batch-first", o.batch_first,
      "inputs and output are [B,L,E] (the default without config.json's batch_first; an error "
      "when it says false)");
  seq->excludes(batch);
  app.add_flag("--allow-missing-weights", o.allow_missing_weights,
               "take weights without a file as zero (by default a missing weight is an error, as "
               "in PyTorch's load_state_dict)");
  add_run_options(app, o);
}

void check_module_options(const ModuleOptions& o) {
  std::string missing;
  const auto need = [&missing](const std::string& value, const char* flag) {
    if (value.empty()) missing += missing.empty() ? flag : std::string(", ") + flag;
  };
  need(o.weights_dir, "--weights");
  need(o.query, "--query");
  if (o.repeat == 0) need(o.out, "--out");
  if (!missing.empty())
    throw UsageError("module: missing " + missing + " (see mha-run module --help)");
  if (o.average_weights && o.need_weights.empty()) {
    throw UsageError("module: --average-weights needs --need-weights W.npy");
  }
  if (o.heads && *o.heads <= 0) {
    throw UsageError("module: --heads " + std::to_string(*o.heads) + ": it must be positive");
  }
  if (o.sequence_first && o.batch_first) {
    throw UsageError("module: --sequence-first and --batch-first exclude each other");
  }
  (void)causal_mode(o.causal);
  if (!o.window.empty()) (void)parse_window(o.window);
}

ModuleConfigFile read_module_config(const std::string& dir) {
  ModuleConfigFile c;
  const std::string file = (fs::path(dir) / "config.json").string();
  struct stat st {};
  if (::lstat(file.c_str(), &st) != 0 && errno == ENOENT) return c;
  std::string text;
  try {
    text = read_small_file(file, std::size_t{1} << 20);
  } catch (const NpyError& e) {
    throw ToolError(file + ": " + e.what());
  }
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    throw ToolError(file + ": not valid JSON: " + e.what());
  }
  if (!j.is_object()) throw ToolError(file + ": not a JSON object");
  c.present = true;
  c.num_heads = config_value<int64_t>(j, "num_heads", file);
  c.embed_dim = config_value<int64_t>(j, "embed_dim", file);
  c.kdim = config_value<int64_t>(j, "kdim", file);
  c.vdim = config_value<int64_t>(j, "vdim", file);
  c.bias = config_value<bool>(j, "bias", file);
  c.batch_first = config_value<bool>(j, "batch_first", file);
  c.add_bias_kv = config_value<bool>(j, "add_bias_kv", file);
  c.add_zero_attn = config_value<bool>(j, "add_zero_attn", file);
  c.dropout = config_value<double>(j, "dropout", file);
  return c;
}

bool sequence_first_layout(const ModuleOptions& o, const ModuleConfigFile& c) {
  if (!c.batch_first) return o.sequence_first;
  const std::string where = (fs::path(o.weights_dir) / "config.json").string();
  if (*c.batch_first && o.sequence_first) {
    throw UsageError("module: --sequence-first contradicts \"batch_first\": true in " + where +
                     " (the module takes [B, L, E]); drop the flag or correct config.json");
  }
  if (!*c.batch_first && o.batch_first) {
    throw UsageError("module: --batch-first contradicts \"batch_first\": false in " + where +
                     " (the module takes [L, B, E]); drop the flag or correct config.json");
  }
  return !*c.batch_first;
}

// ---------------------------------------------------------------- weights

ModuleWeightFiles load_module_weights(const std::string& dir, std::optional<int64_t> heads,
                                      bool allow_missing_weights) {
  ModuleWeightFiles files;
  const fs::path root(dir);
  std::error_code ec;
  if (!fs::is_directory(root, ec)) throw ToolError("--weights " + dir + ": not a directory");
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const fs::path& path = entry.path();
    if (path.extension() != ".npy") continue;
    const std::string key = path.stem().string();
    if (key == "bias_k" || key == "bias_v") {
      throw ToolError(path.string() + ": add_bias_kv=True is not supported by the mha module");
    }
    if (!is_weight_key(key)) {
      throw ToolError(path.string() + ": '" + key +
                      "' is not a weight of nn.MultiheadAttention; the files are named " +
                      known_keys() + " (.npy)");
    }
    NpyArray a = read_float_input("--weights", path.string());
    if (a.dtype() != NpyDtype::F32) {
      throw ToolError(path.string() +
                      ": weights must be float32 (<f4, or float16 <f2, float64 <f8); the file "
                      "holds " +
                      a.describe());
    }
    if (a.rank() != (is_bias_key(key) ? 1 : 2)) {
      throw ToolError(path.string() + ": " + key + " must have rank " +
                      (is_bias_key(key) ? "1" : "2") + "; the file holds " + a.describe());
    }
    files.arrays.emplace(key, std::move(a));
  }
  if (ec) throw ToolError("--weights " + dir + ": " + ec.message());
  const ModuleConfigFile& cf = files.file = read_module_config(dir);
  const std::string config_file = (root / "config.json").string();
  if (cf.add_bias_kv.value_or(false)) {
    throw ToolError(config_file + ": add_bias_kv=True is not supported by the mha module");
  }
  if (cf.add_zero_attn.value_or(false)) {
    throw ToolError(config_file + ": add_zero_attn=True is not supported by the mha module");
  }

  const auto shape = [&files](const char* key, size_t d) -> std::optional<int64_t> {
    auto it = files.arrays.find(key);
    if (it == files.arrays.end()) return std::nullopt;
    return it->second.shape()[d];
  };
  std::optional<int64_t> e = shape("out_proj.weight", 0);
  if (!e) e = shape("W_o.weight", 0);
  if (!e) e = shape("in_proj_weight", 1);
  if (!e) e = shape("q_proj_weight", 0);
  if (!e) e = shape("W_q.weight", 0);
  if (!e) {
    throw ToolError("--weights " + dir +
                    ": cannot tell the embedding size: the directory has none of "
                    "out_proj.weight.npy, in_proj_weight.npy, q_proj_weight.npy, W_o.weight.npy, "
                    "W_q.weight.npy");
  }
  const auto input_dim = [&](const char* torch, const char* d2l) {
    if (auto v = shape(torch, 1)) return *v;
    if (auto v = shape(d2l, 1)) return *v;
    return *e;
  };
  mha_module_config& c = files.config;
  mha_module_config_init(&c);
  c.embed_dim = *e;
  if (heads) {
    c.num_heads = *heads;
  } else if (!cf.present) {
    throw ToolError(
        "the number of heads is not stored in the weights: give --heads N (or put "
        "{\"num_heads\": N} in " +
        config_file + ")");
  } else if (!cf.num_heads) {
    throw ToolError(config_file + ": no integer \"num_heads\"; give --heads N");
  } else {
    c.num_heads = *cf.num_heads;
  }
  c.query_dim = input_dim("q_proj_weight", "W_q.weight");
  c.key_dim = input_dim("k_proj_weight", "W_k.weight");
  c.value_dim = input_dim("v_proj_weight", "W_v.weight");
  const auto agree = [&](const char* key, const std::optional<int64_t>& said, int64_t found,
                         const char* from) {
    if (said && *said != found) {
      throw ToolError(config_file + ": \"" + key + "\": " + std::to_string(*said) +
                      " but the weights have " + std::to_string(found) + " (" + from + ")");
    }
  };
  agree("embed_dim", cf.embed_dim, c.embed_dim, "the rows of the projections");
  agree("kdim", cf.kdim, c.key_dim, "the columns of the key projection");
  agree("vdim", cf.vdim, c.value_dim, "the columns of the value projection");

  std::vector<std::string> bias_files;
  for (const auto& [key, array] : files.arrays) {
    if (is_bias_key(key)) bias_files.push_back(key + ".npy");
  }
  if (cf.bias == std::optional<bool>(false) && !bias_files.empty()) {
    throw ToolError(config_file + ": \"bias\": false, but the directory has " + joined(bias_files));
  }
  const bool bias = cf.bias.value_or(!bias_files.empty());
  c.bias = bias ? 1 : 0;

  const bool packed = c.query_dim == c.embed_dim && c.key_dim == c.embed_dim &&
                      c.value_dim == c.embed_dim && !shape("q_proj_weight", 0) &&
                      !shape("k_proj_weight", 0) && !shape("v_proj_weight", 0);
  files.missing = missing_files(files.arrays, kWeightParts, packed);
  if (bias) {
    for (std::string& f : missing_files(files.arrays, kBiasParts, packed)) {
      files.missing.push_back(std::move(f));
    }
  }
  if (!files.missing.empty() && !allow_missing_weights) {
    throw ToolError("--weights " + dir + ": missing " + joined(files.missing) +
                    " (PyTorch's load_state_dict refuses missing keys); give "
                    "--allow-missing-weights to take them as zero");
  }
  return files;
}

// ---------------------------------------------------------------- the command

namespace {

std::vector<NamedFile> module_inputs(const ModuleOptions& o) {
  std::vector<NamedFile> files = {{"--query", o.query},
                                  {"--key", o.key},
                                  {"--value", o.value},
                                  {"--valid-lens", o.valid_lens},
                                  {"--key-padding-mask", o.key_padding_mask},
                                  {"--attn-mask", o.attn_mask},
                                  {"--sinks", o.sinks},
                                  {"--alibi", o.alibi}};
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(o.weights_dir, ec)) {
    files.push_back({"--weights", entry.path().string()});
  }
  return files;
}

}  // namespace

int run_module_command(const ModuleOptions& o) {
  return run_guarded([&o] {
    check_module_options(o);
    std::vector<NamedFile> output_names;  // the weights first, the output last
    if (!o.need_weights.empty()) output_names.push_back({"--need-weights", o.need_weights});
    if (!o.out.empty()) output_names.push_back({"--out", o.out});
    OutputFiles outputs(output_names, module_inputs(o));
    configure_runtime(o.backend, o.threads);
    ModuleWeightFiles weights =
        load_module_weights(o.weights_dir, o.heads, o.allow_missing_weights);
    const bool seq = sequence_first_layout(o, weights.file);
    if (verbose()) {
      if (!weights.missing.empty()) {
        print_error("module: taken as zero (--allow-missing-weights): " + joined(weights.missing));
      }
      print_error(std::string("module: inputs and output are ") +
                  (seq ? "[L, B, E] (sequence-first)" : "[B, L, E] (batch-first)") +
                  (weights.file.batch_first ? ", from config.json's batch_first" : ""));
    }
    ModuleHandle module;
    if (mha_status s = mha_module_create(&weights.config, &module.m); s != MHA_OK) {
      library_error("--weights " + o.weights_dir + ": mha_module_create", s);
    }
    for (auto& [key, array] : weights.arrays) {
      const mha_tensor t = describe(array, MHA_DTYPE_F32);
      if (mha_status s = mha_module_set_weight(module.m, key.c_str(), &t); s != MHA_OK) {
        library_error("--weights " + o.weights_dir + ": " + key + ".npy: mha_module_set_weight", s);
      }
    }

    NpyArray query = load_sequence("--query", o.query, "the query", seq);
    std::optional<NpyArray> key, value;
    if (!o.key.empty()) key = load_sequence("--key", o.key, "the key", seq);
    if (!o.value.empty()) value = load_sequence("--value", o.value, "the value", seq);
    const mha_tensor q = describe(query, MHA_DTYPE_F32, seq);
    const mha_tensor k = key ? describe(*key, MHA_DTYPE_F32, seq) : q;
    const mha_tensor v = value ? describe(*value, MHA_DTYPE_F32, seq) : k;
    const int64_t batch = q.shape[0], lq = q.shape[1], lk = k.shape[1];
    const int64_t e = weights.config.embed_dim, heads = weights.config.num_heads;

    mha_module_forward_params p;
    mha_module_forward_params_init(&p);
    std::optional<NpyArray> valid_lens, kpm, am;
    mha_tensor vl_t{}, kpm_t{}, am_t{};
    if (!o.valid_lens.empty()) {
      valid_lens = read_input("--valid-lens", o.valid_lens);
      if (valid_lens->dtype() != NpyDtype::I32 && valid_lens->dtype() != NpyDtype::I64) {
        throw ToolError("--valid-lens " + o.valid_lens +
                        ": valid lengths must be int32 (<i4) or int64 (<i8); the file holds " +
                        valid_lens->describe());
      }
      if (valid_lens->rank() < 1 || valid_lens->rank() > 2) {
        throw ToolError("--valid-lens " + o.valid_lens +
                        ": valid lengths are [B] or [B,Lq]; the file holds " +
                        valid_lens->describe());
      }
      vl_t = describe(*valid_lens,
                      valid_lens->dtype() == NpyDtype::I64 ? MHA_DTYPE_I64 : MHA_DTYPE_I32);
      p.valid_lens = &vl_t;
    }
    if (!o.key_padding_mask.empty()) {
      kpm = load_mask("--key-padding-mask", o.key_padding_mask, 2, 2, "[B,Lk]");
      kpm_t = describe(*kpm, mask_dtype(*kpm));
      p.key_padding_mask = &kpm_t;
    }
    if (!o.attn_mask.empty()) {
      am = load_mask("--attn-mask", o.attn_mask, 2, 3, "[Lq,Lk] or [B*H,Lq,Lk]");
      am_t = describe(*am, mask_dtype(*am));
      p.attn_mask = &am_t;
    }
    p.causal = causal_mode(o.causal);
    if (!o.window.empty()) {
      const WindowEdges edges = parse_window(o.window);
      p.window_left = edges.left;
      p.window_right = edges.right;
    }
    if (o.softcap) p.softcap = static_cast<float>(*o.softcap);
    std::optional<NpyArray> sinks, slopes;
    mha_tensor sinks_t{}, slopes_t{};
    if (!o.sinks.empty()) {
      sinks = load_float_vector("--sinks", o.sinks, 1, "[H]");
      sinks_t = describe(*sinks, MHA_DTYPE_F32);
      p.sinks = &sinks_t;
    }
    if (!o.alibi.empty()) {
      slopes = load_float_vector("--alibi", o.alibi, 2, "[H] or [B,H]");
      slopes_t = describe(*slopes, MHA_DTYPE_F32);
      p.alibi_slopes = &slopes_t;
    }

    NpyArray out_array(NpyDtype::F32, seq ? std::vector<int64_t>{lq, batch, e}
                                          : std::vector<int64_t>{batch, lq, e});
    mha_tensor out = describe(out_array, MHA_DTYPE_F32, seq);
    NpyArray weights_array;
    mha_tensor weights_t{};
    if (!o.need_weights.empty()) {
      weights_array =
          NpyArray(NpyDtype::F32, o.average_weights ? std::vector<int64_t>{batch, lq, lk}
                                                    : std::vector<int64_t>{batch, heads, lq, lk});
      weights_t = describe(weights_array, MHA_DTYPE_F32);
      p.attn_weights = &weights_t;
      p.average_attn_weights = o.average_weights ? 1 : 0;
    }

    const auto call = [&] {
      if (mha_status s = mha_module_forward(module.m, &q, &k, &v, &out, &p); s != MHA_OK) {
        library_error("mha_module_forward", s);
      }
    };
    call();
    std::vector<const NpyArray*> arrays;  // in the order of output_names
    if (!o.need_weights.empty()) arrays.push_back(&weights_array);
    if (!o.out.empty()) arrays.push_back(&out_array);
    outputs.commit(arrays);
    if (o.repeat > 0) {
      std::vector<double> ms;
      for (int r = 0; r < o.repeat; ++r) {
        const auto start = std::chrono::steady_clock::now();
        call();
        ms.push_back(
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                .count());
      }
      std::vector<double> sorted = ms;
      std::sort(sorted.begin(), sorted.end());
      const size_t n = sorted.size();
      Timing timing;
      timing.median_ms = n % 2 == 1 ? sorted[n / 2] : 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]);
      timing.min_ms = sorted.front();
      const double d = static_cast<double>(e) / static_cast<double>(heads);
      const double projections =
          2.0 * static_cast<double>(e) *
          static_cast<double>(batch * lq * (weights.config.query_dim + e) +
                              batch * lk * (weights.config.key_dim + weights.config.value_dim));
      const double attention = 4.0 * d * count_pairs(p, batch, heads, lq, lk);
      print_stdout_line(timing_json(timing, projections + attention));
    }
    return kExitOk;
  });
}

}  // namespace mha_tools
