// libFuzzer harness: the step engine's handling of ring messages, the data plane's untrusted input.
// Each input runs one real Job (daemon/control/job.h: state and rank segments in /dev/shm, its engine
// thread, a one-thread worker pool) with its ranks attached through recording sessions; the bytes are
// then records of 65 bytes: the first says which rank and what to do (push the 64 bytes that follow
// as a request message, write them into the rank's hyperparameters, its presence flags, or over its
// request ring's header), the rest is the payload. The harness waits until the engine has read every
// ring (or failed the rank), then drops the job. A message may fail a session; nothing may crash,
// hang, or touch memory outside the segments.
#include <fuzzer/FuzzedDataProvider.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "daemon/control/job.h"
#include "daemon/engine/worker_pool.h"
#include "shm/error.h"
#include "shm/message.h"
#include "shm/ring.h"
#include "tests/cpp/engine/recording_sink.h"

namespace ts = trainstream;

namespace {

constexpr size_t kRecordBytes = 1 + sizeof(ts::shm::Message);

// Two fp32 buckets and a bf16 one; the first byte of the input picks world size, accumulation,
// clipping, moments, the trainer's step terms (with them, accumulation counted from the messages) and
// two state halves (updates that run before the step is decided), so every protocol path is reachable.
ts::shm::LayoutSpec SpecFor(uint8_t options) {
  ts::shm::LayoutSpec spec;
  spec.params = {ts::shm::ParamSpec{.name = "w", .shape = {40, 25}, .dtype = ts::DType::kFloat32},
                 ts::shm::ParamSpec{.name = "b", .shape = {300}, .dtype = ts::DType::kFloat32},
                 ts::shm::ParamSpec{.name = "e", .shape = {64}, .dtype = ts::DType::kBFloat16}};
  spec.bucket_bytes = 4096;
  spec.world_size = 1 + (options & 1);
  spec.step_terms = (options & 16) != 0;
  spec.accumulation_steps = spec.step_terms && (options & 2) != 0 ? 0 : 1 + ((options >> 1) & 1);
  spec.max_grad_norm = (options & 4) != 0 && !spec.step_terms ? 1.0 : 0.0;
  spec.moment_dtype = (options & 8) != 0 ? ts::DType::kBFloat16 : ts::DType::kFloat32;
  spec.state_halves = 1 + ((options >> 5) & 1);
  return spec;
}

// A rank's client side: its rank segment mapped, the producer of its request ring.
struct FuzzRank {
  FuzzRank(ts::daemon::Job& job, uint32_t rank, ts::shm::Doorbell* doorbell)
      : sink(std::make_shared<ts::daemon::RecordingSink>()),
        segment(ts::shm::Segment::Open(job.Attach(rank, sink).rank_segment)),
        view(ts::shm::ViewRank(segment.data(), job.layout())),
        requests(view.request_ring, doorbell) {}
  // Read to the end, or failed. A scribbled header may never read as drained: not waited for.
  [[nodiscard]] bool Drained() const {
    return scribbled || !sink->failures().empty() || view.request_ring->tail.load() >= view.request_ring->head.load();
  }
  bool scribbled = false;
  std::shared_ptr<ts::daemon::RecordingSink> sink;
  ts::shm::Segment segment;
  ts::shm::RankView view;
  ts::shm::RingProducer requests;
};

void Apply(FuzzRank& rank, const ts::daemon::Job& job, uint8_t op, const uint8_t* payload) {
  switch (op % 8) {
    case 5: {  // hyperparameters of either step parity
      auto* hparams = reinterpret_cast<uint8_t*>(rank.view.hparams);
      const size_t bytes = 2 * job.spec().num_groups * sizeof(ts::shm::HParams);
      std::memcpy(hparams + (payload[0] % 2) * (bytes / 2), payload + 1, std::min(bytes / 2, kRecordBytes - 2));
      break;
    }
    case 6:  // presence flags
      std::memcpy(rank.view.presence, payload, job.spec().params.size());
      break;
    case 7:  // the request ring's header, as a client could scribble it
      rank.scribbled = true;
      std::memcpy(reinterpret_cast<uint8_t*>(rank.view.request_ring) + (payload[0] % 3) * 64, payload + 1, 16);
      break;
    default: {  // most records are messages
      ts::shm::Message message;
      std::memcpy(&message, payload, sizeof(message));
      rank.requests.TryPush(message);  // full: dropped
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  spdlog::set_level(spdlog::level::off);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  static ts::daemon::WorkerPool pool(1, /*pin_threads=*/false);
  if (size < 1) return 0;
  auto job = std::make_unique<ts::daemon::Job>("fuzz", static_cast<uint32_t>(geteuid()), SpecFor(bytes[0]), 7, pool);
  ts::shm::Segment state = ts::shm::Segment::Open(job->state_segment_name());
  auto* doorbell = &static_cast<ts::shm::StateHeader*>(state.data())->doorbell;
  std::vector<std::unique_ptr<FuzzRank>> ranks;
  for (uint32_t r = 0; r < job->spec().world_size; ++r) ranks.push_back(std::make_unique<FuzzRank>(*job, r, doorbell));
  try {
    for (size_t at = 1; at + kRecordBytes <= size; at += kRecordBytes) {
      FuzzRank& rank = *ranks[bytes[at] % ranks.size()];
      Apply(rank, *job, static_cast<uint8_t>(bytes[at] >> 1), bytes + at + 1);
    }
  } catch (const ts::Error&) {  // a scribbled header makes the producer report corruption too
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  for (const auto& rank : ranks) {
    while (!rank->Drained() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  for (uint32_t r = 0; r < ranks.size(); ++r) job->Detach(r);
  job.reset();  // waits for the engine's work in flight
  return 0;
}
