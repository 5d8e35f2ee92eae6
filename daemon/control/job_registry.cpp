#include "daemon/control/job_registry.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "daemon/counters/counters.h"
#include "shm/error.h"
#include "shm/segment.h"

namespace trainstream::daemon {

namespace {

// The first parameter that differs between two lists, if any ("parameter" or "frozen parameter").
std::optional<std::string> DescribeParamMismatch(const char* what, const std::vector<shm::ParamSpec>& have,
                                                 const std::vector<shm::ParamSpec>& want) {
  if (have.size() != want.size())
    return fmt::format("the job has {} {}s, this rank {}", have.size(), what, want.size());
  for (size_t i = 0; i < have.size(); ++i) {
    const auto& a = have[i];
    const auto& b = want[i];
    if (a.name != b.name || a.shape != b.shape || a.dtype != b.dtype || a.group != b.group ||
        a.partition != b.partition) {
      return fmt::format(
          "{} {} differs: job has '{}' {} {} group {} partition {}, this rank '{}' {} {} group {} "
          "partition {}",
          what, i, a.name, fmt::join(a.shape, "x"), NameOf(a.dtype), a.group, a.partition, b.name,
          fmt::join(b.shape, "x"), NameOf(b.dtype), b.group, b.partition);
    }
  }
  return std::nullopt;
}

// How a mismatching rank's error shows an option's value.
template <typename T>
std::string Shown(const T& value) {
  return fmt::format("{}", value);
}
std::string Shown(DType dtype) {
  return std::string(NameOf(dtype));
}
std::string Shown(shm::OptimizerKind optimizer) {
  return optimizer == shm::OptimizerKind::kAdam ? "Adam" : "AdamW";
}
std::string Shown(shm::Speculation speculation) {  // a job's is on or off
  return Shown(speculation == shm::Speculation::kOn);
}
std::string Shown(const std::vector<std::string>& peers) {
  return fmt::format("[{}]", fmt::join(peers, ", "));
}

// Every option of a spec, named and shown (shm::ForEachOption's order).
std::vector<std::pair<const char*, std::string>> ShownOptions(const shm::LayoutSpec& spec) {
  std::vector<std::pair<const char*, std::string>> options;
  shm::ForEachOption(spec,
                     [&options](const char* name, const auto& value) { options.emplace_back(name, Shown(value)); });
  return options;
}

// Names what differs between two layouts, for the error a mismatching rank gets.
std::string DescribeMismatch(const shm::LayoutSpec& have, const shm::LayoutSpec& want) {
  if (auto params = DescribeParamMismatch("parameter", have.params, want.params)) return *params;
  if (auto frozen = DescribeParamMismatch("frozen parameter", have.frozen, want.frozen)) return *frozen;
  const auto job = ShownOptions(have);
  const auto rank = ShownOptions(want);
  std::vector<std::string> differ;
  for (size_t i = 0; i < job.size(); ++i) {
    if (job[i].second != rank[i].second) {
      differ.push_back(fmt::format("{}: job {}, this rank {}", job[i].first, job[i].second, rank[i].second));
    }
  }
  return fmt::format("options differ ({})", fmt::join(differ, "; "));
}

// A request's state halves and speculation where it leaves them to the daemon (0, kAuto): those of the
// job it attaches to. A value it names stays, for the layout comparison to refuse if it differs.
shm::LayoutSpec Inherit(shm::LayoutSpec request, uint32_t state_halves, bool speculative_clipping) {
  if (request.state_halves == 0) request.state_halves = state_halves;
  if (request.speculative_clipping == shm::Speculation::kAuto) {
    request.speculative_clipping = speculative_clipping ? shm::Speculation::kOn : shm::Speculation::kOff;
  }
  return request;
}

void CheckJobName(const std::string& name) {
  TS_CHECK(!name.empty() && name.size() <= shm::kMaxJobName, Code::kInvalidArgument,
           "job name must have 1 to {} characters", shm::kMaxJobName);
}

}  // namespace

// A new job's state halves and speculation where the request leaves them open (see FindOrCreate).
shm::LayoutSpec JobRegistry::Decide(const std::string& name, uint32_t uid, shm::LayoutSpec request) const {
  if (request.state_halves == 0) {
    request.state_halves = 1;
    if (request.speculative_clipping == shm::Speculation::kOn) {
      request.state_halves = 2;  // asked for: the quota below decides whether it fits
    } else {
      shm::LayoutSpec two = request;
      two.state_halves = 2;
      two.speculative_clipping = shm::Speculation::kOff;
      const shm::JobLayout layout = shm::ComputeLayout(two);
      const uint64_t needed = layout.state_bytes + uint64_t{request.world_size} * layout.rank_bytes;
      const uint64_t shm_free = shm::AvailableInDevShm();
      const std::vector<HostQuota> quotas = HostQuotasOf(uid);
      const bool fits = needed <= shm_free / 4 * 3 && std::ranges::all_of(quotas, [&](const HostQuota& quota) {
                          return needed <= quota.left() / 4 * 3;
                        });
      request.state_halves = fits ? 2 : 1;
      std::string left;  // of each quota
      for (const HostQuota& quota : quotas) {
        left += fmt::format("{}{} bytes left of {}", left.empty() ? "" : ", ", quota.left(), quota.key);
      }
      spdlog::info(
          "job '{}': {} state {}: with two it needs {} bytes; {} bytes free in /dev/shm, {} (two halves "
          "when they need at most 3/4 of each)",
          name, request.state_halves, fits ? "halves" : "half", needed, shm_free,
          left.empty() ? "no max_host_bytes quota" : left);
    }
  }
  if (request.speculative_clipping == shm::Speculation::kAuto) {
    // A job with step terms may clip any step (its ranks' clip_grad_norm_ calls say which).
    const bool speculate = request.state_halves == 2 && (request.max_grad_norm > 0 || request.step_terms);
    request.speculative_clipping = speculate ? shm::Speculation::kOn : shm::Speculation::kOff;
  }
  return request;
}

JobRegistry::Found JobRegistry::FindOrCreate(const std::string& name, uint32_t uid, const shm::LayoutSpec& request,
                                             uint64_t seed) {
  CheckJobName(name);
  shm::ValidateRequest(request);
  const JobId id{uid, name};
  std::lock_guard lock(mutex_);
  if (auto it = jobs_.find(id); it != jobs_.end()) {
    const std::shared_ptr<Job>& job = it->second;
    const shm::LayoutSpec spec =
        Inherit(request, job->spec().state_halves, job->spec().speculative_clipping == shm::Speculation::kOn);
    TS_CHECK(job->layout().hash == shm::ComputeLayout(spec).hash, Code::kInvalidArgument,
             "layout mismatch for job '{}': {}", name, DescribeMismatch(job->spec(), spec));
    return {job, false};
  }
  auto orphan = orphans_.find(id);
  const shm::LayoutSpec spec = orphan != orphans_.end()
                                   ? Inherit(request, orphan->second.state_halves, orphan->second.speculative_clipping)
                                   : Decide(name, uid, request);
  const shm::JobLayout layout = shm::ComputeLayout(spec);  // validates the decided spec
  CheckRoomFor(name, uid, spec, layout);
  if (orphan != orphans_.end()) {
    TS_CHECK(orphan->second.layout_hash == layout.hash, Code::kInvalidArgument,
             "job '{}' was left by a trainstreamd that died, with another layout: drop it (drop_job) to start a new "
             "job of that name, or attach with its layout to resume it",
             name);
    std::shared_ptr<Job> job;
    try {
      job = std::make_shared<Job>(name, uid, spec, seed, pool_, peer_config_, &orphan->second, nullptr, Schedule(),
                                  config_.trace_dir);
    } catch (const Error&) {
      if (!shm::Segment::Exists(orphan->second.state_segment)) orphans_.erase(orphan);  // refused and removed
      throw;
    }
    orphans_.erase(orphan);
    jobs_.emplace(id, job);
    return {job, false};
  }
  auto job = std::make_shared<Job>(name, uid, spec, seed, pool_, peer_config_, nullptr, nullptr, Schedule(),
                                   config_.trace_dir);
  job->StampSocket(SocketWord());
  jobs_.emplace(id, job);
  return {job, true};
}

JobRegistry::Usage JobRegistry::UsageOf(std::optional<uint32_t> uid) const {
  Usage usage;
  for (const auto& [id, job] : jobs_) {
    if (uid && id.first != *uid) continue;
    ++usage.jobs;
    usage.host_bytes += job->host_bytes();
  }
  return usage;
}

std::vector<JobRegistry::HostQuota> JobRegistry::HostQuotasOf(uint32_t uid) const {
  std::vector<HostQuota> quotas;
  if (config_.max_host_bytes != 0) {
    quotas.push_back({"max_host_bytes", config_.max_host_bytes, UsageOf(std::nullopt).host_bytes, ""});
  }
  if (uid != 0 && config_.max_host_bytes_per_uid != 0) {
    quotas.push_back({"max_host_bytes_per_uid", config_.max_host_bytes_per_uid, UsageOf(uid).host_bytes,
                      fmt::format(" by uid {}", uid)});
  }
  return quotas;
}

void JobRegistry::CheckRoomFor(const std::string& name, uint32_t uid, const shm::LayoutSpec& spec,
                               const shm::JobLayout& layout) {
  TS_CHECK(jobs_.size() < config_.max_jobs, Code::kResourceExhausted, "job limit reached: {} of max_jobs={}",
           jobs_.size(), config_.max_jobs);
  if (uid != 0) {
    const uint64_t jobs = UsageOf(uid).jobs;
    TS_CHECK(jobs < MaxJobsPerUid(config_), Code::kResourceExhausted,
             "job limit of uid {} reached: {} of max_jobs_per_uid={} (drop one: trainstreamctl drop JOB; or raise "
             "max_jobs_per_uid)",
             uid, jobs, MaxJobsPerUid(config_));
  }
  const uint64_t needed = layout.state_bytes + uint64_t{spec.world_size} * layout.rank_bytes;
  for (const HostQuota& quota : HostQuotasOf(uid)) {
    TS_CHECK(quota.used + needed <= quota.limit, Code::kResourceExhausted,
             "host memory quota exceeded: job '{}' needs {} bytes{}, {} of {}={} in use{} (raise {})", name, needed,
             spec.state_halves == 2 ? " (two state halves)" : "", quota.used, quota.key, quota.limit, quota.by,
             quota.key);
  }
  if (spec.nodes() > 1) {
    for (const auto& [other, job] : jobs_) {
      TS_CHECK(other.second != name || job->spec().nodes() == 1, Code::kAlreadyExists,
               "job name '{}' is taken by a multi-node job of uid {}: the daemons of a multi-node job address it by "
               "name alone, so its name must be unique on this daemon; choose another name",
               name, other.first);
    }
  }
}

std::shared_ptr<Job> JobRegistry::Get(const std::string& name, uint32_t uid) {
  const JobId id{uid, name};
  std::lock_guard lock(mutex_);
  TS_CHECK(!orphans_.contains(id), Code::kFailedPrecondition,
           "job '{}' was left by a trainstreamd that died and is not re-adopted yet: attach a rank with its name and "
           "layout first",
           name);
  auto it = jobs_.find(id);
  TS_CHECK(it != jobs_.end(), Code::kNotFound, "uid {} has no job named '{}'", uid, name);
  return it->second;
}

std::shared_ptr<Job> JobRegistry::Restore(const std::string& name, uint32_t owner, const SnapshotFile& snapshot) {
  CheckJobName(name);
  const shm::LayoutSpec& spec = snapshot.meta().spec;
  const shm::JobLayout layout = shm::ComputeLayout(spec);
  const JobId id{owner, name};
  auto check_free = [&] {
    TS_CHECK(!jobs_.contains(id) && !orphans_.contains(id), Code::kAlreadyExists,
             "a job named '{}' exists already (uid {}): drop it first, or restore under another name", name, owner);
    CheckRoomFor(name, owner, spec, layout);
  };
  {
    std::lock_guard lock(mutex_);
    check_free();
  }
  // Filled outside the lock (a large state takes a while); the name is checked again before it counts.
  auto job = std::make_shared<Job>(name, owner, spec, snapshot.meta().seed, pool_, peer_config_, nullptr, &snapshot,
                                   Schedule(), config_.trace_dir);
  job->StampSocket(SocketWord());
  std::lock_guard lock(mutex_);
  check_free();
  jobs_.emplace(id, job);
  return job;
}

uint64_t JobRegistry::SocketWord() const {
  return config_.parent_pid != 0 ? PrivateDaemonSocket() : SocketHash(config_.socket);
}

size_t JobRegistry::ClaimOrphans() {
  std::lock_guard lock(mutex_);
  for (OrphanedJob& orphan : ClaimOrphanedJobs(SocketWord())) {
    JobId id{orphan.uid, orphan.name};
    if (jobs_.contains(id) || orphans_.contains(id)) {
      spdlog::warn("removing job '{}' (uid {}, step {}) left by a dead trainstreamd: another job has its name",
                   orphan.name, orphan.uid, orphan.completed_step);
      RemoveJobSegments(orphan.uid, orphan.key);
      continue;
    }
    spdlog::info(
        "job '{}' (uid {}, step {}) was left by a dead trainstreamd: kept for a rank that attaches with its "
        "name and layout, for up to {} s",
        orphan.name, orphan.uid, orphan.completed_step, config_.job_ttl_seconds);
    orphans_.emplace(std::move(id), std::move(orphan));
  }
  orphans_claimed_ = std::chrono::steady_clock::now();
  return orphans_.size();
}

std::vector<OrphanedJob> JobRegistry::Orphans() {
  std::lock_guard lock(mutex_);
  std::vector<OrphanedJob> orphans;
  for (const auto& [id, orphan] : orphans_) orphans.push_back(orphan);
  return orphans;
}

void JobRegistry::Drop(const std::string& name, uint32_t uid, bool force) {
  const JobId id{uid, name};
  std::shared_ptr<Job> job;
  {
    std::lock_guard lock(mutex_);
    if (auto orphan = orphans_.find(id); orphan != orphans_.end()) {
      RemoveJobSegments(orphan->second.uid, orphan->second.key);
      orphans_.erase(orphan);
      return;
    }
    auto it = jobs_.find(id);
    TS_CHECK(it != jobs_.end(), Code::kNotFound, "uid {} has no job named '{}'", uid, name);
    it->second->Close("it was dropped", force);
    it->second->Dropped();
    job = std::move(it->second);
    jobs_.erase(it);
  }
  job->FailAll(fmt::format("job '{}' was dropped", name));
}

std::vector<std::shared_ptr<Job>> JobRegistry::Jobs() {
  std::lock_guard lock(mutex_);
  std::vector<std::shared_ptr<Job>> jobs;
  for (auto& [_, job] : jobs_) jobs.push_back(job);
  return jobs;
}

size_t JobRegistry::ExpireIdle() {
  const auto now = std::chrono::steady_clock::now();
  const auto ttl = std::chrono::seconds(config_.job_ttl_seconds);
  std::vector<std::shared_ptr<Job>> expired;
  {
    std::lock_guard lock(mutex_);
    for (auto it = jobs_.begin(); it != jobs_.end();) {
      if (it->second->CloseIfIdle(ttl, "it was idle for the TTL")) {
        spdlog::info("job '{}' idle for over {} s: dropping it (uid {})", it->first.second, config_.job_ttl_seconds,
                     it->first.first);
        it->second->Dropped();
        expired.push_back(std::move(it->second));
        it = jobs_.erase(it);
      } else {
        ++it;
      }
    }
    if (!orphans_.empty() && now - orphans_claimed_ >= ttl) {
      for (const auto& [id, orphan] : orphans_) {
        spdlog::info("job '{}' left by a dead trainstreamd was not re-adopted within {} s: dropping it (uid {})",
                     id.second, config_.job_ttl_seconds, id.first);
        RemoveJobSegments(orphan.uid, orphan.key);
      }
      orphans_.clear();
    }
  }
  return expired.size();  // destroyed here, outside the lock
}

size_t JobRegistry::DropLost() {
  std::vector<std::pair<std::shared_ptr<Job>, std::string>> lost;
  {
    std::lock_guard lock(mutex_);
    for (auto it = jobs_.begin(); it != jobs_.end();) {
      if (auto why = it->second->Lost()) {
        it->second->Close(*why, /*force=*/true);
        it->second->Dropped();
        lost.emplace_back(std::move(it->second), std::move(*why));
        it = jobs_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (const auto& [job, why] : lost) {
    spdlog::warn("job '{}' (uid {}) dropped, its segments removed: {}", job->name(), job->uid(), why);
    ProcessCounters::Instance().CountError(ErrorKind::kTruncatedSegment);
  }
  return lost.size();  // destroyed here, outside the lock
}

void JobRegistry::Shutdown(const std::string& reason) {
  std::map<JobId, std::shared_ptr<Job>> jobs;
  {
    std::lock_guard lock(mutex_);
    jobs.swap(jobs_);
  }
  for (auto& [_, job] : jobs) {
    job->Close(reason, true);
    job->FailAll(reason);
  }
}

}  // namespace trainstream::daemon
