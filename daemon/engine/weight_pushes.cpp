#include "daemon/engine/weight_pushes.h"

#include <utility>

#include "daemon/engine/gpu_copies.h"
#include "daemon/engine/ring_checks.h"

namespace trainstream::daemon {

WeightPushes::WeightPushes(const shm::JobLayout& layout, const shm::StateView& state,
                           std::vector<BucketLifecycle>& buckets, RankTable& ranks, EngineMailbox& mailbox,
                           StepTrace* trace, const bool& loading, std::function<void(uint32_t)> on_unread)
    : layout_(layout),
      state_(state),
      buckets_(buckets),
      ranks_(ranks),
      mailbox_(mailbox),
      trace_(trace),
      loading_(loading),
      on_unread_(std::move(on_unread)) {}

void WeightPushes::Publish(uint32_t b, uint64_t step) {
  for (const auto& channel : ranks_) {
    if (!channel || channel->failed) continue;
    if (channel->transfer != nullptr) {
      MaybePush(channel, b);
    } else {
      ranks_.PostTo(*channel, shm::Message{.kind = shm::MessageKind::kParamsReady, .bucket = b, .step = step});
    }
  }
}

void WeightPushes::PushWritten(uint32_t b) {
  for (const auto& channel : ranks_) {
    if (channel && channel->transfer != nullptr) MaybePush(channel, b);
  }
}

void WeightPushes::ForgetSpeculated(uint32_t b) {
  for (const auto& channel : ranks_) {
    if (channel) channel->ForgetSpeculated(b);
  }
}

void WeightPushes::OnWeightsWanted(const std::shared_ptr<RankChannel>& channel, const shm::Message& message) {
  CheckWeightsWanted(channel->transfer != nullptr,
                     channel->transfer != nullptr ? channel->transfer->weights_wanted_events() : 0, channel->rank,
                     message);
  mailbox_.Begin();
  channel->transfer->AwaitWeightsWanted(message.slot, [this, channel](std::optional<Error> error) {
    mailbox_.Continue([this, channel, error = std::move(error)] {
      if (!ranks_.Attached(channel)) return;
      if (error)
        return ranks_.FailRank(*channel,
                               fmt::format("waiting for the rank's optimizer.step() failed: {}", error->what()));
      channel->view.header->weights_wanted_waits.fetch_add(1);
    });
  });
  channel->weights_wanted = static_cast<int64_t>(message.step);
  if (trace_ != nullptr) trace_->Mark(SpanKind::kWeightsWanted, 0, message.step, channel->rank);
  if ((message.flags & shm::kWeightsOnGpu) != 0) {
    channel->claims_on_gpu = static_cast<int64_t>(message.step);
    // The load it follows may have completed already; if it is still running, its end checks the claim.
    if (!loading_ && loaded_by_ == static_cast<int64_t>(channel->rank) && loaded_step_ == message.step) {
      channel->on_gpu = static_cast<int64_t>(message.step);
    }
  }
  for (uint32_t b = buckets_.size(); b-- > 0;) MaybePush(channel, b);  // the first layers first
}

void WeightPushes::Loaded(uint32_t loader, uint64_t step) {
  loaded_by_ = loader;
  loaded_step_ = step;
  for (const auto& channel : ranks_) {
    if (channel) channel->Reloaded(channel->rank, loader, step);
  }
  for (uint32_t b = buckets_.size(); b-- > 0;) Publish(b, step);
}

// Pushes bucket b's weights to a cuda-ipc rank if it wants them and they are final and not there yet;
// a speculated bucket's weights before they are final (NextPush).
void WeightPushes::MaybePush(const std::shared_ptr<RankChannel>& channel, uint32_t b) {
  const BucketLifecycle& bucket = buckets_[b];
  if (channel->failed || loading_ || state_.header->initialized == 0) return;
  const auto committed = static_cast<int64_t>(state_.bucket_state[b].Load().step);
  const std::optional<uint64_t> offset = channel->transfer->ParamsOffset(b);
  const PushOrder order = NextPush(*channel, b, bucket, committed, offset, layout_.buckets[b].bytes());
  switch (order.kind) {
    case PushOrder::Kind::kNone: return;
    case PushOrder::Kind::kReady:
      channel->pushed[b] = order.step;
      return ranks_.PostTo(
          *channel,
          shm::Message{.kind = shm::MessageKind::kParamsReady, .bucket = b, .step = static_cast<uint64_t>(order.step)});
    case PushOrder::Kind::kCommitted:
      return Push(channel, b, order.step, *offset, WeightsIn(layout_, state_, b, state_.Committed(b)), order.begin,
                  order.end, /*written=*/false);
    case PushOrder::Kind::kWritten:
      channel->streamed[b] = bucket.update->written;
      return Push(channel, b, order.step, *offset, WeightsIn(layout_, state_, b, state_.halves[bucket.plan->to]),
                  order.begin, order.end, /*written=*/true);
  }
}

void WeightPushes::Push(const std::shared_ptr<RankChannel>& channel, uint32_t b, int64_t step, uint64_t offset,
                        const std::byte* source, uint64_t begin, uint64_t end, bool written) {
  ++channel->pushing[b];
  ++buckets_[b].pushes;
  mailbox_.Begin();
  const uint64_t generation = channel->push_generation;
  const bool last = end == layout_.buckets[b].bytes();
  const int64_t pushing = trace_ != nullptr ? StepTrace::Now() : 0;
  channel->transfer->PushWeights(
      offset + begin, source + begin, end - begin,
      [this, channel, b, step, generation, written, last, pushing, bytes = end - begin](std::optional<Error> error) {
        if (trace_ != nullptr) {
          trace_->Record({SpanKind::kPush, b, static_cast<uint64_t>(step), bytes, pushing, StepTrace::Now()});
        }
        mailbox_.Continue([this, channel, b, step, generation, written, last, error = std::move(error)] {
          OnPushed(channel, b, static_cast<uint64_t>(step), generation, written, last, error);
        });
      });
}

void WeightPushes::OnPushed(const std::shared_ptr<RankChannel>& channel, uint32_t b, uint64_t step, uint64_t generation,
                            bool written, bool last, const std::optional<Error>& error) {
  // Written weights still awaiting the norm or the update's end, or committed as they are (a redo waits
  // for this push, an abandoned step leaves the bucket collecting it again).
  const bool holds = (buckets_[b].Writing() && buckets_[b].step == step) || state_.bucket_state[b].Load().step == step;
  const bool current = PushEnded(*channel, b, step, generation, written, last, !error, holds);
  if (--buckets_[b].pushes == 0) on_unread_(b);
  if (!ranks_.Attached(channel)) return;
  if (error)
    return ranks_.FailRank(*channel,
                           fmt::format("copying bucket {}'s weights to the GPU failed: {}", b, error->what()));
  if (current && !written) {
    channel->pushed[b] = static_cast<int64_t>(step);
    ranks_.PostTo(*channel, shm::Message{.kind = shm::MessageKind::kParamsReady, .bucket = b, .step = step});
  }
  MaybePush(channel, b);
}

}  // namespace trainstream::daemon
