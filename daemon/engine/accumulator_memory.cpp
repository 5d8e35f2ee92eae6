#include "daemon/engine/accumulator_memory.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>

#include "shm/error.h"

namespace trainstream::daemon {

AccumulatorMemory::AccumulatorMemory(size_t elements) : bytes_(elements * sizeof(float)) {
  if (bytes_ == 0) return;
  void* mapped = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  int error = mapped == MAP_FAILED ? errno : 0;
  // Every page backed now: an overcommitted page that cannot be had later would kill the daemon (the OOM
  // killer) in the middle of an update instead of failing this step. MADV_POPULATE_WRITE reports what it
  // cannot back; kernels before 5.14 lack it (EINVAL), and the pages are touched instead.
  if (error == 0 && madvise(mapped, bytes_, MADV_POPULATE_WRITE) != 0) {
    if (errno == EINVAL) {
      std::memset(mapped, 0, bytes_);
    } else {
      error = errno;
      munmap(mapped, bytes_);
    }
  }
  TS_CHECK(error == 0, Code::kResourceExhausted,
           "cannot map {} bytes for the job's gradient accumulator (4 bytes a parameter, needed once a step sums "
           "several backward passes): {}",
           bytes_, std::strerror(error));
  data_ = static_cast<float*>(mapped);
}

AccumulatorMemory::~AccumulatorMemory() {
  if (data_ != nullptr) munmap(data_, bytes_);
}

}  // namespace trainstream::daemon
