// A file a client controls (daemon/snapshot/untrusted_file.h): what is no regular file is refused at
// once, without blocking; a file truncated while it is read is an error, not a SIGBUS.
#include "daemon/snapshot/untrusted_file.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <vector>

#include "tests/cpp/shm/test_support.h"

namespace trainstream::daemon {
namespace {

class UntrustedFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / ("ts-untrusted-" + std::to_string(getpid()));
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // A file of `bytes` bytes, byte i holding i % 251.
  [[nodiscard]] std::string Counting(const char* name, size_t bytes) const {
    std::string path = (dir_ / name).string();
    std::vector<char> content(bytes);
    for (size_t i = 0; i < bytes; ++i) content[i] = static_cast<char>(i % 251);
    std::ofstream(path, std::ios::binary).write(content.data(), static_cast<std::streamsize>(bytes));
    return path;
  }
  std::filesystem::path dir_;
};

// A FIFO: open() without O_NONBLOCK waits for a writer that never comes (issue 46: 20 restores held 20
// daemon threads forever). If it blocked, this test would hang until ctest's timeout.
TEST_F(UntrustedFileTest, AFifoIsRefusedAtOnce) {
  const std::string fifo = (dir_ / "fifo").string();
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  TS_EXPECT_ERROR(UntrustedFile{fifo}, Code::kInvalidArgument, "is not a regular file (it is a FIFO)");
}

TEST_F(UntrustedFileTest, WhatIsNoRegularFileIsRefusedNamingWhatItIs) {
  TS_EXPECT_ERROR(UntrustedFile{dir_.string()}, Code::kInvalidArgument, "(it is a directory)");
  TS_EXPECT_ERROR(UntrustedFile{"/dev/null"}, Code::kInvalidArgument, "(it is a character device)");
  const std::string link = (dir_ / "link").string();
  std::filesystem::create_symlink(Counting("target", 16), link);
  TS_EXPECT_ERROR(UntrustedFile{link}, Code::kInvalidArgument, "cannot open snapshot");  // ELOOP: not followed
  TS_EXPECT_ERROR(UntrustedFile{(dir_ / "missing").string()}, Code::kNotFound, "No such file");
}

TEST_F(UntrustedFileTest, ReadsWhatIsThere) {
  const UntrustedFile file(Counting("plain", 1000));
  EXPECT_EQ(file.size(), 1000u);
  std::vector<std::byte> out(10);
  file.ReadAt(500, out);
  EXPECT_EQ(std::to_integer<int>(out[0]), 500 % 251);
  EXPECT_EQ(std::to_integer<int>(out[9]), 509 % 251);
}

// Truncated by its owner after it was opened (and checked): the read that comes back short says so.
TEST_F(UntrustedFileTest, AFileTruncatedAfterItWasOpenedEndsEarly) {
  const std::string path = Counting("shrinking", 4096);
  const UntrustedFile file(path);
  ASSERT_EQ(truncate(path.c_str(), 1000), 0);
  std::vector<std::byte> out(2048);
  TS_EXPECT_ERROR(file.ReadAt(0, out), Code::kFailedPrecondition,
                  fmt::format("snapshot '{}' was truncated while trainstreamd read it: it ended at byte 1000, 1048 "
                              "bytes short of the 4096",
                              path));
}

// Truncated between two chunks of one read (the hook runs after each): the second chunk is refused,
// the first one is where it belongs. A mapped file would have raised SIGBUS at the first missing page.
TEST_F(UntrustedFileTest, AFileTruncatedInTheMiddleOfAReadEndsEarly) {
  const size_t bytes = 3 * UntrustedFile::kChunkBytes;
  const std::string path = Counting("big", bytes);
  const UntrustedFile file(path);
  std::vector<std::byte> out(bytes);
  std::vector<uint64_t> chunks;
  TS_EXPECT_ERROR(file.ReadAt(0, out,
                              [&](std::span<const std::byte> chunk, uint64_t offset) {
                                EXPECT_EQ(chunk.data(), out.data() + offset);
                                chunks.push_back(offset);
                                ASSERT_EQ(truncate(path.c_str(), UntrustedFile::kChunkBytes + 100), 0);
                              }),
                  Code::kFailedPrecondition, fmt::format("it ended at byte {}", UntrustedFile::kChunkBytes + 100));
  EXPECT_EQ(chunks, std::vector<uint64_t>{0});
  EXPECT_EQ(std::to_integer<int>(out[UntrustedFile::kChunkBytes - 1]), (UntrustedFile::kChunkBytes - 1) % 251);
}

// A hook that throws stops the read there (a cancelled restore).
TEST_F(UntrustedFileTest, AHookStopsTheRead) {
  const size_t bytes = 2 * UntrustedFile::kChunkBytes + 1;
  const UntrustedFile file(Counting("stopped", bytes));
  std::vector<std::byte> out(bytes);
  int calls = 0;
  TS_EXPECT_ERROR(file.ReadAt(0, out,
                              [&](std::span<const std::byte> chunk, uint64_t) {
                                ++calls;
                                EXPECT_EQ(chunk.size(), UntrustedFile::kChunkBytes);
                                Throw(Code::kAborted, "cancelled");
                              }),
                  Code::kAborted, "cancelled");
  EXPECT_EQ(calls, 1);
}

}  // namespace
}  // namespace trainstream::daemon
