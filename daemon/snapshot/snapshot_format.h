// A job's snapshot as a safetensors file (daemon/snapshot/safetensors.h): which tensors it holds, in
// which order, and the metadata that makes it a job again.
//
// Tensors, parameter i in the optimizer's order (torch's state_dict indices) and frozen parameter j:
//   master.<i> (F32, the parameter's shape), exp_avg.<i>, exp_avg_sq.<i> (F32 or BF16, the job's
//   moments), frozen.<j> (its dtype), step (I64 [P]: AdamW step count per parameter),
//   bucket_step (I64 [B]: the step each bucket's state holds).
// Metadata (strings): format, job, uid, seed, step (the lowest bucket step), layout (JSON of the
// LayoutSpec), hparams (JSON [[lr, beta1, beta2, eps, weight_decay] per group] of that step; "[]"
// when no rank was attached), daemon_version.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "daemon/guard/fault_guard.h"
#include "daemon/snapshot/committed_state.h"
#include "daemon/snapshot/safetensors.h"
#include "shm/job_layout.h"

namespace trainstream::daemon {

inline constexpr const char* kSnapshotFormat = "trainstream.snapshot.v1";

struct SnapshotMeta {
  std::string job;
  uint32_t uid = 0;  // the job's owner
  uint64_t seed = 0;
  uint64_t step = 0;
  std::vector<shm::HParams> hparams;  // empty: unknown
  shm::LayoutSpec spec;
};

std::string TensorName(const char* kind, uint32_t index);  // "master.3"

// The file's header: every tensor of the job's layout, and `meta` as metadata.
SafetensorsHeader SnapshotHeader(const SnapshotMeta& meta);

// A snapshot file opened to restore a job: mapped read-only, checked through and through. The file is
// its owner's, who may truncate it while the daemon reads it: the mapping is guarded
// (daemon/guard/fault_guard.h), and a file that lost pages so is refused.
class SnapshotFile {
 public:
  // kNotFound / kPermissionDenied if it cannot be opened (with the calling thread's file identity),
  // kInvalidArgument naming what is wrong if it is not a complete trainstream snapshot.
  explicit SnapshotFile(const std::string& path);
  ~SnapshotFile();
  SnapshotFile(const SnapshotFile&) = delete;
  SnapshotFile& operator=(const SnapshotFile&) = delete;

  [[nodiscard]] const SnapshotMeta& meta() const { return meta_; }
  [[nodiscard]] const std::string& path() const { return path_; }
  // Writes everything the file holds into a new job's state (its layout is meta().spec's).
  // kFailedPrecondition if the file was truncated meanwhile (the state then holds zeros in its place).
  void RestoreInto(const CommittedState& state) const;

 private:
  [[nodiscard]] std::span<const std::byte> Tensor(const std::string& name) const;
  void CheckTensors() const;
  void CheckNotTruncated() const;
  [[nodiscard]] std::string TruncatedMessage() const;
  void Unmap();

  std::string path_;
  const std::byte* data_ = nullptr;
  uint64_t size_ = 0;
  GuardedRange guard_;  // over [data_, data_ + size_)
  SafetensorsHeader header_;
  SnapshotMeta meta_;
  shm::JobLayout layout_;
};

}  // namespace trainstream::daemon
