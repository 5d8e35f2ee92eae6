// The fp32 gradient accumulator of a job that counts its micro-batches (LayoutSpec::accumulation_steps
// 0): daemon-private memory, mapped when the job's first step sums several backward passes. Jobs that
// never accumulate never pay its 4 bytes a parameter; a job with a fixed count has it in its state
// segment instead (shm/job_layout.h). Only the daemon reads it, and a crash loses nothing that matters:
// a resumed step replays its micro-batches from the first.
#pragma once

#include <cstddef>

namespace trainstream::daemon {

class AccumulatorMemory {
 public:
  // `elements` fp32 zeros, every page backed now (kResourceExhausted naming the bytes where the host
  // has not that much memory to give).
  explicit AccumulatorMemory(size_t elements);
  ~AccumulatorMemory();
  AccumulatorMemory(const AccumulatorMemory&) = delete;
  AccumulatorMemory& operator=(const AccumulatorMemory&) = delete;

  [[nodiscard]] float* data() const { return data_; }
  [[nodiscard]] size_t bytes() const { return bytes_; }

 private:
  float* data_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace trainstream::daemon
