#include "daemon/snapshot/committed_state.h"

#include "daemon/optimizer/adamw_kernels.h"

namespace trainstream::daemon {

ParamStateRef CommittedState::Param(uint32_t param) const {
  const shm::ParamLayout& p = layout_.params[param];
  const uint64_t element = layout_.buckets[p.bucket].elem_offset + p.offset_in_bucket;
  const size_t moment = SizeOf(spec_.moment_dtype);
  const shm::StateHalf& half = state_.Committed(p.bucket);  // the other half may be mid-update
  auto* exp_avg = static_cast<std::byte*>(half.exp_avg) + element * moment;
  auto* exp_avg_sq = static_cast<std::byte*>(half.exp_avg_sq) + element * moment;
  return ParamStateRef{.master = {half.master + element, p.numel},
                       .exp_avg = {exp_avg, p.numel * moment},
                       .exp_avg_sq = {exp_avg_sq, p.numel * moment},
                       .step = half.param_state[param].step};
}

std::span<std::byte> CommittedState::Frozen(uint32_t frozen_param) const {
  const uint64_t begin = layout_.frozen_offsets[frozen_param];
  const shm::ParamSpec& p = spec_.frozen[frozen_param];
  return {state_.frozen + begin, p.numel() * SizeOf(p.dtype)};
}

uint64_t CommittedState::BucketStep(uint32_t bucket) const {
  return state_.bucket_state[bucket].Load().step;
}

void CommittedState::SetBucketStep(uint32_t bucket, uint64_t step) const {
  state_.bucket_state[bucket].Store({.step = step, .half = state_.bucket_state[bucket].Load().half});
}

void CommittedState::MakeUploadCopy(uint32_t bucket) const {
  const shm::BucketLayout& b = layout_.buckets[bucket];
  if (b.uploads_from_master()) return;
  optimizer::ConvertMaster(state_.Committed(bucket).master + b.elem_offset,
                           optimizer::Upload{state_.upload + b.upload_offset, b.dtype}, b.numel);
}

void CommittedState::Publish(uint64_t completed_step) const {
  state_.header->completed_step.store(completed_step);
  state_.header->initialized = 1;
}

}  // namespace trainstream::daemon
