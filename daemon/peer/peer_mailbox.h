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
// Every opening of a job here is an instance of it, and a job dropped and created again under its name
// opens a new one while the dropped one's all-reduce may still be winding down (its Job outlives the
// registry's drop until its last user lets go; the registry drops it before a new job of the name can
// open). A dropped instance is no longer open: it is handed no fragments, neither arriving nor waiting
// ones, and what it registers or reduces later refuses nothing, so a new job of the name starts clean.
// Fragments name their job only (the registry lets one multi-node job hold a name), so they are for
// every open instance of it; normally that is one, but a job being built may open one beside it for a
// moment before the registry refuses it (a restore racing a create). Registrations and the bound of
// reduced buckets below are kept per instance. (A fragment that a peer's dropped instance sent late
// cannot be told from its new one's: the wire names no instance.)
//
// What a peer may leave here is bounded. A key delivered twice is refused (the first one stays), and
// so is a fragment of a bucket that an open instance of its job has already reduced here. Fragments of
// jobs that are not open here (a job whose ranks have not attached yet, one that was dropped, or one
// that never comes: a peer's mistake) hold at most `max_unknown_bytes`, each counted with its header's
// bound; past it they are refused. A refusal is an Error, which the Peer service returns to the sender.
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

// One Open of a job here, which its all-reduce registers with (see the header comment).
struct MailboxJob {
  std::string name;
  uint64_t instance = 0;
};

class PeerMailbox {
 public:
  // The default bound of fragments of jobs not open here (Config::peer_max_unknown_job_bytes).
  static constexpr size_t kDefaultMaxUnknownBytes = size_t{256} << 20;
  explicit PeerMailbox(size_t max_unknown_bytes = kDefaultMaxUnknownBytes) : max_unknown_bytes_(max_unknown_bytes) {}

  // Job `name` spans nodes and has its all-reduce here: a new instance of it, open until it is dropped
  // or closed. Every Open has its Close.
  [[nodiscard]] MailboxJob Open(const std::string& name);
  void Close(const MailboxJob& job);
  // The job was dropped (its all-reduce may still wind down): the instance is no longer open, its bound
  // of reduced buckets goes, and what waits for its name is forgotten unless another instance of the
  // name is open (then it is that one's).
  void Drop(const MailboxJob& job);
  // Hands the fragment to the sink that an open instance of its job registered for its (step, bucket),
  // or keeps it. Throws Error: kAlreadyExists for a key already waiting, kFailedPrecondition for a
  // bucket that an open instance already reduced, kResourceExhausted past the bound of unknown jobs'
  // fragments, and whatever the sink throws.
  void Put(Delivered fragment);
  // Sends later fragments of (job, step, bucket) to `sink` until Unregister; returns those already
  // here, which the caller hands to the sink itself. An instance no longer open gets none.
  std::vector<Delivered> Register(const MailboxJob& job, uint64_t step, uint32_t bucket, PeerSink* sink);
  // Stops handing fragments to the sink of (job, step, bucket) and waits until no thread is inside it;
  // the instance, if still open, has then reduced that bucket.
  void Unregister(const MailboxJob& job, uint64_t step, uint32_t bucket);
  // Whether an open instance of job `name` registered a sink for (step, bucket).
  [[nodiscard]] bool Registered(const std::string& name, uint64_t step, uint32_t bucket);
  // Forgets the fragments that have waited longer than `age`; returns how many.
  size_t Expire(std::chrono::steady_clock::duration age);
  // Bytes held for jobs that are not open here, as the bound counts them.
  [[nodiscard]] size_t unknown_bytes();

 private:
  using SinkKey = std::tuple<std::string, uint64_t, uint64_t, uint32_t>;  // name, instance, step, bucket
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
  using Reduced = std::optional<std::pair<uint64_t, uint32_t>>;  // the last (step, bucket) unregistered
  using Instances = std::map<uint64_t, Reduced>;                 // the open ones of a name
  bool IsOpen(const std::string& name) const { return open_.contains(name); }
  // Closes the instance if open; the name's waiting fragments count against the bound once none is.
  void Retire(const MailboxJob& job);
  Reduced* ReducedOf(const MailboxJob& job);  // nullptr if the instance is not open
  // The registration of an open instance of `name` for (step, bucket); nullptr if none.
  Registration* SinkOf(const std::string& name, uint64_t step, uint32_t bucket);
  void Deliver(std::unique_lock<std::mutex>& lock, Registration& registration, Delivered fragment);
  void Keep(Delivered fragment);
  void Forget(std::map<FragmentKey, Waiting>::iterator it);  // erases and uncounts

  const size_t max_unknown_bytes_;
  std::mutex mutex_;
  std::condition_variable delivered_;
  std::map<FragmentKey, Waiting> fragments_;
  std::map<SinkKey, Registration> sinks_;
  std::map<std::string, Instances> open_;  // by name; a name with none open has no entry
  uint64_t instances_ = 0;                 // the number of the last instance opened
  size_t unknown_bytes_ = 0;
};

}  // namespace trainstream::daemon
