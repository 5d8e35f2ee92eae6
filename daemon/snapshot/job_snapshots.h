// The snapshots of one job: on request (Take, for Control.Snapshot) and every `every` steps into
// `dir` (trainstreamd --snapshot-dir/--snapshot-every), at most one at a time. The engine's commits
// (OnCommit, on its thread) feed the snapshot being taken; writing happens on the requesting thread
// or, for periodic snapshots, on a thread of its own.
//
// A requested snapshot of a job that ranks train is taken at its next step boundary (every bucket as
// it commits that step); of a job no rank is attached to, or whose buckets all hold the same step (its
// ranks are between steps), at once. A periodic one is taken at each
// step that is a multiple of `every`, unless another snapshot is still copying buckets then, or two
// periodic ones are still being written (that step is skipped); its file, <dir>/<job>.uid<uid>.safetensors (the
// name escaped; job names are per uid, so two uids' jobs of one name must not share a file), is replaced each time,
// in step order, and belongs to the job's uid. Copies wait in memory for their writer: two snapshots' worth of the
// job's master weights and moments at most, while the disk is slower than training.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "daemon/engine/step_engine.h"
#include "daemon/snapshot/snapshot_capture.h"
#include "daemon/snapshot/snapshot_writer.h"

namespace trainstream::daemon {

struct SnapshotSchedule {
  std::string dir;     // where periodic snapshots go, and requested ones without a path; empty: none
  uint64_t every = 0;  // steps between periodic snapshots; 0: none
};

// What a snapshot needs of the job besides its state: how many ranks are attached, and a way to have
// the engine announce its buckets' committed state (StepEngine::AnnounceCommitted).
struct SnapshotHooks {
  std::function<size_t()> attached_ranks;
  std::function<void()> announce;
};

class JobSnapshots {
 public:
  // `identity`: the job's name, owner, seed and layout. `state` must outlive this.
  JobSnapshots(SnapshotMeta identity, const shm::StateView& state, const shm::JobLayout& layout,
               SnapshotSchedule schedule);
  ~JobSnapshots();  // Stop()
  JobSnapshots(const JobSnapshots&) = delete;
  JobSnapshots& operator=(const JobSnapshots&) = delete;

  void Connect(SnapshotHooks hooks);  // before the engine runs
  // Ends the snapshot being taken (its writer gives up) and waits for a periodic writer. Call before
  // the engine goes away; commits after it are ignored.
  void Stop();

  void OnCommit(const Commit& commit);  // the engine thread
  // Writes the job's state to `path` (empty: the schedule's dir) with the file permissions of
  // `caller_uid`. kUnavailable if another snapshot of the job is being written, or the job did not
  // reach its next step boundary by `deadline`; kFailedPrecondition if it holds no weights yet.
  SnapshotWritten Take(const std::string& path, uint32_t caller_uid, std::chrono::steady_clock::time_point deadline);
  [[nodiscard]] std::optional<SnapshotWritten> last();

  // <dir>/<job>.uid<uid>.safetensors, with every byte of the name outside [A-Za-z0-9_-] (and a leading
  // '.') written as %XX.
  static std::string PathIn(const std::string& dir, const std::string& job, uint32_t uid);

 private:
  // The periodic snapshot starts at the first commit of a step it is due at (requires mutex_).
  void MaybeStartPeriodic(const Commit& commit);
  void WritePeriodic(const std::shared_ptr<SnapshotCapture>& capture);
  // Waiting for copies: a job that stopped training is taken as it is.
  WaitPolicy TakeAsIsWhenIdle(SnapshotCapture& capture, std::optional<std::chrono::steady_clock::time_point> deadline);
  void Finish(const std::shared_ptr<SnapshotCapture>& capture, const std::optional<SnapshotWritten>& written);

  const SnapshotMeta identity_;
  const shm::StateView state_;
  const shm::JobLayout& layout_;
  const CommittedState committed_;
  const SnapshotSchedule schedule_;
  SnapshotHooks hooks_;

  std::mutex mutex_;                         // guards the fields below
  std::shared_ptr<SnapshotCapture> active_;  // the snapshot still copying buckets
  std::optional<SnapshotWritten> last_;
  uint64_t last_periodic_step_ = 0;
  uint32_t periodic_writers_ = 0;  // started, not finished: at most 2, one writing and one waiting
  bool stopped_ = false;
  std::thread periodic_;  // the latest periodic writer (it joins the one before it)
};

}  // namespace trainstream::daemon
