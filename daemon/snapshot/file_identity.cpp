#include "daemon/snapshot/file_identity.h"

#include <grp.h>
#include <pwd.h>
#include <sys/fsuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <utility>

#include "shm/error.h"

namespace trainstream::daemon {

namespace {

constexpr gid_t kOverflowGroup = 65534;  // no group permission of any real group

struct Account {
  gid_t gid = kOverflowGroup;
  std::vector<gid_t> groups;  // supplementary, the primary one included (as getgrouplist gives them)
};

Account AccountOf(uid_t uid) {
  std::vector<char> buffer(16384);
  passwd entry{};
  passwd* found = nullptr;
  if (getpwuid_r(uid, &entry, buffer.data(), buffer.size(), &found) != 0 || found == nullptr) return {};
  Account account{.gid = found->pw_gid, .groups = std::vector<gid_t>(32)};
  int count = static_cast<int>(account.groups.size());
  while (getgrouplist(found->pw_name, found->pw_gid, account.groups.data(), &count) == -1) {
    account.groups.resize(static_cast<size_t>(count));  // count is now the number it has
  }
  account.groups.resize(static_cast<size_t>(count));
  return account;
}

std::vector<gid_t> ThreadGroups() {
  std::vector<gid_t> groups(static_cast<size_t>(std::max(0, getgroups(0, nullptr))));
  const int count = getgroups(static_cast<int>(groups.size()), groups.data());
  groups.resize(static_cast<size_t>(std::max(0, count)));
  return groups;
}

// The calling thread's only: glibc's setgroups() broadcasts the change to every thread.
bool SetThreadGroups(const std::vector<gid_t>& groups) {
  return syscall(SYS_setgroups, groups.size(), groups.data()) == 0;
}

bool Among(const std::vector<gid_t>& groups, const Account& account) {
  return std::ranges::all_of(groups, [&](gid_t group) {
    return group == account.gid || std::ranges::find(account.groups, group) != account.groups.end();
  });
}

}  // namespace

FileIdentity::FileIdentity(uint32_t uid) {
  if (geteuid() != 0 || uid == 0) return;
  const Account account = AccountOf(uid);
  std::vector<gid_t> daemon_groups = ThreadGroups();
  if (SetThreadGroups(account.groups)) {
    previous_groups_ = std::move(daemon_groups);
  } else {
    const int error = errno;
    TS_CHECK(Among(daemon_groups, account), Code::kInternal,
             "cannot act as uid {} for file access: cannot set its groups ({}), and the daemon's groups [{}] are "
             "not all its",
             uid, std::strerror(error), fmt::join(daemon_groups, ", "));
  }
  previous_gid_ = static_cast<gid_t>(setfsgid(account.gid));
  previous_uid_ = static_cast<uid_t>(setfsuid(uid));
  switched_ = true;
  // setfsuid reports no error: the only check is asking again (-1 changes nothing).
  if (static_cast<uid_t>(setfsuid(static_cast<uid_t>(-1))) != uid ||
      static_cast<gid_t>(setfsgid(static_cast<gid_t>(-1))) != account.gid) {
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
  if (previous_groups_) SetThreadGroups(*std::exchange(previous_groups_, std::nullopt));
}

}  // namespace trainstream::daemon
