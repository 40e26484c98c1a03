#include "module_run.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <new>
#include <nlohmann/json.hpp>
#include <vector>

#include "attention_run.h"

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

[[noreturn]] void library_error(const std::string& what, mha_status status) {
  throw ToolError(what + " failed (" + mha_status_name(status) + "): " + mha_last_error());
}

NpyArray read_input(const char* flag, const std::string& path) {
  try {
    return read_npy(path);
  } catch (const NpyError& e) {
    throw ToolError(std::string(flag) + " " + e.what());
  }
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
  NpyArray a = read_input(flag, path);
  if (a.dtype() != NpyDtype::F32 || a.rank() != 3) {
    throw ToolError(std::string(flag) + " " + path + ": " + role +
                    " must be float32 (<f4) of rank 3, " +
                    (seq_first ? "[L, B, features] (--sequence-first)" : "[B, L, features]") +
                    "; the file holds " + a.describe());
  }
  return a;
}

NpyArray load_mask(const char* flag, const std::string& path, int min_rank, int max_rank,
                   const char* shapes) {
  NpyArray a = read_input(flag, path);
  if (a.dtype() != NpyDtype::Bool && a.dtype() != NpyDtype::U8 && a.dtype() != NpyDtype::F32) {
    throw ToolError(std::string(flag) + " " + path +
                    ": the mask must be bool (|b1, or |u1; true = not allowed) or float32 (<f4, "
                    "added to the scores); the file holds " +
                    a.describe());
  }
  if (a.rank() < min_rank || a.rank() > max_rank) {
    throw ToolError(std::string(flag) + " " + path + ": the mask must be " + shapes +
                    "; the file holds " + a.describe());
  }
  return a;
}

int64_t heads_from_config(const fs::path& dir) {
  const fs::path file = dir / "config.json";
  std::ifstream in(file);
  if (!in) {
    throw ToolError(
        "the number of heads is not stored in the weights: give --heads N (or put "
        "{\"num_heads\": N} in " +
        file.string() + ")");
  }
  nlohmann::json j;
  try {
    in >> j;
  } catch (const std::exception& e) {
    throw ToolError(file.string() + ": not valid JSON: " + e.what());
  }
  if (!j.is_object() || !j.contains("num_heads") || !j["num_heads"].is_number_integer()) {
    throw ToolError(file.string() + ": no integer \"num_heads\"; give --heads N");
  }
  return j["num_heads"].get<int64_t>();
}

// Pairs (b, h, i, j) that take part, as the module masks them.
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
        int64_t end = lk;
        if (p.causal == MHA_CAUSAL_TOP_LEFT) end = std::min(end, i + 1);
        if (const mha_tensor* vl = p.valid_lens; vl != nullptr) {
          const int64_t at = b * vl->strides[0] + (vl->ndim == 2 ? i * vl->strides[1] : 0);
          end =
              std::min(end, vl->dtype == MHA_DTYPE_I64 ? static_cast<const int64_t*>(vl->data)[at]
                                                       : static_cast<const int32_t*>(vl->data)[at]);
        }
        for (int64_t j = 0; j < end; ++j) {
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
  app.add_option("--weights", o.weights_dir,
                 "directory of .npy weights named as the state_dict keys (in_proj_weight.npy, "
                 "out_proj.weight.npy, ...; tools/export_torch_weights.py writes them)");
  app.add_option("--query", o.query,
                 "queries: float32 [B,Lq,Eq] .npy ([Lq,B,Eq] with --sequence-first)");
  app.add_option("--key", o.key, "keys: float32 [B,Lk,Ek] .npy (default: the queries)");
  app.add_option("--value", o.value, "values: float32 [B,Lk,Ev] .npy (default: the keys)");
  app.add_option("--out", o.out,
                 "output: float32 [B,Lq,E] .npy to write ([Lq,B,E] with --sequence-first)");
  app.add_option_function<int64_t>(
      "--heads", [&o](const int64_t& n) { o.heads = n; },
      "number of heads (default: num_heads of DIR/config.json)");
  app.add_option("--valid-lens", o.valid_lens, "valid lengths .npy, int32 or int64, [B] or [B,Lq]");
  app.add_option("--key-padding-mask", o.key_padding_mask,
                 "key padding mask .npy [B,Lk]: bool (true = ignore the key) or float32 (added)");
  app.add_option(
      "--attn-mask", o.attn_mask,
      "attention mask .npy [Lq,Lk] or [B*H,Lq,Lk]: bool (true = not allowed) or float32 (added)");
  app.add_flag("--causal", o.causal, "causal mask: query i sees keys j <= i");
  app.add_option("--need-weights", o.need_weights,
                 "attention weights: float32 [B,H,Lq,Lk] .npy to write");
  app.add_flag("--average-weights", o.average_weights,
               "write the weights averaged over the heads, [B,Lq,Lk]");
  app.add_flag("--sequence-first", o.sequence_first,
               "inputs and output are [L,B,E] (PyTorch's batch_first=False)");
  app.add_option("--backend", o.backend, "backend to use (default: MHA_BACKEND, else auto)");
  app.add_option_function<int>(
      "--threads", [&o](const int& n) { o.threads = n; }, "threads inside one call");
  app.add_option("--repeat", o.repeat,
                 "time N calls after the first and print one JSON line with the median")
      ->check(CLI::Range(1, 1000000000));
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
    throw ToolError("module: missing " + missing + " (see mha-run module --help)");
  if (o.average_weights && o.need_weights.empty()) {
    throw ToolError("module: --average-weights needs --need-weights W.npy");
  }
  if (o.heads && *o.heads <= 0) {
    throw ToolError("module: --heads " + std::to_string(*o.heads) + ": it must be positive");
  }
}

// ---------------------------------------------------------------- weights

ModuleWeightFiles load_module_weights(const std::string& dir, std::optional<int64_t> heads) {
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
    NpyArray a = read_input("--weights", path.string());
    if (a.dtype() != NpyDtype::F32) {
      throw ToolError(path.string() + ": weights must be float32 (<f4); the file holds " +
                      a.describe());
    }
    if (a.rank() != (is_bias_key(key) ? 1 : 2)) {
      throw ToolError(path.string() + ": " + key + " must have rank " +
                      (is_bias_key(key) ? "1" : "2") + "; the file holds " + a.describe());
    }
    files.arrays.emplace(key, std::move(a));
  }
  if (ec) throw ToolError("--weights " + dir + ": " + ec.message());

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
  c.num_heads = heads ? *heads : heads_from_config(root);
  c.query_dim = input_dim("q_proj_weight", "W_q.weight");
  c.key_dim = input_dim("k_proj_weight", "W_k.weight");
  c.value_dim = input_dim("v_proj_weight", "W_v.weight");
  c.bias = 0;
  for (const auto& [key, array] : files.arrays) {
    if (is_bias_key(key)) c.bias = 1;
  }
  return files;
}

// ---------------------------------------------------------------- the command

int run_module_command(const ModuleOptions& o) {
  try {
    check_module_options(o);
    configure_runtime(o.backend, o.threads);
    ModuleWeightFiles weights = load_module_weights(o.weights_dir, o.heads);
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

    const bool seq = o.sequence_first;
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
    if (o.causal) p.causal = MHA_CAUSAL_TOP_LEFT;

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
    try {
      if (!o.out.empty()) write_npy(o.out, out_array);
      if (!o.need_weights.empty()) write_npy(o.need_weights, weights_array);
    } catch (const NpyError& err) {
      throw ToolError(err.what());
    }
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
      std::printf("%s\n", timing_json(timing, projections + attention).c_str());
    }
    return 0;
  } catch (const ToolError& e) {
    std::fprintf(stderr, "mha-run: %s\n", e.what());
  } catch (const NpyError& e) {
    std::fprintf(stderr, "mha-run: %s\n", e.what());
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "mha-run: out of memory\n");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mha-run: %s\n", e.what());
  }
  return 1;
}

}  // namespace mha_tools
