// `mha-run backward`: the gradients of attention on .npy files.  It takes the
// attention mode's flags (the forward call it differentiates: --q --k --v,
// masks, causal, window, variants, --scale, --backend, --threads, --repeat),
// computes the forward (whose --out and --lse it writes when named), then
// mha_attention_backward with --dout (in --dtype, as --mask) -- for a packed
// batch (--cu-seqlens-q/-k, --seqused-k) mha_attention_varlen_backward, its
// --dout and gradients packed as its inputs --, and writes
// --dq --dk --dv in --grad-dtype (their inputs' dtypes by default; bf16
// values in float32 files) and --dsinks, --dmask when named.  Every output
// is replaced only once all are written.
#pragma once

#include <string>

#include "attention_run.h"

namespace CLI {
class App;
}  // namespace CLI

namespace mha_tools {

struct BackwardOptions : AttentionOptions {
  std::string dout;                       // the loss's gradient by the output, [B,H,Lq,Dv]
  std::string dq, dk, dv, dsinks, dmask;  // outputs (dsinks, dmask: when named)
  std::string grad_dtype = "input";       // input (each gradient in its input's dtype) or f32
};

// Registers the attention flags and --dout, --dq, --dk, --dv, --dsinks, --dmask.
void add_backward_options(CLI::App& app, BackwardOptions& options);

// The whole `mha-run backward` command: prints errors as "mha-run: ..." on
// stderr and returns the exit status.
int run_backward_command(const BackwardOptions& options);

}  // namespace mha_tools
