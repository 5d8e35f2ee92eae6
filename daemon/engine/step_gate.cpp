#include "daemon/engine/step_gate.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "shm/error.h"

namespace trainstream::daemon {

StepGate::StepGate(size_t buckets, uint32_t ranks, bool speculative, float assumed, bool norms_expected)
    : sums_(buckets, 0.0),
      in_(buckets, 0),
      committed_(ranks, 0),
      speculative_(speculative),
      assumed_(assumed),
      norms_expected_(norms_expected) {}

StepTerms StepGate::FromOptions(uint32_t accumulation_steps, double max_grad_norm) {
  return StepTerms{.micro_batches = accumulation_steps, .max_norm = max_grad_norm, .committed = true};
}

void StepGate::SetTerms(const StepTerms& terms) {
  terms_ = terms;
  std::fill(committed_.begin(), committed_.end(), terms.committed ? 1 : 0);
}

void StepGate::AddTerms(uint32_t rank, const shm::Message& message) {
  TS_CHECK(rank < committed_.size(), Code::kInvalidArgument, "step terms from rank {} of {}", rank, committed_.size());
  TS_CHECK(message.micro >= 1, Code::kInvalidArgument, "step terms of step {} after {} backward passes", message.step,
           message.micro);
  const bool clip = (message.flags & shm::kTermsClip) != 0;
  const bool commit = (message.flags & shm::kTermsCommit) != 0;
  TS_CHECK(!clip || (message.value > 0 && !std::isnan(message.value)), Code::kInvalidArgument,
           "step {}: clipping to max norm {} (it must be > 0)", message.step, message.value);
  auto finite_positive = [](float value) { return std::isfinite(value) && value > 0; };
  TS_CHECK(finite_positive(message.norm_factor) && (!commit || finite_positive(message.factor)), Code::kInvalidArgument,
           "step {}: gradient multipliers {} and {} (they must be finite and > 0)", message.step, message.norm_factor,
           message.factor);
  StepTerms terms{.micro_batches = message.micro,
                  .norm_wanted = (message.flags & shm::kTermsNorm) != 0,
                  .max_norm = clip ? message.value : 0.0,
                  .norm_factor = message.norm_factor,
                  .committed = commit,
                  .factor = message.factor};
  Merge(terms, commit, rank);
}

// A rank's terms join those said before: what one rank (or this one, earlier) said, every later word
// of the step must say alike.
void StepGate::Merge(const StepTerms& terms, bool commits, uint32_t rank) {
  const bool first_count = terms_.micro_batches == 0;
  TS_CHECK(first_count || terms.micro_batches == terms_.micro_batches, Code::kInvalidArgument,
           "rank {} says the step summed {} backward passes, but {} was said before (every rank must run as many, "
           "and none after clip_grad_norm_ or a GradScaler's unscale_)",
           rank, terms.micro_batches, terms_.micro_batches);
  terms_.micro_batches = terms.micro_batches;
  if (terms.norm_wanted || terms.max_norm > 0) {
    const bool first_norm = !terms_.norm_wanted && terms_.max_norm == 0;
    TS_CHECK(first_norm || terms.norm_factor == terms_.norm_factor, Code::kInvalidArgument,
             "rank {} takes the gradient norm with the gradients multiplied by {}, but by {} before", rank,
             terms.norm_factor, terms_.norm_factor);
    terms_.norm_factor = terms.norm_factor;
    terms_.norm_wanted |= terms.norm_wanted;
  }
  if (terms.max_norm > 0) {
    TS_CHECK(terms_.max_norm == 0 || terms_.max_norm == terms.max_norm, Code::kInvalidArgument,
             "rank {} clips to max norm {}, but {} was said before (one clipping per step)", rank, terms.max_norm,
             terms_.max_norm);
    terms_.max_norm = terms.max_norm;
  }
  if (!commits) return;
  TS_CHECK(committed_[rank] == 0, Code::kInvalidArgument, "rank {} called optimizer.step() twice in one step", rank);
  const bool first_commit = std::none_of(committed_.begin(), committed_.end(), [](uint8_t c) { return c != 0; });
  TS_CHECK(first_commit || terms.factor == terms_.factor, Code::kInvalidArgument,
           "rank {} steps with gradient multiplier {}, but another rank with {} (each rank must use the same loss "
           "scale)",
           rank, terms.factor, terms_.factor);
  committed_[rank] = 1;
  terms_.factor = terms.factor;
  terms_.committed = std::all_of(committed_.begin(), committed_.end(), [](uint8_t c) { return c != 0; });
}

void StepGate::AddNorm(uint32_t bucket, double sum_of_squares, bool nonfinite, float multiplier) {
  if (in_[bucket] != 0) return;
  in_[bucket] = 1;
  const double m = multiplier;
  sums_[bucket] = m == 1.0 ? sum_of_squares : sum_of_squares / (m * m);  // exact for powers of two
  ++count_;
  nonfinite_ |= nonfinite;
}

bool StepGate::NormsNeeded() const {
  const bool asked = terms_.norm_wanted || terms_.max_norm > 0;
  return asked || (!terms_.committed && norms_expected_);
}

double StepGate::Norm() const {
  double sum = 0;
  for (const double bucket : sums_) sum += bucket;  // bucket order: deterministic
  return std::sqrt(sum) * std::abs(static_cast<double>(terms_.norm_factor));
}

// torch.nn.utils.clip_grad_norm_'s coefficient, max_norm / (norm + 1e-6) clamped to at most 1, as torch
// clamps it: a NaN norm gives NaN (every gradient becomes NaN, as in torch), an inf norm 0.
StepDecision StepGate::Decision() const {
  StepDecision decision;
  decision.nonfinite = nonfinite_;
  if (terms_.max_norm > 0) {
    const double coefficient = terms_.max_norm / (Norm() + 1e-6);
    decision.clip_coefficient = coefficient > 1.0 ? 1.0 : coefficient;
  }
  decision.multiplier = static_cast<float>(decision.clip_coefficient) * terms_.factor;
  return decision;
}

bool StepGate::MarkNormSent() {
  return !std::exchange(norm_sent_, true);
}

bool StepGate::MarkApplied() {
  return !std::exchange(applied_, true);
}

}  // namespace trainstream::daemon
