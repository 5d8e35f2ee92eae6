// The daemon's counters: what the planes count on their hot paths (one relaxed atomic add each) and
// what Stats and the Prometheus endpoint read (daemon/metrics/metrics_server.h). Nothing here knows
// gRPC or Prometheus, so the engine, the GPU and the peer planes may all bump them.
//
// Invariants: counters only grow; a reading may be a few adds behind the latest, never torn.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace trainstream::daemon {

// Durations in fixed buckets (seconds), observed without a lock.
class DurationHistogram {
 public:
  static constexpr std::array<double, 14> kBounds = {0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05,
                                                     0.1,    0.2,   0.5,   1,     2,    5,    10};
  struct Reading {
    std::array<uint64_t, kBounds.size() + 1> counts{};  // per bucket, not cumulative; the last is +Inf
    double sum = 0;                                     // seconds
    uint64_t count = 0;
  };

  void Observe(double seconds);
  [[nodiscard]] Reading Read() const;

 private:
  std::array<std::atomic<uint64_t>, kBounds.size() + 1> counts_{};
  std::atomic<uint64_t> sum_ns_{0};
};

// Per job, bumped as its buckets commit updates.
struct JobCounters {
  std::atomic<uint64_t> steps{0};    // steps completed (every bucket updated)
  DurationHistogram update_seconds;  // one bucket's update pass
  std::atomic<int64_t> last_update_unix_ms{0};
  std::atomic<int64_t> last_step_unix_ms{0};
};

// Per GPU the daemon copies with (cuda-ipc).
struct GpuCounters {
  std::atomic<uint64_t> to_host_bytes{0};    // gradients
  std::atomic<uint64_t> to_device_bytes{0};  // weights
};

// The ring all-reduces of multi-node jobs.
struct PeerCounters {
  std::atomic<uint64_t> bytes_sent{0};
  DurationHistogram allreduce_seconds;  // one bucket's all-reduce
};

// What went wrong, counted by kind (the `kind` label of trainstream_errors_total).
enum class ErrorKind : uint8_t {
  kRefusedRequest,    // an RPC answered with an error status
  kSessionFailed,     // a rank's session failed (protocol error, a rank left mid-step, shutdown, ...)
  kGpuCopy,           // a cuda-ipc copy failed
  kPeerAllReduce,     // an all-reduce between daemons failed
  kSnapshot,          // a snapshot could not be written
  kPeerFragment,      // a fragment a peer delivered was refused (wrong secret, size, place, a duplicate, ...)
  kPeerConnection,    // a connection to the peer port was closed unauthenticated, or refused for want of room
  kTruncatedSegment,  // a job was dropped: its owner truncated one of its segments under the daemon
  kCount,
};
const char* NameOf(ErrorKind kind);

// The daemon's process-wide counters.
class ProcessCounters {
 public:
  static ProcessCounters& Instance();

  // The counters of the GPU called `label` ("GPU-<uuid>"), created on first use; they live as long
  // as the process, so callers may keep the reference.
  GpuCounters& Gpu(const std::string& label);
  [[nodiscard]] std::vector<std::pair<std::string, const GpuCounters*>> Gpus();
  PeerCounters& peer() { return peer_; }
  void CountError(ErrorKind kind) { errors_[static_cast<size_t>(kind)].fetch_add(1, std::memory_order_relaxed); }
  [[nodiscard]] uint64_t errors(ErrorKind kind) const {
    return errors_[static_cast<size_t>(kind)].load(std::memory_order_relaxed);
  }

 private:
  ProcessCounters() = default;
  std::mutex mutex_;  // guards gpus_ (the counters themselves are atomic)
  std::map<std::string, std::unique_ptr<GpuCounters>> gpus_;
  PeerCounters peer_;
  std::array<std::atomic<uint64_t>, static_cast<size_t>(ErrorKind::kCount)> errors_{};
};

// Milliseconds since the epoch, for the "last ..." counters.
int64_t UnixMillisNow();

}  // namespace trainstream::daemon
