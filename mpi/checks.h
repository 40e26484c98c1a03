// What each rank checks of its own arguments before it tells the others.
#pragma once

#include <mha/mha_mpi.h>

#include <vector>

#include "agreement.h"

namespace mha::mpi {

// The caller's structs completed with their defaults (a caller built against
// an older mha passes a shorter one); a size this library never had is refused.
mha_status read_params(const mha_attention_params* given, mha_attention_params* params);
mha_status read_mpi_params(const mha_mpi_params* given, mha_mpi_params* mpi);

enum class Call { kRing, kDecode };

// q, k, v, out and params as one rank of `call` sees them; fills the shard's
// sizes (status MHA_OK) or returns the failure (the message recorded).
mha_status check_local(Call call, const mha_tensor* q, const mha_tensor* k, const mha_tensor* v,
                       const mha_tensor* out, const mha_attention_params& params, Shard* shard);

// The checks that need every rank's shard: sizes that must agree across
// ranks, the totals' limits, this rank's valid lengths against the full key
// count.  Every rank computes the same verdict on the others' sizes.
mha_status check_global(Call call, const std::vector<Shard>& shards, int rank,
                        const mha_attention_params& params);

// What every rank of a collective call knows once the arguments are exchanged.
struct Arguments {
  mha_attention_params params;  // the caller's, completed with defaults
  mha_mpi_params mpi;
  Shard mine;                 // this rank's sizes
  std::vector<Shard> shards;  // every rank's, in rank order
};

// The opening of every collective call: reads the structs, checks this rank's
// arguments and exchanges every rank's shard (collective).  False when some
// rank failed its own checks: *status is then the agreed failure, which the
// call returns at once.  True otherwise, *status being check_global's verdict
// on this rank (not yet agreed with the others).
bool exchange_arguments(MPI_Comm comm, Call call, int rank, const mha_tensor* q,
                        const mha_tensor* k, const mha_tensor* v, const mha_tensor* out,
                        const mha_attention_params* params, const mha_mpi_params* mpi,
                        Arguments* args, mha_status* status);

// An element count a * b * c * d that must fit in 64 bits (false: overflow).
bool product(int64_t a, int64_t b, int64_t c, int64_t d, int64_t* count);

}  // namespace mha::mpi
