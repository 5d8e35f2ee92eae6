#include "daemon/metrics/metrics_server.h"

#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "daemon/metrics/metrics_http.h"
#include "daemon/tcp_listen.h"
#include "shm/error.h"

namespace trainstream::daemon {

namespace {
using Clock = std::chrono::steady_clock;
constexpr std::string_view kUnixPrefix = "unix:";
constexpr std::chrono::milliseconds kAcceptPause{100};  // after accept() failed for want of descriptors
constexpr std::chrono::seconds kDrainTime{1};           // reading away the rest of an answered request

// A Unix socket at `path`, 0600 before it accepts anything (nobody can connect before listen()); a
// stale file, that nobody listens on, is replaced.
int ListenUnix(const std::string& path) {
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  TS_CHECK(!path.empty() && path.size() < sizeof(address.sun_path), Code::kInvalidArgument,
           "metrics_listen 'unix:{}' needs a path of 1 to {} bytes", path, sizeof(address.sun_path) - 1);
  path.copy(address.sun_path, sizeof(address.sun_path) - 1);
  const auto* raw = reinterpret_cast<const sockaddr*>(&address);
  struct stat existing {};
  if (lstat(path.c_str(), &existing) == 0) {
    const int probe = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const bool listening = probe >= 0 && connect(probe, raw, sizeof(address)) == 0;
    if (probe >= 0) close(probe);
    TS_CHECK(!listening, Code::kAlreadyExists, "metrics_listen: another process is listening on {}", path);
    TS_CHECK(S_ISSOCK(existing.st_mode), Code::kAlreadyExists, "metrics_listen: {} exists and is not a socket", path);
    unlink(path.c_str());  // left by a daemon that died
  }
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  TS_CHECK(fd >= 0, Code::kUnavailable, "cannot create a Unix socket: {}", std::strerror(errno));
  if (bind(fd, raw, sizeof(address)) != 0 || chmod(path.c_str(), 0600) != 0 || listen(fd, SOMAXCONN) != 0) {
    const int error = errno;
    close(fd);
    Throw(Code::kUnavailable, "cannot listen for metrics on unix:{}: {}", path, std::strerror(error));
  }
  return fd;
}
}  // namespace

MetricsServer::MetricsServer(const std::string& listen, MetricsLabels labels, std::string token, JobRegistry& registry,
                             const WorkerPool& pool)
    : collector_(registry, pool, labels), token_(std::move(token)) {
  if (listen.starts_with(kUnixPrefix)) {
    unix_path_ = listen.substr(kUnixPrefix.size());
    listeners_.push_back(ListenUnix(unix_path_));
  } else {
    TcpListeners tcp = ListenTcp(listen, "metrics_listen");
    listeners_ = std::move(tcp.fds);
    port_ = tcp.port;
  }
  thread_ = std::thread([this] { Run(); });
}

MetricsServer::~MetricsServer() {
  wake_.Wake("metrics endpoint");
  thread_.join();
  for (Client& client : clients_) Close(client);
  for (const int fd : listeners_) close(fd);
  if (!unix_path_.empty()) unlink(unix_path_.c_str());
}

void MetricsServer::Run() {
  for (;;) {
    const auto now = Clock::now();
    std::vector<pollfd> polled{{wake_.fd(), POLLIN, 0}};
    const bool accepting = now >= accept_again_;
    if (accepting) {
      for (const int fd : listeners_) polled.push_back({fd, POLLIN, 0});
    }
    auto wake_at = accepting ? now + kClientTime : accept_again_;
    for (const Client& client : clients_) {
      const bool writing = client.answered && client.sent < client.response.size();
      polled.push_back({client.fd, static_cast<short>(writing ? POLLOUT : POLLIN), 0});  // NOLINT(google-runtime-int)
      wake_at = std::min(wake_at, client.until);
    }
    const auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(wake_at - now).count();
    if (poll(polled.data(), polled.size(), static_cast<int>(std::max<int64_t>(wait, 0) + 1)) < 0 && errno != EINTR) {
      spdlog::error("the metrics endpoint stopped: poll failed: {}", std::strerror(errno));
      return;
    }
    if (polled[0].revents != 0) return;
    size_t index = 1;
    const size_t polled_clients = clients_.size();  // Accept appends to clients_ (and may close the oldest)
    if (accepting) {
      for (const int fd : listeners_) {
        if (polled[index++].revents != 0) Accept(fd);
      }
    }
    for (size_t i = 0; i < polled_clients; ++i) {
      Client& client = clients_[i];
      const pollfd& entry = polled[index++];
      if (client.fd < 0 || entry.revents == 0) continue;
      if ((entry.revents & POLLOUT) != 0) {
        Write(client);
      } else {
        Read(client);
      }
    }
    const auto after = Clock::now();
    for (Client& client : clients_) {
      if (client.fd >= 0 && after >= client.until) Close(client);
    }
    std::erase_if(clients_, [](const Client& client) { return client.fd < 0; });
  }
}

void MetricsServer::Accept(int listener) {
  for (;;) {
    const int fd = accept4(listener, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        spdlog::warn("cannot accept a metrics connection: {}", std::strerror(errno));
        accept_again_ = Clock::now() + kAcceptPause;
      }
      return;
    }
    const auto open = std::count_if(clients_.begin(), clients_.end(), [](const Client& c) { return c.fd >= 0; });
    if (static_cast<size_t>(open) >= kMaxClients) {
      Close(*std::find_if(clients_.begin(), clients_.end(), [](const Client& c) { return c.fd >= 0; }));
    }
    clients_.push_back(Client{fd, Clock::now() + kClientTime, {}, {}});
  }
}

void MetricsServer::Read(Client& client) {
  char buffer[4096];
  const ssize_t n = recv(client.fd, buffer, sizeof(buffer), MSG_DONTWAIT);
  if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
  if (n <= 0) return Close(client);  // the client is gone, or done reading the answer
  if (client.answered) return;       // the rest of the request, read away
  if (!client.request.Add(std::string_view(buffer, static_cast<size_t>(n)))) return;
  client.response = Respond(client.request.head(), token_, [this] { return collector_.Text(); });
  client.answered = true;
  Write(client);
}

void MetricsServer::Write(Client& client) {
  const ssize_t n = send(client.fd, client.response.data() + client.sent, client.response.size() - client.sent,
                         MSG_DONTWAIT | MSG_NOSIGNAL);
  if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
  if (n < 0) return Close(client);
  client.sent += static_cast<size_t>(n);
  if (client.sent < client.response.size()) return;
  // Closing now could reset the connection under the answer if request bytes are still unread: end
  // the sending side and read until the client closes.
  shutdown(client.fd, SHUT_WR);
  client.until = std::min(client.until, Clock::now() + kDrainTime);
}

void MetricsServer::Close(Client& client) {
  if (client.fd >= 0) close(client.fd);
  client.fd = -1;
}

}  // namespace trainstream::daemon
