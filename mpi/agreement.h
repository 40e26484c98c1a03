// How the ranks of a collective call agree: on each other's shapes before
// any data moves, and on one status at the end, so that a rank that fails
// never leaves the others waiting.
#pragma once

#include <mha/mha.h>
#include <mpi.h>

#include <cstdint>
#include <vector>

namespace mha::mpi {

// What a rank tells the others about its part of a call.
struct Shard {
  int64_t status;  // mha_status of this rank's own checks
  int64_t batch, heads, kv_heads, d, dv;
  int64_t lq, lk;  // this rank's query and key rows
  int64_t q_dtype, out_dtype;
  int64_t layout, causal;  // must be the same on every rank
};

// Every rank's Shard, in rank order (MPI_Allgather).
std::vector<Shard> gather_shards(MPI_Comm comm, const Shard& mine);

// One status for all: `mine` is this rank's; when some rank failed, every
// rank returns the status of the lowest failing rank and records its message
// (mha_mpi_last_error) as "rank R: ...".  Collective.
mha_status agree(MPI_Comm comm, mha_status mine);

// The status of the lowest rank of `shards` that failed (its message is
// exchanged with agree()); MHA_OK when none did.  Every rank computes the same.
mha_status first_failure(const std::vector<Shard>& shards, int* rank);

}  // namespace mha::mpi
