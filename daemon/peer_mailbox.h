// Pieces that peer daemons delivered for this daemon's jobs, until the job's all-reduce takes them.
// Keyed by (job, step, bucket, phase, round, piece): each key is delivered and taken exactly once,
// so the order in which peers send does not matter. The pieces' floats stay in the slices gRPC
// received them in (daemon/peer_wire.h).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>

#include "daemon/peer_wire.h"

namespace trainstream::daemon {

struct ChunkKey {
  std::string job;
  uint64_t step = 0;
  uint32_t bucket = 0, phase = 0, round = 0, piece = 0;
  auto operator<=>(const ChunkKey&) const = default;
};

class PeerMailbox {
 public:
  void Put(ChunkKey key, PeerPayload data);
  // The piece for `key`, waiting at most `timeout`; nullopt on timeout.
  std::optional<PeerPayload> Take(const ChunkKey& key, std::chrono::milliseconds timeout);
  // Forgets what is waiting for `job` (dropped jobs).
  void Drop(const std::string& job);

 private:
  std::mutex mutex_;
  std::condition_variable arrived_;
  std::map<ChunkKey, PeerPayload> chunks_;
};

}  // namespace trainstream::daemon
