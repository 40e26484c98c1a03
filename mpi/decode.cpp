// mha_attention_mpi_decode: decoding over a KV cache sharded by position.
// Each rank computes its keys' partial result and LSE; one MPI_Allgather
// brings every rank's partial to every rank, which merges them in rank
// order (Flash-Decoding's merge, here across processes).
#include <mha/mha_mpi.h>

#include <chrono>
#include <climits>
#include <cstring>
#include <new>
#include <vector>

#include "agreement.h"
#include "blocks.h"
#include "checks.h"
#include "error.h"

using namespace mha::mpi;

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// A rank's contribution to the gather: its status, then its partial output
// [B, H, Lq, Dv] and LSE [B, H, Lq], all as floats.
struct Partial {
  int64_t outs, lses;  // float counts
  int64_t count() const { return 1 + outs + lses; }
};

}  // namespace

extern "C" mha_status mha_attention_mpi_decode(MPI_Comm comm, const mha_tensor* q,
                                               const mha_tensor* k_shard, const mha_tensor* v_shard,
                                               mha_tensor* out, const mha_attention_params* params,
                                               const mha_mpi_params* mpi) {
  const Clock::time_point start = Clock::now();
  clear_error();
  int rank = 0, ranks = 0;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &ranks);

  Arguments args;
  mha_status status = MHA_OK;
  if (!exchange_arguments(comm, Call::kDecode, rank, q, k_shard, v_shard, out, params, mpi, &args,
                          &status)) {
    return status;
  }
  const mha_attention_params& p = args.params;
  const mha_mpi_params& m = args.mpi;
  const Shard& mine = args.mine;
  const std::vector<Shard>& shards = args.shards;

  const int64_t batch = mine.batch, heads = mine.heads, lq = mine.lq, dv = mine.dv;
  int64_t key0 = 0, full_lk = 0;
  for (int r = 0; r < ranks; ++r) {
    if (r < rank) key0 += shards[static_cast<size_t>(r)].lk;
    full_lk += shards[static_cast<size_t>(r)].lk;
  }
  Partial part{0, 0};
  if (status == MHA_OK &&
      (!product(batch, heads, lq, dv, &part.outs) || part.outs > (INT_MAX - 1) / 2 / ranks)) {
    status = fail(MHA_ERR_SIZE_OVERFLOW, "out [%lld, %lld, %lld, %lld] is too large to gather",
                  static_cast<long long>(batch), static_cast<long long>(heads),
                  static_cast<long long>(lq), static_cast<long long>(dv));
  }
  part.lses = batch * heads * lq;
  std::vector<float> send, gathered, merged, merged_lse;
  if (status == MHA_OK) {
    try {
      send.resize(static_cast<size_t>(part.count()));
      gathered.resize(static_cast<size_t>(part.count() * ranks));
      merged.resize(static_cast<size_t>(part.outs));
      merged_lse.resize(static_cast<size_t>(part.lses));
    } catch (const std::bad_alloc&) {
      status = fail(MHA_ERR_OUT_OF_MEMORY, "out of memory for the partial results");
    }
  }
  if ((status = agree(comm, status)) != MHA_OK) return status;

  // This rank's partial: its keys are [key0, key0 + Lk_r) of the full cache.
  mha_mpi_stats stats{};
  const Clock::time_point compute_start = Clock::now();
  mha_tensor part_out = dense(send.data() + 1, MHA_DTYPE_F32, batch, heads, lq, dv);
  mha_tensor part_lse = dense3(send.data() + 1 + part.outs, batch, heads, lq);
  const int64_t lk = mine.lk;
  const Visibility vis = visibility_of(p, lq, full_lk);
  stats.visible_pairs = visible_pairs(vis, 0, lq, key0, key0 + lk) * batch * heads;
  if (stats.visible_pairs == 0) {
    clear_partial(part_out, part_lse);
  } else {
    mha_attention_params block = p;
    mha_tensor valid_view{};
    std::vector<int64_t> valid_storage;
    block.lse = &part_lse;
    block.sinks = nullptr;  // added once, after the merge
    block.valid_lens = block_valid_lens(p.valid_lens, 0, lq, key0, lk, &valid_storage, &valid_view);
    block.query_offset = 0;
    block.key_offset = key0;
    block.full_lq = lq;
    block.full_lk = full_lk;
    status = mha_attention(q, k_shard, v_shard, &part_out, &block);
    if (status != MHA_OK) fail_from_mha(status, "this rank's mha_attention failed");
  }
  send[0] = static_cast<float>(status);
  stats.compute_seconds = seconds_since(compute_start);

  const Clock::time_point wait_start = Clock::now();
  MPI_Allgather(send.data(), static_cast<int>(part.count()), MPI_FLOAT, gathered.data(),
                static_cast<int>(part.count()), MPI_FLOAT, comm);
  stats.wait_seconds = seconds_since(wait_start);
  stats.bytes_received = (ranks - 1) * part.count() * static_cast<int64_t>(sizeof(float));
  for (int r = 0; r < ranks && status == MHA_OK; ++r) {
    if (gathered[static_cast<size_t>(r * part.count())] != 0.0f) status = MHA_ERR_INTERNAL;
  }
  if (status != MHA_OK) return agree(comm, send[0] == 0.0f ? MHA_OK : status);

  // Merge in rank order: the same bytes on every rank, run after run.
  const Clock::time_point merge_start = Clock::now();
  std::vector<mha_tensor> outs, lses;
  for (int r = 0; r < ranks; ++r) {
    float* base = gathered.data() + r * part.count() + 1;
    outs.push_back(dense(base, MHA_DTYPE_F32, batch, heads, lq, dv));
    lses.push_back(dense3(base + part.outs, batch, heads, lq));
  }
  mha_tensor result = dense(merged.data(), MHA_DTYPE_F32, batch, heads, lq, dv);
  mha_tensor result_lse = dense3(merged_lse.data(), batch, heads, lq);
  status = mha_merge_partials(ranks, outs.data(), lses.data(), &result, &result_lse);
  if (status != MHA_OK) return fail_from_mha(status, "merging the ranks' partials");
  if (const mha_tensor* sinks = p.sinks; sinks != nullptr) {
    fold_sinks(result, result_lse, static_cast<const float*>(sinks->data), sinks->strides[0]);
  }
  write_out(result, *out);
  if (p.lse != nullptr) write_lse(result_lse, *p.lse);
  stats.compute_seconds += seconds_since(merge_start);
  stats.total_seconds = seconds_since(start);
  stats.steps = 1;
  if (m.stats != nullptr) *m.stats = stats;
  return MHA_OK;
}
