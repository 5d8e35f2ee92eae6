// The GPUs this daemon copies to and from, each opened the first time a cuda-ipc rank names it (by
// UUID). A GPU's primary context costs about 0.5 GiB of its memory, so GPUs without such a rank get
// none. Each has one copy queue per direction, shared by every rank and job on it.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "daemon/counters/counters.h"
#include "daemon/gpu/copy_queue.h"
#include "shm/cuda_driver.h"

namespace trainstream::daemon {

struct GpuDevice {
  GpuDevice(const cuda::CudaDriver& driver, cuda::CUdevice device, const std::string& label);
  const cuda::CudaDriver& driver;
  cuda::PrimaryContext context;
  CopyQueue to_host;                // gradients
  CopyQueue to_device;              // weights
  GpuCounters* counters = nullptr;  // the bytes copied each way (ProcessCounters, "GPU-<uuid>")
};

class GpuDevices {
 public:
  static GpuDevices& Instance();
  // The GPU with this 16-byte UUID; throws kUnavailable without a driver, kNotFound if not visible.
  std::shared_ptr<GpuDevice> Get(const std::string& uuid);

 private:
  std::mutex mutex_;
  std::map<std::string, std::shared_ptr<GpuDevice>> devices_;
};

}  // namespace trainstream::daemon
