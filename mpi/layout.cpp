#include "layout.h"

#include <mha/mha_mpi.h>

#include <numeric>

namespace mha::mpi {
namespace {

int64_t total_of(const std::vector<int64_t>& lengths) {
  return std::accumulate(lengths.begin(), lengths.end(), int64_t{0});
}

}  // namespace

int64_t chunk_begin(int64_t c, int64_t chunks, int64_t total) {
  return c * total / chunks;
}

std::vector<Segment> segments_of(int32_t layout, int rank, const std::vector<int64_t>& lengths) {
  const int64_t ranks = static_cast<int64_t>(lengths.size());
  std::vector<Segment> segments;
  if (layout == MHA_MPI_ZIGZAG) {
    const int64_t total = total_of(lengths), chunks = 2 * ranks;
    int64_t local = 0;
    for (const int64_t c : {static_cast<int64_t>(rank), chunks - 1 - rank}) {
      const int64_t begin = chunk_begin(c, chunks, total);
      const int64_t length = chunk_begin(c + 1, chunks, total) - begin;
      if (length > 0) segments.push_back({begin, length, local});
      local += length;
    }
    return segments;
  }
  const int64_t begin = std::accumulate(lengths.begin(), lengths.begin() + rank, int64_t{0});
  if (lengths[static_cast<size_t>(rank)] > 0) {
    segments.push_back({begin, lengths[static_cast<size_t>(rank)], 0});
  }
  return segments;
}

std::vector<Segment> coalesce(const std::vector<Segment>& segments) {
  std::vector<Segment> out;
  for (const Segment& s : segments) {
    if (!out.empty() && out.back().global + out.back().length == s.global &&
        out.back().local + out.back().length == s.local) {
      out.back().length += s.length;
    } else {
      out.push_back(s);
    }
  }
  return out;
}

std::string check_layout(int32_t layout, const std::vector<int64_t>& lengths, const char* what) {
  if (layout != MHA_MPI_ZIGZAG) return "";
  const int64_t ranks = static_cast<int64_t>(lengths.size());
  const int64_t total = total_of(lengths), chunks = 2 * ranks;
  for (int64_t r = 0; r < ranks; ++r) {
    const int64_t expected = chunk_begin(r + 1, chunks, total) - chunk_begin(r, chunks, total) +
                             chunk_begin(chunks - r, chunks, total) -
                             chunk_begin(chunks - 1 - r, chunks, total);
    if (lengths[static_cast<size_t>(r)] != expected) {
      return "rank " + std::to_string(r) + ": " + what + " has " +
             std::to_string(lengths[static_cast<size_t>(r)]) + " rows, but the zigzag layout of " +
             std::to_string(total) + " positions over " + std::to_string(ranks) +
             " ranks gives it " + std::to_string(expected) + " (chunks " + std::to_string(r) +
             " and " + std::to_string(chunks - 1 - r) + ")";
    }
  }
  return "";
}

}  // namespace mha::mpi

extern "C" int32_t mha_mpi_shard_rows(int32_t layout, int64_t length, int32_t rank, int32_t ranks,
                                      int64_t starts[2], int64_t lengths[2]) {
  using mha::mpi::chunk_begin;
  if ((layout != MHA_MPI_CONTIGUOUS && layout != MHA_MPI_ZIGZAG) || length < 0 ||
      length > MHA_MAX_EXTENT || ranks < 1 || rank < 0 || rank >= ranks || starts == nullptr ||
      lengths == nullptr) {
    return -1;
  }
  if (layout == MHA_MPI_CONTIGUOUS) {
    starts[0] = chunk_begin(rank, ranks, length);
    lengths[0] = chunk_begin(rank + 1, ranks, length) - starts[0];
    return 1;
  }
  const int64_t chunks = 2 * int64_t{ranks};
  int run = 0;
  for (const int64_t c : {int64_t{rank}, chunks - 1 - rank}) {
    starts[run] = chunk_begin(c, chunks, length);
    lengths[run] = chunk_begin(c + 1, chunks, length) - starts[run];
    ++run;
  }
  return 2;
}
