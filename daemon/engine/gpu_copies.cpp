#include "daemon/engine/gpu_copies.h"

#include <algorithm>

namespace trainstream::daemon {

PushOrder NextPush(const RankCopies& rank, uint32_t b, const BucketLifecycle& bucket, int64_t committed,
                   std::optional<uint64_t> offset, uint64_t bytes) {
  if (bucket.Writing()) {  // the pieces of its running update or speculation written since the last push
    const auto step = static_cast<int64_t>(bucket.step);
    const RunningUpdate& update = *bucket.update;
    const uint32_t streamed = rank.streamed[b];
    if (!offset || step > rank.weights_wanted || streamed >= update.written) return {};
    return {.kind = PushOrder::Kind::kWritten,
            .step = step,
            .begin = update.EndByte(streamed),
            .end = update.EndByte(update.written)};
  }
  if (rank.pushing[b] > 0) return {};
  if (committed > rank.weights_wanted || rank.pushed[b] >= committed || bucket.updating || bucket.upload_dirty) {
    return {};
  }
  // Nothing to copy when the rank's GPU holds these weights already (a load of its own, the speculation
  // that committed), or keeps the bucket off it (weight paging: the rank loads the bucket from the host
  // copy itself, once told it is final).
  if (rank.on_gpu == committed || rank.speculated[b] == committed || !offset) {
    return {.kind = PushOrder::Kind::kReady, .step = committed};
  }
  return {.kind = PushOrder::Kind::kCommitted, .step = committed, .begin = 0, .end = bytes};
}

bool PushEnded(RankCopies& rank, uint32_t b, uint64_t step, uint64_t generation, bool written, bool last, bool ok,
               bool holds) {
  --rank.pushing[b];
  const bool current = ok && generation == rank.push_generation;
  // Recorded before a redo held back by this push starts: the redo forgets them.
  if (current && written && last && holds) rank.speculated[b] = static_cast<int64_t>(step);
  return current;
}

uint32_t PiecesOf(const shm::BucketLayout& bucket, uint64_t slot_bytes) {
  return static_cast<uint32_t>(std::max<uint64_t>(1, (bucket.bytes() + slot_bytes - 1) / slot_bytes));
}

std::vector<HostRange> CopiedHostRanges(const shm::JobLayout& layout, const shm::StateView& state,
                                        const RankChannel& channel) {
  std::vector<HostRange> ranges, second_half;
  for (uint32_t b = 0; b < layout.buckets.size(); ++b) {
    const shm::BucketLayout& bucket = layout.buckets[b];
    if (!channel.transfer->ParamsOffset(b)) continue;
    ranges.push_back(HostRange::Of(shm::GradsOf(bucket, state, channel.view), bucket.bytes()));
    if (!bucket.uploads_from_master()) {
      ranges.push_back(HostRange::Of(state.upload + bucket.upload_offset, bucket.bytes()));
      continue;
    }
    ranges.push_back(HostRange::Of(state.Other(b).master + bucket.elem_offset, bucket.bytes()));
    if (state.Other(b).master != state.Committed(b).master) {
      second_half.push_back(HostRange::Of(state.Committed(b).master + bucket.elem_offset, bucket.bytes()));
    }
  }
  ranges.insert(ranges.end(), second_half.begin(), second_half.end());
  return ranges;
}

const std::byte* WeightsIn(const shm::JobLayout& layout, const shm::StateView& state, uint32_t b,
                           const shm::StateHalf& half) {
  const shm::BucketLayout& bucket = layout.buckets[b];
  const void* weights = bucket.uploads_from_master() ? static_cast<const void*>(half.master + bucket.elem_offset)
                                                     : static_cast<const void*>(state.upload + bucket.upload_offset);
  return static_cast<const std::byte*>(weights);
}

}  // namespace trainstream::daemon
