#include "shm/cuda_driver.h"

#include <dlfcn.h>

#include <cstring>
#include <mutex>

#include "shm/error.h"

namespace trainstream::cuda {

namespace {

template <typename Function>
void Load(void* library, const char* name, Function* slot) {
  void* symbol = dlsym(library, name);
  TS_CHECK(symbol != nullptr, Code::kUnavailable, "the CUDA driver (libcuda.so.1) lacks {}: too old?", name);
  *slot = reinterpret_cast<Function>(symbol);  // NOLINT(cppcoreguidelines-pro-type-reinterpret-cast)
}

// The versioned names are those of the current ABI (the unversioned ones are kept for old binaries).
CudaDriver LoadDriver() {
  void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  TS_CHECK(library != nullptr, Code::kUnavailable, "no CUDA driver: {}", dlerror());
  CudaDriver d;
  Load(library, "cuInit", &d.cuInit);
  Load(library, "cuGetErrorName", &d.cuGetErrorName);
  Load(library, "cuGetErrorString", &d.cuGetErrorString);
  Load(library, "cuDeviceGetCount", &d.cuDeviceGetCount);
  Load(library, "cuDeviceGet", &d.cuDeviceGet);
  Load(library, "cuDeviceGetUuid_v2", &d.cuDeviceGetUuid);
  Load(library, "cuDevicePrimaryCtxRetain", &d.cuDevicePrimaryCtxRetain);
  Load(library, "cuDevicePrimaryCtxRelease_v2", &d.cuDevicePrimaryCtxRelease);
  Load(library, "cuCtxSetCurrent", &d.cuCtxSetCurrent);
  Load(library, "cuCtxPushCurrent_v2", &d.cuCtxPushCurrent);
  Load(library, "cuCtxPopCurrent_v2", &d.cuCtxPopCurrent);
  Load(library, "cuStreamCreate", &d.cuStreamCreate);
  Load(library, "cuStreamDestroy_v2", &d.cuStreamDestroy);
  Load(library, "cuEventCreate", &d.cuEventCreate);
  Load(library, "cuEventDestroy_v2", &d.cuEventDestroy);
  Load(library, "cuEventRecord", &d.cuEventRecord);
  Load(library, "cuEventSynchronize", &d.cuEventSynchronize);
  Load(library, "cuEventQuery", &d.cuEventQuery);
  Load(library, "cuMemAlloc_v2", &d.cuMemAlloc);
  Load(library, "cuMemFree_v2", &d.cuMemFree);
  Load(library, "cuMemcpyDtoHAsync_v2", &d.cuMemcpyDtoHAsync);
  Load(library, "cuMemcpyHtoDAsync_v2", &d.cuMemcpyHtoDAsync);
  Load(library, "cuMemHostRegister_v2", &d.cuMemHostRegister);
  Load(library, "cuMemHostUnregister", &d.cuMemHostUnregister);
  Load(library, "cuMemHostAlloc", &d.cuMemHostAlloc);
  Load(library, "cuMemFreeHost", &d.cuMemFreeHost);
  Load(library, "cuMemHostGetDevicePointer_v2", &d.cuMemHostGetDevicePointer);
  Load(library, "cuStreamWaitValue32_v2", &d.cuStreamWaitValue32);
  Load(library, "cuIpcGetMemHandle", &d.cuIpcGetMemHandle);
  Load(library, "cuIpcOpenMemHandle_v2", &d.cuIpcOpenMemHandle);
  Load(library, "cuIpcCloseMemHandle", &d.cuIpcCloseMemHandle);
  Load(library, "cuIpcGetEventHandle", &d.cuIpcGetEventHandle);
  Load(library, "cuIpcOpenEventHandle", &d.cuIpcOpenEventHandle);
  d.Check(d.cuInit(0), "cuInit");
  return d;
}

}  // namespace

const CudaDriver& CudaDriver::Get() {
  // Loaded once; a failure is remembered and repeated to every caller.
  static std::once_flag once;
  static CudaDriver driver;
  static std::string failure;
  std::call_once(once, [] {
    try {
      driver = LoadDriver();
    } catch (const Error& e) {
      failure = e.what();
    }
  });
  TS_CHECK(failure.empty(), Code::kUnavailable, "{}", failure);
  return driver;
}

void CudaDriver::Check(CUresult result, const char* what) const {
  if (result == 0) return;
  const char* name = "unknown error";
  const char* description = "";
  if (cuGetErrorName != nullptr) cuGetErrorName(result, &name);
  if (cuGetErrorString != nullptr) cuGetErrorString(result, &description);
  Throw(Code::kInternal, "{}: {} ({})", what, name != nullptr ? name : "?", description != nullptr ? description : "");
}

CUdevice CudaDriver::DeviceAt(int ordinal) const {
  CUdevice device = 0;
  Check(cuDeviceGet(&device, ordinal), "cuDeviceGet");
  return device;
}

CUdevice CudaDriver::DeviceByUuid(const std::string& uuid) const {
  TS_CHECK(uuid.size() == kUuidBytes, Code::kInvalidArgument, "a device UUID has {} bytes, not {}", kUuidBytes,
           uuid.size());
  int count = 0;
  Check(cuDeviceGetCount(&count), "cuDeviceGetCount");
  for (int ordinal = 0; ordinal < count; ++ordinal) {
    const CUdevice device = DeviceAt(ordinal);
    CUuuid id{};
    Check(cuDeviceGetUuid(&id, device), "cuDeviceGetUuid");
    if (std::memcmp(id.bytes, uuid.data(), kUuidBytes) == 0) return device;
  }
  Throw(Code::kNotFound, "none of the {} GPU(s) this process sees has the trainer's UUID (CUDA_VISIBLE_DEVICES?)",
        count);
}

ScopedContext::ScopedContext(const CudaDriver& driver, CUcontext context) : driver_(driver) {
  driver_.Check(driver_.cuCtxPushCurrent(context), "cuCtxPushCurrent");
}

ScopedContext::~ScopedContext() {
  CUcontext popped = nullptr;
  driver_.cuCtxPopCurrent(&popped);
}

PrimaryContext::PrimaryContext(const CudaDriver& driver, CUdevice device) : driver_(driver), device_(device) {
  driver_.Check(driver_.cuDevicePrimaryCtxRetain(&context_, device), "cuDevicePrimaryCtxRetain");
}

PrimaryContext::~PrimaryContext() {
  driver_.cuDevicePrimaryCtxRelease(device_);
}

}  // namespace trainstream::cuda
