/* mha_attention on a small problem against a naive loop, through the C API. */
#include <math.h>
#include <mha/mha.h>
#include <stdio.h>

int main(void) {
  enum { L = 5, D = 8 };
  float q[L * D], out[L * D];
  int64_t shape[4] = {1, 1, L, D};
  mha_tensor tq, tout;
  double worst = 0.0;
  int i, j, d;
  for (i = 0; i < L * D; ++i) q[i] = (float)((i * 7 % 11) - 5) * 0.1f;
  if (mha_tensor_init(&tq, q, MHA_DTYPE_F32, 4, shape, NULL) != MHA_OK ||
      mha_tensor_init(&tout, out, MHA_DTYPE_F32, 4, shape, NULL) != MHA_OK ||
      mha_attention(&tq, &tq, &tq, &tout, NULL) != MHA_OK) {
    printf("mha failed: %s\n", mha_last_error());
    return 1;
  }
  for (i = 0; i < L; ++i) {
    double s[L], m = -1e300, sum = 0.0;
    for (j = 0; j < L; ++j) {
      s[j] = 0.0;
      for (d = 0; d < D; ++d) s[j] += (double)q[i * D + d] * q[j * D + d] / sqrt((double)D);
      if (s[j] > m) m = s[j];
    }
    for (j = 0; j < L; ++j) sum += (s[j] = exp(s[j] - m));
    for (d = 0; d < D; ++d) {
      double o = 0.0;
      for (j = 0; j < L; ++j) o += s[j] / sum * q[j * D + d];
      if (fabs(o - out[i * D + d]) > worst) worst = fabs(o - out[i * D + d]);
    }
  }
  printf("c: mha %s, backend %s, largest error %.2g\n", mha_version(), mha_selected_backend(),
         worst);
  return worst < 1e-5 ? 0 : 1;
}
