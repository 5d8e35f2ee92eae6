// A range of the job's host memory that the GPUs' copies read or write: what the engine tells a rank's
// transfer it will copy (RankTransfer::WillCopy) and what the CUDA transfer page-locks (PinnedHost).
#pragma once

#include <cstddef>

namespace trainstream::daemon {

struct HostRange {
  std::byte* data;
  size_t bytes;
  bool operator==(const HostRange&) const = default;
  // Of any region of the job's segments (master weights are float, gradients and uploads bytes).
  static HostRange Of(void* data, size_t bytes) { return {static_cast<std::byte*>(data), bytes}; }
};

}  // namespace trainstream::daemon
