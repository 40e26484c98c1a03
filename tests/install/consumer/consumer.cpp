// The same call through mha.hpp (and, WITH_MPI, mha_mpi.h compiled as C++).
#include <cstdio>
#include <mha/mha.hpp>
#include <vector>
#ifdef WITH_MPI
#include <mha/mha_mpi.h>
#endif

int main() {
  std::vector<float> q(40), out(40), expected(40);
  for (size_t i = 0; i < q.size(); ++i) q[i] = static_cast<float>((i * 7 % 11)) * 0.1f - 0.5f;
  const mha::Tensor tq(q.data(), {1, 1, 5, 8});
  mha::attention(tq, tq, tq, mha::Tensor(out.data(), {1, 1, 5, 8}),
                 mha::AttentionParams().causal(MHA_CAUSAL_TOP_LEFT));
  mha::attention(tq, tq, tq, mha::Tensor(expected.data(), {1, 1, 5, 8}),
                 mha::AttentionParams().causal(MHA_CAUSAL_TOP_LEFT));
  if (out != expected || out[0] != q[0]) return 1;  // the first row sees its own key only
#ifdef WITH_MPI
  mha_mpi_params mpi;
  mha_mpi_params_init(&mpi);
  if (mpi.layout != MHA_MPI_CONTIGUOUS) return 1;
#endif
  std::printf("c++: mha %s, C++%ld\n", mha::version().c_str(), __cplusplus / 100 % 100);
  return 0;
}
