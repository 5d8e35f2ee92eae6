#include "daemon/counters/counters.h"

#include <algorithm>
#include <chrono>

namespace trainstream::daemon {

void DurationHistogram::Observe(double seconds) {
  const auto bucket = static_cast<size_t>(std::lower_bound(kBounds.begin(), kBounds.end(), seconds) - kBounds.begin());
  counts_[bucket].fetch_add(1, std::memory_order_relaxed);
  sum_ns_.fetch_add(static_cast<uint64_t>(std::max(0.0, seconds) * 1e9), std::memory_order_relaxed);
}

DurationHistogram::Reading DurationHistogram::Read() const {
  Reading reading;
  for (size_t i = 0; i < counts_.size(); ++i) {
    reading.counts[i] = counts_[i].load(std::memory_order_relaxed);
    reading.count += reading.counts[i];
  }
  reading.sum = static_cast<double>(sum_ns_.load(std::memory_order_relaxed)) / 1e9;
  return reading;
}

const char* NameOf(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kRefusedRequest: return "refused_request";
    case ErrorKind::kSessionFailed: return "session_failed";
    case ErrorKind::kGpuCopy: return "gpu_copy";
    case ErrorKind::kPeerAllReduce: return "peer_allreduce";
    case ErrorKind::kSnapshot: return "snapshot";
    case ErrorKind::kPeerFragment: return "peer_fragment_refused";
    case ErrorKind::kPeerConnection: return "peer_connection_refused";
    case ErrorKind::kTruncatedSegment: return "truncated_segment";
    case ErrorKind::kCount: break;
  }
  return "unknown";
}

ProcessCounters& ProcessCounters::Instance() {
  static ProcessCounters* counters = new ProcessCounters();  // never destroyed: threads may count at exit
  return *counters;
}

GpuCounters& ProcessCounters::Gpu(const std::string& label) {
  std::lock_guard lock(mutex_);
  auto& counters = gpus_[label];
  if (!counters) counters = std::make_unique<GpuCounters>();
  return *counters;
}

std::vector<std::pair<std::string, const GpuCounters*>> ProcessCounters::Gpus() {
  std::lock_guard lock(mutex_);
  std::vector<std::pair<std::string, const GpuCounters*>> gpus;
  for (const auto& [label, counters] : gpus_) gpus.emplace_back(label, counters.get());
  return gpus;
}

int64_t UnixMillisNow() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace trainstream::daemon
