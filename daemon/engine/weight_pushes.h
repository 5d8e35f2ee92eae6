// A bucket's new weights on their way to the ranks: PARAMS_READY to a rank that maps the host regions,
// a push to the GPU first for a cuda-ipc rank (RankTransfer::PushWeights), once that rank asked for the
// step's weights (kWeightsWanted). What to send when is decided by gpu_copies.h (NextPush, PushEnded);
// this object issues the copies, counts them on the bucket (BucketLifecycle::pushes: an update waits
// while a push reads its bucket) and posts the messages. It runs on the engine thread and tells the
// engine one thing back: a bucket no push reads any more (its held-back update may start).
//
// Invariants: every push it starts ends once on the engine thread (through the mailbox), failed or
// not; nothing is pushed while the job's state is loaded or before the seed is written.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "daemon/engine/bucket_lifecycle.h"
#include "daemon/engine/engine_mailbox.h"
#include "daemon/engine/rank_table.h"
#include "daemon/engine/step_trace.h"
#include "shm/job_layout.h"

namespace trainstream::daemon {

class WeightPushes {
 public:
  // `loading`: the engine's flag, set while a LOAD_STATE rewrites the state. `on_unread(b)`: no push
  // reads bucket b any more. `trace` may be nullptr.
  WeightPushes(const shm::JobLayout& layout, const shm::StateView& state, std::vector<BucketLifecycle>& buckets,
               RankTable& ranks, EngineMailbox& mailbox, StepTrace* trace, const bool& loading,
               std::function<void(uint32_t)> on_unread);

  // The weights of bucket b after `step` are final: PARAMS_READY, after a push for cuda-ipc ranks.
  void Publish(uint32_t b, uint64_t step);
  // Bucket b's update wrote weights before its commit (a piece, or the whole speculated update): they go
  // to the cuda-ipc ranks that asked for the step.
  void PushWritten(uint32_t b);
  // The GPUs' copies of bucket b's speculated weights are void (redone, abandoned).
  void ForgetSpeculated(uint32_t b);
  // optimizer.step() was called for message.step on the rank: from now on that step's weights may
  // overwrite its parameters, after (on the GPU) the kernels it queued before.
  void OnWeightsWanted(const std::shared_ptr<RankChannel>& channel, const shm::Message& message);
  // A LOAD_STATE of `loader` ended at `step`: every GPU's copy is stale but the loader's where it said
  // its GPU holds what it loaded; every bucket's weights go out.
  void Loaded(uint32_t loader, uint64_t step);

 private:
  void MaybePush(const std::shared_ptr<RankChannel>& channel, uint32_t b);
  // Copies bytes [begin, end) of the bucket's weights of `step` (the bucket's in `source`) to the rank's
  // GPU, at its parameter buffer's `offset` plus `begin`; `written`: not committed yet.
  void Push(const std::shared_ptr<RankChannel>& channel, uint32_t b, int64_t step, uint64_t offset,
            const std::byte* source, uint64_t begin, uint64_t end, bool written);
  // `last`: the push held the bucket's end, so the GPU holds all of it once this push is done (pushes
  // of a rank complete in submission order).
  void OnPushed(const std::shared_ptr<RankChannel>& channel, uint32_t b, uint64_t step, uint64_t generation,
                bool written, bool last, const std::optional<Error>& error);

  const shm::JobLayout& layout_;
  const shm::StateView& state_;
  std::vector<BucketLifecycle>& buckets_;
  RankTable& ranks_;
  EngineMailbox& mailbox_;
  StepTrace* const trace_;
  const bool& loading_;
  const std::function<void(uint32_t)> on_unread_;
  int64_t loaded_by_ = -1;  // the rank whose LOAD_STATE was the last one to complete
  uint64_t loaded_step_ = 0;
};

}  // namespace trainstream::daemon
