// The vector operations the SIMD kernel body (simd_kernels-inl.h) needs, for AVX2 + F16C: 8 fp32
// lanes. Include only from a translation unit compiled with -mavx2 -mf16c. Same bit-exact conversions
// as simd_ops_avx512.h; 64-bit lane multiplies (for the stochastic-rounding hash) are emulated with
// three 32x32->64 multiplies.
#pragma once

// GCC 12's AVX-512 headers trip -Wuninitialized on their own _mm512_undefined_* (GCC bug 105593, fixed in
// 13); the warning is attributed to the header, so silencing it around the include is enough.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <cstddef>
#include <cstdint>

namespace trainstream::optimizer {
namespace {  // internal linkage: compiled only into this ISA's translation unit

struct Avx2Ops {
  static constexpr size_t kLanes = 8;
  static constexpr size_t kStreamAlign = 32;
  using F = __m256;

  static F Zero() { return _mm256_setzero_ps(); }
  static F Set(float x) { return _mm256_set1_ps(x); }
  static F Add(F a, F b) { return _mm256_add_ps(a, b); }
  static F Sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F Mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F Div(F a, F b) { return _mm256_div_ps(a, b); }
  static F Sqrt(F a) { return _mm256_sqrt_ps(a); }

  static F LoadF32(const float* p) { return _mm256_loadu_ps(p); }
  static F LoadBF16(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static F LoadF16(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

  static void StoreF32(float* p, F v) { _mm256_storeu_ps(p, v); }
  static void StreamF32(float* p, F v) { _mm256_stream_ps(p, v); }

  static __m256i RoundBF16(F v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(rounded, quiet, nan);
  }
  // Lanes hold values <= 0xFFFF, so the unsigned-saturating pack is an exact narrowing.
  static __m128i Narrow(__m256i v) {
    return _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  }

  static void StoreBF16(uint16_t* p, F v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), Narrow(RoundBF16(v))); }
  static void StreamBF16(uint16_t* p, F v) { _mm_stream_si128(reinterpret_cast<__m128i*>(p), Narrow(RoundBF16(v))); }
  static void StoreF16(uint16_t* p, F v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static void StreamF16(uint16_t* p, F v) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }

  static __m256i MulLo64(__m256i a, __m256i b_lo, __m256i b_hi) {  // a * b mod 2^64, b split in 32-bit halves
    const __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a, 32), b_lo), _mm256_mul_epu32(a, b_hi));
    return _mm256_add_epi64(_mm256_mul_epu32(a, b_lo), _mm256_slli_epi64(cross, 32));
  }

  // RandomBits(seed, index0 + k) for lanes k = 0..7, given z0 = seed + index0 * golden.
  static __m256i Random32(uint64_t z0, uint64_t golden, uint64_t mix1, uint64_t mix2) {
    auto ll = [](uint64_t x) { return static_cast<long long>(x); };
    const __m256i z_lo = _mm256_setr_epi64x(ll(z0), ll(z0 + golden), ll(z0 + 2 * golden), ll(z0 + 3 * golden));
    const __m256i z_hi = _mm256_add_epi64(z_lo, _mm256_set1_epi64x(ll(4 * golden)));
    const __m256i m1_lo = _mm256_set1_epi64x(ll(mix1 & 0xFFFFFFFFu)), m1_hi = _mm256_set1_epi64x(ll(mix1 >> 32));
    const __m256i m2_lo = _mm256_set1_epi64x(ll(mix2 & 0xFFFFFFFFu)), m2_hi = _mm256_set1_epi64x(ll(mix2 >> 32));
    auto mix = [&](__m256i z) {
      z = MulLo64(_mm256_xor_si256(z, _mm256_srli_epi64(z, 30)), m1_lo, m1_hi);
      z = MulLo64(_mm256_xor_si256(z, _mm256_srli_epi64(z, 27)), m2_lo, m2_hi);
      return _mm256_srli_epi64(_mm256_xor_si256(z, _mm256_srli_epi64(z, 31)), 16);
    };
    // Gather the low 32 bits of the 8 64-bit lanes, in order.
    const __m256 packed = _mm256_shuffle_ps(_mm256_castsi256_ps(mix(z_lo)), _mm256_castsi256_ps(mix(z_hi)),
                                            _MM_SHUFFLE(2, 0, 2, 0));  // lo0 lo1 hi0 hi1 | lo2 lo3 hi2 hi3
    return _mm256_permute4x64_epi64(_mm256_castps_si256(packed), _MM_SHUFFLE(3, 1, 2, 0));
  }
  static __m256i Low16(__m256i bits) { return _mm256_and_si256(bits, _mm256_set1_epi32(0xFFFF)); }
  static __m256i High16(__m256i bits) { return _mm256_srli_epi32(bits, 16); }

  static void StoreBF16Stochastic(uint16_t* p, F v, __m256i random16) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i sr = _mm256_srli_epi32(_mm256_add_epi32(bits, random16), 16);
    const __m256i exp_mask = _mm256_set1_epi32(0x7F800000);
    const __m256i nonfinite = _mm256_cmpeq_epi32(_mm256_and_si256(bits, exp_mask), exp_mask);
    const __m256i result = _mm256_blendv_epi8(sr, RoundBF16(v), nonfinite);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), Narrow(result));
  }

  struct SquareSum {
    __m256d a = _mm256_setzero_pd(), b = _mm256_setzero_pd();
  };
  static void AddSquares(SquareSum& acc, F v) {
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
    const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
    acc.a = _mm256_add_pd(acc.a, _mm256_mul_pd(lo, lo));
    acc.b = _mm256_add_pd(acc.b, _mm256_mul_pd(hi, hi));
  }
  static double Total(const SquareSum& acc) {
    const __m256d s = _mm256_add_pd(acc.a, acc.b);
    const __m128d t = _mm_add_pd(_mm256_castpd256_pd128(s), _mm256_extractf128_pd(s, 1));
    return _mm_cvtsd_f64(_mm_add_sd(t, _mm_unpackhi_pd(t, t)));
  }

  static void StreamFence() { _mm_sfence(); }
};

}  // namespace
}  // namespace trainstream::optimizer
