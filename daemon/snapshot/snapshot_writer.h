// Writes one snapshot file from a SnapshotCapture: the copies as they come, at the places the file's
// header gives them, then the frozen weights and step counts, then the header itself (its length is
// fixed up front: the metadata that is known only at the end, the step and the hyperparameters, fits
// in room reserved for their longest form), then the crash-safe rename (daemon/snapshot/atomic_file.h).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "daemon/snapshot/committed_state.h"
#include "daemon/snapshot/snapshot_capture.h"
#include "daemon/snapshot/snapshot_format.h"

namespace trainstream::daemon {

struct SnapshotWritten {
  std::string path;
  uint64_t step = 0;
  uint64_t bytes = 0;
};

// Called whenever no copy arrived for a while: may throw to give up, or make the capture go on
// differently (SnapshotCapture::TakeAsIs).
using WaitPolicy = std::function<void()>;

// `meta`: the job's identity and layout (its step and hparams are filled in from the capture). The
// file is created with the calling thread's file identity, and given to `owner` if set.
SnapshotWritten WriteSnapshot(SnapshotMeta meta, const CommittedState& state, SnapshotCapture& capture,
                              const std::string& path, std::optional<uint32_t> owner, const WaitPolicy& waiting);

}  // namespace trainstream::daemon
