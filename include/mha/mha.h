/*
 * mha — multi-head attention on the CPU.  The stable C API.
 *
 * Every function returns a status code (or a value whose meaning is stated);
 * when a call fails, mha_last_error() returns a message for the calling thread
 * that names the argument at fault.  A failed call leaves its outputs
 * untouched -- every check, and every allocation, happens before the first
 * output element is written -- with one exception: MHA_ERR_INTERNAL (a
 * backend plugin reported a failure in the middle of a call), after which the
 * outputs' contents are unspecified.
 *
 * Versioned structs (mha_attention_params, mha_module_config,
 * mha_module_forward_params, mha_module_gradients, ...) start with struct_size, which their
 * *_init() sets to the size the program was compiled with.  They only grow at their end: a program
 * built against an older mha passes its smaller size and the fields it does not know take their
 * defaults; a size this library never had is refused (MHA_ERR_INVALID_PARAMS).
 *
 * Size limits, checked by every entry point (MHA_ERR_INVALID_SIZE): the head
 * sizes D and Dv at most MHA_MAX_HEAD_DIM, every other dimension of every
 * tensor (batch, heads, sequence lengths, embedding sizes) at most
 * MHA_MAX_EXTENT, also when a stride of 0 broadcasts it; a tensor's element
 * and byte extent must fit in 63 bits (MHA_ERR_SIZE_OVERFLOW).
 *
 * Tensors are described, not owned: a data pointer, a dtype, a shape and
 * strides counted in elements, so [B,H,L,D] and [B,L,H,D] layouts (and packed
 * QKV buffers) are used in place, without copies.
 */
#ifndef MHA_MHA_H
#define MHA_MHA_H

#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__)
#define MHA_API __attribute__((visibility("default")))
#else
#define MHA_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define MHA_VERSION_MAJOR 0
#define MHA_VERSION_MINOR 4
#define MHA_VERSION_PATCH 0

/* ---------------------------------------------------------------- status */

typedef enum mha_status {
  MHA_OK = 0,
  MHA_ERR_NULL_POINTER = 1,         /* a required pointer (tensor, data, params) is NULL     */
  MHA_ERR_INVALID_SIZE = 2,         /* a size or rank is zero, negative or out of range      */
  MHA_ERR_SHAPE_MISMATCH = 3,       /* tensors disagree (batch, heads, lengths, head size)   */
  MHA_ERR_INVALID_DTYPE = 4,        /* unknown dtype, or one this argument does not accept   */
  MHA_ERR_INVALID_STRIDES = 5,      /* negative strides                                       */
  MHA_ERR_OVERLAP = 6,              /* an output overlaps itself or another tensor           */
  MHA_ERR_SIZE_OVERFLOW = 7,        /* an element or byte count does not fit in 64 bits      */
  MHA_ERR_INVALID_PARAMS = 8,       /* a parameters struct of unknown size                   */
  MHA_ERR_INVALID_VALUE = 9,        /* a value out of range: scale, causal mode, valid length */
  MHA_ERR_BACKEND_UNAVAILABLE = 10, /* the requested backend is unknown or unusable here     */
  MHA_ERR_OUT_OF_MEMORY = 11,
  MHA_ERR_INTERNAL = 12,   /* a backend failed mid-call; the outputs are unspecified */
  MHA_ERR_UNSUPPORTED = 13 /* valid, but the selected backend cannot compute it (a dtype,
                              a variant); the message says which backend and why     */
} mha_status;

/* A short, static description of a status code ("MHA_ERR_SHAPE_MISMATCH"). */
MHA_API const char* mha_status_name(mha_status status);

/* The message of the last failed call on this thread ("" if none).  Valid until
 * the next mha call on the same thread. */
MHA_API const char* mha_last_error(void);

/* "0.4.0" */
MHA_API const char* mha_version(void);

/* ---------------------------------------------------------------- tensors */

typedef enum mha_dtype {
  MHA_DTYPE_INVALID = 0, /* zero-initialised descriptors are refused, not guessed */
  MHA_DTYPE_F32 = 1,
  MHA_DTYPE_F16 = 2,  /* IEEE binary16                                              */
  MHA_DTYPE_BF16 = 3, /* bfloat16: the upper 16 bits of an IEEE binary32            */
  MHA_DTYPE_BOOL = 4, /* one byte per element, 0 = false, anything else = true      */
  MHA_DTYPE_I32 = 5,
  MHA_DTYPE_I64 = 6,
  /* 7 is unused */
  MHA_DTYPE_I8 = 8 /* signed 8-bit: an int8 KV cache, value = row scale · int8     */
} mha_dtype;

#define MHA_MAX_DIMS 4
#define MHA_MAX_HEAD_DIM 65536
/* INT64_C, not a cast: C++ callers may build with -Wold-style-cast. */
#define MHA_MAX_EXTENT (INT64_C(1) << 40)

typedef struct mha_tensor {
  void* data;
  int32_t dtype; /* mha_dtype */
  int32_t ndim;  /* 1..MHA_MAX_DIMS */
  int64_t shape[MHA_MAX_DIMS];
  int64_t strides[MHA_MAX_DIMS]; /* in elements, >= 0; 0 broadcasts a dimension of an input */
} mha_tensor;

/* Fills a descriptor.  strides == NULL means C order (row-major, contiguous). */
MHA_API mha_status mha_tensor_init(mha_tensor* tensor, void* data, mha_dtype dtype, int32_t ndim,
                                   const int64_t* shape, const int64_t* strides);

/* ------------------------------------------------- scaled dot-product attention */

typedef enum mha_causal {
  MHA_CAUSAL_NONE = 0,
  MHA_CAUSAL_TOP_LEFT = 1,    /* query i sees keys j <= i (PyTorch's is_causal)          */
  MHA_CAUSAL_BOTTOM_RIGHT = 2 /* query i sees keys j <= i + Lk - Lq (queries end a KV cache) */
} mha_causal;

/*
 * Parameters of mha_attention.  Initialise with mha_attention_params_init(),
 * which sets struct_size and the defaults, then set what you need: the struct
 * can grow in later versions without breaking programs built against this one.
 */
typedef struct mha_attention_params {
  uint32_t struct_size; /* sizeof(mha_attention_params) as the caller was compiled */
  int32_t has_scale;    /* 0: scale = 1/sqrt(D), as PyTorch's scale=None          */
  float scale;          /* used when has_scale != 0; must be finite and non-zero  */
  int32_t causal;       /* mha_causal                                              */

  /* d2l.ai's valid_lens: key j takes part in query i's row iff j < valid length.
   * I32 or I64, shape [B] (per batch) or [B, Lq] (per batch and query); each
   * value in [0, Lk].  NULL: every key takes part. */
  const mha_tensor* valid_lens;

  /* An explicit mask, broadcast over batch, heads (and queries or keys) like
   * NumPy: rank 2 to 4, shapes such as [Lq,Lk], [B,1,Lq,Lk], [1,H,Lq,Lk],
   * [B,H,Lq,Lk] or [B,1,1,Lk].  BOOL: true = the key takes part (the opposite
   * of PyTorch's key_padding_mask).  F32, BF16 or F16: added to the scaled
   * scores (-inf
   * removes the key: its value row is never used, garbage there cannot leak
   * in; a NaN score plus -inf stays NaN, as in IEEE arithmetic and PyTorch).
   * NULL: no mask. */
  const mha_tensor* mask;

  /* Optional output: the natural log of each row's softmax denominator of the
   * scaled (and masked) scores, F32 [B, H, Lq].  NULL: not wanted. */
  mha_tensor* lse;

  /* Dropout on the attention weights (training), p in [0, 1); 0 = none.  A
   * weight is kept (and scaled by 1/(1-p)) or zeroed by a counter-based hash, so
   * results are reproducible and the same for any thread count:
   *   row  = splitmix64(seed ^ splitmix64((b * H + h) * Lq + i))      (64-bit)
   *   key  = (uint32)(row ^ (row >> 32))
   *   drop = fmix32(key + (uint32)j * 0x9E3779B9) < (uint32)(p * 2^32)
   * with splitmix64 (Steele et al.) and fmix32 (MurmurHash3's finaliser),
   * arithmetic modulo 2^64 / 2^32.  The LSE output is that of the weights
   * before dropout. */
  float dropout_p;
  uint64_t dropout_seed;

  /* --- added in 0.2 --- */

  /* An int8 KV cache (K and V of dtype I8): the fp32 scale of every row,
   * value = scale · int8, F32 [B, Hkv, Lk] each (strided like the rest; 0
   * broadcasts).  mha_quantize_kv() makes such a cache.  Required with I8 K
   * and V, refused otherwise.  NULL: none. */
  const mha_tensor* k_scale;
  const mha_tensor* v_scale;

  /* --- added in 0.3 --- */

  /* A sliding window, FlashAttention-2's semantics aligned to the
   * bottom-right corner: key j takes part in query i's row iff
   *   i + Lk - Lq - window_left <= j <= i + Lk - Lq + window_right.
   * -1 (the default) leaves that side unbounded; any other negative value is
   * refused.  It combines with the causal rule, valid lengths and masks (a
   * key must pass all of them).  Keys outside the window are never read:
   * the cost is that of the window, not of Lk. */
  int64_t window_left;
  int64_t window_right;

  /* Attention sinks (gpt-oss): per-head logits, F32 [H] (strided), that join
   * each row's softmax denominator without a value row:
   *   out_i = sum_j e^(s_ij) v_j / (e^(sink_h) + sum_j e^(s_ij)),
   * and the LSE includes them.  A row in which no key takes part is zeros
   * with LSE sink_h.  -inf is no sink; NaN and +inf are refused.  NULL: none. */
  const mha_tensor* sinks;

  /* Logit softcap (Gemma 2): s <- softcap * tanh(s / softcap) on the scaled
   * scores, before ALiBi and the mask.  0 (the default): off; otherwise it
   * must be finite and > 0. */
  float softcap;

  /* ALiBi (BLOOM, MPT): F32 slopes [H] or [B, H] (strided); adds
   *   -slope * |i + Lk - Lq - j|
   * to the scaled (and softcapped) scores, FlashAttention-2's convention: the
   * distance to the bottom-right-aligned diagonal.  Slopes must be finite.
   * NULL: none. */
  const mha_tensor* alibi_slopes;

  /* --- added in 0.4: one block of a larger problem --- */

  /* The call computes queries [query_offset, query_offset + Lq) against keys
   * [key_offset, key_offset + Lk) of a problem of full_lq queries and full_lk
   * keys: ring attention, context parallelism, a prefill cut into chunks --
   * blocks computed apart whose results mha_merge_partials joins by their
   * LSE into exactly the full call's.  What depends on positions uses the
   * full problem's: the causal rule (either alignment, on full_lq x full_lk),
   * the window, ALiBi's distance and dropout's hash (row query_offset + i of
   * full_lq, key key_offset + j).  What the caller hands in stays this
   * call's own: valid_lens count this call's keys (0 .. Lk), the mask is
   * [.., Lq, Lk], and the sinks join this call's denominators (give them to
   * one block only, or fold them in after merging).  All 0 (the default):
   * the call is the whole problem.  full_lq = 0 means query_offset + Lq,
   * full_lk = 0 means key_offset + Lk; otherwise the block must fit:
   * offset >= 0 and offset + length <= full length.  Not taken by the varlen
   * and paged calls. */
  int64_t query_offset;
  int64_t key_offset;
  int64_t full_lq;
  int64_t full_lk;
} mha_attention_params;

MHA_API void mha_attention_params_init(mha_attention_params* params);

/*
 * out = softmax(Q·Kᵀ·scale + mask) · V, per batch and query head.
 *   q   [B, H,   Lq, D]     F32, BF16 or F16
 *   k   [B, Hkv, Lk, D]     F32, BF16, F16, or I8 with params->k_scale; H must be a
 *   v   [B, Hkv, Lk, Dv]    multiple of Hkv: query head h uses KV head h / (H / Hkv)
 *                           (grouped/multi-query attention); v has k's dtype
 *   out [B, H,   Lq, Dv]    F32 or q's dtype; must not overlap itself or any input
 * Half-precision and int8 inputs are widened to fp32 as they are read:
 * products, the softmax (running maximum and sum), accumulation and the LSE
 * are fp32; a half-precision output is rounded once, at the end (to nearest,
 * ties to even).  Backends with bf16 dot products (avx512bf16) may instead
 * multiply bf16 Q and K exactly and round the probabilities to bf16 once for
 * P·V (mha-info and MHA_VERBOSE=2 say which path ran).
 * params may be NULL (defaults).  All masks combine (causal, valid lengths,
 * mask).  A row in which no key takes part is all zeros, and its LSE is -inf:
 * never NaN.
 */
MHA_API mha_status mha_attention(const mha_tensor* q, const mha_tensor* k, const mha_tensor* v,
                                 mha_tensor* out, const mha_attention_params* params);

/* ------------------------------------------------------------ the backward pass */

/*
 * Optional outputs of mha_attention_backward.  Initialise with
 * mha_backward_params_init() (it sets struct_size; every output NULL).
 */
typedef struct mha_backward_params {
  uint32_t struct_size; /* sizeof(mha_backward_params) as the caller was compiled */
  /* The gradient of params->sinks, F32 [H] (strided); only with sinks.  NULL:
   * not wanted. */
  mha_tensor* dsinks;
  /* The gradient of an additive params->mask, F32 of the mask's own shape:
   * dL/dlogit, summed over the axes the mask broadcasts (0 where a key does
   * not take part).  NULL: not wanted. */
  mha_tensor* dmask;
} mha_backward_params;

MHA_API void mha_backward_params_init(mha_backward_params* backward);

/*
 * The gradients of mha_attention (FlashAttention-2's backward: the weights
 * are recomputed tile by tile from q, k and the LSE, so memory does not grow
 * with Lq·Lk).
 *   q, k, v, params  the forward call's, with its dtypes (params->lse is
 *                    ignored: pass the LSE as lse)
 *   out   [B, H, Lq, Dv]  the forward's output (F32 or q's dtype)
 *   lse   F32 [B, H, Lq]  the forward's LSE (params->lse of that call)
 *   dout  [B, H, Lq, Dv]  dL/dout, F32 or q's dtype (the dtypes out takes)
 *   dq    [B, H, Lq, D]     written: dL/dq, F32 or q's dtype
 *   dk    [B, Hkv, Lk, D]   written: dL/dk (summed over each group's query
 *                           heads), F32 or k's dtype
 *   dv    [B, Hkv, Lk, Dv]  written: dL/dv, F32 or v's dtype
 * Every option of the forward is taken: causal (both alignments), valid
 * lengths, bool and additive masks, dropout (the same weights dropped: the
 * counter-based rule is regenerated, never stored), the sliding window,
 * softcap (through tanh's derivative), ALiBi and sinks.  BF16 and F16 inputs
 * are widened to fp32 as they are read, as in the forward: every product and
 * sum is fp32, delta = rowsum(dout ∘ out) included (from the out given, so a
 * half-precision out rounds its terms); a half-precision gradient is
 * accumulated in fp32 and rounded once, at the end (to nearest, ties to
 * even).  int8 K and V are refused.  The results are the same bits for any
 * thread count.  A row in which no key takes part gets zero
 * gradients.  The outputs must not overlap each other or any input.
 * backward may be NULL.
 */
MHA_API mha_status mha_attention_backward(const mha_tensor* q, const mha_tensor* k,
                                          const mha_tensor* v, const mha_tensor* out,
                                          const mha_tensor* lse, const mha_tensor* dout,
                                          mha_tensor* dq, mha_tensor* dk, mha_tensor* dv,
                                          const mha_attention_params* params,
                                          const mha_backward_params* backward);

/*
 * Quantises rows to int8 with one scale per row, as mha_attention's int8 KV
 * cache wants them:
 *   src   F32, BF16 or F16 [B, Hkv, L, D]  (any strides)
 *   dst   I8 [B, Hkv, L, D]                 (must not overlap src or scale)
 *   scale F32 [B, Hkv, L]
 * Symmetric: scale = max|row| / 127 (in fp32), dst = round(x / scale) to
 * nearest, ties to even, so |x - scale · dst| <= scale / 2.  A row of zeros
 * gets scale 0 and zeros.  A row holding NaN or an infinity is refused.
 */
MHA_API mha_status mha_quantize_kv(const mha_tensor* src, mha_tensor* dst, mha_tensor* scale);

/*
 * Combines partial results of the same queries over disjoint key ranges —
 * each as mha_attention computes it over its own keys, with its LSE — into the
 * result over all the keys (the log-sum-exp merge of Flash-Decoding).  A user
 * can so split a KV cache across calls, devices or machines.
 *   outs[c] F32 [B, H, Lq, Dv], lses[c] F32 [B, H, Lq] for c < n (arrays of n
 *   descriptors); out F32 [B, H, Lq, Dv]; lse F32 [B, H, Lq] or NULL.
 * Parts are combined in order c = 0..n-1, so the result is reproducible.  A row
 * whose parts all have LSE -inf is zeros with LSE -inf.  out and lse must not
 * overlap the inputs.
 */
MHA_API mha_status mha_merge_partials(int32_t n, const mha_tensor* outs, const mha_tensor* lses,
                                      mha_tensor* out, mha_tensor* lse);

/* ------------------------------------------------ packed variable-length batches */

/*
 * A batch of B sequences of different lengths, packed without padding
 * (FlashAttention-2's varlen layout): sequence b's queries are rows
 * cu_seqlens_q[b] .. cu_seqlens_q[b+1]-1 of q, out and lse.  Its keys are
 * either rows cu_seqlens_k[b] .. cu_seqlens_k[b+1]-1 of k and v (packed), or
 * rows of the blocks of a paged KV cache that block_table names (vLLM's and
 * FlashAttention-2's paged layout).
 */
typedef struct mha_varlen_params {
  uint32_t struct_size; /* set by mha_varlen_params_init */
  /* I32 [B + 1], B >= 1: starts at 0, non-decreasing, ends at total_q (q's
   * first dimension).  Required. */
  const mha_tensor* cu_seqlens_q;
  /* I32 [B + 1]: the same for the keys, ending at total_k.  Required with
   * packed keys, refused with a paged cache. */
  const mha_tensor* cu_seqlens_k;
  /* I32 [B]: the number of keys sequence b uses.  With packed keys it is
   * optional (NULL: all of them) and at most cu_seqlens_k[b+1] -
   * cu_seqlens_k[b] (the first seqused_k[b] of its rows take part); with a
   * paged cache it is required and at most max_blocks · block_size. */
  const mha_tensor* seqused_k;
  /* I32 [B, max_blocks]: a paged KV cache (NULL: packed keys).  k and v are
   * then [num_blocks, block_size, Hkv, D] and [num_blocks, block_size, Hkv,
   * Dv], block_size a multiple of 8 (16 as vLLM, 32, 256, ...); key j of
   * sequence b is row j % block_size of block block_table[b][j / block_size].
   * The entries a sequence's keys address (the first ceil(seqused_k[b] /
   * block_size) of its row) must be in [0, num_blocks); the others are not
   * read.  Blocks may be shared between sequences (a common prefix). */
  const mha_tensor* block_table;
} mha_varlen_params;

MHA_API void mha_varlen_params_init(mha_varlen_params* varlen);

/*
 * mha_attention over each sequence of a packed batch, as if each were a call
 * of its own with B = 1 (its own Lq and Lk: causal alignment, windows and
 * ALiBi distances are the sequence's):
 *   q   [total_q, H,   D]   F32, BF16 or F16
 *   k   [total_k, Hkv, D]   as mha_attention's k (I8: params->k_scale and
 *   v   [total_k, Hkv, Dv]  v_scale are F32 [total_k, Hkv])
 *       or, paged, [num_blocks, block_size, Hkv, D / Dv] (I8: the scales are
 *       F32 [num_blocks, block_size, Hkv])
 *   out [total_q, H,   Dv]  F32 or q's dtype
 * params (NULL: defaults) as for mha_attention, except:
 *   lse           F32 [H, total_q];
 *   alibi_slopes  [H], or [B, H] per sequence;
 *   dropout       sequence b draws as a one-sequence call with the seed
 *                 dropout_seed + b (modulo 2^64);
 *   valid_lens and mask are refused (the lengths are the sequences').
 * Decoding over a paged cache is Lq = 1 per sequence; chunked prefill (Lq > 1
 * new queries at the end of the cache) wants causal with
 * MHA_CAUSAL_BOTTOM_RIGHT.  A sequence without keys gives zero rows (LSE
 * -inf, or its sink), one without queries nothing.  Work is cut per sequence
 * and balanced over the threads by cost; results are the same bits for any
 * thread count.
 */
MHA_API mha_status mha_attention_varlen(const mha_tensor* q, const mha_tensor* k,
                                        const mha_tensor* v, mha_tensor* out,
                                        const mha_varlen_params* varlen,
                                        const mha_attention_params* params);

/*
 * The gradients of mha_attention_varlen over packed keys (FlashAttention-2's
 * varlen backward): each sequence's as mha_attention_backward computes them
 * for that sequence alone, B = 1 with its own Lq and Lk, and the same bits.
 *   q, k, v, varlen, params  the forward call's (params->lse is ignored: pass
 *                            the LSE as lse); varlen->block_table is refused
 *                            (a paged cache has no backward pass)
 *   out  [total_q, H, Dv]   the forward's output (F32 or q's dtype)
 *   lse  F32 [H, total_q]   the forward's LSE
 *   dout [total_q, H, Dv]   dL/dout, F32 or q's dtype
 *   dq   [total_q, H, D]    written: F32 or q's dtype
 *   dk   [total_k, Hkv, D]  written: F32 or k's dtype
 *   dv   [total_k, Hkv, Dv] written: F32 or v's dtype
 *   backward  NULL, or its dsinks [H]: the sum of every sequence's share, in
 *             order (dmask is refused: a packed batch has no mask)
 * Key rows no query reads -- past seqused_k[b], or of a sequence without
 * queries -- get zeros, as do the query rows of a sequence without keys.
 * Work is cut per sequence and key chunk and balanced over the threads by
 * cost; the results are the same bits for any thread count.  The outputs
 * must not overlap each other or any input.
 */
MHA_API mha_status mha_attention_varlen_backward(const mha_tensor* q, const mha_tensor* k,
                                                 const mha_tensor* v, const mha_tensor* out,
                                                 const mha_tensor* lse, const mha_tensor* dout,
                                                 mha_tensor* dq, mha_tensor* dk, mha_tensor* dv,
                                                 const mha_varlen_params* varlen,
                                                 const mha_attention_params* params,
                                                 const mha_backward_params* backward);

/*
 * Writes a step's new K and V rows into their slots of a paged cache
 * (vLLM's reshape_and_cache):
 *   key          [T, Hkv, D]   F32, BF16 or F16
 *   value        [T, Hkv, Dv]  the same dtype
 *   key_cache    [num_blocks, block_size, Hkv, D]   F32, BF16, F16 or I8
 *   value_cache  [num_blocks, block_size, Hkv, Dv]  key_cache's dtype
 *   slot_mapping I32 or I64 [T]: token t goes to row slot % block_size of
 *                block slot / block_size; a negative slot skips the token
 *                (padding).  Slots must be below num_blocks · block_size and
 *                not repeat.
 *   key_scale_cache, value_scale_cache  F32 [num_blocks, block_size, Hkv]:
 *                with an I8 cache, each row's scale (rows quantised as
 *                mha_quantize_kv does); NULL otherwise.
 * Every check (finite values for an I8 cache included) runs before anything
 * is written.  The caches must not overlap the inputs or each other.
 */
MHA_API mha_status mha_kv_cache_write(const mha_tensor* key, const mha_tensor* value,
                                      mha_tensor* key_cache, mha_tensor* value_cache,
                                      const mha_tensor* slot_mapping, mha_tensor* key_scale_cache,
                                      mha_tensor* value_scale_cache);

/* ------------------------------------------------ the multi-head attention module */

/*
 * The module of "Attention is all you need" as PyTorch's nn.MultiheadAttention
 * and d2l.ai's MultiHeadAttention define it: project queries, keys and values
 * (W_q, W_k, W_v), split into heads, attend, concatenate, project (W_o).
 */
typedef struct mha_module mha_module; /* opaque */

typedef struct mha_module_config {
  uint32_t struct_size; /* set by mha_module_config_init */
  int64_t embed_dim;    /* E (d2l's num_hiddens); a multiple of num_heads */
  int64_t num_heads;
  int64_t query_dim; /* Eq, 0 = E (d2l's query_size) */
  int64_t key_dim;   /* Ek, 0 = E (PyTorch's kdim, d2l's key_size) */
  int64_t value_dim; /* Ev, 0 = E (PyTorch's vdim, d2l's value_size) */
  int32_t bias;      /* non-zero: in_proj_bias and out_proj.bias (PyTorch's default) */
  float dropout;     /* on the attention weights in training mode, [0, 1) */
  /* --- added in 0.4 --- */
  int32_t activations; /* mha_activations: what a half-precision forward call keeps between its
                          products (mha_module_forward) */
} mha_module_config;

/*
 * config.activations: where a forward call whose query is BF16 or F16 keeps
 * the values between its products.
 *   MHA_ACTIVATIONS_F32 (the default): in fp32 -- the projections, the
 *     attention and the heads' concatenation are all fp32; only out is
 *     rounded (the most accurate, and what an fp32 call on the same values
 *     gives).
 *   MHA_ACTIVATIONS_INPUT: in the query's dtype, as PyTorch's module in that
 *     dtype keeps them (module.to(torch.bfloat16)): the projections Q, K, V
 *     (biases added) are rounded once to the query's dtype, the attention
 *     runs on them as mha_attention runs on half-precision tensors (bf16
 *     products on AVX512-BF16 or AMX where the backend has them) and
 *     rounds the heads' outputs once, and the output projection reads those
 *     rounded values.  About twice as fast as F32 activations on AMX CPUs;
 *     each rounding costs up to half an ulp of the dtype (2^-9 relative for
 *     bf16).  An F32 query ignores it.  The backward pass is the F32
 *     activations' (the roundings' derivative taken as 1, as autograd
 *     takes a cast's).
 */
typedef enum mha_activations { MHA_ACTIVATIONS_F32 = 0, MHA_ACTIVATIONS_INPUT = 1 } mha_activations;

MHA_API void mha_module_config_init(mha_module_config* config);
MHA_API mha_status mha_module_create(const mha_module_config* config, mha_module** module);
MHA_API void mha_module_destroy(mha_module* module);

/*
 * Sets (copies) one weight, named as in PyTorch's state_dict:
 *   "in_proj_weight" [3E, E] (when Eq = Ek = Ev = E), or "q_proj_weight" [E, Eq],
 *   "k_proj_weight" [E, Ek], "v_proj_weight" [E, Ev]; "in_proj_bias" [3E];
 *   "out_proj.weight" [E, E]; "out_proj.bias" [E].
 * d2l's names are accepted too: "W_q.weight", "W_k.weight", "W_v.weight",
 * "W_o.weight" (and ".bias").  Weights not set are zero.  value is F32,
 * BF16 or F16, any strides; the module keeps an fp32 copy (a half-precision
 * checkpoint's values widened exactly).
 */
MHA_API mha_status mha_module_set_weight(mha_module* module, const char* name,
                                         const mha_tensor* value);

typedef struct mha_module_forward_params {
  uint32_t struct_size; /* set by mha_module_forward_params_init */
  /* d2l's valid_lens: I32/I64 [B] or [B, Lq]. */
  const mha_tensor* valid_lens;
  /* PyTorch's key_padding_mask [B, Lk]: BOOL true = the key is IGNORED (the
   * opposite of mha_attention's bool mask), or F32 (or the query's BF16 /
   * F16) added to the scores. */
  const mha_tensor* key_padding_mask;
  /* PyTorch's attn_mask [Lq, Lk] or [B*H, Lq, Lk]: BOOL true = NOT allowed
   * (PyTorch's convention), or F32 (or the query's BF16 / F16) added to the
   * scores. */
  const mha_tensor* attn_mask;
  int32_t causal; /* mha_causal */
  /* Attention weights (the only path that materialises Lq x Lk): F32 or
   * the query's dtype [B, H, Lq, Lk], or [B, Lq, Lk] averaged over heads
   * when average_attn_weights is non-zero.  NULL: not wanted. */
  mha_tensor* attn_weights;
  int32_t average_attn_weights;
  int32_t training; /* non-zero: dropout as configured */
  uint64_t dropout_seed;

  /* --- added in 0.3: the attention variants, as in mha_attention_params
   * (see there for their semantics), with H = config.num_heads, B = the
   * batch, Lq and Lk the query and key lengths.  They apply on both paths,
   * the fused one and the one that returns attn_weights; there, a row's
   * weights sum to less than 1 by the sink's share. --- */

  /* Sliding window: key j takes part in query i's row iff
   *   i + Lk - Lq - window_left <= j <= i + Lk - Lq + window_right;
   * -1 (the default) leaves a side unbounded.  Combines with causal,
   * valid_lens and the masks. */
  int64_t window_left;
  int64_t window_right;
  /* Attention sinks: F32 [H], per-head logits in each row's softmax
   * denominator without a value row.  A row in which no key takes part is
   * zeros.  -inf: no sink; NaN and +inf are refused.  NULL: none. */
  const mha_tensor* sinks;
  /* Logit softcap: s <- softcap * tanh(s / softcap) on the scaled scores,
   * before ALiBi and the masks.  0 (the default): off; else finite, > 0. */
  float softcap;
  /* ALiBi: F32 slopes [H] or [B, H], finite; adds -slope * |i + Lk - Lq - j|
   * to the scaled (and capped) scores.  NULL: none. */
  const mha_tensor* alibi_slopes;
} mha_module_forward_params;

MHA_API void mha_module_forward_params_init(mha_module_forward_params* params);

/*
 * out = module(query, key, value): query [B, Lq, Eq], key [B, Lk, Ek], value
 * [B, Lk, Ev], out [B, Lq, E], described logically as [B, L, E]: the
 * sequence-first layout [L, B, E] (PyTorch's batch_first=False) is the same
 * shape with strides {E, B*E, 1}.  Self-attention passes the same tensor three
 * times.  params may be NULL (inference, no masks).
 * query, key and value are each F32, BF16 or F16 (a half-precision input is
 * widened to fp32 as the projections read it: every product is fp32, the
 * weights are the module's fp32 copy); out is F32 or the query's dtype,
 * rounded once (to nearest, ties to even).  Where a product's weights all
 * hold bf16 values (a bf16 checkpoint) and the selected backend has AMX
 * tiles, the product runs on them: the same exact products summed in fp32,
 * in another order (subnormal values count as 0), so a result may differ in
 * the last bits from the same call without the tiles.
 */
MHA_API mha_status mha_module_forward(mha_module* module, const mha_tensor* query,
                                      const mha_tensor* key, const mha_tensor* value,
                                      mha_tensor* out, const mha_module_forward_params* params);

/*
 * The module's backward pass (training): the gradients of
 *   L = sum(dout * mha_module_forward(query, key, value, params))
 * with respect to the inputs, every weight and bias, and the sinks.
 *
 * query, key, value and params are the forward call's (the same masks, causal
 * rule, variants, and for dropout the same training flag and dropout_seed:
 * the counter-based mask is regenerated, never stored); params->attn_weights
 * must be NULL.  query, key and value are F32, BF16 or F16 (as in the
 * forward call); dout [B, Lq, E] is dL/d(out), F32 or the query's dtype.
 * Every product is fp32, on the module's fp32 weights: a half-precision
 * call gives the bits of the F32 call on the same values, its half-precision
 * gradients those rounded once (to nearest, ties to even).  The backward recomputes
 * the forward (the projections and the attention with its LSE) -- activation
 * checkpointing: nothing is kept between the two calls, and the memory is
 * O((Lq + Lk)·E), never O(Lq·Lk).  Deterministic: the same bits for any thread
 * count (mha_attention_backward's rule; BLIS never splits a product's inner
 * dimension).
 *
 * Every gradient is optional (NULL: not wanted), F32, BF16 or F16 (each
 * its own: say bf16 input gradients beside f32 weight gradients), any
 * strides, and OVERWRITTEN (not accumulated into).  The weights' gradients are named as in
 * PyTorch's state_dict; for in_proj_weight [3E, E] and in_proj_bias [3E] pass
 * views of its rows (q: rows 0..E-1, k: E..2E-1, v: 2E..3E-1).  When grads->
 * query, key and value are the same tensor (same data, shape and strides --
 * self-attention), it receives their sum; otherwise no gradient may overlap
 * another or any input.  The bias gradients need a module with biases; sinks
 * needs params->sinks.  Fails, writing nothing, on bad input.
 */
typedef struct mha_module_gradients {
  uint32_t struct_size;        /* set by mha_module_gradients_init */
  mha_tensor* query;           /* [B, Lq, Eq] */
  mha_tensor* key;             /* [B, Lk, Ek] */
  mha_tensor* value;           /* [B, Lk, Ev] */
  mha_tensor* q_proj_weight;   /* [E, Eq] */
  mha_tensor* k_proj_weight;   /* [E, Ek] */
  mha_tensor* v_proj_weight;   /* [E, Ev] */
  mha_tensor* q_proj_bias;     /* [E] */
  mha_tensor* k_proj_bias;     /* [E] */
  mha_tensor* v_proj_bias;     /* [E] */
  mha_tensor* out_proj_weight; /* [E, E] */
  mha_tensor* out_proj_bias;   /* [E] */
  mha_tensor* sinks;           /* [H] */
} mha_module_gradients;

MHA_API void mha_module_gradients_init(mha_module_gradients* grads);
MHA_API mha_status mha_module_backward(mha_module* module, const mha_tensor* query,
                                       const mha_tensor* key, const mha_tensor* value,
                                       const mha_tensor* dout,
                                       const mha_module_forward_params* params,
                                       const mha_module_gradients* grads);

/* Adds the sinusoidal positional encoding of "Attention is all you need" in
 * place to x F32 [B, L, d] (any strides, any d, odd too):
 * P[i, 2j] = sin(i / 10000^(2j/d)), P[i, 2j+1] = cos(i / 10000^(2j/d)). */
MHA_API mha_status mha_positional_encoding_add(mha_tensor* x);

/* ------------------------------------------------------------ backends */

typedef struct mha_backend_info {
  const char* name;   /* "scalar", "avx2", "avx512", "neon" */
  int32_t usable;     /* non-zero when this CPU can run it and its plugin loaded */
  int32_t priority;   /* auto picks the usable backend with the highest priority */
  const char* reason; /* why it is not usable ("" when usable) */
} mha_backend_info;

/* Number of backends known to the runtime (installed or not). */
MHA_API int32_t mha_backend_count(void);
/* Strings stay valid until the process ends. */
MHA_API mha_status mha_backend_get_info(int32_t index, mha_backend_info* info);

/* The backend calls will use: the name, or NULL when the requested one is not
 * usable (mha_last_error() then says why). */
MHA_API const char* mha_selected_backend(void);

/* Choose a backend by name ("auto" = best usable), overriding MHA_BACKEND.
 * An unknown or unusable name fails and leaves the choice unchanged. */
MHA_API mha_status mha_select_backend(const char* name);

/* Space-separated CPU features the runtime detected ("avx2 fma avx512f ..."). */
MHA_API const char* mha_cpu_features(void);

/* --- added in 0.4: tiles from the machine's caches --- */

/* The data caches one core sees, in bytes (0 when the system does not say):
 * sysfs (the instance cpu0 shares), else sysconf;
 * MHA_CACHE_SIZES="l1d=32K,l2=1M,l3=32M" (any subset)
 * overrides them, read once (a malformed value is ignored with a warning). */
typedef struct mha_cache_info {
  int64_t l1d_bytes;
  int64_t l2_bytes;
  int64_t l3_bytes;
} mha_cache_info;
MHA_API mha_status mha_cpu_caches(mha_cache_info* caches);

/* The tiles a usable backend chose for those caches (docs/kernel-design.md,
 * "Tiles from the caches"): queries x keys of a prefill tile, keys of a decode
 * tile (0: no decode orientation).  All 0 for a backend that is not usable. */
typedef struct mha_backend_tiles {
  int32_t query_tile;
  int32_t key_tile;
  int32_t decode_key_tile;
} mha_backend_tiles;
MHA_API mha_status mha_backend_get_tiles(int32_t index, mha_backend_tiles* tiles);

/* How a usable backend's decode reads a tile's K and V rows on this CPU when
 * one or two query rows share a KV head: 1 in address order, more as that
 * many streams at once (the AVX2 backend's four).  The runtime decides from
 * the CPU -- streams where its hardware prefetchers bring one stream at well
 * below the memory's rate (AMD Zen 1 to Zen 3) -- and MHA_DECODE_STREAMS
 * overrides it.  0 for a backend that is not usable. */
MHA_API mha_status mha_backend_get_decode_streams(int32_t index, int32_t* streams);

/* How a usable backend computes bf16 x bf16 products (bf16 Q with bf16 K and
 * V, prefill) on this CPU: 1 by its bf16 dot-product instructions
 * (avx512bf16's vdpbf16ps: products of bf16 pairs, P rounded to bf16 once),
 * 2 by the same products on AMX tiles (tdpbf16ps; same operands and
 * rounding), 0 on values widened to fp32, as every backend computes the
 * other dtypes.  The runtime decides from the CPU -- AMX tiles where the
 * CPU, the OS and the process's permission allow them, else widened where
 * the dot-product instructions run below the rate of fp32 FMAs (Intel's
 * cores with AVX512_BF16, measured at half of it) -- and MHA_BF16_DOT=0, 1
 * or 2 overrides it (2 only where AMX tiles are usable).  0 for a backend
 * without such a path or not usable. */
MHA_API mha_status mha_backend_get_bf16_dot(int32_t index, int32_t* bf16_dot);

/* ------------------------------------------------------------ threads */

/* Threads used inside one call.  Precedence: this setter, then MHA_NUM_THREADS,
 * then OMP_NUM_THREADS, then all cores.  n = 0 returns to the environment. */
MHA_API mha_status mha_set_num_threads(int32_t n);
MHA_API int32_t mha_get_num_threads(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* MHA_MHA_H */
