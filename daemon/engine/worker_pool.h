// A fixed pool of CPU threads that run the optimizer's work, one thread per core by default.
//
// Work arrives as a batch of independent blocks (the step engine's: up to 64 Ki elements of one
// parameter, daemon/engine/bucket_passes.h) with a priority and a completion callback; the callback
// runs exactly once, on the thread that finishes the last block.
// Higher priority batches are started first (the bucket the next forward needs first); within a
// priority, batches run in submission order. Threads are pinned to cores when there are enough.
//
// NUMA: each thread belongs to the node of its CPU. A batch may give every block a home node; a
// thread then takes its own node's blocks first and helps other nodes only when its own are handed
// out. Touching a job's memory first through the same homes (first-touch placement) makes a block's
// memory local to the threads that update it. With one node this is all a no-op.
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

// The NUMA node of `cpu` (0 where the kernel does not say).
uint32_t NodeOfCpu(int cpu);

// The physical core of `cpu`: its package and core ids from /sys (a CPU the kernel says nothing of counts
// as a core of its own). Hyperthreads of one core share its id.
uint64_t CoreOfCpu(int cpu);

// `allowed` less every CPU of its last `reserved_cores` physical cores (in the order of their first CPU):
// the CPUs left to the workers. Throws kInvalidArgument when none would be left.
std::vector<int> CpusLeftAfterReserving(const std::vector<int>& allowed, uint32_t reserved_cores,
                                        const std::function<uint64_t(int)>& core_of = CoreOfCpu);

// How the workers are scheduled beside other threads. kIdle (Linux SCHED_IDLE): any thread of normal
// policy that wakes on a worker's core takes it at once, where at a nice value it may wait for the
// scheduler's next tick (4 ms on the GPU machines), and the workers get only what such threads leave.
enum class WorkerPolicy { kNormal, kIdle };

class WorkerPool {
 public:
  using Work = std::function<void(size_t block)>;      // does one block of a batch
  using Home = std::function<uint32_t(size_t block)>;  // the NUMA node whose memory a block touches

  // `thread_nodes` overrides the node of each thread (tests); by default, the node of its pinned CPU.
  // `nice` (0-19) lowers the threads' scheduling priority, so that a trainer's thread sharing a core
  // with one preempts it (ignored with kIdle). `cpus`: those the threads are pinned to (empty: every allowed CPU).
  explicit WorkerPool(size_t threads, bool pin_threads = true, std::vector<uint32_t> thread_nodes = {}, int nice = 0,
                      std::vector<int> cpus = {}, WorkerPolicy policy = WorkerPolicy::kNormal);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // Runs work(0..blocks-1) on the pool, then on_done(). Never blocks. `home` (optional, used only
  // with several nodes) names each block's node.
  void Submit(size_t blocks, Work work, std::function<void()> on_done, int64_t priority = 0, const Home& home = {});
  [[nodiscard]] size_t threads() const { return threads_.size(); }
  [[nodiscard]] uint32_t nodes() const { return nodes_; }

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

  void Run(uint32_t node, int nice, WorkerPolicy policy);

  std::mutex mutex_;
  std::condition_variable wake_;
  std::priority_queue<Entry> queue_;
  uint64_t next_sequence_ = 0;
  bool stopping_ = false;
  uint32_t nodes_ = 1;
  std::vector<std::thread> threads_;
};

}  // namespace trainstream::daemon
