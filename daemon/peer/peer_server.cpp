#include "daemon/peer/peer_server.h"

#include <sys/resource.h>

#include <algorithm>

#include "shm/error.h"

namespace trainstream::daemon {

int OpenFileLimit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return 1 << 20;
  return static_cast<int>(std::min<rlim_t>(limit.rlim_cur, 1 << 30));
}

PeerServer::Limits PeerServer::LimitsFor(int open_files, std::chrono::milliseconds handshake) {
  const int count = std::clamp(open_files / 8, 4, 1024);
  const int first = open_files / 2 - count;
  TS_CHECK(first > 16, Code::kFailedPrecondition,
           "an open-file limit of {} leaves the peer plane no room (ulimit -n; 256 or more)", open_files);
  return Limits{.connections = {.first = first, .count = count, .handshake = handshake},
                .listener = {.pending = static_cast<size_t>(std::clamp(open_files / 32, 4, 64)), .ceiling = first}};
}

PeerServer::PeerServer(const std::string& address, PeerMailbox& mailbox, std::string secret)
    : PeerServer(address, mailbox, std::move(secret), LimitsFor(OpenFileLimit())) {}

PeerServer::PeerServer(const std::string& address, PeerMailbox& mailbox, std::string secret, Limits limits)
    : connections_(limits.connections), service_(mailbox, std::move(secret), connections_) {
  grpc::ServerBuilder builder;  // no listening port: PeerListener hands the connections over
  builder.SetMaxReceiveMessageSize(static_cast<int>(kMaxFragmentMessageBytes));
  builder.RegisterService(&service_);
  server_ = builder.BuildAndStart();
  TS_CHECK(server_ != nullptr, Code::kUnavailable, "cannot start the peer gRPC server");
  listener_ = std::make_unique<PeerListener>(address, *server_, connections_, limits.listener);
}

PeerServer::~PeerServer() {
  Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
}

void PeerServer::Shutdown(std::chrono::system_clock::time_point deadline) {
  if (shut_down_) return;
  shut_down_ = true;
  listener_->Stop();
  server_->Shutdown(deadline);
}

}  // namespace trainstream::daemon
