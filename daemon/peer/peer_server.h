// The peer plane's server (trainstreamd --peer-listen): the Peer service, on a TCP port whose
// connections the daemon accepts itself (daemon/peer/peer_listener.h) and keeps a record of
// (daemon/peer/peer_connections.h).
//
// How many descriptors the peer plane may take follows the open-file limit L (the daemon raises its
// soft limit to the hard one first): the control socket's connections take [L/2, L)
// (daemon/control/control_socket.h); handed-over peer connections [L/2 - P, L/2), P = L/8 (4 to
// 1024); connections not handed over yet at most L/32 (4 to 64) descriptors below that. The rest,
// below L/2 - P, stays for everything else (jobs' segments, gRPC's own). At L = 256 (the issue's
// flood): 32 peer connections, 8 waiting, 96 descriptors for the rest.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <memory>
#include <string>

#include "daemon/peer/peer_connections.h"
#include "daemon/peer/peer_listener.h"
#include "daemon/peer/peer_mailbox.h"
#include "daemon/peer/peer_service.h"

namespace trainstream::daemon {

class PeerServer {
 public:
  struct Limits {
    PeerConnections::Limits connections;
    PeerListener::Limits listener;
  };
  // The limits for an open-file limit of `open_files` (above), with `handshake` as the time a
  // connection has from accept to its first call with the secret.
  static Limits LimitsFor(int open_files, std::chrono::milliseconds handshake = kHandshake);
  // A connection's time to its first call with the secret: a peer's gRPC channel connects for a call
  // and sends it at once (within a round trip).
  static constexpr std::chrono::milliseconds kHandshake{10000};

  // Serves the Peer service on `address` ("host:port"; port 0 picks one) with LimitsFor the process's
  // open-file limit, or `limits`. kUnavailable if it cannot listen.
  PeerServer(const std::string& address, PeerMailbox& mailbox, std::string secret);
  PeerServer(const std::string& address, PeerMailbox& mailbox, std::string secret, Limits limits);
  ~PeerServer();
  PeerServer(const PeerServer&) = delete;
  PeerServer& operator=(const PeerServer&) = delete;

  [[nodiscard]] int port() const { return listener_->port(); }
  [[nodiscard]] PeerConnections& connections() { return connections_; }
  // Accepts nothing more and ends the calls in progress by `deadline`.
  void Shutdown(std::chrono::system_clock::time_point deadline);

 private:
  PeerConnections connections_;
  PeerService service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<PeerListener> listener_;
  bool shut_down_ = false;
};

// The process's open-file limit (RLIMIT_NOFILE's soft limit, at most 2^30).
int OpenFileLimit();

}  // namespace trainstream::daemon
