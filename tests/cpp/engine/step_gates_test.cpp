// StepGates alone (daemon/engine/step_gates.h): whether a step speculates after a run of clipped steps,
// what its updates assume from the step before, what a bucket runs once its gradients are in, and how
// a written update ends once its step is decided.
#include "daemon/engine/step_gates.h"

#include <gtest/gtest.h>

#include <memory>

namespace trainstream::daemon {
namespace {

using Next = StepGates::Next;
using Settlement = StepGates::Settlement;

// Decides `step` of a one-bucket job clipped to 1.0 with a norm of sqrt(sum_of_squares).
void DecideWithNorm(StepGates& gates, uint64_t step, double sum_of_squares) {
  StepGate& gate = gates.Of(step);
  gate.AddNorm(0, sum_of_squares, false, 1.0f);
  ASSERT_TRUE(gate.Decided());
  gates.Decided(gate, gate.Decision());
}

TEST(StepGates, AfterARunOfClippedStepsTheNextWaitsForTheNormUntilOneDoesNotClip) {
  StepGates gates(1, 1, /*speculative_clipping=*/true, /*step_terms=*/false, 1, /*max_grad_norm=*/1.0);
  for (uint64_t step = 1; step <= StepGates::kClippedRunToWait; ++step) {
    EXPECT_TRUE(gates.Of(step).speculative()) << step;
    DecideWithNorm(gates, step, 4.0);  // norm 2: clipped
  }
  EXPECT_FALSE(gates.Of(4).speculative());
  DecideWithNorm(gates, 4, 0.25);  // not clipped: the run ends
  EXPECT_TRUE(gates.Of(5).speculative());
}

TEST(StepGates, AGateIsMadeOnceAndForgottenWithItsStep) {
  StepGates gates(1, 1, true, false, 1, 0);
  EXPECT_EQ(gates.Find(1), nullptr);
  StepGate& gate = gates.Of(1);
  EXPECT_EQ(&gates.Of(1), &gate);
  EXPECT_EQ(gates.Find(1), &gate);
  (void)gates.Of(2);
  gates.EraseThrough(1);
  EXPECT_EQ(gates.Find(1), nullptr);
  EXPECT_NE(gates.Find(2), nullptr);
  gates.Clear();
  EXPECT_EQ(gates.Find(2), nullptr);
}

TEST(StepGates, TheNextStepAssumesTheFactorAndTheNormOfTheStepBefore) {
  StepGates gates(1, 1, true, /*step_terms=*/true, 0, 0);
  StepGate& first = gates.Of(1);
  shm::Message terms{.kind = shm::MessageKind::kStepTerms, .flags = shm::kTermsCommit, .step = 1, .micro = 1};
  terms.factor = 0.5f;
  first.AddTerms(0, terms);
  ASSERT_TRUE(first.Decided());
  gates.Decided(first, first.Decision());
  EXPECT_EQ(gates.Of(2).assumed(), 0.5f);
}

TEST(StepGates, ABucketUpdatesWhenDecidedSpeculatesWhereItCanBeTakenBackElseNormsFirst) {
  StepGates gates(1, 1, true, false, 1, 1.0);
  const StepGate& clipped = gates.Of(1);
  EXPECT_EQ(StepGates::AfterGradients(clipped, /*revocable=*/true), Next::kSpeculate);
  EXPECT_EQ(StepGates::AfterGradients(clipped, /*revocable=*/false), Next::kNorm);
  StepGates unclipped(1, 1, true, false, 1, 0);
  EXPECT_EQ(StepGates::AfterGradients(unclipped.Of(1), false), Next::kUpdate);
}

TEST(StepGates, AWrittenUpdateCommitsIfItsMultiplierHoldsElseIsRedoneOrDiverges) {
  const StepDecision halved{.multiplier = 0.5f};
  EXPECT_EQ(StepGates::Settle(nullptr, halved, true), Settlement::kUpdate);
  UpdatePlan plan;
  plan.updated = {0, 1};
  plan.multiplier = 0.5f;
  EXPECT_EQ(StepGates::Settle(&plan, halved, false), Settlement::kCommit);
  plan.multiplier = 1.0f;
  EXPECT_EQ(StepGates::Settle(&plan, halved, true), Settlement::kRedo);
  EXPECT_EQ(StepGates::Settle(&plan, halved, false), Settlement::kDiverge);
  plan.updated = {0, 0};  // it only carried its state across
  EXPECT_EQ(StepGates::Settle(&plan, halved, true), Settlement::kCommit);
}

}  // namespace
}  // namespace trainstream::daemon
