// The data-plane messages carried by the rings: exactly 64 bytes, trivially copyable.
// Every field is validated by the receiver (the daemon: daemon/engine/step_engine.cpp); the wire
// values are part of the segment format: never renumber.
#pragma once

#include <cstddef>
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
  // What the trainer's loop did with `step`'s gradients (jobs with LayoutSpec::step_terms): `micro`
  // backward passes were summed; with kTermsNorm it wants their norm, with kTermsClip clipped to `value`,
  // with kTermsCommit optimizer.step() was called. `norm_factor` and `factor`: see Message.
  kStepTerms = 4,
  kMoreMicro = 5,  // another backward pass of `step` follows micro-batch `micro`: that one was not the last
  // zero_grad() before optimizer.step(): `step`'s gradients so far are dropped, for the `micro`th time
  // (each rank counts its discards of a step: the first rank's drops the step, the others' say the same)
  kDiscard = 6,
  // daemon -> client
  kSlotFree = 16,     // the daemon has consumed the grad region of `bucket` for (`step`, `micro`)
  kParamsReady = 17,  // the new weights of `bucket` after `step` are in the upload region (cuda-ipc: on the GPU)
  kStagingFree = 18,  // cuda-ipc: GPU gradient staging slot `slot` has been copied out and may be reused
  kStepNorm = 19,     // the global norm of `step`'s gradients is `value` (kNonFinite: some are inf or NaN)
  kDiscarded = 20,    // `step`'s gradients are dropped the `micro`th time: every grad region is free again
};

enum MessageFlags : uint16_t {
  // kGradReady: the last micro-batch of the step (with step terms: the rank expects it to be; the
  // update may start, and is taken back if another backward pass follows)
  kFinalMicro = 1,
  // kWeightsWanted: the rank's GPU already holds the weights of `step`: it wrote them into the master
  // weights itself (LOAD_STATE), so the daemon need not push them back
  kWeightsOnGpu = 2,
  // kGradReady with step terms: the rank cannot tell whether this micro-batch is the last (no step has
  // told it yet, or more came than ever before): the daemon holds it until the terms or the next one
  kUncertainMicro = 4,
  kTermsNorm = 8,     // kStepTerms: send the norm (kStepNorm) once every bucket's gradients are in
  kTermsClip = 16,    // kStepTerms: clip to max norm `value` (torch.nn.utils.clip_grad_norm_)
  kTermsCommit = 32,  // kStepTerms: optimizer.step() was called; update with `factor`
  kNonFinite = 64,    // kStepNorm
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
  // kStepTerms with kTermsNorm or kTermsClip: what the averaged gradients were multiplied by when their
  // norm was taken (a GradScaler's unscale_ before clip_grad_norm_); 1 otherwise
  float norm_factor = 1.0f;
  double value = 0.0;   // kStepTerms: the max norm (kTermsClip); kStepNorm: the norm
  float factor = 1.0f;  // kStepTerms with kTermsCommit: the multiplier the update applies (1 / the loss scale left)
  uint8_t reserved[20] = {};
};

static_assert(sizeof(Message) == 64);
static_assert(offsetof(Message, value) == 32);
static_assert(std::is_trivially_copyable_v<Message>);

}  // namespace trainstream::shm
