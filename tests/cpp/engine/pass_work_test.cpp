// The cutting of a pass into blocks alone (daemon/engine/pass_work.h): which blocks a pass over a bucket
// has, the NUMA node each runs on, and the order-independent sum of their results.
#include "daemon/engine/pass_work.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

namespace trainstream::daemon {
namespace {

constexpr uint64_t kBlock = 1 << 16;

shm::JobLayout TwoParameters() {
  shm::LayoutSpec spec;
  spec.params = {shm::ParamSpec{.name = "a", .shape = {static_cast<int64_t>(kBlock + 10)}, .dtype = DType::kFloat32},
                 shm::ParamSpec{.name = "b", .shape = {100}, .dtype = DType::kFloat32}};
  spec.world_size = 1;
  return shm::ComputeLayout(spec);
}

TEST(PassWork, ABucketIsCutIntoBlocksOfTheParametersAPassIncludes) {
  const shm::JobLayout layout = TwoParameters();
  ASSERT_EQ(layout.params[0].bucket, layout.params[1].bucket);  // one bucket holds both
  const uint32_t bucket = layout.params[0].bucket;
  const auto all = BlocksOf(layout, bucket, [](uint32_t) { return true; });
  uint64_t elements = 0;
  for (const Block& block : *all) {
    EXPECT_LE(block.count, kBlock);
    elements += block.count;
  }
  EXPECT_EQ(all->size(), 3u);
  EXPECT_EQ(elements, kBlock + 10 + 100);
  const auto only_b = BlocksOf(layout, bucket, [](uint32_t p) { return p == 1; });
  ASSERT_EQ(only_b->size(), 1u);
  EXPECT_EQ((*only_b)[0].param, 1u);
  EXPECT_EQ((*only_b)[0].count, 100u);
}

TEST(PassWork, ABlocksHomeIsWhereItsElementsLieWhateverThePassIncludes) {
  const shm::JobLayout layout = TwoParameters();
  const uint32_t bucket = layout.params[0].bucket;
  EXPECT_FALSE(HomesOf(layout, 1, BlocksOf(layout, bucket, [](uint32_t) { return true; })));
  const auto blocks = BlocksOf(layout, bucket, [](uint32_t) { return true; });
  const WorkerPool::Home all = HomesOf(layout, 2, blocks);
  const WorkerPool::Home only_b = HomesOf(layout, 2, BlocksOf(layout, bucket, [](uint32_t p) { return p == 1; }));
  std::vector<uint32_t> homes;
  size_t b_block = 0;
  for (size_t i = 0; i < blocks->size(); ++i) {
    homes.push_back(all(i));
    if ((*blocks)[i].param == 1) b_block = i;
  }
  EXPECT_NE(std::count(homes.begin(), homes.end(), 0u), 0);  // the bucket's two halves: one per node
  EXPECT_NE(std::count(homes.begin(), homes.end(), 1u), 0);
  EXPECT_EQ(only_b(0), all(b_block));
}

TEST(PassWork, PartialSumsAddUpInBlockOrderAndAnUntracedWorkIsTheWorkItself) {
  EXPECT_EQ(Total({1.0, 2.0, 3.5}), 6.5);
  int ran = 0;
  const BlockWork work = Traced(nullptr, SpanKind::kNormBlock, 0, 1, [&ran](size_t, const Block&) { ++ran; });
  work(0, Block{0, 0, 1});
  EXPECT_EQ(ran, 1);
}

}  // namespace
}  // namespace trainstream::daemon
