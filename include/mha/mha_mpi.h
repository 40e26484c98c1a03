/*
 * mha_mpi.h -- context-parallel attention over MPI (libmha-mpi).
 *
 * A sequence too long for one process is sharded by position across the
 * ranks of a communicator.  Two entry points, both collective (every rank of
 * the communicator calls them with the same parameters, each with its own
 * shard):
 *
 *   mha_attention_mpi_ring    prefill: Q, K and V sharded; the K/V shards
 *                             travel around the ring (non-blocking sends and
 *                             receives overlapped with the kernel), each rank
 *                             merging the partial results of its queries by
 *                             their LSE (ring attention, Liu et al. 2023).
 *   mha_attention_mpi_decode  decoding: the queries on every rank, the KV
 *                             cache sharded; each rank's partial (out, LSE) is
 *                             gathered and merged in rank order on every rank
 *                             (Flash-Decoding across processes).
 *
 * Both are exact: each rank computes blocks of the full problem with
 * mha_attention_params' block fields (query_offset, key_offset, full_lq,
 * full_lk), so the causal rule, the window, ALiBi and dropout see global
 * positions, and the result equals the single-process call up to the
 * rounding of the LSE merge.  The merge order is fixed, so a given rank count
 * gives identical bytes from run to run.
 *
 * Errors.  Every rank returns the same status: a rank whose input is bad
 * tells the others before any data moves (the message, on every rank, names
 * the rank and the argument), and nothing is written.  A kernel that fails
 * during the ring (it could not get its scratch memory) is agreed on at the
 * ring's end, so no rank is left waiting: every rank then returns
 * MHA_ERR_INTERNAL, and out and lse, in which the result is built, hold
 * partial results (as mha.h's MHA_ERR_INTERNAL says).  The message of the
 * last failed call is mha_mpi_last_error().
 *
 * Memory.  The ring keeps two K/V shards and one block's partial result per
 * calling thread between calls (as libmha keeps its scratch), so that
 * steady-state calls allocate nothing; outputs must not overlap the inputs.
 *
 * Threads: each rank computes with mha's threads (mha_set_num_threads,
 * OMP_NUM_THREADS).  MPI must be initialised; MPI_THREAD_SINGLE is enough
 * (only the calling thread calls MPI).
 */
#ifndef MHA_MHA_MPI_H
#define MHA_MHA_MPI_H

#include <mha/mha.h>
/* MPI's C API only: the C++ bindings some MPIs still ship (deprecated since
 * MPI 2.2) warn under -Wall -Wextra in C++ programs and are not used here. */
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#ifdef __cplusplus
extern "C" {
#endif

/* How a sequence of L positions is cut into the shards of N ranks. */
typedef enum mha_mpi_layout {
  /* Rank r holds one contiguous slice, the slices in rank order; any lengths
   * (0 included), each rank passing its own.  Under a causal mask the last
   * rank has the most work. */
  MHA_MPI_CONTIGUOUS = 0,
  /* Load-balanced for causal masks (zigzag, as Llama 3's context parallelism
   * and ring-flash-attention): the sequence is cut into 2N chunks, chunk c
   * being positions [c·L/(2N), (c+1)·L/(2N)) (integer division), and rank r
   * holds chunk r followed by chunk 2N-1-r.  Each rank passes its two chunks
   * back to back; their lengths must match that rule for the total L. */
  MHA_MPI_ZIGZAG = 1
} mha_mpi_layout;

/* What a call did on this rank, for benchmarks and load-balance checks. */
typedef struct mha_mpi_stats {
  double compute_seconds; /* in the attention kernels and the merges        */
  double wait_seconds;    /* waiting for K/V blocks (communication not hidden) */
  double total_seconds;   /* the whole call                                  */
  int64_t visible_pairs;  /* (query, key) pairs the causal rule and window
                             leave to this rank: its share of the work     */
  int64_t bytes_received; /* K/V (ring) or partials (decode) received       */
  int32_t steps;          /* ring steps (the rank count); 1 for decode       */
} mha_mpi_stats;

typedef struct mha_mpi_params {
  uint32_t struct_size; /* sizeof(mha_mpi_params) as the caller was compiled */
  int32_t layout;       /* mha_mpi_layout of the query and key shards (ring)  */
  mha_mpi_stats* stats; /* NULL: not wanted */
} mha_mpi_params;

/* Sets struct_size, layout = MHA_MPI_CONTIGUOUS, stats = NULL. */
MHA_API void mha_mpi_params_init(mha_mpi_params* mpi);

/*
 * Ring attention.  On each rank (N ranks, this one r):
 *   q   [B, H,   Lq_r, D]   this rank's queries   (F32, BF16 or F16)
 *   k   [B, Hkv, Lk_r, D]   this rank's keys      (q's dtype, any strides)
 *   v   [B, Hkv, Lk_r, Dv]  this rank's values
 *   out [B, H,   Lq_r, Dv]  F32 or q's dtype
 * where the shards follow mpi->layout over the full lengths Lq = Σ Lq_r and
 * Lk = Σ Lk_r.  params (NULL: defaults) are those of mha_attention over the
 * full problem: causal (either alignment, on the full lengths), scale, GQA,
 * dropout (its hash uses full positions, so the weights dropped do not
 * depend on the rank count), the window, softcap, ALiBi and sinks;
 * valid_lens as [B] (a count of the full sequence's keys) or [B, Lq_r] (this
 * rank's rows; values count full keys); params->lse, if given, is this
 * rank's F32 [B, H, Lq_r].  Not supported (refused): explicit masks, int8
 * K/V, and the block fields (the call sets them).  mpi may be NULL
 * (contiguous, no stats).
 */
MHA_API mha_status mha_attention_mpi_ring(MPI_Comm comm, const mha_tensor* q, const mha_tensor* k,
                                          const mha_tensor* v, mha_tensor* out,
                                          const mha_attention_params* params,
                                          const mha_mpi_params* mpi);

/*
 * Decoding over a KV cache sharded by position: rank r holds keys
 * [Σ_{s<r} Lk_s, Σ_{s<=r} Lk_s) of the full cache (a contiguous layout;
 * Lk_r may be 0).  q [B, H, Lq, D] is the same on every rank (its values
 * are not compared); out [B, H, Lq, Dv] (F32 or q's dtype) and params->lse
 * receive the full result on every rank.  The partials are gathered
 * (MPI_Allgather) and merged in rank order, so the result is the same on
 * every rank and from run to run.  params as for the ring; K and V may also
 * be I8 with params->k_scale / v_scale (this rank's rows).  mpi->layout is
 * ignored.
 */
MHA_API mha_status mha_attention_mpi_decode(MPI_Comm comm, const mha_tensor* q,
                                            const mha_tensor* k_shard, const mha_tensor* v_shard,
                                            mha_tensor* out, const mha_attention_params* params,
                                            const mha_mpi_params* mpi);

/*
 * The positions of a sequence of `length` that rank `rank` of `ranks` holds
 * under `layout`, as the runs [starts[i], starts[i] + lengths[i]) in the
 * order the rank passes them back to back: MHA_MPI_ZIGZAG's chunks rank and
 * 2·ranks-1-rank (two runs, either possibly empty); for MHA_MPI_CONTIGUOUS
 * the even split [length·rank/ranks, length·(rank+1)/ranks) (one run; the
 * ring takes any other contiguous split too).  Returns the number of runs,
 * or -1 (and nothing written) for a layout, length or rank out of range.
 */
MHA_API int32_t mha_mpi_shard_rows(int32_t layout, int64_t length, int32_t rank, int32_t ranks,
                                   int64_t starts[2], int64_t lengths[2]);

/* The message of the last failed mha_*_mpi call on this thread ("" if none). */
MHA_API const char* mha_mpi_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* MHA_MHA_MPI_H */
