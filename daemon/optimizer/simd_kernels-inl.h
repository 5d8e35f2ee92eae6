// The SIMD kernel body, written once over a small vector-operations struct (simd_ops_*.h) and compiled
// once per instruction set (kernels_avx2.cpp, kernels_avx512.cpp, kernels_avx512bf16.cpp). Vector loop over
// whole vectors; the alignment peel and the tail run as masked vectors where the ISA has masks (AVX-512), else
// the scalar reference (adamw_element.h). Every variant computes the same fp32 operations in the same order
// (vector lanes are elementwise IEEE operations, masked or not) and agrees with the portable variant bit for
// bit.
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

#include <algorithm>
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
[[gnu::always_inline]] inline typename Ops::F LoadV(const void* base, size_t i) {
  if constexpr (kDType == DType::kFloat32) return Ops::LoadF32(static_cast<const float*>(base) + i);
  if constexpr (kDType == DType::kBFloat16) return Ops::LoadBF16(static_cast<const uint16_t*>(base) + i);
  if constexpr (kDType == DType::kFloat16) return Ops::LoadF16(static_cast<const uint16_t*>(base) + i);
}

// The lanes of the vector at i that `mask` selects (Ops with masks); the others read as zero, and their
// memory is not touched (no fault past the end of a buffer).
template <class Ops, DType kDType, class Mask>
[[gnu::always_inline]] inline typename Ops::F LoadV(const void* base, size_t i, Mask mask) {
  if constexpr (kDType == DType::kFloat32) return Ops::LoadF32(static_cast<const float*>(base) + i, mask);
  if constexpr (kDType == DType::kBFloat16) return Ops::LoadBF16(static_cast<const uint16_t*>(base) + i, mask);
  if constexpr (kDType == DType::kFloat16) return Ops::LoadF16(static_cast<const uint16_t*>(base) + i, mask);
}

// The two vectors at i and i + kLanes (bf16: one load, widened in two halves).
template <class Ops, DType kDType>
[[gnu::always_inline]] inline void LoadV2(const void* base, size_t i, typename Ops::F* a, typename Ops::F* b) {
  if constexpr (kDType == DType::kBFloat16) {
    Ops::LoadBF16x2(static_cast<const uint16_t*>(base) + i, a, b);
  } else {
    *a = LoadV<Ops, kDType>(base, i);
    *b = LoadV<Ops, kDType>(base, i + Ops::kLanes);
  }
}

// The gradient of a range, g = scale * (accum + sum_r grad_r) in GradElement's order, with the loop-
// invariant pointers in locals (the stores of the update could alias the GradSources the caller passed, so
// the compiler would reload them every vector). kOne: one slot and no accumulator, the common case, without
// the rank loop; its sum is still 0 + slot (-0 becomes +0, as in GradElement).
template <class Ops, DType kGrad, bool kOne>
class GradReader {
 public:
  using F = typename Ops::F;
  explicit GradReader(const GradSources& grads)
      : accum_(grads.accum), slots_(grads.slots.data()), ranks_(grads.slots.size()), scale_(Ops::Set(grads.scale)) {}

  [[gnu::always_inline]] F At(size_t i) const {
    if constexpr (kOne) {
      return Ops::Mul(Ops::Add(Ops::Zero(), LoadV<Ops, kGrad>(slots_[0], i)), scale_);
    } else {
      F sum = accum_ != nullptr ? Ops::LoadF32(accum_ + i) : Ops::Zero();
      for (size_t r = 0; r < ranks_; ++r) sum = Ops::Add(sum, LoadV<Ops, kGrad>(slots_[r], i));
      return Ops::Mul(sum, scale_);
    }
  }
  template <class Mask>
  [[gnu::always_inline]] F At(size_t i, Mask mask) const {
    F sum = accum_ != nullptr ? Ops::LoadF32(accum_ + i, mask) : Ops::Zero();
    for (size_t r = 0; r < ranks_; ++r) sum = Ops::Add(sum, LoadV<Ops, kGrad>(slots_[r], i, mask));
    return Ops::Mul(sum, scale_);
  }
  [[gnu::always_inline]] void At2(size_t i, F* a, F* b) const {
    if constexpr (kOne) {
      LoadV2<Ops, kGrad>(slots_[0], i, a, b);
      *a = Ops::Mul(Ops::Add(Ops::Zero(), *a), scale_);
      *b = Ops::Mul(Ops::Add(Ops::Zero(), *b), scale_);
    } else {
      F sa = Ops::Zero(), sb = Ops::Zero();
      if (accum_ != nullptr) sa = Ops::LoadF32(accum_ + i), sb = Ops::LoadF32(accum_ + i + Ops::kLanes);
      for (size_t r = 0; r < ranks_; ++r) {
        F ga, gb;
        LoadV2<Ops, kGrad>(slots_[r], i, &ga, &gb);
        sa = Ops::Add(sa, ga), sb = Ops::Add(sb, gb);
      }
      *a = Ops::Mul(sa, scale_), *b = Ops::Mul(sb, scale_);
    }
  }

 private:
  const float* accum_;
  const void* const* slots_;
  size_t ranks_;
  F scale_;
};

template <class Ops, UploadKind kUpload>
[[gnu::always_inline]] inline void StoreUploadV(void* base, size_t i, typename Ops::F v, bool stream) {
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

template <class Ops, UploadKind kUpload, class Mask>
[[gnu::always_inline]] inline void StoreUploadMaskedV(void* base, size_t i, typename Ops::F v, Mask mask) {
  if constexpr (kUpload == UploadKind::kFloat32) Ops::StoreF32(static_cast<float*>(base) + i, v, mask);
  if constexpr (kUpload == UploadKind::kBFloat16) Ops::StoreBF16(static_cast<uint16_t*>(base) + i, v, mask);
  if constexpr (kUpload == UploadKind::kFloat16) Ops::StoreF16(static_cast<uint16_t*>(base) + i, v, mask);
}

// How many leading elements to do before the main loop so the upload stores are aligned for streaming;
// sets *stream when the main loop should stream.
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

// The math of one vector of elements, UpdateElement's operations in its order: g and the loaded p, m, v in,
// the new p, m, v out.
template <class Ops, bool kD>
[[gnu::always_inline]] inline void AdamMath(const StepVectors<Ops>& k, typename Ops::F g, typename Ops::F* p,
                                            typename Ops::F* m, typename Ops::F* v) {
  using F = typename Ops::F;
  if constexpr (kD) {
    *p = Ops::Mul(*p, k.decay);
  } else {
    g = Ops::Add(g, Ops::Mul(k.weight_decay, *p));
  }
  *m = Ops::Add(*m, Ops::Mul(k.one_minus_beta1, Ops::Sub(g, *m)));
  *v = Ops::Add(Ops::Mul(*v, k.beta2), Ops::Mul(Ops::Mul(k.one_minus_beta2, g), g));
  const F denom = Ops::Add(Ops::Div(Ops::Sqrt(*v), k.bc2_sqrt), k.eps);
  *p = Ops::Sub(*p, Ops::Mul(k.step_size, Ops::Div(*m, denom)));
}

// The pointers of one update, in locals (see GradReader): where it reads the state (the same memory as
// where it writes it, in place) and where it writes the state and the upload copy.
struct UpdatePointers {
  const float* master_in;
  const void* exp_avg_in;
  const void* exp_avg_sq_in;
  float* master;
  void* exp_avg;
  void* exp_avg_sq;
  void* upload;
};

// Which of an update's stores the main loop streams (see UpdatePeel).
struct Streams {
  bool upload = false;  // the upload copy: write-only here, read next by DMA
  bool state = false;   // out of place: the new master weights and moments
  [[nodiscard]] bool any() const { return upload || state; }
};

// How many leading elements to do before the main loop so that every stream it writes with
// non-temporal stores is 64-byte aligned there, and which it streams (*streams): the upload copy as
// StreamPeel decides, and out of place the new state as well, where one head aligns them all (it does
// for the daemon's blocks, which start on 64-byte boundaries in every region). Where none does, the new
// state alone (12 bytes per element of reads saved, against 2 for the upload). Small ranges stream
// nothing.
template <class Ops, DType kM, UploadKind kU>
inline size_t UpdatePeel(const UpdatePointers& at, size_t n, Streams* streams) {
  *streams = {};
  bool upload = false;
  const size_t upload_peel = StreamPeel<Ops, kU>(at.upload, n, &upload);
  const bool out_of_place = at.master != at.master_in;
  if (out_of_place && n * sizeof(float) >= kStreamMinBytes) {
    constexpr size_t kMoment = kM == DType::kFloat32 ? 4 : 2;
    constexpr size_t kUploadElement = kU == UploadKind::kFloat32 ? 4 : 2;
    auto aligned = [](const void* p, size_t element, size_t i) {
      return (reinterpret_cast<uintptr_t>(p) + i * element) % 64 == 0;
    };
    for (const bool with_upload : {upload, false}) {
      for (size_t i = 0; i < 64; ++i) {
        if (aligned(at.master, 4, i) && aligned(at.exp_avg, kMoment, i) && aligned(at.exp_avg_sq, kMoment, i) &&
            (!with_upload || aligned(at.upload, kUploadElement, i))) {
          *streams = {.upload = with_upload, .state = true};
          return i;
        }
      }
    }
  }
  streams->upload = upload;
  return upload_peel;
}

// The largest |p| bits of the new weights seen so far, per lane (MagnitudeBits): non-finite if any lane
// reaches kNonFiniteMagnitude.
template <class Ops>
struct Magnitudes {
  typename Ops::I largest = Ops::SetI(0);
  uint32_t scalar = 0;  // of the elements the scalar reference updated
  [[nodiscard]] bool NonFinite() const { return std::max(Ops::MaxLane(largest), scalar) >= kNonFiniteMagnitude; }
};

// Elements [i, i + count) of a range, count <= kLanes, as one masked vector (Ops with masks only): the head
// that aligns the streams and the tails, without the scalar reference. Ordinary stores. bf16 moments:
// counter0 is the hash counter (index * kRandomWeyl) of element i, key the range's mixed key.
template <class Ops, DType kG, DType kM, UploadKind kU, bool kD, class Grad>
[[gnu::always_inline]] inline void UpdateMasked(const Grad& grad, const StepVectors<Ops>& k, const UpdatePointers& at,
                                                size_t i, size_t count, uint32_t counter0, typename Ops::I key,
                                                Magnitudes<Ops>* seen) {
  using F = typename Ops::F;
  using I = typename Ops::I;
  const auto mask = Ops::FirstN(count);
  const F g = grad.At(i, mask);
  F p = Ops::LoadF32(at.master_in + i, mask);
  F m = LoadV<Ops, kM>(at.exp_avg_in, i, mask);
  F v = LoadV<Ops, kM>(at.exp_avg_sq_in, i, mask);
  AdamMath<Ops, kD>(k, g, &p, &m, &v);
  Ops::StoreF32(at.master + i, p, mask);
  seen->largest = Ops::MaxMagnitude(seen->largest, p, mask);  // the masked-off lanes may hold 0/0
  if constexpr (kM == DType::kFloat32) {
    Ops::StoreF32(static_cast<float*>(at.exp_avg) + i, m, mask);
    Ops::StoreF32(static_cast<float*>(at.exp_avg_sq) + i, v, mask);
  } else {
    I lo, hi;
    Ops::HashSplit(Ops::WeylCounter(counter0, kRandomWeyl), key, Ops::SetI(kRandomHash1), Ops::SetI(kRandomHash2), &lo,
                   &hi);
    Ops::StoreHigh16(static_cast<uint16_t*>(at.exp_avg) + i, Ops::StochasticWord(m, lo), mask);
    Ops::StoreHigh16(static_cast<uint16_t*>(at.exp_avg_sq) + i, Ops::StochasticWord(v, hi), mask);
  }
  StoreUploadMaskedV<Ops, kU>(at.upload, i, p, mask);
}

// Elements [i, end), fewer than a few vectors: masked vectors where the Ops have masks, else the scalar
// reference. bf16 moments: key is RandomKey of the range's high 32 index bits (all of [i, end) share them).
template <class Ops, DType kG, DType kM, UploadKind kU, bool kD, class Grad>
inline void UpdateRest(const Grad& grad, const StepVectors<Ops>& k, const UpdatePointers& at, const GradSources& grads,
                       const StepConstants& c, const MomentBuffers& moments, const Upload& upload, size_t i, size_t end,
                       uint32_t key, Magnitudes<Ops>* seen) {
  if constexpr (Ops::kMasked) {
    const typename Ops::I key_v = Ops::MixKey(key);
    for (; i < end; i += Ops::kLanes) {
      const uint32_t counter0 = static_cast<uint32_t>(moments.element_base + i) * kRandomWeyl;
      UpdateMasked<Ops, kG, kM, kU, kD>(grad, k, at, i, std::min(end - i, Ops::kLanes), counter0, key_v, seen);
    }
  } else {
    const StateIn in{at.master_in, at.exp_avg_in, at.exp_avg_sq_in};
    for (; i < end; ++i) {
      const float p = UpdateElement<kG, kM, kU, kD>(grads, c, in, at.master, moments, upload, i);
      seen->scalar = std::max(seen->scalar, MagnitudeBits(p));
    }
  }
}

// A whole fp32 vector at p, streamed or not.
template <class Ops>
[[gnu::always_inline]] inline void StoreStateV(float* p, typename Ops::F v, bool stream) {
  stream ? Ops::StreamF32(p, v) : Ops::StoreF32(p, v);
}

// fp32 moments: one vector per iteration over [i, end); returns where it stopped (< kLanes before end).
template <class Ops, DType kG, UploadKind kU, bool kD, class Grad>
size_t UpdateVectorsF32(const Grad& grad, const StepVectors<Ops>& k, const UpdatePointers& at, size_t i, size_t end,
                        Streams streams, Magnitudes<Ops>* seen) {
  using F = typename Ops::F;
  const float* const master_in = at.master_in;
  const auto* const exp_avg_in = static_cast<const float*>(at.exp_avg_in);
  const auto* const exp_avg_sq_in = static_cast<const float*>(at.exp_avg_sq_in);
  float* const master = at.master;
  float* const exp_avg = static_cast<float*>(at.exp_avg);
  float* const exp_avg_sq = static_cast<float*>(at.exp_avg_sq);
  void* const upload = at.upload;
  typename Ops::I largest = seen->largest;
  for (; i + Ops::kLanes <= end; i += Ops::kLanes) {
    const F g = grad.At(i);
    F p = Ops::LoadF32(master_in + i), m = Ops::LoadF32(exp_avg_in + i), v = Ops::LoadF32(exp_avg_sq_in + i);
    AdamMath<Ops, kD>(k, g, &p, &m, &v);
    StoreStateV<Ops>(master + i, p, streams.state);
    StoreStateV<Ops>(exp_avg + i, m, streams.state);
    StoreStateV<Ops>(exp_avg_sq + i, v, streams.state);
    largest = Ops::MaxMagnitude(largest, p);
    StoreUploadV<Ops, kU>(upload, i, p, streams.upload);
  }
  seen->largest = largest;
  return i;
}

// bf16 moments with stochastic rounding over [i, end), whose global indices share their high 32 bits (key =
// RandomKey of them): two vectors per iteration, so each bf16 stream is one full-width load and one
// full-width store (one word permute packs two vectors); returns where it stopped (fewer than 2 * kLanes
// before end with masks, fewer than kLanes without). One hash per element (RandomBits: its low 16 bits round
// exp_avg, its high 16 bits exp_avg_sq).
template <class Ops, DType kG, UploadKind kU, bool kD, class Grad>
size_t UpdateVectorsBF16(const Grad& grad, const StepVectors<Ops>& k, const UpdatePointers& at, size_t i, size_t end,
                         Streams streams, uint32_t key, uint64_t element_base, Magnitudes<Ops>* seen) {
  using F = typename Ops::F;
  using I = typename Ops::I;
  constexpr size_t kLanes = Ops::kLanes;
  const float* const master_in = at.master_in;
  const auto* const exp_avg_in = static_cast<const uint16_t*>(at.exp_avg_in);
  const auto* const exp_avg_sq_in = static_cast<const uint16_t*>(at.exp_avg_sq_in);
  float* const master = at.master;
  auto* const exp_avg = static_cast<uint16_t*>(at.exp_avg);
  auto* const exp_avg_sq = static_cast<uint16_t*>(at.exp_avg_sq);
  void* const upload = at.upload;
  const I key_v = Ops::MixKey(key), h1 = Ops::SetI(kRandomHash1), h2 = Ops::SetI(kRandomHash2);
  const I step = Ops::SetI(static_cast<uint32_t>(kLanes) * kRandomWeyl);
  I counter = Ops::WeylCounter(static_cast<uint32_t>(element_base + i) * kRandomWeyl, kRandomWeyl);
  I largest = seen->largest;
  for (; i + 2 * kLanes <= end; i += 2 * kLanes) {
    F g0, g1, m0, m1, v0, v1;
    grad.At2(i, &g0, &g1);
    F p0 = Ops::LoadF32(master_in + i), p1 = Ops::LoadF32(master_in + i + kLanes);
    LoadV2<Ops, DType::kBFloat16>(exp_avg_in, i, &m0, &m1);
    LoadV2<Ops, DType::kBFloat16>(exp_avg_sq_in, i, &v0, &v1);
    AdamMath<Ops, kD>(k, g0, &p0, &m0, &v0);
    AdamMath<Ops, kD>(k, g1, &p1, &m1, &v1);
    StoreStateV<Ops>(master + i, p0, streams.state);
    StoreStateV<Ops>(master + i + kLanes, p1, streams.state);
    largest = Ops::MaxMagnitude(Ops::MaxMagnitude(largest, p0), p1);
    I lo0, hi0, lo1, hi1;
    Ops::HashSplit(counter, key_v, h1, h2, &lo0, &hi0);
    Ops::HashSplit(Ops::AddI(counter, step), key_v, h1, h2, &lo1, &hi1);
    counter = Ops::AddI(counter, Ops::AddI(step, step));
    if (streams.state) {
      Ops::StreamHigh16x2(exp_avg + i, Ops::StochasticWord(m0, lo0), Ops::StochasticWord(m1, lo1));
      Ops::StreamHigh16x2(exp_avg_sq + i, Ops::StochasticWord(v0, hi0), Ops::StochasticWord(v1, hi1));
    } else {
      Ops::StoreHigh16x2(exp_avg + i, Ops::StochasticWord(m0, lo0), Ops::StochasticWord(m1, lo1));
      Ops::StoreHigh16x2(exp_avg_sq + i, Ops::StochasticWord(v0, hi0), Ops::StochasticWord(v1, hi1));
    }
    if constexpr (kU == UploadKind::kBFloat16) {
      Ops::StoreBF16x2(static_cast<uint16_t*>(upload) + i, p0, p1, streams.upload);
    } else {
      StoreUploadV<Ops, kU>(upload, i, p0, streams.upload);
      StoreUploadV<Ops, kU>(upload, i + kLanes, p1, streams.upload);
    }
  }
  if constexpr (!Ops::kMasked) {  // one more whole vector, so at most kLanes - 1 are left to the scalar tail
    if (i + kLanes <= end) {
      const F g = grad.At(i);
      F p = Ops::LoadF32(master_in + i), m = LoadV<Ops, DType::kBFloat16>(exp_avg_in, i),
        v = LoadV<Ops, DType::kBFloat16>(exp_avg_sq_in, i);
      AdamMath<Ops, kD>(k, g, &p, &m, &v);
      Ops::StoreF32(master + i, p);
      largest = Ops::MaxMagnitude(largest, p);
      I lo, hi;
      Ops::HashSplit(counter, key_v, h1, h2, &lo, &hi);
      Ops::StoreHigh16(exp_avg + i, Ops::StochasticWord(m, lo));
      Ops::StoreHigh16(exp_avg_sq + i, Ops::StochasticWord(v, hi));
      StoreUploadV<Ops, kU>(upload, i, p, streams.upload);
      i += kLanes;
    }
  }
  seen->largest = largest;
  return i;
}

// `reader` is copied in and back out: a local reader, whose address does not escape, keeps its fields in
// registers across the loop's stores (the vector types may alias anything).
template <class Ops, DType kG, DType kM, UploadKind kU, bool kD, class Grad>
bool UpdateRange(Grad& reader, const GradSources& grads, const StepConstants& c, const StateIn& in, float* master,
                 const MomentBuffers& moments, const Upload& upload, size_t n) {
  const Grad grad = reader;
  const StepVectors<Ops> k(c);
  const UpdatePointers at{in.master,       in.exp_avg,         in.exp_avg_sq, master,
                          moments.exp_avg, moments.exp_avg_sq, upload.data};
  Magnitudes<Ops> seen;
  Streams streams;
  size_t peel = UpdatePeel<Ops, kM, kU>(at, n, &streams);
  const bool fence = streams.any();
  if constexpr (kM == DType::kFloat32) {
    UpdateRest<Ops, kG, kM, kU, kD>(grad, k, at, grads, c, moments, upload, 0, peel, 0, &seen);
    const size_t i = UpdateVectorsF32<Ops, kG, kU, kD>(grad, k, at, peel, n, streams, &seen);
    UpdateRest<Ops, kG, kM, kU, kD>(grad, k, at, grads, c, moments, upload, i, n, 0, &seen);
  } else {
    // The hash key changes where the global index crosses a multiple of 2^32: one segment per key (in
    // practice one). The streams need the alignment peel in the first segment; a segment's tail leaves
    // the next one unaligned: no streaming after it.
    size_t i = 0;
    while (true) {
      const uint64_t index = moments.element_base + i;
      const uint64_t to_boundary = (uint64_t{1} << 32) - (index & 0xFFFFFFFFu);
      const size_t end = to_boundary < n - i ? i + static_cast<size_t>(to_boundary) : n;
      const uint32_t key = RandomKey(c.sr_seed, index >> 32);
      if (peel > end - i) streams = {}, peel = 0;  // the peel would cross the boundary: no streaming
      UpdateRest<Ops, kG, kM, kU, kD>(grad, k, at, grads, c, moments, upload, i, i + peel, key, &seen);
      i = UpdateVectorsBF16<Ops, kG, kU, kD>(grad, k, at, i + peel, end, streams, key, moments.element_base, &seen);
      UpdateRest<Ops, kG, kM, kU, kD>(grad, k, at, grads, c, moments, upload, i, end, key, &seen);
      i = end, peel = 0;
      if (end == n) break;
      streams = {};
    }
  }
  if (fence) Ops::StreamFence();  // streamed stores are weakly ordered: publish before completion
  reader = grad;
  return seen.NonFinite();
}

// The squared norm of [0, n) as SimdSumOfSquares defines it, bit for bit: whole vectors from element 0
// into `acc` in order, its total, then the remaining elements one by one. `acc` may hold the vectors
// before `i` already (an update's reads, NormingReader); this adds the rest.
template <class Ops, DType kG>
double FinishSquares(const GradSources& grads, size_t n, typename Ops::SquareSum acc, size_t i, bool* nonfinite) {
  const GradReader<Ops, kG, false> grad(grads);
  for (; i + Ops::kLanes <= n; i += Ops::kLanes) Ops::AddSquares(acc, grad.At(i));
  double sum = Ops::Total(acc);
  for (; i < n; ++i) {
    const double g = GradElement<kG>(grads, i);
    sum += g * g;
  }
  // A non-finite g makes the sum non-finite, and finite squares cannot overflow a double sum.
  if (!(sum - sum == 0) && nonfinite != nullptr) *nonfinite = true;
  return sum;
}

// A GradReader whose whole-vector reads, while they run in order from element 0 (the update's main loop
// where its stores need no alignment peel), also add their squares as FinishSquares would; a masked or
// out-of-order read stops the adding, and FinishSquares does the rest from next().
template <class Ops, class Inner>
class NormingReader {
 public:
  using F = typename Ops::F;
  explicit NormingReader(const GradSources& grads) : inner_(grads) {}
  [[gnu::always_inline]] F At(size_t i) const {
    const F g = inner_.At(i);
    Note(i, g);
    return g;
  }
  template <class Mask>
  [[gnu::always_inline]] F At(size_t i, Mask mask) const {
    return inner_.At(i, mask);
  }
  [[gnu::always_inline]] void At2(size_t i, F* a, F* b) const {
    inner_.At2(i, a, b);
    Note(i, *a);
    Note(i + Ops::kLanes, *b);
  }
  [[nodiscard]] size_t next() const { return next_; }
  [[nodiscard]] const typename Ops::SquareSum& squares() const { return squares_; }

 private:
  [[gnu::always_inline]] void Note(size_t i, F g) const {
    if (i != next_) return;
    Ops::AddSquares(squares_, g);
    next_ += Ops::kLanes;
  }
  Inner inner_;
  mutable typename Ops::SquareSum squares_;
  mutable size_t next_ = 0;
};

// The update with g read by `Reader<kG, one source>`: GradReader, or NormingReader around it.
template <class Ops, template <DType, bool> class Reader, class After>
bool SimdUpdateWith(const GradSources& grads, const AdamWStep& step, const StateIn& in, float* master,
                    const MomentBuffers& moments, const Upload& upload, size_t n, After after) {
  const StepConstants c(step, moments);
  const bool one = grads.slots.size() == 1 && grads.accum == nullptr;
  bool nonfinite = false;
  DispatchUpdate(grads.dtype, moments.dtype, UploadKindOf(upload), step.decoupled,
                 [&]<DType kG, DType kM, UploadKind kU, bool kD>() {
                   auto run = [&]<bool kOne>() {
                     Reader<kG, kOne> grad(grads);
                     nonfinite = UpdateRange<Ops, kG, kM, kU, kD>(grad, grads, c, in, master, moments, upload, n);
                     after.template operator()<kG>(grad);
                   };
                   one ? run.template operator()<true>() : run.template operator()<false>();
                 });
  return nonfinite;
}

template <class Ops>
struct PlainReader {
  template <DType kG, bool kOne>
  using Type = GradReader<Ops, kG, kOne>;
};
template <class Ops>
struct SquaringReader {
  template <DType kG, bool kOne>
  using Type = NormingReader<Ops, GradReader<Ops, kG, kOne>>;
};

template <class Ops>
bool SimdUpdate(const GradSources& grads, const AdamWStep& step, const StateIn& in, float* master,
                const MomentBuffers& moments, const Upload& upload, size_t n) {
  return SimdUpdateWith<Ops, PlainReader<Ops>::template Type>(grads, step, in, master, moments, upload, n,
                                                              []<DType>(const auto&) {});
}

template <class Ops>
bool SimdUpdateWithNorm(const GradSources& grads, const AdamWStep& step, const StateIn& in, float* master,
                        const MomentBuffers& moments, const Upload& upload, size_t n, double* sum_of_squares,
                        bool* nonfinite) {
  return SimdUpdateWith<Ops, SquaringReader<Ops>::template Type>(
      grads, step, in, master, moments, upload, n, [&]<DType kG>(const auto& reader) {
        *sum_of_squares = FinishSquares<Ops, kG>(grads, n, reader.squares(), reader.next(), nonfinite);
      });
}

template <class Ops>
double SimdSumOfSquares(const GradSources& grads, size_t n, bool* nonfinite) {
  double sum = 0;
  DispatchGrad(grads.dtype, [&]<DType kG>() { sum = FinishSquares<Ops, kG>(grads, n, {}, 0, nonfinite); });
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
  static const KernelTable table{name,
                                 &SimdUpdate<Ops>,
                                 &SimdSumOfSquares<Ops>,
                                 &SimdUpdateWithNorm<Ops>,
                                 &SimdAccumulate<Ops>,
                                 &SimdConvertMaster<Ops>};
  return table;
}

}  // namespace
}  // namespace trainstream::optimizer
