// PageRanges: the range arithmetic behind PinnedHost (which host pages the cuda-ipc copies register,
// and how a copy is cut so that no part spans two registrations), on plain memory.
#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>
#include <vector>

#include "daemon/gpu/pinned_host.h"

namespace trainstream::daemon {
namespace {

constexpr size_t kPage = 4096;

class PageRangesTest : public ::testing::Test {
 protected:
  std::byte* At(size_t offset) { return memory_.get() + offset; }
  HostRange Range(size_t offset, size_t bytes) { return HostRange{At(offset), bytes}; }

  std::unique_ptr<std::byte, decltype(&std::free)> memory_{
      static_cast<std::byte*>(std::aligned_alloc(kPage, 16 * kPage)), &std::free};
  PageRanges ranges_{kPage};
};

TEST_F(PageRangesTest, NothingRegisteredMeansEveryTouchedPageIsMissing) {
  EXPECT_EQ(ranges_.Missing(At(100), 5000), (std::vector<HostRange>{Range(0, 2 * kPage)}));
  EXPECT_EQ(ranges_.Cut(At(100), 5000), (std::vector<HostRange>{Range(100, 5000)}));
}

TEST_F(PageRangesTest, NeighbouringBucketsShareAPageButNoRegistration) {
  // Bucket A: [100, 6000) registers pages 0-1; bucket B: [6000, 13000) then needs pages 2-3 only.
  for (const HostRange& range : ranges_.Missing(At(100), 5900)) ranges_.Add(range);
  const std::vector<HostRange> missing = ranges_.Missing(At(6000), 7000);
  EXPECT_EQ(missing, (std::vector<HostRange>{Range(2 * kPage, 2 * kPage)}));
  for (const HostRange& range : missing) ranges_.Add(range);
  // A copy of bucket B spans both registrations: it is cut at their boundary.
  EXPECT_EQ(ranges_.Cut(At(6000), 7000),
            (std::vector<HostRange>{Range(6000, 2 * kPage - 6000), Range(2 * kPage, 13000 - 2 * kPage)}));
  EXPECT_EQ(ranges_.bytes(), 4 * kPage);
}

TEST_F(PageRangesTest, PiecesOutsideEveryRangeStayWhole) {
  ranges_.Add(Range(2 * kPage, kPage));
  EXPECT_EQ(ranges_.Cut(At(kPage), 3 * kPage),
            (std::vector<HostRange>{Range(kPage, kPage), Range(2 * kPage, kPage), Range(3 * kPage, kPage)}));
  EXPECT_EQ(ranges_.Missing(At(kPage), 3 * kPage),
            (std::vector<HostRange>{Range(kPage, kPage), Range(3 * kPage, kPage)}));
}

TEST_F(PageRangesTest, RemoveInsideTakesOnlyTheRangesOfThatMemory) {
  ranges_.Add(Range(0, kPage));
  ranges_.Add(Range(4 * kPage, 2 * kPage));
  ranges_.Add(Range(8 * kPage, kPage));
  EXPECT_EQ(ranges_.RemoveInside(At(4 * kPage), 4 * kPage), (std::vector<HostRange>{Range(4 * kPage, 2 * kPage)}));
  EXPECT_EQ(ranges_.bytes(), 2 * kPage);
  EXPECT_EQ(ranges_.Missing(At(4 * kPage), 2 * kPage), (std::vector<HostRange>{Range(4 * kPage, 2 * kPage)}));
}

}  // namespace
}  // namespace trainstream::daemon
