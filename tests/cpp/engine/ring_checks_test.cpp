// The ring messages' checks alone (daemon/engine/ring_checks.h): each refuses what a rank may not say
// where the job is, with an error naming what was wrong, and lets the right message through.
#include "daemon/engine/ring_checks.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "shm/error.h"

namespace trainstream::daemon {
namespace {

// The message of the Error `call` throws, which must have `code`.
template <typename F>
std::string Refusal(F call, Code code = Code::kInvalidArgument) {
  try {
    call();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code);
    return e.what();
  }
  ADD_FAILURE() << "not refused";
  return {};
}

shm::Message GradReady(uint32_t bucket, uint64_t step, uint32_t micro, uint16_t flags) {
  return shm::Message{
      .kind = shm::MessageKind::kGradReady, .flags = flags, .bucket = bucket, .step = step, .micro = micro};
}

shm::LayoutSpec Spec(uint32_t accumulation_steps, bool step_terms) {
  shm::LayoutSpec spec;
  spec.world_size = 2;
  spec.accumulation_steps = accumulation_steps;
  spec.step_terms = step_terms;
  return spec;
}

TEST(RingChecks, GradReadyNamesTheBucketStepAndMicroBatchItExpects) {
  std::vector<BucketLifecycle> buckets(2, BucketLifecycle(3, 2));
  const shm::LayoutSpec spec = Spec(2, false);
  EXPECT_FALSE(CheckGradReady(spec, buckets, false, 0, 0, GradReady(1, 3, 0, 0)));
  EXPECT_NE(Refusal([&] { CheckGradReady(spec, buckets, false, 0, 0, GradReady(2, 3, 0, 0)); }).find("has 2 buckets"),
            std::string::npos);
  EXPECT_NE(Refusal([&] { CheckGradReady(spec, buckets, false, 0, 0, GradReady(0, 4, 0, 0)); }).find("expects step 3"),
            std::string::npos);
  EXPECT_NE(Refusal([&] {
              CheckGradReady(spec, buckets, false, 0, 0, GradReady(0, 3, 1, shm::kFinalMicro));
            }).find("collecting micro-batch 0"),
            std::string::npos);
  EXPECT_NE(Refusal([&] {
              CheckGradReady(spec, buckets, false, 0, 0, GradReady(0, 3, 0, shm::kFinalMicro));
            }).find("marked final, but accumulation_steps is 2"),
            std::string::npos);
  Refusal([&] { CheckGradReady(spec, buckets, true, 0, 0, GradReady(0, 3, 0, 0)); }, Code::kFailedPrecondition);
  (void)buckets[0].Deliver(0);
  EXPECT_NE(Refusal([&] { CheckGradReady(spec, buckets, false, 0, 0, GradReady(0, 3, 0, 0)); }).find("twice"),
            std::string::npos);
  buckets[0].Begin(BucketLifecycle::Pass::kUpdate);
  buckets[0].streaming = true;  // the rest of a streamed bucket's gradients is welcome while it updates
  EXPECT_TRUE(CheckGradReady(spec, buckets, false, 0, 1, GradReady(0, 3, 0, 0)));
}

TEST(RingChecks, APieceComesInOrderThroughARegisteredSlot) {
  shm::Message message = GradReady(0, 1, 0, 0);
  message.slot = 1;
  message.piece = 1;
  CheckGradPiece(2, 3, 0, 1, message);
  EXPECT_NE(Refusal([&] { CheckGradPiece(1, 3, 0, 1, message); }).find("staging slot 1"), std::string::npos);
  EXPECT_NE(Refusal([&] { CheckGradPiece(2, 3, 0, 0, message); }).find("piece 0 is the next one"), std::string::npos);
}

TEST(RingChecks, StepMessagesBelongToTheCurrentStepAndTheJobsOptions) {
  const shm::Message terms{.kind = shm::MessageKind::kStepTerms, .step = 5, .micro = 2};
  CheckStepTerms(Spec(0, true), 4, 0, terms);
  EXPECT_NE(Refusal([&] { CheckStepTerms(Spec(0, false), 4, 0, terms); }).find("attached without them"),
            std::string::npos);
  EXPECT_NE(Refusal([&] { CheckStepTerms(Spec(0, true), 5, 0, terms); }).find("the job is in step 6"),
            std::string::npos);
  EXPECT_NE(Refusal([&] { CheckStepTerms(Spec(3, true), 4, 0, terms); }).find("accumulation_steps is 3"),
            std::string::npos);
  std::vector<BucketLifecycle> buckets(1, BucketLifecycle(5, 1));
  buckets[0].micro = 2;
  (void)buckets[0].Deliver(0);
  EXPECT_NE(Refusal([&] { CheckTermsAgainstBuckets(buckets, terms); }).find("bucket 0 has 3 already"),
            std::string::npos);
  EXPECT_NE(Refusal([&] { CheckMoreMicro(Spec(2, true), 4, 0, terms); }).find("accumulation_steps is 2"),
            std::string::npos);
  EXPECT_NE(Refusal([&] { CheckMoreAfterTerms(2, 0, terms); }).find("after its terms said 2"), std::string::npos);
  shm::LayoutSpec two_nodes = Spec(0, true);
  two_nodes.peers.resize(2);
  EXPECT_NE(Refusal([&] { CheckDiscard(two_nodes, 4, 0, terms); }).find("spanning nodes"), std::string::npos);
}

TEST(RingChecks, AStateLoadWaitsForEveryBucketToBeBetweenSteps) {
  std::vector<BucketLifecycle> buckets(2, BucketLifecycle(1, 1));
  const shm::Message load{.kind = shm::MessageKind::kLoadState, .step = 10};
  CheckLoadState(buckets, false, 0, load);
  Refusal([&] { CheckLoadState(buckets, true, 0, load); }, Code::kFailedPrecondition);
  (void)buckets[1].Deliver(0);
  EXPECT_NE(Refusal([&] { CheckLoadState(buckets, false, 0, load); }, Code::kFailedPrecondition)
                .find("bucket 1 is in the middle of step 1"),
            std::string::npos);
}

TEST(RingChecks, WeightsWantedAndHyperparameters) {
  const shm::Message wanted{.kind = shm::MessageKind::kWeightsWanted, .step = 3, .slot = 1};
  CheckWeightsWanted(true, 2, 0, wanted);
  EXPECT_NE(Refusal([&] { CheckWeightsWanted(false, 0, 0, wanted); }).find("no cuda-ipc registration"),
            std::string::npos);
  EXPECT_NE(Refusal([&] { CheckWeightsWanted(true, 1, 0, wanted); }).find("event 1"), std::string::npos);
  CheckHParams(shm::HParams{}, 0);
  EXPECT_NE(Refusal([&] { CheckHParams(shm::HParams{.beta1 = 1.0}, 4); }).find("group 4"), std::string::npos);
}

}  // namespace
}  // namespace trainstream::daemon
