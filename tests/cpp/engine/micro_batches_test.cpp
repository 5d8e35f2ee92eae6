// MicroBatches alone (daemon/engine/micro_batches.h): which micro-batch is a step's last for a job with
// a fixed count and for one that counts them (its terms, kMoreMicro, what its ranks expect), the
// numbering of a step's discards, and the accumulator a counting job maps when it first needs one.
#include "daemon/engine/micro_batches.h"

#include <gtest/gtest.h>

#include <string>

#include "shm/error.h"
#include "shm/message.h"

namespace trainstream::daemon {
namespace {

using Last = MicroBatches::Last;
using Discard = MicroBatches::Discard;

BucketLifecycle Collecting(uint64_t step, uint32_t micro, uint16_t flags) {
  BucketLifecycle bucket(step, 1);
  bucket.micro = micro;
  bucket.flags = flags;
  return bucket;
}

TEST(MicroBatches, AFixedCountSaysWhichIsTheLast) {
  const MicroBatches micro(3, nullptr, 0);
  EXPECT_EQ(micro.LastOf(Collecting(1, 1, shm::kFinalMicro), nullptr), Last::kNo);
  EXPECT_EQ(micro.LastOf(Collecting(1, 2, 0), nullptr), Last::kYes);
}

TEST(MicroBatches, ACountingJobGoesByTheTermsThenMoreMicroThenWhatTheRanksExpect) {
  MicroBatches micro(0, nullptr, 0);
  EXPECT_EQ(micro.LastOf(Collecting(4, 0, shm::kUncertainMicro), nullptr), Last::kUnknown);
  EXPECT_EQ(micro.LastOf(Collecting(4, 0, shm::kFinalMicro), nullptr), Last::kYes);
  EXPECT_TRUE(micro.More(4, 0));
  EXPECT_FALSE(micro.More(4, 0));  // another rank said it already
  EXPECT_EQ(micro.LastOf(Collecting(4, 0, shm::kFinalMicro), nullptr), Last::kNo);
  EXPECT_EQ(micro.LastOf(Collecting(5, 0, shm::kFinalMicro), nullptr), Last::kYes);  // another step
  EXPECT_THROW(micro.CheckTerms(4, 1), Error);  // a second backward pass came: at least 2
  micro.CheckTerms(4, 2);
  StepGate gate(1, 1, false, 1.0f, false);
  gate.SetTerms(StepGate::FromOptions(3, 0));
  EXPECT_EQ(micro.LastOf(Collecting(4, 1, shm::kFinalMicro), &gate), Last::kNo);
  EXPECT_EQ(micro.LastOf(Collecting(4, 2, shm::kUncertainMicro), &gate), Last::kYes);
  micro.Forget();
  EXPECT_EQ(micro.LastOf(Collecting(4, 0, shm::kFinalMicro), nullptr), Last::kYes);
}

TEST(MicroBatches, ABucketWhoseMicroBatchesTheTermsCountAreAllAccumulatedHasItsLastGradientsIn) {
  StepGate gate(1, 1, false, 1.0f, false);
  BucketLifecycle bucket = Collecting(2, 2, 0);
  EXPECT_FALSE(MicroBatches::AllAccumulated(bucket, &gate));  // the terms said no count yet
  gate.SetTerms(StepGate::FromOptions(2, 0));
  EXPECT_FALSE(MicroBatches::AllAccumulated(bucket, &gate));  // nothing accumulated
  bucket.accumulated = true;
  EXPECT_TRUE(MicroBatches::AllAccumulated(bucket, &gate));
  (void)bucket.Deliver(0);  // a third micro-batch came
  EXPECT_FALSE(MicroBatches::AllAccumulated(bucket, &gate));
}

TEST(MicroBatches, TheFirstRanksDiscardDropsTheStepTheOthersFindItDropped) {
  MicroBatches micro(0, nullptr, 0);
  EXPECT_EQ(micro.OnDiscard(3, 1, 0), Discard::kDrop);
  micro.Dropping(3);
  EXPECT_EQ(micro.OnDiscard(3, 1, 1), Discard::kBeingDropped);
  EXPECT_EQ(micro.FinishDiscard(), std::optional<uint64_t>(3));
  EXPECT_FALSE(micro.FinishDiscard());
  EXPECT_EQ(micro.OnDiscard(3, 1, 2), Discard::kDropped);
  EXPECT_EQ(micro.discards(), 1u);
  EXPECT_THROW((void)micro.OnDiscard(3, 3, 0), Error);  // the second came before
  EXPECT_EQ(micro.OnDiscard(3, 2, 0), Discard::kDrop);
  EXPECT_EQ(micro.OnDiscard(4, 1, 0), Discard::kDrop);  // numbered per step
}

TEST(MicroBatches, ACountingJobMapsItsOwnAccumulatorOnceAndOnlyWithoutTheSegments) {
  float segment[4] = {};
  MicroBatches with_segment(2, segment, 4);
  EXPECT_EQ(with_segment.Accumulator("job"), segment);
  EXPECT_EQ(with_segment.own_bytes(), 0u);
  MicroBatches counting(0, nullptr, 1000);
  EXPECT_EQ(counting.accumulator(), nullptr);
  float* own = counting.Accumulator("job");
  ASSERT_NE(own, nullptr);
  EXPECT_EQ(counting.Accumulator("job"), own);
  EXPECT_GE(counting.own_bytes(), 1000 * sizeof(float));
}

}  // namespace
}  // namespace trainstream::daemon
