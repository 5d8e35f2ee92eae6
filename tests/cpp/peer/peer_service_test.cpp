// Tests of the Peer server as trainstreamd serves it (daemon/peer/peer_service.h) on loopback: the
// largest fragment the all-reduce sends arrives whole, a wrong secret stores nothing, and a message
// larger than any fragment is refused before the daemon buffers it.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "daemon/peer/peer_sender.h"
#include "daemon/peer/peer_server.h"
#include "daemon/peer/peer_wire.h"

namespace trainstream::daemon {
namespace {

constexpr char kSecret[] = "a-peer-secret-0123456789";

class PeerServiceTest : public ::testing::Test {
 protected:
  PeerServiceTest() : server_(std::make_unique<PeerServer>("127.0.0.1:0", mailbox_, kSecret)) {
    port_ = server_->port();
    EXPECT_NE(port_, 0);
  }

  [[nodiscard]] std::string address() const { return "127.0.0.1:" + std::to_string(port_); }

  // One Deliver call with `message` as it is, and `secret` unless empty.
  grpc::Status Deliver(const grpc::ByteBuffer& message, const std::string& secret) {
    grpc::GenericStub stub(grpc::CreateChannel(address(), grpc::InsecureChannelCredentials()));
    grpc::ClientContext context;
    if (!secret.empty()) context.AddMetadata(kSecretHeader, secret);
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    grpc::ByteBuffer response;
    std::mutex mutex;
    std::condition_variable done;
    std::optional<grpc::Status> status;
    stub.UnaryCall(&context, kDeliverMethod, grpc::StubOptions(), &message, &response, [&](const grpc::Status& s) {
      std::lock_guard lock(mutex);
      status = s;
      done.notify_all();
    });
    std::unique_lock lock(mutex);
    done.wait(lock, [&] { return status.has_value(); });
    return *status;
  }

  // The fragments the mailbox holds for bucket 0 of step 1 of "job".
  std::vector<Delivered> Waiting() {
    const MailboxJob job = mailbox_.Open("job");
    auto waiting = mailbox_.Register(job, 1, 0, nullptr);
    mailbox_.Unregister(job, 1, 0);
    mailbox_.Close(job);
    return waiting;
  }

  PeerMailbox mailbox_;
  std::unique_ptr<PeerServer> server_;
  int port_ = 0;
};

v1::PeerChunk Header() {
  v1::PeerChunk header;
  header.set_job("job");
  header.set_step(1);
  return header;
}

TEST_F(PeerServiceTest, TheLargestPieceArrivesWhole) {
  const std::vector<float> values(kMaxFragmentBytes / sizeof(float), 2.5F);
  PeerSender sender(address(), 1, "peer (node 1)", kSecret, std::chrono::milliseconds(10000), 1);
  sender.Post(Header(), values.data(), values.size());
  ASSERT_EQ(sender.Finish(), std::nullopt);
  const auto waiting = Waiting();
  ASSERT_EQ(waiting.size(), 1U);
  EXPECT_EQ(PayloadBytes(waiting[0].data), kMaxFragmentBytes);
}

TEST_F(PeerServiceTest, AWrongSecretStoresNothing) {
  const std::vector<float> values(1024, 1.0F);
  const grpc::ByteBuffer fragment = EncodeFragment(Header(), grpc::Slice(values.data(), values.size() * sizeof(float)));
  EXPECT_EQ(Deliver(fragment, "not-the-secret-at-all").error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(Deliver(fragment, "").error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(Waiting().empty());
}

TEST_F(PeerServiceTest, MalformedPiecesAreRefusedNamingWhatIsWrong) {
  const std::vector<float> values(16, 1.0F);
  auto fragment = [&](const v1::PeerChunk& header, size_t bytes) {
    return EncodeFragment(header, grpc::Slice(values.data(), bytes));
  };
  v1::PeerChunk phase2 = Header();
  phase2.set_phase(2);
  v1::PeerChunk long_name = Header();
  long_name.set_job(std::string(257, 'j'));
  const std::vector<std::pair<grpc::ByteBuffer, std::string>> cases = {
      {fragment(Header(), 6), "6 bytes, not a whole number of floats"},
      {fragment(phase2, 16), "phase 2 (0 or 1)"},
      {fragment(long_name, 16), "job name has 257 characters (1 to 256)"},
  };
  for (const auto& [message, needle] : cases) {
    const grpc::Status status = Deliver(message, kSecret);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << needle;
    EXPECT_NE(status.error_message().find(needle), std::string::npos) << status.error_message();
  }
  EXPECT_TRUE(Waiting().empty());
}

TEST_F(PeerServiceTest, AMessageLargerThanAnyPieceIsRefused) {
  const std::string bytes(kMaxFragmentMessageBytes + 1, 'x');
  const grpc::Slice slice(bytes);
  const grpc::ByteBuffer message(&slice, 1);
  const grpc::Status status = Deliver(message, "");
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_TRUE(Waiting().empty());
}

}  // namespace
}  // namespace trainstream::daemon
