#include "shm/segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <boost/interprocess/exceptions.hpp>
#include <boost/interprocess/permissions.hpp>
#include <cerrno>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>

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
constexpr size_t kPage = 4096;
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
[[noreturn]] void ThrowCannotBack(const std::string& name, size_t bytes, int error) {
  Throw(error == ENOSPC || error == EFBIG || error == ENOMEM || error == EFAULT ? Code::kResourceExhausted
                                                                                : Code::kInternal,
        "cannot reserve {} bytes for shared memory segment {} ({} bytes available in /dev/shm): {}", bytes, name,
        AvailableInDevShm(), std::strerror(error));
}

// A sparse segment that tmpfs cannot back later is found by whoever touches the missing page first,
// with a SIGBUS: the daemon, and every job with it. So the room is checked before anything is mapped.
void CheckRoom(const std::string& name, size_t bytes) {
  if (bytes != 0 && AvailableInDevShm() < bytes) ThrowCannotBack(name, bytes, ENOSPC);
}

// Asks for transparent huge pages on a mapping: a fault backs 2 MiB instead of 4 KiB. Faulting 4 KiB
// pages of /dev/shm was the attach phase of wrap() on the GPU machine (35-49 GiB in 12-24 s on 16
// threads, 2026-12-02). The kernel honours it where /dev/shm is mounted with huge=advise (or
// within_size, always; docs/operations.md); elsewhere it changes nothing. The policy is per mapping, so
// every process that maps a segment asks.
void AdviseHugePages(void* data, size_t bytes) {
  constexpr size_t kHugePage = size_t{2} << 20;
  if (bytes >= kHugePage) (void)madvise(data, bytes, MADV_HUGEPAGE);  // EINVAL: a kernel without THP; fine
}

// Backs every page of [begin, end) of a mapped segment now, on several threads. Zero-filling tmpfs
// pages ran at about 4.5 GiB/s on one thread on the GPU machine (8 GiB in 1.76 s), and posix_fallocate,
// one thread, took 9.5 s for the 45 GB of a 1.86B-parameter job (most of its wrap()); on 16 threads,
// with huge pages, 1.2-1.5 s.
// MADV_POPULATE_WRITE faults the pages in as writes would, but reports a page tmpfs cannot back as an
// error, not a SIGBUS. Kernels before 5.14 lack it (EINVAL): posix_fallocate does it there.
void Populate(std::byte* data, size_t begin, size_t end, int fd, const std::string& name) {
  constexpr size_t kPerThread = size_t{1} << 30;
  const size_t bytes = end - begin;
  const size_t threads =
      std::clamp<size_t>(bytes / kPerThread, 1, std::clamp<size_t>(std::thread::hardware_concurrency(), 1, 16));
  const size_t share = (bytes / threads + kPage - 1) / kPage * kPage;
  std::vector<int> errors(threads, 0);
  std::vector<std::thread> workers;
  for (size_t t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      const size_t from = std::min(end, begin + t * share), to = std::min(end, from + share);
      if (from < to && madvise(data + from, to - from, MADV_POPULATE_WRITE) != 0) errors[t] = errno;
    });
  }
  for (std::thread& worker : workers) worker.join();
  int error = 0;
  for (int e : errors) error = error != 0 ? error : e;
  if (error == EINVAL) error = posix_fallocate(fd, static_cast<off_t>(begin), static_cast<off_t>(bytes));
  if (error != 0) ThrowCannotBack(name, bytes, error);
}

// The page-aligned stretches of [0, bytes) outside `unbacked`: a page partly inside an unbacked range
// is backed.
std::vector<std::pair<size_t, size_t>> BackedStretches(size_t bytes, std::vector<Segment::Range> unbacked) {
  std::sort(unbacked.begin(), unbacked.end(), [](const auto& a, const auto& b) { return a.offset < b.offset; });
  std::vector<std::pair<size_t, size_t>> stretches;
  size_t at = 0;
  for (const Segment::Range& range : unbacked) {
    const size_t first = (range.offset + kPage - 1) / kPage * kPage;  // whole pages inside the range
    const size_t last = std::min(bytes, (range.offset + range.bytes) / kPage * kPage);
    if (first >= last) continue;
    if (at < first) stretches.emplace_back(at, first);
    at = std::max(at, last);
  }
  if (at < bytes) stretches.emplace_back(at, bytes);
  return stretches;
}
}  // namespace

Segment Segment::Create(const std::string& name, size_t bytes, std::optional<uint32_t> owner_uid,
                        const std::vector<Range>& unbacked) {
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
    // Not object.truncate(): newer Boost (1.83, the GPU machine's) backs the whole file there with
    // posix_fallocate on one thread, which left Populate's threads nothing to do (the 1.86B job's 45 GB
    // in 9.5 s) and backed the ranges meant to stay unbacked (the 10B job did not fit beside its model).
    if (ftruncate(object.get_mapping_handle().handle, static_cast<off_t>(bytes)) != 0) {
      Throw(errno == EFBIG || errno == EINVAL ? Code::kResourceExhausted : Code::kInternal,
            "cannot size shared memory segment {} to {} bytes: {}", name, bytes, std::strerror(errno));
    }
    CheckRoom(name, bytes);
    segment.region_ = bip::mapped_region(object, bip::read_write);
    AdviseHugePages(segment.data(), bytes);
    for (const auto& [begin, end] : BackedStretches(bytes, unbacked)) {
      Populate(static_cast<std::byte*>(segment.data()), begin, end, object.get_mapping_handle().handle, name);
    }
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
    AdviseHugePages(segment.data(), segment.size());
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

uint64_t AvailableInDevShm() {
  struct statvfs shm {};
  return statvfs("/dev/shm", &shm) == 0 ? uint64_t{shm.f_bavail} * shm.f_frsize : 0;
}

}  // namespace trainstream::shm
