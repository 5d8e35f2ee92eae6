// GpuBuffer: device memory from the driver (shm/cuda_driver.h), in the primary context that the CUDA
// runtime, and so torch, uses for the device; each call makes that context current only for itself.
#include "shm/cuda_driver.h"
#include "trainstream/client.h"

namespace trainstream {

namespace {
cuda::CUcontext PrimaryContextOf(const cuda::CudaDriver& driver, int ordinal) {
  cuda::CUdevice device = 0;
  driver.Check(driver.cuDeviceGet(&device, ordinal), "cuDeviceGet");
  cuda::CUcontext context = nullptr;
  driver.Check(driver.cuDevicePrimaryCtxRetain(&context, device), "cuDevicePrimaryCtxRetain");
  return context;
}
}  // namespace

GpuBuffer::GpuBuffer(int device_ordinal, size_t bytes) : device_ordinal_(device_ordinal), bytes_(bytes) {
  const cuda::CudaDriver& driver = cuda::CudaDriver::Get();
  context_ = PrimaryContextOf(driver, device_ordinal_);
  cuda::ScopedContext scope(driver, static_cast<cuda::CUcontext>(context_));
  cuda::CUdeviceptr address = 0;
  driver.Check(driver.cuMemAlloc(&address, bytes_ == 0 ? 1 : bytes_),
               fmt::format("allocating {} bytes on GPU {} (cuMemAlloc)", bytes_, device_ordinal_).c_str());
  address_ = address;
}

GpuBuffer::~GpuBuffer() {
  const cuda::CudaDriver& driver = cuda::CudaDriver::Get();
  if (driver.cuCtxPushCurrent(static_cast<cuda::CUcontext>(context_)) == 0) {
    driver.cuMemFree(address_);
    cuda::CUcontext popped = nullptr;
    driver.cuCtxPopCurrent(&popped);
  }
  cuda::CUdevice device = 0;
  driver.cuDeviceGet(&device, device_ordinal_);
  driver.cuDevicePrimaryCtxRelease(device);  // the retain of the constructor
}

std::string GpuBuffer::ipc_handle() const {
  const cuda::CudaDriver& driver = cuda::CudaDriver::Get();
  cuda::ScopedContext scope(driver, static_cast<cuda::CUcontext>(context_));
  cuda::CUipcMemHandle handle{};
  driver.Check(driver.cuIpcGetMemHandle(&handle, address_), "cuIpcGetMemHandle");
  return {handle.reserved, sizeof(handle.reserved)};
}

}  // namespace trainstream
