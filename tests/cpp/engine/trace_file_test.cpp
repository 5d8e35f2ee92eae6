// Tests of where a trace may go and how it is written (daemon/engine/trace_file.h), as a root daemon
// on a shared node meets it (issue 46): a name planted in the directory, the file's owner and mode,
// directories other users may change, symbolic links on the way. Cases about other uids run as root
// only.
#include "daemon/engine/trace_file.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "tests/cpp/shm/test_support.h"

namespace trainstream::daemon {
namespace {

constexpr uint32_t kAlice = 65534, kMallory = 65533;

class TraceFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / ("ts-trace-file-" + std::to_string(getpid()));
    std::filesystem::create_directories(dir_);
    Mode(dir_, 0755);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  static void Mode(const std::filesystem::path& path, mode_t mode) { ASSERT_EQ(chmod(path.c_str(), mode), 0); }
  static std::string Read(const std::filesystem::path& path) {
    std::ifstream file(path);
    return (std::stringstream() << file.rdbuf()).str();
  }
  static void WriteHello(const TraceFile& file) {
    file.Write([](std::FILE* out) { std::fputs("hello", out); });
  }
  // The refusal a TraceFile for `owner` in `dir` gets; "" if none.
  static std::string Refusal(const std::filesystem::path& dir, uint32_t owner) {
    try {
      const TraceFile file(dir.string(), "trace-k.json", owner);
      return "";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Code::kFailedPrecondition);
      return e.what();
    }
  }
  std::filesystem::path dir_;
};

TEST_F(TraceFileTest, APlantedSymlinkIsReplacedNotFollowed) {
  Mode(dir_, 01777);  // as /tmp: anyone may plant a name, nobody may replace another's
  const std::filesystem::path victim = dir_ / "victim";
  std::ofstream(victim) << "root's";
  std::filesystem::create_symlink(victim, dir_ / "trace-k.json");
  WriteHello(TraceFile(dir_.string(), "trace-k.json", getuid()));
  EXPECT_EQ(Read(victim), "root's");
  EXPECT_TRUE(std::filesystem::is_regular_file(std::filesystem::symlink_status(dir_ / "trace-k.json")));
  EXPECT_EQ(Read(dir_ / "trace-k.json"), "hello");
}

TEST_F(TraceFileTest, TheFileIsTheJobOwnersAndOnlyTheirs) {
  const uint32_t owner = geteuid() == 0 ? kAlice : getuid();
  WriteHello(TraceFile(dir_.string(), "trace-k.json", owner));
  struct stat info {};
  ASSERT_EQ(stat((dir_ / "trace-k.json").c_str(), &info), 0);
  EXPECT_EQ(info.st_uid, owner);
  EXPECT_EQ(info.st_mode & 07777, 0600u);
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir_), {}), 1);  // no temporary file left
}

TEST_F(TraceFileTest, ADirectoryOthersMayChangeIsRefusedByName) {
  Mode(dir_, 0777);
  EXPECT_NE(Refusal(dir_, getuid()).find(dir_.string() + " is writable by every user, without the sticky bit"),
            std::string::npos);
  Mode(dir_, 0775);
  EXPECT_NE(Refusal(dir_, getuid()).find("is writable by its group"), std::string::npos);
  const std::filesystem::path inside = dir_ / "traces";
  std::filesystem::create_directory(inside);
  Mode(inside, 0755);
  EXPECT_NE(Refusal(inside, getuid()).find(dir_.string() + " is writable by its group"), std::string::npos)
      << "a directory on the way counts too: whoever may write it may replace what follows";
  Mode(dir_, 01777);
  EXPECT_EQ(Refusal(dir_, getuid()), "");
  EXPECT_EQ(Refusal(inside, getuid()), "");
}

TEST_F(TraceFileTest, ASymbolicLinkOnTheWayIsRefused) {
  const std::filesystem::path real = dir_ / "real", link = dir_ / "link";
  std::filesystem::create_directory(real);
  Mode(real, 0755);
  std::filesystem::create_directory_symlink(real, link);
  EXPECT_NE(Refusal(link, getuid()).find(link.string() + " is a symbolic link"), std::string::npos);
  EXPECT_NE(Refusal(link / "below", getuid()).find(link.string() + " is a symbolic link"), std::string::npos);
  EXPECT_EQ(Refusal(real, getuid()), "");
}

TEST_F(TraceFileTest, ADirectoryOfAnotherUserIsRefusedForOtherUsersJobs) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to give a directory to another uid";
  ASSERT_EQ(chown(dir_.c_str(), kMallory, kMallory), 0);
  EXPECT_NE(Refusal(dir_, kAlice).find("belongs to uid 65533"), std::string::npos);
  EXPECT_EQ(Refusal(dir_, kMallory), "");  // hers, for her own job
}

TEST_F(TraceFileTest, ADirectoryOpenedToOthersAfterTheStartGetsNoFile) {
  const TraceFile file(dir_.string(), "trace-k.json", getuid());
  Mode(dir_, 0777);
  try {
    WriteHello(file);
    ADD_FAILURE() << "written";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("writable by every user"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(std::filesystem::exists(dir_ / "trace-k.json"));
}

}  // namespace
}  // namespace trainstream::daemon
