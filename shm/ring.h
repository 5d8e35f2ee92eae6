// Single-producer single-consumer ring of fixed 64-byte messages in shared memory, and the doorbell
// that wakes its consumer.
//
// Invariants:
//  - Exactly one process produces and one consumes. Each side keeps its own index privately and only
//    publishes it into the shared header, so a peer that scribbles over the header can make the ring
//    report corruption (Error kInvalidArgument) but can never make this side read or write outside it.
//  - No lock is shared between processes: a peer that dies leaves a ring that is merely idle.
//  - Wake-ups go through a Doorbell (a futex word). Several rings may share one doorbell, so one
//    thread can wait for any of them (the daemon's per-job engine waits on all its ranks at once).
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>

#include "shm/message.h"

namespace trainstream::shm {

struct Doorbell {
  std::atomic<uint32_t> seq{0};
  std::atomic<uint32_t> waiters{0};

  // Producer side: called after publishing work.
  void Ring();
  // Consumer side: read Seq() before checking for work, then Wait(seq, ...) if there was none, so
  // that a Ring() between the check and the wait is never lost.
  [[nodiscard]] uint32_t Seq() const { return seq.load(std::memory_order_seq_cst); }
  void Wait(uint32_t seen, std::chrono::microseconds timeout);
};

struct alignas(64) RingHeader {
  static constexpr uint32_t kMagic = 0x52494E47;  // "RING"
  alignas(64) std::atomic<uint64_t> head{0};      // next index the producer writes
  alignas(64) std::atomic<uint64_t> tail{0};      // next index the consumer reads
  alignas(64) uint32_t magic = kMagic;
  uint32_t capacity = 0;  // a power of two
};

// Bytes a ring of `capacity` messages occupies (header + slots).
constexpr size_t RingBytes(uint32_t capacity) {
  return sizeof(RingHeader) + size_t{capacity} * sizeof(Message);
}

// Constructs an empty ring in place at `memory` (RingBytes(capacity) bytes, 64-byte aligned).
RingHeader* InitRing(void* memory, uint32_t capacity);

class RingProducer {
 public:
  RingProducer() = default;
  RingProducer(RingHeader* ring, Doorbell* doorbell);
  // Returns false when the ring is full. Throws Error if the consumer corrupted the header.
  bool TryPush(const Message& message);
  [[nodiscard]] bool valid() const { return ring_ != nullptr; }

 private:
  RingHeader* ring_ = nullptr;
  Message* slots_ = nullptr;
  Doorbell* doorbell_ = nullptr;
  uint64_t head_ = 0;
  uint64_t mask_ = 0;
};

class RingConsumer {
 public:
  RingConsumer() = default;
  explicit RingConsumer(RingHeader* ring);
  // Returns false when the ring is empty. Throws Error if the producer corrupted the header.
  bool TryPop(Message* message);
  [[nodiscard]] bool valid() const { return ring_ != nullptr; }

 private:
  RingHeader* ring_ = nullptr;
  const Message* slots_ = nullptr;
  uint64_t tail_ = 0;
  uint64_t mask_ = 0;
};

}  // namespace trainstream::shm
