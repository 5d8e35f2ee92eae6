// Named shared-memory segments (POSIX shm under /dev/shm, through Boost.Interprocess).
//
// Names: "trainstream.<uid>.<job_key>.<part>" (SegmentName). The uid in the name lets an operator see
// whose memory a segment is; the job key is random, so a daemon restarted next to stale segments never
// collides with them. Segments are created 0600 for the creating uid; nobody else may map them.
// A Segment unmaps on destruction; only Remove() (or RemoveOnDestroy) unlinks the name.
#pragma once

#include <boost/interprocess/mapped_region.hpp>
#include <boost/interprocess/shared_memory_object.hpp>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace trainstream::shm {

std::string SegmentName(uint32_t uid, const std::string& job_key, const std::string& part);

// Bytes free for new segments in /dev/shm (0 if it cannot say).
uint64_t AvailableInDevShm();

class Segment {
 public:
  Segment() = default;
  Segment(Segment&&) noexcept;
  Segment& operator=(Segment&&) noexcept;
  ~Segment();

  // Creates a new zero-filled segment of `bytes`; fails if the name exists, and with
  // kResourceExhausted where /dev/shm has less room. Every page is backed now, so that /dev/shm filling
  // up later cannot make the first touch of a page there a SIGBUS, except the pages inside `unbacked`:
  // a segment whose pages must be first touched by the threads of their NUMA node leaves all of it
  // (allocation places a page on the allocating thread's node), and a new job's state leaves the regions
  // its first client fills while it frees the model's own copy (the master weights it seeds, a LoRA
  // base's frozen weights): both whole at once would not fit beside each other for a model near the
  // host's memory. With `owner_uid`, the segment is given to that uid (a root daemon creating a job's
  // memory for its user).
  struct Range {
    size_t offset = 0;
    size_t bytes = 0;
  };
  static Segment Create(const std::string& name, size_t bytes, std::optional<uint32_t> owner_uid = std::nullopt,
                        const std::vector<Range>& unbacked = {});
  // Maps an existing segment read/write; fails with kNotFound if missing, kPermissionDenied if the
  // caller may not open it.
  static Segment Open(const std::string& name);
  // Unlinks the name (mappings stay valid). Returns false if it did not exist.
  static bool Remove(const std::string& name);
  static bool Exists(const std::string& name);

  [[nodiscard]] void* data() const { return region_.get_address(); }
  [[nodiscard]] size_t size() const { return region_.get_size(); }
  [[nodiscard]] const std::string& name() const { return name_; }
  [[nodiscard]] bool valid() const { return data() != nullptr; }
  // Unlink the name when this object is destroyed (the daemon owns what it created).
  void RemoveOnDestroy() { remove_on_destroy_ = true; }

 private:
  std::string name_;
  boost::interprocess::mapped_region region_;
  bool remove_on_destroy_ = false;
};

}  // namespace trainstream::shm
