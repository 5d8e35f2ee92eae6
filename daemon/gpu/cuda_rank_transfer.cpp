#include "daemon/gpu/cuda_rank_transfer.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "daemon/gpu/pinned_host.h"
#include "shm/error.h"

namespace trainstream::daemon {

namespace {

constexpr size_t kMaxEvents = 64;
constexpr uint64_t kSlotAlignment = 256;  // pieces of a bucket start at multiples of the slot size

template <typename Handle>
Handle HandleFrom(const std::string& bytes, const char* what) {
  TS_CHECK(bytes.size() == sizeof(Handle), Code::kInvalidArgument, "{}: an IPC handle has {} bytes, not {}", what,
           sizeof(Handle), bytes.size());
  Handle handle{};
  std::memcpy(handle.reserved, bytes.data(), sizeof(Handle));
  return handle;
}

// Where each bucket lies in the rank's parameter buffer (nullopt: off the GPU), checked to fit it
// without overlapping: by default at its offset in the rank's gradient region.
std::vector<std::optional<uint64_t>> ParamOffsets(const shm::CudaIpcExport& exported, const shm::JobLayout& layout) {
  std::vector<std::optional<uint64_t>> offsets;
  if (exported.param_offsets.empty()) {
    TS_CHECK(exported.params_bytes >= layout.grad_bytes, Code::kInvalidArgument,
             "cuda-ipc: the parameter buffer has {} bytes, the job's buckets need {}", exported.params_bytes,
             layout.grad_bytes);
    for (const shm::BucketLayout& bucket : layout.buckets) {
      offsets.push_back(bucket.grads_in_upload ? std::nullopt : std::optional<uint64_t>(bucket.grad_offset));
    }
    return offsets;
  }
  TS_CHECK(exported.param_offsets.size() == layout.buckets.size(), Code::kInvalidArgument,
           "cuda-ipc: {} parameter-buffer offsets for the job's {} buckets", exported.param_offsets.size(),
           layout.buckets.size());
  std::vector<std::pair<uint64_t, uint64_t>> taken;  // [begin, end) of each bucket on the GPU
  for (size_t b = 0; b < layout.buckets.size(); ++b) {
    const uint64_t offset = exported.param_offsets[b];
    if (offset == shm::kNotOnGpu) {
      offsets.emplace_back(std::nullopt);
      continue;
    }
    const uint64_t bytes = layout.buckets[b].bytes();
    TS_CHECK(offset % shm::kAlign == 0 && offset <= exported.params_bytes && bytes <= exported.params_bytes - offset,
             Code::kInvalidArgument,
             "cuda-ipc: bucket {} ({} bytes) at offset {} of a {}-byte parameter buffer; it must fit, {}-byte aligned",
             b, bytes, offset, exported.params_bytes, shm::kAlign);
    taken.emplace_back(offset, offset + bytes);
    offsets.emplace_back(offset);
  }
  std::sort(taken.begin(), taken.end());
  for (size_t i = 1; i < taken.size(); ++i) {
    TS_CHECK(taken[i - 1].second <= taken[i].first, Code::kInvalidArgument,
             "cuda-ipc: buckets overlap in the parameter buffer at offset {}", taken[i].first);
  }
  return offsets;
}

void CheckFits(const shm::CudaIpcExport& exported) {
  TS_CHECK(exported.slot_bytes >= kSlotAlignment && exported.slot_bytes % kSlotAlignment == 0, Code::kInvalidArgument,
           "cuda-ipc: staging slots of {} bytes; a positive multiple of {} is needed", exported.slot_bytes,
           kSlotAlignment);
  const size_t slots = exported.grad_ready_events.size();
  TS_CHECK(slots >= 1 && slots <= kMaxEvents, Code::kInvalidArgument,
           "cuda-ipc: {} staging slots (grad-ready events); 1 to {} are allowed", slots, kMaxEvents);
  const size_t wanted = exported.weights_wanted_events.size();
  TS_CHECK(wanted >= 1 && wanted <= kMaxEvents, Code::kInvalidArgument,
           "cuda-ipc: {} weights-wanted events; 1 to {} are allowed", wanted, kMaxEvents);
}

// `done`, after adding a successful copy's bytes to `counter` (or counting the failure).
Done Counted(std::atomic<uint64_t>& counter, size_t bytes, Done done) {
  return [&counter, bytes, done = std::move(done)](std::optional<Error> error) {
    if (error) {
      ProcessCounters::Instance().CountError(ErrorKind::kGpuCopy);
    } else {
      counter.fetch_add(bytes, std::memory_order_relaxed);
    }
    done(std::move(error));
  };
}

}  // namespace

std::shared_ptr<CudaRankTransfer> CudaRankTransfer::Open(const shm::CudaIpcExport& exported,
                                                         const shm::JobLayout& layout) {
  CheckFits(exported);
  auto offsets = ParamOffsets(exported, layout);
  return std::shared_ptr<CudaRankTransfer>(
      new CudaRankTransfer(GpuDevices::Instance().Get(exported.device_uuid), exported, std::move(offsets)));
}

CudaRankTransfer::CudaRankTransfer(std::shared_ptr<GpuDevice> gpu, const shm::CudaIpcExport& exported,
                                   std::vector<std::optional<uint64_t>> offsets)
    : gpu_(std::move(gpu)),
      params_bytes_(exported.params_bytes),
      slot_bytes_(exported.slot_bytes),
      offsets_(std::move(offsets)) {
  const cuda::CudaDriver& d = driver();
  cuda::ScopedContext scope(d, gpu_->context.get());
  try {
    d.Check(d.cuIpcOpenMemHandle(&params_, HandleFrom<cuda::CUipcMemHandle>(exported.params_handle, "parameters"),
                                 cuda::kIpcMemLazyEnablePeerAccess),
            "opening the parameter buffer's IPC handle (cuIpcOpenMemHandle)");
    d.Check(d.cuIpcOpenMemHandle(&staging_, HandleFrom<cuda::CUipcMemHandle>(exported.staging_handle, "staging"),
                                 cuda::kIpcMemLazyEnablePeerAccess),
            "opening the staging slots' IPC handle (cuIpcOpenMemHandle)");
    auto open_events = [&d](const std::vector<std::string>& handles, std::vector<cuda::CUevent>& opened) {
      for (const std::string& bytes : handles) {
        cuda::CUevent event = nullptr;
        d.Check(d.cuIpcOpenEventHandle(&event, HandleFrom<cuda::CUipcEventHandle>(bytes, "event")),
                "opening an interprocess event (cuIpcOpenEventHandle)");
        opened.push_back(event);  // as it opens: Close() below must see every one
      }
    };
    open_events(exported.grad_ready_events, grad_ready_);
    open_events(exported.weights_wanted_events, weights_wanted_);
  } catch (...) {
    Close();  // what was opened so far
    throw;
  }
}

CudaRankTransfer::~CudaRankTransfer() {
  StopPinAhead();
  Close();
}

void CudaRankTransfer::Close() noexcept {
  const cuda::CudaDriver& d = driver();
  cuda::ReleaseInContext(d, gpu_->context.get(), [&] {
    for (cuda::CUevent event : grad_ready_) d.cuEventDestroy(event);
    for (cuda::CUevent event : weights_wanted_) d.cuEventDestroy(event);
    grad_ready_.clear();
    weights_wanted_.clear();
    if (params_ != 0) d.cuIpcCloseMemHandle(std::exchange(params_, 0));
    if (staging_ != 0) d.cuIpcCloseMemHandle(std::exchange(staging_, 0));
  });
}

void CudaRankTransfer::PullGradients(uint32_t slot, void* host, size_t bytes, Done done) {
  TS_CHECK(slot < grad_ready_.size() && bytes <= slot_bytes_, Code::kInvalidArgument,
           "pull of {} bytes from staging slot {} ({} slots of {} bytes)", bytes, slot, grad_ready_.size(),
           slot_bytes_);
  gpu_->to_host.Submit(
      [self = shared_from_this(), slot, host, bytes](cuda::CUstream stream) {
        const cuda::CudaDriver& d = self->driver();
        const cuda::CUdeviceptr source = self->staging_ + slot * self->slot_bytes_;
        for (const HostRange& part : PinnedHost::Instance().Ensure(host, bytes)) {
          const size_t offset = part.data - static_cast<std::byte*>(host);
          d.Check(d.cuMemcpyDtoHAsync(part.data, source + offset, part.bytes, stream), "copying gradients to the host");
        }
      },
      Counted(gpu_->counters->to_host_bytes, bytes, std::move(done)), GateOn(grad_ready_[slot]));
}

void CudaRankTransfer::AwaitWeightsWanted(uint32_t event, Done done) {
  TS_CHECK(event < weights_wanted_.size(), Code::kInvalidArgument, "weights-wanted event {} of {}", event,
           weights_wanted_.size());
  gpu_->to_device.Submit([](cuda::CUstream) {}, std::move(done), GateOn(weights_wanted_[event]));
}

void CudaRankTransfer::PushWeights(uint64_t offset, const void* host, size_t bytes, Done done) {
  TS_CHECK(offset + bytes <= params_bytes_, Code::kInvalidArgument,
           "push of {} bytes at offset {} beyond the parameter buffer ({} bytes)", bytes, offset, params_bytes_);
  gpu_->to_device.Submit(
      [self = shared_from_this(), offset, host, bytes](cuda::CUstream stream) {
        const cuda::CudaDriver& d = self->driver();
        for (const HostRange& part : PinnedHost::Instance().Ensure(host, bytes)) {
          const size_t at = part.data - static_cast<const std::byte*>(host);
          d.Check(d.cuMemcpyHtoDAsync(self->params_ + offset + at, part.data, part.bytes, stream),
                  "copying weights to the GPU");
        }
      },
      Counted(gpu_->counters->to_device_bytes, bytes, std::move(done)), GateOn(nullptr));
}

void CudaRankTransfer::WillCopy(std::vector<HostRange> ranges) {
  std::lock_guard lock(pin_ahead_mutex_);
  if (!abandoned_ && pin_ahead_ == nullptr) pin_ahead_ = std::make_unique<PinAhead>(gpu_, std::move(ranges));
}

void CudaRankTransfer::Abandon() {
  abandoned_ = true;
  StopPinAhead();
}

void CudaRankTransfer::StopPinAhead() {
  std::lock_guard lock(pin_ahead_mutex_);
  if (pin_ahead_) pin_ahead_->Stop();
}

void CudaRankTransfer::ReleaseHost(const void* base, size_t bytes) {
  StopPinAhead();  // before the memory it may be registering goes
  PinnedHost::Instance().Release(base, bytes);
}

CopyQueue::Gate CudaRankTransfer::GateOn(cuda::CUevent event) {
  return [self = shared_from_this(), event] {
    TS_CHECK(!self->abandoned_, Code::kUnavailable, "the rank detached before its GPU work was ready");
    if (event == nullptr) return true;
    const cuda::CudaDriver& d = self->driver();
    const cuda::CUresult result = d.cuEventQuery(event);
    if (result == cuda::kErrorNotReady) return false;
    d.Check(result, "waiting for a rank's interprocess event (cuEventQuery)");
    return true;
  };
}

}  // namespace trainstream::daemon
