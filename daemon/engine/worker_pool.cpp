#include "daemon/engine/worker_pool.h"

#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <string>

#include "shm/error.h"

namespace trainstream::daemon {

// The blocks of a batch in node order: node k's blocks are order[begin[k]..begin[k+1]), handed out by
// cursor[k]. With one node, order is empty and cursor[0] counts the blocks themselves.
struct WorkerPool::Batch {
  size_t blocks;
  Work work;
  std::function<void()> on_done;
  std::vector<size_t> order;
  std::vector<size_t> begin;
  std::unique_ptr<std::atomic<size_t>[]> cursor;
  std::atomic<size_t> handed{0};    // blocks handed out
  std::atomic<size_t> finished{0};  // blocks done

  // The next block for a thread of `node`: its own node's first, then the others'. False when every
  // block has been handed out.
  bool Claim(uint32_t node, size_t* block) {
    const size_t nodes = begin.size() - 1;
    for (size_t k = 0; k < nodes; ++k) {
      const size_t n = (node + k) % nodes;
      const size_t at = cursor[n].fetch_add(1);
      if (at < begin[n + 1]) {
        *block = order.empty() ? at : order[at];
        handed.fetch_add(1);
        return true;
      }
    }
    return false;
  }
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

uint32_t NodeOfCpu(int cpu) {
  const std::filesystem::path dir = "/sys/devices/system/cpu/cpu" + std::to_string(cpu);
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(dir, error)) {
    const std::string name = entry.path().filename().string();
    if (name.starts_with("node") && name.size() > 4 && std::isdigit(static_cast<unsigned char>(name[4])) != 0) {
      return static_cast<uint32_t>(std::stoul(name.substr(4)));
    }
  }
  return 0;
}

uint64_t CoreOfCpu(int cpu) {
  const std::string topology = "/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/topology/";
  uint64_t package = 0;
  uint64_t core = 0;
  std::ifstream package_file(topology + "physical_package_id");
  std::ifstream core_file(topology + "core_id");
  if (!(package_file >> package) || !(core_file >> core)) return (uint64_t{1} << 63) | static_cast<uint64_t>(cpu);
  return (package << 32) | core;
}

std::vector<int> CpusLeftAfterReserving(const std::vector<int>& allowed, uint32_t reserved_cores,
                                        const std::function<uint64_t(int)>& core_of) {
  if (reserved_cores == 0) return allowed;
  std::vector<uint64_t> core_of_cpu;  // per allowed CPU
  std::vector<uint64_t> cores;        // in the order of their first allowed CPU
  for (const int cpu : allowed) {
    core_of_cpu.push_back(core_of(cpu));
    if (std::find(cores.begin(), cores.end(), core_of_cpu.back()) == cores.end()) cores.push_back(core_of_cpu.back());
  }
  TS_CHECK(reserved_cores < cores.size(), Code::kInvalidArgument,
           "reserved_cores is {} but this daemon may run on {} physical cores ({} CPUs); expected fewer than {}",
           reserved_cores, cores.size(), allowed.size(), cores.size());
  const std::vector<uint64_t> reserved(cores.end() - reserved_cores, cores.end());
  std::vector<int> left;
  for (size_t i = 0; i < allowed.size(); ++i) {
    if (std::find(reserved.begin(), reserved.end(), core_of_cpu[i]) == reserved.end()) left.push_back(allowed[i]);
  }
  return left;
}

WorkerPool::WorkerPool(size_t threads, bool pin_threads, std::vector<uint32_t> thread_nodes, int nice,
                       std::vector<int> cpus, WorkerPolicy policy) {
  if (threads == 0) threads = 1;
  if (cpus.empty()) cpus = AllowedCpus();
  // Pinned only when every thread gets a CPU of its own: sharing would only add migrations.
  const bool pin = pin_threads && threads <= cpus.size();
  if (thread_nodes.size() != threads) {
    thread_nodes.assign(threads, 0);
    for (size_t i = 0; pin && i < threads; ++i) thread_nodes[i] = NodeOfCpu(cpus[i]);
  }
  // Nodes are numbered densely so that a batch needs one cursor per node that has threads.
  std::vector<uint32_t> dense = thread_nodes;
  std::sort(dense.begin(), dense.end());
  dense.erase(std::unique(dense.begin(), dense.end()), dense.end());
  nodes_ = static_cast<uint32_t>(dense.size());
  for (size_t i = 0; i < threads; ++i) {
    const auto node =
        static_cast<uint32_t>(std::lower_bound(dense.begin(), dense.end(), thread_nodes[i]) - dense.begin());
    threads_.emplace_back([this, node, nice, policy] { Run(node, nice, policy); });
    if (pin) {
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

void WorkerPool::Submit(size_t blocks, Work work, std::function<void()> on_done, int64_t priority, const Home& home) {
  if (blocks == 0) {
    on_done();
    return;
  }
  auto batch = std::make_shared<Batch>();
  batch->blocks = blocks;
  batch->work = std::move(work);
  batch->on_done = std::move(on_done);
  const uint32_t nodes = home ? nodes_ : 1;
  batch->begin.assign(nodes + 1, 0);
  batch->cursor = std::make_unique<std::atomic<size_t>[]>(nodes);
  if (nodes == 1) {
    batch->begin[1] = blocks;
  } else {
    std::vector<std::vector<size_t>> by_node(nodes);
    for (size_t i = 0; i < blocks; ++i) by_node[home(i) % nodes].push_back(i);
    for (uint32_t k = 0; k < nodes; ++k) {
      batch->begin[k + 1] = batch->begin[k] + by_node[k].size();
      batch->cursor[k] = batch->begin[k];
      batch->order.insert(batch->order.end(), by_node[k].begin(), by_node[k].end());
    }
  }
  {
    std::lock_guard lock(mutex_);
    queue_.push(Entry{priority, next_sequence_++, std::move(batch)});
  }
  wake_.notify_all();
}

void WorkerPool::Run(uint32_t node, int nice, WorkerPolicy policy) {
  // Linux keeps a nice value and a policy per thread; lowering one's own needs no privilege.
  const auto tid = static_cast<pid_t>(syscall(SYS_gettid));
  if (policy == WorkerPolicy::kIdle) {
    const sched_param none{};
    sched_setscheduler(tid, SCHED_IDLE, &none);
  } else if (nice != 0) {
    setpriority(PRIO_PROCESS, static_cast<id_t>(tid), nice);
  }
  for (;;) {
    std::shared_ptr<Batch> batch;
    size_t block = 0;
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and nothing left
      batch = queue_.top().batch;
      const bool claimed = batch->Claim(node, &block);
      if (batch->handed.load() == batch->blocks) queue_.pop();  // all blocks handed out
      if (!claimed) continue;
    }
    batch->work(block);
    if (batch->finished.fetch_add(1) + 1 == batch->blocks) batch->on_done();
  }
}

}  // namespace trainstream::daemon
