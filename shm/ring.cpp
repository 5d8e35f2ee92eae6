#include "shm/ring.h"

#include <new>

#include "shm/error.h"
#include "shm/futex.h"

namespace trainstream::shm {

void Doorbell::Ring() {
  seq.fetch_add(1, std::memory_order_seq_cst);
  if (waiters.load(std::memory_order_seq_cst) != 0) FutexWakeAll(&seq);
}

void Doorbell::Wait(uint32_t seen, std::chrono::microseconds timeout) {
  waiters.fetch_add(1, std::memory_order_seq_cst);
  FutexWait(&seq, seen, timeout);
  waiters.fetch_sub(1, std::memory_order_seq_cst);
}

RingHeader* InitRing(void* memory, uint32_t capacity) {
  TS_CHECK(capacity != 0 && (capacity & (capacity - 1)) == 0, Code::kInvalidArgument,
           "ring capacity {} is not a power of two", capacity);
  auto* ring = new (memory) RingHeader();
  ring->capacity = capacity;
  return ring;
}

namespace {
Message* SlotsOf(RingHeader* ring) {
  return reinterpret_cast<Message*>(ring + 1);
}

uint64_t CheckedMask(const RingHeader* ring) {
  TS_CHECK(ring->magic == RingHeader::kMagic, Code::kInvalidArgument, "ring header is corrupt (bad magic)");
  const uint32_t capacity = ring->capacity;
  TS_CHECK(capacity != 0 && (capacity & (capacity - 1)) == 0, Code::kInvalidArgument,
           "ring header is corrupt (capacity {})", capacity);
  return capacity - 1;
}
}  // namespace

RingProducer::RingProducer(RingHeader* ring, Doorbell* doorbell)
    : ring_(ring), slots_(SlotsOf(ring)), doorbell_(doorbell), head_(ring->head.load()), mask_(CheckedMask(ring)) {}

bool RingProducer::TryPush(const Message& message) {
  const uint64_t tail = ring_->tail.load(std::memory_order_acquire);
  TS_CHECK(tail <= head_ && head_ - tail <= mask_ + 1, Code::kInvalidArgument,
           "ring is corrupt: consumer index {} is inconsistent with producer index {}", tail, head_);
  if (head_ - tail == mask_ + 1) return false;
  slots_[head_ & mask_] = message;
  ++head_;
  ring_->head.store(head_, std::memory_order_release);
  if (doorbell_ != nullptr) doorbell_->Ring();
  return true;
}

RingConsumer::RingConsumer(RingHeader* ring)
    : ring_(ring), slots_(SlotsOf(ring)), tail_(ring->tail.load()), mask_(CheckedMask(ring)) {}

bool RingConsumer::TryPop(Message* message) {
  const uint64_t head = ring_->head.load(std::memory_order_acquire);
  if (head == tail_) return false;
  TS_CHECK(head > tail_ && head - tail_ <= mask_ + 1, Code::kInvalidArgument,
           "ring is corrupt: producer index {} is inconsistent with consumer index {}", head, tail_);
  *message = slots_[tail_ & mask_];
  ++tail_;
  ring_->tail.store(tail_, std::memory_order_release);
  return true;
}

}  // namespace trainstream::shm
