// Files a client names (a snapshot to write, one to restore) are opened with that client's file
// permissions, not the daemon's: a root daemon must not let a user overwrite or read what the user
// could not. While a FileIdentity lives, the calling thread's filesystem uid and gid (setfsuid,
// setfsgid) and its supplementary groups are the client's, which also drops root's override of file
// permissions for this thread. All three are per thread in the kernel; glibc's setgroups() would
// apply the groups to every thread of the daemon, so they are set by the raw system call.
//
// The client's groups are those of its account (its passwd entry's group and getgrouplist), not those
// of the process that connected: SO_PEERCRED gives only the uid, gid and pid, and reading the pid's
// /proc/<pid>/status races with that process exiting and its pid being reused. The account's groups
// are what the user gets at any login, so they grant nothing the user could not reach anyway. A uid
// with no passwd entry gets the overflow group 65534 and no other.
//
// Invariant: the thread never acts as the client with a group the client's account lacks (issue 46:
// a container's root, in group 0, read 0640 root:root files for another uid). Where the groups cannot
// be set (a user namespace that denies setgroups) the switch is refused, unless the daemon's own
// groups are among the client's.
#pragma once

#include <sys/types.h>
#include <cstdint>
#include <optional>
#include <vector>

namespace trainstream::daemon {

class FileIdentity {
 public:
  // Acts as `uid` on this thread. Nothing changes when the daemon is not root or `uid` is root.
  // kInternal if the thread cannot take the identity (nothing changed then).
  explicit FileIdentity(uint32_t uid);
  ~FileIdentity();  // back to the daemon's identity
  FileIdentity(const FileIdentity&) = delete;
  FileIdentity& operator=(const FileIdentity&) = delete;

 private:
  void Restore() noexcept;

  bool switched_ = false;
  uid_t previous_uid_ = 0;
  gid_t previous_gid_ = 0;
  std::optional<std::vector<gid_t>> previous_groups_;  // nullopt: the groups were left as they were
};

}  // namespace trainstream::daemon
