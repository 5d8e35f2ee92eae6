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
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "daemon/snapshot/committed_state.h"
#include "daemon/snapshot/safetensors.h"
#include "daemon/snapshot/untrusted_file.h"
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

// What a restore accepts beyond a consistent snapshot, and how it stops early.
struct RestoreOptions {
  // Master weights and moments that are inf or NaN (a job that had diverged) restore too; by default
  // they are refused, naming the tensor and the element.
  bool allow_nonfinite = false;
  // Asked between chunks of the copy; true stops it (kAborted): the caller went away, or the daemon
  // is shutting down.
  std::function<bool()> cancelled;
};

// A snapshot file opened to restore a job, from a file its client controls
// (daemon/snapshot/untrusted_file.h): its header, metadata and step counts are read and checked when
// it is opened, its tensors when RestoreInto copies them, and what is checked is what is kept in memory
// or copied, never read again from the file. Consistent: the metadata's numbers are decimal and in
// range (a uid is below 2^32 - 1), every bucket holds the snapshot's step or the next one (the engine
// lets no bucket run further ahead) and one holds it, the AdamW step counts are below 2^62, the
// hyperparameters are given for every group or none.
class SnapshotFile {
 public:
  // kNotFound / kPermissionDenied if it cannot be opened (with the calling thread's file identity),
  // kInvalidArgument naming what is wrong if it is not a complete, consistent trainstream snapshot,
  // kFailedPrecondition if it was truncated while it was read.
  explicit SnapshotFile(const std::string& path, RestoreOptions options = {});

  [[nodiscard]] const SnapshotMeta& meta() const { return meta_; }
  [[nodiscard]] const std::string& path() const { return file_.path(); }
  // Writes everything the file holds into a new job's state (its layout is meta().spec's). Throws
  // kFailedPrecondition if the file was truncated since it was opened, kInvalidArgument if it holds
  // non-finite values (unless allowed), kAborted if cancelled; the state is then partly written:
  // discard it (Job does: its new state segment is removed).
  void RestoreInto(const CommittedState& state) const;

 private:
  [[nodiscard]] const TensorEntry& Tensor(const std::string& name) const;
  void CheckTensors() const;
  void ReadSteps();  // the step counts: checked now, restored from what was checked

  UntrustedFile file_;
  RestoreOptions options_;
  SafetensorsHeader header_;
  SnapshotMeta meta_;
  shm::JobLayout layout_;
  std::vector<int64_t> steps_, bucket_steps_;
};

}  // namespace trainstream::daemon
