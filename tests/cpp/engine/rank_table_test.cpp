// RankTable alone (daemon/engine/rank_table.h): who may attach, what a detach and a failure leave, what
// reaches a failed rank (nothing), and which divergence is kept (the first).
#include "daemon/engine/rank_table.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <deque>
#include <memory>
#include <string>

#include "shm/error.h"
#include "shm/segment.h"
#include "tests/cpp/engine/recording_sink.h"
#include "tests/cpp/shm/test_support.h"

namespace trainstream::daemon {
namespace {

class RankTableTest : public ::testing::Test {
 protected:
  RankTableTest() : layout_(shm::ComputeLayout(Spec())) {}

  static shm::LayoutSpec Spec() {
    shm::LayoutSpec spec;
    spec.params = {shm::ParamSpec{.name = "w", .shape = {16}, .dtype = DType::kFloat32}};
    spec.world_size = 2;
    return spec;
  }

  std::shared_ptr<RankChannel> Channel(uint32_t rank) {
    shm::Segment segment = shm::Segment::Create(names_.emplace_back().str(), layout_.rank_bytes);
    shm::InitRankSegment(segment.data(), layout_, rank);
    return std::make_shared<RankChannel>(rank, ClientSegment(std::move(segment), geteuid()), layout_,
                                         sinks_.emplace_back(std::make_shared<RecordingSink>()));
  }

  shm::JobLayout layout_;
  std::deque<trainstream::testing::ScopedSegmentName> names_;
  std::deque<std::shared_ptr<RecordingSink>> sinks_;
  RankTable table_{"job", 2, nullptr, nullptr};
};

TEST_F(RankTableTest, ARankAttachesOnceWithinTheWorldSize) {
  table_.Add(Channel(1));
  EXPECT_TRUE(table_.Has(1));
  EXPECT_FALSE(table_.Has(0));
  try {
    table_.Add(Channel(1));
    ADD_FAILURE() << "attached twice";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kAlreadyExists);
  }
  EXPECT_THROW(table_.Add(Channel(2)), Error);
  EXPECT_EQ(table_.AttachedRanks(), std::vector<uint32_t>{1});
  EXPECT_TRUE(table_.Remove(1));
  EXPECT_FALSE(table_.Remove(1));
  EXPECT_TRUE(table_.AttachedRanks().empty());
}

TEST_F(RankTableTest, AFailedRankHearsWhyAndIsPostedNothingMore) {
  const auto first = Channel(0);
  const auto second = Channel(1);
  table_.Add(first);
  table_.Add(second);
  EXPECT_TRUE(table_.Attached(first));
  table_.FailRank(*first, "bad message");
  EXPECT_FALSE(table_.Attached(first));
  EXPECT_EQ(sinks_[0]->failures(), std::vector<std::string>{"bad message"});
  table_.PostToAll(shm::Message{.kind = shm::MessageKind::kParamsReady, .step = 1});
  shm::Message got;
  EXPECT_FALSE(shm::RingConsumer(first->view.completion_ring).TryPop(&got));
  ASSERT_TRUE(shm::RingConsumer(second->view.completion_ring).TryPop(&got));
  EXPECT_EQ(got.kind, shm::MessageKind::kParamsReady);
  EXPECT_FALSE(table_.CheckMemory());
}

TEST_F(RankTableTest, TheFirstDivergenceIsKept) {
  EXPECT_FALSE(table_.diverged());
  table_.SetDiverged("first");
  table_.SetDiverged("second");
  EXPECT_EQ(table_.diverged(), std::optional<std::string>("first"));
}

}  // namespace
}  // namespace trainstream::daemon
