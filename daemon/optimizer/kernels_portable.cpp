// The portable variant: the scalar element definitions of adamw_element.h in a plain loop. It is the
// reference the SIMD variants are tested against, and the fallback on CPUs without AVX2 (on ARM the
// compiler auto-vectorizes its fp32 paths with NEON).
#include <algorithm>
#include <cmath>

#include "daemon/optimizer/adamw_element.h"
#include "daemon/optimizer/kernel_table.h"

namespace trainstream::optimizer {
namespace {

bool PortableUpdate(const GradSources& grads, const AdamWStep& step, const StateIn& in, float* master,
                    const MomentBuffers& moments, const Upload& upload, size_t n) {
  const StepConstants c(step, moments);
  uint32_t largest = 0;
  DispatchUpdate(grads.dtype, moments.dtype, UploadKindOf(upload), step.decoupled,
                 [&]<DType kG, DType kM, UploadKind kU, bool kD>() {
                   for (size_t i = 0; i < n; ++i) {
                     const float p = UpdateElement<kG, kM, kU, kD>(grads, c, in, master, moments, upload, i);
                     largest = std::max(largest, MagnitudeBits(p));
                   }
                 });
  return largest >= kNonFiniteMagnitude;
}

double PortableSumOfSquares(const GradSources& grads, size_t n, bool* nonfinite) {
  double sum = 0;
  DispatchGrad(grads.dtype, [&]<DType kG>() {
    for (size_t i = 0; i < n; ++i) {
      const double g = GradElement<kG>(grads, i);
      sum += g * g;
    }
  });
  // A non-finite g makes the sum non-finite, and finite squares cannot overflow a double sum.
  if (!std::isfinite(sum) && nonfinite != nullptr) *nonfinite = true;
  return sum;
}

// The reference: the norm pass, then the update.
bool PortableUpdateWithNorm(const GradSources& grads, const AdamWStep& step, const StateIn& in, float* master,
                            const MomentBuffers& moments, const Upload& upload, size_t n, double* sum_of_squares,
                            bool* nonfinite) {
  *sum_of_squares = PortableSumOfSquares(grads, n, nonfinite);
  return PortableUpdate(grads, step, in, master, moments, upload, n);
}

void PortableAccumulate(const GradSources& grads, float* accum, bool overwrite, size_t n) {
  DispatchGrad(grads.dtype, [&]<DType kG>() {
    for (size_t i = 0; i < n; ++i) AccumulateElement<kG>(grads, accum, overwrite, i);
  });
}

void PortableConvertMaster(const float* master, const Upload& upload, size_t n) {
  DispatchUploadKind(UploadKindOf(upload), [&]<UploadKind kU>() {
    for (size_t i = 0; i < n; ++i) StoreUploadElement<kU>(upload.data, i, master[i]);
  });
}

}  // namespace

const KernelTable& PortableKernels() {
  static const KernelTable table{
      "portable",          &PortableUpdate,       &PortableSumOfSquares, &PortableUpdateWithNorm,
      &PortableAccumulate, &PortableConvertMaster};
  return table;
}

}  // namespace trainstream::optimizer
