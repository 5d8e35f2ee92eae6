#include "daemon/control/control_socket.h"

#include <fcntl.h>
#include <grpcpp/server.h>
#include <grpcpp/server_context.h>
#include <grpcpp/server_posix.h>
#include <spdlog/spdlog.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstring>

#include "shm/error.h"

namespace trainstream::daemon {

namespace {
constexpr std::string_view kFdPeerPrefix = "fd:";  // gRPC's peer string for a connection added by descriptor

int OpenFileLimit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return 1 << 20;
  return static_cast<int>(std::min<rlim_t>(limit.rlim_cur, 1 << 30));
}
}  // namespace

ControlSocket::ControlSocket(const std::string& path, uint32_t mode, grpc::Server& server)
    : path_(path), server_(server) {
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  TS_CHECK(path.size() < sizeof(address.sun_path), Code::kInvalidArgument, "socket path '{}' is longer than {} bytes",
           path, sizeof(address.sun_path) - 1);
  path.copy(address.sun_path, sizeof(address.sun_path) - 1);
  listener_ = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  TS_CHECK(listener_ >= 0, Code::kUnavailable, "cannot create a Unix socket: {}", std::strerror(errno));
  // Nobody can connect before listen(), so the mode is in place before the first connection.
  const bool listening = bind(listener_, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) == 0 &&
                         chmod(path.c_str(), mode & 07777) == 0 && listen(listener_, SOMAXCONN) == 0;
  if (!listening) {
    const int error = errno;
    close(listener_);
    Throw(Code::kUnavailable, "cannot listen on {}: {}", path, std::strerror(error));
  }
  const int limit = OpenFileLimit();
  lowest_ = next_ = limit / 2;
  highest_ = limit - 1;
  acceptor_ = std::thread([this] { Accept(); });
}

ControlSocket::~ControlSocket() {
  StopAccepting();
}

void ControlSocket::StopAccepting() {
  if (listener_ < 0) return;
  shutdown(listener_, SHUT_RDWR);  // wakes the acceptor's accept() with an error
  acceptor_.join();
  close(listener_);
  listener_ = -1;
  unlink(path_.c_str());
}

int ControlSocket::Renumber(int fd) {
  int moved = fcntl(fd, F_DUPFD_CLOEXEC, next_);
  if (moved < 0 && next_ != lowest_) {  // the top of the range is taken: go round
    next_ = lowest_;
    moved = fcntl(fd, F_DUPFD_CLOEXEC, next_);
  }
  close(fd);
  if (moved >= 0) next_ = moved >= highest_ ? lowest_ : moved + 1;
  return moved;
}

void ControlSocket::Accept() {
  for (;;) {
    const int accepted = accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (accepted < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        spdlog::warn("cannot accept a connection on {}: {}", path_, std::strerror(errno));
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        continue;
      }
      return;  // shut down
    }
    ucred credentials{};
    socklen_t length = sizeof(credentials);
    if (getsockopt(accepted, SOL_SOCKET, SO_PEERCRED, &credentials, &length) != 0) {
      spdlog::warn("refusing a connection on {}: no peer credentials ({})", path_, std::strerror(errno));
      close(accepted);
      continue;
    }
    const int fd = Renumber(accepted);
    if (fd < 0) {
      spdlog::warn("refusing a connection on {}: no descriptor left ({})", path_, std::strerror(errno));
      continue;
    }
    {
      std::lock_guard lock(mutex_);
      connections_[fd] = PeerCredentials{credentials.uid, credentials.gid, credentials.pid};
    }
    spdlog::trace("connection from pid {} (uid {}) as descriptor {}", credentials.pid, credentials.uid, fd);
    grpc::AddInsecureChannelFromFd(&server_, fd);  // gRPC owns the descriptor now
  }
}

std::optional<PeerCredentials> ControlSocket::CallerOf(const grpc::ServerContext& context) const {
  const std::string peer = context.peer();
  if (!peer.starts_with(kFdPeerPrefix)) return std::nullopt;
  int fd = -1;
  const char* end = peer.data() + peer.size();
  if (std::from_chars(peer.data() + kFdPeerPrefix.size(), end, fd).ptr != end) return std::nullopt;
  std::lock_guard lock(mutex_);
  auto it = connections_.find(fd);
  if (it == connections_.end()) return std::nullopt;
  return it->second;
}

}  // namespace trainstream::daemon
