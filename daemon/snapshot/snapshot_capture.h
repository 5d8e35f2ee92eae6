// One snapshot of a job while it is being taken: which buckets are still to be copied and at which
// step, and the copies of those already taken, waiting for the writer.
//
// The engine thread reports each bucket's commits (OnCommit); a bucket is copied right then, before
// its next update can start, so training stops for no longer than that copy. With a target step every
// bucket is taken when it commits that step (a step boundary); without one (TakeAsIs), each is taken
// as it is at its next commit or announcement (a job nothing trains). A target that is the step every
// bucket holds already (a job between two steps, its buckets announced) may move on: if a bucket not
// taken yet commits the next step (it was being updated), every bucket is taken again at that step.
// The writer thread takes the copies in any order (Next) and writes them where the file's header puts
// them; a copy it wrote before the target moved on is written over by the bucket's new one.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "daemon/engine/step_engine.h"
#include "daemon/snapshot/committed_state.h"

namespace trainstream::daemon {

struct CapturedBucket {
  uint32_t bucket = 0;
  uint64_t step = 0;
  // Per parameter of the bucket, in its order: master weights, exp_avg, exp_avg_sq, back to back.
  std::vector<std::byte> bytes;
  std::vector<int64_t> steps;  // per parameter of the bucket: its AdamW step count
};

class SnapshotCapture {
 public:
  // `or_next`: the target may move on to the step after it, once.
  SnapshotCapture(const CommittedState& state, const shm::JobLayout& layout, uint32_t num_groups,
                  std::optional<uint64_t> target, bool or_next = false);

  // Engine thread: copies the bucket if this snapshot still waits for it at this step.
  void OnCommit(const Commit& commit);
  // Drops the target: buckets not taken yet are taken at their next commit or announcement, whatever
  // their step (the job stopped training before reaching the target).
  void TakeAsIs();
  void Abort(const std::string& reason);

  // Writer: the next copy, waiting at most `wait` (nullopt if none came); throws kAborted with the
  // reason once aborted.
  std::optional<CapturedBucket> Next(std::chrono::milliseconds wait);
  [[nodiscard]] bool collected();  // every bucket has been copied
  [[nodiscard]] bool complete();   // every copy has been handed to the writer
  [[nodiscard]] std::optional<uint64_t> target();
  [[nodiscard]] std::vector<shm::HParams> hparams();  // of the first commit that had them

 private:
  CapturedBucket Copy(uint32_t bucket, uint64_t step) const;
  void MoveOn();  // to the step after the target: everything is taken again (requires mutex_)

  const CommittedState state_;
  const shm::JobLayout& layout_;
  const uint32_t num_groups_;

  std::mutex mutex_;
  std::condition_variable ready_;
  std::optional<uint64_t> target_;
  bool or_next_;
  std::vector<uint8_t> taken_;  // per bucket: copied
  size_t handed_ = 0;           // copies given to the writer
  std::deque<CapturedBucket> copies_;
  std::vector<shm::HParams> hparams_;
  std::optional<std::string> aborted_;
};

}  // namespace trainstream::daemon
