// The step traces of a root trainstreamd (--trace-dir) as other users meet them (issue 46: a planted
// trace-<key>.json symlink made the root daemon overwrite a root-owned file, and every trace was 0644).
// Against a real daemon: uid 65534 trains a job, uid 65533 finds its key in /dev/shm and plants a link
// at its trace's name in the trace directory (sticky and writable by all, as /tmp); when the job ends,
// its trace replaces the link, is 65534's and 0600, and the link's target is untouched. Clients run as
// other uids in forked children; the test runs as root and skips otherwise.
#include <fcntl.h>
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

// The key of `uid`'s one job, from its state segment's name in /dev/shm (what any user can list).
std::string JobKeyOf(uint32_t uid) {
  const std::string prefix = "trainstream." + std::to_string(uid) + ".";
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
    const std::string name = entry.path().filename().string();
    if (name.starts_with(prefix) && name.ends_with(".state")) {
      return name.substr(prefix.size(), name.size() - prefix.size() - 6);
    }
  }
  return "";
}

std::string Read(const std::filesystem::path& path) {
  std::ifstream file(path);
  return (std::stringstream() << file.rdbuf()).str();
}

using TraceFiles = AsOtherUids;

TEST_F(TraceFiles, APlantedLinkNeitherRedirectsNorExposesAnotherUsersTrace) {
  const std::filesystem::path root = std::filesystem::temp_directory_path() / ("ts-traces-" + std::to_string(getpid()));
  const std::filesystem::path traces = root / "traces", victim = root / "root-only";
  std::filesystem::create_directories(traces);
  ASSERT_EQ(chmod(root.c_str(), 0755), 0);
  ASSERT_EQ(chmod(traces.c_str(), 01777), 0);
  std::ofstream(victim) << "root's file";
  {
    DaemonProcess daemon("trace_dir = \"" + traces.string() + "\"\n");
    EXPECT_TRUE(ExitedWith(RunAs(kAlice,
                                 [&] {
                                   auto client = Client::Connect(daemon.socket());
                                   client->Attach("run", 0, OneParamSpec(), 1)->Close();
                                   return 0;
                                 }),
                           0));
    const std::string key = JobKeyOf(kAlice);
    ASSERT_FALSE(key.empty());
    const std::filesystem::path trace = traces / ("trace-" + key + ".json");
    EXPECT_TRUE(ExitedWith(RunAs(kMallory, [&] { return symlink(victim.c_str(), trace.c_str()) == 0 ? 0 : 1; }), 0));
    EXPECT_TRUE(ExitedWith(RunAs(kAlice,
                                 [&] {
                                   Client::Connect(daemon.socket())->DropJob("run", false);  // the job ends
                                   return 0;
                                 }),
                           0));
    EXPECT_TRUE(PollUntil([&] { return std::filesystem::is_regular_file(std::filesystem::symlink_status(trace)); },
                          std::chrono::seconds(10)));
    EXPECT_EQ(Read(victim), "root's file");
    struct stat info {};
    ASSERT_EQ(lstat(trace.c_str(), &info), 0);
    EXPECT_EQ(info.st_uid, kAlice);
    EXPECT_EQ(info.st_mode & 07777, 0600u);
    EXPECT_NE(Read(trace).find("\"spans\""), std::string::npos);
    EXPECT_TRUE(
        ExitedWith(RunAs(kMallory, [&] { return open(trace.c_str(), O_RDONLY) < 0 && errno == EACCES ? 0 : 1; }), 0));
  }
  std::filesystem::remove_all(root);
}

}  // namespace
}  // namespace trainstream
