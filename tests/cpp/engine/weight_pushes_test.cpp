// WeightPushes alone (daemon/engine/weight_pushes.h), over a real state segment, real rank segments and
// a real mailbox, with a fake GPU whose pushes the test ends: PARAMS_READY to a rank that maps the host
// regions; a cuda-ipc rank's weights pushed once it asked for them, PARAMS_READY after the push; the
// bucket's count of the pushes that read it; a failed push; pushes held while the state loads; a load's
// end; the pieces of an update pushed before its commit.
#include "daemon/engine/weight_pushes.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "daemon/engine/rank_channel.h"
#include "daemon/engine/rank_transfer.h"
#include "shm/error.h"
#include "shm/job_layout.h"
#include "shm/message.h"
#include "shm/ring.h"
#include "shm/segment.h"
#include "tests/cpp/engine/recording_sink.h"
#include "tests/cpp/shm/test_support.h"

namespace trainstream::daemon {
namespace {

using shm::Message;
using shm::MessageKind;
using Ready = std::vector<std::pair<uint32_t, uint64_t>>;  // PARAMS_READY messages, as (bucket, step)

constexpr int64_t kElements = 1024;  // per parameter: 4 KiB of fp32, a bucket of its own

// A RankTransfer whose "GPU" is a host buffer. A push is held until the test ends it (EndPush): it is
// copied then, and its end reported from a thread of its own, as a GPU's stream would. The rank's
// weights-wanted events have always completed.
class HeldGpu final : public RankTransfer {
 public:
  struct Push {
    uint64_t offset;
    const std::byte* host;
    size_t bytes;
    Done done;
  };

  HeldGpu(std::vector<uint64_t> offsets, size_t bytes) : params(bytes), offsets_(std::move(offsets)) {}
  [[nodiscard]] uint32_t staging_slots() const override { return 1; }
  [[nodiscard]] uint64_t slot_bytes() const override { return uint64_t{1} << 20; }
  [[nodiscard]] uint32_t weights_wanted_events() const override { return 2; }
  void PullGradients(uint32_t, void*, size_t, Done done) override {
    ADD_FAILURE() << "WeightPushes pulled gradients";
    done(Error(Code::kInternal, "not a GPU with gradients"));
  }
  void AwaitWeightsWanted(uint32_t, Done done) override { done(std::nullopt); }
  [[nodiscard]] std::optional<uint64_t> ParamsOffset(uint32_t bucket) const override { return offsets_.at(bucket); }
  void PushWeights(uint64_t offset, const void* host, size_t bytes, Done done) override {
    held_.push_back(Push{offset, static_cast<const std::byte*>(host), bytes, std::move(done)});
  }
  void WillCopy(std::vector<HostRange>) override {}
  void Abandon() override {}
  void ReleaseHost(const void*, size_t) override {}

  // The pushes not ended yet, oldest first.
  [[nodiscard]] const std::deque<Push>& held() const { return held_; }
  // Ends the oldest push held: copies it unless it failed, and reports its end.
  void EndPush(std::optional<Error> error = std::nullopt) {
    ASSERT_FALSE(held_.empty());
    Push push = std::move(held_.front());
    held_.pop_front();
    if (!error) std::memcpy(params.data() + push.offset, push.host, push.bytes);
    std::thread([&push, &error] { push.done(std::move(error)); }).join();
  }
  // A push's callback holds the rank's channel, which holds this: a test that ends with pushes held
  // drops them.
  void Drop() { held_.clear(); }

  std::vector<std::byte> params;  // the rank's flat parameter buffer

 private:
  std::vector<uint64_t> offsets_;
  std::deque<Push> held_;
};

// A job of two fp32 parameters in two buckets and two ranks, its state seeded; no rank attached yet.
class WeightPushesTest : public ::testing::Test {
 protected:
  WeightPushesTest() : layout_(shm::ComputeLayout(spec_)) {
    state_segment_ = shm::Segment::Create(state_name_.str(), layout_.state_bytes);
    shm::InitStateSegment(state_segment_.data(), layout_);
    state_ = shm::ViewState(state_segment_.data(), layout_, spec_);
    state_.header->initialized = 1;
    buckets_.assign(layout_.buckets.size(), BucketLifecycle(1, spec_.world_size));
  }
  ~WeightPushesTest() override {
    for (const auto& gpu : gpus_) gpu->Drop();
  }
  WeightPushesTest(const WeightPushesTest&) = delete;
  WeightPushesTest& operator=(const WeightPushesTest&) = delete;

  void SetUp() override { ASSERT_EQ(layout_.buckets.size(), 2u); }

  static shm::LayoutSpec Spec() {
    shm::LayoutSpec spec;
    spec.params = {shm::ParamSpec{.name = "a", .shape = {kElements}, .dtype = DType::kFloat32},
                   shm::ParamSpec{.name = "b", .shape = {kElements}, .dtype = DType::kFloat32}};
    spec.bucket_bytes = 4096;
    spec.world_size = 2;
    return spec;
  }

  // A rank that maps the host regions (no transfer).
  std::shared_ptr<RankChannel> Attach(uint32_t rank) {
    shm::Segment segment = shm::Segment::Create(names_.emplace_back().str(), layout_.rank_bytes);
    shm::InitRankSegment(segment.data(), layout_, rank);
    auto channel = std::make_shared<RankChannel>(rank, ClientSegment(std::move(segment), geteuid()), layout_,
                                                 sinks_.emplace_back(std::make_shared<RecordingSink>()));
    ranks_.Add(channel);
    return channel;
  }
  // A cuda-ipc rank: its buckets lie back to back in its GPU's parameter buffer.
  std::pair<std::shared_ptr<RankChannel>, std::shared_ptr<HeldGpu>> AttachCudaIpc(uint32_t rank) {
    offsets_.clear();
    uint64_t end = 0;
    for (uint32_t b = 0; b < layout_.buckets.size(); ++b) {
      offsets_.push_back(end);
      end += Bytes(b);
    }
    auto gpu = std::make_shared<HeldGpu>(offsets_, end);
    auto channel = Attach(rank);
    ranks_.SetTransfer(rank, gpu);
    gpus_.push_back(gpu);
    return {channel, gpu};
  }
  [[nodiscard]] uint64_t Offset(uint32_t b) const { return offsets_.at(b); }
  [[nodiscard]] uint64_t Bytes(uint32_t b) const { return layout_.buckets[b].bytes(); }

  // What bucket b's update writes (one state half: in place).
  void WriteMaster(uint32_t b, float value) {
    std::fill_n(state_.halves[0].master + layout_.buckets[b].elem_offset, layout_.buckets[b].numel, value);
  }
  void Commit(uint32_t b, uint64_t step) {
    state_.bucket_state[b].Store(shm::BucketCommit{.step = step, .half = 0});
    buckets_[b].Committed(step);
  }
  // Every bucket's weights of `step` committed, each bucket's its own.
  void CommitAll(uint64_t step) {
    for (uint32_t b = 0; b < layout_.buckets.size(); ++b) {
      WriteMaster(b, static_cast<float>(10 * step + b));
      Commit(b, step);
    }
  }
  [[nodiscard]] bool GpuHolds(const HeldGpu& gpu, uint32_t b) const {
    return std::memcmp(gpu.params.data() + Offset(b), state_.halves[0].master + layout_.buckets[b].elem_offset,
                       Bytes(b)) == 0;
  }

  // The rank called optimizer.step() for `step`.
  void WantWeights(const std::shared_ptr<RankChannel>& channel, uint64_t step, uint16_t flags = 0) {
    pushes_.OnWeightsWanted(channel, Message{.kind = MessageKind::kWeightsWanted, .flags = flags, .step = step});
  }
  // Runs what came back through the mailbox, as the engine thread would.
  void RunContinuations() {
    for (auto& work : mailbox_.Take()) work();
  }
  // Ends every push held (and those their ends start), running their continuations.
  void EndAll(HeldGpu& gpu) {
    while (!gpu.held().empty()) {
      gpu.EndPush();
      RunContinuations();
    }
  }
  // The PARAMS_READY posted to `rank` since the last call; nothing else may have been posted.
  Ready ParamsReady(uint32_t rank) {
    shm::RingConsumer ring(ranks_[rank]->view.completion_ring);
    Ready ready;
    Message message;
    while (ring.TryPop(&message)) {
      EXPECT_EQ(message.kind, MessageKind::kParamsReady);
      ready.emplace_back(message.bucket, message.step);
    }
    return ready;
  }

  shm::LayoutSpec spec_ = Spec();
  shm::JobLayout layout_;
  trainstream::testing::ScopedSegmentName state_name_;
  shm::Segment state_segment_;
  shm::StateView state_{};
  std::deque<trainstream::testing::ScopedSegmentName> names_;
  std::deque<std::shared_ptr<RecordingSink>> sinks_;
  std::vector<std::shared_ptr<HeldGpu>> gpus_;
  std::vector<uint64_t> offsets_;
  std::vector<BucketLifecycle> buckets_;
  RankTable ranks_{"job", 2, nullptr, nullptr};
  shm::Doorbell doorbell_;
  EngineMailbox mailbox_{doorbell_};
  bool loading_ = false;
  std::vector<uint32_t> unread_;  // the buckets on_unread named, in order
  WeightPushes pushes_{layout_,  state_,
                       buckets_, ranks_,
                       mailbox_, /*trace=*/nullptr,
                       loading_, [this](uint32_t b) { unread_.push_back(b); }};
};

TEST_F(WeightPushesTest, PublishPostsParamsReadyToARankWithoutATransferAndNothingToAFailedOne) {
  Attach(0);
  ranks_.FailRank(*Attach(1), "bad message");
  CommitAll(1);
  pushes_.Publish(1, 1);
  EXPECT_EQ(ParamsReady(0), (Ready{{1, 1}}));
  EXPECT_TRUE(ParamsReady(1).empty());
  EXPECT_TRUE(mailbox_.Take().empty());
}

TEST_F(WeightPushesTest, ACudaIpcRankIsPushedTheCommittedWeightsOnlyOnceItAskedAndHearsParamsReadyAfter) {
  const auto [channel, gpu] = AttachCudaIpc(0);
  CommitAll(1);
  pushes_.Publish(1, 1);
  pushes_.Publish(0, 1);
  EXPECT_TRUE(gpu->held().empty());  // optimizer.step() was not called yet: its kernels may read them
  EXPECT_TRUE(ParamsReady(0).empty());
  WantWeights(channel, 1);
  ASSERT_EQ(gpu->held().size(), 2u);
  EXPECT_EQ(gpu->held()[0].offset, Offset(1));  // the first layers first
  EXPECT_EQ(gpu->held()[0].bytes, Bytes(1));
  EXPECT_EQ(gpu->held()[1].offset, Offset(0));
  RunContinuations();  // the wait for the rank's event
  EXPECT_EQ(channel->view.header->weights_wanted_waits.load(), 1u);
  gpu->EndPush();
  EXPECT_TRUE(ParamsReady(0).empty());  // the push's end is the engine thread's to handle
  RunContinuations();
  EXPECT_TRUE(GpuHolds(*gpu, 1));
  EXPECT_EQ(ParamsReady(0), (Ready{{1, 1}}));
  EndAll(*gpu);
  EXPECT_TRUE(GpuHolds(*gpu, 0));
  EXPECT_EQ(ParamsReady(0), (Ready{{0, 1}}));
  pushes_.Publish(0, 1);  // the GPU holds them: neither a second push nor a second PARAMS_READY
  EXPECT_TRUE(gpu->held().empty());
  EXPECT_TRUE(ParamsReady(0).empty());
}

TEST_F(WeightPushesTest, APushCountsOnItsBucketUntilItsEndIsHandledAndThenTheBucketIsUnread) {
  const auto [channel, gpu] = AttachCudaIpc(0);
  CommitAll(1);
  WantWeights(channel, 1);
  EXPECT_EQ(buckets_[0].pushes, 1u);
  EXPECT_EQ(buckets_[1].pushes, 1u);
  EXPECT_FALSE(buckets_[1].Settled());
  gpu->EndPush();  // bucket 1's
  EXPECT_EQ(buckets_[1].pushes, 1u);
  EXPECT_TRUE(unread_.empty());
  RunContinuations();
  EXPECT_EQ(buckets_[1].pushes, 0u);
  EXPECT_EQ(buckets_[0].pushes, 1u);
  EXPECT_EQ(unread_, std::vector<uint32_t>{1});
  EndAll(*gpu);
  EXPECT_EQ(buckets_[0].pushes, 0u);
  EXPECT_EQ(unread_, (std::vector<uint32_t>{1, 0}));
}

TEST_F(WeightPushesTest, AFailedPushFailsItsRankSayingWhyAndPostsNoParamsReady) {
  const auto [channel, gpu] = AttachCudaIpc(0);
  CommitAll(1);
  WantWeights(channel, 1);
  RunContinuations();
  gpu->EndPush(Error(Code::kInternal, "an illegal memory access"));
  RunContinuations();
  EXPECT_TRUE(channel->failed);
  EXPECT_EQ(sinks_[0]->failures(),
            std::vector<std::string>{"copying bucket 1's weights to the GPU failed: an illegal memory access"});
  EXPECT_EQ(unread_, std::vector<uint32_t>{1});  // the bucket is free all the same
  EndAll(*gpu);                                  // the other push ends after the rank failed
  EXPECT_EQ(unread_, (std::vector<uint32_t>{1, 0}));
  EXPECT_TRUE(ParamsReady(0).empty());
  EXPECT_EQ(sinks_[0]->failures().size(), 1u);
}

TEST_F(WeightPushesTest, NothingIsPushedWhileTheStateLoadsNorBeforeTheSeedIsWritten) {
  const auto [channel, gpu] = AttachCudaIpc(0);
  CommitAll(1);
  loading_ = true;
  WantWeights(channel, 1);
  pushes_.Publish(0, 1);
  EXPECT_TRUE(gpu->held().empty());
  loading_ = false;
  state_.header->initialized = 0;
  pushes_.Publish(0, 1);
  EXPECT_TRUE(gpu->held().empty());
  EXPECT_TRUE(ParamsReady(0).empty());
  state_.header->initialized = 1;
  pushes_.Publish(0, 1);
  ASSERT_EQ(gpu->held().size(), 1u);
  EXPECT_EQ(gpu->held()[0].offset, Offset(0));
  EndAll(*gpu);
  EXPECT_EQ(ParamsReady(0), (Ready{{0, 1}}));
}

TEST_F(WeightPushesTest, ALoadPublishesEveryBucketAndPushesNothingToTheLoaderWhoseGpuHoldsWhatItLoaded) {
  Attach(0);
  const auto [loader, gpu] = AttachCudaIpc(1);
  loading_ = true;
  CommitAll(7);
  WantWeights(loader, 7, shm::kWeightsOnGpu);
  loading_ = false;
  pushes_.Loaded(1, 7);
  EXPECT_EQ(ParamsReady(0), (Ready{{1, 7}, {0, 7}}));
  EXPECT_EQ(ParamsReady(1), (Ready{{1, 7}, {0, 7}}));
  EXPECT_TRUE(gpu->held().empty());
  RunContinuations();
}

TEST_F(WeightPushesTest, AClaimThatArrivesAfterItsLoadEndedIsHonouredToo) {
  const auto [loader, gpu] = AttachCudaIpc(1);
  CommitAll(7);
  pushes_.Loaded(1, 7);
  EXPECT_TRUE(ParamsReady(1).empty());  // not asked for yet
  WantWeights(loader, 7, shm::kWeightsOnGpu);
  EXPECT_TRUE(gpu->held().empty());
  EXPECT_EQ(ParamsReady(1), (Ready{{1, 7}, {0, 7}}));
  RunContinuations();
}

TEST_F(WeightPushesTest, ARankThatDidNotLoadTheStateIsPushedItWhateverItClaims) {
  const auto [channel, gpu] = AttachCudaIpc(1);
  loading_ = true;
  CommitAll(7);
  WantWeights(channel, 7, shm::kWeightsOnGpu);
  loading_ = false;
  pushes_.Loaded(0, 7);  // rank 0 loaded it
  EXPECT_EQ(gpu->held().size(), 2u);
  EXPECT_TRUE(ParamsReady(1).empty());
  RunContinuations();
  EndAll(*gpu);
  EXPECT_TRUE(GpuHolds(*gpu, 0) && GpuHolds(*gpu, 1));
  EXPECT_EQ(ParamsReady(1), (Ready{{1, 7}, {0, 7}}));
}

TEST_F(WeightPushesTest, APushALoadOvertookPostsNoParamsReadyAndTheLoadedWeightsFollowOnceAsked) {
  const auto [channel, gpu] = AttachCudaIpc(0);
  CommitAll(1);
  WantWeights(channel, 1);
  RunContinuations();
  ASSERT_EQ(gpu->held().size(), 2u);
  loading_ = true;  // rank 1 loads step 7 while both pushes are in flight
  CommitAll(7);
  loading_ = false;
  pushes_.Loaded(1, 7);
  EXPECT_EQ(gpu->held().size(), 2u);  // one push of a bucket at a time
  EndAll(*gpu);
  EXPECT_TRUE(ParamsReady(0).empty());
  EXPECT_EQ(unread_, (std::vector<uint32_t>{1, 0}));
  WantWeights(channel, 7);
  RunContinuations();
  EXPECT_EQ(gpu->held().size(), 2u);
  EndAll(*gpu);
  EXPECT_TRUE(GpuHolds(*gpu, 0) && GpuHolds(*gpu, 1));
  EXPECT_EQ(ParamsReady(0), (Ready{{1, 7}, {0, 7}}));
}

// The bucket's update of its next step, in place, in two pieces of which the first is written.
std::shared_ptr<RunningUpdate> UpdateInTwoPieces(BucketLifecycle& bucket, uint64_t bytes) {
  bucket.Begin(BucketLifecycle::Pass::kUpdate);
  bucket.updating = true;
  bucket.plan = std::make_shared<UpdatePlan>();  // from half 0 into half 0
  auto update = std::make_shared<RunningUpdate>();
  update->pieces = {{1, bytes / 2}, {2, bytes}};
  update->written = 1;
  bucket.StartUpdate(update);
  return update;
}

TEST_F(WeightPushesTest, AnUpdatesWrittenPiecesGoBeforeItsCommitWhichThenPostsParamsReadyWithoutACopy) {
  const auto [channel, gpu] = AttachCudaIpc(0);
  CommitAll(1);
  const auto update = UpdateInTwoPieces(buckets_[0], Bytes(0));
  WriteMaster(0, 2.5f);
  WantWeights(channel, 2);
  ASSERT_EQ(gpu->held().size(), 2u);  // bucket 1's committed weights of step 1, bucket 0's first piece
  EXPECT_EQ(gpu->held()[1].offset, Offset(0));
  EXPECT_EQ(gpu->held()[1].bytes, Bytes(0) / 2);
  EndAll(*gpu);
  EXPECT_EQ(ParamsReady(0), (Ready{{1, 1}}));  // nothing for a piece
  update->written = 2;
  pushes_.PushWritten(0);
  ASSERT_EQ(gpu->held().size(), 1u);
  EXPECT_EQ(gpu->held()[0].offset, Offset(0) + Bytes(0) / 2);
  EXPECT_EQ(buckets_[0].pushes, 1u);
  EndAll(*gpu);
  EXPECT_TRUE(ParamsReady(0).empty());
  Commit(0, 2);
  pushes_.Publish(0, 2);
  EXPECT_TRUE(gpu->held().empty());
  EXPECT_TRUE(GpuHolds(*gpu, 0));
  EXPECT_EQ(ParamsReady(0), (Ready{{0, 2}}));
}

TEST_F(WeightPushesTest, ARedoneUpdatesPushedPiecesAreForgottenAndItsCommitPushesTheWholeBucket) {
  const auto [channel, gpu] = AttachCudaIpc(0);
  CommitAll(1);
  const auto update = UpdateInTwoPieces(buckets_[0], Bytes(0));
  update->written = 2;
  WantWeights(channel, 2);
  EndAll(*gpu);
  ASSERT_EQ(ParamsReady(0), (Ready{{1, 1}}));
  pushes_.ForgetSpeculated(0);  // redone: what it wrote is void
  WriteMaster(0, 3.5f);
  Commit(0, 2);
  pushes_.Publish(0, 2);
  ASSERT_EQ(gpu->held().size(), 1u);
  EXPECT_EQ(gpu->held()[0].bytes, Bytes(0));
  EXPECT_TRUE(ParamsReady(0).empty());
  EndAll(*gpu);
  EXPECT_TRUE(GpuHolds(*gpu, 0));
  EXPECT_EQ(ParamsReady(0), (Ready{{0, 2}}));
}

}  // namespace
}  // namespace trainstream::daemon
