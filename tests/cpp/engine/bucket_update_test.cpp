// RunningUpdate and SplitIntoPieces alone (daemon/engine/bucket_update.h): where an update of a bucket
// larger than a staging slot splits, which pieces may run as the gradients come in, and when the
// written pieces may go to the GPUs and the update ends.
#include "daemon/engine/bucket_update.h"

#include <gtest/gtest.h>

#include <vector>

#include "shm/job_layout.h"

namespace trainstream::daemon {
namespace {

shm::JobLayout OneParameter(uint64_t numel) {
  shm::LayoutSpec spec;
  spec.params = {shm::ParamSpec{.name = "w", .shape = {static_cast<int64_t>(numel)}, .dtype = DType::kFloat32}};
  spec.world_size = 1;
  spec.state_halves = 2;
  return shm::ComputeLayout(spec);
}

// Blocks of `count` elements over parameter 0's `numel`.
std::vector<Block> BlocksOf(uint64_t numel, uint64_t count) {
  std::vector<Block> blocks;
  for (uint64_t begin = 0; begin < numel; begin += count) blocks.push_back({0, begin, std::min(count, numel - begin)});
  return blocks;
}

TEST(SplitIntoPieces, ABucketNoLargerThanASlotIsOnePiece) {
  const shm::JobLayout layout = OneParameter(1000);
  const auto pieces = SplitIntoPieces(layout, 0, BlocksOf(1000, 300), layout.buckets[0].bytes());
  ASSERT_EQ(pieces.size(), 1u);
  EXPECT_EQ(pieces[0], (std::pair<size_t, uint64_t>{4, layout.buckets[0].bytes()}));  // padded past 4000
}

TEST(SplitIntoPieces, APieceEndsBeforeTheBlockThatWouldReadPastTheNextSlot) {
  const shm::JobLayout layout = OneParameter(1000);  // 4000 bytes; blocks of 1200 bytes, slots of 1000
  const auto pieces = SplitIntoPieces(layout, 0, BlocksOf(1000, 300), 1000);
  const std::vector<std::pair<size_t, uint64_t>> expected = {
      {1, 1200}, {2, 2400}, {3, 3600}, {4, layout.buckets[0].bytes()}};
  EXPECT_EQ(pieces, expected);
}

TEST(RunningUpdate, PiecesRunAsTheirGradientsComeAndGoToTheGpusInOrder) {
  RunningUpdate update;
  update.pieces = {{1, 1200}, {2, 2400}, {4, 4000}};
  update.piece_written.assign(3, 0);
  EXPECT_EQ(update.TakeReady(1000), (std::pair<uint32_t, uint32_t>{0, 0}));  // piece 0 reads up to byte 1200
  EXPECT_EQ(update.TakeReady(2400), (std::pair<uint32_t, uint32_t>{0, 2}));
  EXPECT_EQ(update.unfinished, 2u);
  EXPECT_EQ(update.FirstBlock(1), 1u);
  EXPECT_EQ(update.MarkWritten(1), RunningUpdate::PieceEnd::kRunning);
  EXPECT_EQ(update.written, 0u);  // piece 0 is not written: nothing may go to the GPUs yet
  EXPECT_EQ(update.MarkWritten(0), RunningUpdate::PieceEnd::kWaitsForGradients);
  EXPECT_EQ(update.written, 2u);
  EXPECT_EQ(update.EndByte(update.written), 2400u);
  EXPECT_EQ(update.TakeReady(4000), (std::pair<uint32_t, uint32_t>{2, 3}));
  EXPECT_EQ(update.TakeReady(4000), (std::pair<uint32_t, uint32_t>{3, 3}));  // given out once
  EXPECT_EQ(update.MarkWritten(2), RunningUpdate::PieceEnd::kDone);
  EXPECT_EQ(update.written, 3u);
}

}  // namespace
}  // namespace trainstream::daemon
