#include "daemon/control/unattached_sessions.h"

#include "shm/error.h"

namespace trainstream::daemon {

UnattachedSessions::Entry::Entry(UnattachedSessions& sessions, uint32_t uid) : sessions_(&sessions), uid_(uid) {
  sessions.Enter(uid);
}

void UnattachedSessions::Enter(uint32_t uid) {
  std::lock_guard lock(mutex_);
  auto found = per_uid_.find(uid);
  const uint32_t mine = found == per_uid_.end() ? 0 : found->second;
  if (mine >= max_per_uid_ || total_ >= max_total_) {
    TS_CHECK(mine < max_per_uid_, Code::kResourceExhausted,
             "too many sessions not attached yet: uid {} has {} of max_unattached_sessions_per_uid={}", uid, mine,
             max_per_uid_);
    Throw(Code::kResourceExhausted, "too many sessions not attached yet: {} of max_unattached_sessions={}", total_,
          max_total_);
  }
  ++per_uid_[uid];
  ++total_;
}

void UnattachedSessions::Entry::Leave() {
  if (sessions_ != nullptr) sessions_->Release(uid_);
  sessions_ = nullptr;
}

void UnattachedSessions::Release(uint32_t uid) {
  std::lock_guard lock(mutex_);
  --total_;
  if (--per_uid_[uid] == 0) per_uid_.erase(uid);
}

}  // namespace trainstream::daemon
