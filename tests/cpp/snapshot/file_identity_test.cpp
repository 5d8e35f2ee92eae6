// FileIdentity (daemon/snapshot/file_identity.h) as a root daemon with supplementary groups (a
// container's root: groups 0 and 4242) uses it: acting as uid 65534 the thread reaches nothing those
// groups open to it, the other threads keep the daemon's groups meanwhile, and the thread gets them
// back after. Each case runs in a forked child, whose groups it sets; root only.
#include "daemon/snapshot/file_identity.h"

#include <fcntl.h>
#include <grp.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <future>
#include <vector>

#include "tests/cpp/shm/test_support.h"

namespace trainstream::daemon {
namespace {
using namespace trainstream::testing;  // NOLINT(google-build-using-namespace): the shared test helpers

constexpr uint32_t kNobody = 65534;
constexpr gid_t kDaemonGroup = 4242;

std::vector<gid_t> Groups() {
  std::vector<gid_t> groups(static_cast<size_t>(getgroups(0, nullptr)));
  groups.resize(static_cast<size_t>(getgroups(static_cast<int>(groups.size()), groups.data())));
  return groups;
}

class FileIdentityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "needs root to act as another uid";
    dir_ = std::filesystem::temp_directory_path() / ("ts-file-identity-" + std::to_string(getpid()));
    std::filesystem::create_directories(dir_);
    std::filesystem::permissions(dir_, std::filesystem::perms::all);  // 0777: only the modes below decide
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::filesystem::path dir_;
};

TEST_F(FileIdentityTest, TheDaemonsSupplementaryGroupsOpenNothingForAnotherUid) {
  const std::string group_file = dir_ / "root-root-0640";
  std::ofstream(group_file) << "secret";
  ASSERT_EQ(chmod(group_file.c_str(), 0640), 0);
  const std::filesystem::path group_dir = dir_ / "group-dir";
  std::filesystem::create_directory(group_dir);
  ASSERT_EQ(chown(group_dir.c_str(), 0, kDaemonGroup), 0);
  ASSERT_EQ(chmod(group_dir.c_str(), 0770), 0);
  const std::string created = group_dir / "created";

  EXPECT_TRUE(ExitedWith(WaitChild(ForkChild([&] {
                           const std::vector<gid_t> daemon_groups = {0, kDaemonGroup};
                           if (setgroups(daemon_groups.size(), daemon_groups.data()) != 0) return 98;
                           std::promise<void> switched;
                           auto other_thread = std::async(std::launch::async, [&, seen = switched.get_future()] {
                             return seen.wait_for(std::chrono::seconds(10)) == std::future_status::ready &&
                                    Groups() == daemon_groups;
                           });
                           int failed = 0;
                           {
                             const FileIdentity as_nobody(kNobody);
                             if (open(group_file.c_str(), O_RDONLY) != -1 || errno != EACCES) {
                               failed = 1;
                             } else if (open(created.c_str(), O_CREAT | O_WRONLY, 0600) != -1 || errno != EACCES) {
                               failed = 2;
                             } else if (Groups() == daemon_groups) {
                               failed = 3;
                             }
                             switched.set_value();
                             if (!other_thread.get()) failed = failed != 0 ? failed : 4;  // it reached another thread
                           }
                           if (failed != 0) return failed;
                           if (Groups() != daemon_groups) return 5;
                           const int fd = open(group_file.c_str(), O_RDONLY);  // as root again
                           if (fd < 0) return 6;
                           close(fd);
                           return 0;
                         })),
                         0));
  EXPECT_FALSE(std::filesystem::exists(created));
}

TEST_F(FileIdentityTest, AUserKeepsTheGroupsOfItsAccount) {
  // nobody's own group (nogroup, or whatever its passwd entry names) opens its group's files to it.
  const gid_t own_group = getgrnam("nogroup") != nullptr ? getgrnam("nogroup")->gr_gid : kNobody;
  const std::string shared = dir_ / "nogroup-0660";
  std::ofstream(shared) << "for the group";
  ASSERT_EQ(chown(shared.c_str(), 0, own_group), 0);
  ASSERT_EQ(chmod(shared.c_str(), 0660), 0);
  EXPECT_TRUE(ExitedWith(WaitChild(ForkChild([&] {
                           const FileIdentity as_nobody(kNobody);
                           const int fd = open(shared.c_str(), O_RDWR);
                           if (fd < 0) return 1;
                           close(fd);
                           return 0;
                         })),
                         0));
}

}  // namespace
}  // namespace trainstream::daemon
