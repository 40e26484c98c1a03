// The backend and the thread count are process-wide settings of libmha
// (mha_select_backend, mha_set_num_threads).  A call's backend= and threads=
// are in force for that call only: such a call changes the settings, runs and
// restores them while no other call runs; calls without them run
// concurrently.  Every function here is called without the GIL.
#pragma once

#include <mha/mha.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <shared_mutex>
#include <string>

namespace mha_python {

struct CallOverrides {
  std::optional<std::string> backend;
  std::optional<int32_t> threads;
};

class CallSettings {
 public:
  static CallSettings& instance();

  // Runs `call` (a library call returning its status) under the process's
  // settings, or with `overrides` in force for this call only.  Throws
  // mha::Error when a setting or the call fails.
  void run(const CallOverrides& overrides, const std::function<mha_status()>& call);

  // The process's settings, as mha.set_backend and mha.set_num_threads change them.
  void select_backend(const std::string& name);
  void set_num_threads(int32_t n);

  // The backend calls without backend= use, or nullopt with the reason in *why.
  std::optional<std::string> selected_backend(std::string* why);

 private:
  CallSettings();
  static void forget_thread_count_in_child();
  void run_with_overrides(const CallOverrides& overrides, const std::function<mha_status()>& call);

  std::shared_mutex mutex_;  // shared: a call; exclusive: changing a setting
  // What set_num_threads last set (0: the environment's count), to return to
  // after a call's threads=.  0 again in a forked child, which computes on one
  // thread until it chooses a count itself (the library's rule after fork).
  int32_t threads_ = 0;
  // Non-empty when MHA_BACKEND named an unusable backend and a call with
  // backend= has run since: the library then has that call's backend
  // selected, but calls without backend= must still fail, with this reason,
  // until set_backend succeeds -- never a silent fallback.
  std::string unusable_reason_;
};

}  // namespace mha_python
