// Listening TCP sockets for a "host:port" setting, as the daemon's TCP endpoints take it (the peer
// port, the metrics endpoint): a wildcard host (empty, "0.0.0.0", "::" or "[::]") listens on every
// address, "0.0.0.0" on IPv4 only, the others on one dual-stack socket (IPv4 alone where the machine
// has no IPv6); any other host on every address it resolves to ("localhost": 127.0.0.1 and ::1).
// Port 0 lets the system pick one port, the same for all of them. The sockets are non-blocking,
// close-on-exec, SO_REUSEADDR (a restarted daemon binds again at once) but not SO_REUSEPORT (a
// second daemon on the same port fails), with TCP_NODELAY, which accepted sockets inherit.
#pragma once

#include <string>
#include <vector>

namespace trainstream::daemon {

struct TcpListeners {
  std::vector<int> fds;  // the caller closes them
  int port = 0;          // the port bound
};

// `what` names the setting in errors ("peer_listen"). Throws Error: kInvalidArgument if `address`
// is not HOST:PORT, kUnavailable if no address could be bound (naming the system's reason).
TcpListeners ListenTcp(const std::string& address, const char* what);

}  // namespace trainstream::daemon
