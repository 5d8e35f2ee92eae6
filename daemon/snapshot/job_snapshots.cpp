#include "daemon/snapshot/job_snapshots.h"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <filesystem>

#include "daemon/counters/counters.h"
#include "daemon/snapshot/file_identity.h"
#include "shm/error.h"

namespace trainstream::daemon {

JobSnapshots::JobSnapshots(SnapshotMeta identity, const shm::StateView& state, const shm::JobLayout& layout,
                           SnapshotSchedule schedule)
    : identity_(std::move(identity)),
      state_(state),
      layout_(layout),
      committed_(state_, layout_, identity_.spec),
      schedule_(std::move(schedule)) {}

JobSnapshots::~JobSnapshots() {
  Stop();
}

void JobSnapshots::Connect(SnapshotHooks hooks) {
  hooks_ = std::move(hooks);
}

void JobSnapshots::Stop() {
  std::thread periodic;
  {
    std::lock_guard lock(mutex_);
    stopped_ = true;
    if (active_) active_->Abort(fmt::format("job '{}' was removed", identity_.job));
    periodic.swap(periodic_);
  }
  if (periodic.joinable()) periodic.join();
}

std::string JobSnapshots::PathIn(const std::string& dir, const std::string& job, uint32_t uid) {
  std::string name;
  for (size_t i = 0; i < job.size(); ++i) {
    const auto c = static_cast<unsigned char>(job[i]);
    const bool plain = std::isalnum(c) != 0 || c == '_' || c == '-' || (c == '.' && i > 0);
    name += plain ? std::string(1, static_cast<char>(c)) : fmt::format("%{:02X}", c);
  }
  return (std::filesystem::path(dir) / fmt::format("{}.uid{}.safetensors", name, uid)).string();
}

void JobSnapshots::OnCommit(const Commit& commit) {
  std::lock_guard lock(mutex_);
  if (stopped_) return;
  if (!active_) return MaybeStartPeriodic(commit);
  active_->OnCommit(commit);
  if (active_->collected()) active_.reset();  // its writer goes on alone: the next one may start
}

void JobSnapshots::MaybeStartPeriodic(const Commit& commit) {
  if (schedule_.every == 0 || schedule_.dir.empty() || commit.loaded || commit.announced ||
      commit.step % schedule_.every != 0 || commit.step <= last_periodic_step_) {
    return;
  }
  if (periodic_writers_ >= 2) return;                      // the disk is behind: one more waits already
  for (uint32_t b = 0; b < layout_.buckets.size(); ++b) {  // the first commit of the step, or too late
    if (b != commit.bucket && committed_.BucketStep(b) >= commit.step) return;
  }
  last_periodic_step_ = commit.step;
  ++periodic_writers_;
  auto capture = std::make_shared<SnapshotCapture>(committed_, layout_, identity_.spec.num_groups, commit.step);
  capture->OnCommit(commit);
  if (!capture->collected()) active_ = capture;
  // After the previous periodic writer, so that the files are renamed into place in step order.
  periodic_ = std::thread([this, capture, previous = std::move(periodic_)]() mutable {
    if (previous.joinable()) previous.join();
    WritePeriodic(capture);
  });
}

WaitPolicy JobSnapshots::TakeAsIsWhenIdle(SnapshotCapture& capture,
                                          std::optional<std::chrono::steady_clock::time_point> deadline) {
  return [this, &capture, deadline, as_is = !capture.target().has_value()]() mutable {
    if (!as_is && hooks_.attached_ranks() == 0) {  // it stopped training before the boundary
      capture.TakeAsIs();
      hooks_.announce();
      as_is = true;
    }
    TS_CHECK(!deadline || std::chrono::steady_clock::now() < *deadline, Code::kUnavailable,
             "job '{}' did not reach its next step boundary (step {}) in time; its ranks may be stalled", identity_.job,
             capture.target().value_or(0));
  };
}

void JobSnapshots::Finish(const std::shared_ptr<SnapshotCapture>& capture,
                          const std::optional<SnapshotWritten>& written) {
  std::lock_guard lock(mutex_);
  if (active_ == capture) active_.reset();  // it failed before every bucket was copied
  if (written) last_ = written;
}

SnapshotWritten JobSnapshots::Take(const std::string& path, uint32_t caller_uid,
                                   std::chrono::steady_clock::time_point deadline) {
  TS_CHECK(state_.header->initialized != 0, Code::kFailedPrecondition,
           "job '{}' holds no weights yet (its first rank has not loaded them)", identity_.job);
  TS_CHECK(!path.empty() || !schedule_.dir.empty(), Code::kInvalidArgument,
           "no snapshot path given, and trainstreamd has no --snapshot-dir to put it in");
  std::shared_ptr<SnapshotCapture> capture;
  bool idle = false, between_steps = false;
  {
    std::lock_guard lock(mutex_);
    TS_CHECK(!stopped_, Code::kAborted, "job '{}' was removed", identity_.job);
    TS_CHECK(!active_, Code::kUnavailable, "a snapshot of job '{}' is being taken already; try again later",
             identity_.job);
    idle = hooks_.attached_ranks() == 0;
    uint64_t latest = 0, earliest = UINT64_MAX;  // no bucket is past latest: every one commits latest + 1 next
    for (uint32_t b = 0; b < layout_.buckets.size(); ++b) {
      latest = std::max(latest, committed_.BucketStep(b));
      earliest = std::min(earliest, committed_.BucketStep(b));
    }
    // Every bucket holds the same step: taken at once as the engine announces them, unless one turns out
    // to be under way (the capture then moves on to the next step). A trainer that is attached but
    // between steps (evaluating, checkpointing, waiting for data) may not step again for a long while.
    between_steps = !idle && earliest == latest;
    const std::optional<uint64_t> target =
        idle ? std::nullopt : std::optional<uint64_t>(between_steps ? latest : latest + 1);
    capture = std::make_shared<SnapshotCapture>(committed_, layout_, identity_.spec.num_groups, target, between_steps);
    active_ = capture;
  }
  if (idle || between_steps) {
    spdlog::info("job '{}': snapshot of its current state requested ({})", identity_.job,
                 idle ? "no rank is attached"
                      : fmt::format("every bucket holds step {}; the next one if a bucket is being updated",
                                    *capture->target()));
    hooks_.announce();
  } else {
    spdlog::info("job '{}': snapshot at its next step boundary (step {}) requested", identity_.job, *capture->target());
  }
  try {
    const FileIdentity as_caller(caller_uid);
    SnapshotWritten written = WriteSnapshot(identity_, committed_, *capture,
                                            path.empty() ? PathIn(schedule_.dir, identity_.job, identity_.uid) : path,
                                            std::nullopt, TakeAsIsWhenIdle(*capture, deadline));
    Finish(capture, written);
    spdlog::info("job '{}': snapshot of step {} written to {} ({} bytes)", identity_.job, written.step, written.path,
                 written.bytes);
    return written;
  } catch (...) {
    Finish(capture, std::nullopt);
    ProcessCounters::Instance().CountError(ErrorKind::kSnapshot);
    throw;
  }
}

void JobSnapshots::WritePeriodic(const std::shared_ptr<SnapshotCapture>& capture) {
  std::optional<SnapshotWritten> written;
  try {
    const std::optional<uint32_t> owner = geteuid() == 0 ? std::optional(identity_.uid) : std::nullopt;
    written = WriteSnapshot(identity_, committed_, *capture, PathIn(schedule_.dir, identity_.job, identity_.uid), owner,
                            TakeAsIsWhenIdle(*capture, std::nullopt));
    spdlog::info("job '{}': periodic snapshot of step {} written to {}", identity_.job, written->step, written->path);
  } catch (const std::exception& e) {
    ProcessCounters::Instance().CountError(ErrorKind::kSnapshot);
    spdlog::warn("job '{}': periodic snapshot failed: {}", identity_.job, e.what());
  }
  Finish(capture, written);
  std::lock_guard lock(mutex_);
  --periodic_writers_;
}

std::optional<SnapshotWritten> JobSnapshots::last() {
  std::lock_guard lock(mutex_);
  return last_;
}

}  // namespace trainstream::daemon
