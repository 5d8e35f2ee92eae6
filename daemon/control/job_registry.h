// All jobs of the daemon, by owner and name: create-or-attach, quotas, idle expiry, shutdown, and the
// jobs a dead daemon left behind (orphans: re-adopted by the first attach with their name and layout,
// dropped like idle jobs after the TTL).
//
// Quotas: max_jobs and max_host_bytes over all jobs; max_jobs_per_uid and max_host_bytes_per_uid over
// the jobs of one uid, root's exempt (root's jobs count toward the global limits only). A job counts
// toward its owner's, also when root restores it for that owner.
//
// Job names are per uid: two users may each have a job "run1", and neither can reach the other's.
// Multi-node jobs are the exception: the daemons of a job address it by name alone on the peer plane,
// so a multi-node job's name is unique among the multi-node jobs of the daemon.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "daemon/config.h"
#include "daemon/control/job.h"
#include "daemon/engine/worker_pool.h"

namespace trainstream::daemon {

class JobRegistry {
 public:
  JobRegistry(const Config& config, WorkerPool& pool, PeerConfig peer_config = {})
      : config_(config), pool_(pool), peer_config_(std::move(peer_config)) {}

  struct Found {
    std::shared_ptr<Job> job;
    bool created = false;
  };
  // `uid`'s job called `name`, created from `request` if it does not exist (or re-adopted, if an orphan
  // of that uid has the name). An existing job must have an identical layout (kInvalidArgument naming
  // the difference). What the request leaves to the daemon (state_halves 0, speculation kAuto) an
  // existing job or an orphan answers with its own; a new job gets two state halves where memory allows
  // (they need at most 3/4 of the bytes free in /dev/shm and of what is left of max_host_bytes; the
  // choice is logged with its numbers), and speculative clipping where it has two halves and clips. The
  // job's spec() holds what was decided.
  Found FindOrCreate(const std::string& name, uint32_t uid, const shm::LayoutSpec& request, uint64_t seed);
  // Removes `uid`'s job `name`; kFailedPrecondition if ranks are attached and not `force` (their
  // sessions fail).
  void Drop(const std::string& name, uint32_t uid, bool force);
  // `uid`'s job called `name` (a snapshot); kNotFound, or kFailedPrecondition for a job a dead daemon
  // left that no rank has re-adopted yet.
  std::shared_ptr<Job> Get(const std::string& name, uint32_t uid);
  // Creates job `name`, owned by `owner`, from a snapshot of its layout: the next attach with that
  // layout resumes it. kAlreadyExists if a job (or an orphan) of `owner` has the name; quotas as for a
  // new job.
  std::shared_ptr<Job> Restore(const std::string& name, uint32_t owner, const SnapshotFile& snapshot);
  std::vector<std::shared_ptr<Job>> Jobs();
  // Drops jobs idle for longer than the TTL. Returns how many.
  size_t ExpireIdle();
  // Drops the jobs whose owner truncated one of their segments under the daemon (Job::Lost): their
  // sessions have failed saying so, and their segments are removed. Returns how many.
  size_t DropLost();
  // Fails every session and drops every job.
  void Shutdown(const std::string& reason);
  // Claims the jobs of daemons that died (daemon/control/orphaned_jobs.h). Returns how many.
  size_t ClaimOrphans();
  std::vector<OrphanedJob> Orphans();  // claimed, not re-adopted yet
  [[nodiscard]] const Config& config() const { return config_; }

 private:
  using JobId = std::pair<uint32_t, std::string>;  // owner uid, name
  // A new job of `uid`: its state halves and speculation, decided where `request` leaves them open.
  // Requires mutex_.
  [[nodiscard]] shm::LayoutSpec Decide(const std::string& name, uint32_t uid, shm::LayoutSpec request) const;
  struct Usage {
    uint64_t jobs = 0;
    uint64_t host_bytes = 0;
  };
  [[nodiscard]] Usage UsageOf(std::optional<uint32_t> uid) const;  // of all jobs, or of `uid`'s (requires mutex_)
  // A byte limit a new job of some uid must fit in: max_host_bytes, and max_host_bytes_per_uid for a uid
  // other than root; only those that are set (requires mutex_).
  struct HostQuota {
    const char* key;  // the config key
    uint64_t limit;
    uint64_t used;
    std::string by;  // "" or " by uid <U>", for the message
    [[nodiscard]] uint64_t left() const { return limit - std::min(used, limit); }
  };
  [[nodiscard]] std::vector<HostQuota> HostQuotasOf(uint32_t uid) const;
  // The daemon_socket word its jobs carry: its socket's hash, or PrivateDaemonSocket() (orphaned_jobs.h).
  [[nodiscard]] uint64_t SocketWord() const;
  // A new job of `uid` with this layout fits in max_jobs and max_host_bytes, and (but for root) in
  // max_jobs_per_uid and max_host_bytes_per_uid; a multi-node one's name is free among the multi-node
  // jobs (requires mutex_).
  void CheckRoomFor(const std::string& name, uint32_t uid, const shm::LayoutSpec& spec, const shm::JobLayout& layout);
  [[nodiscard]] SnapshotSchedule Schedule() const { return {config_.snapshot_dir, config_.snapshot_every}; }

  const Config& config_;
  WorkerPool& pool_;
  const PeerConfig peer_config_;
  std::mutex mutex_;
  std::map<JobId, std::shared_ptr<Job>> jobs_;
  std::map<JobId, OrphanedJob> orphans_;
  std::chrono::steady_clock::time_point orphans_claimed_;
};

}  // namespace trainstream::daemon
