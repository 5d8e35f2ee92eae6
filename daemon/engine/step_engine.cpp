#include "daemon/engine/step_engine.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <latch>
#include <utility>

#include "daemon/optimizer/adamw_kernels.h"
#include "shm/error.h"

namespace trainstream::daemon {

namespace {

constexpr uint64_t kBlockElements = 1 << 16;           // elements of one Block (the unit of work on the pool)
constexpr uint32_t kMaxMessagesPerRankPerRound = 256;  // fairness between ranks
constexpr auto kIdleWait = std::chrono::milliseconds(100);

void CheckHParams(const shm::HParams& h, uint32_t group) {
  const bool ok = std::isfinite(h.lr) && h.lr >= 0 && std::isfinite(h.beta1) && h.beta1 >= 0 && h.beta1 < 1 &&
                  std::isfinite(h.beta2) && h.beta2 >= 0 && h.beta2 < 1 && std::isfinite(h.eps) && h.eps >= 0 &&
                  std::isfinite(h.weight_decay) && h.weight_decay >= 0;
  TS_CHECK(ok, Code::kInvalidArgument,
           "invalid hyperparameters for group {}: lr={} betas=({}, {}) eps={} weight_decay={}", group, h.lr, h.beta1,
           h.beta2, h.eps, h.weight_decay);
}

}  // namespace

StepEngine::StepEngine(std::string job_name, const shm::LayoutSpec& spec, const shm::JobLayout& layout,
                       shm::StateView state, uint64_t seed, WorkerPool& pool, AllReduce* peers)
    : job_name_(std::move(job_name)),
      spec_(spec),
      layout_(layout),
      state_(state),
      passes_(layout_, state_, spec_.moment_dtype),
      seed_(seed),
      pool_(pool),
      peers_(peers),
      ranks_(spec.world_size),
      buckets_(layout.buckets.size()),
      had_grad_(spec.params.size(), 0) {
  for (size_t b = 0; b < buckets_.size(); ++b) {
    buckets_[b].step = state_.bucket_state[b].Load().step + 1;
    buckets_[b].delivered.assign(spec.world_size, 0);
  }
  thread_ = std::thread([this] { Loop(); });
}

StepEngine::~StepEngine() {
  stopping_ = true;
  state_.header->doorbell.Ring();
  thread_.join();
  std::unique_lock lock(inflight_mutex_);
  inflight_zero_.wait(lock, [this] { return inflight_.load() == 0; });
}

void StepEngine::AddRank(std::shared_ptr<RankChannel> channel) {
  std::lock_guard lock(mutex_);
  const uint32_t rank = channel->rank;
  TS_CHECK(rank < ranks_.size(), Code::kInvalidArgument, "rank {} out of range (world size {})", rank, ranks_.size());
  TS_CHECK(ranks_[rank] == nullptr, Code::kAlreadyExists, "rank {} of job '{}' is already attached by another client",
           rank, job_name_);
  ranks_[rank] = std::move(channel);
}

void StepEngine::RemoveRank(uint32_t rank) {
  std::lock_guard lock(mutex_);
  if (rank >= ranks_.size() || ranks_[rank] == nullptr) return;
  if (ranks_[rank]->transfer) ranks_[rank]->transfer->Abandon();  // its GPU may never reach its events
  ranks_[rank] = nullptr;
  ResetCollecting(fmt::format("rank {} detached", rank));
}

void StepEngine::SetTransfer(uint32_t rank, std::shared_ptr<RankTransfer> transfer) {
  std::lock_guard lock(mutex_);
  TS_CHECK(rank < ranks_.size() && ranks_[rank] != nullptr, Code::kFailedPrecondition, "rank {} is not attached", rank);
  TS_CHECK(ranks_[rank]->transfer == nullptr, Code::kAlreadyExists, "rank {} registered its GPU buffers already", rank);
  ranks_[rank]->transfer = std::move(transfer);
}

bool StepEngine::HasRank(uint32_t rank) {
  std::lock_guard lock(mutex_);
  return rank < ranks_.size() && ranks_[rank] != nullptr;
}

std::optional<std::string> StepEngine::Diverged() {
  std::lock_guard lock(mutex_);
  return diverged_;
}

EngineStats StepEngine::Stats() {
  EngineStats stats{.updates = updates_.load(), .nonfinite_steps = nonfinite_steps_.load(), .attached_ranks = {}};
  std::lock_guard lock(mutex_);
  for (const auto& channel : ranks_) {
    if (channel) stats.attached_ranks.push_back(channel->rank);
  }
  return stats;
}

void StepEngine::FailAll(const std::string& message) {
  std::lock_guard lock(mutex_);
  FailSessions(message);
}

void StepEngine::FailRank(RankChannel& channel, const std::string& message) {
  channel.failed = true;
  spdlog::warn("job '{}' rank {}: {}", job_name_, channel.rank, message);
  channel.session->Fail(message);
}

bool StepEngine::Attached(const std::shared_ptr<RankChannel>& channel) const {
  return channel->rank < ranks_.size() && ranks_[channel->rank] == channel && !channel->failed;
}

void StepEngine::FailSessions(const std::string& message) {
  for (const auto& channel : ranks_) {
    if (channel) channel->session->Fail(message);
  }
}

// A rank left while others were mid-step: its share of the step's gradients is gone, so the partial
// step is discarded and the other ranks' sessions fail (they would wait for it forever; like a
// collective whose peer died, every rank must restart). Buckets already being updated finish.
void StepEngine::ResetCollecting(const std::string& reason) {
  bool discarded = false;
  for (uint32_t b = 0; b < buckets_.size(); ++b) {
    const BucketProgress& progress = buckets_[b];
    if (progress.phase != Phase::kCollecting || (progress.delivered_count == 0 && progress.micro == 0)) continue;
    discarded = true;
    RestartBucket(b);
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
void StepEngine::RestartBucket(uint32_t b) {
  BucketProgress& progress = buckets_[b];
  progress.phase = Phase::kCollecting;
  progress.micro = 0;
  progress.delivered_count = 0;
  std::fill(progress.delivered.begin(), progress.delivered.end(), 0);
  for (uint32_t p : layout_.buckets[b].params) had_grad_[p] = 0;
  for (const auto& channel : ranks_) {
    if (channel) channel->staged[b] = channel->pulled[b] = 0;
  }
}

void StepEngine::Loop() {
  shm::Doorbell& doorbell = state_.header->doorbell;
  while (!stopping_.load()) {
    const uint32_t seen = doorbell.Seq();
    bool progress = DrainFinished();
    progress |= DrainRequests();
    if (!progress) doorbell.Wait(seen, kIdleWait);
  }
}

bool StepEngine::DrainRequests() {
  std::lock_guard lock(mutex_);
  bool progress = false;
  for (const auto& channel : ranks_) {
    if (!channel || channel->failed) continue;
    try {
      channel->FlushBacklog();
      shm::Message message;
      for (uint32_t n = 0; n < kMaxMessagesPerRankPerRound && channel->requests.TryPop(&message); ++n) {
        progress = true;
        Handle(*channel, message);
      }
    } catch (const Error& e) {
      FailRank(*channel, e.what());
    }
  }
  return progress;
}

bool StepEngine::DrainFinished() {
  std::vector<std::function<void()>> finished;
  {
    std::lock_guard lock(finished_mutex_);
    finished.swap(finished_);
  }
  if (finished.empty()) return false;
  std::lock_guard lock(mutex_);
  for (auto& continuation : finished) {
    try {
      continuation();
    } catch (const Error& e) {  // e.g. hyperparameters rewritten between validation and use
      spdlog::error("job '{}': {}", job_name_, e.what());
      for (const auto& channel : ranks_) {
        if (channel) channel->session->Fail(e.what());
      }
    }
  }
  return true;
}

void StepEngine::Handle(RankChannel& channel, const shm::Message& message) {
  switch (message.kind) {
    case shm::MessageKind::kGradReady: return OnGradReady(channel, message);
    case shm::MessageKind::kLoadState: return OnLoadState(channel, message);
    case shm::MessageKind::kWeightsWanted: return OnWeightsWanted(ranks_[channel.rank], message);
    default:
      Throw(Code::kInvalidArgument, "unknown ring message kind {} from rank {}", static_cast<int>(message.kind),
            channel.rank);
  }
}

void StepEngine::OnGradReady(RankChannel& channel, const shm::Message& message) {
  const uint32_t b = message.bucket;
  TS_CHECK(b < buckets_.size(), Code::kInvalidArgument, "GRAD_READY for bucket {}, but the job has {} buckets", b,
           buckets_.size());
  BucketProgress& progress = buckets_[b];
  TS_CHECK(!loading_, Code::kFailedPrecondition, "GRAD_READY for bucket {} while a state load is in progress", b);
  TS_CHECK(message.step == progress.step, Code::kInvalidArgument,
           "GRAD_READY for bucket {} of step {}, but that bucket expects step {}", b, message.step, progress.step);
  TS_CHECK(progress.phase == Phase::kCollecting && message.micro == progress.micro, Code::kInvalidArgument,
           "GRAD_READY for bucket {} micro-batch {} of step {}, but that bucket is {}", b, message.micro, message.step,
           progress.phase == Phase::kCollecting ? fmt::format("collecting micro-batch {}", progress.micro)
                                                : std::string("still being processed (slot not yet released)"));
  TS_CHECK(!progress.delivered[channel.rank], Code::kInvalidArgument,
           "rank {} delivered bucket {} of step {} micro-batch {} twice", channel.rank, b, message.step, message.micro);
  const bool final_micro = (message.flags & shm::kFinalMicro) != 0;
  TS_CHECK(final_micro == (message.micro + 1 == spec_.accumulation_steps), Code::kInvalidArgument,
           "GRAD_READY micro-batch {} marked {}final, but accumulation_steps is {}", message.micro,
           final_micro ? "" : "not ", spec_.accumulation_steps);
  if (channel.transfer == nullptr) return Deliver(channel, b);
  TS_CHECK(message.slot < channel.transfer->staging_slots(), Code::kInvalidArgument,
           "GRAD_READY for bucket {} names staging slot {}, but rank {} registered {}", b, message.slot, channel.rank,
           channel.transfer->staging_slots());
  const uint32_t pieces = PiecesOf(b, *channel.transfer);
  TS_CHECK(message.piece == channel.staged[b] && message.piece < pieces, Code::kInvalidArgument,
           "GRAD_READY for piece {} of bucket {} ({} pieces), but piece {} is the next one", message.piece, b, pieces,
           channel.staged[b]);
  ++channel.staged[b];
  PullThenDeliver(ranks_[channel.rank], b, message.slot, message.piece);
}

uint32_t StepEngine::PiecesOf(uint32_t b, const RankTransfer& transfer) const {
  const uint64_t bytes = layout_.buckets[b].bytes();
  return static_cast<uint32_t>(std::max<uint64_t>(1, (bytes + transfer.slot_bytes() - 1) / transfer.slot_bytes()));
}

// cuda-ipc: each piece of the bucket's gradients reaches the rank's host slot first (the slot on the
// GPU is then free); the bucket is delivered once every piece has.
void StepEngine::PullThenDeliver(const std::shared_ptr<RankChannel>& channel, uint32_t b, uint32_t slot,
                                 uint32_t piece) {
  const shm::BucketLayout& bucket = layout_.buckets[b];
  const uint64_t step = buckets_[b].step;
  const uint32_t micro = buckets_[b].micro;
  const uint64_t offset = piece * channel->transfer->slot_bytes();
  ++inflight_;
  channel->transfer->PullGradients(
      slot, channel->view.grads + bucket.grad_offset + offset,
      std::min(channel->transfer->slot_bytes(), bucket.bytes() - offset),
      [this, channel, b, slot, step, micro](std::optional<Error> error) {
        Continue([this, channel, b, slot, step, micro, error = std::move(error)] {
          if (!Attached(channel)) return;
          if (error) {
            return FailRank(*channel,
                            fmt::format("copying bucket {}'s gradients from the GPU failed: {}", b, error->what()));
          }
          const BucketProgress& progress = buckets_[b];
          if (progress.step != step || progress.micro != micro || progress.phase != Phase::kCollecting) return;
          PostTo(*channel, shm::Message{.kind = shm::MessageKind::kStagingFree, .step = step, .slot = slot});
          if (++channel->pulled[b] < PiecesOf(b, *channel->transfer)) return;
          channel->staged[b] = channel->pulled[b] = 0;
          Deliver(*channel, b);
        });
      });
}

void StepEngine::Deliver(RankChannel& channel, uint32_t b) {
  BucketProgress& progress = buckets_[b];
  progress.delivered[channel.rank] = 1;
  ++progress.delivered_count;
  for (uint32_t p : layout_.buckets[b].params) had_grad_[p] |= channel.view.presence[p] != 0 ? 1 : 0;
  if (progress.delivered_count == spec_.world_size) OnBucketDelivered(b);
}

void StepEngine::OnBucketDelivered(uint32_t b) {
  BucketProgress& progress = buckets_[b];
  const bool final_micro = progress.micro + 1 == spec_.accumulation_steps;
  if (final_micro) HParamsFor(progress.step);  // refuse bad hyperparameters before any work starts
  progress.phase = Phase::kBusy;
  if (!final_micro) return StartAccumulate(b);
  if (spec_.nodes() > 1) return StartReduce(b);
  AfterGradients(b);
}

// The hyperparameters in force for `step`: those rank 0 wrote (the lowest attached rank if 0 is gone).
const shm::HParams* StepEngine::HParamsFor(uint64_t step) {
  for (const auto& channel : ranks_) {
    if (!channel) continue;
    const shm::HParams* table = channel->view.hparams + (step % 2) * spec_.num_groups;
    for (uint32_t g = 0; g < spec_.num_groups; ++g) CheckHParams(table[g], g);
    return table;
  }
  Throw(Code::kFailedPrecondition, "no rank attached to read hyperparameters from");
}

Sources StepEngine::SnapshotSources() {
  return ranks_;
}

// After a multi-node all-reduce the accumulator holds the whole sum: the slots must not count again.
Sources StepEngine::GradientSlots() {
  return spec_.nodes() > 1 ? Sources() : ranks_;
}

// Hands `continuation` from an asynchronous worker (pool, all-reduce) back to the engine thread, and
// ends that worker's in-flight count.
void StepEngine::Continue(std::function<void()> continuation) {
  {
    std::lock_guard lock(finished_mutex_);
    finished_.push_back(std::move(continuation));
  }
  state_.header->doorbell.Ring();
  if (--inflight_ == 0) {
    std::lock_guard lock(inflight_mutex_);
    inflight_zero_.notify_all();
  }
}

template <typename Include>
std::shared_ptr<std::vector<Block>> StepEngine::BlocksOf(uint32_t bucket, Include include) const {
  auto blocks = std::make_shared<std::vector<Block>>();
  for (uint32_t p : layout_.buckets[bucket].params) {
    if (!include(p)) continue;
    const uint64_t numel = layout_.params[p].numel;
    for (uint64_t begin = 0; begin < numel; begin += kBlockElements) {
      blocks->push_back(Block{p, begin, std::min(kBlockElements, numel - begin)});
    }
  }
  return blocks;
}

// With several NUMA nodes, each bucket is split into equal element ranges, one per node: a block's
// home depends only on where its elements lie, so every pass (touch, accumulate, norm, update) runs
// it on the same node, whichever parameters the pass includes.
WorkerPool::Home StepEngine::HomesOf(std::shared_ptr<std::vector<Block>> blocks) const {
  const uint32_t nodes = pool_.nodes();
  if (nodes == 1) return {};
  return [this, blocks = std::move(blocks), nodes](size_t i) {
    const Block& block = (*blocks)[i];
    const shm::ParamLayout& p = layout_.params[block.param];
    const uint64_t numel = std::max<uint64_t>(layout_.buckets[p.bucket].numel, 1);
    return static_cast<uint32_t>((p.offset_in_bucket + block.begin) * nodes / numel);
  };
}

template <typename Work, typename Include>
void StepEngine::Schedule(uint32_t bucket, int64_t priority, Include include, Work work, std::function<void()> done) {
  auto blocks = BlocksOf(bucket, include);
  ++inflight_;
  pool_.Submit(
      blocks->size(), [blocks, work = std::move(work)](size_t i) { work(i, (*blocks)[i]); },
      [this, done = std::move(done)] { Continue(done); }, priority, HomesOf(blocks));
}

void StepEngine::PlaceState() {
  std::call_once(placed_, [this] { TouchState(); });
}

void StepEngine::TouchState() {
  if (pool_.nodes() == 1) return;
  std::latch touched(static_cast<std::ptrdiff_t>(layout_.buckets.size()));
  for (uint32_t b = 0; b < layout_.buckets.size(); ++b) {
    auto blocks = BlocksOf(b, [](uint32_t) { return true; });
    pool_.Submit(
        blocks->size(), [passes = &passes_, blocks](size_t i) { passes->Touch((*blocks)[i]); },
        [&touched] { touched.count_down(); }, /*priority=*/0, HomesOf(blocks));
  }
  touched.wait();
}

void StepEngine::StartAccumulate(uint32_t b) {
  AccumulateSlots(b, [this, b] {
    BucketProgress& progress = buckets_[b];
    const uint32_t micro = progress.micro++;
    progress.delivered_count = 0;
    std::fill(progress.delivered.begin(), progress.delivered.end(), 0);
    progress.phase = Phase::kCollecting;
    PostToAll(shm::Message{.kind = shm::MessageKind::kSlotFree, .bucket = b, .step = progress.step, .micro = micro});
  });
}

// Multi-node: this node's sum goes into the accumulator, then around the ring of daemons.
void StepEngine::StartReduce(uint32_t b) {
  AccumulateSlots(b, [this, b] {
    const shm::BucketLayout& bucket = layout_.buckets[b];
    ++inflight_;  // the all-reduce works on the accumulator
    peers_->Submit(buckets_[b].step, b, state_.accum + bucket.elem_offset, bucket.numel,
                   [this, b](std::optional<Error> error) {
                     Continue([this, b, error = std::move(error)] {
                       if (!error) return AfterGradients(b);
                       RestartBucket(b);
                       const std::string message = fmt::format("all-reduce between daemons failed: {}", error->what());
                       if (!diverged_)
                         diverged_ = fmt::format("{} (bucket {} of step {})", message, b, buckets_[b].step);
                       FailSessions(message);
                     });
                   });
  });
}

void StepEngine::AfterGradients(uint32_t b) {
  if (spec_.max_grad_norm > 0) return StartNorm(b);
  StartUpdate(b, 1.0f);
}

void StepEngine::AccumulateSlots(uint32_t b, std::function<void()> then) {
  const bool overwrite = buckets_[b].micro == 0;
  Schedule(
      b, 0, [](uint32_t) { return true; },
      [passes = &passes_, overwrite, sources = SnapshotSources()](size_t, const Block& block) {
        passes->Accumulate(block, sources, overwrite);
      },
      std::move(then));
}

void StepEngine::StartNorm(uint32_t b) {
  const float scale = 1.0f / static_cast<float>(spec_.world_size * spec_.nodes());
  auto include = [this](uint32_t p) { return had_grad_[p] != 0; };
  size_t blocks = 0;
  for (uint32_t p : layout_.buckets[b].params) {
    if (include(p)) blocks += (layout_.params[p].numel + kBlockElements - 1) / kBlockElements;
  }
  auto partial = std::make_shared<std::vector<double>>(blocks, 0.0);
  auto nonfinite = std::make_shared<std::atomic<bool>>(false);
  Schedule(
      b, 0, include,
      [passes = &passes_, scale, partial, nonfinite, sources = GradientSlots()](size_t i, const Block& block) {
        bool bad = false;
        (*partial)[i] = passes->SumOfSquares(block, sources, scale, &bad);
        if (bad) nonfinite->store(true);
      },
      [this, b, partial, nonfinite] {
        double sum = 0;
        for (double value : *partial) sum += value;  // fixed order: deterministic
        OnNormed(b, sum, nonfinite->load());
      });
}

void StepEngine::OnNormed(uint32_t b, double sum_of_squares, bool nonfinite) {
  BucketProgress& progress = buckets_[b];
  progress.phase = Phase::kAwaitingClip;
  ClipGate& gate = clip_gates_[progress.step];
  gate.sum_of_squares += sum_of_squares;
  gate.nonfinite |= nonfinite;
  if (++gate.normed < buckets_.size()) return;
  // Every bucket's norm is in: torch's clip_grad_norm_ coefficient, then updates in forward order
  // (the highest bucket holds the first parameters, which the next forward needs first).
  const double total_norm = std::sqrt(gate.sum_of_squares);
  const double coefficient = std::min(1.0, spec_.max_grad_norm / (total_norm + 1e-6));
  if (gate.nonfinite) ReportNonFinite(progress.step, "gradients contain inf or NaN");
  for (uint32_t bucket = static_cast<uint32_t>(buckets_.size()); bucket-- > 0;) {
    StartUpdate(bucket, static_cast<float>(coefficient));
  }
}

// Reads bucket b's committed half and writes the other (the same half, in place, with one half): the
// parameters with a gradient get their update, the others their state carried over unchanged (with one
// half there is nothing to carry), and the step counts go to the other half alike. OnUpdated commits.
void StepEngine::StartUpdate(uint32_t b, float clip_coefficient) {
  BucketProgress& progress = buckets_[b];
  if (progress.pushes > 0) {  // a GPU still reads the weights of the last step
    progress.update_after_pushes = clip_coefficient;
    return;
  }
  progress.updating = true;
  const uint64_t step = progress.step;
  const shm::BucketCommit committed = state_.bucket_state[b].Load();
  const uint32_t to = OtherHalf(committed.half);
  if (spec_.state_halves == 1) {  // torn until OnUpdated: a daemon that adopts the job must know
    state_.bucket_state[b].Store({.step = committed.step, .half = 0, .updating = true});
  }
  const shm::StateHalf& from_half = state_.halves[committed.half];
  const shm::StateHalf& to_half = state_.halves[to];
  const shm::HParams* hparams = HParamsFor(step);
  const bool decoupled = spec_.optimizer == shm::OptimizerKind::kAdamW;
  auto scalars = std::make_shared<std::vector<optimizer::AdamWStep>>(spec_.params.size());
  auto updated = std::make_shared<std::vector<uint8_t>>(spec_.params.size(), 0);
  for (uint32_t p : layout_.buckets[b].params) {
    const uint64_t steps = from_half.param_state[p].step + (had_grad_[p] != 0 ? 1 : 0);
    to_half.param_state[p].step = steps;
    if (!had_grad_[p]) continue;
    (*updated)[p] = 1;
    const shm::HParams& h = hparams[spec_.params[p].group];
    (*scalars)[p] = optimizer::AdamWStep::For(h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, decoupled, steps);
  }
  const float scale = clip_coefficient / static_cast<float>(spec_.world_size * spec_.nodes());
  const uint64_t sr_seed = seed_ ^ (step * 0xD1B54A32D192ED03ull);
  auto nonfinite = std::make_shared<std::atomic<bool>>(false);
  const bool carry = spec_.state_halves == 2;  // in place, a parameter without a gradient is left alone
  Schedule(
      b, static_cast<int64_t>(b), [this, carry](uint32_t p) { return carry || had_grad_[p] != 0; },
      [passes = &passes_, scale, sr_seed, scalars, updated, nonfinite, from = &from_half, to = &to_half,
       sources = GradientSlots()](size_t, const Block& block) {
        if ((*updated)[block.param] == 0) return passes->Carry(block, *from, *to);
        if (passes->Update(block, sources, scale, (*scalars)[block.param], sr_seed, *from, *to)) nonfinite->store(true);
      },
      [this, b, step, to, nonfinite] { OnUpdated(b, step, to, nonfinite->load()); });
}

uint32_t StepEngine::OtherHalf(uint32_t half) const {
  return spec_.state_halves == 2 ? 1 - half : 0;
}

void StepEngine::ReportNonFinite(uint64_t step, const std::string& what) {
  if (step <= last_nonfinite_step_) return;  // once per step, whichever pass noticed first
  last_nonfinite_step_ = step;
  nonfinite_steps_++;
  for (const auto& channel : ranks_) {
    if (channel) channel->session->Warn(fmt::format("step {}: {}", step, what));
  }
}

void StepEngine::OnUpdated(uint32_t b, uint64_t step, uint32_t half, bool nonfinite) {
  if (nonfinite) {
    ReportNonFinite(step, fmt::format("the update of bucket {} left inf or NaN weights (from inf or NaN gradients, "
                                      "or a diverging model); max_grad_norm also reports them before the update",
                                      b));
  }
  state_.bucket_state[b].Store({.step = step, .half = half});  // the commit
  BucketProgress& progress = buckets_[b];
  progress.updating = false;
  progress.step = step + 1;
  RestartBucket(b);  // collects the next step from scratch
  updates_++;
  if (++updated_[step] == buckets_.size()) {  // before the last PARAMS_READY: a client may read it then
    updated_.erase(step);
    clip_gates_.erase(step);
    state_.header->completed_step.store(step);
  }
  PublishWeights(b, step);
}

void StepEngine::OnLoadState(RankChannel& channel, const shm::Message& message) {
  TS_CHECK(!loading_, Code::kFailedPrecondition, "LOAD_STATE while another load is in progress");
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const BucketProgress& progress = buckets_[b];
    TS_CHECK(progress.phase == Phase::kCollecting && progress.delivered_count == 0 && progress.micro == 0,
             Code::kFailedPrecondition,
             "LOAD_STATE from rank {} while bucket {} is in the middle of step {}; call synchronize() first",
             channel.rank, b, progress.step);
  }
  TS_CHECK(message.step < (uint64_t{1} << 62), Code::kInvalidArgument, "LOAD_STATE step {} out of range", message.step);
  loading_ = true;
  const uint64_t step = message.step;
  const uint32_t loader = channel.rank;
  channel.claims_on_gpu = -1;  // only a claim sent after this load counts for it
  auto remaining = std::make_shared<size_t>(buckets_.size());
  for (uint32_t b = 0; b < buckets_.size(); ++b) {
    buckets_[b].phase = Phase::kBusy;
    Schedule(
        b, 0, [](uint32_t) { return true; },
        [passes = &passes_, half = &state_.Committed(b)](size_t, const Block& block) {
          passes->UploadMaster(block, *half);
        },
        [this, remaining, step, loader] {
          if (--*remaining != 0) return;
          for (uint32_t bucket = 0; bucket < buckets_.size(); ++bucket) {
            state_.bucket_state[bucket].Store({.step = step, .half = state_.bucket_state[bucket].Load().half});
            buckets_[bucket].step = step + 1;
            buckets_[bucket].phase = Phase::kCollecting;
          }
          state_.header->completed_step.store(step);
          state_.header->initialized = 1;
          loading_ = false;
          loaded_by_ = loader;
          loaded_step_ = step;
          for (const auto& channel : ranks_) {  // the GPUs' copies of the weights are stale now...
            if (!channel) continue;
            ++channel->push_generation;
            std::fill(channel->pushed.begin(), channel->pushed.end(), -1);
            // ...except the loader's, if it said its GPU holds what it loaded
            channel->on_gpu = channel->rank == loader && channel->claims_on_gpu == static_cast<int64_t>(step)
                                  ? static_cast<int64_t>(step)
                                  : -1;
          }
          for (uint32_t bucket = buckets_.size(); bucket-- > 0;) PublishWeights(bucket, step);
        });
  }
}

void StepEngine::PostToAll(const shm::Message& message) {
  for (const auto& channel : ranks_) {
    if (channel && !channel->failed) PostTo(*channel, message);
  }
}

void StepEngine::PostTo(RankChannel& channel, const shm::Message& message) {
  try {
    channel.Post(message);
  } catch (const Error& e) {
    FailRank(channel, e.what());
  }
}

void StepEngine::PublishWeights(uint32_t b, uint64_t step) {
  for (const auto& channel : ranks_) {
    if (!channel || channel->failed) continue;
    if (channel->transfer != nullptr) {
      MaybePush(channel, b);
    } else {
      PostTo(*channel, shm::Message{.kind = shm::MessageKind::kParamsReady, .bucket = b, .step = step});
    }
  }
}

// optimizer.step() was called for message.step: from now on that step's weights may overwrite the
// rank's parameters, after (on the GPU) the kernels it queued before.
void StepEngine::OnWeightsWanted(const std::shared_ptr<RankChannel>& channel, const shm::Message& message) {
  TS_CHECK(channel->transfer != nullptr, Code::kInvalidArgument,
           "WEIGHTS_WANTED from rank {}, which copies its weights itself (no cuda-ipc registration)", channel->rank);
  TS_CHECK(message.slot < channel->transfer->weights_wanted_events(), Code::kInvalidArgument,
           "WEIGHTS_WANTED names event {}, but rank {} registered {}", message.slot, channel->rank,
           channel->transfer->weights_wanted_events());
  TS_CHECK(message.step < (uint64_t{1} << 62), Code::kInvalidArgument, "WEIGHTS_WANTED step {} out of range",
           message.step);
  ++inflight_;
  channel->transfer->AwaitWeightsWanted(message.slot, [this, channel](std::optional<Error> error) {
    Continue([this, channel, error = std::move(error)] {
      if (!Attached(channel)) return;
      if (error)
        return FailRank(*channel, fmt::format("waiting for the rank's optimizer.step() failed: {}", error->what()));
      channel->view.header->weights_wanted_waits.fetch_add(1);
    });
  });
  channel->weights_wanted = static_cast<int64_t>(message.step);
  if ((message.flags & shm::kWeightsOnGpu) != 0) {
    channel->claims_on_gpu = static_cast<int64_t>(message.step);
    // The load it follows may have completed already; if it is still running, its end checks the claim.
    if (!loading_ && loaded_by_ == static_cast<int64_t>(channel->rank) && loaded_step_ == message.step) {
      channel->on_gpu = static_cast<int64_t>(message.step);
    }
  }
  for (uint32_t b = buckets_.size(); b-- > 0;) MaybePush(channel, b);  // the first layers first
}

// Pushes bucket b's weights to a cuda-ipc rank if it wants them and they are final and not there yet.
void StepEngine::MaybePush(const std::shared_ptr<RankChannel>& channel, uint32_t b) {
  BucketProgress& progress = buckets_[b];
  const auto step = static_cast<int64_t>(state_.bucket_state[b].Load().step);
  if (channel->failed || channel->pushing[b] || step > channel->weights_wanted || channel->pushed[b] >= step ||
      loading_ || progress.updating || state_.header->initialized == 0) {
    return;
  }
  if (channel->on_gpu == step) {  // the rank's GPU holds these weights already: nothing to copy
    channel->pushed[b] = step;
    return PostTo(
        *channel,
        shm::Message{.kind = shm::MessageKind::kParamsReady, .bucket = b, .step = static_cast<uint64_t>(step)});
  }
  const shm::BucketLayout& bucket = layout_.buckets[b];
  const void* source = bucket.uploads_from_master()
                           ? static_cast<const void*>(state_.Committed(b).master + bucket.elem_offset)
                           : static_cast<const void*>(state_.upload + bucket.upload_offset);
  channel->pushing[b] = 1;
  ++progress.pushes;
  ++inflight_;
  const uint64_t generation = channel->push_generation;
  channel->transfer->PushWeights(bucket.grad_offset, source, bucket.bytes(),
                                 [this, channel, b, step, generation](std::optional<Error> error) {
                                   Continue([this, channel, b, step, generation, error = std::move(error)] {
                                     OnPushed(channel, b, static_cast<uint64_t>(step), generation, error);
                                   });
                                 });
}

void StepEngine::OnPushed(const std::shared_ptr<RankChannel>& channel, uint32_t b, uint64_t step, uint64_t generation,
                          const std::optional<Error>& error) {
  channel->pushing[b] = 0;
  BucketProgress& progress = buckets_[b];
  if (--progress.pushes == 0 && progress.update_after_pushes) {
    StartUpdate(b, *std::exchange(progress.update_after_pushes, std::nullopt));
  }
  if (!Attached(channel)) return;
  if (error)
    return FailRank(*channel, fmt::format("copying bucket {}'s weights to the GPU failed: {}", b, error->what()));
  if (generation == channel->push_generation) {  // not overtaken by a state load
    channel->pushed[b] = static_cast<int64_t>(step);
    PostTo(*channel, shm::Message{.kind = shm::MessageKind::kParamsReady, .bucket = b, .step = step});
  }
  MaybePush(channel, b);
}

}  // namespace trainstream::daemon
