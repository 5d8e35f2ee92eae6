// How the step engine sums a bucket's gradients over the nodes of a multi-node job: the peer plane's
// ring all-reduce implements it (daemon/peer/peer_allreduce.h); the engine's tests use a fake.
//
// Submit returns at once; `done` runs later, on another thread, exactly once, with the error that
// stopped the reduction if any. Every node submits its buckets in (step, bucket) order and ends with
// the same sums, so the nodes' weights stay identical.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "shm/error.h"

namespace trainstream::daemon {

class AllReduce {
 public:
  virtual ~AllReduce() = default;

  // Sums data[0, n) (this node's sum of bucket `bucket` of `step`) over the nodes, in place. The data
  // is not touched by anyone else until `done`.
  virtual void Submit(uint64_t step, uint32_t bucket, float* data, size_t n, Done done) = 0;
  // Fails what is submitted and not yet reduced with `reason`, and forgets the (step, bucket) order: the
  // step was abandoned (a rank left), so the next submission starts a new order.
  virtual void Reset(const std::string& reason) = 0;
};

}  // namespace trainstream::daemon
