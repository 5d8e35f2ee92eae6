#include "daemon/peer/peer_listener.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <grpcpp/server.h>
#include <grpcpp/server_posix.h>
#include <netinet/in.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "daemon/counters/counters.h"
#include "daemon/tcp_listen.h"
#include "shm/error.h"

namespace trainstream::daemon {

namespace {
using Clock = PeerConnections::Clock;
using std::chrono::milliseconds;

constexpr char kPreface[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";  // what an HTTP/2 client sends first
constexpr int kPrefaceBytes = sizeof(kPreface) - 1;
constexpr milliseconds kTick{250};              // how often handed-over connections are swept
constexpr milliseconds kAcceptPause{100};       // after accept() failed for want of descriptors or memory
constexpr milliseconds kRoomWait{20};           // a connection that spoke, waiting for a place
constexpr std::chrono::seconds kWarnEvery{10};  // refused connections are summed up in the log this often

void SetOption(int fd, int level, int name, int value) {
  setsockopt(fd, level, name, &value, sizeof(value));
}

}  // namespace

std::string PeerAddressOf(int fd) {
  sockaddr_storage address{};
  socklen_t length = sizeof(address);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) return "unknown";
  char text[INET6_ADDRSTRLEN] = {};
  if (address.ss_family == AF_INET) {
    const auto* v4 = reinterpret_cast<const sockaddr_in*>(&address);
    inet_ntop(AF_INET, &v4->sin_addr, text, sizeof(text));
    return fmt::format("ipv4:{}:{}", text, ntohs(v4->sin_port));
  }
  const auto* v6 = reinterpret_cast<const sockaddr_in6*>(&address);
  if (IN6_IS_ADDR_V4MAPPED(&v6->sin6_addr)) {  // an IPv4 peer of a dual-stack socket
    inet_ntop(AF_INET, &v6->sin6_addr.s6_addr[12], text, sizeof(text));
    return fmt::format("ipv4:{}:{}", text, ntohs(v6->sin6_port));
  }
  inet_ntop(AF_INET6, &v6->sin6_addr, text, sizeof(text));
  return fmt::format("ipv6:[{}]:{}", text, ntohs(v6->sin6_port));
}

PeerListener::PeerListener(const std::string& address, grpc::Server& server, PeerConnections& connections,
                           Limits limits)
    : server_(server), connections_(connections), limits_(limits) {
  TcpListeners listening = ListenTcp(address, "peer_listen");
  listeners_ = std::move(listening.fds);
  port_ = listening.port;
  thread_ = std::thread([this] { Run(); });
}

PeerListener::~PeerListener() {
  Stop();
}

void PeerListener::Stop() {
  if (!thread_.joinable()) return;
  wake_.Wake("peer listener");
  thread_.join();
  for (const int fd : listeners_) close(fd);
  for (Pending& pending : pending_) {
    if (pending.fd >= 0) close(pending.fd);
  }
  pending_.clear();
}

void PeerListener::Run() {
  auto next_sweep = Clock::now() + kTick;
  for (;;) {
    const auto now = Clock::now();
    std::vector<pollfd> polled{{wake_.fd(), POLLIN, 0}};
    const bool accepting = now >= accept_again_;
    if (accepting) {
      for (const int fd : listeners_) polled.push_back({fd, POLLIN, 0});
    }
    auto wake_at = accepting ? next_sweep : std::min(next_sweep, accept_again_);
    std::vector<size_t> polled_pending;  // the index in pending_ of each pending connection polled
    for (size_t i = 0; i < pending_.size(); ++i) {
      const Pending& pending = pending_[i];
      wake_at = std::min(wake_at, pending.spoke ? now + kRoomWait : pending.accepted + connections_.limits().handshake);
      if (pending.spoke) continue;
      polled.push_back({pending.fd, POLLIN | POLLRDHUP, 0});
      polled_pending.push_back(i);
    }
    const auto wait = std::chrono::duration_cast<milliseconds>(wake_at - now).count();
    if (poll(polled.data(), polled.size(), static_cast<int>(std::max<int64_t>(wait, 0) + 1)) < 0 && errno != EINTR) {
      spdlog::error("the peer listener stopped: poll failed: {}", std::strerror(errno));
      return;
    }
    if (polled[0].revents != 0) return;  // Stop
    const auto polled_at = Clock::now();
    size_t index = 1;
    if (accepting) {
      for (const int fd : listeners_) {
        if (polled[index++].revents != 0) AcceptFrom(fd, polled_at);
      }
    }
    for (const size_t i : polled_pending) {  // AcceptFrom only appends to pending_, and may close some
      const pollfd& entry = polled[index++];
      if (entry.revents != 0 && pending_[i].fd == entry.fd) Check(pending_[i], entry.revents);
    }
    for (Pending& pending : pending_) {
      if (pending.fd >= 0 && pending.spoke) HandOver(pending);
      if (pending.fd >= 0 && polled_at - pending.accepted >= connections_.limits().handshake) {
        Close(pending, "it did not speak HTTP/2 within the handshake time");
      }
    }
    std::erase_if(pending_, [](const Pending& pending) { return pending.fd < 0; });
    if (polled_at >= next_sweep) {
      refused_ += connections_.Sweep(polled_at, false);
      next_sweep = polled_at + kTick;
    }
    if (refused_ > 0 && polled_at - warned_ >= kWarnEvery) {
      spdlog::warn(
          "peer port: {} connections closed without a call carrying the peer secret since the last such "
          "warning (a scan or a flood? the peer port should be open to the cluster's nodes only)",
          refused_);
      refused_ = 0;
      warned_ = polled_at;
    }
  }
}

void PeerListener::AcceptFrom(int listener, Clock::time_point now) {
  for (;;) {
    const int fd = accept4(listener, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      // EMFILE, ENFILE, ENOBUFS, ENOMEM, or worse: gRPC's listener gave up here for good; this one pauses.
      const auto level = now - accept_failed_ >= kWarnEvery ? spdlog::level::warn : spdlog::level::debug;
      spdlog::log(level, "cannot accept a peer connection: {}; accepting again every {} ms", std::strerror(errno),
                  kAcceptPause.count());
      if (level == spdlog::level::warn) accept_failed_ = now;
      accept_again_ = now + kAcceptPause;
      return;
    }
    pending_.push_back(Pending{fd, PeerAddressOf(fd), now});
    if (fd >= limits_.ceiling) {  // the descriptors above are kept for handed-over peers and local trainers
      Close(pending_.back(), "no descriptor to spare below the reserved ones");
      accept_again_ = now + kAcceptPause;
      return;
    }
    SetOption(fd, SOL_SOCKET, SO_RCVLOWAT, kPrefaceBytes);  // poll wakes once the whole preface is here
    const auto waiting = std::count_if(pending_.begin(), pending_.end(), [](auto& p) { return p.fd >= 0 && !p.spoke; });
    if (static_cast<size_t>(waiting) > limits_.pending) {
      const auto oldest = std::find_if(pending_.begin(), pending_.end(), [](auto& p) { return p.fd >= 0 && !p.spoke; });
      Close(*oldest, "a newer connection took its place before it spoke HTTP/2");
    }
  }
}

void PeerListener::Check(Pending& pending, short events) {  // NOLINT(google-runtime-int)
  char head[kPrefaceBytes];
  const ssize_t n = recv(pending.fd, head, sizeof(head), MSG_PEEK | MSG_DONTWAIT);
  if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
  if (n <= 0) return Close(pending, "it ended before speaking HTTP/2");
  if (std::memcmp(head, kPreface, static_cast<size_t>(n)) != 0) return Close(pending, "it does not speak HTTP/2");
  if (n < kPrefaceBytes) {
    if ((events & (POLLHUP | POLLRDHUP | POLLERR)) != 0) Close(pending, "it ended before speaking HTTP/2");
    return;
  }
  SetOption(pending.fd, SOL_SOCKET, SO_RCVLOWAT, 1);
  pending.spoke = true;
}

void PeerListener::HandOver(Pending& pending) {
  const int fd = connections_.Adopt(pending.fd, pending.address, pending.accepted);
  if (fd >= 0) {
    pending.fd = -1;  // Adopt closed it; the connection is gRPC's now
    grpc::AddInsecureChannelFromFd(&server_, fd);
    return;
  }
  if (pending.asked_room) return;  // an untrusted connection is going away for it
  // Every place is taken: an untrusted connection makes room, and this one waits for it; or none can.
  pending.asked_room = true;
  const size_t shut = connections_.Sweep(Clock::now(), true);
  refused_ += shut;
  if (shut == 0) {
    spdlog::warn(
        "peer connection from {} refused: all {} places are held by peers with the secret (raise the "
        "open-file limit)",
        pending.address, connections_.limits().count);
    Close(pending, "no place left");
  }
}

void PeerListener::Close(Pending& pending, const char* why) {
  spdlog::debug("peer connection from {} closed: {}", pending.address, why);
  ++refused_;
  ProcessCounters::Instance().CountError(ErrorKind::kPeerConnection);
  close(pending.fd);
  pending.fd = -1;
}

}  // namespace trainstream::daemon
