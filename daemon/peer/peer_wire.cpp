#include "daemon/peer/peer_wire.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/wire_format_lite.h>
#include <grpcpp/support/proto_buffer_reader.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "shm/error.h"

namespace trainstream::daemon {

namespace {
using google::protobuf::internal::WireFormatLite;
using google::protobuf::io::CodedInputStream;
using google::protobuf::io::CodedOutputStream;

constexpr uint32_t kDataTag =
    (v1::PeerChunk::kDataFieldNumber << 3) | WireFormatLite::WIRETYPE_LENGTH_DELIMITED;  // 7 << 3 | 2

// Where the data field starts: the header's length (bytes before the data tag) and the data's offset
// and length.
struct DataField {
  size_t header_bytes = 0, begin = 0;
  uint32_t bytes = 0;
};

DataField FindData(grpc::ByteBuffer& message) {
  grpc::ProtoBufferReader reader(&message);
  CodedInputStream in(&reader);
  DataField field;
  for (;;) {
    field.header_bytes = static_cast<size_t>(in.CurrentPosition());
    const uint32_t tag = in.ReadTag();
    TS_CHECK(tag != 0, Code::kInvalidArgument, "malformed peer chunk: no data");
    if (tag == kDataTag) break;
    TS_CHECK(WireFormatLite::SkipField(&in, tag), Code::kInvalidArgument, "malformed peer chunk header");
  }
  TS_CHECK(in.ReadVarint32(&field.bytes), Code::kInvalidArgument, "malformed peer chunk: data length");
  field.begin = static_cast<size_t>(in.CurrentPosition());
  return field;
}

v1::PeerChunk ReadHeader(grpc::ByteBuffer& message, size_t header_bytes) {
  grpc::ProtoBufferReader reader(&message);
  CodedInputStream in(&reader);
  std::string bytes;
  v1::PeerChunk header;
  TS_CHECK(in.ReadString(&bytes, static_cast<int>(header_bytes)) && header.ParseFromString(bytes),
           Code::kInvalidArgument, "malformed peer chunk header");
  return header;
}

// The slices of `message` from byte `skip` on (references, not copies).
PeerPayload SlicesFrom(const grpc::ByteBuffer& message, size_t skip) {
  std::vector<grpc::Slice> slices;
  TS_CHECK(message.Dump(&slices).ok(), Code::kInvalidArgument, "unreadable peer chunk");
  PeerPayload payload;
  for (const grpc::Slice& slice : slices) {
    if (skip >= slice.size()) {
      skip -= slice.size();
      continue;
    }
    payload.push_back(skip == 0 ? slice : slice.sub(skip, slice.size()));
    skip = 0;
  }
  return payload;
}

// Four floats: GCC and Clang add these lane by lane with one vector instruction (the plain loop
// below stays scalar at -O2: measured 7% of a node's CPU time). Each lane's sum is the same IEEE
// addition as the scalar one, so the result is bit-identical.
using Floats = float __attribute__((vector_size(16)));

void AddFloats(float* __restrict out, const uint8_t* __restrict in, size_t count) {
  constexpr size_t kBlock = 4 * sizeof(Floats) / sizeof(float);
  size_t i = 0;
  for (; i + kBlock <= count; i += kBlock) {
    Floats sum[4], value[4];
    std::memcpy(sum, out + i, sizeof(sum));  // slices are not aligned to floats
    std::memcpy(value, in + i * sizeof(float), sizeof(value));
    for (int k = 0; k < 4; ++k) sum[k] += value[k];
    std::memcpy(out + i, sum, sizeof(sum));
  }
  for (; i < count; ++i) {
    float value;
    std::memcpy(&value, in + i * sizeof(float), sizeof(float));
    out[i] += value;
  }
}

// Adds a stream of float bytes that arrives in slices split anywhere, even inside a float.
class Adder {
 public:
  explicit Adder(float* out) : out_(out) {}
  void Add(const uint8_t* in, size_t bytes) {
    if (carried_ > 0) {  // finish the float split across the previous slice and this one
      const size_t take = std::min(sizeof(float) - carried_, bytes);
      std::memcpy(carry_ + carried_, in, take);
      carried_ += take;
      in += take;
      bytes -= take;
      if (carried_ < sizeof(float)) return;
      AddFloats(out_++, carry_, 1);
      carried_ = 0;
    }
    const size_t whole = bytes / sizeof(float);
    AddFloats(out_, in, whole);
    out_ += whole;
    carried_ = bytes - whole * sizeof(float);
    std::memcpy(carry_, in + whole * sizeof(float), carried_);
  }

 private:
  float* out_;
  uint8_t carry_[sizeof(float)] = {};
  size_t carried_ = 0;
};
}  // namespace

size_t PayloadBytes(const PeerPayload& payload) {
  size_t bytes = 0;
  for (const grpc::Slice& slice : payload) bytes += slice.size();
  return bytes;
}

grpc::ByteBuffer EncodeFragment(const v1::PeerChunk& header, const grpc::Slice& data) {
  std::string head = header.SerializeAsString();
  uint8_t field[16];
  uint8_t* end = CodedOutputStream::WriteVarint32ToArray(kDataTag, field);
  end = CodedOutputStream::WriteVarint32ToArray(static_cast<uint32_t>(data.size()), end);
  head.append(reinterpret_cast<const char*>(field), end - field);
  const grpc::Slice slices[] = {grpc::Slice(head), data};
  return {slices, 2};
}

PeerPayload DecodeFragment(const grpc::ByteBuffer& message, v1::PeerChunk& header) {
  grpc::ByteBuffer readable(message);  // shares the slices; the readers want a mutable buffer
  const DataField data = FindData(readable);
  TS_CHECK(data.begin + data.bytes == message.Length(), Code::kInvalidArgument,
           "malformed peer chunk: its data field says {} bytes but {} follow (data must be the last field)", data.bytes,
           message.Length() - data.begin);
  header = ReadHeader(readable, data.header_bytes);
  return SlicesFrom(message, data.begin);
}

void ApplyPayload(const PeerPayload& payload, float* out, bool add) {
  if (add) {
    Adder adder(out);
    for (const grpc::Slice& slice : payload) adder.Add(slice.begin(), slice.size());
    return;
  }
  auto* bytes = reinterpret_cast<uint8_t*>(out);
  for (const grpc::Slice& slice : payload) bytes = std::copy(slice.begin(), slice.end(), bytes);
}

}  // namespace trainstream::daemon
