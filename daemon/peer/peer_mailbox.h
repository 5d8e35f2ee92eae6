// Fragments that peer daemons delivered for this daemon's jobs, until the job's all-reduce takes them.
// Keyed by (job, step, bucket, phase, round, fragment): each key is delivered and taken exactly once,
// so the order in which peers send does not matter. The fragments' floats stay in the slices gRPC
// received them in (daemon/peer/peer_wire.h).
//
// While a bucket is being reduced, its all-reduce registers a sink for (job, step, bucket): fragments
// that arrive for it then go straight to the sink, on the gRPC thread that received it (no
// hand-over to the reducing thread); fragments that came earlier wait here until the sink registers.
// A fragment that waited longer than a reduction can wait for its peer (the peer timeout) belongs to
// no reduction any more: a job that never came, a step that failed. The daemon expires those.
//
// What a peer may leave here is bounded. A key delivered twice is refused (the first one stays), and
// so is a fragment of a bucket that its open job has already reduced here. Fragments of jobs that are
// not open here (a job whose ranks have not attached yet, or one that never comes: a peer's mistake)
// hold at most `max_unknown_bytes`, each counted with its header's bound; past it they are refused.
// A refusal is an Error, which the Peer service returns to the sender.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
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

// "fragment 2 of round 0 of phase 1 of bucket 3 of step 7 of job 'j'", for messages.
std::string Describe(const FragmentKey& key);

// A fragment as it arrived: its key, its floats, and who sent it (the connection's address and the
// node rank the sender claims), for messages that must name a peer that sent something wrong.
struct Delivered {
  FragmentKey key;
  PeerPayload data;
  std::string sender;      // "ipv4:10.0.0.2:41234"
  uint32_t from_node = 0;  // as the sender says (PeerChunk::from_node)
};

// Takes the fragments of one (job, step, bucket); called from any thread, also concurrently.
class PeerSink {
 public:
  virtual ~PeerSink() = default;
  // Takes the fragment, or throws Error saying what is wrong with it; the bucket goes on either way.
  virtual void Arrived(Delivered fragment) = 0;
};

class PeerMailbox {
 public:
  // The default bound of fragments of jobs not open here (Config::peer_max_unknown_job_bytes).
  static constexpr size_t kDefaultMaxUnknownBytes = size_t{256} << 20;
  explicit PeerMailbox(size_t max_unknown_bytes = kDefaultMaxUnknownBytes) : max_unknown_bytes_(max_unknown_bytes) {}

  // `job` spans nodes and has its all-reduce here (counted: every Open has its Close).
  void Open(const std::string& job);
  void Close(const std::string& job);
  // Hands the fragment to the sink registered for its (job, step, bucket), or keeps it. Throws Error:
  // kAlreadyExists for a key already waiting, kFailedPrecondition for a bucket already reduced,
  // kResourceExhausted past the bound of unknown jobs' fragments, and whatever the sink throws.
  void Put(Delivered fragment);
  // Sends later fragments of (job, step, bucket) to `sink` until Unregister; returns those already
  // here, which the caller hands to the sink itself.
  std::vector<Delivered> Register(const std::string& job, uint64_t step, uint32_t bucket, PeerSink* sink);
  // Stops handing fragments to the sink of (job, step, bucket) and waits until no thread is inside it.
  void Unregister(const std::string& job, uint64_t step, uint32_t bucket);
  [[nodiscard]] bool Registered(const std::string& job, uint64_t step, uint32_t bucket);
  // Forgets what is waiting for `job` (dropped jobs).
  void Drop(const std::string& job);
  // Forgets the fragments that have waited longer than `age`; returns how many.
  size_t Expire(std::chrono::steady_clock::duration age);
  // Bytes held for jobs that are not open here, as the bound counts them.
  [[nodiscard]] size_t unknown_bytes();

 private:
  using BucketKey = std::tuple<std::string, uint64_t, uint32_t>;
  struct Registration {
    PeerSink* sink;
    int delivering = 0;  // threads inside sink->Arrived
  };
  struct Waiting {
    PeerPayload data;
    std::string sender;
    uint32_t from_node;
    std::chrono::steady_clock::time_point arrived;
  };
  struct OpenJob {
    int opened = 0;
    std::optional<std::pair<uint64_t, uint32_t>> reduced;  // the last (step, bucket) unregistered
  };
  void Deliver(std::unique_lock<std::mutex>& lock, Registration& registration, Delivered fragment);
  void Keep(Delivered fragment);
  bool IsOpen(const std::string& job) const { return open_.contains(job); }
  void Forget(std::map<FragmentKey, Waiting>::iterator it);  // erases and uncounts

  const size_t max_unknown_bytes_;
  std::mutex mutex_;
  std::condition_variable delivered_;
  std::map<FragmentKey, Waiting> fragments_;
  std::map<BucketKey, Registration> sinks_;
  std::map<std::string, OpenJob> open_;
  size_t unknown_bytes_ = 0;
};

}  // namespace trainstream::daemon
