// PyTorch's two module masks turned into mha_attention's one mask.
#pragma once

#include <mha/mha.h>

#include "module.h"
#include "scratch.h"

namespace mha::rt {

// The masks in mha_attention's form: one mask, bool true = take part or f32
// added to the scores, as a [B or 1, H or 1, Lq or 1, Lk] descriptor.
//   key_padding_mask alone: f32 is used in place ([B, 1, 1, Lk] view); bool is
//     inverted into B·Lk bytes of scratch.
//   attn_mask alone: f32 is used in place ([Lq, Lk], or the [B*H, Lq, Lk] one
//     viewed as [B, H, Lq, Lk]); bool is inverted into scratch of its own size.
//   both: combined into scratch of [B, 1 or H, Lq, Lk] elements -- bool
//     (allowed = neither masks the key) when both are bool, otherwise f32 (the
//     sum of the two, a true bool entry counting as -inf), so O(B·Lq·Lk), or
//     O(B·H·Lq·Lk) when attn_mask already has that size.
// False when the call has no mask.  Throws std::bad_alloc when the scratch
// cannot be had.
bool build_kernel_mask(const ModuleCall& call, int64_t heads, AlignedBuffer& scratch,
                       mha_tensor* mask);

}  // namespace mha::rt
