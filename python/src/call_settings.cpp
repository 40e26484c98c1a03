#include "call_settings.h"

#include <pthread.h>

#include <mutex>

#include "errors.h"

namespace mha_python {

CallSettings& CallSettings::instance() {
  static CallSettings settings;
  return settings;
}

CallSettings::CallSettings() {
  (void)pthread_atfork(nullptr, nullptr, &CallSettings::forget_thread_count_in_child);
}

void CallSettings::forget_thread_count_in_child() {
  instance().threads_ = 0;
}

void CallSettings::run(const CallOverrides& overrides, const std::function<mha_status()>& call) {
  if (overrides.backend || overrides.threads) {
    run_with_overrides(overrides, call);
    return;
  }
  std::shared_lock<std::shared_mutex> lock(mutex_);
  if (!unusable_reason_.empty()) {
    throw library_error(MHA_ERR_BACKEND_UNAVAILABLE, unusable_reason_);
  }
  const mha_status status = call();
  if (status != MHA_OK) throw library_error(status);
}

void CallSettings::run_with_overrides(const CallOverrides& overrides,
                                      const std::function<mha_status()>& call) {
  std::unique_lock<std::shared_mutex> lock(mutex_);
  if (!overrides.backend && !unusable_reason_.empty()) {
    throw library_error(MHA_ERR_BACKEND_UNAVAILABLE, unusable_reason_);
  }
  // What to return to: the selected backend by name (the same one "auto"
  // chose), or the reason none is usable.
  std::string previous_backend;
  std::string previous_reason = unusable_reason_;
  if (previous_reason.empty()) {
    const char* selected = mha_selected_backend();
    if (selected != nullptr) {
      previous_backend = selected;
    } else {
      previous_reason = mha_last_error();
    }
  }
  auto restore_backend = [&] {
    if (!overrides.backend) return;
    if (!previous_backend.empty()) {
      // It was usable a moment ago and the library never unloads a plugin.
      (void)mha_select_backend(previous_backend.c_str());
    } else {
      unusable_reason_ = previous_reason;
    }
  };

  if (overrides.backend) {
    const mha_status status = mha_select_backend(overrides.backend->c_str());
    if (status != MHA_OK) throw library_error(status);  // the choice is unchanged
    unusable_reason_.clear();
  }
  if (overrides.threads) {
    const mha_status status = mha_set_num_threads(*overrides.threads);
    if (status != MHA_OK) {
      const mha::Error error = library_error(status);
      restore_backend();
      throw error;
    }
  }
  const mha_status status = call();
  // Read the message before the calls below replace it.
  std::optional<mha::Error> failure;
  if (status != MHA_OK) failure = library_error(status);
  if (overrides.threads) (void)mha_set_num_threads(threads_);
  restore_backend();
  if (failure) throw *failure;
}

void CallSettings::select_backend(const std::string& name) {
  std::unique_lock<std::shared_mutex> lock(mutex_);
  const mha_status status = mha_select_backend(name.c_str());
  if (status != MHA_OK) throw library_error(status);
  unusable_reason_.clear();
}

void CallSettings::set_num_threads(int32_t n) {
  std::unique_lock<std::shared_mutex> lock(mutex_);
  const mha_status status = mha_set_num_threads(n);
  if (status != MHA_OK) throw library_error(status);
  threads_ = n;
}

std::optional<std::string> CallSettings::selected_backend(std::string* why) {
  std::shared_lock<std::shared_mutex> lock(mutex_);
  if (!unusable_reason_.empty()) {
    *why = unusable_reason_;
    return std::nullopt;
  }
  const char* selected = mha_selected_backend();
  if (selected == nullptr) {
    *why = mha_last_error();
    return std::nullopt;
  }
  return std::string(selected);
}

}  // namespace mha_python
