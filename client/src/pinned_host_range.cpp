// PinnedHostRange: host memory page-locked for the GPUs through the driver (shm/cuda_driver.h), in the
// primary context that the CUDA runtime, and so torch, uses. Registering backed memory runs at 16-25
// GiB/s on the GPU machine, memory not yet backed at about 2 GiB/s (32 GiB in 18.6 s: the driver
// faults the pages in first; benchmarks/results/paging.md), so callers register only what copies
// touch, and may do it on several threads: the constructor holds no lock of ours.
#include "shm/cuda_driver.h"
#include "trainstream/client.h"

namespace trainstream {

PinnedHostRange::PinnedHostRange(int device_ordinal, uint64_t address, size_t bytes)
    : address_(address), bytes_(bytes) {
  const cuda::CudaDriver& driver = cuda::CudaDriver::Get();
  context_ = std::make_unique<cuda::PrimaryContext>(driver, driver.DeviceAt(device_ordinal));
  cuda::ScopedContext scope(driver, context_->get());
  // NOLINTNEXTLINE(performance-no-int-to-ptr): the address comes from Python as an integer
  void* host = reinterpret_cast<void*>(address_);
  driver.Check(driver.cuMemHostRegister(host, bytes_, cuda::kMemHostRegisterPortable),
               fmt::format("page-locking {} bytes of host memory (cuMemHostRegister)", bytes_).c_str());
}

PinnedHostRange::~PinnedHostRange() {
  const cuda::CudaDriver& driver = cuda::CudaDriver::Get();
  // NOLINTNEXTLINE(performance-no-int-to-ptr)
  void* host = reinterpret_cast<void*>(address_);
  cuda::ReleaseInContext(driver, context_->get(), [&] { driver.cuMemHostUnregister(host); });
}

}  // namespace trainstream
