// One training job in the daemon: its layout, its state segment (master weights, moments, upload
// staging), the rank segments of attached ranks, and the engine that runs its steps.
//
// A job outlives its ranks: when every rank has detached (or died) the state stays until the job is
// dropped or its idle TTL expires, so a restarted training process re-attaches and resumes.
// Its segments belong to its uid, who may truncate them: the daemon maps them guarded
// (daemon/guard/client_segment.h), and a job whose memory was lost so is dropped (Lost()).
// Thread-safe: gRPC handler threads attach and detach concurrently.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "daemon/control/orphaned_jobs.h"
#include "daemon/counters/counters.h"
#include "daemon/engine/session_sink.h"
#include "daemon/engine/step_engine.h"
#include "daemon/engine/worker_pool.h"
#include "daemon/gpu/cuda_rank_transfer.h"
#include "daemon/guard/client_segment.h"
#include "daemon/peer/peer_allreduce.h"
#include "daemon/snapshot/job_snapshots.h"
#include "daemon/snapshot/snapshot_format.h"
#include "shm/job_layout.h"

namespace trainstream::daemon {

struct JobInfo {
  std::string name, key;
  uint32_t uid = 0;
  uint64_t params = 0, elements = 0, state_bytes = 0, rank_bytes = 0, completed_step = 0;
  uint32_t buckets = 0, world_size = 0, state_halves = 1;
  bool speculative_clipping = false;
  EngineStats engine;
  std::map<uint32_t, std::string> transports;  // by attached rank
  uint64_t steps = 0;                          // completed since this daemon took the job
  DurationHistogram::Reading update_seconds;
  int64_t last_update_unix_ms = 0, last_step_unix_ms = 0;
  uint64_t host_bytes = 0, pinned_bytes = 0;
  std::optional<SnapshotWritten> last_snapshot;
};

class Job {
 public:
  // Creates the job's state, or with `adopted`, takes over the state an earlier daemon left (its
  // layout must be `spec`'s; kFailedPrecondition if it holds torn buckets: one state half, killed
  // during an update; kFailedPrecondition, and its segments removed, if its owner truncated it), or
  // with `restored`, fills it from a snapshot (of `spec`'s layout). With
  // `trace_dir`, its engine's timeline goes there when the job ends (daemon/engine/step_trace.h).
  Job(std::string name, uint32_t uid, const shm::LayoutSpec& spec, uint64_t seed, WorkerPool& pool,
      const PeerConfig& peer_config = {}, const OrphanedJob* adopted = nullptr, const SnapshotFile* restored = nullptr,
      SnapshotSchedule snapshots = {}, const std::string& trace_dir = {});
  // Names this daemon's socket in the state, so that a daemon restarted on it can re-adopt the job.
  void StampSocket(uint64_t socket_hash);
  ~Job();  // stops the engine, then unlinks every segment of the job
  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;

  struct Attachment {
    std::string rank_segment;
    bool initialized = false;
    uint64_t completed_step = 0;  // the step the rank resumes from (StepEngine::Resume)
  };
  // Readies the job for the rank (StepEngine::Resume), maps a fresh rank segment and hands it to the
  // engine. kAlreadyExists if the rank is taken.
  // `transport` says how the rank moves its data ("cuda-client-copy on cuda:0 (...)"), for logs and Stats.
  Attachment Attach(uint32_t rank, std::shared_ptr<SessionSink> session, const std::string& transport = "host");
  void Detach(uint32_t rank);
  // cuda-ipc: opens the rank's exported GPU buffers and events; from then on the daemon copies its data.
  // On failure the rank keeps copying its data itself: the error says why, for the client's log.
  [[nodiscard]] std::optional<std::string> RegisterCudaIpc(uint32_t rank, const shm::CudaIpcExport& exported);
  // The rank's data moves through `transfer` (RegisterCudaIpc's work; tests hand in their own).
  void SetTransfer(uint32_t rank, std::shared_ptr<RankTransfer> transfer, const std::string& transport);
  void FailAll(const std::string& message) { engine_->FailAll(message); }
  // Why the job cannot go on, if so: its owner truncated one of its segments under the daemon
  // (StepEngine::Lost); every session has failed saying so, and the job must be dropped.
  [[nodiscard]] std::optional<std::string> Lost() { return engine_->Lost(); }
  // Closes the job to ranks: an Attach that found the job before the registry forgot it fails
  // (kAborted, naming `reason`) instead of running on a job nothing else can see. kFailedPrecondition
  // while ranks are attached, unless `force` (the caller then fails their sessions with FailAll).
  void Close(const std::string& reason, bool force);
  // Closes the job if no rank has been attached for `ttl`; returns whether it did.
  bool CloseIfIdle(std::chrono::steady_clock::duration ttl, const std::string& reason);
  // The registry forgets the job (dropped, expired, lost); it lives on until its last user lets go. A
  // multi-node job's all-reduce forgets the peers' fragments waiting for it and takes no more, so that
  // a new job of its name starts clean (PeerAllReduce::Dropped). Called under the registry's lock, so
  // no new job of the name opens before.
  void Dropped() {
    if (peers_) peers_->Dropped();
  }

  [[nodiscard]] const std::string& name() const { return name_; }
  [[nodiscard]] const std::string& key() const { return key_; }
  [[nodiscard]] uint32_t uid() const { return uid_; }
  [[nodiscard]] const shm::LayoutSpec& spec() const { return spec_; }
  [[nodiscard]] const shm::JobLayout& layout() const { return layout_; }
  [[nodiscard]] const std::string& state_segment_name() const { return state_.name(); }
  [[nodiscard]] uint64_t host_bytes();  // state + attached rank segments
  [[nodiscard]] size_t attached_ranks();
  JobInfo Info();
  [[nodiscard]] shm::StateView ViewState() const;  // the state segment as this daemon maps it
  // Writes the job's state to `path` (daemon/snapshot/job_snapshots.h) with the file permissions of
  // `caller_uid`.
  SnapshotWritten Snapshot(const std::string& path, uint32_t caller_uid,
                           std::chrono::steady_clock::time_point deadline);

 private:
  std::string RankSegmentName(uint32_t rank) const;
  void Rename(uint32_t rank, const std::string& transport);  // in the transports shown by Stats
  void OnCommit(const Commit& commit);                       // the engine thread
  [[nodiscard]] uint64_t PinnedBytes();
  [[nodiscard]] std::vector<shm::Segment::Range> LeftToFirstTouch(size_t numa_nodes) const;

  const std::string name_;
  const uint32_t uid_;
  const shm::LayoutSpec spec_;
  const shm::JobLayout layout_;
  const std::string key_;
  ClientSegment state_;
  std::unique_ptr<PeerAllReduce> peers_;  // multi-node jobs only; outlives the engine that uses it
  const bool fresh_;                      // its state was created empty (not adopted, not restored)
  double backed_seconds_ = 0;             // creating (backing) the state segment: most of a new job's attach
  JobCounters counters_;
  std::unique_ptr<JobSnapshots> snapshots_;  // fed by the engine's commits; stopped before it
  std::unique_ptr<StepEngine> engine_;

  std::mutex mutex_;  // guards the fields below
  size_t attached_ = 0;
  std::map<uint32_t, std::string> transports_;                      // by attached rank
  std::map<uint32_t, std::pair<const void*, size_t>> rank_memory_;  // by attached rank: its segment's mapping
  std::chrono::steady_clock::time_point idle_since_;
  std::optional<std::string> closed_;  // why, once Close ran
};

}  // namespace trainstream::daemon
