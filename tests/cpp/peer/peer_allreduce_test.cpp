// Tests of the ring all-reduce between two daemons' peer planes in one process, on loopback
// (daemon/peer/peer_allreduce.h): a fragment that does not fit a bucket is refused to whoever sent it,
// naming what was wrong, and fails no reduction; a reduction that then times out names that sender.
#include "daemon/peer/peer_allreduce.h"

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "daemon/peer/peer_server.h"
#include "daemon/peer/peer_wire.h"

namespace trainstream::daemon {
namespace {

using namespace std::chrono_literals;

constexpr char kSecret[] = "a-peer-secret-0123456789";
constexpr size_t kFloats = 1024;  // two chunks of 512 floats, one fragment each

struct Node {
  PeerMailbox mailbox;
  std::unique_ptr<PeerServer> server = std::make_unique<PeerServer>("127.0.0.1:0", mailbox, kSecret);
  std::unique_ptr<PeerAllReduce> ring;
  std::vector<float> data;
  std::promise<std::optional<Error>> done;

  std::string address() const { return "127.0.0.1:" + std::to_string(server->port()); }
  void Join(const std::vector<std::string>& peers, uint32_t rank, std::chrono::milliseconds timeout) {
    ring = std::make_unique<PeerAllReduce>("job", peers, rank, 1, PeerConfig{&mailbox, kSecret, timeout, 1});
    data.assign(kFloats, static_cast<float>(rank + 1));
  }
  std::future<std::optional<Error>> Submit() {
    ring->Submit(1, 0, data.data(), data.size(), [this](const std::optional<Error>& error) { done.set_value(error); });
    return done.get_future();
  }
  void AwaitRegistered() {
    for (int i = 0; i < 1000 && !mailbox.Registered("job", 1, 0); ++i) std::this_thread::sleep_for(10ms);
    ASSERT_TRUE(mailbox.Registered("job", 1, 0));
  }
};

// One Deliver call to `address` with the secret: fragment 0 of round 0 of the reduce-scatter of
// bucket 0 of step 1 of "job", from node 0, holding `floats` floats.
grpc::Status DeliverFragment(const std::string& address, size_t floats) {
  v1::PeerChunk header;
  header.set_job("job");
  header.set_step(1);
  header.set_from_node(0);
  const std::vector<float> values(floats, 100.0F);
  const grpc::ByteBuffer message = EncodeFragment(header, grpc::Slice(values.data(), values.size() * sizeof(float)));
  grpc::GenericStub stub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.AddMetadata(kSecretHeader, kSecret);
  context.set_deadline(std::chrono::system_clock::now() + 10s);
  grpc::ByteBuffer response;
  std::promise<grpc::Status> status;
  stub.UnaryCall(&context, kDeliverMethod, grpc::StubOptions(), &message, &response,
                 [&](const grpc::Status& s) { status.set_value(s); });
  return status.get_future().get();
}

TEST(PeerAllReduce, AWrongSizeFragmentIsRefusedToItsSenderAndFailsNoReduction) {
  Node left, right;
  const std::vector<std::string> peers = {left.address(), right.address()};
  left.Join(peers, 0, 20s);
  right.Join(peers, 1, 20s);
  auto right_done = right.Submit();
  right.AwaitRegistered();
  const grpc::Status refused = DeliverFragment(right.address(), 100);  // a chunk here is 512 floats
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(refused.error_message().find("holds 400 bytes; node 1 expects 2048 (layouts differ?)"), std::string::npos)
      << refused.error_message();
  auto left_done = left.Submit();
  ASSERT_EQ(left_done.wait_for(20s), std::future_status::ready);
  ASSERT_EQ(right_done.wait_for(20s), std::future_status::ready);
  const auto left_error = left_done.get(), right_error = right_done.get();
  EXPECT_FALSE(left_error.has_value()) << left_error->what();
  EXPECT_FALSE(right_error.has_value()) << right_error->what();
  for (size_t i = 0; i < kFloats; ++i) {
    ASSERT_EQ(left.data[i], 3.0F) << i;
    ASSERT_EQ(right.data[i], 3.0F) << i;
  }
}

TEST(PeerAllReduce, AReductionThatTimesOutNamesTheSenderOfARefusedFragment) {
  Node left, right;
  right.Join({left.address(), right.address()}, 1, 1000ms);  // node 0 never joins
  auto right_done = right.Submit();
  right.AwaitRegistered();
  EXPECT_EQ(DeliverFragment(right.address(), 100).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  ASSERT_EQ(right_done.wait_for(20s), std::future_status::ready);
  const auto error = right_done.get();
  ASSERT_TRUE(error.has_value());
  const std::string message = error->what();
  EXPECT_NE(message.find("sent nothing for bucket 0 of step 1 within 1000 ms; refused meanwhile a fragment from "
                         "ipv4:127.0.0.1:"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("(node 0): fragment 0 of round 0 of phase 0 of bucket 0 of step 1 of job 'job' holds 400 "
                         "bytes"),
            std::string::npos)
      << message;
}

}  // namespace
}  // namespace trainstream::daemon
