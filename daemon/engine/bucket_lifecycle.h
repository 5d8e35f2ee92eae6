// One bucket's way through its steps, as the engine thread sees it: what it collects (step, micro-batch,
// which ranks delivered), which pass runs on it, what waits, and what its update wrote. The engine owns
// one per bucket and changes it only through the named transitions below; the concern objects
// (daemon/engine/gpu_copies.h, step_gates.h, micro_batches.h, resume_plan.h) read it and return decisions.
//
//   kCollecting --all ranks delivered--> kBusy (accumulate | reduce | norm | speculate | update | redo)
//   kCollecting --last micro-batch not known (kUncertainMicro)--> kAwaitingDecision (Hold: held)
//   kBusy --accumulate ends--> kCollecting (the next micro-batch, EndAccumulate)
//   kBusy --norm or speculation ends--> kAwaitingDecision (AwaitDecision) --decided--> kBusy or committed
//   kBusy --update ends--> committed: kCollecting of the next step (Committed)
//   any --a rank left, a discard--> kCollecting of the same step (Restart), at once or when its pass ends
//   kCollecting --resume rewrite, state load--> kBusy (upload) --> kCollecting (Idle)
//
// Invariants: a kCollecting bucket runs no pass (pass kNone) and holds no pending update; `pending` is
// set only on a kBusy bucket whose update waits (for pushes, or the skew bound); `plan` is set from the
// start of an update until its commit or its take-back, and `updating` while that update's weights are
// not committed; `delivered_count` is the number of ranks set in `delivered`; `pushes` counts the
// copies to GPUs reading the bucket's weights, which no update may overwrite meanwhile.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "daemon/engine/bucket_update.h"

namespace trainstream::daemon {

class BucketLifecycle {
 public:
  // kAwaitingDecision: the bucket's last gradients of the step are in (held, normed, or updated before
  // the decision) and it waits for its step's decision.
  enum class Phase { kCollecting, kBusy, kAwaitingDecision };
  // What a busy bucket's pass is. A rank that leaves mid-step discards the passes of a step that can no
  // longer complete (OnRankLeft): accumulation, norm and speculation; the rest have all their
  // gradients and commit. kSpeculate: an update before the step's decision.
  enum class Pass { kNone, kAccumulate, kReduce, kNorm, kSpeculate, kUpdate, kRedo, kUpload };
  // What becomes of the bucket when its step is dropped (a rank left, a discard), for the engine to do.
  enum class Drop {
    kNone,         // nothing of the step in it
    kRestart,      // it collects the step again from scratch
    kCommitAsRan,  // updated in place before the decision: it commits as it ran
    kAbandon,      // its written update (if any) is dropped, and it collects the step again
    kDropPending,  // its update waits and never starts: dropped, then kAbandon
    kAtPassEnd,    // its pass runs on: it is abandoned when the pass ends (TakeDiscard)
    kFinishes,     // its pass has every gradient it needs: it commits
    kDiverge,      // updated in place before a discard: the job cannot go on
  };
  struct Dropped {
    Drop drop = Drop::kNone;
    bool discards = false;  // the ranks lose gradients of a step they sent (their sessions must restart)
  };

  BucketLifecycle(uint64_t step, uint32_t ranks) : step(step), delivered(ranks, 0) {}

  // Transitions.
  void Restart();                             // collects `step` from scratch
  [[nodiscard]] bool Deliver(uint32_t rank);  // rank delivered the micro-batch; returns whether all have
  void Begin(Pass next);                      // kBusy with `next`
  void AwaitDecision();                       // its pass ended; the step's decision is not in
  void Hold();                                // its last gradients may not be its last: held until known
  void Idle();                                // kCollecting, no pass (an upload ended, a state load)
  uint32_t EndAccumulate();                   // collects the next micro-batch; returns the one accumulated
  void HoldBack(float multiplier, Pass pass) { pending = {multiplier, pass}; }
  void StartUpdate(std::shared_ptr<RunningUpdate> running);  // its update's pieces are being given out
  // Its written update is void (taken back or abandoned); `rewrite_upload`: the upload region may hold
  // what it wrote.
  void Forget(bool rewrite_upload);
  void Committed(uint64_t step_committed);  // collects the step after
  bool TakeDiscard();                       // its pass ended for a dropped step: whether it was

  // Decisions.
  // A rank left mid-step. `revocable`: an update of it can be taken back (two halves); `bytes`: the
  // bucket's size; `completed`: the job's completed step.
  [[nodiscard]] Dropped OnRankLeft(bool revocable, uint64_t bytes, uint64_t completed) const;
  // zero_grad() mid-step (kDiscard).
  [[nodiscard]] Drop OnDiscard(bool revocable) const;

  // Questions.
  [[nodiscard]] bool Settled() const { return phase != Phase::kBusy && pushes == 0; }
  [[nodiscard]] bool MidStep() const { return delivered_count > 0 || micro > 0; }
  // Micro-batches of its step it has, counting the one it collects if any rank delivered it.
  [[nodiscard]] uint32_t MicrosSeen() const;
  // A speculated update is written, waiting for the step's norm.
  [[nodiscard]] bool Speculated() const { return phase == Phase::kAwaitingDecision && plan != nullptr && !discard; }
  // Its running update (not held back, not discarded) or its speculated one may go to the GPUs before
  // the commit, as far as it is written.
  [[nodiscard]] bool Writing() const;
  // Of its `bytes` of gradients, those in (all, unless its update started with the first piece).
  [[nodiscard]] uint64_t GradientBytesIn(uint64_t bytes) const { return streaming ? grad_bytes : bytes; }

  uint64_t step = 1;  // the step being collected
  uint32_t micro = 0;
  uint16_t flags = 0;        // the GRAD_READY flags of the micro-batch collected (what its ranks expect)
  bool accumulated = false;  // the accumulator holds the step's micro-batches before `micro`
  bool held = false;         // its last gradients are in, not yet known to be the last (kAwaitingDecision)
  bool from_accum = false;   // the step's last micro-batch had no gradients left: the update reads the accumulator
  bool take_back = false;    // not the last micro-batch after all: when its pass ends, accumulate instead
  std::vector<uint8_t> delivered;  // per rank, for (step, micro)
  uint32_t delivered_count = 0;
  Phase phase = Phase::kCollecting;
  Pass pass = Pass::kNone;
  bool discard = false;                           // its pass runs for a step a rank abandoned: restart when it ends
  bool updating = false;                          // an update wrote master and upload and has not committed: not pushed
  bool upload_dirty = false;                      // the upload region may hold weights of an uncommitted step
  uint32_t pushes = 0;                            // pushes to GPUs in flight: master and upload are read
  std::optional<std::pair<float, Pass>> pending;  // an update waiting for pushes or the skew bound
  std::shared_ptr<UpdatePlan> plan;               // the update written before the decision, for its redo
  std::chrono::steady_clock::time_point update_started;
  std::shared_ptr<RunningUpdate> update;  // the update started last (its pieces outlive its work)
  // Delivered with its first piece of gradients (StepProtocol::StreamsGradients): the rest are still
  // coming, and `grad_bytes` of them are in.
  bool streaming = false;
  uint64_t grad_bytes = 0;
};

}  // namespace trainstream::daemon
