// mha_bench_mpi: ring attention on localhost against the single-process call,
// in one run (issue 19's yardstick).  Run it as
//   mpirun -np 2 --bind-to none mha_bench_mpi [--repeat N] [S2 S6 ...]
// with one thread per rank (OMP_NUM_THREADS=1).  For each shape it prints
// one JSON line (rank 0):
//   ring_ms       the ring call (zigzag layout), slowest rank, median
//   single_ms     mha_attention on the whole problem in one process with as
//                 many threads as there are ranks, the other ranks idle
//   speed         single / ring, the median over pairs of calls made one
//                 right after the other (1 = the distribution costs nothing)
//   compute_ms, wait_ms   per rank (the busiest rank's median; the largest
//                 wait): in the kernels and merges, and waiting for K/V
//                 (communication not hidden)
//   compute_min_ms, balance   the idlest rank's median compute, and its
//                 ratio to the busiest's (1: perfectly balanced)
//   transfer_ms   one step's K/V shard sent around the ring alone
//   hidden        1 - wait / (transfer · (N-1)): the part of the
//                 communication the kernels hid
//   step_compute_ms   compute_ms / N: one step's blocks on one rank
//   shard_mb, link_gbps   one step's K/V shard, and the rate the transfer
//                 above moved it at (Gbit/s)
//   model_hidden  min(1, step_compute / transfer): the share of the transfer
//                 README's model says the kernels hide, to set beside
//                 `hidden`
#include <mha/mha.h>
#include <mha/mha_mpi.h>
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

namespace {

struct Shape {
  const char* name;
  int64_t batch, heads, kv_heads, length, d;
};
// ../shared/bench-shapes.md: the causal prefill shapes.
constexpr Shape kShapes[] = {{"S2", 1, 32, 32, 2048, 128}, {"S6", 1, 8, 8, 8192, 64}};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::vector<float> random_floats(size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

mha_tensor tensor4(float* data, int64_t a, int64_t b, int64_t c, int64_t d) {
  mha_tensor t{};
  const int64_t shape[4] = {a, b, c, d};
  mha_tensor_init(&t, data, MHA_DTYPE_F32, 4, shape, nullptr);
  return t;
}

void check(mha_status status, const char* what) {
  if (status == MHA_OK) return;
  std::fprintf(stderr, "mha_bench_mpi: %s failed: %s %s\n", what, mha_last_error(),
               mha_mpi_last_error());
  MPI_Abort(MPI_COMM_WORLD, 1);
}

// Waits for rank 0 without spinning, so that its threads have the cores.
void idle_until_rank0_done(MPI_Comm comm) {
  MPI_Request request;
  MPI_Ibarrier(comm, &request);
  int done = 0;
  while (!done) {
    usleep(2000);
    MPI_Test(&request, &done, MPI_STATUS_IGNORE);
  }
}

void run_shape(const Shape& s, int repeat, int rank, int ranks) {
  const int64_t chunks = 2 * ranks, length = s.length;
  auto begin = [&](int64_t c) { return c * length / chunks; };
  const int64_t rows =
      begin(rank + 1) - begin(rank) + begin(chunks - rank) - begin(chunks - 1 - rank);
  std::vector<float> q =
      random_floats(static_cast<size_t>(s.batch * s.heads * rows * s.d), 1u + rank);
  std::vector<float> k =
      random_floats(static_cast<size_t>(s.batch * s.kv_heads * rows * s.d), 7u + rank);
  std::vector<float> v = random_floats(k.size(), 13u + rank);
  std::vector<float> out(q.size());
  mha_tensor qt = tensor4(q.data(), s.batch, s.heads, rows, s.d);
  mha_tensor kt = tensor4(k.data(), s.batch, s.kv_heads, rows, s.d);
  mha_tensor vt = tensor4(v.data(), s.batch, s.kv_heads, rows, s.d);
  mha_tensor ot = tensor4(out.data(), s.batch, s.heads, rows, s.d);
  mha_attention_params params;
  mha_attention_params_init(&params);
  params.causal = MHA_CAUSAL_TOP_LEFT;
  mha_mpi_stats stats{};
  mha_mpi_params mpi;
  mha_mpi_params_init(&mpi);
  mpi.layout = MHA_MPI_ZIGZAG;
  mpi.stats = &stats;

  // The whole problem for the single-process call (rank 0 only).
  std::vector<float> fq, fk, fv, fo;
  mha_tensor a{}, b{}, c{}, o{};
  if (rank == 0) {
    fq = random_floats(static_cast<size_t>(s.batch * s.heads * length * s.d), 3);
    fk = random_floats(static_cast<size_t>(s.batch * s.kv_heads * length * s.d), 5);
    fv = random_floats(fk.size(), 9);
    fo.resize(fq.size());
    a = tensor4(fq.data(), s.batch, s.heads, length, s.d);
    b = tensor4(fk.data(), s.batch, s.kv_heads, length, s.d);
    c = tensor4(fv.data(), s.batch, s.kv_heads, length, s.d);
    o = tensor4(fo.data(), s.batch, s.heads, length, s.d);
  }

  // The two alternate, one ring call then one single-process call, so that
  // a drift of the machine's speed (these VMs are shared) hits both alike;
  // `speed` is the median of the per-pair ratios.  One untimed round first.
  std::vector<double> ring_ms, single_ms, ratios;
  std::vector<double> compute_ms_of_rank;  // this rank's, per repetition
  double wait = 0;
  for (int r = -1; r < repeat; ++r) {
    check(mha_set_num_threads(1), "mha_set_num_threads");
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = MPI_Wtime();
    check(mha_attention_mpi_ring(MPI_COMM_WORLD, &qt, &kt, &vt, &ot, &params, &mpi), "the ring");
    double mine = (MPI_Wtime() - t0) * 1e3, slowest = 0;
    MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    if (r >= 0) {
      ring_ms.push_back(slowest);
      compute_ms_of_rank.push_back(stats.compute_seconds * 1e3);
      wait = std::max(wait, stats.wait_seconds * 1e3);
    }
    // The single-process call with as many threads as there are ranks, the
    // other ranks asleep.
    if (rank == 0) {
      check(mha_set_num_threads(ranks), "mha_set_num_threads");
      const double t1 = MPI_Wtime();
      check(mha_attention(&a, &b, &c, &o, &params), "the single-process call");
      if (r >= 0) {
        single_ms.push_back((MPI_Wtime() - t1) * 1e3);
        ratios.push_back(single_ms.back() / slowest);
      }
    }
    idle_until_rank0_done(MPI_COMM_WORLD);  // (rank 0 passes at once)
  }
  // The ranks' median compute times: the busiest and the idlest (the load
  // balance of the layout).
  const double compute = median(compute_ms_of_rank);
  double compute_max = 0, compute_min = 0, wait_max = 0;
  MPI_Allreduce(&compute, &compute_max, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  MPI_Allreduce(&compute, &compute_min, 1, MPI_DOUBLE, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(&wait, &wait_max, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);

  // One step's K/V shard around the ring, alone.
  std::vector<char> send(static_cast<size_t>(2 * k.size() * sizeof(float))), recv(send.size());
  std::vector<double> transfer_ms;
  for (int r = 0; r < 3; ++r) {
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = MPI_Wtime();
    MPI_Sendrecv(send.data(), static_cast<int>(send.size()), MPI_BYTE, (rank + 1) % ranks, 5,
                 recv.data(), static_cast<int>(recv.size()), MPI_BYTE, (rank + ranks - 1) % ranks,
                 5, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    transfer_ms.push_back((MPI_Wtime() - t0) * 1e3);
  }

  if (rank == 0) {
    const double ring = median(ring_ms), transfer = median(transfer_ms);
    const double single = median(single_ms), speed = median(ratios);
    const double flops = 2.0 * static_cast<double>(2 * s.d) *
                         static_cast<double>(s.batch * s.heads) * static_cast<double>(length) *
                         static_cast<double>(length + 1) / 2.0;
    const double exposed = transfer * (ranks - 1);
    const double shard_bytes = static_cast<double>(send.size());
    const double step_compute = compute_max / ranks;
    std::printf(
        "{\"shape\":\"%s\",\"ranks\":%d,\"threads_per_rank\":1,\"layout\":\"zigzag\","
        "\"backend\":\"%s\",\"ring_ms\":%.3f,\"single_ms\":%.3f,\"single_threads\":%d,"
        "\"speed\":%.3f,\"compute_ms\":%.3f,\"wait_ms\":%.3f,\"transfer_ms\":%.3f,"
        "\"hidden\":%.3f,\"ring_gflops\":%.1f,\"single_gflops\":%.1f,"
        "\"step_compute_ms\":%.3f,\"shard_mb\":%.2f,\"link_gbps\":%.2f,"
        "\"model_hidden\":%.3f,\"compute_min_ms\":%.3f,\"balance\":%.3f}\n",
        s.name, ranks, mha_selected_backend(), ring, single, ranks, speed, compute_max, wait_max,
        transfer, exposed > 0 ? std::max(0.0, 1.0 - wait_max / exposed) : 1.0, flops / ring * 1e-6,
        flops / single * 1e-6, step_compute, shard_bytes / 1e6,
        transfer > 0 ? shard_bytes * 8 / (transfer * 1e6) : 0.0,
        transfer > 0 ? std::min(1.0, step_compute / transfer) : 1.0, compute_min,
        compute_max > 0 ? compute_min / compute_max : 1.0);
    std::fflush(stdout);
  }
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  int repeat = 3;
  std::vector<std::string> wanted;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--repeat" && i + 1 < argc) {
      repeat = std::max(1, static_cast<int>(std::strtol(argv[++i], nullptr, 10)));
    } else {
      wanted.push_back(arg);
    }
  }
  for (const Shape& s : kShapes) {
    if (!wanted.empty() && std::find(wanted.begin(), wanted.end(), s.name) == wanted.end())
      continue;
    run_shape(s, repeat, rank, ranks);
  }
  MPI_Finalize();
  return 0;
}
