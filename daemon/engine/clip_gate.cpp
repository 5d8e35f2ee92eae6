#include "daemon/engine/clip_gate.h"

#include <algorithm>
#include <cmath>

namespace trainstream::daemon {

bool ClipGate::Add(uint32_t bucket, double sum_of_squares, bool nonfinite) {
  if (in_[bucket] == 0) {
    in_[bucket] = 1;
    sums_[bucket] = sum_of_squares;
    ++count_;
  }
  nonfinite_ |= nonfinite;
  return complete();
}

double ClipGate::Norm() const {
  double sum = 0;
  for (const double bucket : sums_) sum += bucket;  // bucket order: deterministic
  return std::sqrt(sum);
}

double ClipGate::Coefficient(double max_norm) const {
  return std::min(1.0, max_norm / (Norm() + 1e-6));
}

}  // namespace trainstream::daemon
