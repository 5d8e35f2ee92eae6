// The scalar definition of one element of every kernel: the portable variant runs it over the whole
// range, the SIMD variants over their tails and alignment peels. It is the numerical reference: every
// SIMD variant performs the same fp32 operations in the same order (no FMA contraction: the optimizer
// sources are compiled with -ffp-contract=off, and IEEE division and sqrt are correctly rounded), so all
// variants agree bit for bit, which the tests check.
//
// Internal linkage (unnamed namespace) on purpose, as in float_convert.h: it is compiled once per ISA.
#pragma once

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "daemon/optimizer/adamw_kernels.h"
#include "daemon/optimizer/float_convert.h"

namespace trainstream::optimizer {
namespace {  // internal linkage per translation unit (compiled with different -m flags)

// What the upload copy is: a compile-time choice so the element loop has no per-element branches.
enum class UploadKind { kNone, kFloat32, kBFloat16, kFloat16 };

inline UploadKind UploadKindOf(const Upload& upload) {
  if (upload.data == nullptr) return UploadKind::kNone;
  switch (upload.dtype) {
    case DType::kFloat32: return UploadKind::kFloat32;
    case DType::kBFloat16: return UploadKind::kBFloat16;
    case DType::kFloat16: return UploadKind::kFloat16;
  }
  return UploadKind::kNone;
}

// The per-call scalars, derived once from AdamWStep exactly as the reference formula needs them.
struct StepConstants {
  float decay, weight_decay, one_minus_beta1, beta2, one_minus_beta2, step_size, bc2_sqrt, eps;
  uint64_t sr_seed;  // stochastic rounding seed of this job and step

  StepConstants(const AdamWStep& step, const MomentBuffers& moments)
      : decay(step.decay),
        weight_decay(step.weight_decay),
        one_minus_beta1(step.one_minus_beta1),
        beta2(step.beta2),
        one_minus_beta2(step.one_minus_beta2),
        step_size(step.step_size),
        bc2_sqrt(step.bias_correction2_sqrt),
        eps(step.eps),
        sr_seed(moments.sr_seed) {}
};

template <DType kDType>
inline float LoadElement(const void* base, size_t i) {
  if constexpr (kDType == DType::kFloat32) return static_cast<const float*>(base)[i];
  if constexpr (kDType == DType::kBFloat16) return BF16ToFloat(static_cast<const uint16_t*>(base)[i]);
  if constexpr (kDType == DType::kFloat16) return HalfToFloat(static_cast<const uint16_t*>(base)[i]);
}

// (accum or 0) + slot_0 + ... + slot_{N-1}, in that order, then * scale.
template <DType kGrad>
inline float GradElement(const GradSources& grads, size_t i) {
  float sum = grads.accum != nullptr ? grads.accum[i] : 0.0f;
  for (const void* slot : grads.slots) sum += LoadElement<kGrad>(slot, i);
  return sum * grads.scale;
}

template <UploadKind kUpload>
inline void StoreUploadElement(void* base, size_t i, float value) {
  if constexpr (kUpload == UploadKind::kFloat32) static_cast<float*>(base)[i] = value;
  if constexpr (kUpload == UploadKind::kBFloat16) static_cast<uint16_t*>(base)[i] = FloatToBF16(value);
  if constexpr (kUpload == UploadKind::kFloat16) static_cast<uint16_t*>(base)[i] = FloatToHalf(value);
}

template <DType kMoment>
inline void StoreMomentElement(void* base, size_t i, float value, uint32_t random16) {
  if constexpr (kMoment == DType::kFloat32) {
    static_cast<float*>(base)[i] = value;
  } else {
    static_cast<uint16_t*>(base)[i] = FloatToBF16Stochastic(value, random16);
  }
}

// One element of AdamWUpdate; element i of the range, global index moments.element_base + i. Reads the
// state from `in`, writes it to master and moments (the same memory in place). Returns the new weight.
template <DType kGrad, DType kMoment, UploadKind kUpload, bool kDecoupled>
inline float UpdateElement(const GradSources& grads, const StepConstants& c, const StateIn& in, float* master,
                           const MomentBuffers& moments, const Upload& upload, size_t i) {
  float g = GradElement<kGrad>(grads, i);
  float p = in.master[i];
  if constexpr (kDecoupled) {
    p *= c.decay;
  } else {
    g += c.weight_decay * p;
  }
  float m = LoadElement<kMoment>(in.exp_avg, i);
  float v = LoadElement<kMoment>(in.exp_avg_sq, i);
  m += c.one_minus_beta1 * (g - m);
  v = v * c.beta2 + c.one_minus_beta2 * g * g;
  const float denom = std::sqrt(v) / c.bc2_sqrt + c.eps;
  p -= c.step_size * (m / denom);
  master[i] = p;
  const uint32_t random = kMoment == DType::kBFloat16 ? RandomBits(c.sr_seed, moments.element_base + i) : 0;
  StoreMomentElement<kMoment>(moments.exp_avg, i, m, ExpAvgRandom(random));
  StoreMomentElement<kMoment>(moments.exp_avg_sq, i, v, ExpAvgSqRandom(random));
  StoreUploadElement<kUpload>(upload.data, i, p);
  return p;
}

// |x|'s bits: at least kNonFiniteMagnitude exactly when x is inf or NaN. The update keeps the largest
// of its new weights' (an unsigned max, cheap in vectors) to tell whether any is non-finite.
constexpr uint32_t kNonFiniteMagnitude = 0x7f800000u;
inline uint32_t MagnitudeBits(float x) {
  return std::bit_cast<uint32_t>(x) & 0x7fffffffu;
}

// One element of Accumulate.
template <DType kGrad>
inline void AccumulateElement(const GradSources& grads, float* accum, bool overwrite, size_t i) {
  float sum = 0.0f;
  for (const void* slot : grads.slots) sum += LoadElement<kGrad>(slot, i);
  accum[i] = (overwrite ? 0.0f : accum[i]) + sum * grads.scale;
}

// Calls fn.template operator()<kGrad, kMoment, kUpload, kDecoupled>() for the runtime configuration, so
// every variant instantiates one specialized loop per combination (3 * 2 * 4 * 2 = 48).
template <typename Fn>
inline void DispatchUpdate(DType grad, DType moment, UploadKind upload, bool decoupled, Fn&& fn) {
  auto with_decoupled = [&]<DType kG, DType kM, UploadKind kU>() {
    if (decoupled) {
      fn.template operator()<kG, kM, kU, true>();
    } else {
      fn.template operator()<kG, kM, kU, false>();
    }
  };
  auto with_upload = [&]<DType kG, DType kM>() {
    switch (upload) {
      case UploadKind::kNone: with_decoupled.template operator()<kG, kM, UploadKind::kNone>(); break;
      case UploadKind::kFloat32: with_decoupled.template operator()<kG, kM, UploadKind::kFloat32>(); break;
      case UploadKind::kBFloat16: with_decoupled.template operator()<kG, kM, UploadKind::kBFloat16>(); break;
      case UploadKind::kFloat16: with_decoupled.template operator()<kG, kM, UploadKind::kFloat16>(); break;
    }
  };
  auto with_moment = [&]<DType kG>() {
    if (moment == DType::kBFloat16) {
      with_upload.template operator()<kG, DType::kBFloat16>();
    } else {
      with_upload.template operator()<kG, DType::kFloat32>();
    }
  };
  switch (grad) {
    case DType::kFloat32: with_moment.template operator()<DType::kFloat32>(); break;
    case DType::kBFloat16: with_moment.template operator()<DType::kBFloat16>(); break;
    case DType::kFloat16: with_moment.template operator()<DType::kFloat16>(); break;
  }
}

template <typename Fn>
inline void DispatchGrad(DType grad, Fn&& fn) {
  switch (grad) {
    case DType::kFloat32: fn.template operator()<DType::kFloat32>(); break;
    case DType::kBFloat16: fn.template operator()<DType::kBFloat16>(); break;
    case DType::kFloat16: fn.template operator()<DType::kFloat16>(); break;
  }
}

template <typename Fn>
inline void DispatchUploadKind(UploadKind upload, Fn&& fn) {
  switch (upload) {
    case UploadKind::kNone: break;
    case UploadKind::kFloat32: fn.template operator()<UploadKind::kFloat32>(); break;
    case UploadKind::kBFloat16: fn.template operator()<UploadKind::kBFloat16>(); break;
    case UploadKind::kFloat16: fn.template operator()<UploadKind::kFloat16>(); break;
  }
}

}  // namespace
}  // namespace trainstream::optimizer
