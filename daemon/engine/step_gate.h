// How one step's updates end: committed as they ran, or run again with another gradient multiplier. The
// decision comes from the step's terms and, where they need it, the step's global gradient norm, gathered
// bucket by bucket.
//
// The terms are the trainer's (LayoutSpec::step_terms): each rank says, in kStepTerms messages, how many
// backward passes it summed, whether it wants the norm (clip_grad_norm_, a GradScaler's inf check),
// the norm it clips to, and, with optimizer.step(), the multiplier the update applies (what a GradScaler's
// unscale_ took off the gradients; a step the scaler skips never commits: zero_grad() drops it). A job
// whose ranks send no terms has its options' (FromOptions): a fixed count, max_grad_norm, committed.
//
// Updates may run before the decision, with a multiplier assumed from the steps before (`assumed`); the
// engine compares it with the decision's and redoes or takes back what differs.
//
// Invariants: the norm is the same whatever order the buckets arrive in (their sums of squares are added
// in bucket order once all are in), so an update that waited for the decision and one that ran before it
// and was checked against it see the same multiplier bit for bit. Every rank sends the same terms: one
// that contradicts what another said is an error, and so is a rank's change of what it said.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "shm/message.h"

namespace trainstream::daemon {

struct StepTerms {
  uint32_t micro_batches = 0;  // backward passes summed; 0: not said yet
  bool norm_wanted = false;    // send the norm (kStepNorm)
  double max_norm = 0;         // clip to this norm; 0: no clipping
  float norm_factor = 1.0f;    // the averaged gradients' multiplier when the norm is taken
  bool committed = false;      // optimizer.step() was called (by every rank)
  float factor = 1.0f;         // the multiplier the update applies besides the clip coefficient
};

struct StepDecision {
  float multiplier = 1.0f;  // of the averaged gradients in the update: clip coefficient x factor
  bool nonfinite = false;   // the norm found inf or NaN gradients
  double clip_coefficient = 1.0;
};

class StepGate {
 public:
  // `ranks` must each commit the step. Updates that run before the decision use `assumed` as their
  // multiplier, speculate (may be redone or taken back) where `speculative`, and sum the squares of
  // what they read where `norms_expected` (the steps before needed the norm).
  StepGate(size_t buckets, uint32_t ranks, bool speculative, float assumed, bool norms_expected);

  // The terms of a job whose ranks send none: `accumulation_steps` micro-batches, clipped to
  // `max_grad_norm` (0: not clipped), committed.
  static StepTerms FromOptions(uint32_t accumulation_steps, double max_grad_norm);
  void SetTerms(const StepTerms& terms);
  // Rank `rank`'s kStepTerms; throws kInvalidArgument naming the contradiction.
  void AddTerms(uint32_t rank, const shm::Message& message);

  // Bucket b's sum of squares of `multiplier` x its averaged gradients, and whether any was inf or NaN;
  // a bucket adds once.
  void AddNorm(uint32_t bucket, double sum_of_squares, bool nonfinite, float multiplier);
  [[nodiscard]] bool HasNorm(uint32_t bucket) const { return in_[bucket] != 0; }
  [[nodiscard]] bool NormsComplete() const { return count_ == sums_.size(); }
  // The terms (or, until they are in, the guess) need every bucket's norm.
  [[nodiscard]] bool NormsNeeded() const;
  // The global norm of norm_factor x the averaged gradients, once NormsComplete.
  [[nodiscard]] double Norm() const;

  [[nodiscard]] const StepTerms& terms() const { return terms_; }
  [[nodiscard]] bool speculative() const { return speculative_; }
  [[nodiscard]] float assumed() const { return assumed_; }
  [[nodiscard]] bool norms_expected() const { return norms_expected_; }
  // Every rank committed, and the norm is in where the terms need it.
  [[nodiscard]] bool Decided() const { return terms_.committed && (!NormsNeeded() || NormsComplete()); }
  [[nodiscard]] StepDecision Decision() const;  // once Decided

  // Whether this is the first call: the norm goes to the ranks once, the step's decision is counted once.
  bool MarkNormSent();
  bool MarkApplied();

 private:
  void Merge(const StepTerms& terms, bool commits, uint32_t rank);

  std::vector<double> sums_;
  std::vector<uint8_t> in_;
  size_t count_ = 0;
  bool nonfinite_ = false;
  std::vector<uint8_t> committed_;  // per rank
  StepTerms terms_;
  bool speculative_;
  float assumed_;
  bool norms_expected_;
  bool norm_sent_ = false;
  bool applied_ = false;
};

}  // namespace trainstream::daemon
