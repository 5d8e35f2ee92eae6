// Tests of the fault guard (daemon/guard/fault_guard.h, client_segment.h): a segment truncated through
// another descriptor, as its owner would, is read and written by a thread of the daemon's process
// without killing it, and reports itself lost; every other SIGBUS still kills (death tests).
#include "daemon/guard/fault_guard.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <thread>

#include "daemon/guard/client_segment.h"
#include "shm/segment.h"
#include "tests/cpp/shm/test_support.h"

namespace trainstream::daemon {
namespace {

constexpr size_t kBytes = size_t{4} << 20;
constexpr size_t kPage = 4096;

// What the segment's owner may do with a descriptor of its own: cut it to `bytes`. With `unlink`, the
// name goes first (a death test's process dies before its ScopedSegmentName could remove it).
void TruncateAsItsOwner(const std::string& name, size_t bytes, bool unlink = false) {
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  if (unlink) shm_unlink(name.c_str());
  ASSERT_EQ(ftruncate(fd, static_cast<off_t>(bytes)), 0);
  close(fd);
}

// Reads every page and writes every page, as an update kernel on a worker thread would.
uint64_t ReadAndWriteEveryPage(void* data, size_t bytes) {
  uint64_t sum = 0;
  std::thread worker([&] {
    auto* memory = static_cast<volatile std::byte*>(data);
    for (size_t at = 0; at < bytes; at += kPage) {
      sum += static_cast<uint8_t>(memory[at]);
      memory[at + 1] = std::byte{0x5a};
    }
  });
  worker.join();
  return sum;
}

TEST(FaultGuard, ATruncatedSegmentIsReadAndWrittenWithoutAFaultAndReportsItselfLost) {
  testing::ScopedSegmentName name;
  ClientSegment segment = ClientSegment::Create(name.str(), kBytes, geteuid());
  std::memset(segment.data(), 1, kBytes);
  EXPECT_FALSE(segment.lost());
  const uint64_t absorbed = AbsorbedFaults();

  TruncateAsItsOwner(name.str(), kPage);
  ReadAndWriteEveryPage(segment.data(), kBytes);  // pages 1.. are gone: the first access past them faults

  EXPECT_TRUE(segment.lost());
  EXPECT_EQ(AbsorbedFaults(), absorbed + 1);  // one fault: the whole mapping holds zeros since
  EXPECT_NE(segment.LostMessage().find("was truncated by its owner"), std::string::npos);
  EXPECT_NE(segment.LostMessage().find(name.str()), std::string::npos);
  // The zeros are the daemon's own: what it writes there now never reaches the owner's file.
  EXPECT_EQ(static_cast<const std::byte*>(segment.data())[2], std::byte{0});
  static_cast<std::byte*>(segment.data())[2] = std::byte{0x77};
  const int fd = shm_open(name.str().c_str(), O_RDONLY, 0);
  ASSERT_GE(fd, 0);
  std::byte in_file{};
  ASSERT_EQ(pread(fd, &in_file, 1, 2), 1);
  close(fd);
  EXPECT_EQ(in_file, std::byte{1});
}

TEST(FaultGuard, OnlyTheTruncatedSegmentIsLost) {
  testing::ScopedSegmentName truncated_name, other_name;
  ClientSegment truncated = ClientSegment::Create(truncated_name.str(), kBytes, geteuid());
  ClientSegment other = ClientSegment::Create(other_name.str(), kBytes, geteuid());
  std::memset(other.data(), 7, kBytes);
  TruncateAsItsOwner(truncated_name.str(), 0);
  ReadAndWriteEveryPage(truncated.data(), kBytes);
  EXPECT_TRUE(truncated.lost());
  EXPECT_FALSE(other.lost());
  EXPECT_EQ(static_cast<const uint8_t*>(other.data())[kBytes - 1], 7);
}

TEST(FaultGuard, AMovedSegmentStaysGuarded) {
  testing::ScopedSegmentName name;
  ClientSegment first = ClientSegment::Create(name.str(), kBytes, geteuid());
  ClientSegment moved;
  moved = std::move(first);
  TruncateAsItsOwner(name.str(), kPage);
  ReadAndWriteEveryPage(moved.data(), kBytes);
  EXPECT_TRUE(moved.lost());
}

// A mapping of a client's segment that nobody guards, truncated and read: what the daemon did before the
// guard, and what it must still do for memory it does not guard (a bug is never swallowed).
void TouchATruncatedUnguardedSegment() {
  InstallFaultGuard();
  testing::ScopedSegmentName name;
  shm::Segment segment = shm::Segment::Create(name.str(), kBytes);
  TruncateAsItsOwner(name.str(), kPage, /*unlink=*/true);
  ReadAndWriteEveryPage(segment.data(), kBytes);
}

TEST(FaultGuardDeathTest, AFaultOutsideEveryGuardedRangeStillKills) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        testing::ScopedSegmentName guarded_name;
        ClientSegment guarded = ClientSegment::Create(guarded_name.str(), kBytes, geteuid());
        shm::Segment::Remove(guarded_name.str());
        TouchATruncatedUnguardedSegment();
        _exit(0);
      },
      ::testing::KilledBySignal(SIGBUS), "");
}

TEST(FaultGuardDeathTest, ARangeNoLongerGuardedKillsAgain) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        testing::ScopedSegmentName name;
        shm::Segment segment = shm::Segment::Create(name.str(), kBytes);
        { GuardedRange released(segment.data(), segment.size()); }
        TruncateAsItsOwner(name.str(), kPage, /*unlink=*/true);
        ReadAndWriteEveryPage(segment.data(), kBytes);
        _exit(0);
      },
      ::testing::KilledBySignal(SIGBUS), "");
}

TEST(FaultGuardDeathTest, ASigbusSentByAnotherProcessStillKills) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        InstallFaultGuard();
        kill(getpid(), SIGBUS);
        std::this_thread::sleep_for(std::chrono::seconds(5));
        _exit(0);
      },
      ::testing::KilledBySignal(SIGBUS), "");
}

TEST(FaultGuardDeathTest, AHandlerInstalledBeforeIsStillCalledForFaultsOutsideTheRanges) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        struct sigaction previous {};
        previous.sa_handler = [](int) { _exit(42); };
        sigemptyset(&previous.sa_mask);
        sigaction(SIGBUS, &previous, nullptr);
        TouchATruncatedUnguardedSegment();
        _exit(0);
      },
      ::testing::ExitedWithCode(42), "");
}

}  // namespace
}  // namespace trainstream::daemon
