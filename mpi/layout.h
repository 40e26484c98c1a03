// Which positions of the full sequence each rank's shard holds.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mha::mpi {

// A run of consecutive positions held by one rank: global positions
// [global, global + length) are the shard's rows [local, local + length).
struct Segment {
  int64_t global, length, local;
};

// Chunk c's first position when `total` positions are cut into `chunks`
// (c * total / chunks, which cannot overflow: total <= 2^40, chunks < 2^32).
int64_t chunk_begin(int64_t c, int64_t chunks, int64_t total);

// The segments of rank `rank` when the ranks' shards have `lengths` rows
// (in rank order) under `layout` (mha_mpi_layout).  Zigzag: chunk c of
// 2N is [c·L/(2N), (c+1)·L/(2N)); rank r holds chunks r and 2N-1-r.
std::vector<Segment> segments_of(int32_t layout, int rank, const std::vector<int64_t>& lengths);

// The same positions in as few segments as possible: runs that follow each
// other both in the sequence and in the shard become one (the middle rank's
// two zigzag chunks, for one), so that a block is one call, not two.
std::vector<Segment> coalesce(const std::vector<Segment>& segments);

// "" when the lengths fit the layout; otherwise why not, naming `what`
// ("q", "k") and the first rank that does not fit.
std::string check_layout(int32_t layout, const std::vector<int64_t>& lengths, const char* what);

}  // namespace mha::mpi
