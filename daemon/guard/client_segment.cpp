#include "daemon/guard/client_segment.h"

#include <fmt/format.h>

#include <utility>

namespace trainstream::daemon {

ClientSegment::ClientSegment(shm::Segment segment, uint32_t owner)
    : segment_(std::move(segment)), guard_(segment_.data(), segment_.size()), owner_(owner) {}

ClientSegment& ClientSegment::operator=(ClientSegment&& other) noexcept {
  if (this != &other) {
    guard_ = GuardedRange();
    segment_ = std::move(other.segment_);
    guard_ = std::move(other.guard_);
    owner_ = other.owner_;
  }
  return *this;
}

ClientSegment ClientSegment::Create(const std::string& name, size_t bytes, uint32_t owner,
                                    const std::vector<shm::Segment::Range>& unbacked) {
  return {shm::Segment::Create(name, bytes, owner, unbacked), owner};
}

ClientSegment ClientSegment::Open(const std::string& name, uint32_t owner) {
  return {shm::Segment::Open(name), owner};
}

std::string ClientSegment::LostMessage() const {
  return fmt::format("shared memory segment {} was truncated by its owner (uid {}) while trainstreamd used it", name(),
                     owner_);
}

}  // namespace trainstream::daemon
