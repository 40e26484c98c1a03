// Where the K or V rows of a tile are, for the kernels that read them in
// place: evenly spaced (a dense tensor, a packed tile), through a table of
// addresses (a paged cache's tile in the decode kernel), or looked up one by
// one (a paged cache, where a row is packed once and its address costs
// little next to the work on it).  rows(t) is the first element of row t.
#pragma once

#include <mha/plugin_abi.h>

#include <cstdint>

#include "common/problem.h"

namespace mha_simd {

template <class T>
struct StridedRows {
  const T* first;
  int64_t stride;
  const T* operator()(int64_t t) const { return first + t * stride; }
};

// The table holds kRowsAheadMax (row_kernels.hpp) entries past the tile's last
// row, for the prefetches; `offset` selects a KV head within each row's token
// (the table holds the addresses of KV head 0).
template <class T>
struct TableRows {
  const T* const* row;
  int64_t offset;
  const T* operator()(int64_t t) const { return row[t] + offset; }
};

// Keys j0 + t of KV head kvh of batch b in `data` (K or V, with its strides),
// paged or not (mha_kernel::kv_offset).
template <class T>
struct ProblemRows {
  const mha_kernel_problem* p;
  const T* data;
  const int64_t* strides;
  int64_t b, kvh, j0;
  const T* operator()(int64_t t) const {
    return data + mha_kernel::kv_offset(*p, strides, b, kvh, j0 + t);
  }
};

}  // namespace mha_simd
