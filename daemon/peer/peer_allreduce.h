// The ring all-reduce of one multi-node job's gradients between its daemons (docs/multi-node.md).
//
// Each bucket's node-summed gradients (fp32, in the job's accumulator) go through a reduce-scatter
// and an all-gather around the ring of the job's daemons, in chunks of 1/M of the bucket. The sum of
// every chunk is formed once, in ring order, by one node and then copied to the others, so every
// node ends with bit-identical values. Buckets are reduced one at a time in (step, bucket) order on
// every node, which keeps the nodes' rings from waiting on each other in a cycle. A peer that does
// not deliver within the timeout, or refuses a fragment, fails the bucket with a message naming it. A
// fragment that does not fit this node's bucket is refused to whoever sent it (named in the log, and
// in the bucket's timeout message if its peer then never sends the right one); it fails nothing here.
//
// Chunks travel in fragments of a quarter of a chunk, 128 KiB to 4 MiB (daemon/peer/peer_allreduce.cpp),
// over 4 connections (--peer-connections) with 2 in flight on each (daemon/peer/peer_sender.h), sent straight from the
// bucket's memory: a fragment received in one ring step is summed into the bucket and sent on in the
// next step at once, on the gRPC thread that received it (the mailbox hands it over while the
// bucket is registered), so sending, receiving and adding overlap within a bucket. Fragments cover
// disjoint elements, so the order in which they arrive changes no sum.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "daemon/engine/all_reduce.h"
#include "daemon/peer/peer_mailbox.h"
#include "daemon/peer/peer_sender.h"
#include "shm/error.h"

namespace trainstream::daemon {

struct PeerConfig {
  PeerMailbox* mailbox = nullptr;  // nullptr: this daemon serves no peer plane
  std::string secret;
  std::chrono::milliseconds timeout{30000};
  uint32_t connections = 4;  // to the right-hand peer (daemon/peer/peer_allreduce.cpp)
};

class PeerAllReduce final : public AllReduce {
 public:
  PeerAllReduce(std::string job, std::vector<std::string> peers, uint32_t node_rank, uint32_t buckets,
                const PeerConfig& config);
  ~PeerAllReduce() override;
  PeerAllReduce(const PeerAllReduce&) = delete;
  PeerAllReduce& operator=(const PeerAllReduce&) = delete;

  // Bucket b of step s runs after every bucket < b of s. `done` gets the error that stopped it, if
  // any: kUnavailable when a peer failed it, kInvalidArgument when a peer's layout differs, kAborted
  // when it was given up (Reset, Stop).
  void Submit(uint64_t step, uint32_t bucket, float* data, size_t n, Done done) override;
  void Reset(const std::string& reason) override;
  // Reset, then refuse every later submission (the job is going away). A reduction in progress,
  // also one waiting for its last sends, gives up within kPoll (daemon/peer/peer_allreduce.cpp) and
  // cancels its calls; Stop waits for that.
  void Stop(const std::string& reason);
  // The job was dropped, and may wind down after a new job of its name started: peers' fragments waiting
  // for it are forgotten, and this all-reduce takes no more (PeerMailbox::Drop).
  void Dropped();

 private:
  struct Bucket;
  struct Request {
    float* data;
    size_t n;
    Done done;
  };
  void Run();
  void FailQueued(const std::string& reason);
  std::optional<Error> Reduce(uint64_t step, uint32_t bucket, float* data, size_t n);
  void Count(size_t n, std::chrono::steady_clock::duration took, bool failed) const;  // ProcessCounters
  std::optional<Error> Fail(Error error);
  void Post(uint64_t step, uint32_t bucket, uint32_t ring_step, uint32_t fragment, const float* data, size_t n);
  bool Stopping();
  uint32_t Left() const { return static_cast<uint32_t>((node_rank_ + peers_.size() - 1) % peers_.size()); }

  MailboxJob job_;  // its instance in the mailbox, opened once the constructor can no longer fail
  const std::vector<std::string> peers_;
  const uint32_t node_rank_, buckets_;
  const PeerConfig config_;
  std::unique_ptr<PeerSender> right_;  // posted to by the reducing thread only

  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::pair<uint64_t, uint32_t>, Request> pending_;
  std::optional<std::pair<uint64_t, uint32_t>> next_;  // the (step, bucket) to reduce next
  bool stopping_ = false;
  std::optional<std::string> stopped_;  // why submissions are refused
  std::thread thread_;
};

}  // namespace trainstream::daemon
