// Tests of the peer plane's sender (daemon/peer/peer_sender.h) against a real gRPC server on loopback
// that records every Deliver call: calls are spread over the sender's connections, a call waits for
// a peer that starts listening late (within the timeout), and a peer that never answers fails the
// sends with its name within the timeout.
#include <arpa/inet.h>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "daemon/peer/peer_sender.h"

namespace trainstream::daemon {
namespace {

using std::chrono::milliseconds;

// Answers every call with an empty message and records who called.
class Recorder final : public grpc::CallbackGenericService {
 public:
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* context) override {
    {
      std::lock_guard lock(mutex_);
      connections_.insert(context->peer());
      ++calls_;
    }
    return new Answer();
  }
  size_t Calls() {
    std::lock_guard lock(mutex_);
    return calls_;
  }
  size_t Connections() {
    std::lock_guard lock(mutex_);
    return connections_.size();
  }

 private:
  class Answer final : public grpc::ServerGenericBidiReactor {
   public:
    Answer() {
      const grpc::Slice empty;  // a serialized PeerAck
      response_ = grpc::ByteBuffer(&empty, 1);
      StartRead(&request_);
    }
    void OnReadDone(bool ok) override {
      if (!ok) return Finish(grpc::Status::OK);
      StartWriteAndFinish(&response_, grpc::WriteOptions(), grpc::Status::OK);
    }
    void OnDone() override { delete this; }

   private:
    grpc::ByteBuffer request_;
    grpc::ByteBuffer response_;
  };

  std::mutex mutex_;
  std::set<std::string> connections_;  // the callers' addresses: one per connection
  size_t calls_ = 0;
};

struct Server {
  Recorder recorder;
  std::unique_ptr<grpc::Server> server;

  explicit Server(const std::string& address) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort(address, grpc::InsecureServerCredentials());
    builder.RegisterCallbackGenericService(&recorder);
    server = builder.BuildAndStart();
  }
  ~Server() { server->Shutdown(); }
};

// A loopback port that nothing listens on (for now).
int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  socklen_t size = sizeof(address);
  EXPECT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&address), &size), 0);
  close(fd);
  return ntohs(address.sin_port);
}

std::unique_ptr<PeerSender> SenderTo(const std::string& address, size_t connections, milliseconds timeout) {
  return std::make_unique<PeerSender>(address, connections, "peer " + address + " (node 1)", "secret", timeout,
                                      2 * connections);
}

void PostFragments(PeerSender& sender, const std::vector<float>& data, uint32_t fragments) {
  for (uint32_t fragment = 0; fragment < fragments; ++fragment) {
    v1::PeerChunk header;
    header.set_job("a-job");
    header.set_fragment(fragment);
    sender.Post(header, data.data(), data.size());
  }
}

TEST(PeerSenderTest, SpreadsItsCallsOverItsConnections) {
  const std::string address = "127.0.0.1:" + std::to_string(FreePort());
  Server server(address);
  auto sender = SenderTo(address, 4, milliseconds(10000));
  const std::vector<float> data(1024, 1.0F);
  PostFragments(*sender, data, 16);
  EXPECT_EQ(sender->Finish(), std::nullopt);
  EXPECT_EQ(server.recorder.Calls(), 16U);
  EXPECT_EQ(server.recorder.Connections(), 4U);
}

TEST(PeerSenderTest, WaitsForAPeerThatStartsListeningWithinTheTimeout) {
  const std::string address = "127.0.0.1:" + std::to_string(FreePort());
  auto sender = SenderTo(address, 2, milliseconds(10000));
  const std::vector<float> data(1024, 1.0F);
  PostFragments(*sender, data, 4);
  std::this_thread::sleep_for(milliseconds(500));  // the first connection attempts are refused
  Server server(address);
  EXPECT_EQ(sender->Finish(), std::nullopt);
  EXPECT_EQ(server.recorder.Calls(), 4U);
}

TEST(PeerSenderTest, NamesAPeerThatNeverAnswersWithinTheTimeout) {
  const std::string address = "127.0.0.1:" + std::to_string(FreePort());
  auto sender = SenderTo(address, 2, milliseconds(500));
  const std::vector<float> data(1024, 1.0F);
  const auto start = std::chrono::steady_clock::now();
  PostFragments(*sender, data, 4);
  const auto error = sender->Finish();
  ASSERT_TRUE(error.has_value());
  EXPECT_NE(error->find("peer " + address + " (node 1) did not take"), std::string::npos) << *error;
  EXPECT_LT(std::chrono::steady_clock::now() - start, milliseconds(5000));
}

}  // namespace
}  // namespace trainstream::daemon
