// Speculative clipping (daemon/engine/step_engine.h): with max_grad_norm and two state halves, each
// bucket's update runs as soon as its gradients are in and is committed once the global norm shows no
// clipping, or redone from the committed half with the clip coefficient. Driven through Jobs in-process
// over real shared memory, a speculating job and one that waits for the norm side by side on the same
// gradients: their state must be equal bit for bit (any NaN equals any NaN), whether clipping applies
// or not, with parameters without gradients and with inf/NaN gradients, and the redos are counted; after
// a run of clipped steps the job waits for the norm until a step does not clip.
#include <gtest/gtest.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "daemon/control/job.h"
#include "daemon/engine/worker_pool.h"
#include "shm/job_layout.h"
#include "tests/cpp/engine/adamw_reference.h"
#include "tests/cpp/engine/rank_client.h"

namespace trainstream::daemon {
namespace {

const uint32_t kUid = static_cast<uint32_t>(getuid());

shm::LayoutSpec ClippedSpec(double max_grad_norm, bool speculative) {
  shm::LayoutSpec spec = TwoParamSpec(1, 2);
  spec.max_grad_norm = max_grad_norm;
  spec.speculative_clipping = speculative ? shm::Speculation::kOn : shm::Speculation::kOff;
  return spec;
}

// The first element where two float arrays differ, -1 if none. Bit for bit, except that any NaN
// equals any NaN: which operand's NaN an x86 add passes on depends on the operand order the compiler
// picked, so two compilations of the same update may give NaNs of different signs (seen on an AVX2 CI
// machine: the fused update-with-norm against the plain update).
int64_t FirstDifference(const float* a, const float* b, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (std::isnan(a[i]) && std::isnan(b[i])) continue;
    if (std::bit_cast<uint32_t>(a[i]) != std::bit_cast<uint32_t>(b[i])) return static_cast<int64_t>(i);
  }
  return -1;
}

// A speculating job and a waiting one, each with one rank, fed the same gradients.
class SpeculationTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { spdlog::set_level(spdlog::level::err); }

  void Start(double max_grad_norm) {
    for (bool speculative : {true, false}) {
      auto& job = jobs_.emplace_back(std::make_unique<Job>(speculative ? "speculative" : "waiting", kUid,
                                                           ClippedSpec(max_grad_norm, speculative), 7, pool_));
      auto& client = clients_.emplace_back(std::make_unique<RankClient>(*job, 0));
      client->LoadInitialState();
      client->ExpectParamsReady(0);
    }
  }
  // Both jobs: step `step`'s gradients times `scale`, with parameter `absent` (if any) left out and
  // `poison` written into element 3 of parameter 0; every bucket's PARAMS_READY.
  void Step(uint64_t step, float scale, int absent = -1, float poison = 0) {
    for (auto& client : clients_) {
      client->SetHParams(step, TestHParams(0.05));
      client->SetGradients(step);
      for (uint32_t p = 0; p < 2; ++p) {
        for (float& g : client->Grad(p)) g *= scale;
      }
      if (poison != 0) client->Grad(0)[3] = poison;
      if (absent >= 0) client->view().presence[absent] = 0;
      for (uint32_t b = 0; b < client->buckets(); ++b) client->SendGradReady(b, step);
    }
    for (auto& client : clients_) client->ExpectParamsReady(step);
  }
  // The two jobs' committed state (master weights, moments, step counts), byte for byte.
  void ExpectSameState() const {
    const shm::JobLayout& layout = jobs_[0]->layout();
    for (uint32_t b = 0; b < layout.buckets.size(); ++b) {
      const shm::BucketLayout& bucket = layout.buckets[b];
      const shm::StateHalf& a = clients_[0]->state().Committed(b);
      const shm::StateHalf& c = clients_[1]->state().Committed(b);
      const auto first_difference = [&](const void* x, const void* y) {
        return FirstDifference(static_cast<const float*>(x) + bucket.elem_offset,
                               static_cast<const float*>(y) + bucket.elem_offset, bucket.numel);
      };
      EXPECT_EQ(first_difference(a.master, c.master), -1) << "bucket " << b << " master";
      EXPECT_EQ(first_difference(a.exp_avg, c.exp_avg), -1) << "bucket " << b << " exp_avg";
      EXPECT_EQ(first_difference(a.exp_avg_sq, c.exp_avg_sq), -1) << "bucket " << b << " exp_avg_sq";
      for (uint32_t p : bucket.params) EXPECT_EQ(a.param_state[p].step, c.param_state[p].step) << "param " << p;
    }
  }
  [[nodiscard]] EngineStats Speculating() const { return jobs_[0]->Info().engine; }

  WorkerPool pool_{2, /*pin_threads=*/false};
  std::vector<std::unique_ptr<Job>> jobs_;
  std::vector<std::unique_ptr<RankClient>> clients_;
};

TEST_F(SpeculationTest, WithoutClippingTheSpeculativeUpdatesAreCommittedAsTheyAre) {
  Start(/*max_grad_norm=*/1e6);
  AdamWReference reference(jobs_[0]->spec());
  for (uint64_t step = 1; step <= 3; ++step) {
    Step(step, 1.0f);
    reference.Step(step, TestHParams(0.05), {}, 1e6);
  }
  ExpectSameState();
  reference.ExpectMatches(*clients_[0]);
  EXPECT_EQ(Speculating().speculative_steps, 3u);
  EXPECT_EQ(Speculating().redone_steps, 0u);
  EXPECT_EQ(jobs_[1]->Info().engine.speculative_steps, 0u);  // the other job waited for the norm
  EXPECT_EQ(Speculating().updates, 6u);                      // one commit per bucket and step
}

// 20 steps whose gradients are scaled so that the norm is over the limit on every third step and under
// it on the others: the clipped steps are redone, and the result is the waiting job's bit for bit.
TEST_F(SpeculationTest, ClippedStepsAreRedoneAndEveryStepEqualsTheUpdateThatWaited) {
  constexpr double kMaxNorm = 12.0;  // the unscaled gradients' norm is about 11.5
  Start(kMaxNorm);
  AdamWReference reference(jobs_[0]->spec());
  uint64_t clipped = 0;
  for (uint64_t step = 1; step <= 20; ++step) {
    const float scale = step % 3 == 0 ? 2.0f : 0.5f;
    Step(step, scale);
    ExpectSameState();
  }
  for (uint64_t step = 1; step <= 20; ++step) {  // how many steps a reference clips
    AdamWReference probe(jobs_[0]->spec());
    probe.Step(step, TestHParams(0.05), {}, kMaxNorm / (step % 3 == 0 ? 2.0 : 0.5));
    clipped += probe.last_clip() < 1.0;
  }
  EXPECT_GT(clipped, 0u);
  EXPECT_LT(clipped, 20u);
  EXPECT_EQ(Speculating().speculative_steps, 20u);
  EXPECT_EQ(Speculating().redone_steps, clipped);
}

// A run of clipped steps: the first three speculate and are redone, the later ones wait for the norm;
// the first of them that does not clip lets the next step speculate again. Equal bit for bit throughout.
TEST_F(SpeculationTest, AfterThreeClippedStepsInARowTheStepsWaitUntilOneDoesNotClip) {
  Start(/*max_grad_norm=*/3.0);  // gradients scaled by 1 have a norm of about 11.5: they clip
  for (uint64_t step = 1; step <= 6; ++step) Step(step, 1.0f);
  EXPECT_EQ(Speculating().speculative_steps, 3u);
  EXPECT_EQ(Speculating().redone_steps, 3u);
  Step(7, 0.05f);  // waits for the norm, which does not clip
  EXPECT_EQ(Speculating().speculative_steps, 3u);
  Step(8, 0.05f);  // speculates again, and commits as speculated
  Step(9, 1.0f);   // an isolated clipped step still speculates
  Step(10, 0.05f);
  EXPECT_EQ(Speculating().speculative_steps, 6u);
  EXPECT_EQ(Speculating().redone_steps, 4u);
  ExpectSameState();
}

TEST_F(SpeculationTest, AParameterWithoutAGradientIsCarriedWhetherTheStepIsRedoneOrNot) {
  Start(/*max_grad_norm=*/3.0);
  Step(1, 1.0f, /*absent=*/1);   // clipped (redone): "b" only carried
  Step(2, 0.05f, /*absent=*/0);  // not clipped: "w" only carried
  Step(3, 1.0f, /*absent=*/-1);  // clipped
  ExpectSameState();
  EXPECT_EQ(Speculating().redone_steps, 2u);
  const shm::JobLayout& layout = jobs_[0]->layout();
  EXPECT_EQ(clients_[0]->state().Committed(layout.params[0].bucket).param_state[0].step, 2u);
  EXPECT_EQ(clients_[0]->state().Committed(layout.params[1].bucket).param_state[1].step, 2u);
}

// An inf or NaN gradient: the norm is inf or NaN; the weights and the one warning per step are what the
// job that waited for the norm has.
TEST_F(SpeculationTest, NonFiniteGradientsGiveWhatTheUpdateThatWaitedGives) {
  Start(/*max_grad_norm=*/1.0);
  Step(1, 1.0f);
  Step(2, 1.0f, -1, std::numeric_limits<float>::infinity());
  Step(3, 1.0f, -1, std::numeric_limits<float>::quiet_NaN());
  ExpectSameState();
  for (const auto& job : jobs_) EXPECT_EQ(job->Info().engine.nonfinite_steps, 2u) << job->name();
  EXPECT_EQ(clients_[0]->sink().warnings(), clients_[1]->sink().warnings());
  EXPECT_EQ(clients_[0]->sink().warnings().size(), 2u);
}

}  // namespace
}  // namespace trainstream::daemon
