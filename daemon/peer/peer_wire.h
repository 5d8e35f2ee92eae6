// One fragment of the ring all-reduce on the wire, without protobuf copies of its floats.
//
// A fragment travels as a serialized v1::PeerChunk whose `data` field comes last: the header fields,
// then field 7's tag and length, then the raw float32 bytes. That is a valid PeerChunk for any
// protobuf reader, but the daemons never build it as one: the sender appends its copy of the floats
// as a slice of its own after the serialized header, and the receiver keeps the floats as slices of the
// received message (reference-counted, not copied) until the all-reduce adds them into its bucket.
#pragma once

#include <grpcpp/support/byte_buffer.h>

#include <cstddef>
#include <vector>

#include "trainstream/v1/peer.pb.h"

namespace trainstream::daemon {

inline constexpr char kDeliverMethod[] = "/trainstream.v1.Peer/Deliver";
// The most float bytes one fragment carries (daemon/peer/peer_allreduce.cpp), and the most a whole message
// may hold: the fragment and its header, whose one long field is the job name (256 bytes at most).
inline constexpr size_t kMaxFragmentBytes = size_t{4} << 20;
inline constexpr size_t kMaxFragmentHeaderBytes = 4096;
inline constexpr size_t kMaxFragmentMessageBytes = kMaxFragmentBytes + kMaxFragmentHeaderBytes;

// The float32 bytes of one delivered fragment: slices of the received message, in order.
using PeerPayload = std::vector<grpc::Slice>;

size_t PayloadBytes(const PeerPayload& payload);

// `header` (its `data` empty) followed by `data` (float32 bytes) as one message.
grpc::ByteBuffer EncodeFragment(const v1::PeerChunk& header, const grpc::Slice& data);

// Splits a message from EncodeFragment into its header and its data bytes; throws Error
// (kInvalidArgument) when the message is not a PeerChunk with `data` last.
PeerPayload DecodeFragment(const grpc::ByteBuffer& message, v1::PeerChunk& header);

// out[i] += value i of `payload` (add), or out[i] = value i, for every float `payload` holds.
void ApplyPayload(const PeerPayload& payload, float* out, bool add);

}  // namespace trainstream::daemon
