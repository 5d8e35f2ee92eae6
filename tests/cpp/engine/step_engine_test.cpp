// Tests of the step pipeline (daemon/control/job.h, daemon/engine/step_engine.h) driven in-process through real shared
// memory: a Job with a WorkerPool, a recording SessionSink, and a client side built from shm:: parts
// (the rank and state segments opened by name, the request and completion rings). Checks the AdamW
// result against a double-precision reference, multi-rank averaging, attach/detach, and that protocol
// violations fail only the offending session.
#include <gtest/gtest.h>
#include <spdlog/spdlog.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <latch>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <set>
#include <span>
#include <stop_token>
#include <string>
#include <thread>
#include <vector>

#include "daemon/config.h"
#include "daemon/control/job.h"
#include "daemon/control/job_registry.h"
#include "daemon/engine/rank_transfer.h"
#include "daemon/engine/session_sink.h"
#include "daemon/engine/step_trace.h"
#include "daemon/engine/worker_pool.h"
#include "shm/error.h"
#include "shm/job_layout.h"
#include "shm/message.h"
#include "shm/ring.h"
#include "shm/segment.h"
#include "tests/cpp/engine/adamw_reference.h"
#include "tests/cpp/engine/rank_client.h"
#include "tests/cpp/engine/recording_sink.h"
#include "tests/cpp/shm/test_support.h"

namespace trainstream::daemon {
namespace {

using namespace std::chrono_literals;
using shm::HParams;
using shm::Message;
using shm::MessageKind;

class StepEngineTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { spdlog::set_level(spdlog::level::err); }

  std::unique_ptr<Job> MakeJob(uint32_t world_size = 1, const std::string& name = "job") {
    return std::make_unique<Job>(name, static_cast<uint32_t>(getuid()), TwoParamSpec(world_size), /*seed=*/7, pool_);
  }
  // Attaches every rank of `job` and loads the initial state through rank 0.
  static std::vector<std::unique_ptr<RankClient>> StartJob(Job& job) {
    std::vector<std::unique_ptr<RankClient>> clients;
    for (uint32_t r = 0; r < job.spec().world_size; ++r) clients.push_back(std::make_unique<RankClient>(job, r));
    clients[0]->LoadInitialState();
    for (auto& client : clients) client->ExpectParamsReady(0);
    return clients;
  }
  // Every rank delivers `step`; every rank gets PARAMS_READY for every bucket.
  static void RunStep(const std::vector<std::unique_ptr<RankClient>>& clients, uint64_t step, const HParams& h) {
    for (auto& client : clients) client->DeliverStep(step, h);
    for (auto& client : clients) client->ExpectParamsReady(step);
  }

  WorkerPool pool_{2, /*pin_threads=*/false};
};

TEST_F(StepEngineTest, LoadStatePublishesEveryBucket) {
  auto job = MakeJob();
  RankClient client(*job, 0);
  EXPECT_FALSE(client.attachment().initialized);
  EXPECT_EQ(client.buckets(), 2u);
  client.LoadInitialState();
  client.ExpectParamsReady(0);
  AdamWReference(job->spec()).ExpectMatches(client);  // nothing updated: upload == master == initial
  EXPECT_EQ(client.state().header->initialized, 1u);
  EXPECT_EQ(client.state().header->completed_step.load(), 0u);
}

TEST_F(StepEngineTest, StepsMatchAdamW) {
  auto job = MakeJob();
  auto clients = StartJob(*job);
  AdamWReference reference(job->spec());
  RunStep(clients, 1, TestHParams(0.1));
  reference.Step(1, TestHParams(0.1));
  reference.ExpectMatches(*clients[0]);
  // Step 2 reads the other half of the double-buffered hyperparameters.
  RunStep(clients, 2, TestHParams(0.05));
  reference.Step(2, TestHParams(0.05));
  reference.ExpectMatches(*clients[0]);
  for (uint32_t b = 0; b < clients[0]->buckets(); ++b) {
    EXPECT_EQ(clients[0]->state().bucket_state[b].Load().step, 2u);
  }
  EXPECT_EQ(job->Info().engine.updates, 4u);
  EXPECT_TRUE(clients[0]->sink().warnings().empty());
  EXPECT_EQ(job->Info().engine.nonfinite_steps, 0u);
}

// Delivers step 1 with an inf and a NaN gradient (one in each bucket).
void DeliverNonFiniteStep(RankClient& client) {
  client.SetHParams(1, TestHParams());
  client.SetGradients(1);
  client.Grad(0)[7] = std::numeric_limits<float>::quiet_NaN();
  client.Grad(1)[3] = std::numeric_limits<float>::infinity();
  for (uint32_t b = 0; b < client.buckets(); ++b) client.SendGradReady(b, 1);
  client.ExpectParamsReady(1);
}

// Without clipping nothing reads the gradients before the update: the update notices (once per step).
TEST_F(StepEngineTest, NonFiniteGradientsAreReportedByTheUpdate) {
  auto job = MakeJob();
  auto clients = StartJob(*job);
  DeliverNonFiniteStep(*clients[0]);
  const std::vector<std::string> warnings = clients[0]->sink().warnings();
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("step 1: the update of bucket"), std::string::npos) << warnings[0];
  EXPECT_EQ(job->Info().engine.nonfinite_steps, 1u);
}

// With clipping the norm pass notices first; the update that follows does not report the step again.
TEST_F(StepEngineTest, NonFiniteGradientsAreReportedOnceWithClipping) {
  shm::LayoutSpec spec = TwoParamSpec(1);
  spec.max_grad_norm = 1.0;
  Job job("clipped", static_cast<uint32_t>(getuid()), spec, 7, pool_);
  auto clients = StartJob(job);
  DeliverNonFiniteStep(*clients[0]);
  const std::vector<std::string> warnings = clients[0]->sink().warnings();
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("step 1: gradients contain inf or NaN"), std::string::npos) << warnings[0];
  EXPECT_EQ(job.Info().engine.nonfinite_steps, 1u);
}

// The control plane finds a job, then attaches to it, outside the registry's lock. A job the
// registry forgot in between (dropped, expired) must refuse the attach: a rank on it would train on
// a job that Stats, DropJob and the quotas no longer see, and the next rank would make another.
TEST_F(StepEngineTest, AJobDroppedBetweenFindAndAttachRefusesTheAttach) {
  const Config config;
  JobRegistry registry(config, pool_);
  const auto uid = static_cast<uint32_t>(getuid());
  const JobRegistry::Found found = registry.FindOrCreate("raced", uid, TwoParamSpec(1), 7);
  registry.Drop("raced", uid, /*force=*/false);
  TS_EXPECT_ERROR(found.job->Attach(0, std::make_shared<RecordingSink>()), Code::kAborted,
                  "job 'raced' went away while rank 0 attached (it was dropped)");
  EXPECT_TRUE(registry.Jobs().empty());
}

TEST_F(StepEngineTest, ALayoutMismatchNamesTheOptionsThatDiffer) {
  const Config config;
  JobRegistry registry(config, pool_);
  const auto uid = static_cast<uint32_t>(getuid());
  registry.FindOrCreate("job", uid, TwoParamSpec(1), 7);
  shm::LayoutSpec other = TwoParamSpec(1);
  other.num_groups = 2;
  other.optimizer = shm::OptimizerKind::kAdam;
  TS_EXPECT_ERROR(registry.FindOrCreate("job", uid, other, 7), Code::kInvalidArgument,
                  "options differ (num_groups: job 1, this rank 2; optimizer: job AdamW, this rank Adam)");
}

TEST_F(StepEngineTest, DropRefusesAJobWithRanksUnlessForcedAndThenFailsThem) {
  const Config config;
  JobRegistry registry(config, pool_);
  const auto uid = static_cast<uint32_t>(getuid());
  const JobRegistry::Found found = registry.FindOrCreate("busy", uid, TwoParamSpec(1), 7);
  RankClient client(*found.job, 0);
  TS_EXPECT_ERROR(registry.Drop("busy", uid, false), Code::kFailedPrecondition, "1 attached rank(s)");
  EXPECT_EQ(registry.Jobs().size(), 1u);
  client.Reattach();  // refusing the drop left the job open
  registry.Drop("busy", uid, true);
  EXPECT_TRUE(registry.Jobs().empty());
  const std::optional<std::string> failure = client.sink().WaitForFailure();
  ASSERT_TRUE(failure.has_value());
  EXPECT_NE(failure->find("job 'busy' was dropped"), std::string::npos) << *failure;
}

TEST_F(StepEngineTest, IdleExpiryTakesOnlyJobsWithoutRanksAndTheyRefuseLateAttaches) {
  Config config;
  config.job_ttl_seconds = 0;
  JobRegistry registry(config, pool_);
  const auto uid = static_cast<uint32_t>(getuid());
  const JobRegistry::Found busy = registry.FindOrCreate("busy", uid, TwoParamSpec(1), 7);
  const RankClient client(*busy.job, 0);
  const JobRegistry::Found idle = registry.FindOrCreate("idle", uid, TwoParamSpec(1), 7);
  EXPECT_EQ(registry.ExpireIdle(), 1u);
  ASSERT_EQ(registry.Jobs().size(), 1u);
  EXPECT_EQ(registry.Jobs()[0]->name(), "busy");
  TS_EXPECT_ERROR(idle.job->Attach(0, std::make_shared<RecordingSink>()), Code::kAborted, "idle");
}

TEST_F(StepEngineTest, ParameterWithoutGradientIsLeftAlone) {
  auto job = MakeJob();
  auto clients = StartJob(*job);
  RankClient& client = *clients[0];
  AdamWReference reference(job->spec());
  client.SetHParams(1, TestHParams());
  client.SetGradients(1);
  client.view().presence[1] = 0;  // "b" got no gradient this step: no decay, no step count
  for (uint32_t b = 0; b < client.buckets(); ++b) client.SendGradReady(b, 1);
  client.ExpectParamsReady(1);
  reference.Step(1, TestHParams(), {true, false});
  reference.ExpectMatches(client);
  EXPECT_EQ(client.state().Committed(client.layout().params[0].bucket).param_state[0].step, 1u);
  EXPECT_EQ(client.state().Committed(client.layout().params[1].bucket).param_state[1].step, 0u);
}

// A client that has PARAMS_READY of every bucket of step t reads completed_step == t (the state segment is
// the client's record of progress). Many short steps with a client that busy-polls its completion ring
// while another thread sleeps on its doorbell (so every push is followed by a futex wake-up): a store
// that comes after the last PARAMS_READY is then seen late in most steps.
TEST_F(StepEngineTest, CompletedStepIsPublishedWithTheLastParamsReady) {
  auto job = MakeJob();
  auto clients = StartJob(*job);
  RankClient& client = *clients[0];
  std::jthread sleeper([&](const std::stop_token& stop) {
    shm::Doorbell& doorbell = client.view().header->completion_doorbell;
    while (!stop.stop_requested()) doorbell.Wait(doorbell.Seq(), 1ms);
  });
  int stale = 0;
  for (uint64_t step = 1; step <= 200; ++step) {
    client.DeliverStep(step, TestHParams(1e-3));
    uint32_t ready = 0;
    const auto deadline = std::chrono::steady_clock::now() + kReplyTimeout;
    while (ready < client.buckets() && std::chrono::steady_clock::now() < deadline) {
      if (std::optional<Message> message = client.Poll()) ready += message->kind == MessageKind::kParamsReady;
    }
    ASSERT_EQ(ready, client.buckets()) << "step " << step;
    if (client.state().header->completed_step.load() != step) ++stale;
  }
  EXPECT_EQ(stale, 0) << "completed_step lagged behind the last PARAMS_READY in " << stale << " of 200 steps";
}

TEST_F(StepEngineTest, AttachingATakenRankFailsWithAlreadyExists) {
  auto job = MakeJob();
  RankClient client(*job, 0);
  TS_EXPECT_ERROR(job->Attach(0, std::make_shared<RecordingSink>()), Code::kAlreadyExists, "rank 0");
  TS_EXPECT_ERROR(job->Attach(1, std::make_shared<RecordingSink>()), Code::kInvalidArgument, "rank 1");
  EXPECT_EQ(job->attached_ranks(), 1u);
}

TEST_F(StepEngineTest, DetachThenReattachResumesFromTheKeptState) {
  auto job = MakeJob();
  auto clients = StartJob(*job);
  AdamWReference reference(job->spec());
  RunStep(clients, 1, TestHParams());
  reference.Step(1, TestHParams());

  clients[0]->Reattach();
  EXPECT_TRUE(clients[0]->attachment().initialized);
  EXPECT_EQ(clients[0]->attachment().completed_step, 1u);
  EXPECT_EQ(job->attached_ranks(), 1u);
  RunStep(clients, 2, TestHParams());
  reference.Step(2, TestHParams());  // moments and step counts survived the detach
  reference.ExpectMatches(*clients[0]);
}

TEST_F(StepEngineTest, TwoRanksWaitForBothAndAverageTheirGradients) {
  auto job = MakeJob(/*world_size=*/2);
  auto clients = StartJob(*job);
  AdamWReference reference(job->spec());
  clients[0]->DeliverStep(1, TestHParams());
  clients[0]->ExpectNoCompletion(200ms);
  clients[1]->ExpectNoCompletion(0ms);
  AdamWReference(job->spec()).ExpectMatches(*clients[0]);  // still the initial weights
  clients[1]->DeliverStep(1, TestHParams());
  clients[0]->ExpectParamsReady(1);
  clients[1]->ExpectParamsReady(1);
  reference.Step(1, TestHParams());
  reference.ExpectMatches(*clients[0]);
  reference.ExpectMatches(*clients[1]);
}

// Two NUMA nodes (given to the pool, this machine may have one): the state is first touched and every
// pass is split by node, and the updates are the same.
TEST_F(StepEngineTest, TwoNumaNodesGiveTheSameUpdates) {
  WorkerPool numa(4, /*pin_threads=*/false, /*thread_nodes=*/{0, 0, 1, 1});
  ASSERT_EQ(numa.nodes(), 2u);
  Job job("job", static_cast<uint32_t>(getuid()), TwoParamSpec(2), 7, numa);
  auto clients = StartJob(job);
  AdamWReference reference(job.spec());
  for (uint64_t step = 1; step <= 3; ++step) {
    RunStep(clients, step, TestHParams());
    reference.Step(step, TestHParams());
  }
  reference.ExpectMatches(*clients[0]);
  reference.ExpectMatches(*clients[1]);
}

// A rank that detaches and re-attaches while an update that read its old gradients is still queued: the
// attach waits for that update (the step the rank resumes from must not move under it: the update
// commits step 1, so the rank resumes after step 1), and the old rank segment, released when the update
// finishes, must not take the new segment's name along.
TEST_F(StepEngineTest, ReattachDuringAnInFlightUpdateWaitsForItAndKeepsTheNewRankSegment) {
  WorkerPool single(1, false);
  Job job("job", static_cast<uint32_t>(getuid()), TwoParamSpec(1), 7, single);
  std::vector<std::unique_ptr<RankClient>> clients;
  clients.push_back(std::make_unique<RankClient>(job, 0));
  clients[0]->LoadInitialState();
  clients[0]->ExpectParamsReady(0);

  std::latch started(1);
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  single.Submit(
      1,
      [&](size_t) {
        started.count_down();
        released.wait();
      },
      [] {}, 1000);
  started.wait();  // the only worker is busy: the update below stays queued
  clients[0]->DeliverStep(1, TestHParams());
  const shm::RingHeader* requests = clients[0]->view().request_ring;
  ASSERT_TRUE(trainstream::testing::PollUntil([&] { return requests->tail.load() == requests->head.load(); }));

  std::thread releaser([&] {
    std::this_thread::sleep_for(100ms);  // the attach below is waiting by then (it cannot return before)
    release.set_value();
  });
  clients[0]->Reattach();
  releaser.join();
  EXPECT_EQ(clients[0]->attachment().completed_step, 1u);
  const std::string name = clients[0]->attachment().rank_segment;
  std::this_thread::sleep_for(100ms);
  EXPECT_TRUE(shm::Segment::Exists(name)) << "the re-attached rank's segment " << name << " was unlinked";
  EXPECT_NO_THROW(shm::Segment::Open(name));
  RunStep(clients, 2, TestHParams());  // and it trains on
}

// A RankTransfer whose "GPU" is host memory: copies are memcpy on a thread of its own, in submission
// order, so the engine's cuda-ipc stages (pull before delivery, push after the update and after
// WEIGHTS_WANTED) run on machines without a GPU. ReachEvents(false) models a trainer's GPU that has
// not reached its events (or never will: its process died): work that waits for them waits.
class FakeGpu final : public RankTransfer {
 public:
  // `offsets`: where each bucket lies in the flat parameter buffer (nullopt: off the GPU).
  FakeGpu(size_t params_bytes, uint32_t slots, size_t slot_bytes, std::vector<std::optional<uint64_t>> offsets)
      : params(params_bytes),
        staging(slots * slot_bytes),
        slots_(slots),
        slot_bytes_(slot_bytes),
        offsets_(std::move(offsets)) {}
  ~FakeGpu() override {
    Set(queue_->stopping, true);
    // The engine's callbacks hold the rank (and so this) too: when the last of them lets go on the
    // queue's own thread, that thread must not join itself. It ends alone; its state outlives this.
    if (thread_.get_id() == std::this_thread::get_id()) {
      thread_.detach();
    } else {
      thread_.join();
    }
  }
  [[nodiscard]] uint32_t staging_slots() const override { return slots_; }
  [[nodiscard]] uint64_t slot_bytes() const override { return slot_bytes_; }
  [[nodiscard]] uint32_t weights_wanted_events() const override { return 2; }
  void PullGradients(uint32_t slot, void* host, size_t bytes, Done done) override {
    {
      std::lock_guard lock(queue_->mutex);
      pulled_into_.insert(host);
    }
    Run([=, this] { std::memcpy(host, staging.data() + slot * slot_bytes_, bytes); }, std::move(done), true);
  }
  void AwaitWeightsWanted(uint32_t, Done done) override {
    Run([] {}, std::move(done), true);
  }
  [[nodiscard]] std::optional<uint64_t> ParamsOffset(uint32_t bucket) const override { return offsets_.at(bucket); }
  void PushWeights(uint64_t offset, const void* host, size_t bytes, Done done) override {
    ++pushes;
    {
      std::lock_guard lock(queue_->mutex);
      push_ranges_.emplace_back(offset, bytes);
    }
    Run([=, this] { std::memcpy(params.data() + offset, host, bytes); }, std::move(done), false);
  }
  void Abandon() override { Set(queue_->abandoned, true); }
  void WillCopy(std::vector<HostRange> ranges) override {
    will_copy = std::move(ranges);
    told = true;
  }
  void ReleaseHost(const void*, size_t) override {}  // nothing is page-locked
  void ReachEvents(bool reached) { Set(queue_->events_reached, reached); }
  // The rank's view of parameter p: its place in the flat parameter buffer (its bucket must be there).
  std::span<float> Param(const shm::JobLayout& layout, uint32_t p) {
    return {reinterpret_cast<float*>(params.data() + offsets_.at(layout.params[p].bucket).value()) +
                layout.params[p].offset_in_bucket,
            layout.params[p].numel};
  }
  std::byte* Slot(uint32_t slot) { return staging.data() + slot * slot_bytes_; }
  [[nodiscard]] int given_up() const { return queue_->given_up; }  // work failed: the rank was abandoned
  [[nodiscard]] bool PulledInto(const void* host) const {
    std::lock_guard lock(queue_->mutex);
    return pulled_into_.contains(host);
  }
  // Every push so far, in submission order: (offset in the parameter buffer, bytes).
  [[nodiscard]] std::vector<std::pair<uint64_t, size_t>> PushRanges() const {
    std::lock_guard lock(queue_->mutex);
    return push_ranges_;
  }

  std::vector<std::byte> params, staging;
  std::atomic<int> pushes{0};
  std::vector<HostRange> will_copy;  // what the engine said the copies will touch
  std::atomic<bool> told{false};     // that it said it (readable while the engine runs)

 private:
  struct Work {
    std::function<void()> copy;
    Done done;
    bool waits_for_event;
  };
  // What the copying thread uses, shared with it so that it may outlive this object (see ~FakeGpu).
  struct Queue {
    std::mutex mutex;
    std::condition_variable wake;
    std::deque<Work> work;
    bool stopping = false;
    bool abandoned = false;
    bool events_reached = true;
    std::atomic<int> given_up{0};
  };
  void Set(bool& flag, bool value) {
    {
      std::lock_guard lock(queue_->mutex);
      flag = value;
    }
    queue_->wake.notify_all();
  }
  void Run(std::function<void()> copy, Done done, bool waits_for_event) {
    {
      std::lock_guard lock(queue_->mutex);
      queue_->work.push_back(Work{std::move(copy), std::move(done), waits_for_event});
    }
    queue_->wake.notify_all();
  }
  static void Loop(Queue& queue) {
    for (;;) {
      std::unique_lock lock(queue.mutex);
      queue.wake.wait(lock, [&] {
        return queue.stopping || (!queue.work.empty() &&
                                  (queue.abandoned || queue.events_reached || !queue.work.front().waits_for_event));
      });
      if (queue.work.empty()) return;  // stopping
      Work work = std::move(queue.work.front());
      queue.work.pop_front();
      const bool abandoned = queue.abandoned;
      lock.unlock();
      if (abandoned) {
        ++queue.given_up;
        work.done(Error(Code::kUnavailable, "abandoned"));
        continue;
      }
      work.copy();
      work.done(std::nullopt);
    }
  }

  const uint32_t slots_;
  const size_t slot_bytes_;
  const std::vector<std::optional<uint64_t>> offsets_;
  std::set<const void*> pulled_into_;                     // guarded by queue_->mutex
  std::vector<std::pair<uint64_t, size_t>> push_ranges_;  // guarded by queue_->mutex
  std::shared_ptr<Queue> queue_ = std::make_shared<Queue>();
  std::thread thread_{[queue = queue_] { Loop(*queue); }};
};

class CudaIpcStagesTest : public StepEngineTest {
 protected:
  void SetUp() override {
    job_ = std::make_unique<Job>("job", static_cast<uint32_t>(getuid()), Spec(), /*seed=*/7, Pool(), PeerConfig{},
                                 nullptr, nullptr, SnapshotSchedule{}, TraceDir());
    client_ = std::make_unique<RankClient>(*job_, 0);
    gpu_ = MakeGpu();
    job_->SetTransfer(0, gpu_, "fake-gpu");
  }
  [[nodiscard]] std::shared_ptr<FakeGpu> MakeGpu() const {
    size_t largest = 0;
    for (const shm::BucketLayout& bucket : layout().buckets) largest = std::max<size_t>(largest, bucket.bytes());
    return std::make_shared<FakeGpu>(layout().grad_bytes, kSlots, SlotBytes(largest), ParamOffsets());
  }
  [[nodiscard]] virtual shm::LayoutSpec Spec() const { return TwoParamSpec(1); }
  virtual WorkerPool& Pool() { return pool_; }
  [[nodiscard]] virtual std::string TraceDir() const { return ""; }
  [[nodiscard]] virtual size_t SlotBytes(size_t largest_bucket) const { return largest_bucket; }
  // Where the rank keeps each bucket on its GPU: by default at its offset in the gradient region.
  [[nodiscard]] virtual std::vector<std::optional<uint64_t>> ParamOffsets() const {
    std::vector<std::optional<uint64_t>> offsets;
    for (const shm::BucketLayout& bucket : layout().buckets) offsets.emplace_back(bucket.grad_offset);
    return offsets;
  }
  [[nodiscard]] const shm::JobLayout& layout() const { return job_->layout(); }
  // Bucket b's fp32 master weights in one state half, as the daemon maps them.
  [[nodiscard]] HostRange Master(uint32_t b, const shm::StateHalf& half) const {
    return HostRange::Of(half.master + layout().buckets[b].elem_offset, layout().buckets[b].bytes());
  }
  // The master weights the transfer must be told of, for each bucket of `on_gpu` in order, those its
  // first update writes, then, with two state halves, the other half's. Taken before the first step,
  // which flips the halves.
  [[nodiscard]] std::vector<HostRange> MastersInCopyOrder(const std::vector<uint32_t>& on_gpu) const {
    const shm::StateView state = job_->ViewState();
    std::vector<HostRange> masters, second_half;
    for (uint32_t b : on_gpu) {
      masters.push_back(Master(b, state.Other(b)));
      if (state.halves[0].master != state.halves[1].master) second_half.push_back(Master(b, state.Committed(b)));
    }
    masters.insert(masters.end(), second_half.begin(), second_half.end());
    return masters;
  }
  // After a step: `will_copy` holds each bucket of `on_gpu`'s gradients (where the engine pulled them)
  // and its first update's master weights, then the second half's (`masters`, MastersInCopyOrder).
  void ExpectWillCopy(const std::vector<uint32_t>& on_gpu, const std::vector<HostRange>& masters) const {
    ASSERT_EQ(gpu_->will_copy.size(), on_gpu.size() + masters.size());
    for (size_t i = 0; i < on_gpu.size(); ++i) {
      const HostRange grads = gpu_->will_copy[2 * i];
      EXPECT_EQ(grads.bytes, layout().buckets[on_gpu[i]].bytes()) << "bucket " << on_gpu[i];
      EXPECT_TRUE(gpu_->PulledInto(grads.data)) << "bucket " << on_gpu[i];
      EXPECT_EQ(gpu_->will_copy[2 * i + 1], masters[i]) << "bucket " << on_gpu[i];
    }
    EXPECT_TRUE(std::equal(masters.begin() + on_gpu.size(), masters.end(),
                           gpu_->will_copy.end() - (masters.size() - on_gpu.size())));
  }
  void RunFirstStep() {
    client_->LoadInitialState();
    WantWeights(0);
    client_->ExpectParamsReady(0);
    StageStep(1);
    WantWeights(1);
    ReceiveFrees();
    client_->ExpectParamsReady(1);
  }
  void WantWeights(uint64_t step, uint16_t flags = 0) {
    client_->Send(Message{.kind = MessageKind::kWeightsWanted, .flags = flags, .step = step, .slot = wants_++ % 2});
  }
  // Gradients of `step`, bucket by bucket and slot-sized piece by piece, through the staging slots in
  // turn, each announced by GRAD_READY; a slot is reused once its STAGING_FREE has arrived. The frees of
  // the last pieces are left for ReceiveFrees().
  void StageStep(uint64_t step) {
    client_->SetHParams(step, TestHParams());
    for (uint32_t b = 0; b < client_->buckets(); ++b) StageBucket(step, b);
  }
  void StageBucket(uint64_t step, uint32_t b) { StagePieces(step, b, 0, UINT32_MAX); }
  // Pieces [first, end) of bucket b's gradients of `step` (as many as there are).
  void StagePieces(uint64_t step, uint32_t b, uint32_t first, uint32_t end) {
    const shm::BucketLayout& bucket = layout().buckets[b];
    std::vector<float> gradients(bucket.bytes() / sizeof(float));
    for (uint32_t p : bucket.params) {
      const shm::ParamLayout& param = layout().params[p];
      for (uint64_t i = 0; i < param.numel; ++i) gradients[param.offset_in_bucket + i] = Gradient(p, 0, step, i);
      client_->view().presence[p] = 1;
    }
    const auto* bytes = reinterpret_cast<const std::byte*>(gradients.data());
    for (uint32_t piece = first; piece < end && piece * gpu_->slot_bytes() < bucket.bytes(); ++piece) {
      if (unfreed_ == kSlots) ReceiveFrees(1);
      const uint32_t slot = next_slot_++ % kSlots;
      const uint64_t offset = piece * gpu_->slot_bytes();
      std::memcpy(gpu_->Slot(slot), bytes + offset, std::min(gpu_->slot_bytes(), bucket.bytes() - offset));
      client_->Send(Message{.kind = MessageKind::kGradReady,
                            .flags = shm::kFinalMicro,
                            .bucket = b,
                            .step = step,
                            .slot = slot,
                            .piece = piece});
      ++unfreed_;
    }
  }
  // STAGING_FREE for `count` pieces still in the slots (default: all of them).
  std::vector<Message> ReceiveFrees(std::optional<uint32_t> count = std::nullopt) {
    const uint32_t n = count.value_or(unfreed_);
    unfreed_ -= n;
    return ReceiveAll(MessageKind::kStagingFree, n);
  }
  // Every completion of one kind, `count` of them, in any order (others fail the test).
  std::vector<Message> ReceiveAll(MessageKind kind, uint32_t count) {
    std::vector<Message> received;
    while (received.size() < count) {
      const std::optional<Message> message = client_->Receive();
      if (!message) break;
      EXPECT_EQ(message->kind, kind) << "bucket " << message->bucket << " step " << message->step;
      received.push_back(*message);
    }
    EXPECT_EQ(received.size(), count);
    return received;
  }
  // The initial load, then three steps through the GPU buffers, checked against AdamW.
  void ExpectStepsMatchAdamW() {
    client_->LoadInitialState();
    WantWeights(0);
    client_->ExpectParamsReady(0);
    AdamWReference reference(job_->spec());
    for (uint64_t step = 1; step <= 3; ++step) {
      StageStep(step);
      WantWeights(step);  // optimizer.step() right after backward: the usual order
      ReceiveFrees();
      client_->ExpectParamsReady(step);
      reference.Step(step, TestHParams());
    }
    reference.ExpectMatches(*client_);
    ExpectGpuHoldsMaster();
    EXPECT_TRUE(client_->sink().failures().empty());
  }
  void ExpectGpuHoldsMaster() {
    for (uint32_t p = 0; p < layout().params.size(); ++p) {
      if (!gpu_->ParamsOffset(layout().params[p].bucket)) continue;  // kept off the GPU
      const std::span<float> master = client_->Master(p), gpu = gpu_->Param(layout(), p);
      EXPECT_TRUE(std::equal(master.begin(), master.end(), gpu.begin())) << "param " << p;
    }
  }

  std::unique_ptr<Job> job_;
  std::unique_ptr<RankClient> client_;
  std::shared_ptr<FakeGpu> gpu_;
  uint32_t wants_ = 0;
  uint32_t next_slot_ = 0;
  uint32_t unfreed_ = 0;  // pieces announced whose STAGING_FREE the test has not received
  static constexpr uint32_t kSlots = 2;
};

TEST_F(CudaIpcStagesTest, WeightsReachTheGpuOnlyOnceWanted) {
  client_->LoadInitialState();
  client_->ExpectNoCompletion(100ms);  // loaded, but the rank has not asked for weights yet
  WantWeights(0);
  client_->ExpectParamsReady(0);
  ExpectGpuHoldsMaster();
  EXPECT_TRUE(trainstream::testing::PollUntil([&] { return client_->view().header->weights_wanted_waits == 1; }));

  StageStep(1);
  std::vector<Message> freed = ReceiveFrees();  // both slots copied out
  std::vector<uint32_t> slots;
  slots.reserve(freed.size());
  for (const Message& m : freed) slots.push_back(m.slot);
  std::sort(slots.begin(), slots.end());
  EXPECT_EQ(slots, (std::vector<uint32_t>{0, 1}));
  client_->ExpectNoCompletion(100ms);  // updated, but optimizer.step() has not been called
  AdamWReference reference(job_->spec());
  reference.Step(1, TestHParams());
  reference.ExpectMatches(*client_);
  WantWeights(1);
  client_->ExpectParamsReady(1);
  ExpectGpuHoldsMaster();
}

TEST_F(CudaIpcStagesTest, StepsMatchAdamWThroughTheGpuBuffers) {
  ExpectStepsMatchAdamW();
}

// Speculative clipping through the GPU buffers: a bucket whose speculated update is written goes to the
// GPU before the step's norm is known, and is announced only once the step commits. Without clipping
// that push is the bucket's only one; with clipping the redone weights are pushed again.
TEST_F(CudaIpcStagesTest, TheTransferIsToldWhatItsCopiesWillTouch) {
  const std::vector<HostRange> masters = MastersInCopyOrder({0, 1});
  RunFirstStep();
  ExpectWillCopy({0, 1}, masters);
}

TEST_F(CudaIpcStagesTest, ANewJobsTransferIsToldOnlyOnceItsSeedIsIn) {
  EXPECT_TRUE(gpu_->will_copy.empty());  // registered before the seed: nothing locked beside its copy
  client_->LoadInitialState();
  WantWeights(0);
  client_->ExpectParamsReady(0);
  EXPECT_FALSE(gpu_->will_copy.empty());
}

TEST_F(CudaIpcStagesTest, ARestartedRanksTransferIsToldAtOnce) {
  RunFirstStep();
  client_->Reattach();  // a restarted trainer: the job's state is in, no seed comes
  const std::shared_ptr<FakeGpu> restarted = MakeGpu();
  job_->SetTransfer(0, restarted, "fake-gpu");
  EXPECT_EQ(restarted->will_copy.size(), gpu_->will_copy.size());
}

class CudaIpcTwoRanksTest : public CudaIpcStagesTest {
 protected:
  [[nodiscard]] shm::LayoutSpec Spec() const override { return TwoParamSpec(2); }
};

TEST_F(CudaIpcTwoRanksTest, ARankRegisteringWhileTheSeedLoadsIsToldAtOnce) {
  RankClient second(*job_, 1);
  // Every worker held until released, and the test ends only once each held task has ended: a worker
  // that reached its task after the release (a loaded machine) waited on a latch already gone (a hang
  // under ctest -j2, 1 in 400 runs with three busy loops beside it).
  struct HeldWorkers {
    std::latch release{1};
    std::latch ended;
    bool released = false;
    explicit HeldWorkers(size_t n) : ended(static_cast<std::ptrdiff_t>(n)) {}
    void Release() {
      if (!std::exchange(released, true)) release.count_down();
    }
    ~HeldWorkers() {
      Release();
      ended.wait();
    }
  } held(pool_.threads());
  for (size_t t = 0; t < pool_.threads(); ++t) {
    pool_.Submit(
        1, [&held](size_t) { held.release.wait(); }, [&held] { held.ended.count_down(); });
  }
  client_->LoadInitialState();  // its upload waits behind the held workers: the load stays running
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!gpu_->told && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_TRUE(gpu_->told);  // the engine took the LOAD_STATE in
  const std::shared_ptr<FakeGpu> late = MakeGpu();
  job_->SetTransfer(1, late, "fake-gpu");
  EXPECT_TRUE(late->told);
  held.Release();
  WantWeights(0);
  client_->ExpectParamsReady(0);
}

class CudaIpcSpeculationTest : public CudaIpcStagesTest, public ::testing::WithParamInterface<double> {
 protected:
  [[nodiscard]] shm::LayoutSpec Spec() const override {
    shm::LayoutSpec spec = TwoParamSpec(1, /*state_halves=*/2);
    spec.max_grad_norm = GetParam();
    spec.speculative_clipping = shm::Speculation::kOn;
    return spec;
  }
};

TEST_P(CudaIpcSpeculationTest, ASpeculatedBucketReachesTheGpuBeforeTheNormAndIsAnnouncedAtItsCommit) {
  const bool clips = GetParam() < 1.0;  // the gradients' norm is about 12
  client_->LoadInitialState();
  WantWeights(0);
  client_->ExpectParamsReady(0);
  const int initial_pushes = gpu_->pushes;
  client_->SetHParams(1, TestHParams());
  StageBucket(1, 0);
  WantWeights(1);
  // Bucket 0 speculated and is on the GPU; the norm still waits for bucket 1, and so does its PARAMS_READY.
  EXPECT_TRUE(trainstream::testing::PollUntil([&] { return gpu_->pushes == initial_pushes + 1; }));
  ReceiveFrees();
  client_->ExpectNoCompletion(100ms);
  StageBucket(1, 1);
  ReceiveFrees();
  client_->ExpectParamsReady(1);
  EXPECT_EQ(gpu_->pushes, initial_pushes + (clips ? 3 : 2));  // bucket 0 again after its redo
  AdamWReference reference(job_->spec());
  reference.Step(1, TestHParams(), {}, GetParam());
  EXPECT_EQ(reference.last_clip() < 1.0, clips);
  reference.ExpectMatches(*client_);
  ExpectGpuHoldsMaster();
  EXPECT_EQ(job_->Info().engine.redone_steps, clips ? 1u : 0u);
  EXPECT_TRUE(client_->sink().failures().empty());
}

TEST_P(CudaIpcSpeculationTest, BothStateHalvesMasterWeightsAreToldInTheOrderOfTwoSteps) {
  const std::vector<HostRange> masters = MastersInCopyOrder({0, 1});
  ASSERT_EQ(masters.size(), 4u);
  RunFirstStep();
  ExpectWillCopy({0, 1}, masters);
}

INSTANTIATE_TEST_SUITE_P(MaxGradNorm, CudaIpcSpeculationTest, ::testing::Values(1e6, 0.5));

// Weight paging keeps a bucket off the GPU: the daemon announces its weights without pushing them, and
// pushes the others as usual.
class CudaIpcPagedBucketTest : public CudaIpcStagesTest {
 protected:
  [[nodiscard]] std::vector<std::optional<uint64_t>> ParamOffsets() const override {
    std::vector<std::optional<uint64_t>> offsets = CudaIpcStagesTest::ParamOffsets();
    offsets.front() = std::nullopt;
    return offsets;
  }
};

TEST_F(CudaIpcPagedBucketTest, ABucketOffTheGpuIsAnnouncedAndNeverPushed) {
  const auto buckets = static_cast<uint32_t>(layout().buckets.size());
  ASSERT_GT(buckets, 1u);
  std::vector<uint32_t> on_gpu(buckets - 1);
  std::iota(on_gpu.begin(), on_gpu.end(), 1);
  const std::vector<HostRange> masters = MastersInCopyOrder(on_gpu);
  client_->LoadInitialState();
  WantWeights(0);
  client_->ExpectParamsReady(0);
  AdamWReference reference(job_->spec());
  for (uint64_t step = 1; step <= 3; ++step) {
    StageStep(step);
    WantWeights(step);
    // The bucket off the GPU is announced as soon as it is updated, maybe before the last staging
    // slot is free: every STAGING_FREE and one PARAMS_READY per bucket, in any order.
    std::vector<int> ready(buckets, 0);
    for (uint32_t frees = unfreed_, n = 0; n < frees + buckets; ++n) {
      const std::optional<Message> message = client_->Receive();
      ASSERT_TRUE(message.has_value()) << "step " << step;
      if (message->kind == MessageKind::kParamsReady) {
        ASSERT_EQ(message->step, step);
        ++ready.at(message->bucket);
      } else {
        ASSERT_EQ(message->kind, MessageKind::kStagingFree);
      }
    }
    unfreed_ = 0;
    EXPECT_EQ(ready, std::vector<int>(buckets, 1));
    reference.Step(step, TestHParams());
  }
  reference.ExpectMatches(*client_);
  ExpectGpuHoldsMaster();                                      // the buckets on the GPU
  EXPECT_EQ(gpu_->pushes, 4 * static_cast<int>(buckets - 1));  // the load and three steps, never bucket 0
  EXPECT_TRUE(client_->sink().failures().empty());
  ExpectWillCopy(on_gpu, masters);  // nor is it page-locked ahead
}

TEST_F(CudaIpcStagesTest, ADetachedRanksUnreachedEventsHoldNothing) {
  client_->LoadInitialState();
  WantWeights(0);
  client_->ExpectParamsReady(0);
  gpu_->ReachEvents(false);  // the trainer died before its GPU computed these gradients
  StageStep(1);
  client_->ExpectNoCompletion(100ms);
  job_->Detach(0);
  EXPECT_TRUE(trainstream::testing::PollUntil([&] { return gpu_->given_up() == 2; }));  // both pulls
  gpu_->ReachEvents(true);  // had they not been given up, the engine could still end
}

TEST_F(CudaIpcStagesTest, TheLoadersOwnWeightsAreNotPushedBack) {
  client_->LoadInitialState();
  WantWeights(0, shm::kWeightsOnGpu);  // rank 0 wrote the master weights from its GPU's parameters
  client_->ExpectParamsReady(0);
  EXPECT_EQ(gpu_->pushes.load(), 0);
  StageStep(1);
  WantWeights(1);
  ReceiveFrees();
  client_->ExpectParamsReady(1);  // the step's new weights are pushed as usual
  EXPECT_EQ(gpu_->pushes.load(), static_cast<int>(client_->buckets()));
  ExpectGpuHoldsMaster();
}

TEST_F(CudaIpcStagesTest, AClaimArrivingAfterTheLoadCompletedCountsToo) {
  client_->LoadInitialState();
  ASSERT_TRUE(trainstream::testing::PollUntil([&] { return client_->state().header->initialized == 1; }));
  WantWeights(0, shm::kWeightsOnGpu);
  client_->ExpectParamsReady(0);
  EXPECT_EQ(gpu_->pushes.load(), 0);
}

TEST_F(CudaIpcStagesTest, AStagingSlotOutOfRangeFailsTheSession) {
  client_->LoadInitialState();
  WantWeights(0);
  client_->ExpectParamsReady(0);
  client_->SetHParams(1, TestHParams());
  client_->Send(Message{.kind = MessageKind::kGradReady, .flags = shm::kFinalMicro, .bucket = 0, .step = 1, .slot = 7});
  const std::optional<std::string> failure = client_->sink().WaitForFailure();
  ASSERT_TRUE(failure.has_value());
  EXPECT_NE(failure->find("staging slot 7"), std::string::npos) << *failure;
}

// Staging slots a third of the largest bucket's size: that bucket reaches the daemon in three pieces.
class CudaIpcPiecesTest : public CudaIpcStagesTest {
 protected:
  [[nodiscard]] size_t SlotBytes(size_t largest_bucket) const override {
    return (largest_bucket / 3 + 255) / 256 * 256;
  }
  [[nodiscard]] uint32_t LargestBucket() const {
    const auto& buckets = layout().buckets;
    return static_cast<uint32_t>(std::max_element(buckets.begin(), buckets.end(),
                                                  [](const auto& a, const auto& b) { return a.bytes() < b.bytes(); }) -
                                 buckets.begin());
  }
};

TEST_F(CudaIpcPiecesTest, BucketsLargerThanASlotMatchAdamW) {
  ASSERT_GT(layout().buckets[LargestBucket()].bytes(), 2 * gpu_->slot_bytes());
  ExpectStepsMatchAdamW();
}

TEST_F(CudaIpcPiecesTest, APieceOutOfOrderFailsTheSession) {
  client_->LoadInitialState();
  WantWeights(0);
  client_->ExpectParamsReady(0);
  client_->SetHParams(1, TestHParams());
  const uint32_t b = LargestBucket();
  client_->Send(Message{
      .kind = MessageKind::kGradReady, .flags = shm::kFinalMicro, .bucket = b, .step = 1, .slot = 0, .piece = 1});
  const std::optional<std::string> failure = client_->sink().WaitForFailure();
  ASSERT_TRUE(failure.has_value());
  EXPECT_NE(failure->find(fmt::format("piece 1 of bucket {} (3 pieces), but piece 0 is the next one", b)),
            std::string::npos)
      << *failure;
}

// trainstreamd --trace-dir: a job's step timeline, written when the job ends, holds every piece's
// GRAD_READY and pull, every block of every update, each push and commit, in the order the protocol
// allows: a piece is pulled after its GRAD_READY, a bucket's update reads only pulled gradients, commits
// after its last block, and is pushed after its commit.
class CudaIpcTracedTest : public CudaIpcPiecesTest {
 protected:
  void TearDown() override { std::filesystem::remove_all(dir_); }
  [[nodiscard]] std::string TraceDir() const override { return dir_; }
  // The spans of one kind for (bucket, step), as the trace file has them.
  struct Spans {
    std::vector<std::pair<int64_t, int64_t>> of[10];
    [[nodiscard]] int64_t FirstBegin(SpanKind kind) const { return std::ranges::min(of[Index(kind)]).first; }
    [[nodiscard]] int64_t LastEnd(SpanKind kind) const {
      return std::ranges::max(of[Index(kind)], {}, [](const auto& span) { return span.second; }).second;
    }
    static size_t Index(SpanKind kind) { return static_cast<size_t>(kind); }
  };
  const std::string dir_ = [] {
    std::string dir = (std::filesystem::temp_directory_path() / "ts-trace-XXXXXX").string();
    return std::string(mkdtemp(dir.data()));
  }();
};

TEST_F(CudaIpcTracedTest, TheTraceHoldsEachStepsPullsUpdatesAndPushesInProtocolOrder) {
  ExpectStepsMatchAdamW();  // steps 1-3
  const std::string key = job_->key();
  const std::vector<shm::BucketLayout> buckets = layout().buckets;
  client_.reset();
  job_.reset();  // the engine stops and writes its trace
  std::ifstream file(fmt::format("{}/trace-{}.json", dir_, key));
  ASSERT_TRUE(file.is_open());
  const nlohmann::json trace = nlohmann::json::parse(file);
  EXPECT_EQ(trace["dropped"], 0);
  EXPECT_EQ(trace["kinds"], nlohmann::json({"pull", "update-block", "push", "weights-wanted", "commit", "grad-ready",
                                            "accumulate", "more-micro", "accumulate-block", "norm-block"}));
  std::map<std::pair<uint64_t, uint64_t>, Spans> spans;  // by (bucket, step)
  size_t wanted = 0;
  for (const auto& span : trace["spans"]) {
    const auto kind = span[0].get<uint32_t>();
    ASSERT_LT(kind, 10u);
    ASSERT_LE(span[4].get<int64_t>(), span[5].get<int64_t>());
    if (kind == static_cast<uint32_t>(SpanKind::kWeightsWanted)) {
      ++wanted;
      continue;
    }
    spans[{span[1], span[2]}].of[kind].emplace_back(span[4], span[5]);
  }
  EXPECT_EQ(wanted, 4u);  // steps 0-3
  for (uint32_t b = 0; b < buckets.size(); ++b) {
    for (uint64_t step = 1; step <= 3; ++step) {
      SCOPED_TRACE(fmt::format("bucket {} step {}", b, step));
      const Spans& s = spans[{b, step}];
      const uint64_t pieces = (buckets[b].bytes() + gpu_->slot_bytes() - 1) / gpu_->slot_bytes();
      EXPECT_EQ(s.of[Spans::Index(SpanKind::kGradReady)].size(), pieces);
      EXPECT_EQ(s.of[Spans::Index(SpanKind::kPull)].size(), pieces);
      EXPECT_GE(s.FirstBegin(SpanKind::kPull), s.FirstBegin(SpanKind::kGradReady));
      ASSERT_FALSE(s.of[Spans::Index(SpanKind::kUpdateBlock)].empty());
      ASSERT_EQ(s.of[Spans::Index(SpanKind::kCommit)].size(), 1u);
      ASSERT_FALSE(s.of[Spans::Index(SpanKind::kPush)].empty());
      EXPECT_GE(s.FirstBegin(SpanKind::kUpdateBlock), s.LastEnd(SpanKind::kPull));  // one state half: not streamed
      EXPECT_GE(s.FirstBegin(SpanKind::kCommit), s.LastEnd(SpanKind::kUpdateBlock));
      EXPECT_GE(s.FirstBegin(SpanKind::kPush), s.FirstBegin(SpanKind::kCommit));
    }
  }
}

// A bucket four staging slots large (an embedding, the job's only parameter) is updated in four pieces,
// and each written piece goes to the GPU at once, before the rest of the update is written: speculated or
// not, and again when a clipped speculation is redone. One worker thread, so the pieces are written in
// order; the rank asks for the weights before its gradients arrive, so every piece can go.
class CudaIpcStreamedUpdateTest : public CudaIpcStagesTest, public ::testing::WithParamInterface<double> {
 protected:
  static constexpr uint64_t kRows = 4, kRow = 1 << 16;  // a row: one block of the worker pool
  [[nodiscard]] shm::LayoutSpec Spec() const override {
    shm::LayoutSpec spec = TwoParamSpec(1, /*state_halves=*/2);
    spec.params[0].shape = {kRows, kRow};
    spec.params.pop_back();
    spec.max_grad_norm = GetParam();
    spec.speculative_clipping = GetParam() > 0 ? shm::Speculation::kOn : shm::Speculation::kOff;
    return spec;
  }
  WorkerPool& Pool() override { return one_thread_; }
  [[nodiscard]] size_t SlotBytes(size_t) const override { return kRow * sizeof(float); }
  [[nodiscard]] uint32_t EmbeddingBucket() const { return layout().params[0].bucket; }
  // The pushes of the embedding's bucket since push number `from`, as (begin, end) in the bucket.
  [[nodiscard]] std::vector<std::pair<uint64_t, uint64_t>> EmbeddingPushes(size_t from) const {
    const uint64_t base = gpu_->ParamsOffset(EmbeddingBucket()).value();
    const uint64_t bytes = layout().buckets[EmbeddingBucket()].bytes();
    std::vector<std::pair<uint64_t, uint64_t>> pushes;
    const auto ranges = gpu_->PushRanges();
    for (size_t i = from; i < ranges.size(); ++i) {
      if (ranges[i].first >= base && ranges[i].first < base + bytes) {
        pushes.emplace_back(ranges[i].first - base, ranges[i].first - base + ranges[i].second);
      }
    }
    return pushes;
  }
  // The initial load, then the first two of the four pieces of step 1's gradients, the rank having
  // asked for the step's weights; returns once the update's first piece is on the GPU.
  void StageHalfOfStepOne() {
    client_->LoadInitialState();
    WantWeights(0);
    client_->ExpectParamsReady(0);
    const size_t before = gpu_->PushRanges().size();
    WantWeights(1);
    client_->SetHParams(1, TestHParams());
    StagePieces(1, EmbeddingBucket(), 0, 2);
    ReceiveFrees();
    ASSERT_TRUE(trainstream::testing::PollUntil([&] { return !EmbeddingPushes(before).empty(); }));
    EXPECT_EQ(EmbeddingPushes(before).front(), std::make_pair(uint64_t{0}, kRow * 4));
  }
  WorkerPool one_thread_{1, /*pin_threads=*/false};
};

TEST_P(CudaIpcStreamedUpdateTest, EachWrittenPieceReachesTheGpuAtOnceAndTheStepsMatchAdamW) {
  const bool clips = GetParam() > 0 && GetParam() < 1.0;  // the gradients' norm is about 180
  ASSERT_EQ(layout().buckets[EmbeddingBucket()].bytes(), kRows * kRow * sizeof(float));
  client_->LoadInitialState();
  WantWeights(0);
  client_->ExpectParamsReady(0);
  AdamWReference reference(job_->spec());
  for (uint64_t step = 1; step <= 2; ++step) {
    const size_t before = gpu_->PushRanges().size();
    WantWeights(step);
    StageStep(step);
    ReceiveFrees();
    client_->ExpectParamsReady(step);
    reference.Step(step, TestHParams(), {}, GetParam());
    std::vector<std::pair<uint64_t, uint64_t>> expected;
    for (int pass = 0; pass < (clips ? 2 : 1); ++pass) {  // a redone step streams its pieces again
      for (uint64_t row = 0; row < kRows; ++row) expected.emplace_back(row * kRow * 4, (row + 1) * kRow * 4);
    }
    EXPECT_EQ(EmbeddingPushes(before), expected) << "step " << step;
  }
  reference.ExpectMatches(*client_);
  ExpectGpuHoldsMaster();
  EXPECT_EQ(job_->Info().engine.redone_steps, clips ? 2u : 0u);
  EXPECT_TRUE(client_->sink().failures().empty());
}

// The update starts with the first piece of gradients: its first piece is on the GPU before the last
// gradients have left it.
TEST_P(CudaIpcStreamedUpdateTest, TheUpdateStartsBeforeTheLastGradientsArrive) {
  ASSERT_NO_FATAL_FAILURE(StageHalfOfStepOne());
  StagePieces(1, EmbeddingBucket(), 2, kRows);
  ReceiveFrees();
  client_->ExpectParamsReady(1);
  AdamWReference reference(job_->spec());
  reference.Step(1, TestHParams(), {}, GetParam());
  reference.ExpectMatches(*client_);
  ExpectGpuHoldsMaster();
}

// A trainer that dies after sending part of a bucket whose update has started leaves the job's
// committed state as it was; the restarted trainer replays the step exactly.
TEST_P(CudaIpcStreamedUpdateTest, ARankLeavingBeforeItsLastGradientsLeavesTheCommittedStateAsItWas) {
  ASSERT_NO_FATAL_FAILURE(StageHalfOfStepOne());
  client_->Reattach();
  EXPECT_EQ(client_->attachment().completed_step, 0u);
  AdamWReference reference(job_->spec());
  reference.ExpectMatches(*client_);
  gpu_ = std::make_shared<FakeGpu>(layout().grad_bytes, kSlots, SlotBytes(0), ParamOffsets());
  job_->SetTransfer(0, gpu_, "fake-gpu");
  WantWeights(0);
  client_->ExpectParamsReady(0);
  WantWeights(1);
  StageStep(1);
  ReceiveFrees();
  client_->ExpectParamsReady(1);
  reference.Step(1, TestHParams(), {}, GetParam());
  reference.ExpectMatches(*client_);
  ExpectGpuHoldsMaster();
  EXPECT_TRUE(client_->sink().failures().empty());
}

// A finished update keeps nothing of the ranks it read: a rank that detaches after its step is released
// (its segment unmapped, its transfer gone), not held until the bucket's next update.
TEST_P(CudaIpcStreamedUpdateTest, ARankDetachedAfterItsStepIsReleased) {
  RunFirstStep();
  const std::weak_ptr<FakeGpu> transfer = gpu_;
  gpu_.reset();
  client_->Reattach();
  EXPECT_TRUE(trainstream::testing::PollUntil([&] { return transfer.expired(); }));
}

// Without clipping, speculated without clipping, speculated and clipped (then redone).
INSTANTIATE_TEST_SUITE_P(MaxGradNorm, CudaIpcStreamedUpdateTest, ::testing::Values(0.0, 1e6, 0.5));

// One protocol violation: what rank 0 does wrong, and what the failure message must mention.
struct Violation {
  std::string label;
  uint32_t world_size;
  std::function<void(RankClient&)> act;
  std::string needle;
};

void PrintTo(const Violation& violation, std::ostream* os) {
  *os << violation.label;
}

class ProtocolViolation : public StepEngineTest, public ::testing::WithParamInterface<Violation> {};

TEST_P(ProtocolViolation, FailsOnlyTheOffendingSession) {
  const Violation& violation = GetParam();
  auto bystander_job = MakeJob(1, "bystander");
  auto bystanders = StartJob(*bystander_job);
  auto job = MakeJob(violation.world_size, "offended");
  auto clients = StartJob(*job);

  violation.act(*clients[0]);
  const std::optional<std::string> failure = clients[0]->sink().WaitForFailure();
  ASSERT_TRUE(failure.has_value()) << "no Fail() for " << violation.label;
  EXPECT_NE(failure->find(violation.needle), std::string::npos)
      << "failure '" << *failure << "' does not mention '" << violation.needle << "'";
  for (size_t r = 1; r < clients.size(); ++r) EXPECT_TRUE(clients[r]->sink().failures().empty());

  // Another job on the same pool keeps working.
  AdamWReference bystander_reference(bystander_job->spec());
  RunStep(bystanders, 1, TestHParams());
  bystander_reference.Step(1, TestHParams());
  bystander_reference.ExpectMatches(*bystanders[0]);
  EXPECT_TRUE(bystanders[0]->sink().failures().empty());

  // The offended job serves the rank again once it re-attaches, from the state before the violation.
  clients[0]->Reattach();
  AdamWReference reference(job->spec());
  RunStep(clients, 1, TestHParams());
  reference.Step(1, TestHParams());
  reference.ExpectMatches(*clients[0]);
  EXPECT_TRUE(clients[0]->sink().failures().empty());
}

INSTANTIATE_TEST_SUITE_P(
    StepEngine, ProtocolViolation,
    ::testing::Values(Violation{"BucketOutOfRange", 1, [](RankClient& c) { c.SendGradReady(99, 1); }, "bucket 99"},
                      Violation{"WrongStep", 1, [](RankClient& c) { c.SendGradReady(0, 5); }, "step 5"},
                      Violation{"DuplicateDelivery", 2,
                                [](RankClient& c) {
                                  c.SetHParams(1, TestHParams());
                                  c.SendGradReady(0, 1);
                                  c.SendGradReady(0, 1);
                                },
                                "twice"},
                      Violation{"FinalFlagMissing", 1,
                                [](RankClient& c) {
                                  c.Send(Message{
                                      .kind = MessageKind::kGradReady, .flags = 0, .bucket = 0, .step = 1, .micro = 0});
                                },
                                "final"},
                      Violation{"WeightsWantedWithoutCudaIpc", 1,
                                [](RankClient& c) { c.Send(Message{.kind = MessageKind::kWeightsWanted, .step = 1}); },
                                "no cuda-ipc"},
                      Violation{"UnknownKind", 1,
                                [](RankClient& c) { c.Send(Message{.kind = static_cast<MessageKind>(99)}); },
                                "kind 99"},
                      Violation{"NegativeLearningRate", 1,
                                [](RankClient& c) {
                                  c.SetHParams(1, TestHParams(-1));
                                  c.SetGradients(1);
                                  c.SendGradReady(0, 1);
                                },
                                "lr=-1"}),
    [](const ::testing::TestParamInfo<Violation>& info) { return info.param.label; });

}  // namespace
}  // namespace trainstream::daemon
