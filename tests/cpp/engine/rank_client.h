// The step engine tests' client side of one rank, made of shm:: parts only (the rank and state
// segments opened by name, the request and completion rings), and the test job it drives: two fp32
// parameters in two buckets, with known initial weights and gradients per (rank, step).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <future>
#include <latch>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "daemon/control/job.h"
#include "daemon/engine/worker_pool.h"
#include "shm/job_layout.h"
#include "shm/message.h"
#include "shm/ring.h"
#include "shm/segment.h"
#include "tests/cpp/engine/recording_sink.h"

namespace trainstream::daemon {

inline constexpr auto kReplyTimeout = std::chrono::seconds(5);

// Two fp32 parameters that land in two buckets (bucket 0 holds "b", bucket 1 holds "w").
inline shm::LayoutSpec TwoParamSpec(uint32_t world_size, uint32_t state_halves = 1) {
  shm::LayoutSpec spec;
  spec.params = {shm::ParamSpec{.name = "w", .shape = {40, 25}, .dtype = DType::kFloat32, .group = 0},
                 shm::ParamSpec{.name = "b", .shape = {300}, .dtype = DType::kFloat32, .group = 0}};
  spec.bucket_bytes = 4096;
  spec.world_size = world_size;
  spec.state_halves = state_halves;
  return spec;
}

inline shm::HParams TestHParams(double lr = 0.1) {
  return shm::HParams{.lr = lr, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01};
}

inline float InitialWeight(uint32_t param, uint64_t i) {
  return static_cast<float>(0.9 * std::sin(0.37 * i + param));
}

inline float Gradient(uint32_t param, uint32_t rank, uint64_t step, uint64_t i) {
  const double g = 0.5 * std::cos(0.11 * i + 1.7 * rank + 0.9 * step + param);
  return static_cast<float>(std::abs(g) < 1e-3 ? 0.01 : g);
}

// One rank's client side, made of shm:: parts only.
class RankClient {
 public:
  RankClient(Job& job, uint32_t rank, std::shared_ptr<RecordingSink> sink = std::make_shared<RecordingSink>())
      : job_(job), rank_(rank), sink_(std::move(sink)) {
    Attach();
  }

  // Attaches (again) with a fresh session and maps the segments the daemon names.
  void Attach() {
    attachment_ = job_.Attach(rank_, sink_);
    state_segment_ = shm::Segment::Open(job_.state_segment_name());
    rank_segment_ = shm::Segment::Open(attachment_.rank_segment);
    shm::CheckStateSegment(state_segment_.data(), state_segment_.size(), layout());
    shm::CheckRankSegment(rank_segment_.data(), rank_segment_.size(), layout(), rank_);
    state_ = shm::ViewState(state_segment_.data(), layout(), job_.spec());
    view_ = shm::ViewRank(rank_segment_.data(), layout());
    requests_ = shm::RingProducer(view_.request_ring, &state_.header->doorbell);
    completions_ = shm::RingConsumer(view_.completion_ring);
  }
  void Reattach(std::shared_ptr<RecordingSink> sink = std::make_shared<RecordingSink>()) {
    job_.Detach(rank_);
    sink_ = std::move(sink);
    Attach();
  }

  [[nodiscard]] const shm::JobLayout& layout() const { return job_.layout(); }
  [[nodiscard]] uint32_t rank() const { return rank_; }
  [[nodiscard]] uint32_t buckets() const { return static_cast<uint32_t>(layout().buckets.size()); }
  [[nodiscard]] const Job::Attachment& attachment() const { return attachment_; }
  [[nodiscard]] RecordingSink& sink() const { return *sink_; }
  [[nodiscard]] const shm::StateView& state() const { return state_; }
  [[nodiscard]] const shm::RankView& view() const { return view_; }

  // Parameter p's elements in the master weights, the upload staging, and this rank's gradient slot.
  // Parameter p's master weights in its bucket's committed half (what readers read).
  [[nodiscard]] std::span<float> Master(uint32_t p) const {
    return {state_.Committed(layout().params[p].bucket).master + Element(p), Numel(p)};
  }
  [[nodiscard]] std::span<float> Upload(uint32_t p) const {
    if (layout().buckets[layout().params[p].bucket].uploads_from_master()) return Master(p);  // fp32: in place
    return {reinterpret_cast<float*>(state_.upload + Byte(p, /*upload=*/true)), Numel(p)};
  }
  [[nodiscard]] std::span<float> Grad(uint32_t p) const {
    return {reinterpret_cast<float*>(view_.grads + Byte(p, /*upload=*/false)), Numel(p)};
  }

  void SetHParams(uint64_t step, const shm::HParams& h) {
    for (uint32_t g = 0; g < job_.spec().num_groups; ++g) view_.hparams[(step % 2) * job_.spec().num_groups + g] = h;
  }
  // Writes this rank's gradients of `step` for every parameter (or parameter p) and marks them present.
  void SetGradients(uint64_t step) {
    for (uint32_t p = 0; p < layout().params.size(); ++p) SetGradient(step, p);
  }
  void SetGradient(uint64_t step, uint32_t p) {
    std::span<float> grad = Grad(p);
    for (uint64_t i = 0; i < grad.size(); ++i) grad[i] = Gradient(p, rank_, step, i);
    view_.presence[p] = 1;
  }

  void Send(const shm::Message& message) { ASSERT_TRUE(requests_.TryPush(message)) << "request ring full"; }
  void SendGradReady(uint32_t bucket, uint64_t step) {
    Send(shm::Message{.kind = shm::MessageKind::kGradReady, .flags = shm::kFinalMicro, .bucket = bucket, .step = step});
  }
  // Hyperparameters, gradients and GRAD_READY of every bucket for `step`, as a training step does.
  void DeliverStep(uint64_t step, const shm::HParams& h) {
    SetHParams(step, h);
    SetGradients(step);
    for (uint32_t b = 0; b < buckets(); ++b) SendGradReady(b, step);
  }

  // The next completion if there is one, without waiting.
  std::optional<shm::Message> Poll() {
    shm::Message message;
    if (completions_.TryPop(&message)) return message;
    return std::nullopt;
  }
  // The next completion, waiting on the completion doorbell.
  std::optional<shm::Message> Receive(std::chrono::milliseconds timeout = kReplyTimeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    shm::Doorbell& doorbell = view_.header->completion_doorbell;
    for (;;) {
      const uint32_t seen = doorbell.Seq();
      if (std::optional<shm::Message> message = Poll()) return message;
      const auto now = std::chrono::steady_clock::now();
      if (now >= deadline) return std::nullopt;
      doorbell.Wait(seen, std::min<std::chrono::microseconds>(
                              std::chrono::duration_cast<std::chrono::microseconds>(deadline - now),
                              std::chrono::milliseconds(10)));
    }
  }
  // Expects PARAMS_READY{b, step} for every bucket b (in any order) and nothing else.
  void ExpectParamsReady(uint64_t step) {
    std::vector<int> seen(buckets(), 0);
    for (uint32_t n = 0; n < buckets(); ++n) {
      const std::optional<shm::Message> message = Receive();
      ASSERT_TRUE(message.has_value()) << "rank " << rank_ << ": no PARAMS_READY for step " << step;
      ASSERT_EQ(message->kind, shm::MessageKind::kParamsReady);
      ASSERT_EQ(message->step, step);
      ASSERT_LT(message->bucket, buckets());
      ++seen[message->bucket];
    }
    for (uint32_t b = 0; b < buckets(); ++b) EXPECT_EQ(seen[b], 1) << "bucket " << b;
  }
  void ExpectNoCompletion(std::chrono::milliseconds wait) {
    const std::optional<shm::Message> message = Receive(wait);
    EXPECT_FALSE(message.has_value()) << "unexpected completion kind " << static_cast<int>(message->kind) << " bucket "
                                      << message->bucket << " step " << message->step;
  }
  // Rank 0's start: write the initial master weights and publish them as step 0.
  void LoadInitialState() {
    for (uint32_t p = 0; p < layout().params.size(); ++p) {
      std::span<float> master = Master(p);
      for (uint64_t i = 0; i < master.size(); ++i) master[i] = InitialWeight(p, i);
    }
    Send(shm::Message{.kind = shm::MessageKind::kLoadState, .step = 0});
  }

 private:
  [[nodiscard]] size_t Numel(uint32_t p) const { return layout().params[p].numel; }
  [[nodiscard]] uint64_t Element(uint32_t p) const {
    const shm::ParamLayout& param = layout().params[p];
    return layout().buckets[param.bucket].elem_offset + param.offset_in_bucket;
  }
  [[nodiscard]] uint64_t Byte(uint32_t p, bool upload) const {
    const shm::ParamLayout& param = layout().params[p];
    const shm::BucketLayout& bucket = layout().buckets[param.bucket];
    return (upload ? bucket.upload_offset : bucket.grad_offset) + param.offset_in_bucket * SizeOf(bucket.dtype);
  }

  Job& job_;
  const uint32_t rank_;
  std::shared_ptr<RecordingSink> sink_;
  Job::Attachment attachment_;
  shm::Segment state_segment_, rank_segment_;
  shm::StateView state_{};
  shm::RankView view_{};
  shm::RingProducer requests_;
  shm::RingConsumer completions_;
};

// Rank 0 of `job`, which seeded its weights and has them back.
inline std::unique_ptr<RankClient> StartRank(Job& job) {
  auto client = std::make_unique<RankClient>(job, 0);
  client->LoadInitialState();
  client->ExpectParamsReady(0);
  return client;
}

// One step of every bucket, with TestHParams, and its weights back.
inline void RunStep(RankClient& client, uint64_t step) {
  client.DeliverStep(step, TestHParams());
  client.ExpectParamsReady(step);
}

// Occupies `pool`'s only worker until the returned promise is set: the engine's passes queue behind it,
// so a test can look at the state while an update is scheduled but not run.
inline std::promise<void> HoldTheWorker(WorkerPool& pool) {
  std::promise<void> release;
  auto started = std::make_shared<std::latch>(1);
  pool.Submit(
      1,
      [started, released = release.get_future().share()](size_t) {
        started->count_down();
        released.wait();
      },
      [] {}, /*priority=*/1000);
  started->wait();
  return release;
}

}  // namespace trainstream::daemon
