// HostMappedWords: page-locked host words mapped into a device's primary context (the one the CUDA
// runtime, and so torch, uses). The GPU reads them over PCIe each time a stream's wait polls; the
// host's plain stores reach it without any call of ours.
#include <algorithm>
#include <cstring>

#include "shm/cuda_driver.h"
#include "trainstream/client.h"

namespace trainstream {

HostMappedWords::HostMappedWords(int device_ordinal, size_t count) : count_(count) {
  const cuda::CudaDriver& driver = cuda::CudaDriver::Get();
  context_ = std::make_unique<cuda::PrimaryContext>(driver, driver.DeviceAt(device_ordinal));
  cuda::ScopedContext scope(driver, context_->get());
  const size_t bytes = std::max<size_t>(count_, 1) * sizeof(uint32_t);
  void* host = nullptr;
  driver.Check(driver.cuMemHostAlloc(&host, bytes, cuda::kMemHostAllocPortable | cuda::kMemHostAllocDeviceMap),
               fmt::format("allocating {} mapped host bytes (cuMemHostAlloc)", bytes).c_str());
  std::memset(host, 0, bytes);
  words_ = static_cast<uint32_t*>(host);
  cuda::CUdeviceptr device_address = 0;
  const cuda::CUresult mapped = driver.cuMemHostGetDevicePointer(&device_address, host, 0);
  if (mapped != 0) driver.cuMemFreeHost(host);
  driver.Check(mapped, "cuMemHostGetDevicePointer");
  device_address_ = device_address;
}

HostMappedWords::~HostMappedWords() {
  const cuda::CudaDriver& driver = cuda::CudaDriver::Get();
  cuda::ReleaseInContext(driver, context_->get(), [&] { driver.cuMemFreeHost(words_); });
}

void HostMappedWords::QueueWait(uint64_t stream, size_t index, uint32_t value) const {
  TS_CHECK(index < count_, Code::kInvalidArgument, "word {} of {}", index, count_);
  const cuda::CudaDriver& driver = cuda::CudaDriver::Get();
  cuda::ScopedContext scope(driver, context_->get());
  // NOLINTNEXTLINE(performance-no-int-to-ptr): torch hands its stream over as an integer
  auto* cu_stream = reinterpret_cast<cuda::CUstream>(stream);
  driver.Check(driver.cuStreamWaitValue32(cu_stream, device_address_ + index * sizeof(uint32_t), value,
                                          cuda::kStreamWaitValueGeq),
               "queuing a stream's wait for a bucket's weights (cuStreamWaitValue32)");
}

}  // namespace trainstream
