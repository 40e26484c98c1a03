/*
 * The contract between libmha and its backend plugins.
 *
 * A plugin is a shared object libmha-backend-<name>.so exporting one C symbol,
 * mha_plugin_entry, that returns a static table.  Calling it must be safe on
 * any CPU: the plugin runs no ISA-specific code (and no global constructors)
 * until the runtime has checked required_cpu_features and called init.
 *
 * Plugins compute, the runtime decides: it validates input, resolves defaults,
 * splits the call into work items (batch, query heads, query range, key range)
 * and runs them over its threads.  A kernel computes one work item on the
 * calling thread, in the scratch memory the runtime hands it, and never
 * allocates or starts threads.
 */
#ifndef MHA_PLUGIN_ABI_H
#define MHA_PLUGIN_ABI_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped whenever any struct below changes layout or meaning.
 * 2: mha_kernel_problem starts with struct_size; mha_plugin ends with supports.
 * 3: dtypes -- q, k, v untyped with their dtypes, int8 row scales, the
 *    output's dtype in the work item.
 * 4: mha_plugin ends with path (which arithmetic a problem takes).
 * 5: mha_kernel_problem ends with lower_diag (the sliding window's left
 *    edge); causal_diag includes the window's right edge.
 * 6: mha_kernel_problem ends with the score variants: softcap, ALiBi slopes,
 *    sinks.
 * 7: mha_kernel_problem ends with the paged KV cache: block_table,
 *    block_table_stride, block_size; a decode-layout item may span several
 *    KV heads.
 * 8: the backward pass: mha_backward_problem, mha_backward_item; mha_plugin
 *    ends with backward_scratch_bytes and backward.
 * 9: mha_kernel_problem ends with a block's positions in the full problem:
 *    query_offset, key_offset, full_lq (dropout's hash), alibi_diag.
 * 10: tiles from the machine: mha_plugin ends with choose_tiles, which the
 *    runtime calls once with the caches it detected (mha_cache_sizes).
 * 11: the rows layout (MHA_LAYOUT_ROWS) for tiny problems.
 * 12: mha_work_item ends with kv_new: whether the thread running the item
 *    read other keys just before it.
 * 13: mha_kernel_problem ends with kv_streamed: whether the call's K and V
 *    outgrow the last-level cache.
 * 14: mha_plugin ends with gemm_ukernel (mha_gemm_ukernel): a micro-kernel
 *    for the module's matrix products, run inside BLIS's framework.
 * 15: mha_tile_sizes ends with decode_key_streams: whether the decode reads
 *    a tile's rows as several streams, which the runtime decides from the
 *    CPU.
 * 16: mha_tile_sizes ends with bf16_dot: whether bf16 products use the
 *    plugin's bf16 dot-product instructions, which the runtime decides from
 *    the CPU.
 * 17: bf16_dot 2: the bf16 products on AMX tiles (MHA_CPU_AMX_BF16).
 * 18: mha_work_item ends with next: the item the thread most likely runs
 *    after this one.
 * 19: mha_plugin ends with bf16_gemm (mha_bf16_gemm): the module's bf16
 *    matrix products on AMX tiles.
 * 20: mha_bf16_gemm ends with run_to_bf16 (C in bf16: the module's
 *    activations in bf16).
 * 21: mha_plugin ends with narrow_floats (fp32 values rounded to bf16 or
 *    f16 in the plugin's vectors: the module's activations in half
 *    precision).
 * 22: run_to_bf16 takes c_slab and c_slab_stride (C's columns in slabs: the
 *    module's half-precision projections written head-major); run and
 *    run_to_bf16 also serve a plugin that answered bf16_dot 1 (with its bf16
 *    dot products). */
#define MHA_PLUGIN_ABI_VERSION 22
#define MHA_PLUGIN_ENTRY_SYMBOL "mha_plugin_entry"

/* CPU features, as the runtime detects them (OS support included). */
enum mha_cpu_feature {
  MHA_CPU_SSE2 = 1u << 0,
  MHA_CPU_AVX = 1u << 1, /* CPU and OS (XCR0 YMM state) */
  MHA_CPU_FMA = 1u << 2,
  MHA_CPU_AVX2 = 1u << 3,
  MHA_CPU_AVX512F = 1u << 4, /* CPU and OS (XCR0 opmask and ZMM state) */
  MHA_CPU_AVX512CD = 1u << 5,
  MHA_CPU_AVX512DQ = 1u << 6,
  MHA_CPU_AVX512BW = 1u << 7,
  MHA_CPU_AVX512VL = 1u << 8,
  MHA_CPU_AVX512BF16 = 1u << 9,
  MHA_CPU_F16C = 1u << 10,     /* vcvtph2ps / vcvtps2ph (with AVX state) */
  MHA_CPU_AMX_BF16 = 1u << 11, /* AMX tiles with bf16 products: CPU, OS (XCR0 tile
                                  state) and this process's permission (Linux) */
  MHA_CPU_NEON = 1u << 16,     /* aarch64 Advanced SIMD */
  MHA_CPU_ARCH_X86_64 = 1u << 30,
  MHA_CPU_ARCH_AARCH64 = 1u << 31
};

/* How the kernel lays its vector lanes, chosen by the runtime from the shape. */
enum mha_kernel_layout {
  MHA_LAYOUT_QUERY_LANES = 0, /* prefill: lanes along queries, tiles of queries x keys   */
  MHA_LAYOUT_DECODE = 1,      /* few queries: lanes along the head dimension, the query
                                 heads sharing one KV head (and their queries) as rows   */
  MHA_LAYOUT_ROWS = 2         /* tiny problems (at most 16 keys, 8 queries): one query
                                 row at a time, lanes along the keys; an item holds
                                 several heads of one batch, all their queries and keys  */
};

enum mha_mask_kind { MHA_MASK_NONE = 0, MHA_MASK_BOOL = 1, MHA_MASK_ADDITIVE = 2 };

/*
 * One validated call.  Pointers address element [0,0,0,0]; strides are in
 * elements, in the order [batch, head, sequence, feature] (0 where broadcast).
 * Fields are only ever added at the end; struct_size says how many this
 * runtime filled, so a plugin built against a newer header can tell.
 */
typedef struct mha_kernel_problem {
  uint32_t struct_size; /* sizeof(mha_kernel_problem) as the runtime was built */
  const void* q;        /* q_dtype: F32, BF16 or F16                             */
  const void* k;        /* kv_dtype: F32, BF16, F16, or I8 with k_scale           */
  const void* v;        /* kv_dtype, with v_scale when I8                         */
  int64_t q_strides[4];
  int64_t k_strides[4];
  int64_t v_strides[4];

  int64_t batch, heads, kv_heads; /* heads % kv_heads == 0 */
  int64_t lq, lk, d, dv;

  float scale;         /* resolved: finite, non-zero */
  int32_t layout;      /* mha_kernel_layout */
  int64_t causal_diag; /* key j is allowed for query i iff j <= i + causal_diag:
                          the causal rule and the sliding window's right edge
                          (INT64_MAX / 4 when neither applies) */

  /* valid lengths (already range-checked): element at [b * s0 + i * s1] */
  const void* valid_lens; /* NULL: none */
  int32_t valid_lens_is_i64;
  int64_t valid_lens_strides[2]; /* [batch, query]; query stride 0 for per-batch lengths */

  const void* mask;  /* NULL: none; element [b,h,i,j] at mask_strides · (b,h,i,j) */
  int32_t mask_kind; /* mha_mask_kind */
  int64_t mask_strides[4];
  int32_t mask_dtype; /* BOOL, or F32 / BF16 / F16 for an additive mask */

  float dropout_p; /* 0: none */
  uint64_t dropout_seed;

  int32_t q_dtype;  /* mha_dtype of q */
  int32_t kv_dtype; /* mha_dtype of k and v */
  /* int8 K and V: value = scale · int8, the scale of row (b, kvh, j) at
   * [b · s0 + kvh · s1 + j · s2]; NULL otherwise. */
  const float* k_scale;
  int64_t k_scale_strides[3];
  const float* v_scale;
  int64_t v_scale_strides[3];

  /* ABI 5: the sliding window's left edge: key j is allowed for query i only
   * if j >= i + lower_diag (-(INT64_MAX / 4) when unbounded).  The runtime
   * starts every item at or after its first query's first key. */
  int64_t lower_diag;

  /* ABI 6: the score variants, applied in this order to the scaled score s of
   * query i and key j:
   *   softcap:  s <- softcap · tanh(s / softcap)        (0: off)
   *   ALiBi:    s <- s - slope(b, h) · |i + lk - lq - j| (alibi_slopes NULL: off;
   *             the slope of (b, h) at [b · s0 + h · s1])
   *   then the mask.  sinks (NULL: none): head h's sink logit at
   *   [h · sinks_stride] joins each of its rows' denominators (-inf: none);
   *   a row without keys then gets zeros and LSE = the sink.  For split-KV
   *   partials the runtime passes sinks = NULL and adds them when it merges. */
  float softcap;
  const float* alibi_slopes;
  int64_t alibi_strides[2];
  const float* sinks;
  int64_t sinks_stride;

  /* ABI 7: a paged K/V cache (NULL: K and V are addressed by their strides
   * alone).  Key j of batch b is then row j % block_size of block
   * block_table[b · block_table_stride + j / block_size]: its first element
   * is at block · k_strides[0] + kvh · k_strides[1] + (j % block_size) ·
   * k_strides[2] (likewise V, and the int8 scales with their strides [0] and
   * [2]).  block_size is a multiple of 8, so keys in a run of 8 from a
   * multiple of 8 share a block.  The runtime has checked every block id a
   * key before lk addresses; entries past them may hold anything and must not
   * be read. */
  const int32_t* block_table;
  int64_t block_table_stride;
  int64_t block_size;
  /* ABI 9: the call as a block of a larger problem (mha_attention_params'
   * query_offset, ...): query i is row query_offset + i of full_lq, key j is
   * key key_offset + j.  causal_diag and lower_diag already count in this
   * call's indices.  ALiBi's distance of query i to key j is
   * |i - j + alibi_diag| (lk - lq for a whole problem); dropout hashes row
   * query_offset + i of full_lq and key key_offset + j (common/problem.h's
   * dropout_row_key folds the key offset into the row's key).  0, 0, lq and
   * lk - lq for a whole problem. */
  int64_t query_offset;
  int64_t key_offset;
  int64_t full_lq;
  int64_t alibi_diag;
  /* ABI 13: 1 when the K and V of everything the runtime runs together (all
   * the problems of one mha_attention or mha_attention_varlen call) outgrow
   * the CPU's last-level cache, so that they come from memory on every call;
   * 0 when they may stay in it from one call to the next.  A hint for the
   * order of reads, like kv_new: a result never depends on it. */
  int32_t kv_streamed;
} mha_kernel_problem;

/*
 * One unit of work: batch b, query heads [h_begin, h_end), queries [q_begin,
 * q_end), keys [k_begin, k_end).  In the query-lane layout one head or a
 * few (short sequences); in the decode layout the heads that share one KV
 * head, or every head when K and V are token-major (common/problem.h's
 * decode_heads_per_item, which also sizes the decode kernel's scratch).
 *
 * The order of items.  The runtime numbers a call's items by (batch, head
 * group), then query tiles from the last to the first (the costliest first
 * under a causal mask), then key chunks; each thread takes the lowest item not
 * yet taken.  So the item a thread runs next is most likely the one numbered
 * after its current one -- the previous query tile of the same heads, which
 * reads the same K and V -- and a kernel may prefetch for it (the next head's
 * rows, for an item of several heads).  That is a hint only: a kernel's result
 * never depends on which item comes next, or on which thread runs it.
 *
 * The kernel writes each row normalised over its key range only: row (h, i)
 * to out + (h - h_begin) * out_strides[0] + (i - q_begin) * out_strides[1]
 * (+ feature * out_strides[2]), and, when lse is not NULL, the natural log of
 * its softmax denominator to lse + (h - h_begin) * lse_strides[0] + (i - q_begin)
 * * lse_strides[1].  A row with no key taking part gets zeros and -inf.  The
 * runtime merges items that split one row's keys by their LSE.
 *
 * kv_new (ABI 12): 1 when the thread running this item did not run an item of
 * the same call, batch, head group and key range just before it -- the item's
 * first heads' K and V are then most likely not in this core's caches, and a
 * kernel may fetch them ahead of their use; 0 otherwise.  A hint only, like
 * the order above.
 *
 * next (ABI 18): the item of the same call this thread most likely runs after
 * this one (the one `threads` items on in the order above), or NULL when there
 * is none or it reads the same keys (same batch, head group and key range).  A
 * kernel may request its K, V and first Q rows while it computes this one, so
 * that they are in this core's caches when it starts.  A hint only: another
 * thread may take that item, so a kernel only prefetches the rows it names
 * (never loads them), and its result never depends on it.  Valid during the
 * call to attend only.
 */
typedef struct mha_work_item {
  int64_t b;
  int64_t h_begin, h_end;
  int64_t q_begin, q_end;
  int64_t k_begin, k_end;
  void* out; /* out_dtype */
  int64_t out_strides[3];
  float* lse;
  int64_t lse_strides[2];
  int32_t out_dtype;                /* F32, BF16 or F16 (split-KV partials are always F32) */
  int32_t kv_new;                   /* ABI 12: see above */
  const struct mha_work_item* next; /* ABI 18: see above; may be NULL */
} mha_work_item;

/*
 * ABI 8: one validated backward call -- the forward's problem (its q, k, v,
 * masks, variants, dropout and scale) plus what the gradients need.  Strides
 * in elements: dout [batch, head, query, feature], lse and delta [batch,
 * head, query].
 */
typedef struct mha_backward_problem {
  uint32_t struct_size; /* sizeof(mha_backward_problem) as the runtime was built */
  const mha_kernel_problem* forward;
  const void* dout; /* dO, dout_dtype (F32, BF16, F16) [B, H, Lq, Dv] */
  int64_t dout_strides[4];
  int32_t dout_dtype;
  const float* lse; /* the forward's natural-log LSE (sinks included); -inf: no key */
  int64_t lse_strides[3];
  const float* delta; /* rowsum(dO ∘ O) per row, in fp32 */
  int64_t delta_strides[3];
} mha_backward_problem;

/*
 * One unit of backward work: batch b, KV head kv_head (and every query head
 * of its group), keys [k_begin, k_end), every query that sees one of them.
 * The kernel
 *   - writes (=) dK and dV of its keys, summed over the group's query heads:
 *     key j's row at dk + (j - k_begin) * dk_strides[0] (+ feature *
 *     dk_strides[1]), likewise dv;
 *   - adds (+=) its keys' share of dQ to row (h, i) at dq + (h - h0) *
 *     dq_strides[0] + i * dq_strides[1] (+ feature * dq_strides[2]), h0 the
 *     group's first query head (dq holds what earlier key ranges added, or 0);
 *   - when dmask is not NULL, writes (=) dL/dlogit of every pair (h, i, j) of
 *     its keys to dmask + (h - h0) * dmask_strides[0] + i * dmask_strides[1]
 *     + (j - k_begin) * dmask_strides[2] (0 where the key does not take part).
 * Everything is fp32 (Q, K, V and dO of a half dtype are widened as they are
 * read; a half-precision gradient is the runtime's to round: it hands the
 * kernel fp32 buffers).  Items of the same batch and KV head with other key
 * ranges run on other threads: a kernel writes nothing else.  Their order of
 * summation is the kernel's own -- fixed, never dependent on the thread.
 */
typedef struct mha_backward_item {
  int64_t b, kv_head;
  int64_t k_begin, k_end;
  float* dq;
  int64_t dq_strides[3];
  float* dk;
  int64_t dk_strides[2];
  float* dv;
  int64_t dv_strides[2];
  float* dmask;
  int64_t dmask_strides[3];
} mha_backward_item;

/* ABI 10: the data caches of the CPU the runtime runs on, in bytes (0 when
 * unknown), as one core sees them: sysfs, else sysconf, else MHA_CACHE_SIZES
 * (which overrides both). */
typedef struct mha_cache_sizes {
  int64_t l1d;
  int64_t l2;
  int64_t l3;
} mha_cache_sizes;

/* ABI 10: the tiles a plugin works with on this machine.  The runtime plans
 * work items with query_tile and key_tile (split-KV chunks are multiples of
 * key_tile); decode_key_tile is informative (mha-info prints it; 0: none).
 * ABI 15: decode_key_streams is, on the way in, what the runtime asks for
 * on this CPU -- 1: a decode tile's rows read in address order; more: as
 * that many streams at once, for CPUs whose hardware prefetchers bring one
 * stream of rows at well below the memory's rate -- and on the way out what
 * the kernels do (1 where the plugin has no streams).
 * ABI 16: bf16_dot is, on the way in, whether the runtime wants bf16 x bf16
 * products computed by the plugin's bf16 dot-product instructions on this
 * CPU (1) or on values widened to fp32 (0: where those instructions run
 * below the rate of fp32 FMAs), and on the way out what the kernels do (0
 * where the plugin has no such path).
 * ABI 17: bf16_dot 2 asks for (and answers) the same products on AMX tiles
 * (tdpbf16ps), which the runtime asks for only where the CPU, the OS and
 * the process's permission allow them (MHA_CPU_AMX_BF16): a plugin never
 * enters AMX code on its own. */
typedef struct mha_tile_sizes {
  int32_t query_tile;
  int32_t key_tile;
  int32_t decode_key_tile;
  int32_t decode_key_streams;
  int32_t bf16_dot;
} mha_tile_sizes;

/* ABI 14: a micro-kernel for the module's matrix products.  The runtime runs
 * them in BLIS's framework (its blocking, packing and threads) and, when the
 * BLIS kernel set in use packs its panels for the same C tile and the same
 * orientation, with this micro-kernel in place of BLIS's own. */
typedef struct mha_gemm_ukernel {
  int32_t mr;        /* rows of the C tile (1 to 64) */
  int32_t nr;        /* columns of the C tile (1 to 64) */
  int32_t row_major; /* 1: its vectors run along C's rows (BLIS: "prefers rows"); 0: columns */
  /* C = beta·C + alpha·A·B on an m x n corner of the tile (m <= mr, n <= nr),
   * k >= 0 terms: element (i, p) of A at a[p·mr + i], (p, j) of B at
   * b[p·nr + j] (BLIS's packed panels), (i, j) of C at c[i·rs_c + j·cs_c].
   * beta == 0 writes C without reading it.  next_a and next_b are the panels
   * of the next call (the kernel may request them early), or NULL. */
  void (*run)(int64_t m, int64_t n, int64_t k, float alpha, const float* a, const float* b,
              float beta, float* c, int64_t rs_c, int64_t cs_c, const float* next_a,
              const float* next_b);
} mha_gemm_ukernel;

/* ABI 19: the module's matrix products on the plugin's AMX tiles: C = A · B
 * + bias with B = Wᵀ, W a Linear layer's weight [n][k] holding bf16 values,
 * and A bf16 (run) or fp32 split exactly into three bf16 parts (run_split)
 * -- exact products summed in fp32 (subnormal inputs count as 0).  The
 * runtime calls these only where the plugin answered bf16_dot 2 in
 * choose_tiles (AMX granted), or (ABI 22) run and run_to_bf16 where it
 * answered 1: the same products with the plugin's bf16 dot products, on
 * the same packed weights.  They fail (return non-zero, write nothing)
 * otherwise. */
typedef struct mha_bf16_gemm {
  /* Bytes of B packed for the products (pack's output). */
  size_t (*packed_bytes)(int64_t n, int64_t k);
  /* Packs B from fp32 values: element (p, j) of B (= W[j][p]) at wt[p·ld + j],
   * rounded to bf16 (to nearest, ties to even). */
  void (*pack)(int64_t n, int64_t k, const float* wt, int64_t ld, void* packed);
  /* Bytes of scratch (64-byte aligned) one call of run needs for this k. */
  size_t (*scratch_bytes)(int64_t k);
  /* Rows [0, m) of C (fp32, rows ldc floats apart) = A (bf16 bits, rows lda
   * elements apart, unit column stride) · B + bias (fp32 [n], or NULL).
   * Returns 0.  Reentrant: threads call it on their own rows and scratch. */
  int (*run)(int64_t m, int64_t n, int64_t k, const uint16_t* a, int64_t lda, const void* packed,
             const float* bias, float* c, int64_t ldc, void* scratch);
  /* The same with A fp32 (rows lda floats apart), and its scratch. */
  size_t (*split_scratch_bytes)(int64_t k);
  int (*run_split)(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const void* packed,
                   const float* bias, float* c, int64_t ldc, void* scratch);
  /* run with C in bf16: each fp32 sum rounded once (to nearest, ties to
   * even; a NaN stays NaN).  C's columns lie in slabs of c_slab columns
   * (c_slab >= 1; n or more: one slab, the plain layout), c_slab_stride
   * elements apart: element (i, j) at c[(j / c_slab) * c_slab_stride +
   * i * ldc + j % c_slab] -- the module's projections as [heads][rows][D].
   * run's scratch. */
  int (*run_to_bf16)(int64_t m, int64_t n, int64_t k, const uint16_t* a, int64_t lda,
                     const void* packed, const float* bias, uint16_t* c, int64_t ldc,
                     int64_t c_slab, int64_t c_slab_stride, void* scratch);
} mha_bf16_gemm;

typedef struct mha_plugin {
  uint32_t abi_version; /* MHA_PLUGIN_ABI_VERSION: read first, before anything else */
  uint32_t struct_size; /* sizeof(mha_plugin) */
  const char* name;
  const char* description;
  uint32_t required_cpu_features; /* mha_cpu_feature bits; all must be present */
  int32_t priority;               /* auto mode picks the highest usable */
  int32_t vector_floats;          /* floats per vector register (1 for scalar) */
  int32_t query_tile;             /* queries per work item the kernel works best with */
  int32_t key_tile;               /* keys per inner tile; split-KV chunks are multiples */

  /* Called once, after the feature check, before any kernel.  Returns 0 when
   * ready; otherwise writes why into message and the backend is unusable.  NULL
   * when there is nothing to prepare. */
  int (*init)(char* message, size_t message_size);

  /* Bytes of scratch one thread needs for any work item of this problem whose
   * query range is at most max_queries long (64-byte aligned memory is given). */
  size_t (*scratch_bytes)(const mha_kernel_problem* problem, int64_t max_queries);

  /* Computes one work item.  Returns 0 on success. */
  int (*attend)(const mha_kernel_problem* problem, const mha_work_item* item, void* scratch);

  /* Whether this plugin can compute a (validated) problem: returns 1, or 0
   * with why in reason (a dtype or a variant it does not implement).  The
   * runtime then fails the call with MHA_ERR_UNSUPPORTED and that reason,
   * instead of guessing what a plugin can do.  NULL: every problem. */
  int (*supports)(const mha_kernel_problem* problem, char* reason, size_t reason_size);

  /* The name of the arithmetic attend uses for a (validated, laid-out)
   * problem -- a static string without spaces or commas, e.g. "fp32",
   * "widened-to-fp32", "bf16-dot" -- for MHA_VERBOSE=2's path= field.  NULL:
   * the runtime names it from the dtypes ("fp32" or "widened-to-fp32"). */
  const char* (*path)(const mha_kernel_problem* problem);

  /* ABI 8: the backward pass (NULL: the plugin has none; the runtime then
   * fails a backward call with MHA_ERR_UNSUPPORTED).  Bytes of scratch one
   * thread needs for any item of the problem, and one item (returns 0). */
  size_t (*backward_scratch_bytes)(const mha_backward_problem* problem);
  int (*backward)(const mha_backward_problem* problem, const mha_backward_item* item,
                  void* scratch);

  /* ABI 10: chooses the tiles for this machine's caches.  Called once, after
   * init and before any kernel, with tiles holding the table's query_tile and
   * key_tile (and decode_key_tile 0); the plugin's kernels use what it writes
   * there from then on.  NULL: the table's tiles. */
  void (*choose_tiles)(const mha_cache_sizes* caches, mha_tile_sizes* tiles);

  /* ABI 14: the module's matrix-product micro-kernel (mha_gemm_ukernel).
   * NULL: BLIS's own kernels. */
  const mha_gemm_ukernel* gemm_ukernel;

  /* ABI 19: the module's bf16 matrix products (mha_bf16_gemm).  NULL: none
   * (the runtime widens to fp32 for BLIS). */
  const mha_bf16_gemm* bf16_gemm;

  /* ABI 21: n fp32 values rounded once to dtype (MHA_DTYPE_BF16 or
   * MHA_DTYPE_F16: to nearest, ties to even, a NaN stays NaN) into dst's n
   * elements.  Reentrant.  NULL: the runtime rounds them itself. */
  void (*narrow_floats)(const float* src, int64_t n, void* dst, int32_t dtype);
} mha_plugin;

typedef const mha_plugin* (*mha_plugin_entry_fn)(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* MHA_PLUGIN_ABI_H */
