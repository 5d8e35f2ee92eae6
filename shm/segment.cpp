#include "shm/segment.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <boost/interprocess/exceptions.hpp>
#include <boost/interprocess/permissions.hpp>
#include <cerrno>
#include <cstring>
#include <utility>

#include "shm/error.h"

namespace bip = boost::interprocess;

namespace trainstream::shm {

std::string SegmentName(uint32_t uid, const std::string& job_key, const std::string& part) {
  return fmt::format("trainstream.{}.{}.{}", uid, job_key, part);
}

Segment::Segment(Segment&& other) noexcept
    : name_(std::move(other.name_)),
      region_(std::move(other.region_)),
      remove_on_destroy_(std::exchange(other.remove_on_destroy_, false)) {}

Segment& Segment::operator=(Segment&& other) noexcept {
  if (this != &other) {
    this->~Segment();
    new (this) Segment(std::move(other));
  }
  return *this;
}

Segment::~Segment() {
  if (remove_on_destroy_) Remove(name_);
}

namespace {
Code CodeOf(const bip::interprocess_exception& e) {
  switch (e.get_error_code()) {
    case bip::not_found_error: return Code::kNotFound;
    case bip::security_error: return Code::kPermissionDenied;
    case bip::already_exists_error: return Code::kAlreadyExists;
    case bip::out_of_space_error:
    case bip::out_of_memory_error: return Code::kResourceExhausted;
    default: return Code::kInternal;
  }
}
uint64_t AvailableInDevShm() {
  struct statvfs shm {};
  return statvfs("/dev/shm", &shm) == 0 ? uint64_t{shm.f_bavail} * shm.f_frsize : 0;
}

// A sparse segment that tmpfs cannot back later is found by whoever touches the missing page first,
// with a SIGBUS: the daemon, and every job with it. So the room is checked now, and with `reserve`
// every page is backed now.
void Back(int fd, const std::string& name, size_t bytes, bool reserve) {
  if (bytes == 0) return;
  int error = AvailableInDevShm() >= bytes ? 0 : ENOSPC;
  if (error == 0 && reserve) error = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  if (error == 0) return;
  Throw(error == ENOSPC || error == EFBIG ? Code::kResourceExhausted : Code::kInternal,
        "cannot reserve {} bytes for shared memory segment {} ({} bytes available in /dev/shm): {}", bytes, name,
        AvailableInDevShm(), std::strerror(error));
}
}  // namespace

Segment Segment::Create(const std::string& name, size_t bytes, std::optional<uint32_t> owner_uid, bool reserve) {
  Segment segment;
  segment.name_ = name;
  try {
    bip::permissions owner_only(S_IRUSR | S_IWUSR);
    bip::shared_memory_object object(bip::create_only, name.c_str(), bip::read_write, owner_only);
    segment.remove_on_destroy_ = true;  // until mapped successfully, a failure must not leave the name behind
    if (owner_uid && *owner_uid != geteuid()) {
      TS_CHECK(fchown(object.get_mapping_handle().handle, *owner_uid, static_cast<gid_t>(-1)) == 0,
               Code::kPermissionDenied, "cannot give segment {} to uid {}: {}", name, *owner_uid, std::strerror(errno));
    }
    object.truncate(static_cast<bip::offset_t>(bytes));
    Back(object.get_mapping_handle().handle, name, bytes, reserve);
    segment.region_ = bip::mapped_region(object, bip::read_write);
    segment.remove_on_destroy_ = false;
  } catch (const bip::interprocess_exception& e) {
    Throw(CodeOf(e), "cannot create shared memory segment {} of {} bytes: {}", name, bytes, e.what());
  }
  return segment;
}

Segment Segment::Open(const std::string& name) {
  Segment segment;
  segment.name_ = name;
  try {
    bip::shared_memory_object object(bip::open_only, name.c_str(), bip::read_write);
    segment.region_ = bip::mapped_region(object, bip::read_write);
  } catch (const bip::interprocess_exception& e) {
    Throw(CodeOf(e), "cannot open shared memory segment {}: {}", name, e.what());
  }
  return segment;
}

bool Segment::Remove(const std::string& name) {
  return bip::shared_memory_object::remove(name.c_str());
}

bool Segment::Exists(const std::string& name) {
  try {
    bip::shared_memory_object object(bip::open_only, name.c_str(), bip::read_only);
    return true;
  } catch (const bip::interprocess_exception&) {
    return false;
  }
}

}  // namespace trainstream::shm
