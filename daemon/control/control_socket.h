// The Unix socket of the Control service. The daemon accepts its connections itself, not gRPC: it
// asks the kernel who connected (SO_PEERCRED, recorded at connect()) and only then hands the
// connection to the gRPC server, so every handler knows its caller's uid without trusting anything
// the caller sent. A handler names its connection by ServerContext::peer(), which for a connection
// added this way is "fd:<descriptor>".
//
// Invariant: a descriptor number is never recorded for two connections that may be alive at once.
// gRPC closes a connection's descriptor whenever it likes (a call may outlive it), so numbers are
// taken in increasing order from the upper half of the open-file limit and reused only after the
// whole range went round: a handler can never be told a later connection's uid.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>

namespace grpc {
class Server;
class ServerContext;
}  // namespace grpc

namespace trainstream::daemon {

struct PeerCredentials {
  uint32_t uid = 0;
  uint32_t gid = 0;
  pid_t pid = 0;
};

class ControlSocket {
 public:
  // Creates the socket at `path` with permissions `mode` (before it accepts anything) and hands every
  // connection to `server`, which must be started and outlive this. kUnavailable if it cannot listen.
  ControlSocket(const std::string& path, uint32_t mode, grpc::Server& server);
  ~ControlSocket();  // StopAccepting()
  // Accepts no more connections and removes the socket file; connections handed over stay the server's.
  void StopAccepting();
  ControlSocket(const ControlSocket&) = delete;
  ControlSocket& operator=(const ControlSocket&) = delete;

  // The credentials of the connection a call arrived on; nullopt for a call that did not come through
  // this socket.
  [[nodiscard]] std::optional<PeerCredentials> CallerOf(const grpc::ServerContext& context) const;

 private:
  void Accept();
  int Renumber(int fd);  // the connection's descriptor, moved to the next unused number of the range

  const std::string path_;
  grpc::Server& server_;
  int listener_ = -1;                        // -1 once stopped
  int lowest_ = 0, highest_ = 0, next_ = 0;  // the range of connection descriptors
  mutable std::mutex mutex_;                 // guards connections_
  std::unordered_map<int, PeerCredentials> connections_;
  std::thread acceptor_;
};

}  // namespace trainstream::daemon
