// libFuzzer harness: layout validation. The bytes are either a serialized v1::LayoutSpec, as an attach
// carries it (FromProto, then shm::ComputeLayout: the daemon's path), or a LayoutSpec built
// field by field (reaching ComputeLayout with specs protobuf parsing would rarely produce); a layout
// that passes is then checked against a state segment whose header the rest of the bytes overwrite
// (what a daemon re-adopting a dead daemon's job reads). Only trainstream::Error may come out.
#include <fuzzer/FuzzedDataProvider.h>
#include <google/protobuf/stubs/logging.h>

#include <cstring>
#include <vector>

#include "proto/layout_spec_proto.h"
#include "shm/error.h"
#include "shm/job_layout.h"

namespace ts = trainstream;

namespace {

ts::shm::LayoutSpec SpecFrom(FuzzedDataProvider& data) {
  ts::shm::LayoutSpec spec;
  const size_t params = data.ConsumeIntegralInRange<size_t>(0, 12);
  for (size_t i = 0; i < params; ++i) {
    ts::shm::ParamSpec param;
    param.name = data.ConsumeRandomLengthString(16);
    const size_t dims = data.ConsumeIntegralInRange<size_t>(0, 4);
    for (size_t d = 0; d < dims; ++d) param.shape.push_back(data.ConsumeIntegral<int64_t>());
    param.dtype = static_cast<ts::DType>(data.ConsumeIntegralInRange<uint32_t>(0, 3));
    param.group = data.ConsumeIntegralInRange<uint32_t>(0, 4);
    param.partition = data.ConsumeIntegralInRange<uint32_t>(0, 3);
    (data.ConsumeBool() ? spec.params : spec.frozen).push_back(std::move(param));
  }
  spec.num_groups = data.ConsumeIntegralInRange<uint32_t>(0, 5);
  spec.bucket_bytes = data.ConsumeIntegral<uint64_t>();
  spec.moment_dtype = static_cast<ts::DType>(data.ConsumeIntegralInRange<uint32_t>(0, 3));
  spec.accumulation_steps = data.ConsumeIntegral<uint32_t>();
  spec.world_size = data.ConsumeIntegral<uint32_t>();
  spec.max_grad_norm = data.ConsumeFloatingPoint<double>();
  const size_t peers = data.ConsumeIntegralInRange<size_t>(0, 3);
  for (size_t i = 0; i < peers; ++i) spec.peers.push_back(data.ConsumeRandomLengthString(24));
  spec.node_rank = data.ConsumeIntegral<uint32_t>();
  return spec;
}

// The state segment of `layout` as a new job writes it, then with the fuzzer's bytes over its header.
void CheckScribbledState(const ts::shm::JobLayout& layout, FuzzedDataProvider& data) {
  if (layout.state_bytes > (size_t{1} << 20)) return;
  std::vector<uint64_t> memory((layout.state_bytes + 7) / 8 + 1);  // 8-byte aligned for the atomics
  ts::shm::InitStateSegment(memory.data(), layout);
  const std::vector<uint8_t> scribble = data.ConsumeBytes<uint8_t>(sizeof(ts::shm::StateHeader));
  if (!scribble.empty()) std::memcpy(memory.data(), scribble.data(), scribble.size());
  const size_t size = data.ConsumeIntegralInRange<size_t>(0, layout.state_bytes);
  ts::shm::CheckStateSegment(memory.data(), size, layout);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);  // invalid UTF-8 in a string field is logged: expected here
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  FuzzedDataProvider data(bytes, size);
  try {
    ts::shm::LayoutSpec spec;
    if (data.ConsumeBool()) {
      const std::vector<uint8_t> message = data.ConsumeBytes<uint8_t>(data.ConsumeIntegralInRange<size_t>(0, 4096));
      ts::v1::LayoutSpec proto;
      if (!proto.ParseFromArray(message.data(), static_cast<int>(message.size()))) return 0;
      spec = ts::FromProto(proto);
    } else {
      spec = SpecFrom(data);
    }
    const ts::shm::JobLayout layout = ts::shm::ComputeLayout(spec);
    CheckScribbledState(layout, data);
  } catch (const ts::Error&) {
  }
  return 0;
}
