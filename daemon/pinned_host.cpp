#include "daemon/pinned_host.h"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include "shm/cuda_driver.h"
#include "shm/error.h"

namespace trainstream::daemon {

namespace {
uintptr_t PageSize() {
  static const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  return page;
}
}  // namespace

PinnedHost& PinnedHost::Instance() {
  static PinnedHost instance;
  return instance;
}

void PinnedHost::Ensure(const void* data, size_t bytes) {
  if (bytes == 0) return;
  const uintptr_t page = PageSize();
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes + page - 1) / page * page;
  uintptr_t at = reinterpret_cast<uintptr_t>(data) / page * page;
  std::lock_guard lock(mutex_);
  if (warned_) return;  // registration was refused once: the driver will not do better now
  const cuda::CudaDriver& driver = cuda::CudaDriver::Get();
  while (at < end) {
    auto next = ranges_.upper_bound(at);
    if (next != ranges_.begin() && std::prev(next)->second > at) {  // `at` is inside a registered range
      at = std::prev(next)->second;
      continue;
    }
    const uintptr_t stop = next == ranges_.end() ? end : std::min(end, next->first);
    const cuda::CUresult result =
        driver.cuMemHostRegister(reinterpret_cast<void*>(at), stop - at, cuda::kMemHostRegisterPortable);
    if (result != 0) {
      warned_ = true;
      try {
        driver.Check(result, "cuMemHostRegister");
      } catch (const Error& e) {
        spdlog::warn("cannot page-lock {} bytes for GPU copies ({}); copies go through pageable memory", stop - at,
                     e.what());
      }
      return;
    }
    ranges_.emplace(at, stop);
    pinned_bytes_ += stop - at;
    at = stop;
  }
}

void PinnedHost::Release(const void* base, size_t bytes) {
  const auto first = reinterpret_cast<uintptr_t>(base);
  std::lock_guard lock(mutex_);
  auto it = ranges_.lower_bound(first);
  while (it != ranges_.end() && it->first < first + bytes) {
    cuda::CudaDriver::Get().cuMemHostUnregister(reinterpret_cast<void*>(it->first));
    pinned_bytes_ -= it->second - it->first;
    it = ranges_.erase(it);
  }
}

uint64_t PinnedHost::pinned_bytes() {
  std::lock_guard lock(mutex_);
  return pinned_bytes_;
}

}  // namespace trainstream::daemon
