// libFuzzer harness: the peer wire format (daemon/peer/peer_wire.h). The bytes are one Deliver
// message as another daemon sends it, cut into up to four slices where the fuzzer says (gRPC hands a
// message over in slices of its choosing); a fragment that decodes is applied to a bucket-sized
// buffer, both adding and copying. Only trainstream::Error may come out.
#include <fuzzer/FuzzedDataProvider.h>

#include <vector>

#include "daemon/peer/peer_wire.h"
#include "shm/error.h"

namespace ts = trainstream;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  FuzzedDataProvider data(bytes, size);
  const size_t cuts = data.ConsumeIntegralInRange<size_t>(0, 3);
  std::vector<size_t> lengths;
  for (size_t i = 0; i < cuts; ++i) lengths.push_back(data.ConsumeIntegralInRange<size_t>(0, data.remaining_bytes()));
  std::vector<grpc::Slice> slices;
  for (size_t length : lengths) {
    const std::vector<uint8_t> part = data.ConsumeBytes<uint8_t>(length);
    slices.emplace_back(part.data(), part.size());
  }
  const std::vector<uint8_t> rest = data.ConsumeRemainingBytes<uint8_t>();
  slices.emplace_back(rest.data(), rest.size());
  const grpc::ByteBuffer message(slices.data(), slices.size());
  try {
    ts::v1::PeerChunk header;
    const ts::daemon::PeerPayload payload = ts::daemon::DecodeFragment(message, header);
    std::vector<float> bucket(ts::daemon::PayloadBytes(payload) / sizeof(float) + 1, 1.0F);
    ts::daemon::ApplyPayload(payload, bucket.data(), /*add=*/true);
    ts::daemon::ApplyPayload(payload, bucket.data(), /*add=*/false);
  } catch (const ts::Error&) {
  }
  return 0;
}
