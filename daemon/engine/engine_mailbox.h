// How work comes back to a job's engine thread: a queue of continuations and the job's doorbell, and
// the count of asynchronous work (pool passes, GPU copies, all-reduces) that will post one. A worker
// thread that finishes posts its continuation (Continue) and so ends its count; the engine thread
// takes what was posted (Take) and runs it, so all protocol state is touched by that thread only.
//
// Invariants: every Begin is matched by one Continue; WaitIdle returns once no work that will post is
// left, so the engine may be destroyed without a continuation outliving it.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <utility>
#include <vector>

#include "shm/ring.h"

namespace trainstream::daemon {

class EngineMailbox {
 public:
  explicit EngineMailbox(shm::Doorbell& doorbell) : doorbell_(doorbell) {}

  // Runs `work` on the engine thread, soon.
  void Post(std::function<void()> work) {
    {
      std::lock_guard lock(mutex_);
      posted_.push_back(std::move(work));
    }
    doorbell_.Ring();
  }
  // Asynchronous work starts that will Continue once.
  void Begin() { ++in_flight_; }
  // Hands `continuation` from an asynchronous worker (pool, all-reduce, copy) back to the engine thread,
  // and ends that worker's count.
  void Continue(std::function<void()> continuation) {
    Post(std::move(continuation));
    if (--in_flight_ == 0) {
      std::lock_guard lock(idle_mutex_);
      idle_.notify_all();
    }
  }
  // What was posted since the last call, in order.
  std::vector<std::function<void()>> Take() {
    std::lock_guard lock(mutex_);
    return std::exchange(posted_, {});
  }
  void WaitIdle() {
    std::unique_lock lock(idle_mutex_);
    idle_.wait(lock, [this] { return in_flight_.load() == 0; });
  }

 private:
  shm::Doorbell& doorbell_;
  std::mutex mutex_;
  std::vector<std::function<void()>> posted_;  // continuations from worker threads
  std::atomic<int64_t> in_flight_{0};
  std::mutex idle_mutex_;
  std::condition_variable idle_;
};

}  // namespace trainstream::daemon
