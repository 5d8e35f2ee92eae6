// The vector operations the SIMD kernel body (simd_kernels-inl.h) needs, for AVX-512 (F, DQ, BW, VL):
// 16 fp32 lanes. Include only from a translation unit compiled with those -m flags.
//
// Conversions are the bit-exact vector forms of float_convert.h: bf16 round-to-nearest-even and
// stochastic rounding in integer arithmetic (not VCVTNEPS2BF16 of avx512_bf16, which flushes
// denormals, so it would differ from torch and the scalar reference), fp16 via VCVTPS2PH with
// round-to-nearest-even. Avx512Bf16Ops (below) uses VCVTNE2PS2BF16 for the RNE upload with a denormal fixup.
#pragma once

#include "daemon/optimizer/immintrin_quiet.h"

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
  // 2 * kLanes bf16 -> elements 0-15 in *a, 16-31 in *b. One 64-byte load; each half is one word permute
  // (VPERMW) that puts word k of the half into the high half of lane k and zeroes the low halves, instead of
  // a widening load and a shift per vector.
  static void LoadBF16x2(const uint16_t* p, F* a, F* b) {
    const __m512i x = _mm512_loadu_si512(p);
    const __m512i low = _mm512_setr_epi32(0 << 16, 1 << 16, 2 << 16, 3 << 16, 4 << 16, 5 << 16, 6 << 16, 7 << 16,
                                          8 << 16, 9 << 16, 10 << 16, 11 << 16, 12 << 16, 13 << 16, 14 << 16, 15 << 16);
    const __m512i high = _mm512_add_epi32(low, _mm512_set1_epi32(16 << 16));
    constexpr __mmask32 kOddWords = 0xAAAAAAAAu;
    *a = _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(kOddWords, low, x));
    *b = _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(kOddWords, high, x));
  }

  // Masked vectors: the first n lanes (n <= kLanes) of loads and stores, the others read as zero and left
  // alone (no fault past the end of a buffer). Heads and tails of the update run as masked vectors.
  static constexpr bool kMasked = true;
  using Mask = __mmask16;
  static Mask FirstN(size_t n) { return static_cast<Mask>((1u << n) - 1); }
  static F LoadF32(const float* p, Mask m) { return _mm512_maskz_loadu_ps(m, p); }
  static F LoadBF16(const uint16_t* p, Mask m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
  }
  static F LoadF16(const uint16_t* p, Mask m) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)); }
  static void StoreF32(float* p, F v, Mask m) { _mm512_mask_storeu_ps(p, m, v); }
  static void StoreBF16(uint16_t* p, F v, Mask m) { _mm256_mask_storeu_epi16(p, m, Narrow(RoundBF16(v))); }
  static void StoreF16(uint16_t* p, F v, Mask m) {
    _mm256_mask_storeu_epi16(p, m, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }

  static void StoreF32(float* p, F v) { _mm512_storeu_ps(p, v); }
  static void StreamF32(float* p, F v) { _mm512_stream_ps(p, v); }

  // fp32 bits -> bf16 bits in the low half of each 32-bit lane, round to nearest even; NaN stays NaN.
  static __m512i RoundBF16(F v) { return _mm512_srli_epi32(NearestWord(v), 16); }
  static __m256i Narrow(__m512i v) { return _mm512_cvtepi32_epi16(v); }  // low 16 bits of each lane

  static void StoreBF16(uint16_t* p, F v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), Narrow(RoundBF16(v))); }
  static void StreamBF16(uint16_t* p, F v) { _mm256_stream_si256(reinterpret_cast<__m256i*>(p), Narrow(RoundBF16(v))); }
  static void StoreF16(uint16_t* p, F v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static void StreamF16(uint16_t* p, F v) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }

  // ---- bf16 stochastic rounding of the moments (float_convert.h), on 32-bit "words": the bf16 result is
  // the high half of each 32-bit lane, so two vectors pack into one store with a single word permute.
  using I = __m512i;
  // Lane k: (c0 + k) * kRandomWeyl, the hash counter of element c0 + k (mod 2^32), and its step per vector.
  static I WeylCounter(uint32_t c0_times_weyl, uint32_t weyl) {
    const I lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(c0_times_weyl)),
                            _mm512_mullo_epi32(lanes, _mm512_set1_epi32(static_cast<int>(weyl))));
  }
  static I SetI(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
  static I AddI(I a, I b) { return _mm512_add_epi32(a, b); }
  // Per lane, the larger of `largest` and v's |bits| (MagnitudeBits); the masked form leaves the lanes
  // outside the mask as they were.
  static I MaxMagnitude(I largest, F v) {
    return _mm512_max_epu32(largest, _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7fffffff)));
  }
  static I MaxMagnitude(I largest, F v, Mask m) {
    return _mm512_mask_max_epu32(largest, m, largest,
                                 _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7fffffff)));
  }
  static uint32_t MaxLane(I v) { return _mm512_reduce_max_epu32(v); }
  // The key as HashSplit takes it: x ^= key; x ^= x >> 16 is x ^ (x >> 16) ^ (key ^ key >> 16).
  static I MixKey(uint32_t key) { return SetI(key ^ (key >> 16)); }
  // RandomHash(x, key) per lane, split into its low 16 bits (exp_avg) and high 16 bits (exp_avg_sq);
  // mixed_key: MixKey(key); h1, h2: the multipliers, broadcast. The final x ^= x >> 16 leaves the high half
  // as it is and is folded into the low-half mask (one vpternlogd), the key xor into the first xorshift.
  static void HashSplit(I x, I mixed_key, I h1, I h2, I* low16, I* high16) {
    x = _mm512_ternarylogic_epi32(x, _mm512_srli_epi32(x, 16), mixed_key, 0x96);  // a ^ b ^ c
    x = _mm512_mullo_epi32(x, h1);
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_mullo_epi32(x, h2);
    const I high = _mm512_srli_epi32(x, 16);
    *high16 = high;
    *low16 = _mm512_ternarylogic_epi32(x, high, _mm512_set1_epi32(0xFFFF), 0x28);  // (a ^ b) & c
  }
  // Stochastic rounding word: finite and inf: bits + random16 (inf + r < 2^16 stays inf); NaN: quieted, as
  // RoundBF16 (bits | 0x400000). High halves equal FloatToBF16Stochastic.
  static I StochasticWord(F v, I random16) {
    const I sum = _mm512_add_epi32(_mm512_castps_si512(v), random16);
    return _mm512_castps_si512(QuietNaNs(_mm512_castsi512_ps(sum), v));
  }
  // `word` where v is not NaN, v with the quiet bit set (bits | 0x400000) where it is: one VFIXUPIMMPS
  // (classifies v; token 2, QNaN(src), for QNaN and SNaN, token 0, keep the destination, for every other
  // class) instead of a compare into a mask and a masked OR. Not an arithmetic operation on `word`.
  static F QuietNaNs(F word, F v) { return _mm512_fixupimm_ps(word, v, _mm512_set1_epi32(0x22), 0); }
  // Round-to-nearest-even word (high halves equal FloatToBF16).
  static I NearestWord(F v) {
    const I bits = _mm512_castps_si512(v);
    const I lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const I rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    return _mm512_castps_si512(QuietNaNs(_mm512_castsi512_ps(rounded), v));
  }
  static void StoreHigh16(uint16_t* p, I w) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(w, 16)));
  }
  static void StoreHigh16(uint16_t* p, I w, Mask m) {
    _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(w, 16)));
  }
  // High halves of a's lanes then b's lanes: 2 * kLanes bf16 in one 64-byte store.
  static I PackHigh16(I a, I b) {
    const I odd = _mm512_setr_epi32(0x00030001, 0x00070005, 0x000B0009, 0x000F000D, 0x00130011, 0x00170015, 0x001B0019,
                                    0x001F001D, 0x00230021, 0x00270025, 0x002B0029, 0x002F002D, 0x00330031, 0x00370035,
                                    0x003B0039, 0x003F003D);
    return _mm512_permutex2var_epi16(a, odd, b);
  }
  static void StoreHigh16x2(uint16_t* p, I a, I b) { _mm512_storeu_si512(p, PackHigh16(a, b)); }
  static void StreamHigh16x2(uint16_t* p, I a, I b) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(p), PackHigh16(a, b));
  }
  // a then b rounded to nearest even as 2 * kLanes bf16 (FloatToBF16), in one store.
  static void StoreBF16x2(uint16_t* p, F a, F b, bool stream) {
    const I w = PackHigh16(NearestWord(a), NearestWord(b));
    stream ? _mm512_stream_si512(reinterpret_cast<__m512i*>(p), w) : _mm512_storeu_si512(p, w);
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

#if defined(__AVX512BF16__)
// AVX-512 plus avx512_bf16 (Cooper Lake, Sapphire/Emerald Rapids, Zen 4): the round-to-nearest-even
// upload uses VCVTNE2PS2BF16, one instruction for 32 values in element order instead of ~15 integer ops
// and a word permute. The instruction is FloatToBF16 exactly (same RNE, same NaN quieting: bits >> 16 |
// 0x40) except that it treats denormal inputs as zero regardless of MXCSR; a denormal master weight is
// rare, so one VFPCLASSPS per vector detects it and the whole store then takes the integer path.
struct Avx512Bf16Ops : Avx512Ops {
  static constexpr int kDenormal = 0x20;  // VFPCLASSPS category: denormal

  static void StoreBF16x2(uint16_t* p, F a, F b, bool stream) {
    I w = reinterpret_cast<I>(_mm512_cvtne2ps_pbh(b, a));  // a -> low 16 words, b -> high 16 words
    if (!_kortestz_mask16_u8(_mm512_fpclass_ps_mask(a, kDenormal), _mm512_fpclass_ps_mask(b, kDenormal))) [[unlikely]]
      w = PackHigh16(NearestWord(a), NearestWord(b));
    stream ? _mm512_stream_si512(reinterpret_cast<__m512i*>(p), w) : _mm512_storeu_si512(p, w);
  }
  static __m256i NearestBF16(F v) {
    if (_mm512_fpclass_ps_mask(v, kDenormal) != 0) [[unlikely]]
      return Narrow(RoundBF16(v));
    return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
  }
  static void StoreBF16(uint16_t* p, F v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), NearestBF16(v)); }
  static void StoreBF16(uint16_t* p, F v, Mask m) { _mm256_mask_storeu_epi16(p, m, NearestBF16(v)); }
  static void StreamBF16(uint16_t* p, F v) { _mm256_stream_si256(reinterpret_cast<__m256i*>(p), NearestBF16(v)); }
};
#endif  // __AVX512BF16__

}  // namespace
}  // namespace trainstream::optimizer
