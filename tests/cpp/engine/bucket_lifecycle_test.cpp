// BucketLifecycle alone (daemon/engine/bucket_lifecycle.h): its transitions, and what becomes of a
// bucket in each phase when its step is dropped (a rank left, a discard).
#include "daemon/engine/bucket_lifecycle.h"

#include <gtest/gtest.h>

#include <memory>

namespace trainstream::daemon {
namespace {

using Drop = BucketLifecycle::Drop;
using Pass = BucketLifecycle::Pass;
using Phase = BucketLifecycle::Phase;

constexpr uint64_t kBytes = 4000;

TEST(BucketLifecycle, DeliveredByEveryRankOnceThenAccumulatedItCollectsTheNextMicroBatch) {
  BucketLifecycle bucket(5, 2);
  EXPECT_FALSE(bucket.Deliver(1));
  EXPECT_TRUE(bucket.MidStep());
  EXPECT_TRUE(bucket.Deliver(0));
  bucket.Begin(Pass::kAccumulate);
  EXPECT_FALSE(bucket.Settled());
  EXPECT_EQ(bucket.EndAccumulate(), 0u);
  EXPECT_EQ(bucket.phase, Phase::kCollecting);
  EXPECT_EQ(bucket.pass, Pass::kNone);
  EXPECT_EQ(bucket.micro, 1u);
  EXPECT_EQ(bucket.delivered_count, 0u);
  EXPECT_FALSE(bucket.Deliver(0));
  EXPECT_EQ(bucket.MicrosSeen(), 2u);
}

TEST(BucketLifecycle, ACommitCollectsTheNextStepFromScratch) {
  BucketLifecycle bucket(5, 1);
  ASSERT_TRUE(bucket.Deliver(0));
  bucket.Begin(Pass::kUpdate);
  bucket.plan = std::make_shared<UpdatePlan>();
  bucket.updating = true;
  bucket.Committed(5);
  EXPECT_EQ(bucket.step, 6u);
  EXPECT_EQ(bucket.phase, Phase::kCollecting);
  EXPECT_EQ(bucket.plan, nullptr);
  EXPECT_FALSE(bucket.updating);
  EXPECT_FALSE(bucket.MidStep());
}

TEST(BucketLifecycle, ASpeculatedUpdateIsWrittenUntilItsDecisionAndNotOnceDiscarded) {
  BucketLifecycle bucket(1, 1);
  bucket.Begin(Pass::kSpeculate);
  bucket.plan = std::make_shared<UpdatePlan>();
  bucket.updating = true;
  bucket.StartUpdate(std::make_shared<RunningUpdate>());
  EXPECT_TRUE(bucket.Writing());
  bucket.AwaitDecision();
  EXPECT_TRUE(bucket.Speculated());
  EXPECT_TRUE(bucket.Writing());
  bucket.discard = true;
  EXPECT_FALSE(bucket.Speculated());
  EXPECT_TRUE(bucket.TakeDiscard());
  EXPECT_FALSE(bucket.TakeDiscard());
  bucket.Forget(/*rewrite_upload=*/true);
  EXPECT_FALSE(bucket.Writing());
  EXPECT_TRUE(bucket.upload_dirty);
}

TEST(BucketLifecycle, ARankThatLeavesDropsWhatCanNoLongerComplete) {
  BucketLifecycle idle(3, 2);
  EXPECT_EQ(idle.OnRankLeft(true, kBytes, 2).drop, Drop::kNone);
  EXPECT_FALSE(idle.OnRankLeft(true, kBytes, 2).discards);

  BucketLifecycle partly(3, 2);
  (void)partly.Deliver(0);
  EXPECT_EQ(partly.OnRankLeft(true, kBytes, 2).drop, Drop::kRestart);

  BucketLifecycle norming(3, 2);
  norming.Begin(Pass::kNorm);
  EXPECT_EQ(norming.OnRankLeft(true, kBytes, 2).drop, Drop::kAtPassEnd);

  BucketLifecycle in_place(3, 2);  // updated in place before the decision: it commits as it ran
  in_place.plan = std::make_shared<UpdatePlan>();
  in_place.AwaitDecision();
  EXPECT_EQ(in_place.OnRankLeft(false, kBytes, 2).drop, Drop::kCommitAsRan);
  EXPECT_FALSE(in_place.OnRankLeft(false, kBytes, 2).discards);
  EXPECT_EQ(in_place.OnRankLeft(true, kBytes, 2).drop, Drop::kAbandon);

  BucketLifecycle ahead(4, 2);  // held back by the skew bound: the step before cannot complete now
  ahead.Begin(Pass::kUpdate);
  ahead.HoldBack(1.0f, Pass::kUpdate);
  EXPECT_EQ(ahead.OnRankLeft(true, kBytes, 2).drop, Drop::kDropPending);

  BucketLifecycle updating(3, 2);  // has all its gradients: it commits
  updating.Begin(Pass::kUpdate);
  EXPECT_EQ(updating.OnRankLeft(true, kBytes, 2).drop, Drop::kFinishes);
  EXPECT_TRUE(updating.OnRankLeft(true, kBytes, 2).discards);  // a step ahead of the job
}

TEST(BucketLifecycle, AStreamedUpdateWithoutTheRestOfItsGradientsIsDropped) {
  BucketLifecycle bucket(1, 1);
  bucket.Begin(Pass::kUpdate);
  bucket.streaming = true;
  bucket.grad_bytes = kBytes / 2;
  bucket.updating = true;
  bucket.plan = std::make_shared<UpdatePlan>();
  bucket.StartUpdate(std::make_shared<RunningUpdate>());
  EXPECT_EQ(bucket.OnRankLeft(true, kBytes, 0).drop, Drop::kDropPending);  // no piece runs: now
  bucket.update->unfinished = 1;
  EXPECT_EQ(bucket.OnRankLeft(true, kBytes, 0).drop, Drop::kAtPassEnd);  // when its running piece ends
  bucket.grad_bytes = kBytes;
  EXPECT_EQ(bucket.OnRankLeft(true, kBytes, 0).drop, Drop::kFinishes);
}

TEST(BucketLifecycle, ADiscardDivergesOnlyWhereAnUpdateRanInPlace) {
  BucketLifecycle busy(1, 1);
  busy.Begin(Pass::kAccumulate);
  EXPECT_EQ(busy.OnDiscard(true), Drop::kAtPassEnd);
  busy.HoldBack(1.0f, Pass::kUpdate);
  EXPECT_EQ(busy.OnDiscard(true), Drop::kDropPending);
  BucketLifecycle speculated(1, 1);
  speculated.plan = std::make_shared<UpdatePlan>();
  speculated.AwaitDecision();
  EXPECT_EQ(speculated.OnDiscard(true), Drop::kAbandon);
  EXPECT_EQ(speculated.OnDiscard(false), Drop::kDiverge);
}

}  // namespace
}  // namespace trainstream::daemon
