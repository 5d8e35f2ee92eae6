// The per-job step pipeline (docs/architecture.md, "Step protocol"): the orchestration, on the engine
// thread (StepEngine, step_engine.h, runs that thread and hands it each message and each finished pass).
// StepProtocol owns one BucketLifecycle per bucket and the concern objects, tells each of the events
// that concern it and acts on what it decides: which messages are allowed (ring_checks.h), what becomes
// of a bucket (bucket_lifecycle.h), clipping and speculation (step_gates.h), accumulation
// (micro_batches.h), a cuda-ipc rank's copies (gpu_copies.h) and the pushes that carry them out
// (weight_pushes.h), resume (resume_plan.h), an update's plan and pieces (bucket_update.h), one block of
// a pass (pass_work.h), the ranks (rank_table.h) and what comes back from the workers (engine_mailbox.h).
// None of them calls back into the engine but WeightPushes, which says when no push reads a bucket.
//
// One engine thread per job waits on the job's doorbell, drains every attached rank's request ring,
// validates each message, and tracks per bucket which ranks have delivered which micro-batch. When all
// `world_size` ranks have delivered a bucket it schedules the bucket's element passes
// (daemon/engine/bucket_passes.h) on the worker pool:
//   not the last micro-batch -> accumulate into the fp32 accumulator, then SLOT_FREE to every rank;
//   the last micro-batch     -> fused AdamW update from the bucket's committed state half into the other,
//                               then the commit (one store of its BucketState) and PARAMS_READY to every
//                               rank, once the step's decision (StepGate) says how it ends.
// The decision comes from the step's terms: the job's options (a fixed micro-batch count, max_grad_norm),
// or, with LayoutSpec::step_terms, what every rank's optimizer.step() said (kStepTerms: how many
// micro-batches, clipping, the loss scale a GradScaler's unscale_ took off), and the global gradient norm
// where the terms need it. Updates do not wait for it where they need not: they run with the multiplier
// the steps before had (speculating, where the job has two halves: the committed half stays as it was),
// and once the decision is in each bucket commits what it wrote or is redone from the committed half
// with the decided multiplier. Where a norm is needed and the update cannot be taken back (one
// state half), the norm comes first and the updates wait for the decision, then run in forward order;
// after a run of clipped steps the next steps wait for the norm until one does not clip (StepGates).
// A job that counts its micro-batches (accumulation_steps 0) learns a step's count from its terms, or
// earlier from kMoreMicro (another backward pass follows). Each rank's GRAD_READY says what it expects
// (kFinalMicro, or kUncertainMicro: held until known); an update started on a micro-batch that turns
// out not to be the last is taken back (two halves) and its gradients accumulated. kDiscard (zero_grad()
// mid-step) drops a step's gradients, one rank only.
// Worker completions come back to the engine thread through a queue plus the same doorbell, so all
// protocol state below is touched by the engine thread only; the rank table's mutex guards it against
// attach/detach from gRPC threads.
//
// Each bucket advances through steps on its own: a fast rank may deliver bucket b of step t+1 while
// bucket c of step t is still updating. But no bucket's update of step s starts before every bucket
// has committed s-1, so the buckets' committed steps are at most one apart: the half a bucket's update
// of s read keeps s-1 until its update of s+1, which only starts once the job completed s, so a bucket
// one step ahead of the job can always be rolled back (Resume). The trainer's protocol keeps them that
// close anyway (its forward of s+1 waits for every bucket's weights of s); the engine does not rely on it.
//
// cuda-ipc ranks (a RankTransfer): their GRAD_READY first copies the staging slot into the rank's
// gradient slot (then STAGING_FREE), and their PARAMS_READY follows a push of the bucket's weights to
// the GPU, once the rank asked for that step's weights (kWeightsWanted, sent by optimizer.step()). A
// bucket is never updated while a push reads it, nor pushed while it updates, except for the pieces
// of its update already written. A bucket larger than a staging slot (a GPT's tied embedding: the
// last gradient of backward, the first weights of forward) is updated in pieces of about a slot, in
// order: with one rank, two halves and no norm to wait for, its update starts with its first piece of
// gradients, each piece as soon as the gradients it reads are in, and each written piece goes to the
// GPUs that asked for the step at once. A speculated bucket is pushed before its step's norm is known;
// written or speculated weights reach the GPU before the commit, PARAMS_READY waits for it, and a redo
// pushes again. A rank that leaves before the rest of a bucket's gradients came drops what its update
// wrote (the other half), as a discarded speculation.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "daemon/engine/all_reduce.h"
#include "daemon/engine/bucket_lifecycle.h"
#include "daemon/engine/bucket_passes.h"
#include "daemon/engine/engine_mailbox.h"
#include "daemon/engine/micro_batches.h"
#include "daemon/engine/pass_scheduler.h"
#include "daemon/engine/rank_channel.h"
#include "daemon/engine/rank_table.h"
#include "daemon/engine/step_gates.h"
#include "daemon/engine/step_trace.h"
#include "daemon/engine/weight_pushes.h"
#include "daemon/engine/worker_pool.h"
#include "shm/job_layout.h"

namespace trainstream::daemon {

// A bucket's state (master weights, moments, its parameters' step counts) has committed `step`: it
// stays as it is until the bucket's next update starts. The engine tells its job on the engine thread,
// so what the job does then (a snapshot copies the bucket) delays that thread's next work.
struct Commit {
  uint32_t bucket = 0;
  uint64_t step = 0;
  bool step_completed = false;            // every bucket has now committed `step`
  bool loaded = false;                    // a state load (LOAD_STATE) set it, not an update
  bool announced = false;                 // AnnounceCommitted's replay of a commit made earlier
  double update_seconds = 0;              // how long the update pass took (0 unless an update committed)
  const shm::HParams* hparams = nullptr;  // [num_groups] in force for `step`; nullptr: no rank attached
};
using CommitObserver = std::function<void(const Commit&)>;

struct EngineStats {
  uint64_t updates = 0;            // bucket updates committed
  uint64_t nonfinite_steps = 0;    // steps whose gradient norm was inf/NaN
  uint64_t speculative_steps = 0;  // steps whose updates started before their decision needed the norm
  uint64_t redone_steps = 0;       // of those, the ones the decision made redo or take back
  uint64_t accumulator_bytes = 0;  // the job's daemon-private gradient accumulator, once it has one
  std::vector<uint32_t> attached_ranks;
};

// Everything but Counted runs on the engine thread, or on another holding the rank table's mutex (a rank
// attaching or leaving): the protocol's state has no lock of its own.
class StepProtocol {
 public:
  // See StepEngine's constructor. `ranks` and `mailbox` are the engine's: they outlive the protocol.
  StepProtocol(std::string job_name, const shm::LayoutSpec& spec, const shm::JobLayout& layout, shm::StateView state,
               uint64_t seed, WorkerPool& pool, AllReduce* peers, bool adopted, CommitObserver on_commit,
               std::unique_ptr<StepTrace> trace, RankTable& ranks, EngineMailbox& mailbox);
  StepProtocol(const StepProtocol&) = delete;
  StepProtocol& operator=(const StepProtocol&) = delete;

  // One message of a rank's request ring; throws Error for a message the rank may not send (the engine
  // fails that rank).
  void Handle(RankChannel& channel, const shm::Message& message);
  // `reply` gets the step the job resumes from once no pass, push or load is in flight (StepEngine::Resume).
  void WhenSettled(std::function<void(uint64_t)> reply);
  // Replies to WhenSettled calls if the job has settled; the engine asks after each round of continuations.
  void RunResumes();
  // A rank detached: where the others were mid-step, that step's gradients are discarded and every
  // session fails (each rank resumes from the job's completed step).
  void ResetCollecting(const std::string& reason);
  // The rank's transfer was just set: it hears what host memory its copies touch, once the seed is written.
  void TransferSet(RankChannel& channel);
  // Tells on_commit again of the committed state of every bucket no update or load is changing now.
  void AnnounceCommitted();
  // The state's first touch (StepEngine::PlaceState).
  void PlaceState();
  // The counters; thread-safe (attached_ranks is left empty: the engine fills it in).
  [[nodiscard]] EngineStats Counted() const;

 private:
  using Phase = BucketLifecycle::Phase;
  using Pass = BucketLifecycle::Pass;
  using Last = MicroBatches::Last;

  void OnGradReady(RankChannel& channel, const shm::Message& message);
  void Deliver(RankChannel& channel, uint32_t bucket);
  void PullThenDeliver(const std::shared_ptr<RankChannel>& channel, uint32_t bucket, uint32_t slot, uint32_t piece);
  // Whether a new job's seed is written (its first LOAD_STATE runs or ran): a transfer is told what its
  // copies touch only then, since page-locking beside the seed's copy slowed that copy threefold on an H100
  // (0.39-0.47 s against 0.14 s for 7 GiB; benchmarks/results/train_gpt.md, 2026-12-06). loading_ changes
  // only in messages and continuations, which run holding the rank table's mutex.
  [[nodiscard]] bool PastTheSeed() const { return state_.header->initialized != 0 || loading_; }
  void OnLoadState(RankChannel& channel, const shm::Message& message);
  // The bytes of the pieces an update of the bucket splits into: the smallest staging slot of the
  // cuda-ipc ranks (SplitIntoPieces), or the bucket's size without such ranks.
  [[nodiscard]] uint64_t PieceBytes(uint32_t bucket) const;
  void OnPieceWritten(uint32_t bucket, uint32_t piece);
  // Gives the pool the pieces of the bucket's running update whose gradients are in.
  void ScheduleReadyPieces(uint32_t bucket);
  // One rank, two state halves, the step's last micro-batch, no norm to wait for: the bucket's update
  // may start with its first piece of gradients (the others follow while it runs).
  [[nodiscard]] bool StreamsGradients(uint32_t bucket);
  void OnBucketDelivered(uint32_t bucket);
  void OnStepTerms(RankChannel& channel, const shm::Message& message);
  void OnMoreMicro(RankChannel& channel, const shm::Message& message);
  void OnDiscard(RankChannel& channel, const shm::Message& message);
  void Hold(uint32_t bucket);
  [[nodiscard]] bool HoldAccumulated(uint32_t bucket);
  void StartAccumulate(uint32_t bucket);
  void StartReduce(uint32_t bucket);
  void AccumulateSlots(uint32_t bucket, std::function<void()> then);
  // The accumulator of the bucket's step (nullptr: no micro-batch before the last).
  [[nodiscard]] float* AccumulatorOf(uint32_t bucket);
  // The ranks whose slots the bucket's last pass reads: none where its gradients are all in the accumulator.
  [[nodiscard]] Sources FinalSlots(uint32_t bucket);
  void AfterGradients(uint32_t bucket);
  // An update that runs without a decision can be taken back: the committed half stays as it was, and the
  // gradients it read are still there (two halves, gradients not in the upload copy).
  [[nodiscard]] bool Revocable(uint32_t bucket) const;
  void RestartBucket(uint32_t bucket);
  void Abandon(uint32_t bucket);
  Sources GradientSlots();
  void StartNorm(uint32_t bucket);
  // `pass`: kUpdate (the step's decision is in), kSpeculate (before it) or kRedo. `multiplier`: of the
  // averaged gradients.
  void StartUpdate(uint32_t bucket, float multiplier, Pass pass);
  void StartPendingUpdates();
  void OnNormed(uint32_t bucket, double sum_of_squares, bool nonfinite);
  void OnSpeculated(uint32_t bucket, double sum_of_squares, bool nonfinite);
  // Norm passes for the buckets of `step` whose last gradients are in and not yet counted.
  void StartMissingNorms(uint64_t step);
  // Sends the step's norm where asked and, once the step is decided, ends each bucket waiting for it.
  void MaybeDecide(uint64_t step);
  void Count(uint64_t step, const StepGate& gate, const StepDecision& decision);
  // Bucket b, whose last gradients of the decided step are in, goes on as the decision says.
  void Settle(uint32_t bucket, const StepDecision& decision);
  // The update written before the decision is void: its weights are forgotten (upload rewritten later).
  void TakeBack(uint32_t bucket);
  // Not the last micro-batch after all: what bucket b holds of it is accumulated, and it collects the next.
  void Revoke(uint32_t bucket);
  // An update ran in place before a decision that says otherwise (one state half): no rank may go on.
  void Diverge(const std::string& why);
  // kDiscarded to the ranks once no pass of the discarded step runs.
  void MaybeFinishDiscard();
  void OnUpdated(uint32_t bucket, uint64_t step, uint32_t half, bool nonfinite);
  void CommitBucket(uint32_t bucket, uint64_t step, uint32_t half);
  void NotifyCommit(Commit commit);  // fills in the hyperparameters
  // A pass of a step a rank abandoned ended: the bucket collects that step again. Returns whether it was.
  bool Discarded(uint32_t bucket);
  // One half, after Resume: bucket b committed the step it collects; its replayed gradients are not applied.
  void SkipReplayedStep(uint32_t bucket);
  void AdvanceCompleted();
  [[nodiscard]] uint64_t CompletedStep() const;           // the lowest committed step of any bucket
  [[nodiscard]] uint32_t OtherHalf(uint32_t half) const;  // the half an update of a bucket in `half` writes
  [[nodiscard]] bool Settled() const;                     // no pass, push or load in flight
  void ResumeNow(std::function<void(uint64_t)> reply);
  // Counts `step` once among the non-finite steps and tells every rank why.
  void ReportNonFinite(uint64_t step, const std::string& what);
  const shm::HParams* HParamsFor(uint64_t step);
  Sources SnapshotSources();
  void UploadCommitted(uint32_t bucket, std::function<void()> done);

  const std::string job_name_;
  const shm::LayoutSpec spec_;
  const shm::JobLayout layout_;
  const shm::StateView state_;
  const BucketPasses passes_;  // over layout_ and state_
  const uint64_t seed_;
  AllReduce* const peers_;
  const CommitObserver on_commit_;
  const std::unique_ptr<StepTrace> trace_;  // nullptr: not tracing; written once the engine has stopped
  RankTable& ranks_;
  EngineMailbox& mailbox_;  // continuations from worker threads, and the work in flight

  std::vector<BucketLifecycle> buckets_;
  std::vector<uint8_t> had_grad_;  // per parameter, for the step its bucket is collecting
  StepGates gates_;
  MicroBatches micro_;
  std::vector<std::function<void(uint64_t)>> resumes_;  // WhenSettled replies waiting for the job to settle
  bool adopted_;                                        // until the first Resume
  uint64_t completed_ = 0;                              // CompletedStep(), as the header has it
  bool loading_ = false;
  PassScheduler scheduler_;
  WeightPushes pushes_;

  std::atomic<uint64_t> updates_{0};
  std::atomic<uint64_t> nonfinite_steps_{0};
  std::atomic<uint64_t> speculative_steps_{0};
  std::atomic<uint64_t> redone_steps_{0};
  std::atomic<uint64_t> accumulator_bytes_{0};
  uint64_t last_nonfinite_step_ = 0;
};

}  // namespace trainstream::daemon
