#include "daemon/snapshot/snapshot_writer.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>

#include "daemon/snapshot/atomic_file.h"
#include "shm/error.h"

namespace trainstream::daemon {

namespace {

constexpr auto kPoll = std::chrono::milliseconds(100);

// The header's JSON with the longest step and hyperparameters it can have: the room to reserve.
uint64_t ReservedJsonBytes(SnapshotMeta meta) {
  meta.step = std::numeric_limits<uint64_t>::max();
  const double longest = -1.2345678901234567e-308;
  meta.hparams.assign(meta.spec.num_groups, shm::HParams{longest, longest, longest, longest, longest});
  SafetensorsHeader header = SnapshotHeader(meta);
  return EncodeHeader(header).size() - 8;
}

std::span<const std::byte> AsBytes(const std::vector<int64_t>& values) {
  return std::as_bytes(std::span(values));
}

}  // namespace

SnapshotWritten WriteSnapshot(SnapshotMeta meta, const CommittedState& state, SnapshotCapture& capture,
                              const std::string& path, std::optional<uint32_t> owner, const WaitPolicy& waiting) {
  const uint64_t json_bytes = ReservedJsonBytes(meta);
  SafetensorsHeader layout_header = SnapshotHeader(meta);
  const uint64_t data_start = EncodeHeader(layout_header, json_bytes).size();
  TS_CHECK(data_start - 8 <= kMaxHeaderBytes, Code::kFailedPrecondition,
           "job '{}' has {} parameters: its snapshot's header would be {} bytes, over the {} that a restore reads",
           meta.job, meta.spec.params.size() + meta.spec.frozen.size(), data_start - 8, kMaxHeaderBytes);
  std::map<std::string, uint64_t> at;  // tensor -> file offset
  for (const TensorEntry& tensor : layout_header.tensors) at[tensor.name] = data_start + tensor.begin;
  const shm::JobLayout layout = shm::ComputeLayout(meta.spec);

  AtomicFile file(path, owner);
  std::vector<int64_t> steps(meta.spec.params.size(), 0), bucket_steps(layout.buckets.size(), 0);
  while (!capture.complete()) {
    std::optional<CapturedBucket> copy = capture.Next(kPoll);
    if (!copy) {
      waiting();
      continue;
    }
    const std::byte* from = copy->bytes.data();
    const auto& params = layout.buckets[copy->bucket].params;
    for (size_t k = 0; k < params.size(); ++k) {
      const uint32_t p = params[k];
      const ParamStateRef param = state.Param(p);
      for (const auto& [kind, bytes] :
           {std::pair{"master", param.master.size_bytes()}, std::pair{"exp_avg", param.exp_avg.size()},
            std::pair{"exp_avg_sq", param.exp_avg_sq.size()}}) {
        file.WriteAt(at[TensorName(kind, p)], {from, bytes});
        from += bytes;
      }
      steps[p] = copy->steps[k];
    }
    bucket_steps[copy->bucket] = static_cast<int64_t>(copy->step);
  }
  for (uint32_t j = 0; j < meta.spec.frozen.size(); ++j) file.WriteAt(at[TensorName("frozen", j)], state.Frozen(j));
  file.WriteAt(at["step"], AsBytes(steps));
  file.WriteAt(at["bucket_step"], AsBytes(bucket_steps));

  meta.step = static_cast<uint64_t>(*std::min_element(bucket_steps.begin(), bucket_steps.end()));
  meta.hparams = capture.hparams();
  SafetensorsHeader header = SnapshotHeader(meta);
  const std::string bytes = EncodeHeader(header, json_bytes);
  TS_CHECK(bytes.size() == data_start, Code::kInternal, "snapshot header of {} bytes, {} reserved", bytes.size(),
           data_start);
  file.WriteAt(0, std::as_bytes(std::span(bytes)));
  return SnapshotWritten{.path = path, .step = meta.step, .bytes = file.Commit()};
}

}  // namespace trainstream::daemon
