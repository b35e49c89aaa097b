// 16 float lanes, the unit of jaxcb's packed weight layouts (a 16-column block): one AVX-512
// register, or two AVX2 registers. matmul.cc writes its kernels once over V16; build.py
// compiles them at each ISA level (AVX2 + FMA, AVX-512, ...), so the same source gives the
// AVX2 kernels and the AVX-512 ones. Nothing here is defined below AVX2 + FMA.
#pragma once

#include "common.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define JAXCB_HAVE_V16 1
#include <immintrin.h>

namespace {

// float8 bytes as float16 bits (AVX2 integer ops; F16C or AVX-512 widens them after).
// e4m3fn s|eeee|mmm goes to the float16 s|0eeee|mmm0000000: the same sign, mantissa and
// exponent field, read with bias 15 instead of 7, so the float16 value is the float8 value
// / 256 exactly (subnormals included; e4m3fn's NaN, 0x7f, becomes 480 / 256, and is never
// written). e5m2 s|eeeee|mm is the top byte of the float16 of the same value.
inline __m256i E4M3AsF16(const uint8_t* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8);
  const __m256i rest = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7);
  return _mm256_or_si256(sign, rest);
}

inline __m256i E5M2AsF16(const uint8_t* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_slli_epi16(b, 8);
}

#if defined(__AVX512F__)

struct V16 {
  __m512 v;
  static V16 Zero() { return {_mm512_setzero_ps()}; }
  static V16 Set(float x) { return {_mm512_set1_ps(x)}; }
  static V16 Load(const void* p) { return {_mm512_loadu_ps(static_cast<const float*>(p))}; }
  static V16 LoadBf16(const uint16_t* p) {  // 16 bfloat16 values, widened
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
  }
  static V16 LoadI8(const int8_t* p) {  // 16 int8 values, as floats
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b))};
  }
  static V16 LoadF16(const void* p) {  // 16 float16 values, widened
    return {_mm512_cvtph_ps(_mm256_loadu_si256(static_cast<const __m256i*>(p)))};
  }
  // 16 bytes of 4-bit codes (0..15) as floats: the low nibbles, then the high ones.
  static void LoadU4Pairs(const void* p, V16& low, V16& high) {
    const __m128i b = _mm_loadu_si128(static_cast<const __m128i*>(p));
    const __m128i mask = _mm_set1_epi8(0x0f);
    low = {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, mask)))};
    high = {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), mask)))};
  }
  static V16 LoadE4M3Div256(const uint8_t* p) {  // 16 float8_e4m3fn values / 256, exact
    return {_mm512_cvtph_ps(E4M3AsF16(p))};
  }
  static V16 LoadE5M2(const uint8_t* p) {  // 16 float8_e5m2 values, exact
    return {_mm512_cvtph_ps(E5M2AsF16(p))};
  }
  void Store(float* p) const { _mm512_storeu_ps(p, v); }
  void Stream(float* p) const { _mm512_stream_ps(p, v); }  // p 64-byte aligned
  float MaxLane() const { return _mm512_reduce_max_ps(v); }
  float SumLanes() const { return _mm512_reduce_add_ps(v); }
  // Bit i set where lane i == x (ordered), or >= bound (ordered).
  uint32_t LanesEqual(float x) const {
    return _mm512_cmp_ps_mask(v, _mm512_set1_ps(x), _CMP_EQ_OQ);
  }
  uint32_t LanesAtLeast(V16 bound) const { return _mm512_cmp_ps_mask(v, bound.v, _CMP_GE_OQ); }
};

inline V16 Fma(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }  // a * b + c
inline V16 Add(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 Sub(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline V16 Mul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V16 Max(V16 a, V16 b) { return {_mm512_max_ps(a.v, b.v)}; }  // b where either is NaN
inline V16 Exp(V16 x) { return {Exp512(x.v)}; }  // x <= 0 (clamped to [-87, 0])
// x where s > floor, else 0.
inline V16 KeepAbove(V16 x, V16 s, float floor) {
  return {_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s.v, _mm512_set1_ps(floor), _CMP_GT_OQ), x.v)};
}

// Lane t of the result is the sum of all lanes of v[t]: 16 dot products' partial sums
// reduced together (46 shuffles and adds, not 16 full horizontal reductions).
inline V16 Sum16(const V16* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {  // 256-bit halves: 8 partials of token i, then of i + 8
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i].v, v[i + 8].v, 0x44),
                         _mm512_shuffle_f32x4(v[i].v, v[i + 8].v, 0xEE));
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit lanes: 4 partials of tokens i, i+8, i+4, i+12
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 4], 0x88),
                         _mm512_shuffle_f32x4(a[i], a[i + 4], 0xDD));
  }
  for (int i = 0; i < 2; ++i) {
    c[i] = _mm512_add_ps(_mm512_unpacklo_ps(b[i], b[i + 2]), _mm512_unpackhi_ps(b[i], b[i + 2]));
  }
  const __m512d c0 = _mm512_castps_pd(c[0]), c1 = _mm512_castps_pd(c[1]);
  const __m512 d = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c0, c1)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(c0, c1)));
  // d holds tokens 0 2 1 3 8 10 9 11 4 6 5 7 12 14 13 15; put them in order.
  const __m512i order = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
  return {_mm512_permutexvar_ps(order, d)};
}

// The two rows of one k-pair of a pack_bf16 vector (16 columns x (even row, odd row) bf16).
inline void WidenBf16Pairs(const void* p, V16& even, V16& odd) {
  const __m512i x = _mm512_loadu_si512(p);
  even = {_mm512_castsi512_ps(_mm512_slli_epi32(x, 16))};
  odd = {_mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(int(0xffff0000u))))};
}

// silu(g) * u: g * sigmoid(g), sigmoid from e = exp(-|g|) <= 1.
inline V16 Swiglu(V16 g, V16 u) {
  const __m512 abs = _mm512_abs_ps(g.v);
  const __m512 e = Exp512(_mm512_sub_ps(_mm512_setzero_ps(), abs));
  const __m512 num = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(g.v, abs, _CMP_EQ_OQ), e,
                                          _mm512_set1_ps(1.0f));  // g >= 0: 1, else e
  const __m512 sig = _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
  return {_mm512_mul_ps(_mm512_mul_ps(g.v, sig), u.v)};
}

// 16 bfloat16 values at p, rounded to nearest even (NaN stays NaN).
inline void StoreBf16(V16 x, uint16_t* p) {
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(x.v));
#else
  const __m512i u = _mm512_castps_si512(x.v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x.v, x.v, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
#endif
}

#else  // AVX2 + FMA: two halves of 8 lanes

// exp(x) for x <= 0 on 8 lanes (Exp512's algorithm).
inline __m256 Exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_setzero_ps());
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 e = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i bits =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(e, _mm256_castsi256_ps(bits));
}

inline uint32_t Mask8(__m256 m) { return static_cast<uint32_t>(_mm256_movemask_ps(m)); }

struct V16 {
  __m256 lo, hi;
  static V16 Zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static V16 Set(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
  static V16 Load(const void* p) {
    const float* f = static_cast<const float*>(p);
    return {_mm256_loadu_ps(f), _mm256_loadu_ps(f + 8)};
  }
  static V16 LoadBf16(const uint16_t* p) {  // 16 bfloat16 values, widened
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(a), 16)),
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16))};
  }
  static V16 LoadI8(const int8_t* p) {  // 16 int8 values, as floats
    const __m128i a = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8));
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a)),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b))};
  }
  static V16 LoadF16(const void* p) {  // 16 float16 values, widened (F16C)
    const __m128i* h = static_cast<const __m128i*>(p);
    return {_mm256_cvtph_ps(_mm_loadu_si128(h)), _mm256_cvtph_ps(_mm_loadu_si128(h + 1))};
  }
  // 16 bytes of 4-bit codes (0..15) as floats: the low nibbles, then the high ones.
  static void LoadU4Pairs(const void* p, V16& low, V16& high) {
    const __m128i b = _mm_loadu_si128(static_cast<const __m128i*>(p));
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    low = {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)),
           _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)))};
    high = {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)))};
  }
  static V16 LoadE4M3Div256(const uint8_t* p) {  // 16 float8_e4m3fn values / 256, exact
    return FromF16(E4M3AsF16(p));
  }
  static V16 LoadE5M2(const uint8_t* p) {  // 16 float8_e5m2 values, exact
    return FromF16(E5M2AsF16(p));
  }
  static V16 FromF16(__m256i h) {  // 16 float16 values in a register, widened (F16C)
    return {_mm256_cvtph_ps(_mm256_castsi256_si128(h)),
            _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1))};
  }
  void Store(float* p) const {
    _mm256_storeu_ps(p, lo);
    _mm256_storeu_ps(p + 8, hi);
  }
  void Stream(float* p) const {  // p 32-byte aligned
    _mm256_stream_ps(p, lo);
    _mm256_stream_ps(p + 8, hi);
  }
  float MaxLane() const {
    __m256 m = _mm256_max_ps(lo, hi);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
  }
  float SumLanes() const {
    const __m256 s = _mm256_add_ps(lo, hi);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
  }
  uint32_t LanesEqual(float x) const {
    const __m256 t = _mm256_set1_ps(x);
    return Mask8(_mm256_cmp_ps(lo, t, _CMP_EQ_OQ)) | Mask8(_mm256_cmp_ps(hi, t, _CMP_EQ_OQ)) << 8;
  }
  uint32_t LanesAtLeast(V16 b) const {
    return Mask8(_mm256_cmp_ps(lo, b.lo, _CMP_GE_OQ)) |
           Mask8(_mm256_cmp_ps(hi, b.hi, _CMP_GE_OQ)) << 8;
  }
};

inline V16 Fma(V16 a, V16 b, V16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline V16 Add(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 Sub(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V16 Mul(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 Max(V16 a, V16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline V16 Exp(V16 x) { return {Exp256(x.lo), Exp256(x.hi)}; }  // x <= 0 (clamped to [-87, 0])
inline V16 KeepAbove(V16 x, V16 s, float floor) {  // x where s > floor, else 0
  const __m256 f = _mm256_set1_ps(floor);
  return {_mm256_and_ps(x.lo, _mm256_cmp_ps(s.lo, f, _CMP_GT_OQ)),
          _mm256_and_ps(x.hi, _mm256_cmp_ps(s.hi, f, _CMP_GT_OQ))};
}

// Lane t of the result is the sum of all lanes of x[t], for 8 vectors.
inline __m256 Sum8(const __m256* x) {
  // hadd(hadd(x0, x1), hadd(x2, x3)): the 128-bit halves' sums of x0..x3, low half then high.
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(x[0], x[1]), _mm256_hadd_ps(x[2], x[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(x[4], x[5]), _mm256_hadd_ps(x[6], x[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// Lane t of the result is the sum of all lanes of v[t].
inline V16 Sum16(const V16* v) {
  __m256 x[8], y[8];
  for (int t = 0; t < 8; ++t) {
    x[t] = _mm256_add_ps(v[t].lo, v[t].hi);
    y[t] = _mm256_add_ps(v[t + 8].lo, v[t + 8].hi);
  }
  return {Sum8(x), Sum8(y)};
}

inline void WidenBf16Pairs(const void* p, V16& even, V16& odd) {
  const __m256i* q = static_cast<const __m256i*>(p);
  const __m256i x0 = _mm256_loadu_si256(q), x1 = _mm256_loadu_si256(q + 1);
  const __m256i high = _mm256_set1_epi32(int(0xffff0000u));
  even = {_mm256_castsi256_ps(_mm256_slli_epi32(x0, 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(x1, 16))};
  odd = {_mm256_castsi256_ps(_mm256_and_si256(x0, high)),
         _mm256_castsi256_ps(_mm256_and_si256(x1, high))};
}

inline __m256 Swiglu256(__m256 g, __m256 u) {
  const __m256 abs = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), g);
  const __m256 e = Exp256(_mm256_sub_ps(_mm256_setzero_ps(), abs));
  const __m256 num = _mm256_blendv_ps(e, _mm256_set1_ps(1.0f), _mm256_cmp_ps(g, abs, _CMP_EQ_OQ));
  const __m256 sig = _mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
  return _mm256_mul_ps(_mm256_mul_ps(g, sig), u);
}

inline V16 Swiglu(V16 g, V16 u) { return {Swiglu256(g.lo, u.lo), Swiglu256(g.hi, u.hi)}; }

// 8 lanes rounded to bf16 (nearest even, NaN stays NaN), as 32-bit lanes holding the bits.
inline __m256i Bf16Bits256(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  return _mm256_blendv_epi8(r, quiet, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
}

inline void StoreBf16(V16 x, uint16_t* p) {
  // packus interleaves the 128-bit halves: lo0-3 hi0-3 lo4-7 hi4-7 -> put them in order.
  const __m256i packed = _mm256_packus_epi32(Bf16Bits256(x.lo), Bf16Bits256(x.hi));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(packed, 0xD8));
}

#endif  // AVX-512 / AVX2

// The RMS-normed rows [0, m) of a [., k] into out: a_i * (1 / sqrt(mean(a_i^2) + eps)) * g,
// in float32 as layers.rms_norm computes it.
inline void RmsNormRows(const float* a, const float* g, float eps, int64_t m, int64_t k,
                        float* out) {
  for (int64_t i = 0; i < m; ++i) {
    const float* x = a + i * k;
    float* y = out + i * k;
    __m256 squares = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + 8 <= k; c += 8) {
      const __m256 v = _mm256_loadu_ps(x + c);
      squares = _mm256_fmadd_ps(v, v, squares);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, squares);
    float sum = 0.0f;
    for (float lane : lanes) sum += lane;
    for (; c < k; ++c) sum += x[c] * x[c];
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(k) + eps);
    for (c = 0; c < k; ++c) y[c] = g[c] * (x[c] * inv);
  }
}

// The norm weight g ([K], float32 or bfloat16 as the model stores it) as float32: its data,
// or bf16 widened into a thread-local buffer; null if g is neither or not [K].
inline const float* NormWeightF32(const ffi::AnyBuffer& g, int64_t k) {
  if (static_cast<int64_t>(g.element_count()) != k) return nullptr;
  if (g.element_type() == ffi::DataType::F32) return static_cast<const float*>(g.untyped_data());
  if (g.element_type() != ffi::DataType::BF16) return nullptr;
  thread_local std::vector<float> widened;
  const uint16_t* bits = static_cast<const uint16_t*>(g.untyped_data());
  widened.resize(k);
  for (int64_t c = 0; c < k; ++c) widened[c] = Bf16ToF32(bits[c]);
  return widened.data();
}

inline ffi::Error NormWeightError() {
  return ffi::Error::InvalidArgument("the norm weight must be f32[K] or bf16[K]");
}

}  // namespace

#endif  // JAXCB_HAVE_V16
