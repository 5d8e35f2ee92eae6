// The SIMD kernel body, written once over a small vector-operations struct (simd_ops_*.h) and compiled
// once per instruction set (kernels_avx2.cpp, kernels_avx512.cpp). Vector loop over whole vectors; the
// alignment peel and the tail run the scalar reference (adamw_element.h), so every variant computes
// the same fp32 operations in the same order and agrees with the portable variant bit for bit.
//
// Why hand-written intrinsics behind a thin ops struct rather than Highway (libhwy), decided by
// measurement on the dev box (AMD Zen 4, 2 cores) and by what the GPU machine has:
//  - The update is memory-bound: the fp32 path moves 28 bytes per element for ~12 flops. What decides
//    speed is the memory traffic (in-place read-modify-write of master and moments, non-temporal
//    stores for the write-only upload staging, no extra passes), not instruction selection; measured,
//    both the AVX2 and the AVX-512 variants of this body run at the same bandwidth as the STREAM
//    triad, and the portable (auto-vectorized) build already reaches most of it on fp32-only paths.
//    Highway would generate the same instructions; it cannot beat the roofline.
//  - Where instruction choice matters (bf16 stochastic rounding: a 32-bit multiply-xorshift hash per
//    element, packing two vectors of bf16 into one store), we want explicit control (vpmulld, vpermt2w)
//    and bit-exact integer RNE/SR conversions (Highway's f32->bf16 demotion differs from torch for NaN payloads;
//    avx512_bf16's VCVTNE2PS2BF16 flushes denormals: used only for the RNE upload, with a fixup, in the
//    avx512bf16 variant).
//  - No new build or runtime dependency on the GPU machine's sysroot (libhwy is not there).
//  - ARM stays reachable: the portable variant auto-vectorizes with NEON today, and a NEON/SVE variant is
//    one more ~150-line ops struct with the same interface (no change to this body).
#pragma once

#include <cstddef>
#include <cstdint>

#include "daemon/optimizer/adamw_element.h"
#include "daemon/optimizer/kernel_table.h"

namespace trainstream::optimizer {
namespace {  // internal linkage: one copy per ISA translation unit

// Upload staging is write-only here and read next by DMA: non-temporal stores skip the read-for-
// ownership, saving a third of the upload traffic. Small ranges keep ordinary stores (the copy that
// follows may hit in cache, and the peel would dominate).
constexpr size_t kStreamMinBytes = 64 * 1024;

template <class Ops, DType kDType>
inline typename Ops::F LoadV(const void* base, size_t i) {
  if constexpr (kDType == DType::kFloat32) return Ops::LoadF32(static_cast<const float*>(base) + i);
  if constexpr (kDType == DType::kBFloat16) return Ops::LoadBF16(static_cast<const uint16_t*>(base) + i);
  if constexpr (kDType == DType::kFloat16) return Ops::LoadF16(static_cast<const uint16_t*>(base) + i);
}

// (accum or 0) + slot_0 + ... + slot_{N-1}, then * scale: the order of GradElement.
template <class Ops, DType kGrad>
inline typename Ops::F GradV(const GradSources& grads, const void* const* slots, size_t ranks, size_t i) {
  typename Ops::F sum = grads.accum != nullptr ? Ops::LoadF32(grads.accum + i) : Ops::Zero();
  for (size_t r = 0; r < ranks; ++r) sum = Ops::Add(sum, LoadV<Ops, kGrad>(slots[r], i));
  return Ops::Mul(sum, Ops::Set(grads.scale));
}

template <class Ops, UploadKind kUpload>
inline void StoreUploadV(void* base, size_t i, typename Ops::F v, bool stream) {
  if constexpr (kUpload == UploadKind::kFloat32) {
    float* p = static_cast<float*>(base) + i;
    stream ? Ops::StreamF32(p, v) : Ops::StoreF32(p, v);
  } else if constexpr (kUpload == UploadKind::kBFloat16) {
    uint16_t* p = static_cast<uint16_t*>(base) + i;
    stream ? Ops::StreamBF16(p, v) : Ops::StoreBF16(p, v);
  } else if constexpr (kUpload == UploadKind::kFloat16) {
    uint16_t* p = static_cast<uint16_t*>(base) + i;
    stream ? Ops::StreamF16(p, v) : Ops::StoreF16(p, v);
  }
}

// How many leading elements to do in scalar so the upload stores are aligned for streaming; sets
// *stream when the main loop should stream.
template <class Ops, UploadKind kUpload>
inline size_t StreamPeel(const void* upload, size_t n, bool* stream) {
  *stream = false;
  if constexpr (kUpload == UploadKind::kNone) {
    return 0;
  } else {
    constexpr size_t kElement = kUpload == UploadKind::kFloat32 ? 4 : 2;
    const auto address = reinterpret_cast<uintptr_t>(upload);
    if (n * kElement < kStreamMinBytes || address % kElement != 0) return 0;
    // Narrow stores are half as wide as the fp32 vector, so 64-byte alignment serves every case.
    const size_t peel = ((64 - address % 64) % 64) / kElement;
    *stream = true;
    return peel;
  }
}

// The vector constants of one update.
template <class Ops>
struct StepVectors {
  using F = typename Ops::F;
  F decay, weight_decay, one_minus_beta1, beta2, one_minus_beta2, step_size, bc2_sqrt, eps;
  explicit StepVectors(const StepConstants& c)
      : decay(Ops::Set(c.decay)),
        weight_decay(Ops::Set(c.weight_decay)),
        one_minus_beta1(Ops::Set(c.one_minus_beta1)),
        beta2(Ops::Set(c.beta2)),
        one_minus_beta2(Ops::Set(c.one_minus_beta2)),
        step_size(Ops::Set(c.step_size)),
        bc2_sqrt(Ops::Set(c.bc2_sqrt)),
        eps(Ops::Set(c.eps)) {}
};

// The math of one vector of elements at i: UpdateElement's operations in its order. Stores master; returns
// the new p, m, v for the caller to store.
template <class Ops, DType kG, DType kM, bool kD>
inline void UpdateMath(const GradSources& grads, const void* const* slots, size_t ranks, const StepVectors<Ops>& k,
                       float* master, const MomentBuffers& moments, size_t i, typename Ops::F* p_out,
                       typename Ops::F* m_out, typename Ops::F* v_out) {
  using F = typename Ops::F;
  F g = GradV<Ops, kG>(grads, slots, ranks, i);
  F p = Ops::LoadF32(master + i);
  if constexpr (kD) {
    p = Ops::Mul(p, k.decay);
  } else {
    g = Ops::Add(g, Ops::Mul(k.weight_decay, p));
  }
  F m = LoadV<Ops, kM>(moments.exp_avg, i);
  F v = LoadV<Ops, kM>(moments.exp_avg_sq, i);
  m = Ops::Add(m, Ops::Mul(k.one_minus_beta1, Ops::Sub(g, m)));
  v = Ops::Add(Ops::Mul(v, k.beta2), Ops::Mul(Ops::Mul(k.one_minus_beta2, g), g));
  const F denom = Ops::Add(Ops::Div(Ops::Sqrt(v), k.bc2_sqrt), k.eps);
  p = Ops::Sub(p, Ops::Mul(k.step_size, Ops::Div(m, denom)));
  Ops::StoreF32(master + i, p);
  *p_out = p, *m_out = m, *v_out = v;
}

// fp32 moments: one vector per iteration.
template <class Ops, DType kG, UploadKind kU, bool kD>
size_t UpdateVectorsF32(const GradSources& grads, const StepVectors<Ops>& k, float* master,
                        const MomentBuffers& moments, const Upload& upload, size_t i, size_t end, bool stream) {
  using F = typename Ops::F;
  const void* const* slots = grads.slots.data();
  const size_t ranks = grads.slots.size();
  for (; i + Ops::kLanes <= end; i += Ops::kLanes) {
    F p, m, v;
    UpdateMath<Ops, kG, DType::kFloat32, kD>(grads, slots, ranks, k, master, moments, i, &p, &m, &v);
    Ops::StoreF32(static_cast<float*>(moments.exp_avg) + i, m);
    Ops::StoreF32(static_cast<float*>(moments.exp_avg_sq) + i, v);
    StoreUploadV<Ops, kU>(upload.data, i, p, stream);
  }
  return i;
}

// bf16 moments with stochastic rounding, for elements [i, end) whose global indices share their high 32
// bits (key = RandomKey of them): two vectors per iteration, so each bf16 stream is one full-width store
// (one word permute packs two vectors), then at most one single vector. One hash per element.
template <class Ops, DType kG, UploadKind kU, bool kD>
size_t UpdateVectorsBF16(const GradSources& grads, const StepVectors<Ops>& k, float* master,
                         const MomentBuffers& moments, const Upload& upload, size_t i, size_t end, bool stream,
                         uint32_t key) {
  using F = typename Ops::F;
  using I = typename Ops::I;
  constexpr size_t kLanes = Ops::kLanes;
  const void* const* slots = grads.slots.data();
  const size_t ranks = grads.slots.size();
  auto* exp_avg = static_cast<uint16_t*>(moments.exp_avg);
  auto* exp_avg_sq = static_cast<uint16_t*>(moments.exp_avg_sq);
  const I key_v = Ops::MixKey(key), h1 = Ops::SetI(kRandomHash1), h2 = Ops::SetI(kRandomHash2);
  const I step = Ops::SetI(static_cast<uint32_t>(kLanes) * kRandomWeyl);
  I counter = Ops::WeylCounter(static_cast<uint32_t>(moments.element_base + i) * kRandomWeyl, kRandomWeyl);
  for (; i + 2 * kLanes <= end; i += 2 * kLanes) {
    F p0, m0, v0, p1, m1, v1;
    UpdateMath<Ops, kG, DType::kBFloat16, kD>(grads, slots, ranks, k, master, moments, i, &p0, &m0, &v0);
    UpdateMath<Ops, kG, DType::kBFloat16, kD>(grads, slots, ranks, k, master, moments, i + kLanes, &p1, &m1, &v1);
    I lo0, hi0, lo1, hi1;
    Ops::HashSplit(counter, key_v, h1, h2, &lo0, &hi0);
    counter = Ops::AddI(counter, step);
    Ops::HashSplit(counter, key_v, h1, h2, &lo1, &hi1);
    counter = Ops::AddI(counter, step);
    Ops::StoreHigh16x2(exp_avg + i, Ops::StochasticWord(m0, lo0), Ops::StochasticWord(m1, lo1));
    Ops::StoreHigh16x2(exp_avg_sq + i, Ops::StochasticWord(v0, hi0), Ops::StochasticWord(v1, hi1));
    if constexpr (kU == UploadKind::kBFloat16) {
      Ops::StoreBF16x2(static_cast<uint16_t*>(upload.data) + i, p0, p1, stream);
    } else {
      StoreUploadV<Ops, kU>(upload.data, i, p0, stream);
      StoreUploadV<Ops, kU>(upload.data, i + kLanes, p1, stream);
    }
  }
  if (i + kLanes <= end) {
    F p, m, v;
    UpdateMath<Ops, kG, DType::kBFloat16, kD>(grads, slots, ranks, k, master, moments, i, &p, &m, &v);
    I lo, hi;
    Ops::HashSplit(counter, key_v, h1, h2, &lo, &hi);
    Ops::StoreHigh16(exp_avg + i, Ops::StochasticWord(m, lo));
    Ops::StoreHigh16(exp_avg_sq + i, Ops::StochasticWord(v, hi));
    StoreUploadV<Ops, kU>(upload.data, i, p, stream);
    i += kLanes;
  }
  return i;
}

template <class Ops, DType kG, DType kM, UploadKind kU, bool kD>
void UpdateRange(const GradSources& grads, const StepConstants& c, float* master, const MomentBuffers& moments,
                 const Upload& upload, size_t n) {
  bool stream = false;
  const size_t peel = StreamPeel<Ops, kU>(upload.data, n, &stream);
  const bool fence = stream;
  size_t i = 0;
  for (; i < peel; ++i) UpdateElement<kG, kM, kU, kD>(grads, c, master, moments, upload, i);
  const StepVectors<Ops> k(c);
  if constexpr (kM == DType::kFloat32) {
    i = UpdateVectorsF32<Ops, kG, kU, kD>(grads, k, master, moments, upload, i, n, stream);
  } else {
    // The hash key changes where the global index crosses a multiple of 2^32: one segment per key (in
    // practice one). A segment's scalar tail can leave the upload unaligned: no streaming after it.
    while (true) {
      const uint64_t index = moments.element_base + i;
      const uint64_t to_boundary = (uint64_t{1} << 32) - (index & 0xFFFFFFFFu);
      const size_t end = to_boundary < n - i ? i + static_cast<size_t>(to_boundary) : n;
      i = UpdateVectorsBF16<Ops, kG, kU, kD>(grads, k, master, moments, upload, i, end, stream,
                                             RandomKey(c.sr_seed, index >> 32));
      if (end == n) break;
      for (; i < end; ++i) UpdateElement<kG, kM, kU, kD>(grads, c, master, moments, upload, i);
      stream = false;
    }
  }
  for (; i < n; ++i) UpdateElement<kG, kM, kU, kD>(grads, c, master, moments, upload, i);
  if (fence) Ops::StreamFence();  // streamed stores are weakly ordered: publish before completion
}

template <class Ops>
void SimdUpdate(const GradSources& grads, const AdamWStep& step, float* master, const MomentBuffers& moments,
                const Upload& upload, size_t n) {
  const StepConstants c(step, moments);
  DispatchUpdate(grads.dtype, moments.dtype, UploadKindOf(upload), step.decoupled,
                 [&]<DType kG, DType kM, UploadKind kU, bool kD>() {
                   UpdateRange<Ops, kG, kM, kU, kD>(grads, c, master, moments, upload, n);
                 });
}

template <class Ops>
double SimdSumOfSquares(const GradSources& grads, size_t n, bool* nonfinite) {
  double sum = 0;
  DispatchGrad(grads.dtype, [&]<DType kG>() {
    const void* const* slots = grads.slots.data();
    const size_t ranks = grads.slots.size();
    typename Ops::SquareSum acc;
    size_t i = 0;
    for (; i + Ops::kLanes <= n; i += Ops::kLanes) Ops::AddSquares(acc, GradV<Ops, kG>(grads, slots, ranks, i));
    sum = Ops::Total(acc);
    for (; i < n; ++i) {
      const double g = GradElement<kG>(grads, i);
      sum += g * g;
    }
  });
  // A non-finite g makes the sum non-finite, and finite squares cannot overflow a double sum.
  if (!(sum - sum == 0) && nonfinite != nullptr) *nonfinite = true;
  return sum;
}

template <class Ops>
void SimdAccumulate(const GradSources& grads, float* accum, bool overwrite, size_t n) {
  DispatchGrad(grads.dtype, [&]<DType kG>() {
    const void* const* slots = grads.slots.data();
    const size_t ranks = grads.slots.size();
    const typename Ops::F scale = Ops::Set(grads.scale);
    size_t i = 0;
    for (; i + Ops::kLanes <= n; i += Ops::kLanes) {
      typename Ops::F sum = Ops::Zero();
      for (size_t r = 0; r < ranks; ++r) sum = Ops::Add(sum, LoadV<Ops, kG>(slots[r], i));
      const typename Ops::F base = overwrite ? Ops::Zero() : Ops::LoadF32(accum + i);
      Ops::StoreF32(accum + i, Ops::Add(base, Ops::Mul(sum, scale)));
    }
    for (; i < n; ++i) AccumulateElement<kG>(grads, accum, overwrite, i);
  });
}

template <class Ops>
void SimdConvertMaster(const float* master, const Upload& upload, size_t n) {
  DispatchUploadKind(UploadKindOf(upload), [&]<UploadKind kU>() {
    bool stream = false;
    const size_t peel = StreamPeel<Ops, kU>(upload.data, n, &stream);
    size_t i = 0;
    for (; i < peel; ++i) StoreUploadElement<kU>(upload.data, i, master[i]);
    for (; i + Ops::kLanes <= n; i += Ops::kLanes)
      StoreUploadV<Ops, kU>(upload.data, i, Ops::LoadF32(master + i), stream);
    for (; i < n; ++i) StoreUploadElement<kU>(upload.data, i, master[i]);
    if (stream) Ops::StreamFence();
  });
}

template <class Ops>
const KernelTable& SimdKernelTable(const char* name) {
  static const KernelTable table{name, &SimdUpdate<Ops>, &SimdSumOfSquares<Ops>, &SimdAccumulate<Ops>,
                                 &SimdConvertMaster<Ops>};
  return table;
}

}  // namespace
}  // namespace trainstream::optimizer
