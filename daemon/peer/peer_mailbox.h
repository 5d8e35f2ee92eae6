// Fragments that peer daemons delivered for this daemon's jobs, until the job's all-reduce takes them.
// Keyed by (job, step, bucket, phase, round, fragment): each key is delivered and taken exactly once,
// so the order in which peers send does not matter. The fragments' floats stay in the slices gRPC
// received them in (daemon/peer/peer_wire.h).
//
// While a bucket is being reduced, its all-reduce registers a sink for (job, step, bucket): fragments
// that arrive for it then go straight to the sink, on the gRPC thread that received them (no
// hand-over to the reducing thread); fragments that came earlier wait here until the sink registers.
// A fragment that waited longer than a reduction can wait for its peer (the peer timeout) belongs to
// no reduction any more: a job that never came, a step that failed. The daemon expires those.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "daemon/peer/peer_wire.h"

namespace trainstream::daemon {

struct FragmentKey {
  std::string job;
  uint64_t step = 0;
  uint32_t bucket = 0, phase = 0, round = 0, fragment = 0;
  // NOLINTNEXTLINE(modernize-use-nullptr): clang-tidy 14 misreads a defaulted <=>'s comparison with 0
  auto operator<=>(const FragmentKey&) const = default;
};

// Takes the fragments of one (job, step, bucket); called from any thread, also concurrently.
class PeerSink {
 public:
  virtual ~PeerSink() = default;
  virtual void Arrived(const FragmentKey& key, PeerPayload data) = 0;
};

class PeerMailbox {
 public:
  // Hands the fragment to the sink registered for its (job, step, bucket), or keeps it.
  void Put(FragmentKey key, PeerPayload data);
  // Sends later fragments of (job, step, bucket) to `sink` until Unregister; returns those already
  // here, which the caller hands to the sink itself.
  std::vector<std::pair<FragmentKey, PeerPayload>> Register(const std::string& job, uint64_t step, uint32_t bucket,
                                                            PeerSink* sink);
  // Stops handing fragments to the sink of (job, step, bucket) and waits until no thread is inside it.
  void Unregister(const std::string& job, uint64_t step, uint32_t bucket);
  // Forgets what is waiting for `job` (dropped jobs).
  void Drop(const std::string& job);
  // Forgets the fragments that have waited longer than `age`; returns how many.
  size_t Expire(std::chrono::steady_clock::duration age);

 private:
  using BucketKey = std::tuple<std::string, uint64_t, uint32_t>;
  struct Registration {
    PeerSink* sink;
    int delivering = 0;  // threads inside sink->Arrived
  };

  std::mutex mutex_;
  std::condition_variable delivered_;
  struct Waiting {
    PeerPayload data;
    std::chrono::steady_clock::time_point arrived;
  };
  std::map<FragmentKey, Waiting> fragments_;
  std::map<BucketKey, Registration> sinks_;
};

}  // namespace trainstream::daemon
