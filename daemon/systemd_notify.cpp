#include "daemon/systemd_notify.h"

#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <string_view>

namespace trainstream::daemon {

void NotifySystemd(const char* state) {
  const char* variable = std::getenv("NOTIFY_SOCKET");
  if (variable == nullptr || *variable == '\0') return;
  const std::string_view path(variable);
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if ((path[0] != '/' && path[0] != '@') || path.size() >= sizeof(address.sun_path)) {
    spdlog::warn("NOTIFY_SOCKET={} is not a socket path or @abstract name of at most {} bytes: {} not sent", path,
                 sizeof(address.sun_path) - 1, state);
    return;
  }
  path.copy(address.sun_path, path.size());
  if (path[0] == '@') address.sun_path[0] = '\0';  // the abstract namespace; its length is the name's
  const auto length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + path.size());
  const int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0 ||
      sendto(fd, state, std::strlen(state), MSG_NOSIGNAL, reinterpret_cast<const sockaddr*>(&address), length) < 0) {
    spdlog::warn("cannot notify systemd at NOTIFY_SOCKET={}: {} ({} not sent)", path, std::strerror(errno), state);
  }
  if (fd >= 0) close(fd);
}

}  // namespace trainstream::daemon
