// The data-plane messages carried by the rings: exactly 64 bytes, trivially copyable.
// Every field is validated by the receiver (the daemon: daemon/engine/step_engine.cpp); the wire
// values are part of the segment format: never renumber.
#pragma once

#include <cstdint>
#include <type_traits>

namespace trainstream::shm {

enum class MessageKind : uint16_t {
  // client -> daemon
  kGradReady = 1,  // rank's gradients for `bucket` of micro-batch `micro` of `step` are in its grad region
  kLoadState = 2,  // the client wrote master weights / moments / step counts; publish them as `step`
  // cuda-ipc: the rank's optimizer.step() for `step` was called and its weights-wanted event `slot` was
  // recorded after the last kernels that read the parameters: the step's weights may now be written
  kWeightsWanted = 3,
  // daemon -> client
  kSlotFree = 16,     // the daemon has consumed the grad region of `bucket` for (`step`, `micro`)
  kParamsReady = 17,  // the new weights of `bucket` after `step` are in the upload region (cuda-ipc: on the GPU)
  kStagingFree = 18,  // cuda-ipc: GPU gradient staging slot `slot` has been copied out and may be reused
};

enum MessageFlags : uint16_t {
  kFinalMicro = 1,  // kGradReady: the last micro-batch of the step; the update follows
  // kWeightsWanted: the rank's GPU already holds the weights of `step`: it wrote them into the master
  // weights itself (LOAD_STATE), so the daemon need not push them back
  kWeightsOnGpu = 2,
};

struct alignas(64) Message {
  MessageKind kind{};
  uint16_t flags = 0;
  uint32_t bucket = 0;
  uint64_t step = 0;
  uint32_t micro = 0;
  uint32_t slot = 0;  // cuda-ipc: staging slot (kGradReady, kStagingFree) or event (kWeightsWanted)
  // cuda-ipc kGradReady: the slot holds bytes [piece * slot_bytes, (piece + 1) * slot_bytes) of the
  // bucket's gradients (a bucket larger than a slot is staged piece by piece, in order)
  uint32_t piece = 0;
  uint8_t reserved[36] = {};
};

static_assert(sizeof(Message) == 64);
static_assert(std::is_trivially_copyable_v<Message>);

}  // namespace trainstream::shm
