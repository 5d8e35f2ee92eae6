#include "daemon/gpu/gpu_devices.h"

#include <spdlog/spdlog.h>

namespace trainstream::daemon {

GpuDevice::GpuDevice(const cuda::CudaDriver& driver, cuda::CUdevice device, const std::string& label)
    : driver(driver),
      context(driver, device),
      to_host(driver, context.get(), label + " gradients"),
      to_device(driver, context.get(), label + " weights") {}

GpuDevices& GpuDevices::Instance() {
  static GpuDevices instance;
  return instance;
}

std::shared_ptr<GpuDevice> GpuDevices::Get(const std::string& uuid) {
  std::lock_guard lock(mutex_);
  auto found = devices_.find(uuid);
  if (found != devices_.end()) return found->second;
  const cuda::CudaDriver& driver = cuda::CudaDriver::Get();
  const cuda::CUdevice device = driver.DeviceByUuid(uuid);
  std::string hex;
  for (unsigned char c : uuid) hex += fmt::format("{:02x}", c);
  auto gpu = std::make_shared<GpuDevice>(driver, device, fmt::format("GPU {} (GPU-{})", device, hex));
  gpu->counters = &ProcessCounters::Instance().Gpu("GPU-" + hex);
  spdlog::info("opened GPU {} (GPU-{}) for cuda-ipc transfers", device, hex);
  devices_.emplace(uuid, gpu);
  return gpu;
}

}  // namespace trainstream::daemon
