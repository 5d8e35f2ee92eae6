// How the step engine moves one rank's bytes between its GPU and the job's host memory when the daemon
// does the copies (the cuda-ipc transport: docs/architecture.md, "The cuda-ipc transport", steps 2
// and 4). Ranks whose client copies its data itself have none.
//
// Every call returns at once; `done` runs later, on another thread, exactly once, with the error that
// stopped the work if any. Work of one kind runs in submission order: a push submitted after
// AwaitWeightsWanted starts after that event has completed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "daemon/engine/host_range.h"
#include "shm/error.h"

namespace trainstream::daemon {

class RankTransfer {
 public:
  virtual ~RankTransfer() = default;

  [[nodiscard]] virtual uint32_t staging_slots() const = 0;
  [[nodiscard]] virtual uint64_t slot_bytes() const = 0;  // a bucket larger than this comes in pieces
  [[nodiscard]] virtual uint32_t weights_wanted_events() const = 0;
  // Once the rank's grad-ready event of `slot` has completed: the slot's first `bytes` -> `host`.
  virtual void PullGradients(uint32_t slot, void* host, size_t bytes, Done done) = 0;
  // Later pushes wait for the rank's weights-wanted event `event` (its kernels that read the weights).
  virtual void AwaitWeightsWanted(uint32_t event, Done done) = 0;
  // Where bucket b's weights lie in the rank's flat parameter buffer; nullopt for a bucket the rank
  // keeps off the GPU (weight paging loads it itself), whose push is only its PARAMS_READY.
  [[nodiscard]] virtual std::optional<uint64_t> ParamsOffset(uint32_t bucket) const = 0;
  // `host` -> the rank's flat parameter buffer at `offset`.
  virtual void PushWeights(uint64_t offset, const void* host, size_t bytes, Done done) = 0;
  // The host memory the rank's copies will touch, in the order its first steps touch it (the CUDA
  // transfer page-locks it in the background, ahead of them).
  virtual void WillCopy(std::vector<HostRange> ranges) = 0;
  // The rank is gone: work not yet started fails instead of waiting for events that may never come.
  virtual void Abandon() = 0;
  // The rank's host memory [base, base + bytes) is about to be unmapped, and no copy uses it any more:
  // undo what the copies did to it (the CUDA transfer page-locks the host memory it copies on first use).
  virtual void ReleaseHost(const void* base, size_t bytes) = 0;
};

}  // namespace trainstream::daemon
