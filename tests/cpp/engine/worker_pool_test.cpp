// Tests of the optimizer worker pool (daemon/engine/worker_pool.h): each block runs once, the completion
// callback runs once after every block, concurrent submitters, priority order, NUMA homes, and the
// threads' nice value.
#include <gtest/gtest.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <fstream>
#include <functional>
#include <future>
#include <latch>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "daemon/engine/worker_pool.h"
#include "shm/error.h"

namespace trainstream::daemon {
namespace {

using namespace std::chrono_literals;

// Counts on_done calls and lets the test wait for a number of them.
class DoneCounter {
 public:
  std::function<void()> Callback() {
    return [this] {
      std::lock_guard lock(mutex_);
      ++count_;
      changed_.notify_all();
    };
  }
  bool WaitFor(size_t count, std::chrono::milliseconds timeout = 10s) {
    std::unique_lock lock(mutex_);
    return changed_.wait_for(lock, timeout, [&] { return count_ >= count; });
  }
  size_t count() {
    std::lock_guard lock(mutex_);
    return count_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  size_t count_ = 0;
};

// Occupies every thread of a pool with one block each until Release().
class Blocker {
 public:
  Blocker(WorkerPool& pool, size_t threads) : started_(threads) {
    pool.Submit(
        threads,
        [this](size_t) {
          started_.count_down();
          release_.wait();
        },
        done_.Callback(), /*priority=*/1000);
    started_.wait();
  }
  ~Blocker() {
    Release();
    done_.WaitFor(1);  // the pool must not call back into a destroyed Blocker
  }
  void Release() {
    if (!released_.exchange(true)) promise_.set_value();
  }

 private:
  std::latch started_;
  std::promise<void> promise_;
  std::shared_future<void> release_ = promise_.get_future().share();
  std::atomic<bool> released_{false};
  DoneCounter done_;
};

TEST(WorkerPool, EveryPieceRunsOnceAndOnDoneRunsOnceAfterAll) {
  WorkerPool pool(2, /*pin_threads=*/false);
  constexpr size_t kBlocks = 1000;
  std::vector<std::atomic<int>> runs(kBlocks);
  std::atomic<int> runs_seen_by_on_done{-1};
  DoneCounter done;
  pool.Submit(
      kBlocks, [&](size_t i) { runs[i].fetch_add(1); },
      [&, callback = done.Callback()] {
        int total = 0;
        for (const auto& r : runs) total += r.load();
        runs_seen_by_on_done = total;
        callback();
      });
  ASSERT_TRUE(done.WaitFor(1));
  std::this_thread::sleep_for(20ms);  // a second on_done or a late block would show here
  EXPECT_EQ(done.count(), 1u);
  EXPECT_EQ(runs_seen_by_on_done.load(), static_cast<int>(kBlocks));
  for (size_t i = 0; i < kBlocks; ++i) EXPECT_EQ(runs[i].load(), 1) << "block " << i;
}

TEST(WorkerPool, ZeroPiecesStillCallsOnDone) {
  WorkerPool pool(2, false);
  std::atomic<int> blocks_run{0};
  DoneCounter done;
  pool.Submit(
      0, [&](size_t) { ++blocks_run; }, done.Callback());
  ASSERT_TRUE(done.WaitFor(1));
  EXPECT_EQ(blocks_run.load(), 0);
  EXPECT_EQ(done.count(), 1u);
}

TEST(WorkerPool, ManyConcurrentBatchesFromManySubmitters) {
  WorkerPool pool(2, false);
  constexpr size_t kSubmitters = 4, kBatches = 200;
  std::atomic<size_t> blocks_run{0};
  std::vector<std::unique_ptr<std::atomic<size_t>>> per_batch;
  for (size_t i = 0; i < kSubmitters * kBatches; ++i) per_batch.push_back(std::make_unique<std::atomic<size_t>>(0));
  std::atomic<size_t> bad_on_done{0};
  DoneCounter done;
  size_t expected_blocks = 0;
  for (size_t b = 0; b < kSubmitters * kBatches; ++b) expected_blocks += b % 7;
  std::vector<std::thread> submitters;
  for (size_t s = 0; s < kSubmitters; ++s) {
    submitters.emplace_back([&, s] {
      for (size_t k = 0; k < kBatches; ++k) {
        const size_t id = s * kBatches + k, blocks = id % 7;
        pool.Submit(
            blocks,
            [&, id](size_t) {
              per_batch[id]->fetch_add(1);
              blocks_run.fetch_add(1);
            },
            [&, id, blocks, callback = done.Callback()] {
              if (per_batch[id]->load() != blocks) ++bad_on_done;
              callback();
            },
            static_cast<int64_t>(k % 3));
      }
    });
  }
  for (auto& t : submitters) t.join();
  ASSERT_TRUE(done.WaitFor(kSubmitters * kBatches));
  EXPECT_EQ(blocks_run.load(), expected_blocks);
  EXPECT_EQ(bad_on_done.load(), 0u) << "on_done ran before all blocks of its batch";
}

// Records the order in which single-block batches run on a one-thread pool.
class OrderRecorder {
 public:
  void Submit(WorkerPool& pool, int id, int64_t priority) {
    pool.Submit(
        1,
        [this, id](size_t) {
          std::lock_guard lock(mutex_);
          order_.push_back(id);
        },
        done_.Callback(), priority);
  }
  std::vector<int> WaitForOrder(size_t count) {
    EXPECT_TRUE(done_.WaitFor(count));
    std::lock_guard lock(mutex_);
    return order_;
  }

 private:
  std::mutex mutex_;
  std::vector<int> order_;
  DoneCounter done_;
};

TEST(WorkerPool, HigherPriorityBatchSubmittedLaterRunsFirst) {
  WorkerPool pool(1, false);
  OrderRecorder recorder;
  Blocker blocker(pool, 1);
  recorder.Submit(pool, /*id=*/1, /*priority=*/0);
  recorder.Submit(pool, 2, 5);
  recorder.Submit(pool, 3, -2);
  recorder.Submit(pool, 4, 7);
  blocker.Release();
  EXPECT_EQ(recorder.WaitForOrder(4), (std::vector<int>{4, 2, 1, 3}));
}

TEST(WorkerPool, EqualPriorityRunsInSubmissionOrder) {
  WorkerPool pool(1, false);
  OrderRecorder recorder;
  Blocker blocker(pool, 1);
  for (int id = 0; id < 5; ++id) recorder.Submit(pool, id, 3);
  blocker.Release();
  EXPECT_EQ(recorder.WaitForOrder(5), (std::vector<int>{0, 1, 2, 3, 4}));
}

// What `probe` says on the pool's threads, over a batch of 64 blocks.
std::set<int> SeenOnWorkers(WorkerPool& pool, const std::function<int()>& probe) {
  std::mutex mutex;
  std::set<int> seen;
  DoneCounter done;
  pool.Submit(
      64,
      [&](size_t) {
        const int value = probe();
        std::lock_guard lock(mutex);
        seen.insert(value);
      },
      done.Callback());
  EXPECT_TRUE(done.WaitFor(1));
  return seen;
}

int OwnNice() {
  return getpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)));
}

TEST(WorkerPool, ThreadsRunAtTheirNiceValue) {
  constexpr int kNice = 7;
  const int own = getpriority(PRIO_PROCESS, 0);
  if (own > kNice) GTEST_SKIP() << "this process already runs at nice " << own;
  WorkerPool pool(2, false, {}, kNice);
  EXPECT_EQ(SeenOnWorkers(pool, OwnNice), std::set<int>{kNice});
  EXPECT_EQ(OwnNice(), own);  // the caller's unchanged
}

TEST(WorkerPool, ThreadsOfTheIdlePolicyRunAtSchedIdle) {
  WorkerPool pool(2, false, {}, /*nice=*/7, {}, WorkerPolicy::kIdle);
  EXPECT_EQ(SeenOnWorkers(pool, [] { return sched_getscheduler(static_cast<pid_t>(syscall(SYS_gettid))); }),
            std::set<int>{SCHED_IDLE});
  EXPECT_EQ(sched_getscheduler(0), SCHED_OTHER);  // the caller's unchanged
}

// Eight CPUs on four cores, hyperthread siblings n and n+4, as Linux numbers a two-way SMT machine.
uint64_t SiblingsFourApart(int cpu) {
  return static_cast<uint64_t>(cpu % 4);
}

TEST(CpusLeftAfterReserving, ReservesEveryHyperthreadOfTheLastCores) {
  const std::vector<int> all = {0, 1, 2, 3, 4, 5, 6, 7};
  EXPECT_EQ(CpusLeftAfterReserving(all, 0, SiblingsFourApart), all);
  EXPECT_EQ(CpusLeftAfterReserving({}, 0, SiblingsFourApart), std::vector<int>{});  // no mask read: unchanged
  EXPECT_EQ(CpusLeftAfterReserving(all, 1, SiblingsFourApart), (std::vector<int>{0, 1, 2, 4, 5, 6}));
  EXPECT_EQ(CpusLeftAfterReserving(all, 3, SiblingsFourApart), (std::vector<int>{0, 4}));
  // A cpuset of some CPUs: the cores counted are those it reaches.
  EXPECT_EQ(CpusLeftAfterReserving({1, 2, 5}, 1, SiblingsFourApart), (std::vector<int>{1, 5}));
  // Without hyperthreads, each CPU is its own core.
  EXPECT_EQ(CpusLeftAfterReserving({0, 1, 2}, 2, [](int cpu) { return static_cast<uint64_t>(cpu); }),
            std::vector<int>{0});
}

TEST(CpusLeftAfterReserving, RefusesToReserveEveryCore) {
  try {
    CpusLeftAfterReserving({0, 1, 2, 3, 4, 5, 6, 7}, 4, SiblingsFourApart);
    FAIL() << "reserving all four cores was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("reserved_cores is 4 but this daemon may run on 4 physical cores"),
              std::string::npos)
        << e.what();
  }
}

TEST(CpusLeftAfterReserving, HyperthreadsOfOneCoreShareItsId) {
  for (const int cpu : AllowedCpus()) {
    std::ifstream siblings("/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/topology/thread_siblings_list");
    int first = -1;
    if (!(siblings >> first)) GTEST_SKIP() << "no CPU topology in /sys";
    EXPECT_EQ(CoreOfCpu(cpu), CoreOfCpu(first)) << "cpu " << cpu << " and its first sibling " << first;
  }
}

TEST(WorkerPool, ZeroThreadsMeansOne) {
  WorkerPool pool(0, false);
  EXPECT_EQ(pool.threads(), 1u);
  DoneCounter done;
  pool.Submit(
      3, [](size_t) {}, done.Callback());
  EXPECT_TRUE(done.WaitFor(1));
}

}  // namespace
// With a home per block, every thread starts with its own node's blocks. Each thread's first block
// waits until both threads have one, so neither can take the other node's blocks first. The first
// four blocks are node 0's: a pool that ignored homes would start both threads there.
TEST(WorkerPoolNumaTest, EachThreadStartsWithItsOwnNodesPieces) {
  WorkerPool pool(2, /*pin_threads=*/false, /*thread_nodes=*/{0, 1});
  ASSERT_EQ(pool.nodes(), 2u);
  std::latch both_started(2);
  std::mutex mutex;
  std::map<std::thread::id, std::vector<size_t>> ran;  // per thread, the homes of its blocks in order
  DoneCounter done;
  pool.Submit(
      8,
      [&](size_t i) {
        bool first = false;
        {
          std::lock_guard lock(mutex);
          auto& homes = ran[std::this_thread::get_id()];
          first = homes.empty();
          homes.push_back(i < 4 ? 0 : 1);
        }
        if (first) both_started.arrive_and_wait();
      },
      done.Callback(), /*priority=*/0, [](size_t i) { return i < 4 ? 0u : 1u; });
  ASSERT_TRUE(done.WaitFor(1));
  ASSERT_EQ(ran.size(), 2u);
  std::set<size_t> first_homes;
  size_t total = 0;
  for (const auto& [thread, homes] : ran) {
    first_homes.insert(homes.front());
    total += homes.size();
  }
  EXPECT_EQ(first_homes, (std::set<size_t>{0, 1}));
  EXPECT_EQ(total, 8u);
}

// Homes only order the work: every block still runs exactly once, also when one node has all of it.
TEST(WorkerPoolNumaTest, EveryPieceRunsOnceWhateverTheHomes) {
  WorkerPool pool(4, /*pin_threads=*/false, /*thread_nodes=*/{3, 3, 7, 7});
  ASSERT_EQ(pool.nodes(), 2u);  // numbered densely
  for (const auto& home : std::vector<WorkerPool::Home>{[](size_t i) { return static_cast<uint32_t>(i % 2); },
                                                        [](size_t) { return 1u; }}) {
    std::vector<std::atomic<int>> runs(1000);
    DoneCounter done;
    pool.Submit(
        runs.size(), [&](size_t i) { runs[i].fetch_add(1); }, done.Callback(), 0, home);
    ASSERT_TRUE(done.WaitFor(1));
    for (const auto& r : runs) EXPECT_EQ(r.load(), 1);
  }
}

}  // namespace trainstream::daemon
