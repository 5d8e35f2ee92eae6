// The engine's tests' SessionSink: records what the engine tells one session (warnings, failures),
// and lets a test wait for the first failure.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "daemon/engine/session_sink.h"

namespace trainstream::daemon {

class RecordingSink : public SessionSink {
 public:
  void Warn(const std::string& message) override {
    std::lock_guard lock(mutex_);
    warnings_.push_back(message);
  }
  void Fail(const std::string& message) override {
    std::lock_guard lock(mutex_);
    failures_.push_back(message);
    changed_.notify_all();
  }
  // The first failure, waiting for it up to `timeout`.
  std::optional<std::string> WaitForFailure(std::chrono::milliseconds timeout = std::chrono::seconds(5)) {
    std::unique_lock lock(mutex_);
    if (!changed_.wait_for(lock, timeout, [&] { return !failures_.empty(); })) return std::nullopt;
    return failures_.front();
  }
  std::vector<std::string> failures() {
    std::lock_guard lock(mutex_);
    return failures_;
  }
  std::vector<std::string> warnings() {
    std::lock_guard lock(mutex_);
    return warnings_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<std::string> warnings_, failures_;
};

}  // namespace trainstream::daemon
