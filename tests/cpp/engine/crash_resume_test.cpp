// Resuming a job after a crash (daemon/engine/step_engine.h Resume, daemon/control/job.h adoption),
// through a Job in-process over real shared memory:
//  - a trainer that dies mid-step (some buckets of the step committed, others not) re-attaches at the
//    job's completed step: with two state halves the buckets ahead are rolled back, with one half they
//    keep their step and skip the replayed gradients; either way no gradient is applied twice;
//  - a daemon killed during an update (its state segment copied while the update is held on the pool)
//    leaves a job that resumes exactly with two halves, and with one half is refused naming the torn
//    buckets; one whose owner truncated its state meanwhile is refused and removed; an adopted job's
//    upload region is rewritten from the committed master weights;
//  - no bucket updates step s before every bucket committed s-1 (what makes one step of rollback enough);
//  - a rank leaving while buckets wait for the clipping norm does not leave them waiting.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "daemon/control/job.h"
#include "daemon/control/orphaned_jobs.h"
#include "daemon/engine/worker_pool.h"
#include "daemon/optimizer/float_convert.h"
#include "shm/error.h"
#include "shm/job_layout.h"
#include "shm/segment.h"
#include "tests/cpp/engine/adamw_reference.h"
#include "tests/cpp/engine/rank_client.h"
#include "tests/cpp/shm/test_support.h"

namespace trainstream::daemon {
namespace {

using namespace std::chrono_literals;

const uint32_t kUid = static_cast<uint32_t>(getuid());

class CrashResumeTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { spdlog::set_level(spdlog::level::err); }

  // Step `step` of bucket 0 only ("b"), as a trainer that dies in its backward after that bucket went out.
  static void DeliverBucketZeroOnly(RankClient& client, uint64_t step) {
    client.SetHParams(step, TestHParams());
    client.SetGradient(step, 1);
    client.SendGradReady(0, step);
    const std::optional<shm::Message> ready = client.Receive();
    ASSERT_TRUE(ready.has_value());
    ASSERT_EQ(ready->kind, shm::MessageKind::kParamsReady);
    ASSERT_EQ(ready->bucket, 0u);
    ASSERT_EQ(ready->step, step);
  }

  // Step 1 through both buckets (and `reference`), then step 2 of bucket 0 alone, which commits; the
  // trainer dies and a new one re-attaches.
  std::unique_ptr<RankClient> ReattachedWithBucketZeroAhead(Job& job, AdamWReference& reference) {
    auto client = StartRank(job);
    RunStep(*client, 1);
    reference.Step(1, TestHParams());
    DeliverBucketZeroOnly(*client, 2);
    EXPECT_EQ(client->state().bucket_state[0].Load().step, 2u);
    client->Reattach();
    return client;
  }

  WorkerPool pool_{2, /*pin_threads=*/false};
};

TEST_F(CrashResumeTest, TwoHalvesABucketAheadOfTheJobIsRolledBackAndTheStepIsReplayedExactly) {
  Job job("ahead", kUid, TwoParamSpec(1, 2), 7, pool_);
  AdamWReference reference(job.spec());
  auto client = ReattachedWithBucketZeroAhead(job, reference);
  EXPECT_EQ(client->attachment().completed_step, 1u);  // where the restarted trainer resumes
  EXPECT_EQ(client->state().bucket_state[0].Load(), client->state().bucket_state[1].Load());
  reference.ExpectMatches(*client);  // bucket 0 holds step 1 again
  RunStep(*client, 2);               // the trainer replays step 2
  reference.Step(2, TestHParams());
  reference.ExpectMatches(*client);  // applied once
  EXPECT_EQ(client->state().Committed(0).param_state[1].step, 2u);
}

TEST_F(CrashResumeTest, OneHalfABucketAheadKeepsItsStepAndTakesTheReplayedGradientsWithoutApplyingThem) {
  Job job("ahead", kUid, TwoParamSpec(1, 1), 7, pool_);
  AdamWReference reference(job.spec());
  auto client = ReattachedWithBucketZeroAhead(job, reference);
  EXPECT_EQ(client->attachment().completed_step, 1u);
  EXPECT_EQ(client->state().bucket_state[0].Load().step, 2u);  // kept: it cannot go back
  const uint64_t updates = job.Info().engine.updates;
  RunStep(*client, 2);  // PARAMS_READY for bucket 0 too: its weights of step 2, not updated again
  EXPECT_EQ(job.Info().engine.updates, updates + 1);
  reference.Step(2, TestHParams());  // the replay's gradients equal the first delivery's here
  reference.ExpectMatches(*client);
  RunStep(*client, 3);
  reference.Step(3, TestHParams());
  reference.ExpectMatches(*client);
  EXPECT_EQ(client->state().Committed(0).param_state[1].step, 3u);
}

// A job whose daemon died while bucket updates were held on the pool: its state segment, copied then, is
// what /dev/shm would hold. `corrupt_upload` scribbles over the upload region (an update killed while
// writing it), which adoption must rewrite.
class AdoptionTest : public CrashResumeTest {
 protected:
  // Trains `spec` one step, then holds step 2's updates, copies the state and lets them finish.
  void CopyDuringAnUpdate(const shm::LayoutSpec& spec, bool corrupt_upload = false) {
    WorkerPool single(1, /*pin_threads=*/false);
    Job job("dying", kUid, spec, 7, single);
    auto client = StartRank(job);
    RunStep(*client, 1);
    std::promise<void> release = HoldTheWorker(single);
    client->DeliverStep(2, TestHParams());
    const shm::RingHeader* requests = client->view().request_ring;
    ASSERT_TRUE(trainstream::testing::PollUntil([&] { return requests->tail.load() == requests->head.load(); }));
    std::this_thread::sleep_for(50ms);  // the engine thread has scheduled both updates
    const shm::Segment live = shm::Segment::Open(job.state_segment_name());
    copy_ = shm::Segment::Create(shm::SegmentName(kUid, key_, "state"), live.size());
    std::memcpy(copy_.data(), live.data(), live.size());
    if (corrupt_upload) {
      const shm::JobLayout layout = shm::ComputeLayout(spec);
      std::memset(static_cast<std::byte*>(copy_.data()) + layout.upload_offset, 0x7F, layout.upload_bytes);
    }
    release.set_value();
    client->ExpectParamsReady(2);
  }
  [[nodiscard]] OrphanedJob Orphan(const shm::LayoutSpec& spec) const {
    const auto* header = static_cast<const shm::StateHeader*>(copy_.data());
    return OrphanedJob{.name = "dying",
                       .uid = kUid,
                       .key = key_,
                       .state_segment = shm::SegmentName(kUid, key_, "state"),
                       .completed_step = header->completed_step.load(),
                       .layout_hash = shm::ComputeLayout(spec).hash,
                       .state_bytes = copy_.size()};
  }
  void TearDown() override { RemoveJobSegments(kUid, key_); }

  const std::string key_ = "orphan" + std::to_string(getpid());
  shm::Segment copy_;
};

TEST_F(AdoptionTest, OneHalfKilledDuringAnUpdateIsRefusedNamingTheTornBucketsAndTheWayOut) {
  const shm::LayoutSpec spec = TwoParamSpec(1, 1);
  CopyDuringAnUpdate(spec);
  const OrphanedJob orphan = Orphan(spec);
  TS_EXPECT_ERROR(Job("dying", kUid, spec, 7, pool_, {}, &orphan), Code::kFailedPrecondition,
                  "job 'dying' cannot resume: the trainstreamd that held it was killed while it updated bucket(s) "
                  "[0, 1] (of 2) in place, so their weights and moments are partly of step 1 and partly of step 2");
  TS_EXPECT_ERROR(Job("dying", kUid, spec, 7, pool_, {}, &orphan), Code::kFailedPrecondition,
                  "Drop the job (Client.drop_job('dying')) and restart from your last checkpoint");
  EXPECT_TRUE(shm::Segment::Exists(orphan.state_segment));  // refused, not removed: dropping is the user's call
}

TEST_F(AdoptionTest, TwoHalvesKilledDuringAnUpdateResumeExactlyAtTheCommittedStep) {
  const shm::LayoutSpec spec = TwoParamSpec(1, 2);
  CopyDuringAnUpdate(spec);
  const OrphanedJob orphan = Orphan(spec);
  Job adopted("dying", kUid, spec, 7, pool_, {}, &orphan);
  RankClient client(adopted, 0);
  EXPECT_TRUE(client.attachment().initialized);
  EXPECT_EQ(client.attachment().completed_step, 1u);
  AdamWReference reference(spec);
  reference.Step(1, TestHParams());
  reference.ExpectMatches(client);
  RunStep(client, 2);
  reference.Step(2, TestHParams());
  reference.ExpectMatches(client);
}

// Its owner truncated the state while no daemon held it: mapping it and reading its buckets would fault,
// and it can never resume, so the adoption is refused naming why and the job's segments are removed.
TEST_F(AdoptionTest, AnOrphanItsOwnerTruncatedIsRefusedAndRemoved) {
  const shm::LayoutSpec spec = TwoParamSpec(1, 2);
  CopyDuringAnUpdate(spec);
  const OrphanedJob orphan = Orphan(spec);
  const int fd = shm_open(orphan.state_segment.c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 4096), 0);
  close(fd);
  TS_EXPECT_ERROR(Job("dying", kUid, spec, 7, pool_, {}, &orphan), Code::kFailedPrecondition,
                  fmt::format("job 'dying' cannot resume: its state segment {} holds 4096 bytes of the {} its layout "
                              "needs (its owner, uid {}, truncated it), so its optimizer state is gone. Its segments "
                              "were removed",
                              orphan.state_segment, shm::ComputeLayout(spec).state_bytes, kUid));
  EXPECT_FALSE(shm::Segment::Exists(orphan.state_segment));
}

// A bf16 parameter has an upload copy of its weights: adoption rewrites it from the committed master
// weights, whatever the dead daemon left in it.
TEST_F(AdoptionTest, AnAdoptedJobsUploadRegionIsRewrittenFromTheCommittedMasterWeights) {
  shm::LayoutSpec spec = TwoParamSpec(1, 2);
  spec.params[1].dtype = DType::kBFloat16;
  CopyDuringAnUpdate(spec, /*corrupt_upload=*/true);
  const OrphanedJob orphan = Orphan(spec);
  Job adopted("dying", kUid, spec, 7, pool_, {}, &orphan);
  RankClient client(adopted, 0);
  const shm::JobLayout& layout = adopted.layout();
  const shm::ParamLayout& param = layout.params[1];
  const shm::BucketLayout& bucket = layout.buckets[param.bucket];
  const float* master = client.state().Committed(param.bucket).master + bucket.elem_offset + param.offset_in_bucket;
  const auto* upload =
      reinterpret_cast<const uint16_t*>(client.state().upload + bucket.upload_offset) + param.offset_in_bucket;
  for (uint64_t i = 0; i < param.numel; ++i) ASSERT_EQ(upload[i], optimizer::FloatToBF16(master[i])) << i;
}

// Bucket 0 may collect step 2 while bucket 1 has not committed step 1, but not update it: its update
// waits for that commit, so no bucket is ever two steps past another.
TEST_F(CrashResumeTest, NoBucketUpdatesAStepBeforeEveryBucketCommittedTheStepBefore) {
  Job job("skew", kUid, TwoParamSpec(1, 2), 7, pool_);
  auto client = StartRank(job);
  AdamWReference reference(job.spec());
  DeliverBucketZeroOnly(*client, 1);
  client->SetHParams(2, TestHParams());
  client->SetGradient(2, 1);
  client->SendGradReady(0, 2);
  client->ExpectNoCompletion(200ms);
  EXPECT_EQ(client->state().bucket_state[0].Load().step, 1u);
  client->SetGradient(1, 0);
  client->SendGradReady(1, 1);
  std::vector<std::pair<uint32_t, uint64_t>> ready;
  for (int n = 0; n < 2; ++n) {
    const std::optional<shm::Message> message = client->Receive();
    ASSERT_TRUE(message.has_value());
    ready.emplace_back(message->bucket, message->step);
  }
  EXPECT_EQ(ready, (std::vector<std::pair<uint32_t, uint64_t>>{{1, 1}, {0, 2}}));
  reference.Step(1, TestHParams());
  reference.Step(2, TestHParams(), {false, true});
  reference.ExpectMatches(*client);
}

// With clipping, a bucket whose norm is in waits for the others'. A trainer that dies before sending
// them leaves nothing waiting: the step is discarded and the restarted trainer replays it.
TEST_F(CrashResumeTest, ARankLeavingWhileBucketsWaitForTheNormDiscardsTheStep) {
  for (uint32_t halves : {1u, 2u}) {
    SCOPED_TRACE(halves);
    shm::LayoutSpec spec = TwoParamSpec(1, halves);
    spec.max_grad_norm = 0.5;
    spec.speculative_clipping = halves == 2 ? shm::Speculation::kOn : shm::Speculation::kOff;
    Job job("clipped", kUid, spec, 7, pool_);
    auto client = StartRank(job);
    client->SetHParams(1, TestHParams());
    client->SetGradient(1, 1);
    client->SendGradReady(0, 1);
    client->ExpectNoCompletion(100ms);  // bucket 0 waits for bucket 1's norm
    client->Reattach();
    EXPECT_EQ(client->attachment().completed_step, 0u);
    RunStep(*client, 1);
    AdamWReference reference(spec);
    reference.Step(1, TestHParams(), {}, spec.max_grad_norm);
    reference.ExpectMatches(*client);
  }
}

}  // namespace
}  // namespace trainstream::daemon
