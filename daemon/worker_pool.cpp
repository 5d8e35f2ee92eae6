#include "daemon/worker_pool.h"

#include <pthread.h>
#include <sched.h>

#include <atomic>

namespace trainstream::daemon {

struct WorkerPool::Batch {
  size_t pieces;
  Piece piece;
  std::function<void()> on_done;
  std::atomic<size_t> next{0};      // next piece to hand out
  std::atomic<size_t> finished{0};  // pieces done
};

std::vector<int> AllowedCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return cpus;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (CPU_ISSET(cpu, &set)) cpus.push_back(cpu);
  }
  return cpus;
}

WorkerPool::WorkerPool(size_t threads, bool pin_threads) {
  if (threads == 0) threads = 1;
  const std::vector<int> cpus = AllowedCpus();
  for (size_t i = 0; i < threads; ++i) {
    threads_.emplace_back([this, i] { Run(i); });
    // Pinned only when every thread gets a CPU of its own: sharing would only add migrations.
    if (pin_threads && threads <= cpus.size()) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(cpus[i], &set);
      pthread_setaffinity_np(threads_.back().native_handle(), sizeof(set), &set);
    }
  }
}

WorkerPool::~WorkerPool() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  for (auto& thread : threads_) thread.join();
}

void WorkerPool::Submit(size_t pieces, Piece piece, std::function<void()> on_done, int64_t priority) {
  if (pieces == 0) {
    on_done();
    return;
  }
  auto batch = std::make_shared<Batch>();
  batch->pieces = pieces;
  batch->piece = std::move(piece);
  batch->on_done = std::move(on_done);
  {
    std::lock_guard lock(mutex_);
    queue_.push(Entry{priority, next_sequence_++, std::move(batch)});
  }
  wake_.notify_all();
}

void WorkerPool::Run(size_t /*index*/) {
  for (;;) {
    std::shared_ptr<Batch> batch;
    size_t piece = 0;
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and nothing left
      batch = queue_.top().batch;
      piece = batch->next.fetch_add(1);
      if (piece + 1 >= batch->pieces) queue_.pop();  // all pieces handed out
    }
    batch->piece(piece);
    if (batch->finished.fetch_add(1) + 1 == batch->pieces) batch->on_done();
  }
}

}  // namespace trainstream::daemon
