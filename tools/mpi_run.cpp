#include "mpi_run.h"

#include "tool_util.h"

#ifndef MHA_TOOLS_HAVE_MPI

namespace mha_tools {

bool mpi_available() {
  return false;
}

int run_mpi_attention_command(const AttentionOptions&) {
  print_error(
      "--mpi-ring and --mpi-decode need libmha-mpi, and this mha-run was built without MPI "
      "(install OpenMPI -- scripts/install-deps.sh mpi -- and configure with "
      "-DMHA_BUILD_MPI=ON)");
  return kExitUsage;
}

}  // namespace mha_tools

#else

#include <mha/mha_mpi.h>
#include <mpi.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/dtype.h"
#include "input_files.h"

namespace mha_tools {
namespace {

constexpr int kTag = 77;
constexpr int64_t kMaxMessage = int64_t{1} << 30;  // MPI counts are int

// What rank 0 tells every rank before the data: whether reading the files
// worked, and the sizes and dtypes of what follows.
struct Header {
  int64_t status = kExitOk;
  int64_t batch = 0, heads = 0, kv_heads = 0, lq = 0, lk = 0, d = 0, dv = 0;
  int64_t q_dtype = MHA_DTYPE_F32, kv_dtype = MHA_DTYPE_F32;
  int64_t valid_kind = 0;  // 0 none, 1 [B], 2 [B, Lq]
  int64_t sinks = 0;       // elements of --sinks (H) or 0
  int64_t alibi_kind = 0;  // 0 none, 1 [H], 2 [B, H]
  int64_t lse = 0;         // --lse wanted
};

// The runs of positions a rank holds, and their total.
struct Runs {
  std::vector<int64_t> starts, lengths;
  int64_t total = 0;
};

Runs runs_of(int32_t layout, int64_t length, int rank, int ranks) {
  int64_t starts[2] = {0, 0}, lengths[2] = {0, 0};
  const int32_t n = mha_mpi_shard_rows(layout, length, rank, ranks, starts, lengths);
  if (n < 0)
    throw ToolError("mha_mpi_shard_rows refused the sequence of " + std::to_string(length));
  Runs runs;
  for (int32_t i = 0; i < n; ++i) {
    runs.starts.push_back(starts[i]);
    runs.lengths.push_back(lengths[i]);
    runs.total += lengths[i];
  }
  return runs;
}

int64_t bytes_of(int32_t dtype) {
  return dtype == MHA_DTYPE_I8 ? 1 : mha_types::float_bytes(dtype);
}

// Rows `runs` (dimension 2) of a 3-D or 4-D descriptor, stacked in C order.
std::vector<char> pack_rows(const mha_tensor& t, const Runs& runs) {
  const int64_t bytes = bytes_of(t.dtype);
  const int64_t width = t.ndim == 4 ? t.shape[3] : 1, step = t.ndim == 4 ? t.strides[3] : 0;
  std::vector<char> packed(
      static_cast<size_t>(t.shape[0] * t.shape[1] * runs.total * width * bytes));
  char* at = packed.data();
  for (int64_t a = 0; a < t.shape[0]; ++a) {
    for (int64_t h = 0; h < t.shape[1]; ++h) {
      for (size_t r = 0; r < runs.starts.size(); ++r) {
        for (int64_t i = runs.starts[r]; i < runs.starts[r] + runs.lengths[r]; ++i) {
          const char* row = static_cast<const char*>(t.data) +
                            (a * t.strides[0] + h * t.strides[1] + i * t.strides[2]) * bytes;
          for (int64_t c = 0; c < width; ++c, at += bytes) {
            std::memcpy(at, row + c * step * bytes, static_cast<size_t>(bytes));
          }
        }
      }
    }
  }
  return packed;
}

// The inverse for rank 0's outputs: F32 rows stacked in C order ([B, H,
// rows(, W)]) into rows `runs` of a 3-D or 4-D F32 descriptor.
void unpack_rows(const float* packed, const Runs& runs, const mha_tensor& t) {
  const int64_t width = t.ndim == 4 ? t.shape[3] : 1, step = t.ndim == 4 ? t.strides[3] : 0;
  for (int64_t a = 0; a < t.shape[0]; ++a) {
    for (int64_t h = 0; h < t.shape[1]; ++h) {
      for (size_t r = 0; r < runs.starts.size(); ++r) {
        for (int64_t i = runs.starts[r]; i < runs.starts[r] + runs.lengths[r]; ++i) {
          float* row =
              static_cast<float*>(t.data) + a * t.strides[0] + h * t.strides[1] + i * t.strides[2];
          for (int64_t c = 0; c < width; ++c) row[c * step] = *packed++;
        }
      }
    }
  }
}

void send_bytes(const void* data, int64_t bytes, int to) {
  for (int64_t at = 0; at < bytes; at += kMaxMessage) {
    MPI_Send(static_cast<const char*>(data) + at,
             static_cast<int>(std::min(kMaxMessage, bytes - at)), MPI_BYTE, to, kTag,
             MPI_COMM_WORLD);
  }
}

void receive_bytes(void* data, int64_t bytes, int from) {
  for (int64_t at = 0; at < bytes; at += kMaxMessage) {
    MPI_Recv(static_cast<char*>(data) + at, static_cast<int>(std::min(kMaxMessage, bytes - at)),
             MPI_BYTE, from, kTag, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  }
}

void broadcast_bytes(void* data, int64_t bytes) {
  for (int64_t at = 0; at < bytes; at += kMaxMessage) {
    MPI_Bcast(static_cast<char*>(data) + at, static_cast<int>(std::min(kMaxMessage, bytes - at)),
              MPI_BYTE, 0, MPI_COMM_WORLD);
  }
}

// A C-order descriptor over `data`.  A rank's shard may hold no rows (fewer
// positions than chunks, fewer keys than ranks): the MPI calls take extents of
// 0, which mha_tensor_init (the single-process API's rule) refuses, so such a
// descriptor is written here, over a byte that is never read.
mha_tensor dense(void* data, int32_t dtype, std::vector<int64_t> shape) {
  mha_tensor t{};
  if (std::find(shape.begin(), shape.end(), 0) != shape.end()) {
    static unsigned char nothing = 0;
    t.data = &nothing;
    t.dtype = static_cast<mha_dtype>(dtype);
    t.ndim = static_cast<int32_t>(shape.size());
    int64_t stride = 1;
    for (int32_t d = t.ndim - 1; d >= 0; --d) {
      t.shape[d] = shape[static_cast<size_t>(d)];
      t.strides[d] = stride;
      stride *= std::max<int64_t>(t.shape[d], 1);
    }
    return t;
  }
  if (mha_tensor_init(&t, data, static_cast<mha_dtype>(dtype), static_cast<int32_t>(shape.size()),
                      shape.data(), nullptr) != MHA_OK) {
    throw ToolError(std::string("a shard's descriptor: ") + mha_last_error());
  }
  return t;
}

// The largest of every rank's value.
int64_t max_over_ranks(int64_t mine) {
  int64_t all = 0;
  MPI_Allreduce(&mine, &all, 1, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
  return all;
}

// The flags the ranks' shards cannot take, refused before anything is read.
void check_mpi_options(const AttentionOptions& o) {
  if (o.mpi_ring && o.mpi_decode) {
    throw UsageError(
        "--mpi-ring and --mpi-decode exclude each other: the ring shards the "
        "queries and the keys, decode only the KV cache");
  }
  const struct {
    const char* flag;
    const std::string& value;
    const char* why;
  } refused[] = {
      {"--mask", o.mask,
       "explicit masks are not taken across ranks (use --causal, "
       "--valid-lens or --window)"},
      {"--cu-seqlens-q", o.cu_seqlens_q, "packed batches are single-process calls"},
      {"--cu-seqlens-k", o.cu_seqlens_k, "packed batches are single-process calls"},
      {"--block-table", o.block_table, "paged caches are single-process calls"},
  };
  for (const auto& r : refused) {
    if (!r.value.empty()) {
      throw UsageError(std::string(r.flag) + " cannot be combined with " +
                       (o.mpi_ring ? "--mpi-ring" : "--mpi-decode") + ": " + r.why);
    }
  }
  if (!o.mpi_layout.empty() && o.mpi_layout != "zigzag" && o.mpi_layout != "contiguous") {
    throw UsageError("--mpi-layout " + o.mpi_layout + ": it must be zigzag or contiguous");
  }
}

// One rank's part of the call: its tensors, the params, and what it returns.
struct Shard {
  std::vector<char> q, k, v, k_scale, v_scale;
  std::vector<int64_t> valid;
  std::vector<float> sinks, alibi, out, lse;
  mha_tensor tq{}, tk{}, tv{}, tout{}, tlse{}, tks{}, tvs{}, tvalid{}, tsinks{}, talibi{};
  int64_t rows = 0;  // query rows (ring: this rank's; decode: all)
};

class MpiRun {
 public:
  MpiRun(const AttentionOptions& o, int rank, int ranks)
      : o_(o), rank_(rank), ranks_(ranks), ring_(o.mpi_ring) {
    layout_ = ring_ && o.mpi_layout != "contiguous" ? MHA_MPI_ZIGZAG : MHA_MPI_CONTIGUOUS;
  }

  // Rank 0: the files read and checked; everyone: the header.  Returns the
  // exit status every rank takes.
  int start() {
    int64_t local = kExitOk;
    try {
      check_attention_options(o_);
      check_mpi_options(o_);
      configure_runtime(o_.backend, o_.threads);
      if (rank_ == 0) read_files();
    } catch (const UsageError& e) {
      if (rank_ == 0) print_error(e.what());  // the same command line on every rank
      local = e.exit_status();
    } catch (const ToolError& e) {
      print_error(e.what());
      local = e.exit_status();
    } catch (const std::exception& e) {
      print_error(e.what());
      local = kExitFailure;
    }
    if (rank_ == 0) header_.status = local;
    MPI_Bcast(&header_, sizeof header_, MPI_BYTE, 0, MPI_COMM_WORLD);
    return static_cast<int>(max_over_ranks(std::max<int64_t>(local, header_.status)));
  }

  // Every rank's shard from rank 0, the call, and the result back on rank 0.
  int run() {
    try {
      distribute();
    } catch (const std::exception& e) {
      // A rank that cannot hold its shard: the others wait in collectives
      // that will never complete.
      print_error(std::string("sending the shards: ") + e.what());
      MPI_Abort(MPI_COMM_WORLD, kExitFailure);
    }
    const mha_status status = call();
    if (status != MHA_OK) {
      if (rank_ == 0) {
        print_error(std::string(ring_ ? "mha_attention_mpi_ring" : "mha_attention_mpi_decode") +
                    " failed (" + mha_status_name(status) + "): " + mha_mpi_last_error());
      }
      return kExitFailure;
    }
    gather();
    int64_t local = kExitOk;
    if (rank_ == 0) {
      try {
        write_attention_outputs(call_, o_, *outputs_);
      } catch (const std::exception& e) {
        print_error(e.what());
        local = kExitFailure;
      }
    }
    if (const int agreed = static_cast<int>(max_over_ranks(local)); agreed != kExitOk)
      return agreed;
    return o_.repeat > 0 ? time_calls_over_ranks() : kExitOk;
  }

 private:
  void read_files() {
    outputs_.emplace(attention_outputs(o_), attention_inputs(o_));
    inputs_ = load_attention_inputs(o_);
    call_ = prepare_attention_call(*inputs_, o_);
    // (prepare_attention_call describes rank-3 files as one batch: every
    // tensor here is 4-D, the scales and the LSE 3-D.)
    header_.batch = call_.q.shape[0];
    header_.heads = call_.q.shape[1];
    header_.kv_heads = call_.k.shape[1];
    header_.lq = call_.q.shape[2];
    header_.lk = call_.k.shape[2];
    header_.d = call_.q.shape[3];
    header_.dv = call_.v.shape[3];
    header_.q_dtype = call_.q.dtype;
    header_.kv_dtype = call_.k.dtype;
    header_.lse = call_.lse ? 1 : 0;
    if (call_.valid_lens) header_.valid_kind = call_.valid_lens->ndim;
    if (call_.sinks) header_.sinks = call_.sinks->shape[0];
    if (call_.alibi) header_.alibi_kind = call_.alibi->ndim;
    // The small arrays are copied whole into every rank's call by these shapes
    // (distribute): checked here, as the library checks them in one process.
    const auto check_shape =
        [&](const std::optional<mha_tensor>& t, const char* flag, const std::string& path,
            const std::vector<std::pair<const char*, std::vector<int64_t> > >& allowed) {
          if (!t) return;
          const std::vector<int64_t> shape(t->shape, t->shape + t->ndim);
          std::string wanted;
          for (const auto& [name, want] : allowed) {
            if (shape == want) return;
            wanted += std::string(wanted.empty() ? "" : " or ") + name + " = " + bracketed(want);
          }
          throw ToolError(std::string(flag) + " " + path + ": shape " + bracketed(shape) +
                          "; it must be " + wanted);
        };
    const Header& h = header_;
    // distribute() cuts K and V by Q's batch and head size and K's length,
    // so they must agree before it: the shards would hide a mismatch from the
    // library's checks, or not be there to send.  The messages are the
    // library's in one process, with the files named.
    const std::string q_file = "q (" + input_label("--q", o_.q) + ")",
                      k_file = "k (" + input_label("--k", o_.k) + ")",
                      v_file = "v (" + input_label("--v", o_.v) + ")";
    const struct {
      const char* what;
      const std::string& a;
      int64_t a_has;
      const std::string& b;
      int64_t b_has;
    } agreements[] = {
        {"batch", q_file, h.batch, k_file, call_.k.shape[0]},
        {"batch", q_file, h.batch, v_file, call_.v.shape[0]},
        {"KV heads", k_file, h.kv_heads, v_file, call_.v.shape[1]},
        {"key length", k_file, h.lk, v_file, call_.v.shape[2]},
        {"head size", q_file, h.d, k_file, call_.k.shape[3]},
    };
    for (const auto& a : agreements) {
      if (a.a_has == a.b_has) continue;
      throw ToolError(std::string(a.what) + ": " + a.a + " has " + std::to_string(a.a_has) +
                      " but " + a.b + " has " + std::to_string(a.b_has));
    }
    check_shape(call_.valid_lens, "--valid-lens", o_.valid_lens,
                {{"[B]", {h.batch}}, {"[B, Lq]", {h.batch, h.lq}}});
    check_shape(call_.alibi, "--alibi", o_.alibi,
                {{"[H]", {h.heads}}, {"[B, H]", {h.batch, h.heads}}});
    check_shape(call_.sinks, "--sinks", o_.sinks, {{"[H]", {h.heads}}});
    read_valid_lens();
  }

  // Rank 0: the valid lengths as int64 ([B], or [B, Lq] whose rows follow the
  // queries), checked against the whole key count here, where a bad one can be
  // named by its index in the file (each rank's call sees only its own rows).
  void read_valid_lens() {
    if (!call_.valid_lens) return;
    const Header& h = header_;
    const mha_tensor& vl = *call_.valid_lens;
    const int64_t rows = h.valid_kind == 2 ? h.lq : 1;
    valid_.resize(static_cast<size_t>(h.batch * rows));
    for (int64_t b = 0; b < h.batch; ++b) {
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t at = b * vl.strides[0] + (h.valid_kind == 2 ? i * vl.strides[1] : 0);
        const int64_t n = vl.dtype == MHA_DTYPE_I64 ? static_cast<const int64_t*>(vl.data)[at]
                                                    : static_cast<const int32_t*>(vl.data)[at];
        if (n < 0 || n > h.lk) {
          const std::vector<int64_t> index =
              h.valid_kind == 2 ? std::vector<int64_t>{b, i} : std::vector<int64_t>{b};
          throw ToolError("--valid-lens " + o_.valid_lens + ": the value at " + bracketed(index) +
                          " is " + std::to_string(n) +
                          ", outside [0, Lk = " + std::to_string(h.lk) + "]");
        }
        valid_[static_cast<size_t>(b * rows + i)] = n;
      }
    }
  }

  // Rank 0 sends each rank its rows; the small arrays go to everyone.
  void distribute() {
    const Header& h = header_;
    const int32_t qd = static_cast<int32_t>(h.q_dtype), kd = static_cast<int32_t>(h.kv_dtype);
    const bool int8 = kd == MHA_DTYPE_I8;
    const Runs q_runs = ring_ ? runs_of(layout_, h.lq, rank_, ranks_) : Runs{{0}, {h.lq}, h.lq};
    const Runs k_runs = runs_of(layout_, h.lk, rank_, ranks_);
    shard_.rows = q_runs.total;
    const int64_t q_bytes = h.batch * h.heads * q_runs.total * h.d * bytes_of(qd);
    const int64_t k_bytes = h.batch * h.kv_heads * k_runs.total * h.d * bytes_of(kd);
    const int64_t v_bytes = h.batch * h.kv_heads * k_runs.total * h.dv * bytes_of(kd);
    const int64_t s_bytes = int8 ? h.batch * h.kv_heads * k_runs.total * 4 : 0;
    if (rank_ == 0) {
      for (int r = ranks_ - 1; r >= 0; --r) {  // rank 0's own last: it keeps them
        const Runs qr = ring_ ? runs_of(layout_, h.lq, r, ranks_) : Runs{{0}, {h.lq}, h.lq};
        const Runs kr = runs_of(layout_, h.lk, r, ranks_);
        std::vector<char> parts[5] = {ring_ ? pack_rows(call_.q, qr) : std::vector<char>{},
                                      pack_rows(call_.k, kr), pack_rows(call_.v, kr),
                                      int8 ? pack_rows(*call_.k_scale, kr) : std::vector<char>{},
                                      int8 ? pack_rows(*call_.v_scale, kr) : std::vector<char>{}};
        if (r == 0) {
          shard_.q = std::move(parts[0]);
          shard_.k = std::move(parts[1]);
          shard_.v = std::move(parts[2]);
          shard_.k_scale = std::move(parts[3]);
          shard_.v_scale = std::move(parts[4]);
        } else {
          for (const auto& p : parts) send_bytes(p.data(), static_cast<int64_t>(p.size()), r);
        }
      }
      if (!ring_) shard_.q = pack_rows(call_.q, q_runs);
    } else {
      shard_.q.resize(static_cast<size_t>(ring_ ? q_bytes : 0));
      shard_.k.resize(static_cast<size_t>(k_bytes));
      shard_.v.resize(static_cast<size_t>(v_bytes));
      shard_.k_scale.resize(static_cast<size_t>(s_bytes));
      shard_.v_scale.resize(static_cast<size_t>(s_bytes));
      for (auto* p : {&shard_.q, &shard_.k, &shard_.v, &shard_.k_scale, &shard_.v_scale}) {
        receive_bytes(p->data(), static_cast<int64_t>(p->size()), 0);
      }
      if (!ring_) shard_.q.resize(static_cast<size_t>(q_bytes));
    }
    if (!ring_) broadcast_bytes(shard_.q.data(), q_bytes);  // decode: the queries everywhere

    // Valid lengths (as int64: [B], or [B, Lq] whose rows follow the
    // queries), the sinks and the ALiBi slopes: everyone gets them whole.
    if (h.valid_kind != 0) {
      valid_.resize(static_cast<size_t>(h.batch * (h.valid_kind == 2 ? h.lq : 1)));
      broadcast_bytes(valid_.data(), static_cast<int64_t>(valid_.size() * sizeof(int64_t)));
      if (h.valid_kind == 1) {
        shard_.valid = valid_;
      } else {
        for (int64_t b = 0; b < h.batch; ++b) {
          for (size_t r = 0; r < q_runs.starts.size(); ++r) {
            for (int64_t i = q_runs.starts[r]; i < q_runs.starts[r] + q_runs.lengths[r]; ++i) {
              shard_.valid.push_back(valid_[static_cast<size_t>(b * h.lq + i)]);
            }
          }
        }
      }
    }
    const auto small = [this](std::vector<float>& dst, int64_t n,
                              const std::optional<mha_tensor>& src) {
      dst.resize(static_cast<size_t>(n));
      if (rank_ == 0 && n > 0) {
        const mha_tensor& t = *src;
        for (int64_t x = 0; x < n; ++x) {
          const int64_t row = t.ndim == 2 ? x / t.shape[1] : 0,
                        col = t.ndim == 2 ? x % t.shape[1] : x;
          dst[static_cast<size_t>(x)] = static_cast<const float*>(
              t.data)[(t.ndim == 2 ? row * t.strides[0] : 0) + col * t.strides[t.ndim - 1]];
        }
      }
      broadcast_bytes(dst.data(), n * 4);
    };
    small(shard_.sinks, h.sinks, call_.sinks);
    small(shard_.alibi, h.alibi_kind == 0 ? 0 : (h.alibi_kind == 2 ? h.batch : 1) * h.heads,
          call_.alibi);

    // The descriptors.
    Shard& s = shard_;
    s.tq = dense(s.q.data(), qd, {h.batch, h.heads, s.rows, h.d});
    s.tk = dense(s.k.data(), kd, {h.batch, h.kv_heads, k_runs.total, h.d});
    s.tv = dense(s.v.data(), kd, {h.batch, h.kv_heads, k_runs.total, h.dv});
    if (int8) {
      s.tks = dense(s.k_scale.data(), MHA_DTYPE_F32, {h.batch, h.kv_heads, k_runs.total});
      s.tvs = dense(s.v_scale.data(), MHA_DTYPE_F32, {h.batch, h.kv_heads, k_runs.total});
    }
    s.out.resize(static_cast<size_t>(h.batch * h.heads * s.rows * h.dv));
    s.tout = dense(s.out.data(), MHA_DTYPE_F32, {h.batch, h.heads, s.rows, h.dv});
    if (h.lse != 0) {
      s.lse.resize(static_cast<size_t>(h.batch * h.heads * s.rows));
      s.tlse = dense(s.lse.data(), MHA_DTYPE_F32, {h.batch, h.heads, s.rows});
    }
    if (h.valid_kind == 1) s.tvalid = dense(s.valid.data(), MHA_DTYPE_I64, {h.batch});
    if (h.valid_kind == 2) s.tvalid = dense(s.valid.data(), MHA_DTYPE_I64, {h.batch, s.rows});
    if (h.sinks > 0) s.tsinks = dense(s.sinks.data(), MHA_DTYPE_F32, {h.sinks});
    if (h.alibi_kind == 1) s.talibi = dense(s.alibi.data(), MHA_DTYPE_F32, {h.heads});
    if (h.alibi_kind == 2) s.talibi = dense(s.alibi.data(), MHA_DTYPE_F32, {h.batch, h.heads});
    q_runs_ = q_runs;
  }

  mha_status call() {
    const Header& h = header_;
    Shard& s = shard_;
    mha_attention_params p;
    mha_attention_params_init(&p);
    p.causal = causal_mode(o_.causal);
    if (!o_.window.empty()) {
      const WindowEdges edges = parse_window(o_.window);
      p.window_left = edges.left;
      p.window_right = edges.right;
    }
    if (o_.scale) {
      p.has_scale = 1;
      p.scale = static_cast<float>(*o_.scale);
    }
    if (o_.softcap) p.softcap = static_cast<float>(*o_.softcap);
    if (h.lse != 0) p.lse = &s.tlse;
    if (h.valid_kind != 0) p.valid_lens = &s.tvalid;
    if (h.sinks > 0) p.sinks = &s.tsinks;
    if (h.alibi_kind != 0) p.alibi_slopes = &s.talibi;
    if (h.kv_dtype == MHA_DTYPE_I8) {
      p.k_scale = &s.tks;
      p.v_scale = &s.tvs;
    }
    mha_mpi_params m;
    mha_mpi_params_init(&m);
    m.layout = layout_;
    return ring_ ? mha_attention_mpi_ring(MPI_COMM_WORLD, &s.tq, &s.tk, &s.tv, &s.tout, &p, &m)
                 : mha_attention_mpi_decode(MPI_COMM_WORLD, &s.tq, &s.tk, &s.tv, &s.tout, &p, &m);
  }

  // The ranks' rows of the result into rank 0's arrays (decode: every rank
  // has it all; rank 0 takes its own).
  void gather() {
    const Header& h = header_;
    if (rank_ != 0) {
      if (!ring_) return;
      send_bytes(shard_.out.data(), static_cast<int64_t>(shard_.out.size() * sizeof(float)), 0);
      send_bytes(shard_.lse.data(), static_cast<int64_t>(shard_.lse.size() * sizeof(float)), 0);
      return;
    }
    for (int r = 0; r < (ring_ ? ranks_ : 1); ++r) {
      const Runs runs = ring_ ? runs_of(layout_, h.lq, r, ranks_) : q_runs_;
      std::vector<float> out, lse;
      if (r == 0) {
        out.swap(shard_.out);
        lse.swap(shard_.lse);
      } else {
        out.resize(static_cast<size_t>(h.batch * h.heads * runs.total * h.dv));
        lse.resize(static_cast<size_t>(h.lse != 0 ? h.batch * h.heads * runs.total : 0));
        receive_bytes(out.data(), static_cast<int64_t>(out.size() * sizeof(float)), r);
        receive_bytes(lse.data(), static_cast<int64_t>(lse.size() * sizeof(float)), r);
      }
      unpack_rows(out.data(), runs, call_.out);
      if (h.lse != 0) unpack_rows(lse.data(), runs, *call_.lse);
      if (r == 0) {
        out.swap(shard_.out);
        lse.swap(shard_.lse);
      }
    }
  }

  // --repeat N: N more calls, each timed on the slowest rank.
  int time_calls_over_ranks() {
    std::vector<double> ms;
    for (int r = 0; r < o_.repeat; ++r) {
      MPI_Barrier(MPI_COMM_WORLD);
      const double start = MPI_Wtime();
      if (call() != MHA_OK) {
        if (rank_ == 0) print_error(std::string("a timed call failed: ") + mha_mpi_last_error());
        return kExitFailure;
      }
      double mine = (MPI_Wtime() - start) * 1e3, slowest = 0;
      MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      ms.push_back(slowest);
    }
    if (rank_ != 0) return kExitOk;
    std::sort(ms.begin(), ms.end());
    const Timing timing{ms[ms.size() / 2], ms.front()};
    const Dtypes dtypes{static_cast<mha_dtype>(header_.q_dtype),
                        static_cast<mha_dtype>(header_.kv_dtype)};
    nlohmann::ordered_json line =
        nlohmann::ordered_json::parse(timing_json(timing, attention_flops(call_), dtypes));
    line["mpi"] = ring_ ? "ring" : "decode";
    line["ranks"] = ranks_;
    if (ring_) line["layout"] = layout_ == MHA_MPI_ZIGZAG ? "zigzag" : "contiguous";
    try {
      print_stdout_line(line.dump());
    } catch (const ToolError& e) {
      print_error(e.what());
      return e.exit_status();
    }
    return kExitOk;
  }

  const AttentionOptions& o_;
  int rank_, ranks_;
  bool ring_;
  int32_t layout_ = MHA_MPI_CONTIGUOUS;
  Header header_;
  std::optional<OutputFiles> outputs_;
  std::optional<AttentionInputs> inputs_;
  AttentionCall call_;
  Shard shard_;
  std::vector<int64_t> valid_;  // whole (every rank, once distributed)
  Runs q_runs_;
};

}  // namespace

bool mpi_available() {
  return true;
}

int run_mpi_attention_command(const AttentionOptions& options) {
  int initialised = 0;
  MPI_Initialized(&initialised);
  if (initialised == 0) MPI_Init(nullptr, nullptr);
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  int status = kExitFailure;
  {
    MpiRun run(options, rank, ranks);
    status = run.start();
    if (status == kExitOk) status = run.run();
  }
  if (initialised == 0) MPI_Finalize();
  return status;
}

}  // namespace mha_tools

#endif  // MHA_TOOLS_HAVE_MPI
