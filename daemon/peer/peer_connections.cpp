#include "daemon/peer/peer_connections.h"

#include <fcntl.h>
#include <grpcpp/server_context.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <charconv>
#include <vector>

#include "daemon/counters/counters.h"

namespace trainstream::daemon {

std::optional<int> HandedOverDescriptor(const std::string& peer) {
  constexpr std::string_view kPrefix = "fd:";  // gRPC's peer string for a connection added by descriptor
  if (!peer.starts_with(kPrefix)) return std::nullopt;
  int fd = -1;
  const char* end = peer.data() + peer.size();
  if (std::from_chars(peer.data() + kPrefix.size(), end, fd).ptr != end) return std::nullopt;
  return fd;
}

PeerConnections::PeerConnections(Limits limits) : limits_(limits), next_(limits.first) {}

int PeerConnections::Adopt(int fd, std::string address, Clock::time_point accepted) {
  struct stat socket {};
  if (fstat(fd, &socket) != 0) return -1;
  std::lock_guard lock(mutex_);
  const int end = limits_.first + limits_.count;
  int moved = -1;
  for (const int from : {next_, limits_.first}) {  // from where the last one went, then round again
    moved = fcntl(fd, F_DUPFD_CLOEXEC, from);
    if (moved >= 0 && moved < end) break;
    if (moved >= 0) close(moved);
    moved = -1;
    if (from == limits_.first) break;
  }
  if (moved < 0) return -1;
  close(fd);
  next_ = moved + 1 >= end ? limits_.first : moved + 1;
  connections_.insert_or_assign(moved, Connection{std::move(address), accepted, socket.st_dev, socket.st_ino});
  return moved;
}

void PeerConnections::Trust(const grpc::ServerContextBase& context) {
  if (const auto fd = HandedOverDescriptor(context.peer())) Trust(*fd);
}

void PeerConnections::Trust(int fd) {
  std::lock_guard lock(mutex_);
  const auto it = connections_.find(fd);
  if (it != connections_.end()) it->second.trusted = true;
}

std::string PeerConnections::NameOf(const grpc::ServerContextBase& context) const {
  const std::string peer = context.peer();
  const auto fd = HandedOverDescriptor(peer);
  return fd ? NameOf(*fd) : peer;
}

std::string PeerConnections::NameOf(int fd) const {
  std::lock_guard lock(mutex_);
  const auto it = connections_.find(fd);
  return it != connections_.end() ? it->second.address : fmt::format("fd:{}", fd);
}

bool PeerConnections::Alive(int fd, const Connection& connection) const {
  struct stat socket {};
  return fstat(fd, &socket) == 0 && socket.st_dev == connection.device && socket.st_ino == connection.inode;
}

void PeerConnections::ShutDown(int fd, Connection& connection, const char* why) {
  shutdown(fd, SHUT_RDWR);  // gRPC reads the end and closes the descriptor itself
  connection.shut = true;
  ProcessCounters::Instance().CountError(ErrorKind::kPeerConnection);
  spdlog::debug("peer connection from {} shut down: {}", connection.address, why);
}

size_t PeerConnections::Sweep(Clock::time_point now, bool make_room) {
  std::lock_guard lock(mutex_);
  size_t shut = 0;
  auto oldest = connections_.end();
  for (auto it = connections_.begin(); it != connections_.end();) {
    Connection& connection = it->second;
    if (!Alive(it->first, connection)) {
      it = connections_.erase(it);
      continue;
    }
    if (!connection.trusted && !connection.shut) {
      if (now - connection.accepted >= limits_.handshake) {
        ShutDown(it->first, connection, "no call with the peer secret within the handshake time");
        ++shut;
      } else if (oldest == connections_.end() || connection.accepted < oldest->second.accepted) {
        oldest = it;
      }
    }
    ++it;
  }
  if (make_room && oldest != connections_.end()) {
    ShutDown(oldest->first, oldest->second, "its place went to a newer connection (no call with the secret yet)");
    ++shut;
  }
  return shut;
}

size_t PeerConnections::size() const {
  std::lock_guard lock(mutex_);
  return connections_.size();
}

}  // namespace trainstream::daemon
