// Page-locks the host memory a cuda-ipc rank's copies will touch on a thread of its own, in the order
// its first steps touch it, so that its first step's copies find it registered. Done by the copy
// threads, registering the 1.86B GPT's gradients and master weights (populated memory registers at
// 16-25 GiB/s on the GPU machine) held its first step at 1.57 s; here, behind the seeding of the
// weights and the first forward (21 GiB in 1.1 s), that step took 0.77-0.80 s
// (benchmarks/results/train_gpt.md, 2026-12-03). In a new job it starts after the seed (StepEngine): beside
// it, the seed's copy ran threefold slower and wrap() to the end of the first step took 3.05-3.06 s,
// after it 2.68-2.92 s (2026-12-06).
// Invariants: every range goes through PinnedHost::Ensure, so a page is registered once, by whichever
// comes first (a copy registers what this has not reached yet); Stop() returns after the thread has
// finished, so the memory may be unmapped after it.
#pragma once

#include <atomic>
#include <memory>
#include <thread>
#include <vector>

#include "daemon/engine/host_range.h"
#include "daemon/gpu/gpu_devices.h"

namespace trainstream::daemon {

class PinAhead {
 public:
  PinAhead(std::shared_ptr<GpuDevice> gpu, std::vector<HostRange> ranges);
  ~PinAhead() { Stop(); }
  PinAhead(const PinAhead&) = delete;
  PinAhead& operator=(const PinAhead&) = delete;

  void Stop();

 private:
  void Run(const std::vector<HostRange>& ranges);

  std::shared_ptr<GpuDevice> gpu_;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace trainstream::daemon
