#include "daemon/engine/step_protocol.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "daemon/engine/gpu_copies.h"
#include "daemon/engine/pass_work.h"
#include "daemon/engine/resume_plan.h"
#include "daemon/engine/ring_checks.h"
#include "daemon/optimizer/adamw_kernels.h"
#include "shm/error.h"

namespace trainstream::daemon {

StepProtocol::StepProtocol(std::string job_name, const shm::LayoutSpec& spec, const shm::JobLayout& layout,
                           shm::StateView state, uint64_t seed, WorkerPool& pool, AllReduce* peers, bool adopted,
                           CommitObserver on_commit, std::unique_ptr<StepTrace> trace, RankTable& ranks,
                           EngineMailbox& mailbox)
    : job_name_(std::move(job_name)),
      spec_(spec),
      layout_(layout),
      state_(state),
      passes_(layout_, state_, spec_.moment_dtype),
      seed_(seed),
      peers_(peers),
      on_commit_(std::move(on_commit)),
      trace_(std::move(trace)),
      ranks_(ranks),
      mailbox_(mailbox),
      had_grad_(spec.params.size(), 0),
      gates_(layout.buckets.size(), spec.world_size, layout.speculative_clipping, spec.step_terms,
             spec.accumulation_steps, spec.max_grad_norm),
      micro_(spec.accumulation_steps, state.accum, layout.total_elems),
      adopted_(adopted),
      scheduler_(layout_, pool, mailbox_),
      pushes_(layout_, state_, buckets_, ranks_, mailbox_, trace_.get(), loading_, [this](uint32_t b) {
        if (buckets_[b].pending) StartPendingUpdates();
        RunResumes();
      }) {
  buckets_.reserve(layout.buckets.size());
  for (size_t b = 0; b < layout.buckets.size(); ++b) {
    buckets_.emplace_back(state_.bucket_state[b].Load().step + 1, spec.world_size);
  }
  completed_ = CompletedStep();
}

void StepProtocol::PlaceState() {
  scheduler_.Touch(passes_);
}

void StepProtocol::TransferSet(RankChannel& channel) {
  if (PastTheSeed()) channel.transfer->WillCopy(CopiedHostRanges(layout_, state_, channel));  // else at the seed's load
}

EngineStats StepProtocol::Counted() const {
  return EngineStats{.updates = updates_.load(),
                     .nonfinite_steps = nonfinite_steps_.load(),
                     .speculative_steps = speculative_steps_.load(),
                     .redone_steps = redone_steps_.load(),
                     .accumulator_bytes = accumulator_bytes_.load(),
                     .attached_ranks = {}};
}

void StepProtocol::WhenSettled(std::function<void(uint64_t)> reply) {
  resumes_.push_back(std::move(reply));
  RunResumes();
}

void StepProtocol::AnnounceCommitted() {
  for (uint32_t b = 0; b < buckets_.size(); ++b) {
    if (loading_ || buckets_[b].updating) continue;
    NotifyCommit(Commit{.bucket = b, .step = state_.bucket_state[b].Load().step, .announced = true});
  }
}

bool StepProtocol::Settled() const {
  if (loading_) return false;
  return std::all_of(buckets_.begin(), buckets_.end(), [](const BucketLifecycle& bucket) { return bucket.Settled(); });
}

void StepProtocol::RunResumes() {
  if (resumes_.empty() || !Settled()) return;
  std::vector<std::function<void(uint64_t)>> replies;
  replies.swap(resumes_);
  ResumeNow([replies = std::move(replies)](uint64_t step) {
    for (const auto& reply : replies) reply(step);
  });
}

// See Resume. Runs on the engine thread once no pass is in flight. By the skew bound a bucket is at
// most one step past the job's completed step, and with two halves its other half holds that step.
void StepProtocol::ResumeNow(std::function<void(uint64_t)> reply) {
  std::vector<uint64_t> committed(buckets_.size());
  for (uint32_t b = 0; b < buckets_.size(); ++b) {
    committed[b] = state_.bucket_state[b].Load().step;
    const bool grads_in_upload = layout_.buckets[b].grads_in_upload;
    if (UploadSuspect(adopted_, grads_in_upload, state_.header->initialized != 0)) buckets_[b].upload_dirty = true;
  }
  const ResumePlan plan = ResumePlan::Of(committed, spec_.state_halves);
  const uint64_t completed = plan.completed;
  for (const uint32_t b : plan.rolled_back) {
    state_.bucket_state[b].Store({.step = completed, .half = OtherHalf(state_.bucket_state[b].Load().half)});
    buckets_[b].upload_dirty = true;
  }
  for (const auto* moved : {&plan.rolled_back, &plan.kept}) {
    for (const uint32_t b : *moved) {
      buckets_[b].step = completed + 1;
      RestartBucket(b);
    }
  }
  adopted_ = false;
  completed_ = completed;
  state_.header->completed_step.store(completed);
  if (const std::string resumed = plan.Describe(job_name_); !resumed.empty()) spdlog::info("{}", resumed);
  std::vector<uint32_t> rewrite;
  for (uint32_t b = 0; b < buckets_.size(); ++b) {
    BucketLifecycle& progress = buckets_[b];
    if (!progress.upload_dirty) continue;
    progress.upload_dirty = false;
    if (!layout_.buckets[b].uploads_from_master()) rewrite.push_back(b);
  }
  if (rewrite.empty()) return reply(completed);
  auto remaining = std::make_shared<size_t>(rewrite.size());
  auto done = std::make_shared<std::function<void(uint64_t)>>(std::move(reply));
  for (const uint32_t b : rewrite) {
    UploadCommitted(b, [this, b, remaining, done, completed] {
      buckets_[b].Idle();
      if (--*remaining == 0) (*done)(completed);
    });
  }
}

// Bucket b's upload region from its committed master weights, on the pool; then `done`.
void StepProtocol::UploadCommitted(uint32_t b, std::function<void()> done) {
  buckets_[b].Begin(Pass::kUpload);
  scheduler_.Schedule(
      b, 0, [](uint32_t) { return true; }, UploadWork(&passes_, &state_.Committed(b)), std::move(done));
}

// A rank left while others were mid-step: its share of the step's gradients is gone, so the partial
// step is discarded and the other ranks' sessions fail (they would wait for it forever; like a
// collective whose peer died, every rank must restart, and Resume gives them all one step to resume
// from). What can no longer complete is discarded: partly collected buckets, norms and speculative
// updates waiting for the other buckets (or still running: they restart when they end), updates held
// back by the skew bound, updates started with part of their gradients. Updates that have all their
// gradients finish and commit. Buckets at different committed steps count as mid-step too.
void StepProtocol::ResetCollecting(const std::string& reason) {
  bool discarded = false;
  for (uint32_t b = 0; b < buckets_.size(); ++b) {
    BucketLifecycle& bucket = buckets_[b];
    const BucketLifecycle::Dropped dropped = bucket.OnRankLeft(Revocable(b), layout_.buckets[b].bytes(), completed_);
    discarded |= dropped.discards;
    switch (dropped.drop) {
      case BucketLifecycle::Drop::kRestart: RestartBucket(b); break;
      case BucketLifecycle::Drop::kCommitAsRan: CommitBucket(b, bucket.step, bucket.plan->to); break;
      case BucketLifecycle::Drop::kAbandon: Abandon(b); break;
      case BucketLifecycle::Drop::kDropPending:
        bucket.pending.reset();
        Abandon(b);
        break;
      case BucketLifecycle::Drop::kAtPassEnd:
        bucket.pending.reset();
        bucket.discard = true;  // Discarded() restarts it when its pass ends
        break;
      default: break;
    }
  }
  gates_.Clear();  // no step with a gate left can complete: decided gates are gone already
  micro_.Forget();
  micro_.ForgetDiscard();
  for (uint32_t b = 0; b < buckets_.size() && !discarded; ++b) {
    discarded = state_.bucket_state[b].Load().step != completed_;
  }
  if (!discarded) return;
  const std::string message = fmt::format("{} in the middle of a step; that step's gradients were discarded", reason);
  if (peers_ != nullptr) peers_->Reset(message);
  spdlog::warn("job '{}': {}", job_name_, message);
  for (const auto& channel : ranks_) {
    if (channel) channel->session->Fail(message);
  }
}

// Forgets what bucket b collected of its current step: it collects that step (progress.step) from scratch.
void StepProtocol::RestartBucket(uint32_t b) {
  buckets_[b].Restart();
  for (uint32_t p : layout_.buckets[b].params) had_grad_[p] = 0;
  for (const auto& channel : ranks_) {
    if (channel) channel->staged[b] = channel->pulled[b] = 0;
  }
}

// Bucket b's step is abandoned before its commit: a speculative update it wrote is dropped (the other
// half is not read; the upload region holds its weights until Resume rewrites it).
void StepProtocol::Abandon(uint32_t b) {
  BucketLifecycle& bucket = buckets_[b];
  pushes_.ForgetSpeculated(b);
  if (bucket.plan != nullptr) {
    bucket.upload_dirty = false;  // set again below where the upload region holds what it wrote
    bucket.Forget(!layout_.buckets[b].uploads_from_master());
  }
  bucket.update.reset();
  RestartBucket(b);
}

bool StepProtocol::Discarded(uint32_t b) {
  if (!buckets_[b].TakeDiscard()) return false;
  Abandon(b);
  RunResumes();
  MaybeFinishDiscard();
  return true;
}

void StepProtocol::Handle(RankChannel& channel, const shm::Message& message) {
  switch (message.kind) {
    case shm::MessageKind::kGradReady: return OnGradReady(channel, message);
    case shm::MessageKind::kLoadState: return OnLoadState(channel, message);
    case shm::MessageKind::kWeightsWanted: return pushes_.OnWeightsWanted(ranks_[channel.rank], message);
    case shm::MessageKind::kStepTerms: return OnStepTerms(channel, message);
    case shm::MessageKind::kMoreMicro: return OnMoreMicro(channel, message);
    case shm::MessageKind::kDiscard: return OnDiscard(channel, message);
    default:
      Throw(Code::kInvalidArgument, "unknown ring message kind {} from rank {}", static_cast<int>(message.kind),
            channel.rank);
  }
}

void StepProtocol::OnGradReady(RankChannel& channel, const shm::Message& message) {
  const uint32_t b = message.bucket;
  const bool rest =
      CheckGradReady(spec_, buckets_, loading_, channel.rank, b < buckets_.size() ? channel.staged[b] : 0, message);
  BucketLifecycle& progress = buckets_[b];
  if (!rest) progress.flags = message.flags;
  if (trace_) trace_->Mark(SpanKind::kGradReady, b, message.step, message.micro);
  if (channel.transfer == nullptr) return Deliver(channel, b);
  CheckGradPiece(channel.transfer->staging_slots(), PiecesOf(layout_.buckets[b], channel.transfer->slot_bytes()),
                 channel.rank, channel.staged[b], message);
  ++channel.staged[b];
  PullThenDeliver(ranks_[channel.rank], b, message.slot, message.piece);
}

// cuda-ipc: each piece of the bucket's gradients reaches the rank's host slot first (the slot on the
// GPU is then free); the bucket is delivered once every piece has, or with its first piece where its
// update may start then (StreamsGradients), and each later piece lets more of that update run.
void StepProtocol::PullThenDeliver(const std::shared_ptr<RankChannel>& channel, uint32_t b, uint32_t slot,
                                   uint32_t piece) {
  const shm::BucketLayout& bucket = layout_.buckets[b];
  const uint64_t step = buckets_[b].step;
  const uint32_t micro = buckets_[b].micro;
  const uint64_t offset = piece * channel->transfer->slot_bytes();
  mailbox_.Begin();
  const int64_t pulling = trace_ ? StepTrace::Now() : 0;
  channel->transfer->PullGradients(
      slot, shm::GradsOf(bucket, state_, channel->view) + offset,
      std::min(channel->transfer->slot_bytes(), bucket.bytes() - offset),
      [this, channel, b, slot, step, micro, piece, pulling](std::optional<Error> error) {
        if (trace_) trace_->Record({SpanKind::kPull, b, step, piece, pulling, StepTrace::Now()});
        mailbox_.Continue([this, channel, b, slot, step, micro, error = std::move(error)] {
          if (!ranks_.Attached(channel)) return;
          if (error) {
            return ranks_.FailRank(
                *channel, fmt::format("copying bucket {}'s gradients from the GPU failed: {}", b, error->what()));
          }
          BucketLifecycle& progress = buckets_[b];
          if (progress.step != step || progress.micro != micro ||
              (progress.phase != Phase::kCollecting && !progress.streaming)) {
            return;
          }
          ranks_.PostTo(*channel, shm::Message{.kind = shm::MessageKind::kStagingFree, .step = step, .slot = slot});
          const uint32_t pulled = ++channel->pulled[b];
          const uint32_t pieces = PiecesOf(layout_.buckets[b], channel->transfer->slot_bytes());
          const bool delivered = progress.streaming;
          if (pulled == pieces) channel->staged[b] = channel->pulled[b] = 0;
          if (delivered || (pulled < pieces && StreamsGradients(b))) {
            progress.streaming = true;
            progress.grad_bytes = std::min(layout_.buckets[b].bytes(), pulled * channel->transfer->slot_bytes());
            if (delivered) return ScheduleReadyPieces(b);
          } else if (pulled < pieces) {
            return;
          }
          Deliver(*channel, b);
        });
      });
}

void StepProtocol::Deliver(RankChannel& channel, uint32_t b) {
  for (uint32_t p : layout_.buckets[b].params) had_grad_[p] |= channel.view.presence[p] != 0 ? 1 : 0;
  if (buckets_[b].Deliver(channel.rank)) OnBucketDelivered(b);
}

void StepProtocol::OnBucketDelivered(uint32_t b) {
  BucketLifecycle& progress = buckets_[b];
  const Last last = micro_.LastOf(progress, gates_.Find(progress.step));
  if (last == Last::kUnknown) return Hold(b);
  if (last == Last::kYes) HParamsFor(progress.step);  // refuse bad hyperparameters before any work starts
  progress.phase = Phase::kBusy;                      // its pass is named below
  if (last == Last::kNo) return StartAccumulate(b);
  if (spec_.nodes() > 1) return StartReduce(b);
  AfterGradients(b);
}

// Its ranks cannot tell whether this micro-batch is the step's last: its gradients stay in the slots
// until the step's terms (then they are) or another backward pass (then they are accumulated) say.
void StepProtocol::Hold(uint32_t b) {
  BucketLifecycle& progress = buckets_[b];
  progress.Hold();
  const StepGate* gate = gates_.Find(progress.step);
  if (gate != nullptr && gate->NormsNeeded()) StartNorm(b);
}

// The hyperparameters in force for `step`: those rank 0 wrote (the lowest attached rank if 0 is gone).
const shm::HParams* StepProtocol::HParamsFor(uint64_t step) {
  for (const auto& channel : ranks_) {
    if (!channel) continue;
    const shm::HParams* table = channel->view.hparams + (step % 2) * spec_.num_groups;
    for (uint32_t g = 0; g < spec_.num_groups; ++g) CheckHParams(table[g], g);
    return table;
  }
  Throw(Code::kFailedPrecondition, "no rank attached to read hyperparameters from");
}

Sources StepProtocol::SnapshotSources() {
  return ranks_.all();
}

// After a multi-node all-reduce the accumulator holds the whole sum: the slots must not count again.
Sources StepProtocol::GradientSlots() {
  return spec_.nodes() > 1 ? Sources() : ranks_.all();
}

void StepProtocol::StartAccumulate(uint32_t b) {
  buckets_[b].Begin(Pass::kAccumulate);
  const int64_t started = trace_ ? StepTrace::Now() : 0;
  AccumulateSlots(b, [this, b, started] {
    if (Discarded(b)) return;
    BucketLifecycle& progress = buckets_[b];
    const uint32_t micro = progress.EndAccumulate();
    if (trace_) trace_->Record({SpanKind::kAccumulate, b, progress.step, micro, started, StepTrace::Now()});
    ranks_.PostToAll(
        shm::Message{.kind = shm::MessageKind::kSlotFree, .bucket = b, .step = progress.step, .micro = micro});
    if (HoldAccumulated(b)) MaybeDecide(progress.step);
  });
}

// The step's terms say it summed as many micro-batches as bucket b has accumulated: its last gradients
// are all in the accumulator, and it waits for the decision as a held bucket does.
bool StepProtocol::HoldAccumulated(uint32_t b) {
  BucketLifecycle& progress = buckets_[b];
  if (!MicroBatches::AllAccumulated(progress, gates_.Find(progress.step))) return false;
  progress.from_accum = true;
  Hold(b);
  return true;
}

// Multi-node: this node's sum goes into the accumulator, then around the ring of daemons.
void StepProtocol::StartReduce(uint32_t b) {
  buckets_[b].Begin(Pass::kReduce);
  AccumulateSlots(b, [this, b] {
    const shm::BucketLayout& bucket = layout_.buckets[b];
    mailbox_.Begin();  // the all-reduce works on the accumulator
    peers_->Submit(buckets_[b].step, b, micro_.accumulator() + bucket.elem_offset, bucket.numel,
                   [this, b](std::optional<Error> error) {
                     mailbox_.Continue([this, b, error = std::move(error)] {
                       if (!error) return AfterGradients(b);
                       RestartBucket(b);
                       const std::string message = fmt::format("all-reduce between daemons failed: {}", error->what());
                       ranks_.SetDiverged(fmt::format("{} (bucket {} of step {})", message, b, buckets_[b].step));
                       ranks_.FailSessions(message);
                     });
                   });
  });
}

// Bucket b's last gradients of the step are in (its update reads them, and the accumulator). Its step
// decided: the update as decided. Else the update runs now with the multiplier the
// steps before had, unless a norm is needed and it could not be taken back or the step waits for the
// norm (a run of clipped steps): then the norm comes first.
void StepProtocol::AfterGradients(uint32_t b) {
  const StepGate& gate = gates_.Of(buckets_[b].step);
  switch (StepGates::AfterGradients(gate, Revocable(b))) {
    case StepGates::Next::kUpdate: return StartUpdate(b, gate.Decision().multiplier, Pass::kUpdate);
    case StepGates::Next::kNorm: return StartNorm(b);
    case StepGates::Next::kSpeculate: return StartUpdate(b, gate.assumed(), Pass::kSpeculate);
  }
}

bool StepProtocol::Revocable(uint32_t b) const {
  return spec_.state_halves == 2 && !layout_.buckets[b].grads_in_upload;
}

void StepProtocol::AccumulateSlots(uint32_t b, std::function<void()> then) {
  float* accum = AccumulatorOf(b);
  const bool overwrite = !buckets_[b].accumulated;
  if (accum == nullptr) {
    accum = micro_.Accumulator(job_name_);
    accumulator_bytes_ = micro_.own_bytes();
  }
  buckets_[b].accumulated = true;
  scheduler_.Schedule(
      b, 0, [](uint32_t) { return true; },
      Traced(trace_.get(), SpanKind::kAccumulateBlock, b, buckets_[b].step,
             AccumulateWork(&passes_, accum, overwrite, SnapshotSources())),
      std::move(then));
}

float* StepProtocol::AccumulatorOf(uint32_t b) {
  return buckets_[b].accumulated ? micro_.accumulator() : nullptr;
}

Sources StepProtocol::FinalSlots(uint32_t b) {
  return buckets_[b].from_accum ? Sources() : GradientSlots();
}

// The squares of the bucket's last gradients (all of the step's, the accumulator's included), before any
// update: the decision then says what the update applies (or whether it runs).
void StepProtocol::StartNorm(uint32_t b) {
  BucketLifecycle& progress = buckets_[b];
  progress.Begin(Pass::kNorm);
  const float scale = 1.0f / static_cast<float>(spec_.world_size * spec_.nodes());
  auto include = [this](uint32_t p) { return had_grad_[p] != 0; };
  auto results = std::make_shared<PassResults>(BlocksOf(layout_, b, include)->size());
  scheduler_.Schedule(b, 0, include,
                      Traced(trace_.get(), SpanKind::kNormBlock, b, progress.step,
                             NormWork(&passes_, scale, AccumulatorOf(b), FinalSlots(b), results)),
                      [this, b, results] { OnNormed(b, Total(results->partial), results->nonfinite.load()); });
}

void StepProtocol::OnNormed(uint32_t b, double sum_of_squares, bool nonfinite) {
  if (Discarded(b)) return;
  BucketLifecycle& progress = buckets_[b];
  if (progress.take_back) return Revoke(b);
  progress.AwaitDecision();
  gates_.Of(progress.step).AddNorm(b, sum_of_squares, nonfinite, 1.0f);
  MaybeDecide(progress.step);
}

// Bucket b's update before its step's decision is written (not committed), with its norm where it summed
// the squares. Once the step is decided, MaybeDecide commits, redoes or takes it back.
void StepProtocol::OnSpeculated(uint32_t b, double sum_of_squares, bool nonfinite) {
  if (Discarded(b)) return;
  BucketLifecycle& progress = buckets_[b];
  if (progress.take_back) return Revoke(b);
  progress.AwaitDecision();
  const uint64_t step = progress.step;
  StepGate& gate = gates_.Of(step);
  if (progress.plan->with_norm) gate.AddNorm(b, sum_of_squares, nonfinite, progress.plan->multiplier);
  if (!gate.HasNorm(b) && gate.NormsNeeded()) return StartNorm(b);  // its gradients are still there
  MaybeDecide(step);
  const bool decided = buckets_[b].step != step || buckets_[b].phase != Phase::kAwaitingDecision;  // committed, redone
  if (!decided) pushes_.PushWritten(b);  // its weights reach the GPUs while the step waits for its decision
}

void StepProtocol::StartMissingNorms(uint64_t step) {
  StepGate& gate = gates_.Of(step);
  for (uint32_t b = 0; b < buckets_.size(); ++b) {
    const BucketLifecycle& progress = buckets_[b];
    if (progress.step == step && progress.phase == Phase::kAwaitingDecision && !gate.HasNorm(b)) StartNorm(b);
  }
}

// The ranks that asked get the step's norm once every bucket's is in; a decided step's buckets go on.
void StepProtocol::MaybeDecide(uint64_t step) {
  StepGate* const found = gates_.Find(step);
  if (found == nullptr) return;
  StepGate& gate = *found;
  if (spec_.step_terms && StepGates::SendNorm(gate)) {
    ranks_.PostToAll(shm::Message{.kind = shm::MessageKind::kStepNorm,
                                  .flags = static_cast<uint16_t>(gate.Decision().nonfinite ? shm::kNonFinite : 0),
                                  .step = step,
                                  .value = gate.Norm()});
  }
  if (!gate.Decided()) return;
  const StepDecision decision = gate.Decision();
  if (gate.MarkApplied()) Count(step, gate, decision);
  for (uint32_t b = static_cast<uint32_t>(buckets_.size()); b-- > 0;) {
    if (buckets_[b].step == step) Settle(b, decision);
  }
}

// A step decided: its warnings and counters, and what the next step's updates assume.
void StepProtocol::Count(uint64_t step, const StepGate& gate, const StepDecision& decision) {
  if (decision.nonfinite) ReportNonFinite(step, "gradients contain inf or NaN");
  gates_.Decided(gate, decision);
  bool written = false, changed = false;
  for (const BucketLifecycle& progress : buckets_) {
    if (progress.step != step || progress.plan == nullptr || progress.phase != Phase::kAwaitingDecision) continue;
    written = true;
    changed |= progress.plan->multiplier != decision.multiplier;
  }
  if (written && gate.NormsNeeded()) {
    ++speculative_steps_;
    if (changed) ++redone_steps_;
  }
}

// Forward order (the caller's loop): the highest bucket holds the first parameters, which the next
// forward needs first. A bucket whose pass still runs settles when it ends (its end sees the step decided),
// one whose last gradients are still coming when they are in (AfterGradients).
void StepProtocol::Settle(uint32_t b, const StepDecision& decision) {
  BucketLifecycle& progress = buckets_[b];
  const uint64_t step = progress.step;
  if (progress.phase != Phase::kAwaitingDecision) return;
  progress.held = false;
  const std::shared_ptr<const UpdatePlan> plan = progress.plan;
  switch (StepGates::Settle(plan.get(), decision, Revocable(b))) {
    case StepGates::Settlement::kUpdate:  // held, or its norm taken first
      return StartUpdate(b, decision.multiplier, Pass::kUpdate);
    case StepGates::Settlement::kCommit: return CommitBucket(b, step, plan->to);
    case StepGates::Settlement::kDiverge:
      return Diverge(fmt::format(
          "step {}: bucket {} was updated in place with gradient multiplier {} before the step's terms said {} (the "
          "job has one state half, or keeps paged gradients in their upload copy, so an update cannot be taken "
          "back); drop the job and pass the clipping (max_grad_norm=) to trainstream.wrap, or let the job keep two "
          "state halves",
          step, b, plan->multiplier, decision.multiplier));
    case StepGates::Settlement::kRedo: return StartUpdate(b, decision.multiplier, Pass::kRedo);
  }
}

void StepProtocol::TakeBack(uint32_t b) {
  pushes_.ForgetSpeculated(b);
  buckets_[b].Forget(!layout_.buckets[b].uploads_from_master());
}

// Another backward pass follows the micro-batch bucket b holds: taken back where an update ran on it
// (that fails the job where it ran in place), its gradients accumulated, and the bucket collects the next.
void StepProtocol::Revoke(uint32_t b) {
  BucketLifecycle& progress = buckets_[b];
  progress.take_back = false;
  progress.held = false;
  if (progress.plan != nullptr) {
    if (!Revocable(b)) {
      return Diverge(fmt::format(
          "step {}: another backward pass came after micro-batch {}, whose update of bucket {} already ran in place "
          "(the job has one state half, or keeps paged gradients in their upload copy, so an update cannot be "
          "taken back); drop the job and pass accumulation_steps={} (or more) to trainstream.wrap",
          progress.step, progress.micro, b, progress.micro + 2));
    }
    TakeBack(b);
  }
  progress.streaming = false;
  progress.grad_bytes = 0;
  StartAccumulate(b);
}

void StepProtocol::Diverge(const std::string& why) {
  ranks_.SetDiverged(why);
  spdlog::error("job '{}': {}", job_name_, why);
  ranks_.FailSessions(why);
}

// Reads bucket b's committed half and writes the other (the same half, in place, with one half): the
// parameters with a gradient get their update, the others their state carried over unchanged (with one
// half there is nothing to carry), from g = multiplier x the averaged gradients. kSpeculate also sums
// the squares of each block's gradients where the step's decision may need them, inside the update from
// the gradients it reads (a norm pass before each block's update made the update 1.29-1.54x slower in
// fp32 on the dev box, the fused sum 1.00-1.16x: benchmarks/adamw "norm first"/"norm fused"; the
// speculated steps of the 1.86B were 1.26-1.30x the unclipped ones on the GPU machine), and always where
// the gradients it reads are overwritten by the update itself (gradients in the upload copy).
// The update waits while a GPU still reads the bucket's weights of the last step, and until every bucket
// has committed the step before (the skew bound, see the header).
void StepProtocol::StartUpdate(uint32_t b, float multiplier, Pass pass) {
  BucketLifecycle& progress = buckets_[b];
  if (state_.bucket_state[b].Load().step >= progress.step) return SkipReplayedStep(b);
  progress.Begin(pass);
  if (progress.pushes > 0 || progress.step > completed_ + 1) return progress.HoldBack(multiplier, pass);
  progress.pending.reset();
  if (pass == Pass::kRedo) pushes_.ForgetSpeculated(b);  // no push reads the half now (pushes hold updates back)
  progress.updating = true;
  progress.update_started = std::chrono::steady_clock::now();
  if (pass != Pass::kRedo) {
    const uint32_t from = state_.bucket_state[b].Load().half;
    progress.plan = PlanUpdate(spec_, layout_, state_, b, progress.step, from, OtherHalf(from),
                               HParamsFor(progress.step), had_grad_);
  }
  const std::shared_ptr<UpdatePlan> plan = progress.plan;
  plan->multiplier = multiplier;
  plan->with_norm =
      pass == Pass::kSpeculate && (gates_.Of(plan->step).NormsNeeded() || layout_.buckets[b].grads_in_upload);
  if (spec_.state_halves == 1) {  // torn until the commit: a daemon that adopts the job must know
    state_.bucket_state[b].Store({.step = state_.bucket_state[b].Load().step, .half = 0, .updating = true});
  }
  const bool carry = plan->from != plan->to;  // in place, a parameter without a gradient is left alone
  auto include = [this, carry](uint32_t p) { return carry || had_grad_[p] != 0; };
  const bool speculative = pass == Pass::kSpeculate;
  const float scale = multiplier / static_cast<float>(spec_.world_size * spec_.nodes());
  const uint64_t sr_seed = seed_ ^ (plan->step * 0xD1B54A32D192ED03ull);
  const std::shared_ptr<std::vector<Block>> blocks = BlocksOf(layout_, b, include);
  auto results = std::make_shared<PassResults>(plan->with_norm ? blocks->size() : 0);
  auto work = UpdateWork(&passes_, scale, sr_seed, plan, &state_.halves[plan->from], &state_.halves[plan->to],
                         AccumulatorOf(b), FinalSlots(b), results);
  auto update = std::make_shared<RunningUpdate>();
  update->blocks = blocks;
  update->pieces = SplitIntoPieces(layout_, b, *blocks, PieceBytes(b));
  update->piece_written.assign(update->pieces.size(), 0);
  update->work = Traced(trace_.get(), SpanKind::kUpdateBlock, b, plan->step, std::move(work));
  update->finish = [this, b, plan, speculative, results] {
    if (speculative) return OnSpeculated(b, Total(results->partial), results->norm_nonfinite.load());
    OnUpdated(b, plan->step, plan->to, results->nonfinite.load());
  };
  progress.StartUpdate(std::move(update));
  for (const auto& channel : ranks_) {
    if (channel) channel->streamed[b] = 0;
  }
  ScheduleReadyPieces(b);
}

void StepProtocol::ScheduleReadyPieces(uint32_t b) {
  BucketLifecycle& bucket = buckets_[b];
  if (!bucket.updating || bucket.update == nullptr) return;  // not started yet (held back)
  RunningUpdate& update = *bucket.update;
  const auto [first, end] = update.TakeReady(bucket.GradientBytesIn(layout_.buckets[b].bytes()));
  for (uint32_t k = first; k < end; ++k) {
    scheduler_.ScheduleBlocks(update.blocks, update.FirstBlock(k), update.pieces[k].first, static_cast<int64_t>(b),
                              update.work, [this, b, k, running = bucket.update] {
                                if (buckets_[b].update == running) OnPieceWritten(b, k);
                              });
  }
}

uint64_t StepProtocol::PieceBytes(uint32_t b) const {
  uint64_t piece_bytes = layout_.buckets[b].bytes();
  for (const auto& channel : ranks_) {
    if (channel && channel->transfer != nullptr) piece_bytes = std::min(piece_bytes, channel->transfer->slot_bytes());
  }
  return piece_bytes;
}

// Piece k of bucket b's update is written: with the pieces before it, it may go to the GPUs (a bucket
// updated in one piece is pushed as before: at its commit, or as a speculation once its norm is in).
// The update ends with its last piece, or, abandoned while waiting for gradients, with the last piece
// that was running.
void StepProtocol::OnPieceWritten(uint32_t b, uint32_t k) {
  RunningUpdate& update = *buckets_[b].update;
  const RunningUpdate::PieceEnd end = update.MarkWritten(k);
  if (update.pieces.size() > 1) pushes_.PushWritten(b);
  if (end == RunningUpdate::PieceEnd::kRunning) return;
  if (end == RunningUpdate::PieceEnd::kWaitsForGradients) {
    Discarded(b);  // waits for gradients, unless its rank is gone
    return;
  }
  // The work holds the ranks it read the gradients of: a rank that detached is unmapped once it goes.
  update.work = nullptr;
  update.blocks.reset();
  std::exchange(update.finish, nullptr)();
}

bool StepProtocol::StreamsGradients(uint32_t b) {
  const BucketLifecycle& progress = buckets_[b];
  if (spec_.world_size != 1 || spec_.nodes() != 1 || spec_.state_halves != 2) return false;
  if (micro_.LastOf(progress, gates_.Find(progress.step)) != Last::kYes) return false;
  return StepGates::MayStream(gates_.Of(progress.step));
}

// Updates held back (pushes, the skew bound) whose wait is over, from the highest bucket down.
void StepProtocol::StartPendingUpdates() {
  for (uint32_t b = static_cast<uint32_t>(buckets_.size()); b-- > 0;) {
    const BucketLifecycle& progress = buckets_[b];
    if (progress.pending && progress.pushes == 0 && progress.step <= completed_ + 1) {
      StartUpdate(b, progress.pending->first, progress.pending->second);
    }
  }
}

uint32_t StepProtocol::OtherHalf(uint32_t half) const {
  return spec_.state_halves == 2 ? 1 - half : 0;
}

void StepProtocol::ReportNonFinite(uint64_t step, const std::string& what) {
  if (step <= last_nonfinite_step_) return;  // once per step, whichever pass noticed first
  last_nonfinite_step_ = step;
  nonfinite_steps_++;
  for (const auto& channel : ranks_) {
    if (channel) channel->session->Warn(fmt::format("step {}: {}", step, what));
  }
}

void StepProtocol::OnUpdated(uint32_t b, uint64_t step, uint32_t half, bool nonfinite) {
  if (nonfinite) {
    ReportNonFinite(step, fmt::format("the update of bucket {} left inf or NaN weights (from inf or NaN gradients, "
                                      "or a diverging model); max_grad_norm also reports them before the update",
                                      b));
  }
  CommitBucket(b, step, half);
}

// The one store that makes bucket b's update of `step` (in `half`) its state; then the bucket collects
// the next step and its weights go out.
void StepProtocol::CommitBucket(uint32_t b, uint64_t step, uint32_t half) {
  state_.bucket_state[b].Store({.step = step, .half = half});
  if (trace_) trace_->Mark(SpanKind::kCommit, b, step, half);
  BucketLifecycle& progress = buckets_[b];
  progress.Committed(step);  // collects the next step from scratch
  RestartBucket(b);
  updates_++;
  const uint64_t completed_before = completed_;
  AdvanceCompleted();  // before the last PARAMS_READY: a client may read it then
  pushes_.Publish(b, step);
  const std::chrono::duration<double> took = std::chrono::steady_clock::now() - progress.update_started;
  NotifyCommit(Commit{.bucket = b,
                      .step = step,
                      .step_completed = completed_ >= step && completed_before < step,
                      .update_seconds = took.count()});
  StartPendingUpdates();
}

void StepProtocol::NotifyCommit(Commit commit) {
  if (!on_commit_) return;
  for (const auto& channel : ranks_) {  // the table HParamsFor reads, unvalidated: a record, not for use
    if (channel) {
      commit.hparams = channel->view.hparams + (commit.step % 2) * spec_.num_groups;
      break;
    }
  }
  on_commit_(commit);
}

// One half, after Resume: bucket b committed the step it collected (its update ran before a trainer
// died mid-step, and the trainer replayed the step): its gradients are not applied again, its current
// weights go back.
void StepProtocol::SkipReplayedStep(uint32_t b) {
  BucketLifecycle& progress = buckets_[b];
  const uint64_t step = progress.step;
  progress.step = step + 1;
  RestartBucket(b);
  pushes_.Publish(b, step);
}

uint64_t StepProtocol::CompletedStep() const {
  uint64_t completed = std::numeric_limits<uint64_t>::max();
  for (uint32_t b = 0; b < buckets_.size(); ++b) completed = std::min(completed, state_.bucket_state[b].Load().step);
  return completed;
}

void StepProtocol::AdvanceCompleted() {
  const uint64_t completed = CompletedStep();
  if (completed <= completed_) return;
  completed_ = completed;
  state_.header->completed_step.store(completed);
  gates_.EraseThrough(completed);
}

void StepProtocol::OnStepTerms(RankChannel& channel, const shm::Message& message) {
  CheckStepTerms(spec_, completed_, channel.rank, message);
  const uint64_t step = message.step;
  micro_.CheckTerms(step, message.micro);
  CheckTermsAgainstBuckets(buckets_, message);
  StepGate& gate = gates_.Of(step);
  gate.AddTerms(channel.rank, message);
  for (uint32_t b = 0; b < buckets_.size(); ++b) {
    if (buckets_[b].step == step) (void)HoldAccumulated(b);
  }
  if (gate.NormsNeeded()) StartMissingNorms(step);
  MaybeDecide(step);
}

// Micro-batch message.micro of the step was not its last: what was held or updated on it is taken back
// and accumulated (where it cannot be, no rank may go on), and the step's gate starts again.
void StepProtocol::OnMoreMicro(RankChannel& channel, const shm::Message& message) {
  CheckMoreMicro(spec_, completed_, channel.rank, message);
  const uint64_t step = message.step;
  if (trace_) trace_->Mark(SpanKind::kMoreMicro, 0, step, message.micro);
  const StepGate* gate = gates_.Find(step);
  CheckMoreAfterTerms(gate == nullptr ? 0 : gate->terms().micro_batches, channel.rank, message);
  if (!micro_.More(step, message.micro)) return;  // another rank said so already
  gates_.Erase(step);                             // its norms were of the micro-batch taken back
  for (uint32_t b = 0; b < buckets_.size(); ++b) {
    BucketLifecycle& progress = buckets_[b];
    if (progress.step != step || progress.micro != message.micro) continue;
    if (progress.phase == Phase::kAwaitingDecision) {
      Revoke(b);
    } else if (progress.phase == Phase::kBusy && progress.pass != Pass::kAccumulate) {
      progress.take_back = true;  // when its pass ends
    }
  }
}

// zero_grad() before optimizer.step() (a GradScaler's skipped step, too): every bucket collects the step
// again from its first micro-batch; passes still running finish first (Discarded), then the ranks hear
// kDiscarded. Every rank of a data-parallel job discards alike: the first rank's kDiscard of the step's
// nth discard drops it, the others' find it dropped.
void StepProtocol::OnDiscard(RankChannel& channel, const shm::Message& message) {
  CheckDiscard(spec_, completed_, channel.rank, message);
  switch (micro_.OnDiscard(message.step, message.micro, channel.rank)) {
    case MicroBatches::Discard::kDropped:  // another rank's discard of it came first
      return ranks_.PostTo(
          channel,
          shm::Message{.kind = shm::MessageKind::kDiscarded, .step = message.step, .micro = micro_.discards()});
    case MicroBatches::Discard::kBeingDropped: return;
    case MicroBatches::Discard::kDrop: break;
  }
  gates_.Erase(message.step);
  for (uint32_t b = 0; b < buckets_.size(); ++b) {
    switch (buckets_[b].OnDiscard(Revocable(b))) {
      case BucketLifecycle::Drop::kDropPending:
        buckets_[b].pending.reset();  // held back, not started
        Abandon(b);
        break;
      case BucketLifecycle::Drop::kAtPassEnd: buckets_[b].discard = true; break;  // Discarded() restarts it
      case BucketLifecycle::Drop::kDiverge:
        return Diverge(
            fmt::format("step {}: zero_grad() after bucket {} was updated in place (the job has one state half, or "
                        "keeps paged gradients in their upload copy); drop the job and call zero_grad() only "
                        "after optimizer.step()",
                        message.step, b));
      default: Abandon(b); break;
    }
  }
  micro_.Dropping(message.step);
  MaybeFinishDiscard();
}

void StepProtocol::MaybeFinishDiscard() {
  if (!micro_.discarding()) return;
  for (const BucketLifecycle& progress : buckets_) {
    if (progress.phase != Phase::kCollecting) return;
  }
  const std::optional<uint64_t> step = micro_.FinishDiscard();
  ranks_.PostToAll(shm::Message{.kind = shm::MessageKind::kDiscarded, .step = *step, .micro = micro_.discards()});
}

void StepProtocol::OnLoadState(RankChannel& channel, const shm::Message& message) {
  CheckLoadState(buckets_, loading_, channel.rank, message);
  if (!PastTheSeed()) {  // the seed is written: SetTransfer left this to now
    for (const auto& rank : ranks_) {
      if (rank && rank->transfer) rank->transfer->WillCopy(CopiedHostRanges(layout_, state_, *rank));
    }
  }
  loading_ = true;
  const uint64_t step = message.step;
  const uint32_t loader = channel.rank;
  channel.claims_on_gpu = -1;  // only a claim sent after this load counts for it
  auto remaining = std::make_shared<size_t>(buckets_.size());
  for (uint32_t b = 0; b < buckets_.size(); ++b) {
    UploadCommitted(b, [this, remaining, step, loader] {
      if (--*remaining != 0) return;
      for (uint32_t bucket = 0; bucket < buckets_.size(); ++bucket) {
        // The client wrote the committed half: it commits as `step` where it is.
        state_.bucket_state[bucket].Store({.step = step, .half = state_.bucket_state[bucket].Load().half});
        buckets_[bucket].step = step + 1;
        buckets_[bucket].Idle();
        buckets_[bucket].upload_dirty = false;
      }
      completed_ = step;
      state_.header->completed_step.store(step);
      state_.header->initialized = 1;
      loading_ = false;
      pushes_.Loaded(loader, step);
      for (uint32_t bucket = 0; bucket < buckets_.size(); ++bucket) {
        NotifyCommit(
            Commit{.bucket = bucket, .step = step, .step_completed = bucket + 1 == buckets_.size(), .loaded = true});
      }
    });
  }
}

}  // namespace trainstream::daemon
