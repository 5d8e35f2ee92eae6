// GpuBuffer: device memory from the driver (shm/cuda_driver.h), in the primary context that the CUDA
// runtime, and so torch, uses for the device; each call makes that context current only for itself.
#include "shm/cuda_driver.h"
#include "trainstream/client.h"

namespace trainstream {

GpuBuffer::GpuBuffer(int device_ordinal, size_t bytes) : bytes_(bytes) {
  const cuda::CudaDriver& driver = cuda::CudaDriver::Get();
  context_ = std::make_unique<cuda::PrimaryContext>(driver, driver.DeviceAt(device_ordinal));
  cuda::ScopedContext scope(driver, context_->get());
  cuda::CUdeviceptr address = 0;
  driver.Check(driver.cuMemAlloc(&address, bytes_ == 0 ? 1 : bytes_),
               fmt::format("allocating {} bytes on GPU {} (cuMemAlloc)", bytes_, device_ordinal).c_str());
  address_ = address;
}

GpuBuffer::~GpuBuffer() {
  const cuda::CudaDriver& driver = cuda::CudaDriver::Get();
  cuda::ReleaseInContext(driver, context_->get(), [&] { driver.cuMemFree(address_); });
}

std::string GpuBuffer::ipc_handle() const {
  const cuda::CudaDriver& driver = cuda::CudaDriver::Get();
  cuda::ScopedContext scope(driver, context_->get());
  cuda::CUipcMemHandle handle{};
  driver.Check(driver.cuIpcGetMemHandle(&handle, address_), "cuIpcGetMemHandle");
  return {handle.reserved, sizeof(handle.reserved)};
}

}  // namespace trainstream
