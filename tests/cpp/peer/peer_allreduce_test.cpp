// Tests of the ring all-reduce between two daemons' peer planes in one process, on loopback
// (daemon/peer/peer_allreduce.h): a fragment that does not fit a bucket is refused to whoever sent it,
// naming what was wrong, and fails no reduction; a reduction that then times out names that sender; a
// job dropped mid-reduction leaves nothing that refuses a new job of its name.
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

// One Deliver call to `address` with the secret: fragment 0 of round 0 of the reduce-scatter (or with
// `phase` 1, the all-gather) of bucket 0 of step 1 of "job", from node 0, holding `floats` floats of 100.
grpc::Status DeliverFragment(const std::string& address, size_t floats, uint32_t phase = 0) {
  v1::PeerChunk header;
  header.set_job("job");
  header.set_step(1);
  header.set_phase(phase);
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

// test_peers.py's last phase in one process: node 1's job is dropped while a reduction of it cannot finish
// (its Job lives on: here, the old ring is destroyed only after the new job opened), and a new job of
// the same name starts. Node 0's new job sends its step 1 before node 1's new job submits it (node 0
// is played by hand, so the order is certain); the dropped job's late end must not make node 1 refuse it.
TEST(PeerAllReduce, AJobDroppedMidReductionRefusesNothingOfANewJobOfItsName) {
  Node left, right;
  const std::vector<std::string> peers = {left.address(), right.address()};
  std::vector<float> old_data(kFloats, 1.0F);
  std::promise<std::optional<Error>> old_done;
  auto dropped = std::make_unique<PeerAllReduce>("job", peers, 1, 1, PeerConfig{&right.mailbox, kSecret, 20s, 1});
  dropped->Submit(4, 0, old_data.data(), old_data.size(),
                  [&](const std::optional<Error>& error) { old_done.set_value(error); });
  for (int i = 0; i < 1000 && !right.mailbox.Registered("job", 4, 0); ++i) std::this_thread::sleep_for(10ms);
  ASSERT_TRUE(right.mailbox.Registered("job", 4, 0));  // node 0 never sends it
  dropped->Dropped();
  right.Join(peers, 1, 20s);
  dropped.reset();  // its reduction ends now, after the new job opened
  auto old_result = old_done.get_future();
  ASSERT_EQ(old_result.wait_for(0s), std::future_status::ready);
  const auto old_error = old_result.get();
  ASSERT_TRUE(old_error.has_value());
  EXPECT_EQ(old_error->code(), Code::kAborted) << old_error->what();
  // Node 0's reduce-scatter fragment of step 1 (node 1 receives chunk 0 of 512 floats) arrives first.
  const grpc::Status sent = DeliverFragment(right.address(), kFloats / 2);
  ASSERT_TRUE(sent.ok()) << sent.error_message();
  auto right_done = right.Submit();
  right.AwaitRegistered();
  const grpc::Status gathered = DeliverFragment(right.address(), kFloats / 2, 1);  // chunk 1, summed by node 0
  ASSERT_TRUE(gathered.ok()) << gathered.error_message();
  ASSERT_EQ(right_done.wait_for(20s), std::future_status::ready);
  const auto right_error = right_done.get();
  EXPECT_FALSE(right_error.has_value()) << right_error->what();
  for (size_t i = 0; i < kFloats; ++i) ASSERT_EQ(right.data[i], i < kFloats / 2 ? 102.0F : 100.0F) << i;
}

}  // namespace
}  // namespace trainstream::daemon
