// Restores under way, counted per uid and in total. A restore parses its snapshot's header (up to
// kMaxHeaderBytes of JSON, daemon/snapshot/safetensors.h, which takes several times that in memory
// while it is parsed) and copies its whole file: four restores at once of 44 MiB headers drove the
// daemon to 2.9 GB (issue 46). Past either cap a new one is refused (kResourceExhausted, naming the
// limit); it may be tried again once one has ended.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>

namespace trainstream::daemon {

class RestoresInProgress {
 public:
  // Two at once: a restore is bounded by the disk, so a third would not finish sooner; one per uid, so
  // that a user cannot hold every slot.
  static constexpr uint32_t kMaxTotal = 2;
  static constexpr uint32_t kMaxPerUid = 1;

  // Counts one restore of `uid` until it is destroyed; kResourceExhausted if `uid` or everyone
  // together is at the limit.
  class Entry {
   public:
    Entry(RestoresInProgress& restores, uint32_t uid);
    ~Entry();
    Entry(const Entry&) = delete;
    Entry& operator=(const Entry&) = delete;

   private:
    RestoresInProgress& restores_;
    uint32_t uid_;
  };

 private:
  std::mutex mutex_;
  uint32_t total_ = 0;
  std::map<uint32_t, uint32_t> per_uid_;
};

}  // namespace trainstream::daemon
