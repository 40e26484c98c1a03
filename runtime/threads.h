// How many threads one call uses, and running work items over them.
//
// Fork safety: GCC's libgomp keeps its thread pool across fork(), but the
// child has only the forking thread, so the child's next parallel region
// waits forever for the pool's missing threads (Python's multiprocessing and
// PyTorch's DataLoader workers fork).  libmha therefore never enters an
// OpenMP region in a forked child: the child computes on its calling thread
// until it sets a thread count itself (mha_set_num_threads), and then on
// threads it starts for the call (std::thread), never on the parent's pool.
#pragma once

#include <cstdint>

namespace mha::rt {

// Precedence: mha_set_num_threads, then MHA_NUM_THREADS, then OMP_NUM_THREADS,
// then every core.  In a forked child: 1 until the child calls the setter.
int32_t num_threads();
void set_num_threads(int32_t n);  // 0 returns to the environment's choice

// True in a process forked from one that had loaded libmha: OpenMP (and BLIS,
// which threads with OpenMP) must then run on one thread.
bool in_forked_child();

// The work of a team: prepare() runs once on each thread before any item
// (false: this thread cannot take part, e.g. its scratch memory cannot be
// allocated), then run(i, thread) for every item i, handed out in order of i.
class TeamWork {
 public:
  virtual bool prepare(int32_t /*thread*/) { return true; }
  virtual void run(int64_t index, int32_t thread) = 0;

 protected:
  ~TeamWork() = default;
};

// Runs items [0, n) on up to `team` threads (one when called from inside the
// caller's own OpenMP region, no oversubscription).  Runs no item at all and
// returns false when some thread's prepare() failed, so that a failure never
// leaves an output half written.
bool run_team(int64_t n, int32_t team, TeamWork& work);

// run_team with lambdas: prepare(thread) -> bool, run(index, thread).
template <class Prepare, class Run>
bool run_team(int64_t n, int32_t team, Prepare&& prepare, Run&& run) {
  class Adapter final : public TeamWork {
   public:
    Adapter(Prepare& p, Run& r) : prepare_(p), run_(r) {}
    bool prepare(int32_t thread) override { return prepare_(thread); }
    void run(int64_t index, int32_t thread) override { run_(index, thread); }

   private:
    Prepare& prepare_;
    Run& run_;
  };
  Adapter adapter(prepare, run);
  return run_team(n, team, adapter);
}

}  // namespace mha::rt
