// With max_grad_norm: one step's global gradient norm, gathered bucket by bucket, and torch's clip
// coefficient once every bucket is in (torch.nn.utils.clip_grad_norm_: min(1, max_norm / (norm + 1e-6))).
// It also holds how the step's buckets are checked against the norm, decided once for the step: every
// bucket speculates (updates before the norm is known) or every bucket waits for it.
//
// Invariant: the norm is the same whatever order the buckets arrive in (their sums of squares are added
// in bucket order once all are in), so an update that waited for the norm and one that speculated and
// was checked against it see the same coefficient bit for bit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace trainstream::daemon {

class ClipGate {
 public:
  ClipGate(size_t buckets, bool speculative) : sums_(buckets, 0.0), in_(buckets, 0), speculative_(speculative) {}

  // Bucket b's sum of squares of its scaled gradients (and whether any was inf or NaN); returns whether
  // every bucket is in now. A bucket adds once.
  bool Add(uint32_t bucket, double sum_of_squares, bool nonfinite);
  [[nodiscard]] bool complete() const { return count_ == sums_.size(); }
  [[nodiscard]] bool nonfinite() const { return nonfinite_; }
  [[nodiscard]] bool speculative() const { return speculative_; }
  // Once complete: the global norm, and the coefficient the gradients are multiplied by (1: no clipping;
  // a NaN norm also gives 1, as the comparison in min fails, which the engine has always done).
  [[nodiscard]] double Norm() const;
  [[nodiscard]] double Coefficient(double max_norm) const;

 private:
  std::vector<double> sums_;
  std::vector<uint8_t> in_;
  size_t count_ = 0;
  bool nonfinite_ = false;
  bool speculative_;
};

}  // namespace trainstream::daemon
