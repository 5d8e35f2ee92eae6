// Listening TCP sockets for a "host:port" setting, as the daemon's TCP endpoints take it (the peer
// port, the metrics endpoint): a wildcard host (empty, "0.0.0.0", "::" or "[::]") listens on every
// address, "0.0.0.0" on IPv4 only, the others on one dual-stack socket (IPv4 alone where the machine
// has no IPv6); any other host on every address it resolves to ("localhost": 127.0.0.1 and ::1).
// Port 0 lets the system pick one port, the same for all of them. The sockets are non-blocking,
// close-on-exec, SO_REUSEADDR (a restarted daemon binds again at once) but not SO_REUSEPORT (a
// second daemon on the same port fails), with TCP_NODELAY, which accepted sockets inherit.
// WakeFd is the eventfd the endpoints' poll loops wait on beside their sockets, to be stopped.
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

// A non-blocking, close-on-exec eventfd; throws Error kUnavailable where none can be made.
class WakeFd {
 public:
  WakeFd();
  ~WakeFd();
  WakeFd(const WakeFd&) = delete;
  WakeFd& operator=(const WakeFd&) = delete;

  [[nodiscard]] int fd() const { return fd_; }
  // Makes fd() readable; `what` names the loop in the warning where that fails.
  void Wake(const char* what) const;

 private:
  int fd_;
};

}  // namespace trainstream::daemon
