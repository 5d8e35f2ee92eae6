#include "daemon/snapshot/file_identity.h"

#include <pwd.h>
#include <sys/fsuid.h>
#include <unistd.h>

#include <utility>
#include <vector>

#include "shm/error.h"

namespace trainstream::daemon {

namespace {

gid_t PrimaryGroupOf(uid_t uid) {
  std::vector<char> buffer(16384);
  passwd entry{};
  passwd* found = nullptr;
  if (getpwuid_r(uid, &entry, buffer.data(), buffer.size(), &found) == 0 && found != nullptr) return found->pw_gid;
  return 65534;  // the overflow group: no group permission of any real group
}

}  // namespace

FileIdentity::FileIdentity(uint32_t uid) {
  if (geteuid() != 0 || uid == 0) return;
  const gid_t gid = PrimaryGroupOf(uid);
  previous_gid_ = static_cast<gid_t>(setfsgid(gid));
  previous_uid_ = static_cast<uid_t>(setfsuid(uid));
  switched_ = true;
  // setfsuid reports no error: the only check is asking again (-1 changes nothing).
  if (static_cast<uid_t>(setfsuid(static_cast<uid_t>(-1))) != uid ||
      static_cast<gid_t>(setfsgid(static_cast<gid_t>(-1))) != gid) {
    Restore();  // the destructor of a constructor that throws does not run
    Throw(Code::kInternal, "cannot act as uid {} for file access", uid);
  }
}

FileIdentity::~FileIdentity() {
  Restore();
}

void FileIdentity::Restore() noexcept {
  if (!std::exchange(switched_, false)) return;
  setfsuid(previous_uid_);
  setfsgid(previous_gid_);
}

}  // namespace trainstream::daemon
