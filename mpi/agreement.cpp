#include "agreement.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <string>

#include "error.h"

namespace mha::mpi {

std::vector<Shard> gather_shards(MPI_Comm comm, const Shard& mine) {
  int size = 0;
  MPI_Comm_size(comm, &size);
  std::vector<Shard> all(static_cast<size_t>(size));
  constexpr int kFields = sizeof(Shard) / sizeof(int64_t);
  static_assert(sizeof(Shard) == kFields * sizeof(int64_t), "Shard holds int64 fields only");
  MPI_Allgather(&mine, kFields, MPI_INT64_T, all.data(), kFields, MPI_INT64_T, comm);
  return all;
}

mha_status first_failure(const std::vector<Shard>& shards, int* rank) {
  for (size_t r = 0; r < shards.size(); ++r) {
    if (shards[r].status != MHA_OK) {
      *rank = static_cast<int>(r);
      return static_cast<mha_status>(shards[r].status);
    }
  }
  *rank = -1;
  return MHA_OK;
}

mha_status agree(MPI_Comm comm, mha_status mine) {
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  const int my_claim = mine == MHA_OK ? INT_MAX : rank;
  int first = INT_MAX;
  MPI_Allreduce(&my_claim, &first, 1, MPI_INT, MPI_MIN, comm);
  if (first == INT_MAX) return MHA_OK;

  // The failing rank with the lowest number tells everyone why.
  struct {
    int32_t status;
    char message[500];
  } verdict{};
  if (rank == first) {
    verdict.status = mine;
    std::strncpy(verdict.message, last_error(), sizeof verdict.message - 1);
  }
  MPI_Bcast(&verdict, sizeof verdict, MPI_BYTE, first, comm);
  verdict.message[sizeof verdict.message - 1] = '\0';
  const std::string text = verdict.message;
  return fail(static_cast<mha_status>(verdict.status), "rank %d: %s", first, text.c_str());
}

}  // namespace mha::mpi
