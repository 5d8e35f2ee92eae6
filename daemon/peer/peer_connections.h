// The connections of the peer port that the daemon handed to the Peer gRPC server (PeerListener
// accepts them), by descriptor: where each one comes from, for messages that name a sender, and
// whether a call on it has carried the peer secret yet.
//
// A connection is untrusted until its first call with the secret. One still untrusted `handshake`
// after it was accepted is shut down (gRPC then sees it end and closes it), and so is the oldest
// untrusted one when a new connection needs its place: without the secret a connection holds a
// descriptor for a bounded time, and cannot keep a peer that has it out. Trusted connections stay
// for as long as gRPC keeps them.
//
// Invariants: the handed-over connections hold descriptors in [first, first + count) only, so they
// never take more than `count` descriptors, and never those reserved for the control socket above
// them (daemon/control/control_socket.h). Numbers are taken in increasing order and reused only
// after the range went round; a record is acted on only while its descriptor is still the socket it
// was recorded for (same inode), since gRPC closes descriptors without telling.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <map>
#include <mutex>
#include <optional>
#include <string>

namespace grpc {
class ServerContextBase;
}  // namespace grpc

namespace trainstream::daemon {

class PeerConnections {
 public:
  using Clock = std::chrono::steady_clock;
  struct Limits {
    int first = 0;  // the descriptors of handed-over connections: [first, first + count)
    int count = 0;
    std::chrono::milliseconds handshake;  // time from accept to the first call with the secret
  };
  explicit PeerConnections(Limits limits);

  // Moves the connection `fd` (accepted at `accepted`, from `address`) into the range and records it:
  // the new descriptor, `fd` closed. -1 when the range is full: `fd` is left as it was.
  int Adopt(int fd, std::string address, Clock::time_point accepted);
  // A call with the secret came on the connection of `context` (or descriptor `fd`).
  void Trust(const grpc::ServerContextBase& context);
  void Trust(int fd);
  // Where the connection of `context` comes from ("ipv4:10.0.0.2:41234"); gRPC's peer string for a
  // connection this does not know.
  [[nodiscard]] std::string NameOf(const grpc::ServerContextBase& context) const;
  [[nodiscard]] std::string NameOf(int fd) const;
  // Shuts down the untrusted connections accepted more than `handshake` before `now`, and with
  // `make_room` also the oldest other untrusted one; forgets those gRPC has closed. Returns how many
  // it shut down.
  size_t Sweep(Clock::time_point now, bool make_room);
  [[nodiscard]] size_t size() const;
  [[nodiscard]] const Limits& limits() const { return limits_; }

 private:
  struct Connection {
    std::string address;
    Clock::time_point accepted;
    dev_t device;
    ino_t inode;
    bool trusted = false;
    bool shut = false;  // shut down, gRPC has yet to close it
  };
  bool Alive(int fd, const Connection& connection) const;  // fd is still that socket
  void ShutDown(int fd, Connection& connection, const char* why);

  const Limits limits_;
  mutable std::mutex mutex_;
  std::map<int, Connection> connections_;
  int next_;  // where the next descriptor is looked for
};

// The descriptor of a connection that was handed to gRPC by descriptor, from ServerContext::peer()
// ("fd:<n>"); nullopt for any other peer string.
std::optional<int> HandedOverDescriptor(const std::string& peer);

}  // namespace trainstream::daemon
