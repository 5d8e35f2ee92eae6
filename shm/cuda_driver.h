// The CUDA driver API, loaded at run time with dlopen("libcuda.so.1"): neither the daemon nor the
// client has a build or run dependency on CUDA. A process without a driver gets a clear error from
// CudaDriver::Get() and goes on without the CUDA IPC transport.
//
// Only what the CUDA IPC transport needs is declared here, with the driver's ABI types. Every call goes
// through Check(), which turns a failed CUresult into a trainstream::Error naming the call and the
// driver's own description.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

namespace trainstream::cuda {

using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;  // NOLINT(google-runtime-int): the driver's ABI type
using CUcontext = struct CUctx_st*;
using CUstream = struct CUstream_st*;
using CUevent = struct CUevent_st*;
struct CUipcMemHandle {
  char reserved[64];
};
struct CUipcEventHandle {
  char reserved[64];
};
struct CUuuid {
  char bytes[16];
};
constexpr size_t kIpcHandleBytes = 64;
constexpr size_t kUuidBytes = 16;

constexpr CUresult kErrorNotReady = 600;  // CUDA_ERROR_NOT_READY: cuEventQuery's "not yet"
constexpr unsigned kStreamNonBlocking = 0x1;
constexpr unsigned kEventBlockingSync = 0x1;
constexpr unsigned kEventDisableTiming = 0x2;
constexpr unsigned kEventInterprocess = 0x4;
constexpr unsigned kIpcMemLazyEnablePeerAccess = 0x1;
constexpr unsigned kMemHostRegisterPortable = 0x1;
constexpr unsigned kMemHostAllocPortable = 0x1;
constexpr unsigned kMemHostAllocDeviceMap = 0x2;
constexpr unsigned kStreamWaitValueGeq = 0x0;  // (int32_t)(*address - value) >= 0: a cyclic greater-or-equal

struct CudaDriver {
  // The process's driver, loaded and initialized (cuInit) once. Throws kUnavailable, saying why, when
  // there is no usable driver.
  static const CudaDriver& Get();

  // Throws an Error "<what>: <driver's error name>: <description>" unless `result` is success.
  void Check(CUresult result, const char* what) const;
  // The device at `ordinal` among those this process can see.
  [[nodiscard]] CUdevice DeviceAt(int ordinal) const;
  // The device whose UUID is `uuid` (16 raw bytes), among those this process can see.
  [[nodiscard]] CUdevice DeviceByUuid(const std::string& uuid) const;

  CUresult (*cuInit)(unsigned flags) = nullptr;
  CUresult (*cuGetErrorName)(CUresult, const char**) = nullptr;
  CUresult (*cuGetErrorString)(CUresult, const char**) = nullptr;
  CUresult (*cuDeviceGetCount)(int*) = nullptr;
  CUresult (*cuDeviceGet)(CUdevice*, int ordinal) = nullptr;
  CUresult (*cuDeviceGetUuid)(CUuuid*, CUdevice) = nullptr;
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*cuDevicePrimaryCtxRelease)(CUdevice) = nullptr;
  CUresult (*cuCtxSetCurrent)(CUcontext) = nullptr;
  CUresult (*cuCtxPushCurrent)(CUcontext) = nullptr;
  CUresult (*cuCtxPopCurrent)(CUcontext*) = nullptr;
  CUresult (*cuStreamCreate)(CUstream*, unsigned flags) = nullptr;
  CUresult (*cuStreamDestroy)(CUstream) = nullptr;
  CUresult (*cuEventCreate)(CUevent*, unsigned flags) = nullptr;
  CUresult (*cuEventDestroy)(CUevent) = nullptr;
  CUresult (*cuEventRecord)(CUevent, CUstream) = nullptr;
  CUresult (*cuEventSynchronize)(CUevent) = nullptr;
  CUresult (*cuEventQuery)(CUevent) = nullptr;
  CUresult (*cuMemAlloc)(CUdeviceptr*, size_t) = nullptr;
  CUresult (*cuMemFree)(CUdeviceptr) = nullptr;
  CUresult (*cuMemcpyDtoHAsync)(void*, CUdeviceptr, size_t, CUstream) = nullptr;
  CUresult (*cuMemcpyHtoDAsync)(CUdeviceptr, const void*, size_t, CUstream) = nullptr;
  CUresult (*cuMemHostRegister)(void*, size_t, unsigned flags) = nullptr;
  CUresult (*cuMemHostUnregister)(void*) = nullptr;
  CUresult (*cuMemHostAlloc)(void**, size_t, unsigned flags) = nullptr;
  CUresult (*cuMemFreeHost)(void*) = nullptr;
  CUresult (*cuMemHostGetDevicePointer)(CUdeviceptr*, void*, unsigned flags) = nullptr;
  CUresult (*cuStreamWaitValue32)(CUstream, CUdeviceptr, uint32_t value, unsigned flags) = nullptr;
  CUresult (*cuIpcGetMemHandle)(CUipcMemHandle*, CUdeviceptr) = nullptr;
  CUresult (*cuIpcOpenMemHandle)(CUdeviceptr*, CUipcMemHandle, unsigned flags) = nullptr;
  CUresult (*cuIpcCloseMemHandle)(CUdeviceptr) = nullptr;
  CUresult (*cuIpcGetEventHandle)(CUipcEventHandle*, CUevent) = nullptr;
  CUresult (*cuIpcOpenEventHandle)(CUevent*, CUipcEventHandle) = nullptr;
};

// Makes `context` current on this thread for the scope, restoring the previous one after (the thread
// may belong to torch, whose own notion of the current device must not change).
class ScopedContext {
 public:
  ScopedContext(const CudaDriver& driver, CUcontext context);
  ~ScopedContext();
  ScopedContext(const ScopedContext&) = delete;
  ScopedContext& operator=(const ScopedContext&) = delete;

 private:
  const CudaDriver& driver_;
};

// For destructors, where nothing may throw: runs `release` with `context` current and restores the
// previous one; skips it when the context cannot be made current (the driver is going away with the
// process, and the resources with it).
template <typename Release>
void ReleaseInContext(const CudaDriver& driver, CUcontext context, Release&& release) noexcept {
  if (driver.cuCtxPushCurrent(context) != 0) return;
  std::forward<Release>(release)();
  CUcontext popped = nullptr;
  driver.cuCtxPopCurrent(&popped);
}

// A device's primary context (the one the CUDA runtime, and so torch, uses), retained while this lives.
class PrimaryContext {
 public:
  PrimaryContext(const CudaDriver& driver, CUdevice device);
  ~PrimaryContext();
  PrimaryContext(const PrimaryContext&) = delete;
  PrimaryContext& operator=(const PrimaryContext&) = delete;
  [[nodiscard]] CUcontext get() const { return context_; }
  [[nodiscard]] CUdevice device() const { return device_; }

 private:
  const CudaDriver& driver_;
  CUdevice device_;
  CUcontext context_ = nullptr;
};

}  // namespace trainstream::cuda
