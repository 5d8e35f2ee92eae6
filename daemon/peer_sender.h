// Sends the pieces of one all-reduce to the next daemon of the ring: asynchronous Deliver calls,
// at most `window` in flight, the rest queued in the order they were posted. Each piece's floats
// are copied into the outgoing message when its call starts, not when it is posted.
//
// Invariants: a posted region must not change until Finish returns (the all-reduce writes a region
// only after the right-hand peer received it, see daemon/peer_allreduce.cpp); after Finish or
// Cancel + Finish no call is in flight, so nothing reads the bucket any more. Every call has the
// peer timeout as its deadline, so Finish waits at most that long after the last call started.
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

#include "trainstream/v1/peer.pb.h"

namespace trainstream::daemon {

class PeerSender {
 public:
  // `peer` names the receiver in errors ("peer host:port (node 1)").
  PeerSender(const std::shared_ptr<grpc::Channel>& channel, std::string peer, std::string secret,
             std::chrono::milliseconds timeout, size_t window);
  ~PeerSender();
  PeerSender(const PeerSender&) = delete;
  PeerSender& operator=(const PeerSender&) = delete;

  // Queues data[0, n) with `header` (its `data` empty).
  void Post(v1::PeerChunk header, const float* data, size_t n);
  // The first failure since the last Finish, without waiting.
  std::optional<std::string> Error();
  // Drops what is queued and cancels the calls in flight; later posts are dropped until Finish.
  void Cancel();
  // Waits until no call is queued or in flight; returns the first failure and forgets it.
  std::optional<std::string> Finish();
  // Whether every posted call has completed, waiting at most `timeout` for it.
  bool WaitIdle(std::chrono::milliseconds timeout);

 private:
  struct Piece {
    v1::PeerChunk header;
    const float* data;
    size_t n;
  };
  struct Call;
  class BufferPool;
  void StartQueued(std::unique_lock<std::mutex>& lock);
  void Start(const Piece& piece);
  void Done(const std::shared_ptr<Call>& call, const grpc::Status& status);

  grpc::GenericStub stub_;
  const std::shared_ptr<BufferPool> pool_;
  const std::string peer_, secret_;
  const std::chrono::milliseconds timeout_;
  const size_t window_;

  std::mutex mutex_;
  std::condition_variable idle_;
  std::deque<Piece> queued_;
  std::set<std::shared_ptr<Call>> in_flight_;
  size_t starting_ = 0;     // calls counted in the window but not yet in in_flight_
  bool cancelled_ = false;  // since Cancel, until Finish
  std::optional<std::string> error_;
};

}  // namespace trainstream::daemon
