// Where a job's committed optimizer state lies in its state segment, for snapshots: the one place that
// knows. "Committed": what a bucket holds between two of its updates (the engine reports each commit,
// daemon/engine/step_protocol.h's Commit); with two state halves, the half its BucketState names (the
// other one may be mid-update or hold an uncommitted speculation).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "shm/job_layout.h"

namespace trainstream::daemon {

// One parameter's state: its fp32 master weights, its moments (in the job's moment dtype), its AdamW
// step count.
struct ParamStateRef {
  std::span<float> master;
  std::span<std::byte> exp_avg, exp_avg_sq;
  uint64_t& step;
};

class CommittedState {
 public:
  CommittedState(const shm::StateView& state, const shm::JobLayout& layout, const shm::LayoutSpec& spec)
      : state_(state), layout_(layout), spec_(spec) {}

  // Read by the snapshot only while the parameter's bucket is committed (no update of it is running);
  // written by a restore before any engine runs on the job.
  [[nodiscard]] ParamStateRef Param(uint32_t param) const;
  [[nodiscard]] std::span<std::byte> Frozen(uint32_t frozen_param) const;
  // The step a bucket's state holds.
  [[nodiscard]] uint64_t BucketStep(uint32_t bucket) const;
  void SetBucketStep(uint32_t bucket, uint64_t step) const;
  // The 16-bit copy of a bucket's master weights that its clients read (the upload region), made from
  // the master weights; nothing for fp32 buckets, whose clients read the master weights.
  void MakeUploadCopy(uint32_t bucket) const;
  // Marks the job as holding weights at `completed_step` (every bucket has committed it).
  void Publish(uint64_t completed_step) const;

 private:
  shm::StateView state_;
  const shm::JobLayout& layout_;
  const shm::LayoutSpec& spec_;
};

}  // namespace trainstream::daemon
