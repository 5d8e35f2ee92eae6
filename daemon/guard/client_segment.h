// A shared memory segment of a job, as the daemon maps it: a file its owner (the job's uid) may open
// read-write, and so truncate at any time. Mapped under the fault guard (daemon/guard/fault_guard.h)
// from the moment it is mapped until it is unmapped: the daemon never dies from an access to it, and
// lost() says whether one found its pages gone (they hold zeros since, private to the daemon).
//
// Invariant: the guard is registered before the daemon's first access (Create and Open only map and
// advise; backing a new segment reports a missing page as an error, never a SIGBUS) and released
// before the segment is unmapped (member order).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "daemon/guard/fault_guard.h"
#include "shm/segment.h"

namespace trainstream::daemon {

class ClientSegment {
 public:
  ClientSegment() = default;
  ClientSegment(ClientSegment&&) noexcept = default;
  ClientSegment& operator=(ClientSegment&& other) noexcept;  // unguards the old mapping before unmapping it
  // Guards the mapping of `segment`, whose file `owner` may truncate.
  ClientSegment(shm::Segment segment, uint32_t owner);
  // shm::Segment::Create / Open, guarded.
  static ClientSegment Create(const std::string& name, size_t bytes, uint32_t owner,
                              const std::vector<shm::Segment::Range>& unbacked = {});
  static ClientSegment Open(const std::string& name, uint32_t owner);

  [[nodiscard]] void* data() const { return segment_.data(); }
  [[nodiscard]] size_t size() const { return segment_.size(); }
  [[nodiscard]] const std::string& name() const { return segment_.name(); }
  [[nodiscard]] uint32_t owner() const { return owner_; }
  void RemoveOnDestroy() { segment_.RemoveOnDestroy(); }
  // Whether an access found pages of the segment gone (its owner truncated it).
  [[nodiscard]] bool lost() const { return guard_.lost(); }
  // Says so, for the job's sessions and the log: "shared memory segment <name> was truncated by its
  // owner (uid <owner>) while trainstreamd used it".
  [[nodiscard]] std::string LostMessage() const;

 private:
  shm::Segment segment_;
  GuardedRange guard_;  // after segment_: released before the segment is unmapped
  uint32_t owner_ = 0;
};

}  // namespace trainstream::daemon
