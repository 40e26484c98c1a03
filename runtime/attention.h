// The core's one door to the kernels: a call whose arguments are valid runs on
// the selected backend.  mha_attention validates and comes here; the module,
// which builds its tensors itself, comes here directly, so its calls are
// validated once.
#pragma once

#include <mha/mha.h>

#include <string>

#include "validate.h"

namespace mha::rt {

// Runs the call on the selected backend with the current thread count
// (MHA_VERBOSE=2: one line per call).  Fails, writing nothing, when no
// backend is selected or memory runs out.
mha_status attend(KernelCall& call);

// Runs `count` independent calls -- the sequences of a packed batch of B --
// as one team (scheduler.h); MHA_VERBOSE=2: one line for all of them.
mha_status attend(KernelCall* calls, int64_t count, int64_t batch);

// The attention variants of a call, '+'-separated, as MHA_VERBOSE=2 lists
// them: window(L;R) with -1 for an unbounded side, softcap(C), alibi (per
// head) or alibi(per-batch), sinks; "none" without any.
std::string variants_of(const KernelCall& call);

}  // namespace mha::rt
