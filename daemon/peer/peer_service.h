// The Peer gRPC service (proto/trainstream/v1/peer.proto), served on TCP only when the daemon was
// started with --peer-listen (daemon/peer/peer_server.h). Every call must carry the shared secret;
// fragments go to the mailbox, and what the mailbox or the bucket refuses goes back to the sender as
// its call's status. Deliver is a raw callback method: the message is split by
// daemon/peer/peer_wire.h, never parsed into a PeerChunk, so its floats reach the mailbox as the
// slices gRPC received. Messages over kMaxFragmentMessageBytes are refused (RESOURCE_EXHAUSTED) from
// their length prefix (the server's limit): gRPC reads a whole message before the handler can check
// the secret, so without a bound a client without the secret made the daemon buffer gigabytes.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "daemon/peer/peer_connections.h"
#include "daemon/peer/peer_mailbox.h"
#include "trainstream/v1/peer.grpc.pb.h"

namespace trainstream::daemon {

inline constexpr char kSecretHeader[] = "x-trainstream-secret";

class PeerService final : public v1::Peer::WithRawCallbackMethod_Deliver<v1::Peer::Service> {
 public:
  // `connections` names each call's sender and learns which connections carried the secret.
  PeerService(PeerMailbox& mailbox, std::string secret, PeerConnections& connections)
      : mailbox_(mailbox), secret_(std::move(secret)), connections_(connections) {}
  grpc::ServerUnaryReactor* Deliver(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                    grpc::ByteBuffer* response) override;

 private:
  grpc::Status Store(grpc::CallbackServerContext& context, const grpc::ByteBuffer& request);

  PeerMailbox& mailbox_;
  const std::string secret_;
  PeerConnections& connections_;
};

// gRPC reads a peer's fragments into freshly allocated buffers, one after the other; glibc's default
// trimming hands the freed memory back to the kernel each time, so every fragment would be mapped and
// zeroed again (measured: a third of the all-reduce's CPU time on a 2-core machine). Keeps up to
// 64 MiB of freed heap and serves allocations up to 4 MiB from the heap. Process-wide: called by
// a daemon that serves the peer plane (and by benchmarks/allreduce).
void KeepPeerBuffersMapped();

// Compares in time independent of where equally long strings differ.
bool SecretsEqual(const std::string& a, const std::string& b);

}  // namespace trainstream::daemon
