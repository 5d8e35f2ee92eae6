#include "daemon/snapshot/snapshot_capture.h"

#include <algorithm>
#include <cstring>

#include "shm/error.h"

namespace trainstream::daemon {

SnapshotCapture::SnapshotCapture(const CommittedState& state, const shm::JobLayout& layout, uint32_t num_groups,
                                 std::optional<uint64_t> target, bool or_next)
    : state_(state),
      layout_(layout),
      num_groups_(num_groups),
      target_(target),
      or_next_(or_next && target.has_value()),
      taken_(layout.buckets.size(), 0) {}

void SnapshotCapture::OnCommit(const Commit& commit) {
  std::lock_guard lock(mutex_);
  if (aborted_) return;
  // Any bucket's: one taken at the target may commit the next step before one that was being updated.
  if (or_next_ && !commit.loaded && commit.step == *target_ + 1) MoveOn();
  if (taken_[commit.bucket]) return;
  if (commit.loaded) {  // the client rewrote the state: what was taken belongs to another history
    aborted_ = "a state load (load_state_dict) replaced the job's state during the snapshot";
    ready_.notify_all();
    return;
  }
  if (target_ && commit.step != *target_) {
    if (commit.step < *target_) return;  // it gets there later
    aborted_ = fmt::format("bucket {} went from a step before {} to step {} without committing {}", commit.bucket,
                           *target_, commit.step, *target_);
    ready_.notify_all();
    return;
  }
  copies_.push_back(Copy(commit.bucket, commit.step));
  taken_[commit.bucket] = 1;
  if (hparams_.empty() && commit.hparams != nullptr) hparams_.assign(commit.hparams, commit.hparams + num_groups_);
  ready_.notify_all();
}

CapturedBucket SnapshotCapture::Copy(uint32_t bucket, uint64_t step) const {
  CapturedBucket copy{.bucket = bucket, .step = step, .bytes = {}, .steps = {}};
  size_t bytes = 0;
  for (uint32_t p : layout_.buckets[bucket].params) {
    const ParamStateRef param = state_.Param(p);
    bytes += param.master.size_bytes() + param.exp_avg.size() + param.exp_avg_sq.size();
  }
  copy.bytes.resize(bytes);
  std::byte* out = copy.bytes.data();
  for (uint32_t p : layout_.buckets[bucket].params) {
    const ParamStateRef param = state_.Param(p);
    out = static_cast<std::byte*>(std::memcpy(out, param.master.data(), param.master.size_bytes())) +
          param.master.size_bytes();
    out = static_cast<std::byte*>(std::memcpy(out, param.exp_avg.data(), param.exp_avg.size())) + param.exp_avg.size();
    out = static_cast<std::byte*>(std::memcpy(out, param.exp_avg_sq.data(), param.exp_avg_sq.size())) +
          param.exp_avg_sq.size();
    copy.steps.push_back(static_cast<int64_t>(param.step));
  }
  return copy;
}

void SnapshotCapture::MoveOn() {
  target_ = *target_ + 1;
  or_next_ = false;
  std::fill(taken_.begin(), taken_.end(), 0);
  copies_.clear();
  handed_ = 0;
  hparams_.clear();
}

void SnapshotCapture::TakeAsIs() {
  std::lock_guard lock(mutex_);
  target_.reset();
  or_next_ = false;
}

void SnapshotCapture::Abort(const std::string& reason) {
  std::lock_guard lock(mutex_);
  if (!aborted_) aborted_ = reason;
  ready_.notify_all();
}

std::optional<CapturedBucket> SnapshotCapture::Next(std::chrono::milliseconds wait) {
  std::unique_lock lock(mutex_);
  ready_.wait_for(lock, wait, [this] { return aborted_ || !copies_.empty(); });
  if (aborted_) Throw(Code::kAborted, "{}", *aborted_);
  if (copies_.empty()) return std::nullopt;
  CapturedBucket copy = std::move(copies_.front());
  copies_.pop_front();
  ++handed_;
  return copy;
}

bool SnapshotCapture::collected() {
  std::lock_guard lock(mutex_);
  return std::all_of(taken_.begin(), taken_.end(), [](uint8_t taken) { return taken != 0; });
}

bool SnapshotCapture::complete() {
  std::lock_guard lock(mutex_);
  return handed_ == taken_.size();
}

std::optional<uint64_t> SnapshotCapture::target() {
  std::lock_guard lock(mutex_);
  return target_;
}

std::vector<shm::HParams> SnapshotCapture::hparams() {
  std::lock_guard lock(mutex_);
  return hparams_;
}

}  // namespace trainstream::daemon
