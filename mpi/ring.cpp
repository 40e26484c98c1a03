// mha_attention_mpi_ring: ring attention.  Each rank keeps its queries and
// passes K/V shards around the ring; at step s it holds the shard of rank
// (r - s) mod N, receiving the next one while its kernel computes on this
// one, and merges each block's partial result into its queries' running
// result by their LSE.
#include <mha/mha_mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <limits>
#include <memory>
#include <new>
#include <vector>

#include "agreement.h"
#include "blocks.h"
#include "checks.h"
#include "common/dtype.h"
#include "error.h"
#include "layout.h"

namespace mha::mpi {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// K's messages take tags from kKTag, V's from kVTag (one per piece).
constexpr int kKTag = 1000, kVTag = 3000;
constexpr int64_t kMaxMessage = int64_t{1} << 30;  // MPI counts are int

// Posts a non-blocking send or receive of `bytes` bytes, cut into messages
// of at most kMaxMessage (consecutive tags from `tag`).
void post(bool send, const char* data, int64_t bytes, int peer, int tag, MPI_Comm comm,
          std::vector<MPI_Request>* requests) {
  int part = 0;
  for (int64_t at = 0; at < bytes; at += kMaxMessage, ++part) {
    const int count = static_cast<int>(std::min(kMaxMessage, bytes - at));
    // (Waited for by the caller, through `requests`.)
    MPI_Request* request = &requests->emplace_back(MPI_REQUEST_NULL);
    if (send) {
      MPI_Isend(data + at, count, MPI_BYTE, peer, tag + part, comm, request);
    } else {
      MPI_Irecv(const_cast<char*>(data) + at, count, MPI_BYTE, peer, tag + part, comm, request);
    }
  }
}

// Whether a 4-D tensor's elements are one C-order run (then it can be sent
// as it is, without packing).
bool is_dense(const mha_tensor& t) {
  int64_t expected = 1;
  for (int d = 3; d >= 0; --d) {
    if (t.shape[d] != 1 && t.strides[d] != expected) return false;
    expected *= t.shape[d];
  }
  return true;
}

// Lets MPI move the messages in flight (shared-memory and TCP transports
// progress only inside MPI calls).
// `requests` ends empty once they are all complete.
void progress(std::vector<MPI_Request>* requests) {
  if (requests->empty()) return;
  int done = 0;
  MPI_Testall(static_cast<int>(requests->size()), requests->data(), &done, MPI_STATUSES_IGNORE);
  if (done != 0) requests->clear();
}

// One rank's part of a ring call.
class Ring {
 public:
  Ring(MPI_Comm comm, int rank, int ranks, const std::vector<Shard>& shards,
       const mha_attention_params& params, int32_t layout, const mha_tensor& q, const mha_tensor& k,
       const mha_tensor& v, const mha_tensor& out, const mha_tensor* lse)
      : comm_(comm), rank_(rank), ranks_(ranks), shards_(shards), params_(params), q_(q) {
    std::vector<int64_t> lq, lk;
    for (const Shard& s : shards) {
      lq.push_back(s.lq);
      lk.push_back(s.lk);
      full_lq_ += s.lq;
      full_lk_ += s.lk;
    }
    for (int r = 0; r < ranks; ++r) k_segments_.push_back(coalesce(segments_of(layout, r, lk)));
    q_segments_ = coalesce(segments_of(layout, rank, lq));
    vis_ = visibility_of(params, full_lq_, full_lk_);
    const Shard& me = shards[static_cast<size_t>(rank)];
    batch_ = me.batch;
    heads_ = me.heads;
    kv_heads_ = me.kv_heads;
    d_ = me.d;
    dv_ = me.dv;
    rows_ = me.lq;
    kv_dtype_ = k.dtype;
    for (const Shard& s : shards) max_lk_ = std::max(max_lk_, s.lk);
    // Two K/V buffers (the one computed on, the one arriving), tightly
    // packed.  This rank's own K and V are computed on and sent where they
    // are, unless they have gaps: then they are packed into the first.
    kv_[0] = thread_buffer(Slot::kKv0, shard_bytes(max_lk_));
    kv_[1] = thread_buffer(Slot::kKv1, shard_bytes(max_lk_));
    own_k_ = k;
    own_v_ = v;
    if (!is_dense(k) || !is_dense(v)) {
      pack(k, kv_[0]);
      pack(v, kv_[0] + k_bytes(me.lk));
      own_k_ = dense(kv_[0], kv_dtype_, batch_, kv_heads_, me.lk, d_);
      own_v_ = dense(kv_[0] + k_bytes(me.lk), kv_dtype_, batch_, kv_heads_, me.lk, dv_);
    }
    // The running result of this rank's queries: out itself when it is F32
    // with contiguous rows (so nothing is copied at the end), and the LSE
    // output when there is one; one block's partial beside it.
    int64_t max_segment = 0;
    for (const Segment& s : q_segments_) max_segment = std::max(max_segment, s.length);
    acc_in_out_ = out.dtype == MHA_DTYPE_F32 && out.strides[3] == 1;
    acc_ = acc_in_out_ ? out
                       : dense(thread_buffer(Slot::kAcc, batch_ * heads_ * rows_ * dv_ * 4),
                               MHA_DTYPE_F32, batch_, heads_, rows_, dv_);
    acc_lse_ = lse != nullptr ? *lse
                              : dense3(reinterpret_cast<float*>(thread_buffer(
                                           Slot::kAccLse, batch_ * heads_ * rows_ * 4)),
                                       batch_, heads_, rows_);
    part_ = reinterpret_cast<float*>(
        thread_buffer(Slot::kPart, batch_ * heads_ * max_segment * dv_ * 4));
    part_lse_ =
        reinterpret_cast<float*>(thread_buffer(Slot::kPartLse, batch_ * heads_ * max_segment * 4));
    started_.assign(q_segments_.size(), false);
    // Fault injection for the tests (tests/mpi): the rank this variable
    // names fails its first block as if its kernel could not get memory,
    // the one failure the checks before the ring cannot rule out.
    const char* fault = std::getenv("MHA_MPI_TEST_FAIL_RANK");
    fault_injected_ = fault != nullptr && std::strtol(fault, nullptr, 10) == rank;
  }

  // Runs the N steps; returns this rank's status (the others are not told).
  // Step s computes on the shard of rank (rank - s) mod N -- its own at step
  // 0, then the one received in the step before, into kv_[s % 2] -- while
  // passing it on to the next rank and receiving the following one.
  mha_status run(mha_mpi_stats* stats) {
    mha_status status = MHA_OK;
    const int next = (rank_ + 1) % ranks_, previous = (rank_ + ranks_ - 1) % ranks_;
    for (int step = 0; step < ranks_; ++step) {
      const int source = (rank_ - step + ranks_) % ranks_;
      const int64_t lk = shards_[static_cast<size_t>(source)].lk;
      const mha_tensor k =
          step == 0 ? own_k_ : dense(kv_[step % 2], kv_dtype_, batch_, kv_heads_, lk, d_);
      const mha_tensor v =
          step == 0 ? own_v_
                    : dense(kv_[step % 2] + k_bytes(lk), kv_dtype_, batch_, kv_heads_, lk, dv_);
      std::vector<MPI_Request> requests;
      if (step + 1 < ranks_) {
        const int arriving = (source + ranks_ - 1) % ranks_;  // what `previous` holds now
        const int64_t in_lk = shards_[static_cast<size_t>(arriving)].lk;
        char* into = kv_[(step + 1) % 2];
        post(false, into, k_bytes(in_lk), previous, kKTag, comm_, &requests);
        post(false, into + k_bytes(in_lk), v_bytes(in_lk), previous, kVTag, comm_, &requests);
        post(true, static_cast<const char*>(k.data), k_bytes(lk), next, kKTag, comm_, &requests);
        post(true, static_cast<const char*>(v.data), v_bytes(lk), next, kVTag, comm_, &requests);
        stats->bytes_received += shard_bytes(in_lk);
      }
      const Clock::time_point compute_start = Clock::now();
      if (status == MHA_OK) status = compute(source, k, v, &requests, stats);
      stats->compute_seconds += seconds_since(compute_start);
      const Clock::time_point wait_start = Clock::now();
      if (!requests.empty()) {
        MPI_Waitall(static_cast<int>(requests.size()), requests.data(), MPI_STATUSES_IGNORE);
      }
      stats->wait_seconds += seconds_since(wait_start);
    }
    stats->steps = ranks_;
    return status;
  }

  // Completes the result -- rows no key block reached, the sinks -- and
  // copies it into out when it was not computed there.
  void finish(const mha_tensor& out) {
    for (size_t s = 0; s < q_segments_.size(); ++s) {
      const Segment& seg = q_segments_[s];
      const mha_tensor acc = acc_rows(seg.local, seg.length);
      const mha_tensor acc_lse = acc_lse_rows(seg.local, seg.length);
      if (!started_[s]) clear_partial(acc, acc_lse);  // no key block was visible
      if (const mha_tensor* sinks = params_.sinks; sinks != nullptr) {
        fold_sinks(acc, acc_lse, static_cast<const float*>(sinks->data), sinks->strides[0]);
      }
      if (!acc_in_out_) write_out(acc, rows_of(out, seg.local, seg.length));
    }
  }

 private:
  int64_t k_bytes(int64_t lk) const {
    return batch_ * kv_heads_ * lk * d_ * mha_types::float_bytes(kv_dtype_);
  }
  int64_t v_bytes(int64_t lk) const {
    return batch_ * kv_heads_ * lk * dv_ * mha_types::float_bytes(kv_dtype_);
  }
  int64_t shard_bytes(int64_t lk) const { return k_bytes(lk) + v_bytes(lk); }
  mha_tensor acc_rows(int64_t row0, int64_t count) const { return rows_of(acc_, row0, count); }
  mha_tensor acc_lse_rows(int64_t row0, int64_t count) const {
    return rows_of(acc_lse_, row0, count);
  }

  // The blocks of this rank's queries with the keys of `source`, k and v.
  // A query segment's first visible block is computed straight into the
  // running result; each later one into the partial buffer, then merged
  // into it in place.
  mha_status compute(int source, const mha_tensor& k, const mha_tensor& v,
                     std::vector<MPI_Request>* requests, mha_mpi_stats* stats) {
    for (size_t s = 0; s < q_segments_.size(); ++s) {
      const Segment& qs = q_segments_[s];
      for (const Segment& ks : k_segments_[static_cast<size_t>(source)]) {
        const int64_t pairs =
            visible_pairs(vis_, qs.global, qs.global + qs.length, ks.global, ks.global + ks.length);
        if (pairs == 0) continue;
        stats->visible_pairs += pairs * batch_ * heads_;
        const bool first = !started_[s];
        const mha_tensor part = first ? acc_rows(qs.local, qs.length)
                                      : dense(part_, MHA_DTYPE_F32, batch_, heads_, qs.length, dv_);
        const mha_tensor part_lse = first ? acc_lse_rows(qs.local, qs.length)
                                          : dense3(part_lse_, batch_, heads_, qs.length);
        const mha_tensor kb = rows_of(k, ks.local, ks.length), vb = rows_of(v, ks.local, ks.length);
        // While K/V are in flight, query rows in a few calls, so that MPI can
        // move them between calls: about 4, in whole query tiles (64 rows
        // fill the AVX-512 kernel's tile; a 32-row remainder would run it
        // half empty).  Once they have arrived, the rest in one call.
        const int64_t chunk = std::max<int64_t>(128, (qs.length + 3) / 4 + 63) / 64 * 64;
        for (int64_t c0 = 0, n = 0; c0 < qs.length; c0 += n) {
          n = requests->empty() ? qs.length - c0 : std::min(chunk, qs.length - c0);
          mha_tensor out_rows = rows_of(part, c0, n), lse_rows = rows_of(part_lse, c0, n);
          if (visible_pairs(vis_, qs.global + c0, qs.global + c0 + n, ks.global,
                            ks.global + ks.length) == 0) {
            clear_partial(out_rows, lse_rows);
            continue;
          }
          mha_attention_params block = params_;
          mha_tensor lse_view = lse_rows, valid_view{};
          block.lse = &lse_view;
          block.sinks = nullptr;  // added once, when the result is written
          block.valid_lens = block_valid_lens(params_.valid_lens, qs.local + c0, n, ks.global,
                                              ks.length, &valid_storage_, &valid_view);
          block.query_offset = qs.global + c0;
          block.key_offset = ks.global;
          block.full_lq = full_lq_;
          block.full_lk = full_lk_;
          const mha_tensor qb = rows_of(q_, qs.local + c0, n);
          mha_status st = fault_injected_ ? MHA_ERR_OUT_OF_MEMORY
                                          : mha_attention(&qb, &kb, &vb, &out_rows, &block);
          if (st != MHA_OK) {
            // The running result is already partly written: out and lse
            // are unspecified (mha.h's MHA_ERR_INTERNAL).
            fail_from_mha(st, "a block's mha_attention failed (out and lse hold partial results)");
            return MHA_ERR_INTERNAL;
          }
          progress(requests);
        }
        if (!first) {
          merge_into(acc_rows(qs.local, qs.length), acc_lse_rows(qs.local, qs.length), part,
                     part_lse);
        }
        started_[s] = true;
        progress(requests);
      }
    }
    return MHA_OK;
  }

  MPI_Comm comm_;
  int rank_, ranks_;
  const std::vector<Shard>& shards_;
  const mha_attention_params& params_;
  const mha_tensor& q_;
  int64_t full_lq_ = 0, full_lk_ = 0, max_lk_ = 0;
  int64_t batch_ = 0, heads_ = 0, kv_heads_ = 0, d_ = 0, dv_ = 0, rows_ = 0;
  int32_t kv_dtype_ = MHA_DTYPE_F32;
  Visibility vis_{};
  std::vector<Segment> q_segments_;
  std::vector<std::vector<Segment>> k_segments_;
  char* kv_[2] = {nullptr, nullptr};
  mha_tensor own_k_{}, own_v_{};  // this rank's K and V: the caller's, or packed into kv_[0]
  bool acc_in_out_ = false;
  bool fault_injected_ = false;
  mha_tensor acc_{}, acc_lse_{};  // F32 [B, H, rows, Dv] and [B, H, rows]
  float* part_ = nullptr;
  float* part_lse_ = nullptr;
  std::vector<bool> started_;  // per query segment: whether acc_ holds a result
  std::vector<int64_t> valid_storage_;
};

}  // namespace
}  // namespace mha::mpi

using namespace mha::mpi;

extern "C" void mha_mpi_params_init(mha_mpi_params* mpi) {
  if (mpi == nullptr) return;
  *mpi = mha_mpi_params{};
  mpi->struct_size = sizeof *mpi;
  mpi->layout = MHA_MPI_CONTIGUOUS;
}

extern "C" mha_status mha_attention_mpi_ring(MPI_Comm comm, const mha_tensor* q,
                                             const mha_tensor* k, const mha_tensor* v,
                                             mha_tensor* out, const mha_attention_params* params,
                                             const mha_mpi_params* mpi) {
  const Clock::time_point start = Clock::now();
  clear_error();
  int rank = 0, ranks = 0;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &ranks);

  // Each rank checks its own arguments, then all learn each other's sizes
  // (and failures) before any data moves.
  Arguments args;
  mha_status status = MHA_OK;
  if (!exchange_arguments(comm, Call::kRing, rank, q, k, v, out, params, mpi, &args, &status)) {
    return status;
  }
  const mha_attention_params& p = args.params;
  const mha_mpi_params& m = args.mpi;
  const std::vector<Shard>& shards = args.shards;
  if (status == MHA_OK) {
    std::vector<int64_t> lq, lk;
    for (const Shard& s : shards) {
      lq.push_back(s.lq);
      lk.push_back(s.lk);
    }
    std::string why = check_layout(m.layout, lq, "q");
    if (why.empty()) why = check_layout(m.layout, lk, "k");
    if (!why.empty()) status = fail(MHA_ERR_SHAPE_MISMATCH, "%s", why.c_str());
  }

  // Messages of this call must not meet the caller's own on comm.
  MPI_Comm ring_comm = MPI_COMM_NULL;
  MPI_Comm_dup(comm, &ring_comm);
  std::unique_ptr<Ring> ring;
  if (status == MHA_OK) {
    try {
      ring = std::make_unique<Ring>(ring_comm, rank, ranks, shards, p, m.layout, *q, *k, *v, *out,
                                    p.lse);
    } catch (const std::bad_alloc&) {
      status = fail(MHA_ERR_OUT_OF_MEMORY, "out of memory for the K/V buffers and partial results");
    }
  }
  mha_mpi_stats stats{};
  if ((status = agree(ring_comm, status)) == MHA_OK) {
    status = agree(ring_comm, ring->run(&stats));  // a failed block is told at the end
    if (status == MHA_OK) ring->finish(*out);
  }
  MPI_Comm_free(&ring_comm);
  stats.total_seconds = seconds_since(start);
  if (status == MHA_OK && m.stats != nullptr) *m.stats = stats;
  return status;
}
