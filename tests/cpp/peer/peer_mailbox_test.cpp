// Tests of the peer plane's mailbox (daemon/peer/peer_mailbox.h): fragments wait for their bucket's sink,
// go straight to a registered one, and expire once they have waited too long.
#include "daemon/peer/peer_mailbox.h"

#include <gtest/gtest.h>

#include <chrono>
#include <thread>
#include <vector>

namespace trainstream::daemon {
namespace {

using namespace std::chrono_literals;

class CountingSink final : public PeerSink {
 public:
  void Arrived(const FragmentKey&, PeerPayload) override { ++arrived; }
  int arrived = 0;
};

FragmentKey Fragment(uint64_t step, uint32_t fragment) {
  return FragmentKey{.job = "job", .step = step, .bucket = 0, .phase = 0, .round = 0, .fragment = fragment};
}

TEST(PeerMailbox, PiecesWaitForTheirSinkOrGoStraightToIt) {
  PeerMailbox mailbox;
  mailbox.Put(Fragment(1, 0), {});
  CountingSink sink;
  EXPECT_EQ(mailbox.Register("job", 1, 0, &sink).size(), 1U);  // waited
  mailbox.Put(Fragment(1, 1), {});
  EXPECT_EQ(sink.arrived, 1);  // delivered while registered
  mailbox.Unregister("job", 1, 0);
  EXPECT_TRUE(mailbox.Register("job", 1, 0, &sink).empty());
  mailbox.Unregister("job", 1, 0);
}

TEST(PeerMailbox, OnlyPiecesOlderThanTheAgeExpire) {
  PeerMailbox mailbox;
  mailbox.Put(Fragment(1, 0), {});
  mailbox.Put(Fragment(2, 0), {});
  std::this_thread::sleep_for(400ms);
  mailbox.Put(Fragment(3, 0), {});
  EXPECT_EQ(mailbox.Expire(200ms), 2U);  // margins wide enough for a loaded machine
  EXPECT_EQ(mailbox.Expire(1h), 0U);
  CountingSink sink;
  for (uint64_t step = 1; step <= 3; ++step) {
    EXPECT_EQ(mailbox.Register("job", step, 0, &sink).size(), step == 3 ? 1U : 0U) << "step " << step;
    mailbox.Unregister("job", step, 0);
  }
}

}  // namespace
}  // namespace trainstream::daemon
