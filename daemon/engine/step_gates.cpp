#include "daemon/engine/step_gates.h"

#include <algorithm>

namespace trainstream::daemon {

StepGates::StepGates(size_t buckets, uint32_t ranks, bool speculative_clipping, bool step_terms,
                     uint32_t accumulation_steps, double max_grad_norm)
    : buckets_(buckets),
      ranks_(ranks),
      speculative_clipping_(speculative_clipping),
      step_terms_(step_terms),
      accumulation_steps_(accumulation_steps),
      max_grad_norm_(max_grad_norm) {}

// The step's first bucket to need its gate decides what the step's updates assume: the multiplier and
// whether a norm was needed of the step before, or the job's own terms.
StepGate& StepGates::Of(uint64_t step) {
  auto found = gates_.find(step);
  if (found != gates_.end()) return found->second;
  const bool speculate = speculative_clipping_ && clipped_run_ < kClippedRunToWait;
  const bool expects_norms = max_grad_norm_ > 0 || last_needed_norms_;
  StepGate& gate = gates_.try_emplace(step, buckets_, ranks_, speculate, last_factor_, expects_norms).first->second;
  if (!step_terms_) gate.SetTerms(StepGate::FromOptions(accumulation_steps_, max_grad_norm_));
  return gate;
}

StepGate* StepGates::Find(uint64_t step) {
  const auto found = gates_.find(step);
  return found == gates_.end() ? nullptr : &found->second;
}

void StepGates::Decided(const StepGate& gate, const StepDecision& decision) {
  if (gate.terms().max_norm > 0) clipped_run_ = decision.clip_coefficient != 1.0 ? clipped_run_ + 1 : 0;
  last_factor_ = gate.terms().factor;
  last_needed_norms_ = gate.NormsNeeded();
}

StepGates::Next StepGates::AfterGradients(const StepGate& gate, bool revocable) {
  if (gate.Decided()) return Next::kUpdate;
  if (gate.NormsNeeded() && !(gate.speculative() && revocable)) return Next::kNorm;
  return Next::kSpeculate;
}

StepGates::Settlement StepGates::Settle(const UpdatePlan* plan, const StepDecision& decision, bool revocable) {
  if (plan == nullptr) return Settlement::kUpdate;
  if (plan->multiplier == decision.multiplier) return Settlement::kCommit;
  if (!revocable) return Settlement::kDiverge;
  const bool any_gradient = std::any_of(plan->updated.begin(), plan->updated.end(), [](uint8_t u) { return u; });
  return any_gradient ? Settlement::kRedo : Settlement::kCommit;  // without one it only carried its state across
}

}  // namespace trainstream::daemon
