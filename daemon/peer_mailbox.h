// Chunks that peer daemons delivered for this daemon's jobs, until the job's all-reduce takes them.
// Keyed by (job, step, bucket, phase, round): each key is delivered and taken exactly once, so the
// order in which peers send does not matter.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>

namespace trainstream::daemon {

struct ChunkKey {
  std::string job;
  uint64_t step = 0;
  uint32_t bucket = 0, phase = 0, round = 0;
  auto operator<=>(const ChunkKey&) const = default;
};

class PeerMailbox {
 public:
  void Put(ChunkKey key, std::string data);
  // The chunk for `key`, waiting at most `timeout`; nullopt on timeout.
  std::optional<std::string> Take(const ChunkKey& key, std::chrono::milliseconds timeout);
  // Forgets what is waiting for `job` (dropped jobs).
  void Drop(const std::string& job);

 private:
  std::mutex mutex_;
  std::condition_variable arrived_;
  std::map<ChunkKey, std::string> chunks_;
};

}  // namespace trainstream::daemon
