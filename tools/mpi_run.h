// `mpirun -np N mha-run --mpi-ring ...` and `... --mpi-decode ...`: the
// attention command over MPI ranks with libmha-mpi.  Rank 0 reads the .npy
// files and sends each rank its shard; every rank computes its part; rank 0
// gathers the result and writes --out and --lse.  Built when libmha-mpi is
// (MHA_TOOLS_HAVE_MPI); otherwise the flags are refused with a message.
#pragma once

#include "attention_run.h"

namespace mha_tools {

// Whether this mha-run was built with libmha-mpi.
bool mpi_available();

// The whole MPI command on every rank (MPI is initialised and finalised
// here): errors as "mha-run: ..." on stderr of the rank that found them,
// and the same exit status on every rank.
int run_mpi_attention_command(const AttentionOptions& options);

}  // namespace mha_tools
