#include "daemon/tcp_listen.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "shm/error.h"

namespace trainstream::daemon {

namespace {

void SetOption(int fd, int level, int name, int value) {
  setsockopt(fd, level, name, &value, sizeof(value));
}

// One listening socket bound to `address`; -1 (errno set) if it cannot.
int ListenOn(const sockaddr* address, socklen_t length, bool dual_stack) {
  const int fd = socket(address->sa_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  SetOption(fd, SOL_SOCKET, SO_REUSEADDR, 1);
  SetOption(fd, IPPROTO_TCP, TCP_NODELAY, 1);
  if (address->sa_family == AF_INET6) SetOption(fd, IPPROTO_IPV6, IPV6_V6ONLY, dual_stack ? 0 : 1);
  if (bind(fd, address, length) != 0 || listen(fd, SOMAXCONN) != 0) {
    const int error = errno;
    close(fd);
    errno = error;
    return -1;
  }
  return fd;
}

int BoundPort(int fd) {
  sockaddr_storage address{};
  socklen_t length = sizeof(address);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) return 0;
  return ntohs(address.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&address)->sin6_port
                                             : reinterpret_cast<sockaddr_in*>(&address)->sin_port);
}

void SetPort(sockaddr* address, int port) {
  if (address->sa_family == AF_INET6) {
    reinterpret_cast<sockaddr_in6*>(address)->sin6_port = htons(port);
  } else {
    reinterpret_cast<sockaddr_in*>(address)->sin_port = htons(port);
  }
}

}  // namespace

TcpListeners ListenTcp(const std::string& address, const char* what) {
  const size_t colon = address.rfind(':');
  TS_CHECK(colon != std::string::npos, Code::kInvalidArgument, "{} '{}' must be HOST:PORT", what, address);
  std::string host = address.substr(0, colon);
  const std::string port = address.substr(colon + 1);
  TS_CHECK(!port.empty() && port.size() <= 5 && port.find_first_not_of("0123456789") == std::string::npos &&
               std::stoi(port) <= 65535,
           Code::kInvalidArgument, "{} '{}' has no valid port (HOST:PORT)", what, address);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  const bool dual_stack = host.empty() || host == "::";
  TcpListeners listeners{.fds = {}, .port = std::stoi(port)};
  std::string failure;
  auto bind_all = [&](const char* name, bool dual) {
    addrinfo hints{};
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    addrinfo* list = nullptr;
    const int resolved = getaddrinfo(name, port.c_str(), &hints, &list);
    if (resolved != 0) {
      failure = gai_strerror(resolved);
      return;
    }
    for (addrinfo* a = list; a != nullptr; a = a->ai_next) {
      SetPort(a->ai_addr, listeners.port);  // port 0: the first socket's port for the others too
      const int fd = ListenOn(a->ai_addr, a->ai_addrlen, dual);
      if (fd < 0) {
        failure = std::strerror(errno);
        continue;
      }
      listeners.fds.push_back(fd);
      listeners.port = BoundPort(fd);
      if (dual) break;  // one socket serves both families
    }
    freeaddrinfo(list);
  };
  bind_all(dual_stack ? "::" : host.c_str(), dual_stack);
  if (listeners.fds.empty() && dual_stack) bind_all("0.0.0.0", false);  // a machine without IPv6
  TS_CHECK(!listeners.fds.empty(), Code::kUnavailable, "cannot listen on {} ({}): {}", address, what, failure);
  return listeners;
}

WakeFd::WakeFd() : fd_(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {
  if (fd_ < 0) Throw(Code::kUnavailable, "cannot create an eventfd: {}", std::strerror(errno));
}

WakeFd::~WakeFd() {
  close(fd_);
}

void WakeFd::Wake(const char* what) const {
  const uint64_t one = 1;
  if (write(fd_, &one, sizeof(one)) < 0) spdlog::warn("cannot wake the {}: {}", what, std::strerror(errno));
}

}  // namespace trainstream::daemon
