// Packed variable-length batches (mha_attention_varlen).
#pragma once

#include <mha/mha.h>

namespace mha::rt {

// Checks every argument (naming it on failure, writing nothing), then runs
// each sequence as a B = 1 call in one team of threads.
mha_status attention_varlen(const mha_tensor* q, const mha_tensor* k, const mha_tensor* v,
                            mha_tensor* out, const mha_varlen_params* varlen,
                            const mha_attention_params* params);

}  // namespace mha::rt
