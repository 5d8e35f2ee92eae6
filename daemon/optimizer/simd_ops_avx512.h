// The vector operations the SIMD kernel body (simd_kernels-inl.h) needs, for AVX-512 (F, DQ, BW, VL):
// 16 fp32 lanes. Include only from a translation unit compiled with those -m flags.
//
// Conversions are the bit-exact vector forms of float_convert.h: bf16 round-to-nearest-even and
// stochastic rounding in integer arithmetic (not VCVTNEPS2BF16 of avx512_bf16, which flushes
// denormals, so it would differ from torch and the scalar reference; the integer form costs ~4 ops per
// 16 elements, nothing at the bandwidth limit), fp16 via VCVTPS2PH with round-to-nearest-even.
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

struct Avx512Ops {
  static constexpr size_t kLanes = 16;
  static constexpr size_t kStreamAlign = 64;  // bytes: widest non-temporal store we issue
  using F = __m512;

  static F Zero() { return _mm512_setzero_ps(); }
  static F Set(float x) { return _mm512_set1_ps(x); }
  static F Add(F a, F b) { return _mm512_add_ps(a, b); }
  static F Sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F Mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F Div(F a, F b) { return _mm512_div_ps(a, b); }
  static F Sqrt(F a) { return _mm512_sqrt_ps(a); }

  static F LoadF32(const float* p) { return _mm512_loadu_ps(p); }
  static F LoadBF16(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static F LoadF16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }

  static void StoreF32(float* p, F v) { _mm512_storeu_ps(p, v); }
  static void StreamF32(float* p, F v) { _mm512_stream_ps(p, v); }

  // fp32 bits -> bf16 bits in the low half of each 32-bit lane, round to nearest even; NaN stays NaN.
  static __m512i RoundBF16(F v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
    return _mm512_mask_mov_epi32(rounded, nan, quiet);
  }
  static __m256i Narrow(__m512i v) { return _mm512_cvtepi32_epi16(v); }  // low 16 bits of each lane

  static void StoreBF16(uint16_t* p, F v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), Narrow(RoundBF16(v)));
  }
  static void StreamBF16(uint16_t* p, F v) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), Narrow(RoundBF16(v)));
  }
  static void StoreF16(uint16_t* p, F v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static void StreamF16(uint16_t* p, F v) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }

  // RandomBits(seed, index0 + k) for lanes k = 0..15, given z0 = seed + index0 * golden.
  static __m512i Random32(uint64_t z0, uint64_t golden, uint64_t mix1, uint64_t mix2) {
    const __m512i lanes = _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7);
    const __m512i step = _mm512_set1_epi64(static_cast<long long>(golden));
    const __m512i z_lo = _mm512_add_epi64(_mm512_set1_epi64(static_cast<long long>(z0)), _mm512_mullo_epi64(lanes, step));
    const __m512i z_hi = _mm512_add_epi64(z_lo, _mm512_set1_epi64(static_cast<long long>(golden * 8)));
    const __m512i m1 = _mm512_set1_epi64(static_cast<long long>(mix1));
    const __m512i m2 = _mm512_set1_epi64(static_cast<long long>(mix2));
    auto mix = [&](__m512i z) {
      z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 30)), m1);
      z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 27)), m2);
      return _mm512_srli_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 31)), 16);
    };
    const __m256i lo = _mm512_cvtepi64_epi32(mix(z_lo));  // low 32 bits of each 64-bit lane
    const __m256i hi = _mm512_cvtepi64_epi32(mix(z_hi));
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  }
  static __m512i Low16(__m512i bits) { return _mm512_and_si512(bits, _mm512_set1_epi32(0xFFFF)); }
  static __m512i High16(__m512i bits) { return _mm512_srli_epi32(bits, 16); }

  // Stochastic rounding to bf16 (finite: add 16 random low bits, truncate; inf/NaN: as RoundBF16).
  static void StoreBF16Stochastic(uint16_t* p, F v, __m512i random16) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i sr = _mm512_srli_epi32(_mm512_add_epi32(bits, random16), 16);
    const __m512i exponent = _mm512_and_si512(bits, _mm512_set1_epi32(0x7F800000));
    const __mmask16 nonfinite = _mm512_cmpeq_epi32_mask(exponent, _mm512_set1_epi32(0x7F800000));
    const __m512i result = _mm512_mask_mov_epi32(sr, nonfinite, RoundBF16(v));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), Narrow(result));
  }

  // Sum of squares in double: two accumulators of 8 doubles.
  struct SquareSum {
    __m512d a = _mm512_setzero_pd(), b = _mm512_setzero_pd();
  };
  static void AddSquares(SquareSum& acc, F v) {
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
    const __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    acc.a = _mm512_add_pd(acc.a, _mm512_mul_pd(lo, lo));
    acc.b = _mm512_add_pd(acc.b, _mm512_mul_pd(hi, hi));
  }
  static double Total(const SquareSum& acc) { return _mm512_reduce_add_pd(_mm512_add_pd(acc.a, acc.b)); }

  static void StreamFence() { _mm_sfence(); }
};

}  // namespace
}  // namespace trainstream::optimizer
