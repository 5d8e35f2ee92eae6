// Files a client names (a snapshot to write, one to restore) are opened with that client's file
// permissions, not the daemon's: a root daemon must not let a user overwrite or read what the user
// could not. While a FileIdentity lives, the calling thread's filesystem uid and gid (setfsuid,
// setfsgid: per thread on Linux) are the client's, which also drops root's override of file
// permissions for this thread. The daemon's supplementary groups still apply.
#pragma once

#include <sys/types.h>
#include <cstdint>

namespace trainstream::daemon {

class FileIdentity {
 public:
  // Acts as `uid` (with its primary group, or 65534 if the user is unknown) on this thread. Nothing
  // changes when the daemon is not root or `uid` is root.
  explicit FileIdentity(uint32_t uid);
  ~FileIdentity();  // back to the daemon's identity
  FileIdentity(const FileIdentity&) = delete;
  FileIdentity& operator=(const FileIdentity&) = delete;

 private:
  void Restore() noexcept;

  bool switched_ = false;
  uid_t previous_uid_ = 0;
  gid_t previous_gid_ = 0;
};

}  // namespace trainstream::daemon
