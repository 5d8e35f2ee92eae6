// The peer port: the daemon accepts its TCP connections itself, not gRPC, and hands each one to the
// Peer gRPC server (by descriptor, as the control socket does) once it has spoken HTTP/2.
//
// Why not gRPC's own listener: gRPC 1.51 has no cap on connections, keeps one that never speaks for
// its handshake timeout (120 s), and stops accepting on a listener for good once accept() fails for
// want of descriptors. A plain TCP flood of the peer port (issue 46: 256 descriptors) then took every
// descriptor, so the control socket refused local trainers, and the peer port never answered again.
//
// Here: a new connection waits, unhanded, until its first 24 bytes are HTTP/2's client preface
// (gRPC's client sends it at once); at most `pending` wait, the oldest closed for a newer one, each
// for at most `handshake`, and one that sends anything else is closed at once. A connection is
// accepted only onto a descriptor below `ceiling`, which keeps the ones above it (the handed-over
// peer connections' range, the control socket's) out of a flood's reach. Handed over, PeerConnections
// bounds how many there are and how long they stay without the secret. When accept() fails (no
// descriptor left in the process or the system), the listener waits 100 ms and accepts again.
#pragma once

#include <chrono>
#include <cstddef>
#include <deque>
#include <string>
#include <thread>
#include <vector>

#include "daemon/peer/peer_connections.h"
#include "daemon/tcp_listen.h"

namespace grpc {
class Server;
}  // namespace grpc

namespace trainstream::daemon {

class PeerListener {
 public:
  struct Limits {
    size_t pending = 0;  // connections accepted that have not spoken HTTP/2 yet
    int ceiling = 0;     // accepted connections must have a descriptor below this
  };
  // Listens on `address` ("host:port"; a wildcard host, 0.0.0.0 or [::] or empty, listens on every
  // address; port 0 picks one) and hands connections to `server` (started, outliving this) through
  // `connections`. kUnavailable if it cannot listen.
  PeerListener(const std::string& address, grpc::Server& server, PeerConnections& connections, Limits limits);
  ~PeerListener();  // Stop()
  PeerListener(const PeerListener&) = delete;
  PeerListener& operator=(const PeerListener&) = delete;

  [[nodiscard]] int port() const { return port_; }
  // Accepts nothing more; connections already handed over stay the server's.
  void Stop();

 private:
  struct Pending {
    int fd;
    std::string address;
    PeerConnections::Clock::time_point accepted;
    bool spoke = false;       // its preface arrived; it waits for room among the handed-over connections
    bool asked_room = false;  // an untrusted handed-over connection was shut down to make room for it
  };
  void Run();
  void AcceptFrom(int listener, PeerConnections::Clock::time_point now);
  void Check(Pending& pending, short events);  // NOLINT(google-runtime-int): poll's type
  void HandOver(Pending& pending);
  void Close(Pending& pending, const char* why);

  grpc::Server& server_;
  PeerConnections& connections_;
  const Limits limits_;
  std::vector<int> listeners_;
  int port_ = 0;
  WakeFd wake_;                                       // Stop wakes the loop
  std::deque<Pending> pending_;                       // oldest first; fd -1 once closed
  PeerConnections::Clock::time_point accept_again_;   // after accept() failed, not before this
  PeerConnections::Clock::time_point accept_failed_;  // the last warning that accept() failed
  PeerConnections::Clock::time_point warned_;         // the last warning about refused connections
  size_t refused_ = 0;                                // connections closed unhanded or untrusted since then
  std::thread thread_;
};

// The address of a connected socket as gRPC writes peers: "ipv4:10.0.0.2:41234", "ipv6:[::1]:41234".
std::string PeerAddressOf(int fd);

}  // namespace trainstream::daemon
