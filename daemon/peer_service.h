// The Peer gRPC service (proto/trainstream/v1/peer.proto), served on TCP only when the daemon was
// started with --peer-listen. Every call must carry the shared secret; chunks go to the mailbox.
#pragma once

#include <string>

#include "daemon/peer_mailbox.h"
#include "trainstream/v1/peer.grpc.pb.h"

namespace trainstream::daemon {

inline constexpr char kSecretHeader[] = "x-trainstream-secret";

class PeerService final : public v1::Peer::Service {
 public:
  PeerService(PeerMailbox& mailbox, std::string secret) : mailbox_(mailbox), secret_(std::move(secret)) {}
  grpc::Status Deliver(grpc::ServerContext* context, const v1::PeerChunk* chunk, v1::PeerAck* ack) override;

 private:
  PeerMailbox& mailbox_;
  const std::string secret_;
};

// Compares in time independent of where equally long strings differ.
bool SecretsEqual(const std::string& a, const std::string& b);

}  // namespace trainstream::daemon
