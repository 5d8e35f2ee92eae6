// Tests of the peer port as the daemon accepts it (daemon/peer/peer_listener.h,
// daemon/peer/peer_connections.h), on loopback with short handshake times: a connection that never
// speaks, or speaks something else than HTTP/2, is closed; at most `pending` wait, the oldest goes;
// a connection that never carries the secret is shut down while one that did stays; and connections
// that speak HTTP/2 but hold every place cannot keep out a peer that has the secret; and the port
// accepts again after the process ran out of descriptors (gRPC's own listener stopped for good).
#include <arpa/inet.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "daemon/peer/peer_server.h"
#include "daemon/peer/peer_wire.h"

namespace trainstream::daemon {
namespace {

using namespace std::chrono_literals;

constexpr char kSecret[] = "a-peer-secret-0123456789";
constexpr char kPreface[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

// A server whose handed-over connections have `places` descriptors and `handshake` to carry the secret,
// and `pending` connections may wait to speak.
PeerServer::Limits Limits(int places, size_t pending, std::chrono::milliseconds handshake) {
  PeerServer::Limits limits = PeerServer::LimitsFor(OpenFileLimit(), handshake);
  limits.connections.count = places;
  limits.listener.pending = pending;
  return limits;
}

class Connection {
 public:
  explicit Connection(int port) : fd_(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) {
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(port);
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(connect(fd_, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  }
  ~Connection() { close(fd_); }
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  void Send(const std::string& bytes) { EXPECT_EQ(send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL), bytes.size()); }
  // Whether the daemon closed the connection within `timeout` (reading and dropping what it sent).
  bool ClosedWithin(std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      char buffer[256];
      const ssize_t n = recv(fd_, buffer, sizeof(buffer), MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) return true;
      if (n < 0) std::this_thread::sleep_for(10ms);
    }
    return false;
  }

 private:
  int fd_;
};

// One Deliver call of an empty fragment (fragment `fragment` of an unknown job) over `stub` with `secret`.
grpc::Status Deliver(grpc::GenericStub& stub, const std::string& secret, uint32_t fragment = 0) {
  v1::PeerChunk header;
  header.set_job("job");
  header.set_step(1);
  header.set_fragment(fragment);
  const grpc::ByteBuffer message = EncodeFragment(header, grpc::Slice());
  grpc::ClientContext context;
  context.AddMetadata(kSecretHeader, secret);
  context.set_deadline(std::chrono::system_clock::now() + 10s);
  context.set_wait_for_ready(true);
  grpc::ByteBuffer response;
  std::promise<grpc::Status> status;
  stub.UnaryCall(&context, kDeliverMethod, grpc::StubOptions(), &message, &response,
                 [&](const grpc::Status& s) { status.set_value(s); });
  return status.get_future().get();
}

// A stub on a connection of its own.
std::unique_ptr<grpc::GenericStub> Stub(int port) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return std::make_unique<grpc::GenericStub>(
      grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials(), args));
}

TEST(PeerListener, AConnectionThatNeverSpeaksIsClosedAfterTheHandshakeTime) {
  PeerMailbox mailbox;
  PeerServer server("127.0.0.1:0", mailbox, kSecret, Limits(8, 8, 500ms));
  Connection silent(server.port());
  EXPECT_TRUE(silent.ClosedWithin(10s));  // gRPC's own listener kept it for 120 s
}

TEST(PeerListener, AConnectionThatSpeaksSomethingElseIsClosedAtOnce) {
  PeerMailbox mailbox;
  PeerServer server("127.0.0.1:0", mailbox, kSecret, Limits(8, 8, 60s));
  Connection http1(server.port());
  http1.Send("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_TRUE(http1.ClosedWithin(10s));
}

TEST(PeerListener, AtMostPendingWaitToSpeakAndTheOldestMakesRoom) {
  PeerMailbox mailbox;
  PeerServer server("127.0.0.1:0", mailbox, kSecret, Limits(8, 2, 60s));
  Connection first(server.port());
  EXPECT_FALSE(first.ClosedWithin(300ms));
  Connection second(server.port()), third(server.port());
  EXPECT_TRUE(first.ClosedWithin(10s));
  EXPECT_FALSE(second.ClosedWithin(300ms));
  EXPECT_FALSE(third.ClosedWithin(300ms));
  auto stub = Stub(server.port());  // a peer with the secret still gets in, taking the oldest's place
  EXPECT_TRUE(Deliver(*stub, kSecret).ok());
  EXPECT_TRUE(second.ClosedWithin(10s));
}

TEST(PeerListener, AConnectionWithoutTheSecretIsShutDownAndOneWithItStays) {
  PeerMailbox mailbox;
  PeerServer server("127.0.0.1:0", mailbox, kSecret, Limits(8, 8, 500ms));
  auto trusted = Stub(server.port()), stranger = Stub(server.port());
  EXPECT_TRUE(Deliver(*trusted, kSecret).ok());
  EXPECT_EQ(Deliver(*stranger, "not-the-secret-at-all").error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(server.connections().size(), 2U);
  for (int i = 0; i < 1000 && server.connections().size() > 1; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(server.connections().size(), 1U);
  std::this_thread::sleep_for(1s);  // twice the handshake time: the trusted one stays
  EXPECT_EQ(server.connections().size(), 1U);
  EXPECT_TRUE(Deliver(*trusted, kSecret, 1).ok());
}

TEST(PeerListener, ConnectionsThatSpeakButHaveNoSecretCannotKeepAPeerOut) {
  PeerMailbox mailbox;
  PeerServer server("127.0.0.1:0", mailbox, kSecret, Limits(4, 4, 60s));
  std::vector<std::unique_ptr<Connection>> flood;
  for (int i = 0; i < 12; ++i) {
    flood.push_back(std::make_unique<Connection>(server.port()));
    flood.back()->Send(kPreface);
  }
  for (int i = 0; i < 1000 && server.connections().size() < 4; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(server.connections().size(), 4U);  // every place taken, more waiting
  auto stub = Stub(server.port());
  EXPECT_TRUE(Deliver(*stub, kSecret).ok());
}

TEST(PeerListener, ThePortAcceptsAgainAfterDescriptorsRanOut) {
  PeerMailbox mailbox;
  PeerServer server("127.0.0.1:0", mailbox, kSecret, Limits(8, 8, 60s));
  auto early = std::make_unique<Connection>(server.port());  // its socket exists before they run out
  early->Send(kPreface);
  for (int i = 0; i < 1000 && server.connections().size() < 1; ++i) std::this_thread::sleep_for(10ms);
  ASSERT_EQ(server.connections().size(), 1U);
  const int spare = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);  // made before none are left
  std::vector<int> held;                                             // every other descriptor of the process
  for (int fd = dup(spare); fd >= 0; fd = dup(spare)) held.push_back(fd);
  ASSERT_EQ(errno, EMFILE);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(server.port());
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(connect(spare, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);  // accept() fails: EMFILE
  ASSERT_EQ(send(spare, kPreface, sizeof(kPreface) - 1, MSG_NOSIGNAL), static_cast<ssize_t>(sizeof(kPreface) - 1));
  std::this_thread::sleep_for(500ms);  // the listener meets EMFILE meanwhile
  for (const int fd : held) close(fd);
  for (int i = 0; i < 1000 && server.connections().size() < 2; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(server.connections().size(), 2U);  // the connection made while none was left got in
  auto stub = Stub(server.port());
  EXPECT_TRUE(Deliver(*stub, kSecret).ok());
  close(spare);
}

}  // namespace
}  // namespace trainstream::daemon
