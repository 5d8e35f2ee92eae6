// Tests of the step engine's multi-node path (daemon/engine/step_engine.h) with a fake all-reduce
// (daemon/engine/all_reduce.h) that plays the other node, over real shared memory: what the engine
// hands the all-reduce (this node's sum, in the accumulator), that the update uses what comes back,
// that a failed all-reduce fails the sessions and marks the job diverged, and that a rank leaving
// mid-step resets the all-reduce.
#include <gtest/gtest.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "daemon/engine/all_reduce.h"
#include "daemon/engine/rank_channel.h"
#include "daemon/engine/step_engine.h"
#include "daemon/engine/worker_pool.h"
#include "shm/error.h"
#include "shm/job_layout.h"
#include "shm/message.h"
#include "shm/ring.h"
#include "shm/segment.h"
#include "tests/cpp/engine/recording_sink.h"
#include "tests/cpp/shm/test_support.h"

namespace trainstream::daemon {
namespace {

using namespace std::chrono_literals;
using shm::HParams;
using shm::Message;
using shm::MessageKind;

constexpr auto kTimeout = 5s;
const HParams kHParams{.lr = 0.1, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01};

// What the engine submitted, until the test answers it.
struct Submission {
  uint64_t step;
  uint32_t bucket;
  float* data;
  size_t n;
  Done done;
};

// The other node of the ring, played by the test: it takes each submission (FakeAllReduce::Next)
// and completes it, with the other node's gradients added or with an error. A submission taken must
// be completed: the engine waits for it before it stops.
class FakeAllReduce final : public AllReduce {
 public:
  void Submit(uint64_t step, uint32_t bucket, float* data, size_t n, Done done) override {
    std::lock_guard lock(mutex_);
    submitted_.push_back(Submission{step, bucket, data, n, std::move(done)});
    changed_.notify_all();
  }
  void Reset(const std::string& reason) override {
    std::lock_guard lock(mutex_);
    resets_.push_back(reason);
  }
  std::optional<Submission> Next() {
    std::unique_lock lock(mutex_);
    if (!changed_.wait_for(lock, kTimeout, [&] { return !submitted_.empty(); })) return std::nullopt;
    Submission next = std::move(submitted_.front());
    submitted_.pop_front();
    return next;
  }
  // Fails what the test left unanswered: the engine waits for every submission before it stops.
  void FailPending() {
    std::deque<Submission> pending;
    {
      std::lock_guard lock(mutex_);
      pending.swap(submitted_);
    }
    for (Submission& submission : pending) submission.done(Error(Code::kAborted, "the test ended"));
  }
  std::vector<std::string> resets() {
    std::lock_guard lock(mutex_);
    return resets_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Submission> submitted_;
  std::vector<std::string> resets_;
};

float InitialWeight(uint32_t param, uint64_t i) {
  return static_cast<float>(0.9 * std::sin(0.37 * i + param));
}

// This node's gradient: at least 1e-3 away from 0.
float LocalGradient(uint32_t param, uint64_t i) {
  const double g = 0.5 * std::cos(0.11 * i + param);
  return static_cast<float>(std::abs(g) < 1e-3 ? 0.01 : g);
}

// The other node's: as large, and of the other sign at every odd element, so that the average over
// the nodes differs from this node's gradient in sign (the first AdamW step) and size (the moments).
float OtherGradient(uint32_t param, uint64_t i) {
  return (i % 2 == 0 ? 1.0f : -3.0f) * LocalGradient(param, i);
}

// One job of two nodes, two fp32 parameters in two buckets, and `world_size` ranks on this node
// (node 0): its state segment and engine, and per rank the engine's RankChannel and the client's
// ends of its rings, all in this process.
class TwoNodeJob {
 public:
  TwoNodeJob(uint32_t world_size, FakeAllReduce& peers, WorkerPool& pool)
      : spec_(Spec(world_size)), layout_(shm::ComputeLayout(spec_)), peers_(peers) {
    state_segment_ = shm::Segment::Create(state_name_.str(), layout_.state_bytes);
    shm::InitStateSegment(state_segment_.data(), layout_);
    state_ = shm::ViewState(state_segment_.data(), layout_, spec_);
    engine_ = std::make_unique<StepEngine>("job", spec_, layout_, state_, /*seed=*/7, pool, &peers_);
    for (uint32_t r = 0; r < world_size; ++r) Attach(r);
  }
  ~TwoNodeJob() {
    peers_.FailPending();
    engine_.reset();
  }
  TwoNodeJob(const TwoNodeJob&) = delete;
  TwoNodeJob& operator=(const TwoNodeJob&) = delete;

  [[nodiscard]] const shm::JobLayout& layout() const { return layout_; }
  [[nodiscard]] StepEngine& engine() const { return *engine_; }
  [[nodiscard]] RecordingSink& sink(uint32_t rank) const { return *ranks_[rank].sink; }
  [[nodiscard]] uint64_t applied_step(uint32_t bucket) const { return state_.bucket_state[bucket].Load().step; }
  [[nodiscard]] float* Master(uint32_t p) const { return Committed(p).master + Element(p); }
  [[nodiscard]] const float* ExpAvg(uint32_t p) const {
    return static_cast<const float*>(Committed(p).exp_avg) + Element(p);
  }
  [[nodiscard]] const shm::StateHalf& Committed(uint32_t p) const { return state_.Committed(layout_.params[p].bucket); }
  [[nodiscard]] float* Grad(uint32_t rank, uint32_t p) const {
    const shm::ParamLayout& param = layout_.params[p];
    return reinterpret_cast<float*>(ranks_[rank].channel->view.grads + layout_.buckets[param.bucket].grad_offset) +
           param.offset_in_bucket;
  }

  // Rank 0 writes the initial weights and publishes them as step 0; every rank gets them.
  void LoadInitialState() {
    for (uint32_t p = 0; p < layout_.params.size(); ++p) {
      for (uint64_t i = 0; i < layout_.params[p].numel; ++i) Master(p)[i] = InitialWeight(p, i);
    }
    Send(0, Message{.kind = MessageKind::kLoadState, .step = 0});
    for (uint32_t r = 0; r < ranks_.size(); ++r) ExpectParamsReady(r, 0, {0, 1});
  }
  // `rank`'s hyperparameters and gradients of `step`, then GRAD_READY for `buckets`.
  void Deliver(uint32_t rank, uint64_t step, const std::vector<uint32_t>& buckets) {
    const shm::RankView& view = ranks_[rank].channel->view;
    view.hparams[(step % 2) * spec_.num_groups] = kHParams;
    for (uint32_t p = 0; p < layout_.params.size(); ++p) {
      for (uint64_t i = 0; i < layout_.params[p].numel; ++i) Grad(rank, p)[i] = LocalGradient(p, i);
      view.presence[p] = 1;
    }
    for (uint32_t b : buckets) {
      Send(rank, Message{.kind = MessageKind::kGradReady, .flags = shm::kFinalMicro, .bucket = b, .step = step});
    }
  }
  // PARAMS_READY{b, step} for every b of `buckets`, in any order, and nothing else.
  void ExpectParamsReady(uint32_t rank, uint64_t step, std::vector<uint32_t> buckets) {
    while (!buckets.empty()) {
      const std::optional<Message> message = Receive(rank);
      ASSERT_TRUE(message.has_value()) << "rank " << rank << ": no PARAMS_READY for step " << step;
      ASSERT_EQ(message->kind, MessageKind::kParamsReady);
      ASSERT_EQ(message->step, step);
      ASSERT_EQ(std::erase(buckets, message->bucket), 1u) << "bucket " << message->bucket;
    }
  }

 private:
  struct Rank {
    std::shared_ptr<RecordingSink> sink;
    std::shared_ptr<RankChannel> channel;  // the engine's end
    shm::RingProducer requests;            // the client's ends
    shm::RingConsumer completions;
  };

  static shm::LayoutSpec Spec(uint32_t world_size) {
    shm::LayoutSpec spec;
    spec.params = {shm::ParamSpec{.name = "w", .shape = {40, 25}, .dtype = DType::kFloat32, .group = 0},
                   shm::ParamSpec{.name = "b", .shape = {300}, .dtype = DType::kFloat32, .group = 0}};
    spec.bucket_bytes = 4096;
    spec.world_size = world_size;
    spec.peers = {"node0:1", "node1:1"};
    spec.node_rank = 0;
    return spec;
  }
  void Attach(uint32_t rank) {
    trainstream::testing::ScopedSegmentName& name = rank_names_.emplace_back();
    shm::Segment segment = shm::Segment::Create(name.str(), layout_.rank_bytes);
    shm::InitRankSegment(segment.data(), layout_, rank);
    Rank& r = ranks_.emplace_back();
    r.sink = std::make_shared<RecordingSink>();
    r.channel = std::make_shared<RankChannel>(rank, ClientSegment(std::move(segment), geteuid()), layout_, r.sink);
    r.requests = shm::RingProducer(r.channel->view.request_ring, &state_.header->doorbell);
    r.completions = shm::RingConsumer(r.channel->view.completion_ring);
    engine_->AddRank(r.channel);
  }
  void Send(uint32_t rank, const Message& message) {
    ASSERT_TRUE(ranks_[rank].requests.TryPush(message)) << "request ring full";
  }
  std::optional<Message> Receive(uint32_t rank) {
    shm::Doorbell& doorbell = ranks_[rank].channel->view.header->completion_doorbell;
    const auto deadline = std::chrono::steady_clock::now() + kTimeout;
    while (std::chrono::steady_clock::now() < deadline) {
      const uint32_t seen = doorbell.Seq();
      Message message;
      if (ranks_[rank].completions.TryPop(&message)) return message;
      doorbell.Wait(seen, 10ms);
    }
    return std::nullopt;
  }
  [[nodiscard]] uint64_t Element(uint32_t p) const {
    const shm::ParamLayout& param = layout_.params[p];
    return layout_.buckets[param.bucket].elem_offset + param.offset_in_bucket;
  }

  const shm::LayoutSpec spec_;
  const shm::JobLayout layout_;
  FakeAllReduce& peers_;
  trainstream::testing::ScopedSegmentName state_name_;
  std::deque<trainstream::testing::ScopedSegmentName> rank_names_;
  shm::Segment state_segment_;
  shm::StateView state_{};
  std::deque<Rank> ranks_;  // before engine_: the engine's tasks may hold a channel until it stops
  std::unique_ptr<StepEngine> engine_;
};

class StepEngineReduceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { spdlog::set_level(spdlog::level::err); }

  WorkerPool pool_{2, /*pin_threads=*/false};
  FakeAllReduce peers_;
};

TEST_F(StepEngineReduceTest, TheUpdateUsesTheSumOverTheNodes) {
  TwoNodeJob job(1, peers_, pool_);
  job.LoadInitialState();
  job.Deliver(0, 1, {0, 1});
  for (int n = 0; n < 2; ++n) {
    std::optional<Submission> submission = peers_.Next();
    ASSERT_TRUE(submission.has_value()) << "no all-reduce for the step's buckets";
    EXPECT_EQ(submission->step, 1u);
    const shm::BucketLayout& bucket = job.layout().buckets[submission->bucket];
    ASSERT_EQ(submission->n, bucket.numel);
    for (uint32_t p : bucket.params) {
      float* sum = submission->data + job.layout().params[p].offset_in_bucket;
      for (uint64_t i = 0; i < job.layout().params[p].numel; ++i) {
        ASSERT_EQ(sum[i], LocalGradient(p, i)) << "param " << p << " element " << i;  // this node's one rank
        sum[i] += OtherGradient(p, i);
      }
    }
    submission->done(std::nullopt);
  }
  job.ExpectParamsReady(0, 1, {0, 1});
  // torch.optim.AdamW's first step on the gradient averaged over both nodes' ranks.
  for (uint32_t p = 0; p < job.layout().params.size(); ++p) {
    for (uint64_t i = 0; i < job.layout().params[p].numel; ++i) {
      const double g = 0.5 * static_cast<double>(LocalGradient(p, i) + OtherGradient(p, i));
      const double weight = InitialWeight(p, i) * (1 - kHParams.lr * kHParams.weight_decay) -
                            kHParams.lr * g / (std::abs(g) + kHParams.eps);
      EXPECT_NEAR(job.Master(p)[i], weight, 1e-6) << "param " << p << " element " << i;
      EXPECT_NEAR(job.ExpAvg(p)[i], (1 - kHParams.beta1) * g, 1e-7) << "param " << p << " element " << i;
    }
  }
}

TEST_F(StepEngineReduceTest, AFailedAllReduceFailsTheSessionsAndMarksTheJobDiverged) {
  TwoNodeJob job(1, peers_, pool_);
  job.LoadInitialState();
  job.Deliver(0, 1, {0, 1});
  std::optional<Submission> submission = peers_.Next();
  ASSERT_TRUE(submission.has_value());
  submission->done(Error(Code::kUnavailable, "peer node1:1 (node 1) sent nothing"));
  const std::optional<std::string> failure = job.sink(0).WaitForFailure();
  ASSERT_TRUE(failure.has_value());
  EXPECT_EQ(*failure, "all-reduce between daemons failed: peer node1:1 (node 1) sent nothing");
  ASSERT_TRUE(trainstream::testing::PollUntil([&] { return job.engine().Diverged().has_value(); }));
  EXPECT_NE(job.engine().Diverged()->find(fmt::format("(bucket {} of step 1)", submission->bucket)), std::string::npos)
      << *job.engine().Diverged();
  EXPECT_EQ(job.applied_step(submission->bucket), 0u);  // not updated
}

TEST_F(StepEngineReduceTest, ARankLeavingMidStepResetsTheAllReduce) {
  TwoNodeJob job(2, peers_, pool_);
  job.LoadInitialState();
  job.Deliver(0, 1, {0, 1});
  job.Deliver(1, 1, {0});  // bucket 0 is complete on this node; bucket 1 waits for rank 1
  std::optional<Submission> submission = peers_.Next();
  ASSERT_TRUE(submission.has_value());
  EXPECT_EQ(submission->bucket, 0u);
  job.engine().RemoveRank(1);
  const std::string reason = "rank 1 detached in the middle of a step; that step's gradients were discarded";
  EXPECT_EQ(peers_.resets(), std::vector<std::string>{reason});
  const std::optional<std::string> failure = job.sink(0).WaitForFailure();
  EXPECT_EQ(failure, reason);
  submission->done(Error(Code::kAborted, reason));  // as the ring's reduction of bucket 0 would end
}

}  // namespace
}  // namespace trainstream::daemon
