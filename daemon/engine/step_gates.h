// Clipping and speculation: the gates (daemon/engine/step_gate.h) of a job's steps in flight, what the
// next step's updates assume from the steps decided before, and what a bucket does once its last
// gradients are in and once its step is decided. The engine tells it of events (a step's gate wanted,
// a step decided, a step dropped) and acts on what it returns.
//
// A step whose updates need the norm speculates (updates before its decision, where an update can be
// taken back) unless the last kClippedRunToWait steps all clipped. A clipped step's redo starts only
// after the whole speculative pass (a bucket's norm is known when its update ends), so in a run of
// clipped steps each step pays a second update pass on top of what waiting for the norm costs; an
// isolated clipped step still speculates, as most steps after it do not clip (the 124M GPT on structured
// data, one H200: 10 of 220 steps redone, 54.9 ms a step against 59.7 ms waiting for the norm).
//
// Invariants: a step has one gate from the first bucket that needs it until the job completes the step
// (EraseThrough) or drops it (Erase, Clear); what a gate assumes is fixed when it is made.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>

#include "daemon/engine/bucket_update.h"
#include "daemon/engine/step_gate.h"

namespace trainstream::daemon {

class StepGates {
 public:
  // What a bucket whose last gradients of the step are in runs next.
  enum class Next {
    kUpdate,     // the step is decided: the update as decided
    kNorm,       // the norm first: it is needed, and an update could not be taken back or the step waits
    kSpeculate,  // the update now, with the multiplier the steps before had
  };
  // How a bucket whose last gradients are in ends once its step is decided.
  enum class Settlement {
    kUpdate,   // nothing written yet (held, or its norm taken first): the update as decided
    kCommit,   // what it wrote is what the decision says (or it only carried its state across)
    kRedo,     // written with another multiplier: redone from the committed half
    kDiverge,  // written in place with another multiplier: no rank may go on
  };
  static constexpr uint32_t kClippedRunToWait = 3;  // clipped steps in a row after which steps wait

  // `speculative_clipping`: the layout allows it (two halves). A job without step terms has its options'
  // (`accumulation_steps`, `max_grad_norm`).
  StepGates(size_t buckets, uint32_t ranks, bool speculative_clipping, bool step_terms, uint32_t accumulation_steps,
            double max_grad_norm);

  // The gate of `step`, made (and what its updates assume decided) by the first that needs it.
  StepGate& Of(uint64_t step);
  [[nodiscard]] StepGate* Find(uint64_t step);
  void Erase(uint64_t step) { gates_.erase(step); }
  void EraseThrough(uint64_t completed) { gates_.erase(gates_.begin(), gates_.upper_bound(completed)); }
  void Clear() { gates_.clear(); }
  // `gate`'s step was decided: what the next steps' updates assume.
  void Decided(const StepGate& gate, const StepDecision& decision);

  // `revocable`: an update of the bucket can be taken back (two halves, gradients not in the upload copy).
  [[nodiscard]] static Next AfterGradients(const StepGate& gate, bool revocable);
  // `plan`: the update the bucket wrote before the decision (nullptr: none).
  [[nodiscard]] static Settlement Settle(const UpdatePlan* plan, const StepDecision& decision, bool revocable);
  // With one rank and two halves: the bucket's update may start with its first piece of gradients.
  [[nodiscard]] static bool MayStream(const StepGate& gate) {
    return gate.Decided() || !gate.NormsNeeded() || gate.speculative();
  }
  // The step's norm goes to the ranks now (once every bucket's is in, where their terms asked for it).
  [[nodiscard]] static bool SendNorm(StepGate& gate) {
    return gate.NormsComplete() && (gate.terms().norm_wanted || gate.terms().max_norm > 0) && gate.MarkNormSent();
  }

 private:
  const size_t buckets_;
  const uint32_t ranks_;
  const bool speculative_clipping_;
  const bool step_terms_;
  const uint32_t accumulation_steps_;
  const double max_grad_norm_;
  std::map<uint64_t, StepGate> gates_;
  uint32_t clipped_run_ = 0;  // the steps decided last that clipped, in a row
  // What the steps before said, which the next step's updates assume until its own terms are in.
  float last_factor_ = 1.0f;
  bool last_needed_norms_ = false;
};

}  // namespace trainstream::daemon
