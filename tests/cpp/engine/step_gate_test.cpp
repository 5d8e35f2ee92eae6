// StepGate alone: when a step is decided, the multiplier its updates apply (torch's clip coefficient
// times the trainer's factor), the norm's independence of bucket order, and the contradictions between
// ranks' terms it refuses by name.
#include "daemon/engine/step_gate.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>

#include "shm/error.h"

namespace trainstream::daemon {
namespace {

shm::Message Terms(uint32_t micro, uint16_t flags, double max_norm = 0, float norm_factor = 1.0f, float factor = 1.0f) {
  shm::Message m;
  m.kind = shm::MessageKind::kStepTerms;
  m.step = 7;
  m.micro = micro;
  m.flags = flags;
  m.value = max_norm;
  m.norm_factor = norm_factor;
  m.factor = factor;
  return m;
}

constexpr uint16_t kClipCommit = shm::kTermsClip | shm::kTermsCommit;

// The message of the Error `call` throws, which must be kInvalidArgument.
template <typename F>
std::string Refusal(F call) {
  try {
    call();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kInvalidArgument);
    return e.what();
  }
  ADD_FAILURE() << "not refused";
  return {};
}

TEST(StepGate, OptionsWithoutClippingDecideAtOnceWithMultiplierOne) {
  StepGate gate(3, 1, false, 1.0f, false);
  gate.SetTerms(StepGate::FromOptions(4, 0));
  EXPECT_FALSE(gate.NormsNeeded());
  ASSERT_TRUE(gate.Decided());
  EXPECT_EQ(gate.Decision().multiplier, 1.0f);
  EXPECT_EQ(gate.terms().micro_batches, 4u);
}

TEST(StepGate, ClippingWaitsForEveryBucketAndGivesTorchsCoefficient) {
  StepGate gate(2, 1, false, 1.0f, false);
  gate.SetTerms(StepGate::FromOptions(1, 1.0));
  gate.AddNorm(1, 9.0, false, 1.0f);
  EXPECT_FALSE(gate.Decided());
  gate.AddNorm(0, 16.0, false, 1.0f);
  ASSERT_TRUE(gate.Decided());
  EXPECT_DOUBLE_EQ(gate.Norm(), 5.0);
  const StepDecision decision = gate.Decision();
  EXPECT_DOUBLE_EQ(decision.clip_coefficient, 1.0 / (5.0 + 1e-6));
  EXPECT_EQ(decision.multiplier, static_cast<float>(1.0 / (5.0 + 1e-6)));
  EXPECT_FALSE(decision.nonfinite);
}

TEST(StepGate, ANormUnderTheMaximumLeavesTheGradients) {
  StepGate gate(1, 1, false, 1.0f, false);
  gate.SetTerms(StepGate::FromOptions(1, 10.0));
  gate.AddNorm(0, 4.0, false, 1.0f);
  EXPECT_EQ(gate.Decision().multiplier, 1.0f);
}

TEST(StepGate, TheNormIsTheSameBitForBitInAnyBucketOrder) {
  const double sums[] = {0.1, 1e-9, 3.3, 2e7, 0.7};
  StepGate forward(5, 1, false, 1.0f, false), backward(5, 1, false, 1.0f, false);
  for (uint32_t b = 0; b < 5; ++b) {
    forward.AddNorm(b, sums[b], false, 1.0f);
    backward.AddNorm(4 - b, sums[4 - b], false, 1.0f);
  }
  EXPECT_EQ(forward.Norm(), backward.Norm());
}

TEST(StepGate, ABucketAddsOnceAndItsMultiplierIsTakenOff) {
  StepGate gate(1, 1, false, 1.0f, false);
  gate.AddNorm(0, 64.0, false, 0.5f);  // (0.5 g)^2 summed to 64: g's squares sum to 256
  gate.AddNorm(0, 1.0, false, 1.0f);   // a redone update's second look is ignored
  EXPECT_DOUBLE_EQ(gate.Norm(), 16.0);
}

TEST(StepGate, NaNAndInfNormsClipAsTorchDoes) {
  StepGate nan(1, 1, false, 1.0f, false);
  nan.SetTerms(StepGate::FromOptions(1, 1.0));
  nan.AddNorm(0, std::numeric_limits<double>::quiet_NaN(), true, 1.0f);
  EXPECT_TRUE(nan.Decision().nonfinite);
  EXPECT_TRUE(std::isnan(nan.Decision().multiplier));

  StepGate inf(1, 1, false, 1.0f, false);
  inf.SetTerms(StepGate::FromOptions(1, 1.0));
  inf.AddNorm(0, std::numeric_limits<double>::infinity(), true, 1.0f);
  EXPECT_TRUE(inf.Decision().nonfinite);
  EXPECT_EQ(inf.Decision().multiplier, 0.0f);
}

TEST(StepGate, EveryRankMustCommitAndTheFactorJoinsTheClipCoefficient) {
  StepGate gate(1, 2, false, 1.0f, false);
  gate.AddTerms(1, Terms(2, kClipCommit, 1.0, 0.25f, 0.25f));
  gate.AddNorm(0, 4.0, false, 1.0f);
  EXPECT_FALSE(gate.Decided());  // rank 0 has not stepped
  gate.AddTerms(0, Terms(2, kClipCommit, 1.0, 0.25f, 0.25f));
  ASSERT_TRUE(gate.Decided());
  EXPECT_DOUBLE_EQ(gate.Norm(), 0.5);  // the norm of the unscaled gradients: 0.25 x 2
  EXPECT_EQ(gate.Decision().multiplier, 0.25f);
}

TEST(StepGate, TheNormIsWantedBeforeTheCommitWhereStepsBeforeWantedIt) {
  StepGate gate(1, 1, true, 0.5f, true);
  EXPECT_TRUE(gate.NormsNeeded());
  gate.AddTerms(0, Terms(1, shm::kTermsCommit));
  EXPECT_FALSE(gate.NormsNeeded());  // the terms said no clipping
  EXPECT_TRUE(gate.Decided());
}

TEST(StepGate, TheNormIsSentAndTheDecisionAppliedOnce) {
  StepGate gate(1, 1, false, 1.0f, false);
  EXPECT_TRUE(gate.MarkNormSent());
  EXPECT_FALSE(gate.MarkNormSent());
  EXPECT_TRUE(gate.MarkApplied());
  EXPECT_FALSE(gate.MarkApplied());
}

TEST(StepGate, ContradictingTermsAreRefusedByName) {
  StepGate gate(1, 2, false, 1.0f, false);
  gate.AddTerms(0, Terms(2, kClipCommit, 1.0, 1.0f, 0.5f));
  EXPECT_NE(Refusal([&] { gate.AddTerms(1, Terms(3, kClipCommit, 1.0, 1.0f, 0.5f)); }).find("3 backward passes"),
            std::string::npos);
  EXPECT_NE(Refusal([&] { gate.AddTerms(1, Terms(2, kClipCommit, 2.0, 1.0f, 0.5f)); }).find("max norm 2"),
            std::string::npos);
  EXPECT_NE(Refusal([&] { gate.AddTerms(1, Terms(2, kClipCommit, 1.0, 0.5f, 0.5f)); }).find("multiplied by 0.5"),
            std::string::npos);
  EXPECT_NE(Refusal([&] { gate.AddTerms(1, Terms(2, kClipCommit, 1.0, 1.0f, 0.25f)); }).find("same loss scale"),
            std::string::npos);
  EXPECT_NE(Refusal([&] { gate.AddTerms(0, Terms(2, kClipCommit, 1.0, 1.0f, 0.5f)); }).find("twice"),
            std::string::npos);
  EXPECT_FALSE(gate.Decided());  // nothing refused was taken
  gate.AddTerms(1, Terms(2, kClipCommit, 1.0, 1.0f, 0.5f));
  EXPECT_TRUE(gate.terms().committed);
}

TEST(StepGate, MalformedTermsAreRefusedByName) {
  StepGate gate(1, 1, false, 1.0f, false);
  EXPECT_NE(Refusal([&] { gate.AddTerms(1, Terms(1, 0)); }).find("rank 1 of 1"), std::string::npos);
  EXPECT_NE(Refusal([&] { gate.AddTerms(0, Terms(0, 0)); }).find("after 0 backward passes"), std::string::npos);
  EXPECT_NE(Refusal([&] { gate.AddTerms(0, Terms(1, shm::kTermsClip, -1.0)); }).find("must be > 0"), std::string::npos);
  EXPECT_NE(Refusal([&] {
              gate.AddTerms(0, Terms(1, shm::kTermsClip, std::numeric_limits<double>::quiet_NaN()));
            }).find("must be > 0"),
            std::string::npos);
  EXPECT_NE(Refusal([&] {
              gate.AddTerms(0, Terms(1, shm::kTermsCommit, 0, 1.0f, std::numeric_limits<float>::infinity()));
            }).find("finite"),
            std::string::npos);
  EXPECT_NE(Refusal([&] { gate.AddTerms(0, Terms(1, shm::kTermsNorm, 0, 0.0f)); }).find("finite"), std::string::npos);
  EXPECT_EQ(gate.terms().micro_batches, 0u);
}

}  // namespace
}  // namespace trainstream::daemon
