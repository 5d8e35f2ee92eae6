// EngineMailbox alone (daemon/engine/engine_mailbox.h): what is posted reaches the engine thread in
// order with the doorbell rung, and WaitIdle returns only once every started piece of work continued.
#include "daemon/engine/engine_mailbox.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

namespace trainstream::daemon {
namespace {

TEST(EngineMailbox, PostedWorkComesBackInOrderAndRingsTheDoorbell) {
  shm::Doorbell doorbell;
  EngineMailbox mailbox(doorbell);
  const uint32_t seen = doorbell.Seq();
  std::vector<int> ran;
  mailbox.Post([&ran] { ran.push_back(1); });
  mailbox.Post([&ran] { ran.push_back(2); });
  EXPECT_NE(doorbell.Seq(), seen);
  for (auto& work : mailbox.Take()) work();
  EXPECT_EQ(ran, (std::vector<int>{1, 2}));
  EXPECT_TRUE(mailbox.Take().empty());
}

TEST(EngineMailbox, WaitIdleWaitsForEveryStartedWorkToContinue) {
  shm::Doorbell doorbell;
  EngineMailbox mailbox(doorbell);
  mailbox.Begin();
  mailbox.Begin();
  std::atomic<int> continued{0};
  std::thread worker([&] {
    for (int i = 0; i < 2; ++i) {
      ++continued;
      mailbox.Continue([] {});
    }
  });
  mailbox.WaitIdle();
  EXPECT_EQ(continued.load(), 2);
  worker.join();
  EXPECT_EQ(mailbox.Take().size(), 2u);
}

}  // namespace
}  // namespace trainstream::daemon
