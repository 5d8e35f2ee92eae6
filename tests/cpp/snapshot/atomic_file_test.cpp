// The crash-safe file (daemon/snapshot/atomic_file.h): the target changes only at Commit.
#include "daemon/snapshot/atomic_file.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "tests/cpp/shm/test_support.h"

namespace trainstream::daemon {
namespace {

std::string Read(const std::filesystem::path& path) {
  std::ifstream file(path, std::ios::binary);
  std::stringstream content;
  content << file.rdbuf();
  return content.str();
}

std::span<const std::byte> Bytes(const std::string& text) {
  return std::as_bytes(std::span(text.data(), text.size()));
}

class AtomicFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / ("ts-atomic-" + std::to_string(getpid()));
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  [[nodiscard]] size_t Entries() const {
    return static_cast<size_t>(std::distance(std::filesystem::directory_iterator(dir_), {}));
  }
  std::filesystem::path dir_;
};

TEST_F(AtomicFileTest, TheTargetChangesOnlyAtCommit) {
  const auto target = dir_ / "x.safetensors";
  std::ofstream(target) << "old";
  AtomicFile file(target.string(), std::nullopt);
  file.WriteAt(4, Bytes("tail"));
  file.WriteAt(0, Bytes("new "));
  EXPECT_EQ(Read(target), "old");
  EXPECT_TRUE(std::filesystem::exists(file.temporary_path()));
  EXPECT_EQ(file.Commit(), 8u);
  EXPECT_EQ(Read(target), "new tail");
  EXPECT_EQ(Entries(), 1u);  // the temporary file became the target
}

TEST_F(AtomicFileTest, AnUncommittedFileLeavesTheTargetAndNoTemporaryFile) {
  const auto target = dir_ / "y.safetensors";
  std::ofstream(target) << "old";
  {
    AtomicFile file(target.string(), std::nullopt);
    file.WriteAt(0, Bytes("half"));
  }
  EXPECT_EQ(Read(target), "old");
  EXPECT_EQ(Entries(), 1u);
}

TEST_F(AtomicFileTest, BadPathsAreRefusedByName) {
  TS_EXPECT_ERROR(AtomicFile("relative.safetensors", std::nullopt), Code::kInvalidArgument, "absolute path");
  TS_EXPECT_ERROR(AtomicFile((dir_ / "missing" / "z.safetensors").string(), std::nullopt), Code::kNotFound,
                  (dir_ / "missing").string());
}

}  // namespace
}  // namespace trainstream::daemon
