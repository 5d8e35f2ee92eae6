// One snapshot being taken (daemon/snapshot/snapshot_capture.h), fed commits by hand as the engine
// thread would: a job between two steps is taken at once, and moves on to the next step when a bucket
// turns out to be under way.
#include "daemon/snapshot/snapshot_capture.h"

#include <gtest/gtest.h>

#include <map>

#include "tests/cpp/shm/test_support.h"

namespace trainstream::daemon {
namespace {

// Two fp32 parameters of 1024 elements in two buckets, in a real state segment.
class SnapshotCaptureTest : public ::testing::Test {
 protected:
  SnapshotCaptureTest() {
    spec_.params = {shm::ParamSpec{.name = "a", .shape = {1024}, .dtype = DType::kFloat32, .group = 0},
                    shm::ParamSpec{.name = "b", .shape = {1024}, .dtype = DType::kFloat32, .group = 0}};
    spec_.bucket_bytes = 4096;
    layout_ = shm::ComputeLayout(spec_);
    segment_ = shm::Segment::Create(name_.str(), layout_.state_bytes);
    shm::InitStateSegment(segment_.data(), layout_);
  }
  [[nodiscard]] CommittedState State() const {
    return CommittedState(shm::ViewState(segment_.data(), layout_, spec_), layout_, spec_);
  }
  // Bucket b's update to `step`: its master weights become `step` everywhere, then it commits.
  Commit Committed(uint32_t b, uint64_t step) const {
    for (uint32_t p : layout_.buckets[b].params) std::ranges::fill(State().Param(p).master, static_cast<float>(step));
    State().SetBucketStep(b, step);
    return Commit{.bucket = b, .step = step};
  }
  static Commit Announced(uint32_t b, uint64_t step) { return Commit{.bucket = b, .step = step, .announced = true}; }

  // Every copy handed to the writer until it is complete: per bucket, the step of the master weights
  // it holds (the last copy of a bucket is what the file keeps).
  static std::map<uint32_t, float> Drain(SnapshotCapture& capture) {
    std::map<uint32_t, float> written;
    while (!capture.complete()) {
      const std::optional<CapturedBucket> copy = capture.Next(std::chrono::milliseconds(0));
      if (!copy) break;
      float first = 0;
      std::memcpy(&first, copy->bytes.data(), sizeof(first));
      EXPECT_EQ(first, static_cast<float>(copy->step));
      written[copy->bucket] = first;
    }
    return written;
  }

  testing::ScopedSegmentName name_;
  shm::LayoutSpec spec_;
  shm::JobLayout layout_;
  shm::Segment segment_;
};

TEST_F(SnapshotCaptureTest, BucketsAtTheSameStepAreTakenAsTheyAreAnnounced) {
  for (uint32_t b = 0; b < 2; ++b) Committed(b, 3);
  SnapshotCapture capture(State(), layout_, 1, 3, /*or_next=*/true);
  capture.OnCommit(Announced(0, 3));
  capture.OnCommit(Announced(1, 3));
  EXPECT_TRUE(capture.collected());
  EXPECT_EQ(Drain(capture), (std::map<uint32_t, float>{{0, 3.0f}, {1, 3.0f}}));
  EXPECT_TRUE(capture.complete());
}

// Bucket 1 was being updated when the buckets were announced (the engine skips it); bucket 0, taken at
// step 3, commits step 4 first: every bucket is taken again at step 4, the copy the writer had already
// taken is written over.
TEST_F(SnapshotCaptureTest, ABucketUnderWayMovesTheSnapshotToTheNextStep) {
  for (uint32_t b = 0; b < 2; ++b) Committed(b, 3);
  SnapshotCapture capture(State(), layout_, 1, 3, /*or_next=*/true);
  capture.OnCommit(Announced(0, 3));
  EXPECT_EQ(Drain(capture), (std::map<uint32_t, float>{{0, 3.0f}}));  // the writer has it
  capture.OnCommit(Committed(0, 4));
  EXPECT_EQ(capture.target(), 4u);
  EXPECT_FALSE(capture.complete());
  capture.OnCommit(Committed(1, 4));
  EXPECT_TRUE(capture.collected());
  EXPECT_EQ(Drain(capture), (std::map<uint32_t, float>{{0, 4.0f}, {1, 4.0f}}));
  EXPECT_TRUE(capture.complete());
}

// It moves on once: a bucket that then skips a step is a broken history, as for any target.
TEST_F(SnapshotCaptureTest, ItMovesOnOnlyOnce) {
  for (uint32_t b = 0; b < 2; ++b) Committed(b, 3);
  SnapshotCapture capture(State(), layout_, 1, 3, /*or_next=*/true);
  capture.OnCommit(Committed(1, 4));
  capture.OnCommit(Committed(0, 5));
  TS_EXPECT_ERROR(capture.Next(std::chrono::milliseconds(0)), Code::kAborted, "without committing 4");
}

// A target at the next step boundary never moves: a bucket that commits past it broke the history.
TEST_F(SnapshotCaptureTest, ANextStepTargetDoesNotMove) {
  SnapshotCapture capture(State(), layout_, 1, 4);
  capture.OnCommit(Committed(0, 5));
  TS_EXPECT_ERROR(capture.Next(std::chrono::milliseconds(0)), Code::kAborted, "without committing 4");
}

}  // namespace
}  // namespace trainstream::daemon
