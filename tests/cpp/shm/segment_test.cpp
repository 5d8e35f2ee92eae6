// Tests of named shared-memory segments (shm/segment.h): naming, creation (size, zero fill, 0600 mode),
// error codes, unlinking, move semantics, and sharing between two real processes.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "shm/error.h"
#include "shm/segment.h"
#include "tests/cpp/shm/test_support.h"

namespace trainstream::shm {
namespace {

using trainstream::testing::ExitedWith;
using trainstream::testing::ForkChild;
using trainstream::testing::ScopedSegmentName;
using trainstream::testing::WaitChild;

struct stat StatOf(const std::string& name) {
  struct stat info {};
  EXPECT_EQ(stat(("/dev/shm/" + name).c_str(), &info), 0) << "no /dev/shm/" << name;
  return info;
}

void Fill(const Segment& segment, uint8_t seed) {
  auto* bytes = static_cast<uint8_t*>(segment.data());
  for (size_t i = 0; i < segment.size(); ++i) bytes[i] = static_cast<uint8_t>(seed + i * 31);
}

bool HoldsFill(const Segment& segment, uint8_t seed) {
  const auto* bytes = static_cast<const uint8_t*>(segment.data());
  for (size_t i = 0; i < segment.size(); ++i) {
    if (bytes[i] != static_cast<uint8_t>(seed + i * 31)) return false;
  }
  return true;
}

TEST(SegmentName, HasUidJobKeyAndPart) {
  EXPECT_EQ(SegmentName(1000, "0123456789abcdef", "state"), "trainstream.1000.0123456789abcdef.state");
  EXPECT_EQ(SegmentName(0, "k", "rank7"), "trainstream.0.k.rank7");
}

TEST(Segment, CreateMakesAZeroFilledMappingOfTheAskedSize) {
  ScopedSegmentName name;
  constexpr size_t kBytes = 3 * 4096 + 123;
  Segment segment = Segment::Create(name.str(), kBytes);
  ASSERT_TRUE(segment.valid());
  EXPECT_EQ(segment.name(), name.str());
  EXPECT_EQ(segment.size(), kBytes);
  const auto* bytes = static_cast<const uint8_t*>(segment.data());
  EXPECT_TRUE(std::all_of(bytes, bytes + kBytes, [](uint8_t b) { return b == 0; }));
  EXPECT_EQ(static_cast<size_t>(StatOf(name.str()).st_size), kBytes);
  Fill(segment, 1);  // the whole mapping is writable
  EXPECT_TRUE(HoldsFill(segment, 1));
}

TEST(Segment, CreateIsOwnerOnlyWhateverTheUmask) {
  for (mode_t mask : {mode_t{0}, mode_t{022}}) {
    ScopedSegmentName name;
    const mode_t previous = umask(mask);
    Segment segment = Segment::Create(name.str(), 4096);
    umask(previous);
    const struct stat info = StatOf(name.str());
    EXPECT_EQ(info.st_mode & 07777, 0600u) << "umask " << std::oct << mask;
    EXPECT_EQ(info.st_uid, geteuid());
  }
}

TEST(Segment, CreatingAnExistingNameFailsWithAlreadyExists) {
  ScopedSegmentName name;
  Segment first = Segment::Create(name.str(), 4096);
  Fill(first, 7);
  TS_EXPECT_ERROR(Segment::Create(name.str(), 4096), Code::kAlreadyExists, name.str());
  EXPECT_TRUE(Segment::Exists(name.str()));  // the failed create did not unlink the first one
  EXPECT_TRUE(HoldsFill(first, 7));
}

TEST(Segment, OpeningAMissingNameFailsWithNotFound) {
  ScopedSegmentName name;
  TS_EXPECT_ERROR(Segment::Open(name.str()), Code::kNotFound, name.str());
}

TEST(Segment, FailedCreateLeavesNoNameBehind) {
  ScopedSegmentName name;
  EXPECT_THROW(Segment::Create(name.str(), size_t{1} << 62), Error);  // cannot be mapped
  EXPECT_FALSE(Segment::Exists(name.str()));
}

TEST(Segment, CreateBacksEveryPage) {
  ScopedSegmentName name;
  const Segment segment = Segment::Create(name.str(), size_t{1} << 20);
  EXPECT_GE(StatOf(name.str()).st_blocks * 512, 1 << 20);  // not sparse
}

TEST(Segment, CreateLeavesUnbackedRangesToTheFirstTouch) {
  ScopedSegmentName name;
  const Segment segment = Segment::Create(name.str(), size_t{1} << 20, std::nullopt, {{.offset = 0, .bytes = 1 << 20}});
  EXPECT_EQ(StatOf(name.str()).st_blocks, 0);
}

TEST(Segment, CreateBacksWhatLiesAroundUnbackedRanges) {  // a new job's state without its master weights
  ScopedSegmentName name;
  constexpr size_t kMiB = size_t{1} << 20, kHugePage = 2 * kMiB;
  // Two ranges, out of order, the second's ends not on pages: a page it only partly covers is backed
  // (a 2 MiB one where /dev/shm gives huge pages).
  const Segment segment =
      Segment::Create(name.str(), 32 * kMiB, std::nullopt,
                      {{.offset = 20 * kMiB + 100, .bytes = 8 * kMiB - 101}, {.offset = 4 * kMiB, .bytes = 8 * kMiB}});
  const auto backed = [&] { return static_cast<size_t>(StatOf(name.str()).st_blocks) * 512; };
  const size_t at_creation = backed();
  EXPECT_GE(at_creation, 16 * kMiB);  // [0,4) [12,20) [28,32) MiB
  EXPECT_LE(at_creation, 16 * kMiB + 2 * kHugePage);
  static_cast<std::byte*>(segment.data())[6 * kMiB] = std::byte{1};  // the first touch backs a page of a range
  EXPECT_GT(backed(), at_creation);
}

TEST(Segment, CreateBeyondWhatDevShmHoldsFailsWithResourceExhausted) {
  struct statvfs shm {};
  ASSERT_EQ(statvfs("/dev/shm", &shm), 0);
  const size_t beyond = static_cast<size_t>(shm.f_blocks) * shm.f_frsize + (size_t{1} << 20);
  for (const bool backed : {true, false}) {
    ScopedSegmentName name;
    const std::vector<Segment::Range> unbacked =
        backed ? std::vector<Segment::Range>{} : std::vector<Segment::Range>{{.offset = 0, .bytes = beyond}};
    TS_EXPECT_ERROR(Segment::Create(name.str(), beyond, std::nullopt, unbacked), Code::kResourceExhausted,
                    "available in /dev/shm");
    EXPECT_FALSE(Segment::Exists(name.str()));
  }
}

TEST(Segment, OpenMapsTheSameMemory) {
  ScopedSegmentName name;
  Segment created = Segment::Create(name.str(), 8192);
  Segment opened = Segment::Open(name.str());
  EXPECT_EQ(opened.size(), created.size());
  Fill(created, 3);
  EXPECT_TRUE(HoldsFill(opened, 3));
}

TEST(Segment, RemoveUnlinksTheNameButKeepsMappings) {
  ScopedSegmentName name;
  EXPECT_FALSE(Segment::Exists(name.str()));
  Segment segment = Segment::Create(name.str(), 4096);
  EXPECT_TRUE(Segment::Exists(name.str()));
  EXPECT_TRUE(Segment::Remove(name.str()));
  EXPECT_FALSE(Segment::Exists(name.str()));
  EXPECT_FALSE(Segment::Remove(name.str()));
  Fill(segment, 9);
  EXPECT_TRUE(HoldsFill(segment, 9));
  TS_EXPECT_ERROR(Segment::Open(name.str()), Code::kNotFound, name.str());
}

TEST(Segment, DestructionUnlinksOnlyWithRemoveOnDestroy) {
  ScopedSegmentName kept, removed;
  {
    Segment plain = Segment::Create(kept.str(), 4096);
    Segment owned = Segment::Create(removed.str(), 4096);
    owned.RemoveOnDestroy();
  }
  EXPECT_TRUE(Segment::Exists(kept.str()));
  EXPECT_FALSE(Segment::Exists(removed.str()));
}

TEST(Segment, MoveConstructionKeepsTheMappingAndOwnership) {
  ScopedSegmentName name;
  Segment original = Segment::Create(name.str(), 4096);
  original.RemoveOnDestroy();
  Fill(original, 5);
  void* const address = original.data();
  {
    Segment moved(std::move(original));
    EXPECT_EQ(moved.data(), address);
    EXPECT_EQ(moved.size(), 4096u);
    EXPECT_EQ(moved.name(), name.str());
    EXPECT_TRUE(HoldsFill(moved, 5));
    EXPECT_FALSE(original.valid());  // NOLINT(bugprone-use-after-move): moved-from is empty by contract
  }
  EXPECT_FALSE(Segment::Exists(name.str()));  // the new owner unlinked it
}

TEST(Segment, MovedFromSegmentDoesNotUnlink) {
  ScopedSegmentName name;
  Segment target;
  {
    Segment original = Segment::Create(name.str(), 4096);
    original.RemoveOnDestroy();
    target = std::move(original);
  }
  EXPECT_TRUE(Segment::Exists(name.str()));
  EXPECT_TRUE(target.valid());
}

TEST(Segment, MoveAssignmentReleasesTheOldSegment) {
  ScopedSegmentName first_name, second_name;
  Segment first = Segment::Create(first_name.str(), 4096);
  first.RemoveOnDestroy();
  Segment second = Segment::Create(second_name.str(), 8192);
  Fill(second, 11);
  void* const address = second.data();
  first = std::move(second);
  EXPECT_FALSE(Segment::Exists(first_name.str()));  // the old value of `first` was destroyed
  EXPECT_EQ(first.data(), address);
  EXPECT_EQ(first.size(), 8192u);
  EXPECT_EQ(first.name(), second_name.str());
  EXPECT_TRUE(HoldsFill(first, 11));
}

TEST(Segment, SecondProcessSeesWritesOfTheFirst) {
  ScopedSegmentName name;
  constexpr size_t kHalf = 64 * 1024;
  Segment segment = Segment::Create(name.str(), 2 * kHalf);
  auto* bytes = static_cast<uint8_t*>(segment.data());
  for (size_t i = 0; i < kHalf; ++i) bytes[i] = static_cast<uint8_t>(i * 13 + 1);
  const pid_t child = ForkChild([&] {
    Segment mine = Segment::Open(name.str());
    if (mine.size() != 2 * kHalf) return 2;
    auto* theirs = static_cast<uint8_t*>(mine.data());
    for (size_t i = 0; i < kHalf; ++i) {
      if (theirs[i] != static_cast<uint8_t>(i * 13 + 1)) return 3;
      theirs[kHalf + i] = static_cast<uint8_t>(i * 7 + 2);
    }
    return 0;
  });
  ASSERT_TRUE(ExitedWith(WaitChild(child), 0));
  size_t wrong = 0;
  for (size_t i = 0; i < kHalf; ++i) wrong += bytes[kHalf + i] != static_cast<uint8_t>(i * 7 + 2);
  EXPECT_EQ(wrong, 0u);
}

TEST(Segment, AnotherUidMayNotOpenIt) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to switch to another uid";
  ScopedSegmentName name;
  Segment segment = Segment::Create(name.str(), 4096);
  const pid_t child = ForkChild([&] {
    if (setgid(65534) != 0 || setuid(65534) != 0) return 2;
    try {
      Segment::Open(name.str());
    } catch (const Error& e) {
      return e.code() == Code::kPermissionDenied ? 0 : 3;
    }
    return 4;  // opened another uid's 0600 segment
  });
  EXPECT_TRUE(ExitedWith(WaitChild(child), 0));
}

}  // namespace
}  // namespace trainstream::shm
