// Tests of the peer plane's wire format (daemon/peer/peer_wire.h): a fragment is a valid PeerChunk for any
// protobuf reader, decodes to its header and data without copies, and its floats add exactly even
// when the slices split them anywhere.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "daemon/peer/peer_wire.h"
#include "shm/error.h"
#include "tests/cpp/shm/test_support.h"

namespace trainstream::daemon {
namespace {

v1::PeerChunk Header() {
  v1::PeerChunk header;
  header.set_job("a-job");
  header.set_step(7);
  header.set_bucket(3);
  header.set_phase(1);
  header.set_round(2);
  header.set_from_node(1);
  header.set_fragment(5);
  return header;
}

std::string Flatten(const grpc::ByteBuffer& message) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(message.Dump(&slices).ok());
  std::string bytes;
  for (const auto& slice : slices) bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  return bytes;
}

// `bytes` as a message of slices of the given sizes (the rest in one last slice).
grpc::ByteBuffer Sliced(const std::string& bytes, const std::vector<size_t>& sizes) {
  std::vector<grpc::Slice> slices;
  size_t at = 0;
  for (size_t size : sizes) {
    slices.emplace_back(bytes.data() + at, size);
    at += size;
  }
  slices.emplace_back(bytes.data() + at, bytes.size() - at);
  return {slices.data(), slices.size()};
}

TEST(PeerWire, EncodedPieceIsAPeerChunkWithItsFloats) {
  const std::vector<float> values = {1.5f, -2.0f, 3.25f};
  const grpc::ByteBuffer message = EncodeFragment(Header(), grpc::Slice(values.data(), values.size() * sizeof(float)));
  v1::PeerChunk parsed;
  ASSERT_TRUE(parsed.ParseFromString(Flatten(message)));
  EXPECT_EQ(parsed.job(), "a-job");
  EXPECT_EQ(parsed.fragment(), 5u);
  ASSERT_EQ(parsed.data().size(), values.size() * sizeof(float));
  EXPECT_EQ(std::memcmp(parsed.data().data(), values.data(), parsed.data().size()), 0);
}

TEST(PeerWire, DecodeSplitsHeaderAndDataAcrossOddSlices) {
  std::vector<float> values(1000);
  for (size_t i = 0; i < values.size(); ++i) values[i] = 0.1f * static_cast<float>(i) - 7.0f;
  const std::string bytes =
      Flatten(EncodeFragment(Header(), grpc::Slice(values.data(), values.size() * sizeof(float))));
  v1::PeerChunk header;
  const PeerPayload payload = DecodeFragment(Sliced(bytes, {3, 11, 1, 2, 1001, 5, 6}), header);
  EXPECT_EQ(header.job(), "a-job");
  EXPECT_EQ(header.step(), 7u);
  EXPECT_EQ(header.bucket(), 3u);
  EXPECT_EQ(header.round(), 2u);
  EXPECT_EQ(header.fragment(), 5u);
  EXPECT_TRUE(header.data().empty());
  ASSERT_EQ(PayloadBytes(payload), values.size() * sizeof(float));

  std::vector<float> sum(values.size(), 1.0f), copy(values.size(), 9.0f);
  ApplyPayload(payload, sum.data(), /*add=*/true);
  ApplyPayload(payload, copy.data(), /*add=*/false);
  for (size_t i = 0; i < values.size(); ++i) {
    EXPECT_EQ(sum[i], 1.0f + values[i]) << i;
    EXPECT_EQ(copy[i], values[i]) << i;
  }
}

TEST(PeerWire, RefusesAChunkWhoseDataIsNotLast) {
  v1::PeerChunk chunk = Header();  // fragment (field 8) is written after data (field 7)
  chunk.set_data(std::string(8, '\0'));
  const std::string bytes = chunk.SerializeAsString();
  v1::PeerChunk header;
  EXPECT_THROW(DecodeFragment(Sliced(bytes, {}), header), Error);
  v1::PeerChunk no_data = Header();
  EXPECT_THROW(DecodeFragment(Sliced(no_data.SerializeAsString(), {}), header), Error);
}

TEST(PeerWire, RefusesADataLengthThatDisagreesWithTheMessage) {
  const std::vector<float> values(4, 1.0f);
  std::string bytes = Flatten(EncodeFragment(Header(), grpc::Slice(values.data(), values.size() * sizeof(float))));
  bytes.resize(bytes.size() - 2);  // the data field says 16 bytes; 14 follow
  v1::PeerChunk header;
  TS_EXPECT_ERROR(DecodeFragment(Sliced(bytes, {}), header), Code::kInvalidArgument,
                  "data field says 16 bytes but 14 follow");
}

}  // namespace
}  // namespace trainstream::daemon
