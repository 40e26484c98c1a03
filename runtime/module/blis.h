// The module's matrix products: BLIS sgemm with explicit row and column
// strides, so strided inputs (sequence-first, padded rows, a head's columns of
// a [B, L, E] buffer) need no copy.
#pragma once

#include <mha/mha.h>

#include <cstdint>

namespace mha::rt {

// C[m, n] = alpha * A[m, k] * B[k, n] + beta * C, fp32, element (r, c) of each
// operand at data[r * rs + c * cs] (strides in elements, >= 0).  beta == 0
// overwrites C without reading it.  Runs BLIS on `threads` threads (a per-call
// setting: BLIS's global thread count is left alone), with the selected
// backend's micro-kernel where it has one for BLIS's kernel set.  Operands whose strides
// BLIS refuses (zero strides of broadcast inputs, interleaved rows) are copied
// to packed scratch first, and a refused C is computed in scratch and copied.
void sgemm(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t rsa, int64_t csa,
           const float* b, int64_t rsb, int64_t csb, float beta, float* c, int64_t rsc, int64_t csc,
           int32_t threads);

// The threads a product of this size is worth: 1 below about a million
// multiply-adds (thread start-up would cost more than it saves), else
// `threads`, at most one per core the process may run on: BLIS's threads
// meet at spinning barriers, and one that is not running holds the others
// (7 threads on 2 cores spent about 97 % of a module backward spinning).
// BLIS's results do not depend on its thread count (it never splits the k
// dimension).
int32_t sgemm_threads(int64_t m, int64_t n, int64_t k, int32_t threads);

// MHA_OK when BLIS can run its products here; otherwise fails (the message
// names BLIS_ARCH_TYPE): the user's BLIS_ARCH_TYPE asks a BLIS 0.x for a
// kernel set this CPU cannot run, or one it does not have -- BLIS itself
// would end the process.  The module's calls check it before any product.
mha_status check_blis_kernel_set();

// The BLIS kernel set in use ("skx", "haswell", "generic", ...), for logs.
const char* blis_kernel_set();

// Whose micro-kernel runs the products in BLIS's framework: the selected
// backend's name when its plugin offers one for BLIS's kernel set
// (mha_gemm_ukernel), else "blis".  For logs.
const char* gemm_ukernel_in_use();

}  // namespace mha::rt
