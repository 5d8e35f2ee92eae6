// Tests of the double-buffered optimizer state (shm/job_layout.h, daemon/engine/step_engine.h) through a
// Job in-process over real shared memory: with two state halves each bucket's update reads its
// committed half, writes the other and commits it with one store (the half it read keeps the step
// before); a parameter without a gradient is carried into the committed half; with one half the update
// runs in place and the bucket is marked `updating` until it commits.
#include <gtest/gtest.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <future>
#include <memory>
#include <vector>

#include "daemon/control/job.h"
#include "daemon/engine/worker_pool.h"
#include "shm/job_layout.h"
#include "tests/cpp/engine/adamw_reference.h"
#include "tests/cpp/engine/rank_client.h"
#include "tests/cpp/shm/test_support.h"

namespace trainstream::daemon {
namespace {

class StateHalvesTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { spdlog::set_level(spdlog::level::err); }

  std::unique_ptr<Job> MakeJob(uint32_t halves, WorkerPool* pool = nullptr) {
    return std::make_unique<Job>("halves", static_cast<uint32_t>(getuid()), TwoParamSpec(1, halves), /*seed=*/7,
                                 pool != nullptr ? *pool : pool_);
  }
  // Every parameter's master weights in bucket b's other half (not committed).
  static std::vector<float> OtherHalf(const RankClient& client, uint32_t p) {
    const shm::ParamLayout& param = client.layout().params[p];
    const uint64_t first = client.layout().buckets[param.bucket].elem_offset + param.offset_in_bucket;
    const float* master = client.state().Other(param.bucket).master + first;
    return {master, master + param.numel};
  }
  static std::vector<float> Committed(const RankClient& client, uint32_t p) {
    const std::span<float> master = client.Master(p);
    return {master.begin(), master.end()};
  }

  WorkerPool pool_{2, /*pin_threads=*/false};
};

TEST_F(StateHalvesTest, EachStepCommitsTheOtherHalfAndTheHalfItReadKeepsTheStepBefore) {
  auto job = MakeJob(2);
  auto client = StartRank(*job);
  AdamWReference reference(job->spec());
  std::vector<std::vector<float>> previous = {Committed(*client, 0), Committed(*client, 1)};
  for (uint64_t step = 1; step <= 4; ++step) {
    RunStep(*client, step);
    reference.Step(step, TestHParams());
    reference.ExpectMatches(*client);
    for (uint32_t b = 0; b < client->buckets(); ++b) {
      const shm::BucketCommit commit = client->state().bucket_state[b].Load();
      EXPECT_EQ(commit.step, step);
      EXPECT_EQ(commit.half, step % 2) << "step " << step << " bucket " << b;
      EXPECT_FALSE(commit.updating);
    }
    for (uint32_t p = 0; p < 2; ++p) {
      EXPECT_EQ(OtherHalf(*client, p), previous[p]) << "step " << step << ": the other half lost step " << step - 1;
      previous[p] = Committed(*client, p);
    }
  }
}

TEST_F(StateHalvesTest, AParameterWithoutAGradientIsCarriedIntoTheCommittedHalf) {
  auto job = MakeJob(2);
  auto client = StartRank(*job);
  AdamWReference reference(job->spec());
  const std::vector<float> initial = Committed(*client, 1);
  client->SetHParams(1, TestHParams());
  client->SetGradients(1);
  client->view().presence[1] = 0;  // "b" has no gradient in step 1: no decay, no step count
  for (uint32_t b = 0; b < client->buckets(); ++b) client->SendGradReady(b, 1);
  client->ExpectParamsReady(1);
  reference.Step(1, TestHParams(), {true, false});
  reference.ExpectMatches(*client);
  EXPECT_EQ(Committed(*client, 1), initial);
  const uint32_t bucket_of_b = client->layout().params[1].bucket;
  EXPECT_EQ(client->state().bucket_state[bucket_of_b].Load().half, 1u);  // committed like the others
  EXPECT_EQ(client->state().Committed(bucket_of_b).param_state[1].step, 0u);
  EXPECT_EQ(client->state().Committed(client->layout().params[0].bucket).param_state[0].step, 1u);
  RunStep(*client, 2);  // and it takes its next gradient from there
  reference.Step(2, TestHParams());
  reference.ExpectMatches(*client);
  EXPECT_EQ(client->state().Committed(bucket_of_b).param_state[1].step, 1u);
}

// While an update runs, one half marks its bucket `updating` (the state is torn until the commit); two
// halves never do (the committed half is intact). The update is held on the pool's only worker.
TEST_F(StateHalvesTest, OneHalfMarksABucketUpdatingUntilItCommitsTwoHalvesNever) {
  for (uint32_t halves : {1u, 2u}) {
    SCOPED_TRACE(halves);
    WorkerPool single(1, /*pin_threads=*/false);
    auto job = MakeJob(halves, &single);
    auto client = StartRank(*job);
    std::promise<void> release = HoldTheWorker(single);
    client->DeliverStep(1, TestHParams());
    ASSERT_TRUE(trainstream::testing::PollUntil(
        [&] { return client->state().bucket_state[0].Load().updating || halves == 2; }));
    const shm::RingHeader* requests = client->view().request_ring;
    ASSERT_TRUE(trainstream::testing::PollUntil([&] { return requests->tail.load() == requests->head.load(); }));
    for (uint32_t b = 0; b < client->buckets(); ++b) {
      EXPECT_EQ(client->state().bucket_state[b].Load(), (shm::BucketCommit{.step = 0, .updating = halves == 1}));
    }
    release.set_value();
    client->ExpectParamsReady(1);
    for (uint32_t b = 0; b < client->buckets(); ++b) {
      EXPECT_EQ(client->state().bucket_state[b].Load(),
                (shm::BucketCommit{.step = 1, .half = halves == 2 ? 1u : 0u, .updating = false}));
    }
  }
}

}  // namespace
}  // namespace trainstream::daemon
