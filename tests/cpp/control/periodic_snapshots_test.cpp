// Periodic snapshots of two uids' jobs of the same name, against a real root trainstreamd: each job
// has a file of its own (issue 46: <snapshot_dir>/<job>.safetensors was shared, so nobody's job
// "shared" replaced root's snapshot, and root's restore of "its" file made nobody's job). Each uid
// trains one step of its job "shared" through the client library, in a forked child.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "tests/cpp/control/daemon_process.h"
#include "trainstream/client.h"

namespace trainstream {
namespace {
using namespace trainstream::testing;  // NOLINT(google-build-using-namespace): the shared test helpers

// Attaches to "shared", seeds its weights with `weight` (step 0) and trains step 1, as a trainer would.
int TrainOneStep(const std::string& socket, float weight) {
  auto client = Client::Connect(socket);
  auto session = client->Attach("shared", 0, OneParamSpec(), 1);
  const shm::StateView state = session->state();
  const shm::RankView view = session->view();
  const shm::JobLayout& layout = session->layout();
  const shm::ParamLayout& w = layout.params[0];
  const shm::BucketLayout& bucket = layout.buckets[w.bucket];
  float* master = state.Committed(w.bucket).master + bucket.elem_offset + w.offset_in_bucket;
  std::fill(master, master + w.numel, weight);
  session->SendLoadState(0);
  session->WaitParamsReady(w.bucket, 0);
  view.hparams[1 * session->spec().num_groups] =
      shm::HParams{.lr = 0.1, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.0};
  auto* grads = reinterpret_cast<float*>(shm::GradsOf(bucket, state, view)) + w.offset_in_bucket;
  std::fill(grads, grads + w.numel, 0.5f);
  view.presence[0] = 1;
  session->SendGradReady(w.bucket, 1, 0, RankSession::Last::kYes);
  session->WaitParamsReady(w.bucket, 1);
  return session->completed_step() == 1 ? 0 : 1;
}

std::string Read(const std::filesystem::path& path) {
  std::ifstream file(path, std::ios::binary);
  std::stringstream content;
  content << file.rdbuf();
  return content.str();
}

using PeriodicSnapshots = AsOtherUids;

TEST_F(PeriodicSnapshots, TwoUidsJobsOfOneNameHaveAFileEach) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("ts-periodic-" + std::to_string(getpid())) / "snapshots";
  std::filesystem::remove_all(dir.parent_path());
  {
    DaemonProcess daemon("snapshot_dir = \"" + dir.string() + "\"\nsnapshot_every = 1\n");
    EXPECT_TRUE(ExitedWith(RunAs(kAlice, [&] { return TrainOneStep(daemon.socket(), 2.0f); }), 0));
    EXPECT_TRUE(ExitedWith(WaitChild(ForkChild([&] { return TrainOneStep(daemon.socket(), 1.0f); })), 0));
    const auto root_file = dir / "shared.uid0.safetensors";
    const auto alice_file = dir / "shared.uid65534.safetensors";
    EXPECT_TRUE(PollUntil([&] { return std::filesystem::exists(root_file) && std::filesystem::exists(alice_file); },
                          std::chrono::seconds(20)));
    struct stat root {
    }, alice{};
    ASSERT_EQ(stat(root_file.c_str(), &root), 0);
    ASSERT_EQ(stat(alice_file.c_str(), &alice), 0);
    EXPECT_EQ(root.st_uid, 0u);
    EXPECT_EQ(alice.st_uid, kAlice);
    EXPECT_NE(Read(root_file).find(R"("uid":"0")"), std::string::npos);
    EXPECT_NE(Read(alice_file).find(R"("uid":"65534")"), std::string::npos);
    EXPECT_FALSE(std::filesystem::exists(dir / "shared.safetensors"));  // the old, shared name
  }
  std::filesystem::remove_all(dir.parent_path());
}

}  // namespace
}  // namespace trainstream
