// PassScheduler alone (daemon/engine/pass_scheduler.h), with a real worker pool and a real mailbox: a
// pass runs its work once per block, the blocks of a range and no others, and its `done` comes back
// through the mailbox after the last block; the first touch of the state returns at once with one NUMA
// node and, with two, after every bucket's blocks were touched.
#include "daemon/engine/pass_scheduler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <future>
#include <latch>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "shm/job_layout.h"
#include "shm/ring.h"
#include "shm/segment.h"
#include "tests/cpp/shm/test_support.h"

namespace trainstream::daemon {
namespace {

using namespace std::chrono_literals;

constexpr int64_t kBlock = 1 << 16;  // a block's elements at most

bool All(uint32_t /*param*/) {
  return true;
}

bool Same(const Block& a, const Block& b) {
  return a.param == b.param && a.begin == b.begin && a.count == b.count;
}

// A job's state of three fp32 parameters: "a" of three blocks in a bucket of its own, "b" and "c" of
// one block each in another.
class PassSchedulerTest : public ::testing::Test {
 protected:
  PassSchedulerTest() : layout_(shm::ComputeLayout(spec_)) {
    state_segment_ = shm::Segment::Create(state_name_.str(), layout_.state_bytes);
    shm::InitStateSegment(state_segment_.data(), layout_);
    state_ = shm::ViewState(state_segment_.data(), layout_, spec_);
  }

  void SetUp() override {
    ASSERT_EQ(layout_.buckets.size(), 2u);
    ASSERT_EQ(layout_.params[1].bucket, layout_.params[2].bucket);
  }

  static shm::LayoutSpec Spec() {
    shm::LayoutSpec spec;
    spec.params = {shm::ParamSpec{.name = "a", .shape = {2 * kBlock + 10}, .dtype = DType::kFloat32},
                   shm::ParamSpec{.name = "b", .shape = {100}, .dtype = DType::kFloat32},
                   shm::ParamSpec{.name = "c", .shape = {100}, .dtype = DType::kFloat32}};
    spec.bucket_bytes = 4096;
    spec.world_size = 1;
    return spec;
  }

  [[nodiscard]] uint32_t BucketOf(uint32_t param) const { return layout_.params[param].bucket; }

  // Runs what comes back through the mailbox, as the engine thread does, until `done` (5 s at most).
  bool RunUntil(const bool& done) {
    const auto deadline = std::chrono::steady_clock::now() + 5s;
    while (!done && std::chrono::steady_clock::now() < deadline) {
      const uint32_t seen = doorbell_.Seq();
      auto posted = mailbox_.Take();
      if (posted.empty()) doorbell_.Wait(seen, 100ms);
      for (auto& work : posted) work();
    }
    return done;
  }

  shm::LayoutSpec spec_ = Spec();
  shm::JobLayout layout_;
  trainstream::testing::ScopedSegmentName state_name_;
  shm::Segment state_segment_;
  shm::StateView state_{};
  shm::Doorbell doorbell_;
  EngineMailbox mailbox_{doorbell_};
};

TEST_F(PassSchedulerTest, ScheduleRunsTheWorkOncePerBlockAndDoneAfterTheLastOnTheEngineThread) {
  WorkerPool pool(4, /*pin_threads=*/false);
  PassScheduler scheduler(layout_, pool, mailbox_);
  const auto blocks = BlocksOf(layout_, BucketOf(0), All);
  ASSERT_EQ(blocks->size(), 3u);
  std::vector<std::atomic<int>> runs(blocks->size());
  std::atomic<size_t> ran{0};
  bool done = false;
  size_t ran_at_done = 0;
  std::thread::id done_on;
  scheduler.Schedule(
      BucketOf(0), /*priority=*/0, All,
      [&](size_t i, const Block& block) {
        EXPECT_TRUE(Same(block, (*blocks)[i]));
        ++runs[i];
        ++ran;
      },
      [&] {
        done = true;
        ran_at_done = ran.load();
        done_on = std::this_thread::get_id();
      });
  ASSERT_TRUE(RunUntil(done));
  EXPECT_EQ(ran_at_done, blocks->size());
  EXPECT_EQ(done_on, std::this_thread::get_id());
  for (const auto& r : runs) EXPECT_EQ(r.load(), 1);
  mailbox_.WaitIdle();
  EXPECT_TRUE(mailbox_.Take().empty());  // one done, no more
}

TEST_F(PassSchedulerTest, ScheduleRunsOnlyTheBlocksOfTheParametersIncluded) {
  WorkerPool pool(2, /*pin_threads=*/false);
  PassScheduler scheduler(layout_, pool, mailbox_);
  std::mutex mutex;
  std::vector<Block> ran;
  bool done = false;
  scheduler.Schedule(
      BucketOf(1), /*priority=*/0, [](uint32_t p) { return p == 2; },
      [&](size_t, const Block& block) {
        std::lock_guard lock(mutex);
        ran.push_back(block);
      },
      [&] { done = true; });
  ASSERT_TRUE(RunUntil(done));
  ASSERT_EQ(ran.size(), 1u);
  EXPECT_TRUE(Same(ran[0], Block{2, 0, 100}));
}

TEST_F(PassSchedulerTest, ScheduleBlocksRunsExactlyTheIndicesOfItsRange) {
  WorkerPool pool(4, /*pin_threads=*/false);
  PassScheduler scheduler(layout_, pool, mailbox_);
  const auto blocks = BlocksOf(layout_, BucketOf(0), All);
  std::vector<std::atomic<int>> runs(blocks->size());
  bool done = false;
  scheduler.ScheduleBlocks(
      blocks, 1, 3, /*priority=*/0,
      [&](size_t i, const Block& block) {
        EXPECT_TRUE(Same(block, (*blocks)[i]));
        ++runs[i];
      },
      [&] { done = true; });
  ASSERT_TRUE(RunUntil(done));
  EXPECT_EQ(runs[0].load(), 0);
  EXPECT_EQ(runs[1].load(), 1);
  EXPECT_EQ(runs[2].load(), 1);
}

TEST_F(PassSchedulerTest, WithTwoNodesEveryBlockOfARangeRunsOnceOnSomeNode) {
  WorkerPool pool(2, /*pin_threads=*/false, /*thread_nodes=*/{0, 1});
  ASSERT_EQ(pool.nodes(), 2u);
  PassScheduler scheduler(layout_, pool, mailbox_);
  const auto blocks = BlocksOf(layout_, BucketOf(0), All);
  std::vector<std::atomic<int>> runs(blocks->size());
  bool done = false;
  scheduler.ScheduleBlocks(
      blocks, 1, 3, /*priority=*/0, [&](size_t i, const Block&) { ++runs[i]; }, [&] { done = true; });
  ASSERT_TRUE(RunUntil(done));
  EXPECT_EQ(runs[0].load(), 0);
  EXPECT_EQ(runs[1].load(), 1);
  EXPECT_EQ(runs[2].load(), 1);
}

TEST_F(PassSchedulerTest, AnEmptyRangeStillEndsWithOneDoneThroughTheMailbox) {
  WorkerPool pool(1, /*pin_threads=*/false);
  PassScheduler scheduler(layout_, pool, mailbox_);
  int done = 0;
  scheduler.ScheduleBlocks(
      BlocksOf(layout_, BucketOf(0), All), 2, 2, /*priority=*/0, [](size_t, const Block&) { ADD_FAILURE(); },
      [&] { ++done; });
  EXPECT_EQ(done, 0);  // not before the engine thread takes it
  for (auto& work : mailbox_.Take()) work();
  EXPECT_EQ(done, 1);
  mailbox_.WaitIdle();
}

TEST_F(PassSchedulerTest, TouchReturnsAtOnceWithOneNodeAndTouchesNothing) {
  WorkerPool pool(1, /*pin_threads=*/false);
  ASSERT_EQ(pool.nodes(), 1u);
  PassScheduler scheduler(layout_, pool, mailbox_);
  const BucketPasses passes(layout_, state_, spec_.moment_dtype);
  std::fill_n(state_.halves[0].master, layout_.total_elems, 7.0f);
  // The pool's only thread is busy until the touch returns: a touch that ran on it would never return.
  std::promise<void> release;
  std::latch busy(1);
  pool.Submit(
      1,
      [&busy, released = release.get_future().share()](size_t) {
        busy.count_down();
        released.wait();
      },
      [] {}, /*priority=*/1000);
  busy.wait();
  auto touched = std::async(std::launch::async, [&] { scheduler.Touch(passes); });
  const bool returned = touched.wait_for(5s) == std::future_status::ready;
  release.set_value();
  touched.wait();
  EXPECT_TRUE(returned);
  EXPECT_TRUE(std::all_of(state_.halves[0].master, state_.halves[0].master + layout_.total_elems,
                          [](float w) { return w == 7.0f; }));
}

TEST_F(PassSchedulerTest, WithTwoNodesTouchReturnsOnceEveryBucketsStateIsTouched) {
  WorkerPool pool(2, /*pin_threads=*/false, /*thread_nodes=*/{0, 1});
  PassScheduler scheduler(layout_, pool, mailbox_);
  const BucketPasses passes(layout_, state_, spec_.moment_dtype);
  float* const master = state_.halves[0].master;
  for (const shm::ParamLayout& param : layout_.params) {
    std::fill_n(master + layout_.buckets[param.bucket].elem_offset + param.offset_in_bucket, param.numel, 7.0f);
  }
  scheduler.Touch(passes);
  for (const shm::ParamLayout& param : layout_.params) {
    const float* const weights = master + layout_.buckets[param.bucket].elem_offset + param.offset_in_bucket;
    EXPECT_TRUE(std::all_of(weights, weights + param.numel, [](float w) { return w == 0.0f; }));
  }
  EXPECT_TRUE(mailbox_.Take().empty());  // the engine thread waited: nothing comes back
}

}  // namespace
}  // namespace trainstream::daemon
