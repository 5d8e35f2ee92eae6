// Session streams that have not attached yet, counted per uid and in total. Each holds a gRPC thread
// while the daemon waits for its first message, so a client opening thousands of them would drive
// the daemon to thousands of threads: past either cap a new one is refused (kResourceExhausted,
// naming the limit). Attached sessions are not counted (the job's world size bounds them).
#pragma once

#include <cstdint>
#include <map>
#include <mutex>

namespace trainstream::daemon {

class UnattachedSessions {
 public:
  UnattachedSessions(uint32_t max_total, uint32_t max_per_uid) : max_total_(max_total), max_per_uid_(max_per_uid) {}

  // Counts one unattached session of `uid` until it is destroyed (the session attached or ended);
  // kResourceExhausted if `uid` or everyone together is at the limit.
  class Entry {
   public:
    Entry(UnattachedSessions& sessions, uint32_t uid);
    ~Entry() { Leave(); }
    Entry(const Entry&) = delete;
    Entry& operator=(const Entry&) = delete;
    void Leave();  // early: the session attached

   private:
    UnattachedSessions* sessions_;
    uint32_t uid_;
  };

 private:
  void Enter(uint32_t uid);
  void Release(uint32_t uid);

  const uint32_t max_total_, max_per_uid_;
  std::mutex mutex_;
  uint32_t total_ = 0;
  std::map<uint32_t, uint32_t> per_uid_;
};

}  // namespace trainstream::daemon
