// The vector operations the SIMD kernel body (simd_kernels-inl.h) needs, for AVX2 + F16C: 8 fp32
// lanes. Include only from a translation unit compiled with -mavx2 -mf16c. Same bit-exact conversions
// as simd_ops_avx512.h.
#pragma once

#include "daemon/optimizer/immintrin_quiet.h"

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

  // No masked vectors: heads and tails run the scalar reference.
  static constexpr bool kMasked = false;
  static void LoadBF16x2(const uint16_t* p, F* a, F* b) { *a = LoadBF16(p), *b = LoadBF16(p + kLanes); }

  static void StoreF32(float* p, F v) { _mm256_storeu_ps(p, v); }
  static void StreamF32(float* p, F v) { _mm256_stream_ps(p, v); }

  static __m256i RoundBF16(F v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded =
        _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
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

  // ---- bf16 stochastic rounding of the moments (float_convert.h), on 32-bit "words" (bf16 in the high half).
  using I = __m256i;
  static I WeylCounter(uint32_t c0_times_weyl, uint32_t weyl) {
    const I lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(c0_times_weyl)),
                            _mm256_mullo_epi32(lanes, _mm256_set1_epi32(static_cast<int>(weyl))));
  }
  static I SetI(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
  static I AddI(I a, I b) { return _mm256_add_epi32(a, b); }
  // Per lane, the larger of `largest` and v's |bits| (MagnitudeBits).
  static I MaxMagnitude(I largest, F v) {
    return _mm256_max_epu32(largest, _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0x7fffffff)));
  }
  static uint32_t MaxLane(I v) {
    const __m128i half = _mm_max_epu32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    const __m128i quarter = _mm_max_epu32(half, _mm_shuffle_epi32(half, _MM_SHUFFLE(1, 0, 3, 2)));
    return static_cast<uint32_t>(_mm_cvtsi128_si32(_mm_max_epu32(quarter, _mm_shuffle_epi32(quarter, 1))));
  }
  static I MixKey(uint32_t key) { return SetI(key ^ (key >> 16)); }  // see Avx512Ops::HashSplit
  static void HashSplit(I x, I mixed_key, I h1, I h2, I* low16, I* high16) {
    x = _mm256_xor_si256(_mm256_xor_si256(x, mixed_key), _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, h1);
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
    x = _mm256_mullo_epi32(x, h2);
    const I high = _mm256_srli_epi32(x, 16);
    *high16 = high;
    *low16 = _mm256_and_si256(_mm256_xor_si256(x, high), _mm256_set1_epi32(0xFFFF));
  }
  static I StochasticWord(F v, I random16) {
    const I bits = _mm256_castps_si256(v);
    const I nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const I quiet = _mm256_or_si256(bits, _mm256_set1_epi32(0x400000));
    return _mm256_blendv_epi8(_mm256_add_epi32(bits, random16), quiet, nan);
  }
  static I NearestWord(F v) {
    const I bits = _mm256_castps_si256(v);
    const I lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const I rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
    const I nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(rounded, _mm256_or_si256(bits, _mm256_set1_epi32(0x400000)), nan);
  }
  static void StoreHigh16(uint16_t* p, I w) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), Narrow(_mm256_srli_epi32(w, 16)));
  }
  // High halves of a's lanes then b's lanes (packus within 128-bit halves, then put the quadwords in order).
  static I PackHigh16(I a, I b) {
    const I packed = _mm256_packus_epi32(_mm256_srli_epi32(a, 16), _mm256_srli_epi32(b, 16));  // a0-3 b0-3 | a4-7 b4-7
    return _mm256_permute4x64_epi64(packed, _MM_SHUFFLE(3, 1, 2, 0));
  }
  static void StoreHigh16x2(uint16_t* p, I a, I b) { _mm256_storeu_si256(reinterpret_cast<I*>(p), PackHigh16(a, b)); }
  static void StreamHigh16x2(uint16_t* p, I a, I b) { _mm256_stream_si256(reinterpret_cast<I*>(p), PackHigh16(a, b)); }
  static void StoreBF16x2(uint16_t* p, F a, F b, bool stream) {
    const I w = PackHigh16(NearestWord(a), NearestWord(b));
    stream ? _mm256_stream_si256(reinterpret_cast<I*>(p), w) : _mm256_storeu_si256(reinterpret_cast<I*>(p), w);
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
