// Sends the fragments of one all-reduce to the next daemon of the ring: asynchronous Deliver calls,
// spread in turn over several connections (each one's bytes are framed, written, read and parsed
// by one gRPC thread at a time: on a machine with cores to spare, one connection was the limit;
// daemon/peer/peer_allreduce.cpp has the numbers), at most `window` in flight, the rest queued in the
// order they were posted. Fragments are not copied: each call's message holds a slice of the bucket's
// own memory, which gRPC reads when it writes the message to the socket (measured: the copy was
// 12% of a node's CPU time). A call waits for its connection to come up, until its deadline.
//
// Invariants: a posted region must not change until the right-hand peer received it (the
// all-reduce writes a region only after that, see daemon/peer/peer_allreduce.cpp); after Finish or
// Cancel + Finish no call is in flight and gRPC holds no slice of the bucket, so nothing reads it
// any more. Every call has the peer timeout as its deadline, so the calls end at most that long
// after the last one started. A cancelled call's bytes may still wait in the connection's output
// (a peer that stopped reading): Finish then closes the connection, which releases them, and
// opens a new one for the next reduction.
#pragma once

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "trainstream/v1/peer.pb.h"

namespace trainstream::daemon {

class PeerSender {
 public:
  // `peer` names the receiver in errors ("peer host:port (node 1)").
  // Sends to `address` ("host:port") over `connections` connections of its own.
  PeerSender(std::string address, size_t connections, std::string peer, std::string secret,
             std::chrono::milliseconds timeout, size_t window);
  ~PeerSender();
  PeerSender(const PeerSender&) = delete;
  PeerSender& operator=(const PeerSender&) = delete;

  // Queues data[0, n) with `header` (its `data` empty). Thread-safe.
  void Post(v1::PeerChunk header, const float* data, size_t n);
  // The first failure since the last Finish, without waiting.
  std::optional<std::string> Error();
  // Drops what is queued and cancels the calls in flight; later posts are dropped until Finish.
  void Cancel();
  // Waits until no call is queued or in flight and gRPC released every slice of the posted data;
  // returns the first failure and forgets it.
  std::optional<std::string> Finish();
  // Whether every posted call has completed and its slices are released, waiting at most `timeout`.
  bool WaitIdle(std::chrono::milliseconds timeout);

 private:
  struct Fragment {
    v1::PeerChunk header;
    const float* data;
    size_t n;
  };
  struct Call;
  bool Idle() const { return queued_.empty() && in_flight_.empty() && starting_ == 0 && slices_ == 0; }
  void Connect();  // new connections, one per stub (each a channel sharing none: see Finish)
  static void Released(void* sender);
  void StartQueued(std::unique_lock<std::mutex>& lock);
  void Start(const Fragment& fragment);
  void Done(const std::shared_ptr<Call>& call, const grpc::Status& status);

  const std::string address_;
  std::vector<std::unique_ptr<grpc::GenericStub>> stubs_;  // replaced by Finish only, when nothing is in flight
  size_t next_stub_ = 0;                                   // the connection of the next call
  const std::string peer_, secret_;
  const std::chrono::milliseconds timeout_;
  const size_t window_;

  std::mutex mutex_;
  std::condition_variable idle_;
  std::deque<Fragment> queued_;
  std::set<std::shared_ptr<Call>> in_flight_;
  size_t starting_ = 0;     // calls counted in the window but not yet in in_flight_
  size_t slices_ = 0;       // slices of posted data that gRPC has not released
  bool cancelled_ = false;  // since Cancel, until Finish
  std::optional<std::string> error_;
};

}  // namespace trainstream::daemon
