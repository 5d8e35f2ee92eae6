#include "daemon/gpu/pin_ahead.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>

#include "daemon/gpu/pinned_host.h"

namespace trainstream::daemon {

namespace {
// PinnedHost holds its lock while it registers: a copy that needs it waits for one piece at most
// (3 ms at 20 GiB/s).
constexpr size_t kPieceBytes = size_t{64} << 20;
}  // namespace

PinAhead::PinAhead(std::shared_ptr<GpuDevice> gpu, std::vector<HostRange> ranges)
    : gpu_(std::move(gpu)), thread_([this, ranges = std::move(ranges)] { Run(ranges); }) {}

void PinAhead::Stop() {
  stopping_ = true;
  if (thread_.joinable()) thread_.join();
}

void PinAhead::Run(const std::vector<HostRange>& ranges) {
  const auto started = std::chrono::steady_clock::now();
  size_t bytes = 0;
  try {
    cuda::ScopedContext scope(gpu_->driver, gpu_->context.get());
    for (const HostRange& range : ranges) {
      for (size_t at = 0; at < range.bytes && !stopping_; at += kPieceBytes) {
        const size_t piece = std::min(kPieceBytes, range.bytes - at);
        PinnedHost::Instance().Ensure(range.data + at, piece);
        bytes += piece;
      }
    }
  } catch (const Error& e) {  // the copies register what is left themselves
    spdlog::warn("page-locking a rank's host memory ahead of its copies stopped: {}", e.what());
  }
  spdlog::info("{:.2f} GiB a rank's copies touch page-locked ahead of them in {:.2f} s{}",
               static_cast<double>(bytes) / (1 << 30),
               std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count(),
               stopping_ ? " (stopped: the rank left)" : "");
}

}  // namespace trainstream::daemon
