// Portable implementation of the kernels in adamw_kernels.h: a clear element loop the compiler
// vectorizes for the fp32 paths. SIMD-dispatched variants replace it where the CPU allows.
#include "daemon/optimizer/adamw_kernels.h"

#include <cmath>

#include "daemon/optimizer/float_convert.h"

namespace trainstream::optimizer {

AdamWStep AdamWStep::For(double lr, double beta1, double beta2, double eps, double weight_decay, bool decoupled,
                         uint64_t step) {
  const double bias_correction1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bias_correction2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  return AdamWStep{
      .lr = static_cast<float>(lr),
      .beta1 = static_cast<float>(beta1),
      .beta2 = static_cast<float>(beta2),
      .eps = static_cast<float>(eps),
      .weight_decay = static_cast<float>(weight_decay),
      .decoupled = decoupled,
      .step_size = static_cast<float>(lr / bias_correction1),
      .bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2)),
  };
}

namespace {

inline float GradAt(const GradSources& grads, size_t i) {
  float sum = grads.accum != nullptr ? grads.accum[i] : 0.0f;
  for (const void* slot : grads.slots) sum += LoadAsFloat(slot, i, grads.dtype);
  return sum * grads.scale;
}

inline float LoadMoment(const void* base, size_t i, DType dtype) { return LoadAsFloat(base, i, dtype); }

inline void StoreMoment(void* base, size_t i, const MomentBuffers& moments, float value, uint64_t stream) {
  if (moments.dtype == DType::kFloat32) {
    static_cast<float*>(base)[i] = value;
  } else {
    const uint32_t random = RandomBits(moments.sr_seed ^ stream, moments.element_base + i);
    static_cast<uint16_t*>(base)[i] = FloatToBF16Stochastic(value, random);
  }
}

}  // namespace

void AdamWUpdate(const GradSources& grads, const AdamWStep& step, float* master, const MomentBuffers& moments,
                 const Upload& upload, size_t n) {
  const float decay = 1.0f - step.lr * step.weight_decay;
  const float one_minus_beta1 = 1.0f - step.beta1;
  const float one_minus_beta2 = 1.0f - step.beta2;
  for (size_t i = 0; i < n; ++i) {
    float g = GradAt(grads, i);
    float p = master[i];
    if (step.decoupled) {
      p *= decay;
    } else {
      g += step.weight_decay * p;
    }
    float m = LoadMoment(moments.exp_avg, i, moments.dtype);
    float v = LoadMoment(moments.exp_avg_sq, i, moments.dtype);
    m += one_minus_beta1 * (g - m);
    v = v * step.beta2 + one_minus_beta2 * g * g;
    const float denom = std::sqrt(v) / step.bias_correction2_sqrt + step.eps;
    p -= step.step_size * (m / denom);
    master[i] = p;
    StoreMoment(moments.exp_avg, i, moments, m, 0x6D);
    StoreMoment(moments.exp_avg_sq, i, moments, v, 0x76);
    if (upload.data != nullptr) StoreFromFloat(upload.data, i, upload.dtype, p);
  }
}

double SumOfSquares(const GradSources& grads, size_t n, bool* nonfinite) {
  double sum = 0;
  bool bad = false;
  for (size_t i = 0; i < n; ++i) {
    const float g = GradAt(grads, i);
    bad |= !std::isfinite(g);
    sum += static_cast<double>(g) * g;
  }
  if (bad && nonfinite != nullptr) *nonfinite = true;
  return sum;
}

void Accumulate(const GradSources& grads, float* accum, bool overwrite, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    float sum = 0;
    for (const void* slot : grads.slots) sum += LoadAsFloat(slot, i, grads.dtype);
    accum[i] = (overwrite ? 0.0f : accum[i]) + sum * grads.scale;
  }
}

void ConvertMaster(const float* master, const Upload& upload, size_t n) {
  for (size_t i = 0; i < n; ++i) StoreFromFloat(upload.data, i, upload.dtype, master[i]);
}

const char* ActiveKernelName() { return "portable"; }

}  // namespace trainstream::optimizer
