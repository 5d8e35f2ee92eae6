// What a cuda-ipc rank exports to the daemon, once, right after it attached: the raw bytes of its
// CUDA IPC handles and the sizes behind them. The client fills it from its GPU buffers and sends it
// as a CudaIpcRegistration (proto/trainstream/v1/control.proto); the daemon validates it against the
// job's layout and opens it (daemon/gpu/cuda_rank_transfer.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace trainstream::shm {

struct CudaIpcExport {
  std::string device_uuid;    // 16 bytes: CUDA_VISIBLE_DEVICES may differ between trainer and daemon
  std::string params_handle;  // the flat parameter buffer's memory handle
  uint64_t params_bytes = 0;
  std::string staging_handle;  // the gradient staging slots' memory handle, slots back to back
  uint64_t slot_bytes = 0;
  std::vector<std::string> grad_ready_events;      // per staging slot: recorded after its gradients are in
  std::vector<std::string> weights_wanted_events;  // recorded at optimizer.step(), used in turn
  // Per bucket, where its weights lie in the parameter buffer, or kNotOnGpu for a bucket the rank
  // keeps off the GPU (weight paging brings it in itself). Empty: every bucket at its offset in the
  // rank's gradient region.
  std::vector<uint64_t> param_offsets;
};

constexpr uint64_t kNotOnGpu = ~uint64_t{0};

}  // namespace trainstream::shm
