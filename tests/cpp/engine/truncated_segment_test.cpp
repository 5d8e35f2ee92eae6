// A job whose owner truncates its segments under the daemon (daemon/guard/), through a JobRegistry and
// its Jobs in-process over real shared memory. The state segment, or an attached rank's segment, is
// cut through a descriptor of its own while a step runs, as its uid may do; the daemon's update then
// finds pages gone. The process lives on, the job's session fails naming the segment and its owner,
// nothing computed from the zeros in its place reaches the rank, the job refuses new ranks and the
// registry drops it (removing its segments), and a job beside it trains on as AdamW would. A snapshot
// file cut while a job is restored from it is refused.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>

#include "daemon/config.h"
#include "daemon/control/job.h"
#include "daemon/control/job_registry.h"
#include "daemon/engine/worker_pool.h"
#include "daemon/snapshot/snapshot_format.h"
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

// What a segment's owner may do with a descriptor of its own.
void Truncate(const std::string& name, size_t bytes) {
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0) << name;
  ASSERT_EQ(ftruncate(fd, static_cast<off_t>(bytes)), 0);
  close(fd);
}

size_t OffsetIn(const void* base, const void* at) {
  return static_cast<size_t>(static_cast<const std::byte*>(at) - static_cast<const std::byte*>(base));
}

class TruncatedSegmentTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { spdlog::set_level(spdlog::level::critical); }

  // A job of the registry with its weights loaded and one step trained, and a job beside it.
  void SetUp() override {
    cut_ = registry_.FindOrCreate("cut", kUid, TwoParamSpec(1, 2), 7).job;
    client_ = StartRank(*cut_);
    RunStep(*client_, 1);
    beside_ = registry_.FindOrCreate("beside", kUid, TwoParamSpec(1, 2), 7).job;
    beside_client_ = StartRank(*beside_);
    RunStep(*beside_client_, 1);
    reference_.Step(1, TestHParams());
  }

  // The job's session failed naming `segment`, the rank got nothing more, new ranks are refused, and
  // the registry drops the job and its segments; the job beside it goes on training.
  void ExpectDroppedFor(const std::string& segment) {
    const std::optional<std::string> failure = client_->sink().WaitForFailure();
    ASSERT_TRUE(failure.has_value()) << "the session did not fail";
    EXPECT_NE(failure->find(fmt::format("job 'cut' was dropped: shared memory segment {} was truncated by its "
                                        "owner (uid {}) while trainstreamd used it",
                                        segment, kUid)),
              std::string::npos)
        << *failure;
    client_->ExpectNoCompletion(200ms);  // no PARAMS_READY for weights computed from zeros
    ASSERT_TRUE(cut_->Lost().has_value());
    cut_->Detach(0);
    TS_EXPECT_ERROR(cut_->Attach(0, std::make_shared<RecordingSink>()), Code::kAborted,
                    "job 'cut' is being dropped: shared memory segment");

    const std::string state = cut_->state_segment_name(), rank = client_->attachment().rank_segment;
    EXPECT_EQ(registry_.DropLost(), 1u);
    cut_.reset();
    ASSERT_EQ(registry_.Jobs().size(), 1u);
    EXPECT_EQ(registry_.Jobs()[0]->name(), "beside");
    EXPECT_FALSE(shm::Segment::Exists(state));
    EXPECT_FALSE(shm::Segment::Exists(rank));

    for (uint64_t step = 2; step <= 3; ++step) {
      RunStep(*beside_client_, step);
      reference_.Step(step, TestHParams());
    }
    reference_.ExpectMatches(*beside_client_);
    EXPECT_FALSE(beside_->Lost().has_value());
  }

  WorkerPool pool_{2, /*pin_threads=*/false};
  const Config config_{};
  JobRegistry registry_{config_, pool_};
  std::shared_ptr<Job> cut_, beside_;
  std::unique_ptr<RankClient> client_, beside_client_;
  AdamWReference reference_{TwoParamSpec(1, 2)};
};

TEST_F(TruncatedSegmentTest, AStateSegmentTruncatedDuringAStepDropsTheJobAndOnlyIt) {
  const std::string state = cut_->state_segment_name();
  // The header and commit words stay (the client's doorbell is there); master weights and moments go.
  Truncate(state, cut_->layout().master_offset[0]);
  client_->DeliverStep(2, TestHParams());  // touches nothing past the cut; the daemon's update does
  ExpectDroppedFor(state);
}

TEST_F(TruncatedSegmentTest, ARankSegmentTruncatedDuringAStepDropsTheJobAndOnlyIt) {
  const std::string rank = client_->attachment().rank_segment;
  client_->SetHParams(2, TestHParams());
  client_->SetGradients(2);
  // The rings stay; the gradients the daemon is about to read go from the first page boundary in them
  // (a partial page stays readable: a bucket whose gradients lie before the cut updates as before).
  constexpr size_t kPage = 4096;
  const size_t grads = OffsetIn(client_->view().header, client_->view().grads);
  const size_t cut = (grads + kPage - 1) / kPage * kPage;
  Truncate(rank, cut);
  uint32_t sent = 0;
  for (uint32_t b = 0; b < client_->buckets(); ++b) {
    const shm::BucketLayout& bucket = client_->layout().buckets[b];
    if (grads + bucket.grad_offset + bucket.bytes() <= cut) continue;
    client_->SendGradReady(b, 2);
    ++sent;
  }
  ASSERT_GT(sent, 0u);
  ExpectDroppedFor(rank);
}

// Nothing is sent: the engine's next look at the job's doorbell (at least every 100 ms) finds its page gone.
TEST_F(TruncatedSegmentTest, AnIdleJobsStateTruncatedWholeIsFoundWithinARound) {
  const std::string state = cut_->state_segment_name();
  Truncate(state, 0);
  ASSERT_TRUE(trainstream::testing::PollUntil([&] { return cut_->Lost().has_value(); }, 2s));
  ExpectDroppedFor(state);
}

// A snapshot file is its owner's too. Cut while a job is restored from it: the restore is refused (the
// zeros in its place must not become the job's state), and the new job's state segment does not stay.
TEST(TruncatedSnapshotTest, ASnapshotTruncatedWhileItIsRestoredIsRefusedAndLeavesNoSegment) {
  spdlog::set_level(spdlog::level::critical);
  WorkerPool pool(2, /*pin_threads=*/false);
  const std::string path = fmt::format("/tmp/ts-truncated-snapshot-{}.safetensors", getpid());
  {
    Job job("saved", kUid, TwoParamSpec(1, 2), 7, pool);
    auto client = StartRank(job);
    RunStep(*client, 1);
    job.Detach(0);  // a job nothing trains is snapshot at once
    job.Snapshot(path, kUid, std::chrono::steady_clock::now() + 10s);
  }
  const SnapshotFile snapshot(path);
  ASSERT_EQ(truncate(path.c_str(), 0), 0);
  // As root, the restored job is given a uid of its own, whose segments no other test makes.
  const uint32_t owner = geteuid() == 0 ? 3'000'000 + static_cast<uint32_t>(getpid()) % 100'000 : kUid;
  TS_EXPECT_ERROR(Job("restored", owner, snapshot.meta().spec, 7, pool, {}, nullptr, &snapshot),
                  Code::kFailedPrecondition,
                  fmt::format("snapshot '{}' was truncated while trainstreamd read it", path));
  std::filesystem::remove(path);
  if (owner == kUid) return;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
    EXPECT_FALSE(entry.path().filename().string().starts_with(fmt::format("trainstream.{}.", owner)))
        << entry.path() << " left behind";
  }
}

}  // namespace
}  // namespace trainstream::daemon
