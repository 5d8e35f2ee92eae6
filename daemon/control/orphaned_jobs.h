// Jobs whose daemon died. Their segments stay in /dev/shm (the state holds weights, moments and
// per-bucket steps); a daemon started later on the same socket claims them and re-adopts a job when
// a rank attaches with its name and layout (daemon/control/job_registry.h). Other sockets' orphans (a test's
// daemon, a user's private daemon) are not its to take.
//
// Invariants: a job's state header names its owning daemon by one word (pid and start time), so a
// daemon never takes a live daemon's job (several daemons may share /dev/shm: a service and users'
// private ones), and two daemons started together cannot both claim one orphan (compare-and-swap
// on that word). Segments of another format or unreadable to this daemon's uid are left alone.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace trainstream::daemon {

// This process as a state header's owner word.
uint64_t SelfAsOwner();
// A state header's daemon_socket for a daemon listening on `socket_path`.
uint64_t SocketHash(const std::string& socket_path);

struct OrphanedJob {
  std::string name;
  uint32_t uid = 0;           // the state segment's owner: the job's user
  std::string key;            // as in its segment names, "trainstream.<uid>.<key>.<part>"
  std::string state_segment;  // its name
  uint64_t completed_step = 0;
  uint64_t layout_hash = 0;
  uint64_t state_bytes = 0;
  uint32_t state_halves = 1;  // the job's layout's (a rank that attaches asking the daemon to decide gets these)
  bool speculative_clipping = false;
};

// Claims every job in /dev/shm whose owning daemon, which listened on `socket_hash`'s socket, is gone.
std::vector<OrphanedJob> ClaimOrphanedJobs(uint64_t socket_hash);

// The daemon_socket word of a private daemon's jobs (trainstreamd --parent-pid, started by wrap()): its
// jobs end with it, so no daemon is its successor. A private daemon removes them when it stops; one
// that was killed leaves them behind, and the next daemon of any kind removes them at its start (a
// 10B job's 112 GiB on the GPU machine, after the kernel's OOM killer, made the next jobs fail to fit).
// The word names the pid namespace: only there does a dead owner's pid mean it is dead (containers
// that share /dev/shm each have their own).
uint64_t PrivateDaemonSocket();
// Removes every job in /dev/shm (of any uid this daemon may open) whose private daemon, of this pid
// namespace, is gone. Returns how many.
size_t RemoveDeadPrivateJobs();

// Unlinks every segment of the job (state and ranks).
void RemoveJobSegments(uint32_t uid, const std::string& key);

}  // namespace trainstream::daemon
