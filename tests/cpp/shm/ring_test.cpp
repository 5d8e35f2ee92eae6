// Tests of the SPSC message ring and its futex doorbell (shm/ring.h): ordering, capacity, wrap-around,
// corrupt headers, and producer/consumer pairs in two real processes sharing a Segment.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "shm/error.h"
#include "shm/message.h"
#include "shm/ring.h"
#include "shm/segment.h"
#include "tests/cpp/shm/test_support.h"

namespace trainstream::shm {
namespace {

using namespace std::chrono_literals;
using trainstream::testing::ExitedWith;
using trainstream::testing::ForkChild;
using trainstream::testing::ScopedSegmentName;
using trainstream::testing::WaitChild;

// A message whose every field (reserved bytes included) is derived from `sequence`.
Message MakeMessage(uint64_t sequence) {
  Message message;
  message.kind = MessageKind::kGradReady;
  message.flags = static_cast<uint16_t>(sequence & 1);
  message.bucket = static_cast<uint32_t>(sequence * 7);
  message.step = sequence;
  message.micro = static_cast<uint32_t>(sequence >> 3);
  message.slot = static_cast<uint32_t>(~sequence);
  for (size_t i = 0; i < sizeof(message.reserved); ++i) message.reserved[i] = static_cast<uint8_t>(sequence + i);
  return message;
}

// Field by field: Message holds floating-point fields, whose bytes memcmp may not compare (-0.0, NaN).
bool Matches(const Message& message, uint64_t sequence) {
  const Message expected = MakeMessage(sequence);
  return message.kind == expected.kind && message.flags == expected.flags && message.bucket == expected.bucket &&
         message.step == expected.step && message.micro == expected.micro && message.slot == expected.slot &&
         message.piece == expected.piece && message.norm_factor == expected.norm_factor &&
         message.value == expected.value && message.factor == expected.factor &&
         std::memcmp(message.reserved, expected.reserved, sizeof(message.reserved)) == 0;
}

// A ring in (64-byte aligned) private memory, for the single-process tests.
class LocalRing {
 public:
  explicit LocalRing(uint32_t capacity) : storage_(RingBytes(capacity) / sizeof(Message)) {
    header_ = InitRing(storage_.data(), capacity);
  }
  [[nodiscard]] RingHeader* header() const { return header_; }

 private:
  std::vector<Message> storage_;  // Message is 64 bytes and 64-byte aligned
  RingHeader* header_ = nullptr;
};

// Shared-memory layout of the two-process tests: a doorbell, a flag, then the ring.
struct alignas(64) SharedArea {
  Doorbell doorbell;
  std::atomic<uint64_t> consumed{0};
};
constexpr uint32_t kSharedCapacity = 1024;

RingHeader* RingIn(const Segment& segment) {
  return reinterpret_cast<RingHeader*>(static_cast<std::byte*>(segment.data()) + sizeof(SharedArea));
}
SharedArea* AreaIn(const Segment& segment) {
  return static_cast<SharedArea*>(segment.data());
}

Segment CreateSharedRing(const std::string& name) {
  Segment segment = Segment::Create(name, sizeof(SharedArea) + RingBytes(kSharedCapacity));
  new (segment.data()) SharedArea();
  InitRing(RingIn(segment), kSharedCapacity);
  return segment;
}

TEST(Ring, PopFromEmptyRingFails) {
  LocalRing ring(8);
  RingConsumer consumer(ring.header());
  Message message;
  EXPECT_FALSE(consumer.TryPop(&message));
  EXPECT_FALSE(consumer.TryPop(&message));
}

TEST(Ring, DeliversInFifoOrder) {
  LocalRing ring(8);
  RingProducer producer(ring.header(), nullptr);
  RingConsumer consumer(ring.header());
  for (uint64_t i = 0; i < 5; ++i) ASSERT_TRUE(producer.TryPush(MakeMessage(i)));
  Message message;
  for (uint64_t i = 0; i < 5; ++i) {
    ASSERT_TRUE(consumer.TryPop(&message));
    EXPECT_TRUE(Matches(message, i)) << "at " << i;
  }
  EXPECT_FALSE(consumer.TryPop(&message));
}

TEST(Ring, FullRingRefusesPushUntilOneIsPopped) {
  LocalRing ring(8);
  RingProducer producer(ring.header(), nullptr);
  RingConsumer consumer(ring.header());
  for (uint64_t i = 0; i < 8; ++i) ASSERT_TRUE(producer.TryPush(MakeMessage(i))) << "message " << i;
  EXPECT_FALSE(producer.TryPush(MakeMessage(8)));
  Message message;
  ASSERT_TRUE(consumer.TryPop(&message));
  EXPECT_TRUE(Matches(message, 0));
  EXPECT_TRUE(producer.TryPush(MakeMessage(8)));
  EXPECT_FALSE(producer.TryPush(MakeMessage(9)));
}

TEST(Ring, PushRingsTheDoorbell) {
  LocalRing ring(2);
  Doorbell doorbell;
  RingProducer producer(ring.header(), &doorbell);
  const uint32_t before = doorbell.Seq();
  ASSERT_TRUE(producer.TryPush(MakeMessage(0)));
  EXPECT_NE(doorbell.Seq(), before);
}

TEST(Ring, EndpointsResumeFromThePublishedIndices) {
  LocalRing ring(4);
  {
    RingProducer producer(ring.header(), nullptr);
    for (uint64_t i = 0; i < 3; ++i) ASSERT_TRUE(producer.TryPush(MakeMessage(i)));
  }
  RingConsumer first(ring.header());
  Message message;
  ASSERT_TRUE(first.TryPop(&message));
  RingConsumer second(ring.header());  // a restarted consumer continues after what was consumed
  RingProducer producer(ring.header(), nullptr);
  ASSERT_TRUE(producer.TryPush(MakeMessage(3)));
  for (uint64_t i = 1; i < 4; ++i) {
    ASSERT_TRUE(second.TryPop(&message));
    EXPECT_TRUE(Matches(message, i));
  }
}

class RingCapacity : public ::testing::TestWithParam<uint32_t> {};

TEST_P(RingCapacity, HoldsExactlyCapacityMessages) {
  const uint32_t capacity = GetParam();
  LocalRing ring(capacity);
  RingProducer producer(ring.header(), nullptr);
  RingConsumer consumer(ring.header());
  for (uint32_t i = 0; i < capacity; ++i) ASSERT_TRUE(producer.TryPush(MakeMessage(i)));
  EXPECT_FALSE(producer.TryPush(MakeMessage(capacity)));
  Message message;
  for (uint32_t i = 0; i < capacity; ++i) {
    ASSERT_TRUE(consumer.TryPop(&message));
    ASSERT_TRUE(Matches(message, i));
  }
  EXPECT_FALSE(consumer.TryPop(&message));
}

TEST_P(RingCapacity, WrapsAroundManyTimesWithoutLosingOrCorruptingMessages) {
  const uint32_t capacity = GetParam();
  LocalRing ring(capacity);
  RingProducer producer(ring.header(), nullptr);
  RingConsumer consumer(ring.header());
  const uint64_t total = uint64_t{capacity} * 37 + 5;
  uint64_t pushed = 0, popped = 0;
  Message message;
  // Batches of varying size (1 .. capacity) so head and tail cross the end at every offset.
  for (uint64_t round = 0; popped < total; ++round) {
    const uint64_t batch = 1 + round % capacity;
    for (uint64_t i = 0; i < batch && pushed < total; ++i) ASSERT_TRUE(producer.TryPush(MakeMessage(pushed++)));
    while (consumer.TryPop(&message)) ASSERT_TRUE(Matches(message, popped++)) << "message " << popped - 1;
    ASSERT_EQ(popped, pushed);
  }
  EXPECT_EQ(ring.header()->head.load(), total);
  EXPECT_EQ(ring.header()->tail.load(), total);
}

INSTANTIATE_TEST_SUITE_P(Capacities, RingCapacity, ::testing::Values(1u, 2u, 8u, 1024u),
                         [](const ::testing::TestParamInfo<uint32_t>& info) { return std::to_string(info.param); });

TEST(RingCorruption, ConsumerIndexAheadOfProducerMakesPushThrow) {
  LocalRing ring(8);
  RingProducer producer(ring.header(), nullptr);
  ASSERT_TRUE(producer.TryPush(MakeMessage(0)));
  ring.header()->tail.store(5);  // the consumer claims to have read what was never written
  EXPECT_THROW(producer.TryPush(MakeMessage(1)), Error);
}

TEST(RingCorruption, ConsumerIndexFarBehindMakesPushThrow) {
  LocalRing ring(8);
  RingProducer producer(ring.header(), nullptr);
  RingConsumer consumer(ring.header());
  for (uint64_t i = 0; i < 20; ++i) {
    Message message;
    ASSERT_TRUE(producer.TryPush(MakeMessage(i)));
    ASSERT_TRUE(consumer.TryPop(&message));
  }
  ring.header()->tail.store(2);  // more than capacity behind the producer
  try {
    producer.TryPush(MakeMessage(20));
    ADD_FAILURE() << "TryPush accepted an inconsistent header";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kInvalidArgument);
  }
}

TEST(RingCorruption, ProducerIndexTooFarAheadMakesPopThrow) {
  LocalRing ring(8);
  RingConsumer consumer(ring.header());
  ring.header()->head.store(9);  // more messages than the ring can hold
  Message message;
  try {
    consumer.TryPop(&message);
    ADD_FAILURE() << "TryPop accepted an inconsistent header";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kInvalidArgument);
  }
}

TEST(RingCorruption, ProducerIndexBehindConsumerMakesPopThrow) {
  LocalRing ring(8);
  RingProducer producer(ring.header(), nullptr);
  RingConsumer consumer(ring.header());
  Message message;
  for (uint64_t i = 0; i < 4; ++i) ASSERT_TRUE(producer.TryPush(MakeMessage(i)));
  for (uint64_t i = 0; i < 4; ++i) ASSERT_TRUE(consumer.TryPop(&message));
  ring.header()->head.store(1);  // rewound below what was consumed
  EXPECT_THROW(consumer.TryPop(&message), Error);
  ring.header()->head.store(~uint64_t{0});  // or wildly ahead
  EXPECT_THROW(consumer.TryPop(&message), Error);
}

TEST(RingCorruption, InitRingRejectsCapacitiesThatAreNotPowersOfTwo) {
  for (uint32_t capacity : {0u, 3u, 1000u, 0x80000001u}) {
    std::vector<Message> storage(4);  // InitRing must refuse before writing anything
    try {
      InitRing(storage.data(), capacity);
      ADD_FAILURE() << "capacity " << capacity << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Code::kInvalidArgument);
    }
  }
}

TEST(RingCorruption, EndpointsRejectBadMagicOrCapacity) {
  LocalRing ring(8);
  ring.header()->magic = 0xDEADBEEF;
  EXPECT_THROW(RingProducer(ring.header(), nullptr), Error);
  EXPECT_THROW(RingConsumer{ring.header()}, Error);
  ring.header()->magic = RingHeader::kMagic;
  for (uint32_t capacity : {0u, 6u}) {
    ring.header()->capacity = capacity;
    EXPECT_THROW(RingProducer(ring.header(), nullptr), Error) << capacity;
    EXPECT_THROW(RingConsumer{ring.header()}, Error) << capacity;
  }
}

TEST(Doorbell, WaitReturnsWhenAnotherThreadRings) {
  Doorbell doorbell;
  const uint32_t seen = doorbell.Seq();
  std::thread ringer([&] {
    std::this_thread::sleep_for(50ms);
    doorbell.Ring();
  });
  const auto start = std::chrono::steady_clock::now();
  doorbell.Wait(seen, 10s);
  const auto waited = std::chrono::steady_clock::now() - start;
  ringer.join();
  EXPECT_LT(waited, 5s);
  EXPECT_NE(doorbell.Seq(), seen);
}

TEST(Doorbell, WaitTimesOutWhenNobodyRings) {
  Doorbell doorbell;
  const auto start = std::chrono::steady_clock::now();
  doorbell.Wait(doorbell.Seq(), 50ms);
  const auto waited = std::chrono::steady_clock::now() - start;
  EXPECT_GE(waited, 45ms);
  EXPECT_LT(waited, 5s);
  EXPECT_EQ(doorbell.waiters.load(), 0u);
}

TEST(Doorbell, WaitReturnsAtOnceIfRungSinceSeqWasRead) {
  Doorbell doorbell;
  const uint32_t seen = doorbell.Seq();
  doorbell.Ring();
  const auto start = std::chrono::steady_clock::now();
  doorbell.Wait(seen, 10s);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
}

TEST(Doorbell, WaitReturnsWhenAnotherProcessRings) {
  ScopedSegmentName name;
  Segment segment = CreateSharedRing(name.str());
  Doorbell& doorbell = AreaIn(segment)->doorbell;
  const uint32_t seen = doorbell.Seq();
  const pid_t child = ForkChild([&] {
    Segment mine = Segment::Open(name.str());
    std::this_thread::sleep_for(50ms);
    AreaIn(mine)->doorbell.Ring();
    return 0;
  });
  const auto start = std::chrono::steady_clock::now();
  doorbell.Wait(seen, 10s);
  const auto waited = std::chrono::steady_clock::now() - start;
  EXPECT_TRUE(ExitedWith(WaitChild(child), 0));
  EXPECT_LT(waited, 5s);
  EXPECT_NE(doorbell.Seq(), seen);
}

// A child produces N messages; the parent consumes them, sleeping on the doorbell when the ring is empty.
TEST(RingTwoProcesses, ChildProducesParentConsumesInOrder) {
  constexpr uint64_t kMessages = 100000;
  ScopedSegmentName name;
  Segment segment = CreateSharedRing(name.str());
  const pid_t child = ForkChild([&] {
    Segment mine = Segment::Open(name.str());
    RingProducer producer(RingIn(mine), &AreaIn(mine)->doorbell);
    for (uint64_t i = 0; i < kMessages; ++i) {
      while (!producer.TryPush(MakeMessage(i))) std::this_thread::yield();
    }
    return 0;
  });

  RingConsumer consumer(RingIn(segment));
  Doorbell& doorbell = AreaIn(segment)->doorbell;
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  uint64_t received = 0, mismatches = 0;
  Message message;
  while (received < kMessages && std::chrono::steady_clock::now() < deadline) {
    const uint32_t seen = doorbell.Seq();
    bool any = false;
    while (consumer.TryPop(&message)) {
      any = true;
      if (!Matches(message, received)) ++mismatches;
      ++received;
    }
    if (!any) doorbell.Wait(seen, 100ms);
  }
  EXPECT_EQ(received, kMessages);
  EXPECT_EQ(mismatches, 0u);
  EXPECT_FALSE(consumer.TryPop(&message));
  EXPECT_TRUE(ExitedWith(WaitChild(child), 0));
}

// The consumer dies mid-stream: the producer fills the ring, then TryPush keeps returning false at once.
TEST(RingTwoProcesses, ProducerNeverBlocksWhenTheConsumerIsKilled) {
  constexpr uint64_t kConsumedByChild = 100;
  ScopedSegmentName name;
  Segment segment = CreateSharedRing(name.str());
  const pid_t child = ForkChild([&] {
    Segment mine = Segment::Open(name.str());
    RingConsumer consumer(RingIn(mine));
    Message message;
    uint64_t count = 0;
    while (count < kConsumedByChild) {
      if (consumer.TryPop(&message)) {
        if (!Matches(message, count)) return 2;
        ++count;
      }
    }
    AreaIn(mine)->consumed.store(count);
    for (;;) pause();  // stays alive holding the ring until killed
  });

  RingProducer producer(RingIn(segment), &AreaIn(segment)->doorbell);
  uint64_t pushed = 0;
  for (; pushed < kConsumedByChild; ++pushed) ASSERT_TRUE(producer.TryPush(MakeMessage(pushed)));
  ASSERT_TRUE(trainstream::testing::PollUntil([&] { return AreaIn(segment)->consumed.load() == kConsumedByChild; }));
  ASSERT_EQ(kill(child, SIGKILL), 0);
  const int status = WaitChild(child);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);

  const auto start = std::chrono::steady_clock::now();
  while (producer.TryPush(MakeMessage(pushed))) ++pushed;
  EXPECT_EQ(pushed, kConsumedByChild + kSharedCapacity);
  for (int i = 0; i < 10000; ++i) ASSERT_FALSE(producer.TryPush(MakeMessage(pushed)));
  EXPECT_LT(std::chrono::steady_clock::now() - start, 2s);
}

}  // namespace
}  // namespace trainstream::shm
