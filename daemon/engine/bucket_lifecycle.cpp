#include "daemon/engine/bucket_lifecycle.h"

#include <algorithm>

namespace trainstream::daemon {

void BucketLifecycle::Restart() {
  phase = Phase::kCollecting;
  pass = Pass::kNone;
  micro = 0;
  delivered_count = 0;
  std::fill(delivered.begin(), delivered.end(), 0);
  streaming = false;
  grad_bytes = 0;
  flags = 0;
  accumulated = held = from_accum = take_back = false;
}

bool BucketLifecycle::Deliver(uint32_t rank) {
  delivered[rank] = 1;
  ++delivered_count;
  return delivered_count == delivered.size();
}

void BucketLifecycle::Begin(Pass next) {
  phase = Phase::kBusy;
  pass = next;
}

void BucketLifecycle::AwaitDecision() {
  phase = Phase::kAwaitingDecision;
  pass = Pass::kNone;
}

void BucketLifecycle::Hold() {
  AwaitDecision();
  held = true;
}

void BucketLifecycle::Idle() {
  phase = Phase::kCollecting;
  pass = Pass::kNone;
}

uint32_t BucketLifecycle::EndAccumulate() {
  const uint32_t accumulated_micro = micro++;
  delivered_count = 0;
  std::fill(delivered.begin(), delivered.end(), 0);
  Idle();
  return accumulated_micro;
}

void BucketLifecycle::StartUpdate(std::shared_ptr<RunningUpdate> running) {
  update = std::move(running);
}

void BucketLifecycle::Forget(bool rewrite_upload) {
  updating = false;
  upload_dirty |= rewrite_upload;
  plan.reset();
  update.reset();
}

void BucketLifecycle::Committed(uint64_t step_committed) {
  updating = false;
  upload_dirty = false;
  plan.reset();
  step = step_committed + 1;
  Restart();
}

bool BucketLifecycle::TakeDiscard() {
  if (!discard) return false;
  discard = false;
  return true;
}

// A rank left while others were mid-step (StepProtocol::ResetCollecting): what can no longer complete is
// discarded: partly collected buckets, norms and speculative updates waiting for the other buckets (or
// still running: they restart when they end), updates held back by the skew bound, updates started with
// part of their gradients. Updates that have all their gradients finish and commit.
BucketLifecycle::Dropped BucketLifecycle::OnRankLeft(bool revocable, uint64_t bytes, uint64_t completed) const {
  const bool discardable_pass = pass == Pass::kAccumulate || pass == Pass::kNorm || pass == Pass::kSpeculate;
  if (phase == Phase::kCollecting) {
    if (!MidStep()) return {};
    return {.drop = Drop::kRestart, .discards = true};
  }
  if (phase == Phase::kAwaitingDecision && plan != nullptr && !revocable) {
    // Updated in place before its step's decision: it commits as it ran, and the replayed step skips
    // it (SkipReplayedStep), as a one-half job's buckets that committed before a rank left always did.
    return {.drop = Drop::kCommitAsRan, .discards = false};
  }
  if (phase == Phase::kAwaitingDecision) return {.drop = Drop::kAbandon, .discards = true};
  if (streaming && GradientBytesIn(bytes) < bytes) {
    // Its update started with its first gradients (or waits to start), and the rest will not come:
    // it ends with the pieces still running (OnPieceWritten), or now, and what it wrote is dropped.
    const bool running = updating && update != nullptr && update->unfinished > 0;
    return {.drop = running ? Drop::kAtPassEnd : Drop::kDropPending, .discards = true};
  }
  if (pending && (pending->second == Pass::kSpeculate || step > completed + 1)) {
    return {.drop = Drop::kDropPending,
            .discards = true};  // held back by the skew bound: the step before cannot complete now
  }
  if (discardable_pass && !pending) return {.drop = Drop::kAtPassEnd, .discards = true};
  return {.drop = Drop::kFinishes,
          .discards = phase == Phase::kBusy && pass != Pass::kUpload};  // commits, a step ahead
}

BucketLifecycle::Drop BucketLifecycle::OnDiscard(bool revocable) const {
  if (phase == Phase::kBusy && pending) return Drop::kDropPending;  // held back, not started
  if (phase == Phase::kBusy) return Drop::kAtPassEnd;
  if (phase == Phase::kAwaitingDecision && plan != nullptr && !revocable) return Drop::kDiverge;
  return Drop::kAbandon;
}

uint32_t BucketLifecycle::MicrosSeen() const {
  const bool collected = delivered_count > 0 || (phase != Phase::kCollecting && !from_accum);
  return micro + (collected ? 1 : 0);
}

bool BucketLifecycle::Writing() const {
  if (update == nullptr) return false;
  return Speculated() || (updating && phase == Phase::kBusy && !pending && !discard && plan != nullptr);
}

}  // namespace trainstream::daemon
