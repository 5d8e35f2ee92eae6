#include "daemon/control/restores_in_progress.h"

#include "shm/error.h"

namespace trainstream::daemon {

RestoresInProgress::Entry::Entry(RestoresInProgress& restores, uint32_t uid) : restores_(restores), uid_(uid) {
  std::lock_guard lock(restores.mutex_);
  const uint32_t mine = restores.per_uid_.contains(uid) ? restores.per_uid_.at(uid) : 0;
  TS_CHECK(mine < kMaxPerUid, Code::kResourceExhausted,
           "uid {} has a restore under way already (at most {} per uid at once); try again when it has ended", uid,
           kMaxPerUid);
  TS_CHECK(restores.total_ < kMaxTotal, Code::kResourceExhausted,
           "{} restores are under way (at most {} at once); try again when one has ended", restores.total_, kMaxTotal);
  ++restores.per_uid_[uid];
  ++restores.total_;
}

RestoresInProgress::Entry::~Entry() {
  std::lock_guard lock(restores_.mutex_);
  --restores_.total_;
  if (--restores_.per_uid_[uid_] == 0) restores_.per_uid_.erase(uid_);
}

}  // namespace trainstream::daemon
