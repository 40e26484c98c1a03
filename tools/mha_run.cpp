// mha-run: scaled dot-product attention on .npy files, with the mha library.
//
//   mha-run --q Q.npy --k K.npy --v V.npy --out O.npy [--mask M.npy]
//           [--valid-lens VL.npy] [--causal [none|top-left|bottom-right]] [--scale S]
//           [--window L,R] [--sinks S.npy] [--softcap C] [--alibi SLOPES.npy]
//           [--lse LSE.npy] [--backend NAME] [--threads N] [--repeat N]
//   mha-run module --weights DIR --query Q.npy [--key K.npy] [--value V.npy]
//           --out O.npy [--heads N] [--valid-lens VL.npy] [--key-padding-mask M.npy]
//           [--attn-mask M.npy] [--causal [none|top-left|bottom-right]]
//           [--window L,R] [--sinks S.npy] [--softcap C] [--alibi SLOPES.npy]
//           [--need-weights W.npy [--average-weights]] [--sequence-first | --batch-first]
//           [--allow-missing-weights] [--threads N] [--backend NAME] [--repeat N]
//   mha-run --version
//
// The program is mha_tools::mha_run_main (run_main.cpp); the exit status is
// listed in --help.
#include "tool_main.h"

int main(int argc, char** argv) {
  return mha_tools::mha_run_main(argc, argv);
}
