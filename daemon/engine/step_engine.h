// The per-job step pipeline (docs/architecture.md, "Step protocol").
//
// One engine thread per job waits on the job's doorbell, drains every attached rank's request ring,
// validates each message, and tracks per bucket which ranks have delivered which micro-batch. When all
// `world_size` ranks have delivered a bucket it schedules the bucket's element passes
// (daemon/engine/bucket_passes.h) on the worker pool:
//   micro-batch < k-1   -> accumulate into the fp32 accumulator, then SLOT_FREE to every rank;
//   last micro-batch    -> (clipping: squared norm first; updates wait for every bucket's norm and then
//                          run in forward order) fused AdamW update, then PARAMS_READY to every rank.
// Worker completions come back to the engine thread through a queue plus the same doorbell, so all
// protocol state below is touched by the engine thread only; `mutex_` guards the rank table against
// attach/detach from gRPC threads.
//
// Each bucket advances through steps on its own: a fast rank may deliver bucket b of step t+1 while
// bucket c of step t is still updating.
//
// cuda-ipc ranks (a RankTransfer): their GRAD_READY first copies the staging slot into the rank's
// gradient slot (then STAGING_FREE), and their PARAMS_READY follows a push of the bucket's weights to
// the GPU, once the rank asked for that step's weights (kWeightsWanted, sent by optimizer.step()). A
// bucket is never updated while a push reads it, nor pushed while it updates.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "daemon/engine/all_reduce.h"
#include "daemon/engine/bucket_passes.h"
#include "daemon/engine/rank_channel.h"
#include "daemon/engine/worker_pool.h"
#include "shm/job_layout.h"

namespace trainstream::daemon {

struct EngineStats {
  uint64_t updates = 0;          // bucket updates completed
  uint64_t nonfinite_steps = 0;  // steps whose gradient norm was inf/NaN
  std::vector<uint32_t> attached_ranks;
};

class StepEngine {
 public:
  // `peers` sums the gradients over the daemons of a multi-node job (nullptr for one node).
  StepEngine(std::string job_name, const shm::LayoutSpec& spec, const shm::JobLayout& layout, shm::StateView state,
             uint64_t seed, WorkerPool& pool, AllReduce* peers = nullptr);
  ~StepEngine();  // stops the thread and waits for in-flight work
  StepEngine(const StepEngine&) = delete;
  StepEngine& operator=(const StepEngine&) = delete;

  // Thread-safe. AddRank fails (kAlreadyExists) if the rank is attached.
  // First touch, with several NUMA nodes: the state's pages are faulted in by the threads that will
  // update them (the job leaves them unreserved for this: shm::Segment::Create). Call before the
  // first rank attaches (no client may have written the state yet); later calls return at once.
  // Takes a while for a large job: never call it under a shared lock.
  void PlaceState();
  void AddRank(std::shared_ptr<RankChannel> channel);
  // The rank's data moves through `transfer` from now on (before it sends any message).
  void SetTransfer(uint32_t rank, std::shared_ptr<RankTransfer> transfer);
  void RemoveRank(uint32_t rank);
  [[nodiscard]] bool HasRank(uint32_t rank);
  // Why no rank may attach any more, if so: a failed all-reduce between daemons may have left the
  // nodes with different weights (some applied buckets of the step that others did not).
  [[nodiscard]] std::optional<std::string> Diverged();
  EngineStats Stats();
  // Fails every attached session (daemon shutdown, job dropped).
  void FailAll(const std::string& message);

 private:
  enum class Phase { kCollecting, kBusy, kAwaitingClip };
  struct BucketProgress {
    uint64_t step = 1;  // the step being collected
    uint32_t micro = 0;
    std::vector<uint8_t> delivered;  // per rank, for (step, micro)
    uint32_t delivered_count = 0;
    Phase phase = Phase::kCollecting;
    double sum_of_squares = 0;
    bool nonfinite = false;
    bool updating = false;                     // the update pass runs: master and upload change
    uint32_t pushes = 0;                       // pushes to GPUs in flight: master and upload are read
    std::optional<float> update_after_pushes;  // the clip coefficient of an update waiting for them
  };
  struct ClipGate {  // per step, with clipping: buckets whose norm is known
    uint32_t normed = 0;
    double sum_of_squares = 0;
    bool nonfinite = false;
  };

  void Loop();
  bool DrainRequests();
  bool DrainFinished();
  void Handle(RankChannel& channel, const shm::Message& message);
  void OnGradReady(RankChannel& channel, const shm::Message& message);
  void Deliver(RankChannel& channel, uint32_t bucket);
  void PullThenDeliver(const std::shared_ptr<RankChannel>& channel, uint32_t bucket, uint32_t slot, uint32_t piece);
  [[nodiscard]] uint32_t PiecesOf(uint32_t bucket, const RankTransfer& transfer) const;  // staged piece by piece
  void OnLoadState(RankChannel& channel, const shm::Message& message);
  void OnWeightsWanted(const std::shared_ptr<RankChannel>& channel, const shm::Message& message);
  // The weights of `bucket` after `step` are final: PARAMS_READY, after a push for cuda-ipc ranks.
  void PublishWeights(uint32_t bucket, uint64_t step);
  void MaybePush(const std::shared_ptr<RankChannel>& channel, uint32_t bucket);
  void OnPushed(const std::shared_ptr<RankChannel>& channel, uint32_t bucket, uint64_t step, uint64_t generation,
                const std::optional<Error>& error);
  [[nodiscard]] bool Attached(const std::shared_ptr<RankChannel>& channel) const;
  void PostTo(RankChannel& channel, const shm::Message& message);
  void FailRank(RankChannel& channel, const std::string& message);
  void OnBucketDelivered(uint32_t bucket);
  void StartAccumulate(uint32_t bucket);
  void StartReduce(uint32_t bucket);
  void AccumulateSlots(uint32_t bucket, std::function<void()> then);
  void AfterGradients(uint32_t bucket);
  void Continue(std::function<void()> continuation);
  void FailSessions(const std::string& message);  // requires mutex_
  void RestartBucket(uint32_t bucket);
  Sources GradientSlots();
  void StartNorm(uint32_t bucket);
  void StartUpdate(uint32_t bucket, float clip_coefficient);
  void OnNormed(uint32_t bucket, double sum_of_squares, bool nonfinite);
  void OnUpdated(uint32_t bucket, uint64_t step, uint32_t half, bool nonfinite);
  [[nodiscard]] uint32_t OtherHalf(uint32_t half) const;  // the half an update of a bucket in `half` writes
  // Counts `step` once among the non-finite steps and tells every rank why.
  void ReportNonFinite(uint64_t step, const std::string& what);
  void PostToAll(const shm::Message& message);
  void ResetCollecting(const std::string& reason);
  const shm::HParams* HParamsFor(uint64_t step);
  Sources SnapshotSources();
  void TouchState();
  template <typename Include>
  std::shared_ptr<std::vector<Block>> BlocksOf(uint32_t bucket, Include include) const;
  WorkerPool::Home HomesOf(std::shared_ptr<std::vector<Block>> blocks) const;
  // Runs `work` on the pool for every block of `bucket`'s params selected by `include`; `done` runs on
  // the engine thread afterwards.
  template <typename Work, typename Include>
  void Schedule(uint32_t bucket, int64_t priority, Include include, Work work, std::function<void()> done);

  const std::string job_name_;
  const shm::LayoutSpec spec_;
  const shm::JobLayout layout_;
  const shm::StateView state_;
  const BucketPasses passes_;  // over layout_ and state_
  const uint64_t seed_;
  WorkerPool& pool_;
  AllReduce* const peers_;

  std::once_flag placed_;
  std::mutex mutex_;                                 // guards ranks_ and diverged_
  std::vector<std::shared_ptr<RankChannel>> ranks_;  // by rank; nullptr when not attached
  std::optional<std::string> diverged_;

  // Engine-thread state.
  std::vector<BucketProgress> buckets_;
  std::vector<uint8_t> had_grad_;  // per parameter, for the step its bucket is collecting
  std::map<uint64_t, ClipGate> clip_gates_;
  std::map<uint64_t, uint32_t> updated_;  // per step: buckets updated
  bool loading_ = false;
  int64_t loaded_by_ = -1;  // the rank whose LOAD_STATE was the last one to complete
  uint64_t loaded_step_ = 0;

  std::mutex finished_mutex_;
  std::vector<std::function<void()>> finished_;  // continuations from worker threads

  std::atomic<uint64_t> updates_{0};
  std::atomic<uint64_t> nonfinite_steps_{0};
  uint64_t last_nonfinite_step_ = 0;  // engine thread
  std::atomic<int64_t> inflight_{0};
  std::mutex inflight_mutex_;
  std::condition_variable inflight_zero_;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace trainstream::daemon
