// A fixed pool of CPU threads that run the optimizer's work, one thread per core by default.
//
// Work arrives as a batch of independent pieces (static chunks of one bucket) with a priority and a
// completion callback; the callback runs exactly once, on the thread that finishes the last piece.
// Higher priority batches are started first (the bucket the next forward needs first); within a
// priority, batches run in submission order. Threads are pinned to cores when there are enough.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <queue>
#include <thread>
#include <vector>

namespace trainstream::daemon {

// The CPUs this process may run on (a cgroup cpuset or taskset may allow fewer than the machine has).
std::vector<int> AllowedCpus();

class WorkerPool {
 public:
  using Piece = std::function<void(size_t piece_index)>;

  explicit WorkerPool(size_t threads, bool pin_threads = true);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // Runs piece(0..pieces-1) on the pool, then on_done(). Never blocks.
  void Submit(size_t pieces, Piece piece, std::function<void()> on_done, int64_t priority = 0);
  [[nodiscard]] size_t threads() const { return threads_.size(); }

 private:
  struct Batch;
  struct Entry {
    int64_t priority;
    uint64_t sequence;
    std::shared_ptr<Batch> batch;
    bool operator<(const Entry& other) const {  // max-heap: highest priority, then oldest first
      return priority != other.priority ? priority < other.priority : sequence > other.sequence;
    }
  };

  void Run(size_t index);

  std::mutex mutex_;
  std::condition_variable wake_;
  std::priority_queue<Entry> queue_;
  uint64_t next_sequence_ = 0;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace trainstream::daemon
