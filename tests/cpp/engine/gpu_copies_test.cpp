// The GPU copies' decisions alone (daemon/engine/gpu_copies.h), over a rank's RankCopies and a bucket's
// BucketLifecycle: which weights go to a cuda-ipc rank's GPU and when, and what a finished push leaves
// it holding.
#include "daemon/engine/gpu_copies.h"

#include <gtest/gtest.h>

#include <memory>

namespace trainstream::daemon {
namespace {

using Kind = PushOrder::Kind;

constexpr uint64_t kBytes = 4000;
constexpr uint64_t kOffset = 64;

TEST(GpuCopies, CommittedWeightsGoOnceTheRankWantsThemAndOnlyOnce) {
  RankCopies rank(1);
  const BucketLifecycle bucket(4, 1);
  EXPECT_EQ(NextPush(rank, 0, bucket, 3, kOffset, kBytes).kind, Kind::kNone);  // not asked for yet
  rank.weights_wanted = 3;
  const PushOrder order = NextPush(rank, 0, bucket, 3, kOffset, kBytes);
  EXPECT_EQ(order.kind, Kind::kCommitted);
  EXPECT_EQ(order.step, 3);
  EXPECT_EQ(order.end, kBytes);
  rank.pushing[0] = 1;
  EXPECT_EQ(NextPush(rank, 0, bucket, 3, kOffset, kBytes).kind, Kind::kNone);  // one push at a time
  rank.pushing[0] = 0;
  rank.pushed[0] = 3;
  EXPECT_EQ(NextPush(rank, 0, bucket, 3, kOffset, kBytes).kind, Kind::kNone);
}

TEST(GpuCopies, NoCopyWhereTheGpuHoldsTheWeightsOrKeepsTheBucketOff) {
  RankCopies rank(1);
  rank.weights_wanted = 3;
  const BucketLifecycle bucket(4, 1);
  EXPECT_EQ(NextPush(rank, 0, bucket, 3, std::nullopt, kBytes).kind, Kind::kReady);  // weight paging
  rank.on_gpu = 3;                                                                   // its own load
  EXPECT_EQ(NextPush(rank, 0, bucket, 3, kOffset, kBytes).kind, Kind::kReady);
  rank.on_gpu = -1;
  rank.speculated[0] = 3;  // the speculation that committed
  EXPECT_EQ(NextPush(rank, 0, bucket, 3, kOffset, kBytes).kind, Kind::kReady);
}

TEST(GpuCopies, AnUpdatingBucketIsNotPushedExceptThePiecesItsUpdateWrote) {
  RankCopies rank(1);
  rank.weights_wanted = 4;
  BucketLifecycle bucket(4, 1);
  bucket.Begin(BucketLifecycle::Pass::kUpdate);
  bucket.updating = true;
  EXPECT_EQ(NextPush(rank, 0, bucket, 3, kOffset, kBytes).kind, Kind::kNone);
  bucket.plan = std::make_shared<UpdatePlan>();
  auto update = std::make_shared<RunningUpdate>();
  update->pieces = {{1, 1200}, {2, 2400}, {3, kBytes}};
  update->written = 2;
  bucket.StartUpdate(update);
  PushOrder order = NextPush(rank, 0, bucket, 3, kOffset, kBytes);
  EXPECT_EQ(order.kind, Kind::kWritten);
  EXPECT_EQ(order.step, 4);
  EXPECT_EQ(order.begin, 0u);
  EXPECT_EQ(order.end, 2400u);
  rank.streamed[0] = 2;
  EXPECT_EQ(NextPush(rank, 0, bucket, 3, kOffset, kBytes).kind, Kind::kNone);  // nothing new written
  update->written = 3;
  order = NextPush(rank, 0, bucket, 3, kOffset, kBytes);
  EXPECT_EQ(order.begin, 2400u);
  EXPECT_EQ(order.end, kBytes);
}

TEST(GpuCopies, AWrittenPushThatEndsTheBucketIsRecordedAsSpeculatedUnlessAStateLoadOvertookIt) {
  RankCopies rank(1);
  rank.pushing[0] = 2;
  EXPECT_TRUE(PushEnded(rank, 0, 5, 0, /*written=*/true, /*last=*/false, true, true));
  EXPECT_EQ(rank.speculated[0], -1);  // the GPU does not hold all of it yet
  rank.Reloaded(0, 1, 9);
  EXPECT_FALSE(PushEnded(rank, 0, 5, 0, true, true, true, true));  // sent before the load
  EXPECT_EQ(rank.speculated[0], -1);
  EXPECT_EQ(rank.pushing[0], 0u);
  rank.pushing[0] = 1;
  EXPECT_TRUE(PushEnded(rank, 0, 10, 1, true, true, true, true));
  EXPECT_EQ(rank.speculated[0], 10);
  rank.ForgetSpeculated(0);  // redone: the GPU holds no committed weights of the bucket
  EXPECT_EQ(rank.speculated[0], -1);
  EXPECT_EQ(rank.pushed[0], -1);
}

TEST(GpuCopies, ALoaderThatSaysItsGpuHoldsWhatItLoadedNeedsNoPush) {
  RankCopies loader(1), other(1);
  loader.claims_on_gpu = other.claims_on_gpu = 7;
  loader.pushed[0] = other.pushed[0] = 6;
  loader.Reloaded(0, 0, 7);
  other.Reloaded(1, 0, 7);
  EXPECT_EQ(loader.on_gpu, 7);
  EXPECT_EQ(other.on_gpu, -1);
  EXPECT_EQ(other.pushed[0], -1);
}

TEST(GpuCopies, ABucketIsStagedInSlotSizedPieces) {
  shm::BucketLayout bucket;
  bucket.numel = 1000;
  bucket.dtype = DType::kFloat32;
  EXPECT_EQ(PiecesOf(bucket, bucket.bytes()), 1u);
  EXPECT_EQ(PiecesOf(bucket, bucket.bytes() - 1), 2u);
  EXPECT_EQ(PiecesOf(bucket, 1000), (bucket.bytes() + 999) / 1000);
}

}  // namespace
}  // namespace trainstream::daemon
