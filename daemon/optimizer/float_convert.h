// Scalar conversions between fp32 and the 16-bit float formats, bit-exact with torch:
// round-to-nearest-even for bf16/fp16 stores, stochastic rounding for bf16 moments, and the
// counter-based random bits that drive it. The SIMD kernels reproduce these bit for bit.
//
// Everything here has internal linkage (unnamed namespace) on purpose: this header is included by
// translation units compiled with -mavx2 / -mavx512*, and an ordinary inline function emitted there
// could be picked by the linker for the portable code too, then crash with SIGILL on an older CPU.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "shm/dtype.h"

namespace trainstream::optimizer {
namespace {  // see the header comment: internal linkage per translation unit

inline float BF16ToFloat(uint16_t bits) {
  return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
}

inline uint16_t FloatToBF16(float value) {  // round to nearest even; NaN stays NaN
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  if (std::isnan(value)) return static_cast<uint16_t>((bits >> 16) | 0x40);
  const uint32_t rounding = 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

// Stochastic rounding: add 16 random low bits, truncate. E[result] == value for finite values.
inline uint16_t FloatToBF16Stochastic(float value, uint32_t random16) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  if (!std::isfinite(value)) return FloatToBF16(value);
  return static_cast<uint16_t>((bits + (random16 & 0xFFFF)) >> 16);
}

inline float HalfToFloat(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1F;
  uint32_t mantissa = bits & 0x3FF;
  if (exponent == 0) {
    if (mantissa == 0) return std::bit_cast<float>(sign);
    // subnormal: normalize
    int e = -1;
    do {
      ++e;
      mantissa <<= 1;
    } while ((mantissa & 0x400) == 0);
    mantissa &= 0x3FF;
    return std::bit_cast<float>(sign | static_cast<uint32_t>(127 - 15 - e) << 23 | mantissa << 13);
  }
  if (exponent == 0x1F) return std::bit_cast<float>(sign | 0x7F800000u | mantissa << 13);
  return std::bit_cast<float>(sign | (exponent + 127 - 15) << 23 | mantissa << 13);
}

inline uint16_t FloatToHalf(float value) {  // round to nearest even
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint32_t sign = (bits >> 16) & 0x8000;
  const uint32_t abs = bits & 0x7FFFFFFF;
  if (abs >= 0x7F800000) return static_cast<uint16_t>(sign | 0x7C00 | (abs > 0x7F800000 ? 0x200 : 0));
  if (abs >= 0x477FF000) return static_cast<uint16_t>(sign | 0x7C00);  // overflows to inf after rounding
  if (abs < 0x38800000) {  // result is subnormal or zero: let the FPU round via a magic add
    const float magic = std::bit_cast<float>(0x3F000000u);  // 0.5: shifts the mantissa into place
    const float f = std::bit_cast<float>(abs) + magic;
    return static_cast<uint16_t>(sign | (std::bit_cast<uint32_t>(f) - 0x3F000000u));
  }
  const uint32_t rounded = abs + 0xFFF + ((abs >> 13) & 1);
  return static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
}

inline float LoadAsFloat(const void* base, size_t i, DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return static_cast<const float*>(base)[i];
    case DType::kBFloat16: return BF16ToFloat(static_cast<const uint16_t*>(base)[i]);
    case DType::kFloat16: return HalfToFloat(static_cast<const uint16_t*>(base)[i]);
  }
  return 0;
}

inline void StoreFromFloat(void* base, size_t i, DType dtype, float value) {
  switch (dtype) {
    case DType::kFloat32: static_cast<float*>(base)[i] = value; break;
    case DType::kBFloat16: static_cast<uint16_t*>(base)[i] = FloatToBF16(value); break;
    case DType::kFloat16: static_cast<uint16_t*>(base)[i] = FloatToHalf(value); break;
  }
}

// Counter-based random bits: independent per (seed, element index), no state. Two parts:
//  - a 32-bit key per (seed, high 32 bits of the index): the splitmix64 finalizer, once per range
//    (and per 2^32-element segment), so every bit of the 64-bit seed and of the index reaches the key;
//  - per element, the 32-bit "lowbias32" integer hash (C. Wellons' 2-round multiply-xorshift, avalanche
//    bias ~0.17%) of (low 32 bits of the index * golden32) XOR key. The Weyl multiply spreads adjacent
//    indices over many bits before hashing; in the SIMD kernels it is one vector add per vector.
// 32-bit lanes keep the per-element hash at two 32-bit multiplies (vpmulld) instead of two 64-bit ones
// (vpmullq, 3 uops each on Intel; emulated with 3 vpmuludq on AVX2), which bounded the bf16-moment kernel.
// The SIMD kernels vectorize exactly this; change both or neither (tests compare them bit for bit).
inline constexpr uint64_t kRandomGolden = 0x9E3779B97F4A7C15ull;
inline constexpr uint64_t kRandomMix1 = 0xBF58476D1CE4E5B9ull;
inline constexpr uint64_t kRandomMix2 = 0x94D049BB133111EBull;
inline constexpr uint32_t kRandomWeyl = 0x9E3779B9u;  // golden ratio * 2^32, odd
inline constexpr uint32_t kRandomHash1 = 0x7FEB352Du;
inline constexpr uint32_t kRandomHash2 = 0x846CA68Bu;

// The key of every element whose index has these high 32 bits.
inline uint32_t RandomKey(uint64_t seed, uint64_t index_high32) {
  uint64_t z = seed + index_high32 * kRandomGolden;
  z = (z ^ (z >> 30)) * kRandomMix1;
  z = (z ^ (z >> 27)) * kRandomMix2;
  return static_cast<uint32_t>((z ^ (z >> 31)) >> 16);
}

// lowbias32 of x ^ key, where x = (low 32 bits of the index) * kRandomWeyl.
inline uint32_t RandomHash(uint32_t x, uint32_t key) {
  x ^= key;
  x ^= x >> 16;
  x *= kRandomHash1;
  x ^= x >> 15;
  x *= kRandomHash2;
  x ^= x >> 16;
  return x;
}

inline uint32_t RandomBits(uint64_t seed, uint64_t index) {
  return RandomHash(static_cast<uint32_t>(index) * kRandomWeyl, RandomKey(seed, index >> 32));
}

// One RandomBits(seed, element) serves both moments of an element: its low 16 bits round exp_avg, its
// high 16 bits round exp_avg_sq (one hash per element instead of two: the hash, not memory, bounds the
// bf16-moment kernels on few cores).
inline uint32_t ExpAvgRandom(uint32_t bits) {
  return bits & 0xFFFF;
}
inline uint32_t ExpAvgSqRandom(uint32_t bits) {
  return bits >> 16;
}

}  // namespace
}  // namespace trainstream::optimizer
