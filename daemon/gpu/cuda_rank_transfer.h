// The cuda-ipc transport of one rank: the rank's flat parameter buffer and gradient staging slots,
// opened from its IPC memory handles, and its interprocess events, all on the GPU it named by UUID.
// Copies run on that GPU's copy queues, each issued once the rank's event it depends on has completed
// (see CopyQueue: the GPU never waits on another process's event); the host side of every copy is
// page-locked (PinnedHost) in the background from WillCopy on (PinAhead), or by the copy if it comes
// first. The handles are closed when the last copy that uses them has finished and the rank is gone
// (owners hold a shared_ptr).
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "daemon/engine/rank_transfer.h"
#include "daemon/gpu/gpu_devices.h"
#include "daemon/gpu/pin_ahead.h"
#include "shm/cuda_ipc_export.h"
#include "shm/job_layout.h"

namespace trainstream::daemon {

class CudaRankTransfer final : public RankTransfer, public std::enable_shared_from_this<CudaRankTransfer> {
 public:
  // Validates `exported` against the job's layout, then opens its handles. Throws Error saying why it
  // cannot (no driver, GPU not visible, handles from another PID namespace, sizes that do not fit).
  static std::shared_ptr<CudaRankTransfer> Open(const shm::CudaIpcExport& exported, const shm::JobLayout& layout);
  ~CudaRankTransfer() override;

  [[nodiscard]] uint32_t staging_slots() const override { return static_cast<uint32_t>(grad_ready_.size()); }
  [[nodiscard]] uint64_t slot_bytes() const override { return slot_bytes_; }
  [[nodiscard]] uint32_t weights_wanted_events() const override {
    return static_cast<uint32_t>(weights_wanted_.size());
  }
  void PullGradients(uint32_t slot, void* host, size_t bytes, Done done) override;
  void AwaitWeightsWanted(uint32_t event, Done done) override;
  [[nodiscard]] std::optional<uint64_t> ParamsOffset(uint32_t bucket) const override { return offsets_.at(bucket); }
  void PushWeights(uint64_t offset, const void* host, size_t bytes, Done done) override;
  void WillCopy(std::vector<HostRange> ranges) override;
  void Abandon() override;
  void ReleaseHost(const void* base, size_t bytes) override;

 private:
  CudaRankTransfer(std::shared_ptr<GpuDevice> gpu, const shm::CudaIpcExport& exported,
                   std::vector<std::optional<uint64_t>> offsets);
  [[nodiscard]] const cuda::CudaDriver& driver() const { return gpu_->driver; }
  // Open once `event` (nullptr: none) has completed; fails once the rank is abandoned.
  CopyQueue::Gate GateOn(cuda::CUevent event);
  void Close() noexcept;  // closes what was opened
  void StopPinAhead();

  std::shared_ptr<GpuDevice> gpu_;
  uint64_t params_bytes_ = 0, slot_bytes_ = 0;
  std::vector<std::optional<uint64_t>> offsets_;  // per bucket, in the parameter buffer
  cuda::CUdeviceptr params_ = 0, staging_ = 0;
  std::vector<cuda::CUevent> grad_ready_, weights_wanted_;
  std::atomic<bool> abandoned_{false};
  std::mutex pin_ahead_mutex_;
  std::unique_ptr<PinAhead> pin_ahead_;  // guarded by pin_ahead_mutex_
};

}  // namespace trainstream::daemon
