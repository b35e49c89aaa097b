// Ragged paged attention and the KV page write for XLA's CPU backend, as XLA FFI handlers.
//
// Same semantics as pallas_kernels/ragged_paged_attention/reference.py: sequence s owns query
// rows cu_q_lens[s]:cu_q_lens[s + 1], the last q_len of its kv_lens[s] tokens, whose K/V sit
// in the pages listed by page_indices[s]; causal, GQA, optional sliding window and soft cap;
// rows past cu_q_lens[num_seqs] are zeros.
//
// Why native code: expressed in XLA, each KV chunk is gathered into a fresh buffer, masked
// into another and only then multiplied; on a CPU those passes over memory cost several times
// the arithmetic. Here each page is read once, straight from the pool, by the thread that
// uses it. Work items are (sequence, KV head, block of query rows), spread over XLA's own
// intra-op thread pool. K/V pages may be float32 or bfloat16 (the write kernel updates the
// pool in place, which XLA's CPU scatter cannot do for bfloat16), or quantized: int8,
// float8_e4m3fn or float8_e5m2 codes with a float32 scale per (KV head, page, slot), i.e. per
// token and head (value = code x scale; pallas_kernels/ragged_paged_attention/kv_quant.py).
// Codes are widened in registers and multiplied by their row's scale; the quantized write
// (KvWriteQuantImpl) computes each new row's scale and codes as kv_quant.quantize_rows does.

#include "simd.h"

namespace {

constexpr int kRowsPerItem = 16;  // query rows of one sequence handled by one work item
// A sequence with at most this many query tokens in a step has each row computed exactly as
// a lone decode row is (the row-by-row scores, never the rows-in-lanes or transposed-key
// forms, which sum in another order): speculative decoding verifies 1 + up to 16 proposed
// tokens (SpeculativeConfig.num_speculative_tokens <= 16), and a verified row's token must
// be the one decoding it alone gives.
constexpr int64_t kMaxRowByRowTokens = 17;

// exp(x) for x <= 0 in a form the compiler vectorizes (std::exp is a scalar libm call):
// Cody-Waite reduction x = n ln2 + r, a degree-6 polynomial for e^r on |r| <= ln2 / 2, and
// 2^n built in the exponent bits. Relative error ~2e-7, like libm's expf.
#pragma omp declare simd
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return e * __builtin_bit_cast(float, bits);
}

// Copies n values of a float32 or bfloat16 array into float32.
inline void LoadF32(const void* src, bool bf16, int64_t offset, int64_t n, float* dst) {
  if (bf16) {
    const uint16_t* p = static_cast<const uint16_t*>(src) + offset;
    for (int64_t i = 0; i < n; ++i) dst[i] = Bf16ToF32(p[i]);
  } else {
    std::memcpy(dst, static_cast<const float*>(src) + offset, n * sizeof(float));
  }
}

inline void StoreFromF32(void* dst, bool bf16, int64_t offset, int64_t n, const float* src) {
  if (bf16) {
    uint16_t* p = static_cast<uint16_t*>(dst) + offset;
    for (int64_t i = 0; i < n; ++i) p[i] = F32ToBf16(src[i]);
  } else {
    std::memcpy(static_cast<float*>(dst) + offset, src, n * sizeof(float));
  }
}

// What the K/V pages hold.
enum class Kv { kF32, kBf16, kI8, kE4M3, kE5M2 };

constexpr bool Quantized(Kv kind) {
  return kind == Kv::kI8 || kind == Kv::kE4M3 || kind == Kv::kE5M2;
}

constexpr int64_t KvBytes(Kv kind) {
  return kind == Kv::kF32 ? 4 : kind == Kv::kBf16 ? 2 : 1;
}

// The largest code magnitude of a quantized dtype: a row's scale is max|x| / Qmax.
constexpr float Qmax(Kv kind) {
  return kind == Kv::kI8 ? 127.0f : kind == Kv::kE4M3 ? 448.0f : 57344.0f;
}

// A float8 byte's value: e4m3fn (3 mantissa bits, bias 7; no infinities, 0x7f / 0xff NaN)
// or e5m2 (2, bias 15; IEEE-like). Only finite codes are ever written.
template <int kManBits, int kBias>
float Fp8Value(uint8_t b) {
  const int e = (b & 0x7f) >> kManBits, m = b & ((1 << kManBits) - 1);
  const float mag = e == 0 ? std::ldexp(static_cast<float>(m), 1 - kBias - kManBits)
                           : std::ldexp(static_cast<float>(m + (1 << kManBits)),
                                        e - kBias - kManBits);
  return (b & 0x80) ? -mag : mag;
}

// Every byte's value, for the scalar code.
template <int kManBits, int kBias>
const float* Fp8Table() {
  static const auto table = [] {
    std::vector<float> t(256);
    for (int b = 0; b < 256; ++b) t[b] = Fp8Value<kManBits, kBias>(static_cast<uint8_t>(b));
    return t;
  }();
  return table.data();
}

// |x| <= max as a float8 byte, rounded to nearest even (as ml_dtypes casts float32): the
// quantum of |x|'s binade (of the subnormals below the smallest normal), the rounded
// magnitude, then its exponent and mantissa fields.
template <int kManBits, int kBias>
uint8_t F32ToFp8(float x, float max) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  const float a = std::min(std::fabs(x), max);
  if (!(a > 0.0f)) return sign;  // zero (NaN: zero too; never given)
  constexpr int kMinExp = 1 - kBias;  // exponent of the smallest normal
  int e;
  std::frexp(a, &e);  // a = f x 2^e, f in [0.5, 1): floor(log2 a) = e - 1
  const int quantum = std::max(e - 1, kMinExp) - kManBits;
  const float r = std::ldexp(std::nearbyint(std::ldexp(a, -quantum)), quantum);
  if (r == 0.0f) return sign;
  std::frexp(r, &e);
  const int field = e - 1 + kBias;
  if (field <= 0) return sign | static_cast<uint8_t>(std::ldexp(r, kManBits - kMinExp));
  const float mantissa = std::ldexp(r, 1 - e) - 1.0f;  // in [0, 1)
  return sign | static_cast<uint8_t>(field << kManBits) |
         static_cast<uint8_t>(std::ldexp(mantissa, kManBits));
}

// n rows of head_dim values of a pool from element `offset` (a row's start), as float32:
// bfloat16 widened, quantized codes times their row's scale (scales[offset / head_dim + t]).
void LoadKvRows(const void* pages, const float* scales, Kv kind, int64_t offset, int64_t rows,
                int64_t head_dim, float* dst) {
  if (kind == Kv::kF32 || kind == Kv::kBf16) {
    return LoadF32(pages, kind == Kv::kBf16, offset, rows * head_dim, dst);
  }
  const float* table = kind == Kv::kE4M3 ? Fp8Table<3, 7>() : Fp8Table<2, 15>();
  for (int64_t t = 0; t < rows; ++t) {
    const float scale = scales[offset / head_dim + t];
    const int64_t at = offset + t * head_dim;
    float* out = dst + t * head_dim;
    if (kind == Kv::kI8) {
      const int8_t* c = static_cast<const int8_t*>(pages) + at;
      for (int64_t d = 0; d < head_dim; ++d) out[d] = static_cast<float>(c[d]) * scale;
    } else {
      const uint8_t* c = static_cast<const uint8_t*>(pages) + at;
      for (int64_t d = 0; d < head_dim; ++d) out[d] = table[c[d]] * scale;
    }
  }
}

struct Item {
  int32_t seq, kv_head, row_begin, row_end;
};

// Everything a work item reads, shared by all items of one call.
struct Problem {
  const void* q;
  const void* k_pages;
  const void* v_pages;
  void* out;
  bool q_bf16;
  Kv kv;
  const float* k_scales;  // [Hkv, P, ps] for quantized pages, else null
  const float* v_scales;
  const int32_t* kv_len;
  const int32_t* pages;
  const int32_t* cu;
  int64_t num_q_heads, num_kv_heads, num_pages, page_size, head_dim, group, pages_per_seq;
  float sm_scale, soft_cap;
  int64_t sliding_window;
};

// One work item: `group` query heads x up to kRowsPerItem rows of one sequence against its
// pages, online softmax page by page. kHeadDim > 0 fixes head_dim at compile time, so the
// loops over it unroll into a few full-width vector instructions.
template <int kHeadDim>
void RunItem(const Problem& P, const Item& it) {
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : P.head_dim;
  const int64_t page_size = P.page_size, group = P.group;
  const int64_t rows = it.row_end - it.row_begin, nq = rows * group;
  const int64_t q_len = P.cu[it.seq + 1] - P.cu[it.seq];
  const int64_t len = P.kv_len[it.seq];
  const int64_t first_pos = len - q_len + (it.row_begin - P.cu[it.seq]);
  std::vector<float> qv(nq * head_dim), acc(nq * head_dim, 0.0f), m(nq, -INFINITY),
      l(nq, 0.0f), kbuf(page_size * head_dim), vbuf(page_size * head_dim), p(page_size),
      keep(page_size);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < group; ++g) {
      float* dst = &qv[(r * group + g) * head_dim];
      LoadF32(P.q, P.q_bf16,
              ((it.row_begin + r) * P.num_q_heads + it.kv_head * group + g) * head_dim,
              head_dim, dst);
      for (int64_t d = 0; d < head_dim; ++d) dst[d] *= P.sm_scale;
    }
  }
  const int64_t hi = std::min<int64_t>(first_pos + rows, len);  // positions [lo, hi) matter
  int64_t lo = 0;
  if (P.sliding_window > 0) lo = std::max<int64_t>(0, first_pos - P.sliding_window + 1);
  for (int64_t j = lo / page_size; j * page_size < hi; ++j) {
    const int64_t page = P.pages[it.seq * P.pages_per_seq + j];
    if (page < 0 || page >= P.num_pages) continue;  // never live: guarded by validation
    const int64_t base = (it.kv_head * P.num_pages + page) * page_size * head_dim;
    const int64_t t_end = std::min<int64_t>(page_size, hi - j * page_size);
    const float* kpage = kbuf.data();
    const float* vpage = vbuf.data();
    if (P.kv != Kv::kF32) {
      LoadKvRows(P.k_pages, P.k_scales, P.kv, base, t_end, head_dim, kbuf.data());
      LoadKvRows(P.v_pages, P.v_scales, P.kv, base, t_end, head_dim, vbuf.data());
    } else {  // float32 pages are read where they are
      kpage = static_cast<const float*>(P.k_pages) + base;
      vpage = static_cast<const float*>(P.v_pages) + base;
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = first_pos + r;
      for (int64_t g = 0; g < group; ++g) {
        const int64_t row = r * group + g;
        const float* qr = &qv[row * head_dim];
        float block_max = -INFINITY;
        for (int64_t t = 0; t < t_end; ++t) {
          const int64_t kv_pos = j * page_size + t;
          const bool ok =
              kv_pos <= pos && (P.sliding_window <= 0 || kv_pos > pos - P.sliding_window);
          const float* kr = &kpage[t * head_dim];
          float s = 0.0f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < head_dim; ++d) s += qr[d] * kr[d];
          if (P.soft_cap > 0.0f) s = P.soft_cap * std::tanh(s / P.soft_cap);
          p[t] = s;
          keep[t] = ok ? 1.0f : 0.0f;
          if (ok) block_max = std::max(block_max, s);
        }
        if (block_max == -INFINITY) continue;
        const float m_new = std::max(m[row], block_max);
        const float alpha = std::exp(m[row] - m_new);  // exp(-inf) = 0 on the first block
        float* a = &acc[row * head_dim];
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < t_end; ++t) {
          const float w = ExpNonPositive(std::min(p[t] - m_new, 0.0f)) * keep[t];
          p[t] = w;
          sum += w;
        }
        if (head_dim % 16 == 0) {
          // 16 accumulator lanes stay in a register across the whole page.
          for (int64_t d0 = 0; d0 < head_dim; d0 += 16) {
            float lane[16];
#pragma omp simd
            for (int dd = 0; dd < 16; ++dd) lane[dd] = a[d0 + dd] * alpha;
            for (int64_t t = 0; t < t_end; ++t) {
              const float w = p[t];
              const float* vr = &vpage[t * head_dim + d0];
#pragma omp simd
              for (int dd = 0; dd < 16; ++dd) lane[dd] += w * vr[dd];
            }
#pragma omp simd
            for (int dd = 0; dd < 16; ++dd) a[d0 + dd] = lane[dd];
          }
        } else {
          for (int64_t d = 0; d < head_dim; ++d) a[d] *= alpha;
          for (int64_t t = 0; t < t_end; ++t) {
            const float w = p[t];
            const float* vr = &vpage[t * head_dim];
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) a[d] += w * vr[d];
          }
        }
        l[row] = l[row] * alpha + sum;
        m[row] = m_new;
      }
    }
  }
  std::vector<float> o(head_dim);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < group; ++g) {
      const int64_t row = r * group + g;
      const float inv = l[row] > 0.0f ? 1.0f / l[row] : 0.0f;
      for (int64_t d = 0; d < head_dim; ++d) o[d] = acc[row * head_dim + d] * inv;
      StoreFromF32(P.out, P.q_bf16,
                   ((it.row_begin + r) * P.num_q_heads + it.kv_head * group + g) * head_dim,
                   head_dim, o.data());
    }
  }
}

#if defined(JAXCB_HAVE_V16)
// The vector item routines (AVX2 or AVX-512, over simd.h's 16-lane V16): the same work as
// RunItem, organised for the vector units. Keys go in chunks of up to kChunk, each with one
// online-softmax update (the running maximum and the accumulators are rescaled once per
// chunk, not per page). Scores are computed one of two ways:
// - few query rows (decode: the `group` heads of one token): each K row loaded is dotted
//   with kRowGroup query rows, and the 16 partial-sum vectors of 16 keys are reduced
//   together (Sum16); scores sit row by row, softmax vectorised over keys;
// - 16 query rows or more (a prefill block): the rows go in the lanes, q transposed once per
//   item, so a key's scores for 16 rows are D FMAs of a broadcast K element against a column
//   of q, with no cross-lane sums at all; scores sit key by key, softmax vectorised over rows.
// Then acc += weights x V, kRowGroup rows x kPvSlice vectors of V in registers at a time.
// K/V rows are float32, or bfloat16 widened on load, or quantized codes widened on load
// (int8 by sign extension, float8 through float16 with F16C) and multiplied by their row's
// scale: a K row's before its dot products, a V row's folded into its weights. (With
// AVX512-BF16, bfloat16 q against bfloat16 pages takes RunItemBf16Dot below instead.)

constexpr int kChunk = 256;   // keys per online-softmax update (a multiple of 16)
constexpr int kRowGroup = 4;  // query rows sharing each loaded K or V row
#if defined(__AVX512F__)
constexpr int kLaneKeys = 8;  // keys per pass of the rows-in-lanes scores (accumulators)
constexpr int kPvSlice = 4;   // V16s of a V row per pass (4 x 4 accumulators in 32 zmm)
#else
constexpr int kLaneKeys = 4;  // AVX2: 16 ymm, a V16 takes two
constexpr int kPvSlice = 1;
#endif

inline int64_t RoundUp(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

inline bool Visible(int64_t kv_pos, int64_t pos, int64_t sliding_window) {
  return kv_pos <= pos && (sliding_window <= 0 || kv_pos > pos - sliding_window);
}

// 16 values of a K/V row from element `offset`; quantized kinds give codes, to be multiplied
// by RowScale (float8_e4m3fn codes / 256: RowScale has the 256).
template <Kv kKv>
inline V16 LoadRow16(const void* base, int64_t offset) {
  if constexpr (kKv == Kv::kBf16) {
    return V16::LoadBf16(static_cast<const uint16_t*>(base) + offset);
  } else if constexpr (kKv == Kv::kI8) {
    return V16::LoadI8(static_cast<const int8_t*>(base) + offset);
  } else if constexpr (kKv == Kv::kE4M3) {
    return V16::LoadE4M3Div256(static_cast<const uint8_t*>(base) + offset);
  } else if constexpr (kKv == Kv::kE5M2) {
    return V16::LoadE5M2(static_cast<const uint8_t*>(base) + offset);
  } else {
    return V16::Load(static_cast<const float*>(base) + offset);
  }
}

// What LoadRow16's values of the row at element `offset` are multiplied by (quantized kinds).
template <Kv kKv, int D>
inline float RowScale(const float* scales, int64_t offset) {
  return scales[offset / D] * (kKv == Kv::kE4M3 ? 256.0f : 1.0f);
}

// Where the K/V row of each key of the chunk [c0, c0 + n) is (an element offset into the
// pools; -1 for a page that is not live, which validation rules out), and a request for all
// of them into L2: the pool is far larger than the caches.
void ChunkKeyOffsets(const Problem& P, const Item& it, int64_t c0, int64_t n, int64_t row_bytes,
                     int64_t* key_offset) {
  const int64_t D = P.head_dim;
  for (int64_t t = 0, pos = c0; t < n;) {
    const int64_t page = P.pages[it.seq * P.pages_per_seq + pos / P.page_size];
    const bool live = page >= 0 && page < P.num_pages;
    int64_t off = ((it.kv_head * P.num_pages + page) * P.page_size + pos % P.page_size) * D;
    for (int64_t in_page = pos % P.page_size; in_page < P.page_size && t < n; ++in_page) {
      key_offset[t++] = live ? off : -1;
      off += D;
      ++pos;
    }
  }
  const int64_t elem = row_bytes / D;
  for (int64_t t = 0; t < n; ++t) {
    if (key_offset[t] < 0) continue;
    const char* krow = static_cast<const char*>(P.k_pages) + key_offset[t] * elem;
    const char* vrow = static_cast<const char*>(P.v_pages) + key_offset[t] * elem;
    for (int64_t b = 0; b < row_bytes; b += 64) {
      _mm_prefetch(krow + b, _MM_HINT_T1);
      _mm_prefetch(vrow + b, _MM_HINT_T1);
    }
  }
}

// Scores laid out row by row (scores[row * kChunk + key], keys up to a multiple of 16 past n
// at -inf): each row's weights, its running max m and sum l, its accumulator rescaled.
void SoftmaxRows(float* scores, int64_t rows, int64_t n, int64_t head_dim, float* m, float* l,
                 float* acc) {
  const int64_t n16 = RoundUp(n, 16);
  for (int64_t i = 0; i < rows; ++i) {
    float* s = &scores[i * kChunk];
    V16 vmax = V16::Set(-INFINITY);
    for (int64_t t = 0; t < n16; t += 16) vmax = Max(vmax, V16::Load(s + t));
    const float mx = vmax.MaxLane();
    if (mx == -INFINITY) {  // nothing visible to this row in this chunk
      std::fill(s, s + n16, 0.0f);
      continue;
    }
    const float m_new = std::max(m[i], mx);
    const float alpha = std::exp(m[i] - m_new);  // exp(-inf) = 0 on the first chunk
    const V16 vm = V16::Set(m_new);
    V16 vsum = V16::Zero();
    for (int64_t t = 0; t < n16; t += 16) {
      const V16 x = V16::Load(s + t);
      const V16 w = KeepAbove(Exp(Sub(x, vm)), x, -INFINITY);
      w.Store(s + t);
      vsum = Add(vsum, w);
    }
    l[i] = l[i] * alpha + vsum.SumLanes();
    m[i] = m_new;
    if (alpha != 1.0f) {
      for (int64_t d = 0; d < head_dim; ++d) acc[i * head_dim + d] *= alpha;
    }
  }
}

// Scores laid out key by key (st[key * lanes + row], lanes a multiple of 16): the same
// update 16 rows at a time. A row that has seen nothing yet keeps m = -inf, l = 0.
void SoftmaxLanes(float* st, int64_t lanes, int64_t rows, int64_t n, int64_t head_dim, float* m,
                  float* l, float* acc) {
  alignas(64) float alpha[16];
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    V16 vmax = V16::Set(-INFINITY);
    for (int64_t t = 0; t < n; ++t) vmax = Max(vmax, V16::Load(st + t * lanes + r0));
    const V16 m_old = V16::Load(m + r0), m_new = Max(m_old, vmax);
    const V16 m_safe = KeepAbove(m_new, m_new, -INFINITY);  // -inf lanes: 0
    V16 vsum = V16::Zero();
    for (int64_t t = 0; t < n; ++t) {
      float* s = st + t * lanes + r0;
      const V16 x = V16::Load(s);
      const V16 w = KeepAbove(Exp(Sub(x, m_safe)), x, -INFINITY);
      w.Store(s);
      vsum = Add(vsum, w);
    }
    const V16 a = Exp(Sub(m_old, m_safe));  // a lane's first visible keys: acc and l are 0
    Add(Mul(V16::Load(l + r0), a), vsum).Store(l + r0);
    m_new.Store(m + r0);
    a.Store(alpha);
    for (int64_t i = r0; i < std::min(rows, r0 + 16); ++i) {
      if (alpha[i - r0] == 1.0f) continue;
      for (int64_t d = 0; d < head_dim; ++d) acc[i * head_dim + d] *= alpha[i - r0];
    }
  }
}

// acc[row] += sum over the chunk's keys t of w(row, t) x V[t], w(row, t) at
// w[row * row_stride + t * key_stride]; rows a multiple of kRowGroup.
// The V16s of a V row per pass: the most, up to kPvSlice, that divide the row's `vecs`
// (head_dim 96 is 6 V16s: 3 per pass where kPvSlice is 4).
constexpr int PvSlice(int vecs) {
  for (int s = kPvSlice; s > 1; --s) {
    if (vecs % s == 0) return s;
  }
  return 1;
}

template <int D, Kv kKv>
void AccumulatePv(const Problem& P, const int64_t* key_offset, int64_t n, const float* w,
                  int64_t row_stride, int64_t key_stride, int64_t rows, float* acc) {
  constexpr int kVecs = D / 16;
  constexpr int kSlice = PvSlice(kVecs);
  static_assert(D % 16 == 0 && kVecs % kSlice == 0, "head_dim must be a multiple of 16");
  for (int64_t r0 = 0; r0 < rows; r0 += kRowGroup) {
    for (int d0 = 0; d0 < kVecs; d0 += kSlice) {
      V16 a[kRowGroup][kSlice];
      for (int g = 0; g < kRowGroup; ++g) {
        for (int j = 0; j < kSlice; ++j) a[g][j] = V16::Load(&acc[(r0 + g) * D + 16 * (d0 + j)]);
      }
      for (int64_t t = 0; t < n; ++t) {
        const int64_t off = key_offset[t];
        if (off < 0) continue;
        V16 v[kSlice];
        for (int j = 0; j < kSlice; ++j) v[j] = LoadRow16<kKv>(P.v_pages, off + 16 * (d0 + j));
        float vs = 1.0f;  // the V row's scale, folded into its weights
        if constexpr (Quantized(kKv)) vs = RowScale<kKv, D>(P.v_scales, off);
        for (int g = 0; g < kRowGroup; ++g) {
          const V16 wv = V16::Set(w[(r0 + g) * row_stride + t * key_stride] * vs);
          for (int j = 0; j < kSlice; ++j) a[g][j] = Fma(wv, v[j], a[g][j]);
        }
      }
      for (int g = 0; g < kRowGroup; ++g) {
        for (int j = 0; j < kSlice; ++j) a[g][j].Store(&acc[(r0 + g) * D + 16 * (d0 + j)]);
      }
    }
  }
}

// Row i's score for key t: -inf where the key is not visible to it (causal, window, a page
// that is not live), soft-capped otherwise.
inline float MaskedScore(const Problem& P, float s, bool live, int64_t kv_pos, int64_t pos) {
  if (!live || !Visible(kv_pos, pos, P.sliding_window)) return -INFINITY;
  return P.soft_cap > 0.0f ? P.soft_cap * std::tanh(s / P.soft_cap) : s;
}

// Few rows: scores[row * kChunk + t] for rows [0, rows) (a multiple of kRowGroup).
template <int D, Kv kKv>
void DotScores(const Problem& P, const float* qf, const int64_t* pos, const int64_t* key_offset,
               int64_t c0, int64_t n, int64_t rows, float* scores) {
  constexpr int kVecs = D / 16;
  for (int64_t b0 = 0; b0 < n; b0 += 16) {
    const int64_t nb = std::min<int64_t>(16, n - b0);
    bool all_live = nb == 16;
    for (int64_t t = 0; t < nb; ++t) all_live &= key_offset[b0 + t] >= 0;
    for (int64_t r0 = 0; r0 < rows; r0 += kRowGroup) {
      V16 dots[kRowGroup][16];
      for (int64_t t = 0; t < 16; ++t) {
        const int64_t off = t < nb ? key_offset[b0 + t] : -1;
        if (off < 0) {
          for (int g = 0; g < kRowGroup; ++g) dots[g][t] = V16::Zero();
          continue;
        }
        V16 k[kVecs];
        for (int j = 0; j < kVecs; ++j) k[j] = LoadRow16<kKv>(P.k_pages, off + 16 * j);
        if constexpr (Quantized(kKv)) {
          const V16 ks = V16::Set(RowScale<kKv, D>(P.k_scales, off));
          for (int j = 0; j < kVecs; ++j) k[j] = Mul(k[j], ks);
        }
        for (int g = 0; g < kRowGroup; ++g) {
          const float* qrow = &qf[(r0 + g) * D];
          V16 s = Mul(V16::Load(qrow), k[0]);
          for (int j = 1; j < kVecs; ++j) s = Fma(V16::Load(qrow + 16 * j), k[j], s);
          dots[g][t] = s;
        }
      }
      for (int g = 0; g < kRowGroup; ++g) {
        float* out = &scores[(r0 + g) * kChunk + b0];
        Sum16(dots[g]).Store(out);
        const int64_t p = pos[r0 + g], first = c0 + b0;
        const bool whole = all_live && P.soft_cap <= 0.0f && Visible(first + 15, p, 0) &&
                           (P.sliding_window <= 0 || first > p - P.sliding_window);
        if (whole) continue;
        for (int64_t t = 0; t < 16; ++t) {
          const bool live = t < nb && key_offset[b0 + t] >= 0;
          out[t] = MaskedScore(P, out[t], live, first + t, p);
        }
      }
    }
  }
}

// Many rows: st[t * lanes + row] for rows [0, lanes), from qt (q transposed: 16-row lane
// blocks, [lanes / 16, D, 16]).
template <int D, Kv kKv>
void LaneScores(const Problem& P, const float* qt, const int64_t* pos, int64_t lanes,
                const int64_t* key_offset, int64_t c0, int64_t n, float* st) {
  thread_local std::vector<float> kbuf, zeros;
  kbuf.resize(kLaneKeys * D);
  zeros.assign(D, 0.0f);
  for (int64_t t0 = 0; t0 < n; t0 += kLaneKeys) {
    const float* krow[kLaneKeys];
    for (int u = 0; u < kLaneKeys; ++u) {
      const int64_t off = t0 + u < n ? key_offset[t0 + u] : -1;
      if (off < 0) {
        krow[u] = zeros.data();
      } else if constexpr (kKv != Kv::kF32) {  // widened (and scaled) once for all rows
        V16 ks = V16::Set(1.0f);
        if constexpr (Quantized(kKv)) ks = V16::Set(RowScale<kKv, D>(P.k_scales, off));
        for (int j = 0; j < D / 16; ++j) {
          V16 x = LoadRow16<kKv>(P.k_pages, off + 16 * j);
          if constexpr (Quantized(kKv)) x = Mul(x, ks);
          x.Store(&kbuf[u * D + 16 * j]);
        }
        krow[u] = &kbuf[u * D];
      } else {
        krow[u] = static_cast<const float*>(P.k_pages) + off;
      }
    }
    const int64_t nt = std::min<int64_t>(kLaneKeys, n - t0);
    for (int64_t r0 = 0; r0 < lanes; r0 += 16) {
      const float* q = &qt[r0 * D];
      V16 s[kLaneKeys];
      for (int u = 0; u < kLaneKeys; ++u) s[u] = V16::Zero();
      for (int d = 0; d < D; ++d) {
        const V16 qd = V16::Load(q + 16 * d);
        for (int u = 0; u < kLaneKeys; ++u) s[u] = Fma(V16::Set(krow[u][d]), qd, s[u]);
      }
      for (int64_t u = 0; u < nt; ++u) s[u].Store(&st[(t0 + u) * lanes + r0]);
    }
  }
  // Masking: only keys past the first row's position (or before the last row's window), or
  // on a page that is not live, have rows that cannot see them.
  const int64_t first_pos = pos[0], last_pos = pos[lanes - 1];
  for (int64_t t = 0; t < n; ++t) {
    const int64_t kv_pos = c0 + t;
    const bool live = key_offset[t] >= 0;
    float* s = &st[t * lanes];
    const bool whole = live && P.soft_cap <= 0.0f && kv_pos <= first_pos &&
                       (P.sliding_window <= 0 || kv_pos > last_pos - P.sliding_window);
    if (whole) continue;
    for (int64_t i = 0; i < lanes; ++i) s[i] = MaskedScore(P, s[i], live, kv_pos, pos[i]);
  }
}

// The rows of an item and where their outputs go: query row i is head it.kv_head * group +
// i % group of token it.row_begin + i / group.
inline int64_t QueryOffset(const Problem& P, const Item& it, int64_t i) {
  return ((it.row_begin + i / P.group) * P.num_q_heads + it.kv_head * P.group + i % P.group) *
         P.head_dim;
}

inline void StoreOutputs(const Problem& P, const Item& it, int64_t nq, const float* acc,
                         const float* l) {
  const int64_t D = P.head_dim;
  std::vector<float> o(D);
  for (int64_t i = 0; i < nq; ++i) {
    const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
    for (int64_t d = 0; d < D; ++d) o[d] = acc[i * D + d] * inv;
    StoreFromF32(P.out, P.q_bf16, QueryOffset(P, it, i), D, o.data());
  }
}

// The chunk's rows (element offsets `key_offset`, -1: not live) as float32 values, scaled
// for quantized kinds, into `buf` [n, D]; `offset[t]` is row t's offset in it (or -1).
template <int D, Kv kKv>
void WidenRows(const void* pages, const float* scales, const int64_t* key_offset, int64_t n,
               std::vector<float>& buf, std::vector<int64_t>& offset) {
  buf.resize(n * D);
  offset.resize(n);
  for (int64_t t = 0; t < n; ++t) {
    const int64_t off = key_offset[t];
    offset[t] = off < 0 ? -1 : t * D;
    if (off < 0) continue;
    V16 s = V16::Set(1.0f);
    if constexpr (Quantized(kKv)) s = V16::Set(RowScale<kKv, D>(scales, off));
    for (int j = 0; j < D / 16; ++j) {
      V16 x = LoadRow16<kKv>(pages, off + 16 * j);
      if constexpr (Quantized(kKv)) x = Mul(x, s);
      x.Store(&buf[t * D + 16 * j]);
    }
  }
}

template <int D, Kv kKv>
void RunItemV16(const Problem& P, const Item& it) {
  const int64_t rows = it.row_end - it.row_begin, nq = rows * P.group;
  const int64_t q_len = P.cu[it.seq + 1] - P.cu[it.seq];
  const int64_t len = P.kv_len[it.seq];
  const int64_t first_pos = len - q_len + (it.row_begin - P.cu[it.seq]);
  const int64_t hi = std::min<int64_t>(first_pos + rows, len);  // positions [lo, hi) matter
  int64_t lo = 0;
  if (P.sliding_window > 0) lo = std::max<int64_t>(0, first_pos - P.sliding_window + 1);
  const bool in_lanes = nq >= 16 && q_len > kMaxRowByRowTokens;
  const int64_t work_rows = RoundUp(nq, kRowGroup);  // zero rows past nq
  const int64_t lanes = in_lanes ? RoundUp(nq, 16) : work_rows;

  thread_local std::vector<float> qf, qt, acc, scores, m, l, vbuf;
  thread_local std::vector<int64_t> key_offset, pos, voff;
  qf.assign(lanes * D, 0.0f);
  for (int64_t i = 0; i < nq; ++i) {
    LoadF32(P.q, P.q_bf16, QueryOffset(P, it, i), D, &qf[i * D]);
    for (int64_t d = 0; d < D; ++d) qf[i * D + d] *= P.sm_scale;
  }
  pos.resize(lanes);  // padding rows copy the last row's position
  for (int64_t i = 0; i < lanes; ++i) pos[i] = first_pos + std::min(i, nq - 1) / P.group;
  if (in_lanes) {
    qt.resize(lanes * D);
    for (int64_t r0 = 0; r0 < lanes; r0 += 16) {
      for (int64_t d = 0; d < D; ++d) {
        for (int64_t i = 0; i < 16; ++i) qt[r0 * D + d * 16 + i] = qf[(r0 + i) * D + d];
      }
    }
  }
  acc.assign(lanes * D, 0.0f);
  m.assign(lanes, -INFINITY);
  l.assign(lanes, 0.0f);
  scores.resize(lanes * kChunk);
  key_offset.resize(kChunk);

  for (int64_t c0 = lo; c0 < hi; c0 += kChunk) {
    const int64_t n = std::min<int64_t>(kChunk, hi - c0);
    ChunkKeyOffsets(P, it, c0, n, D * KvBytes(kKv), key_offset.data());
    if (in_lanes) {
      LaneScores<D, kKv>(P, qt.data(), pos.data(), lanes, key_offset.data(), c0, n,
                         scores.data());
      SoftmaxLanes(scores.data(), lanes, work_rows, n, D, m.data(), l.data(), acc.data());
      if constexpr (kKv == Kv::kF32) {
        AccumulatePv<D, kKv>(P, key_offset.data(), n, scores.data(), 1, lanes, work_rows,
                             acc.data());
      } else {
        // Many row groups read each V row: widen (and scale) the chunk's rows once.
        WidenRows<D, kKv>(P.v_pages, P.v_scales, key_offset.data(), n, vbuf, voff);
        Problem local = P;
        local.v_pages = vbuf.data();
        AccumulatePv<D, Kv::kF32>(local, voff.data(), n, scores.data(), 1, lanes, work_rows,
                                  acc.data());
      }
    } else {
      DotScores<D, kKv>(P, qf.data(), pos.data(), key_offset.data(), c0, n, work_rows,
                        scores.data());
      SoftmaxRows(scores.data(), work_rows, n, D, m.data(), l.data(), acc.data());
      AccumulatePv<D, kKv>(P, key_offset.data(), n, scores.data(), kChunk, 1, work_rows,
                           acc.data());
    }
  }
  StoreOutputs(P, it, nq, acc.data(), l.data());
}

#if defined(__AVX512BF16__)
// bfloat16 q against bfloat16 pages with AVX512-BF16: scores from vdpbf16ps straight on the
// stored bits, two dimensions per 32-bit lane. From 16 query rows on (a prefill block), the
// 16 keys of a block are gathered transposed once, so each row's 16 scores come from D/2
// dot products with no cross-lane sums; otherwise each K row is dotted with kRowGroup rows
// and reduced by Sum16. Softmax and the V side are RunItemV16's.
template <int D>
void RunItemBf16Dot(const Problem& P, const Item& it) {
  const int64_t rows = it.row_end - it.row_begin, nq = rows * P.group;
  const int64_t nq4 = RoundUp(nq, kRowGroup);  // zero rows past nq
  const int64_t q_len = P.cu[it.seq + 1] - P.cu[it.seq];
  const int64_t len = P.kv_len[it.seq];
  const int64_t first_pos = len - q_len + (it.row_begin - P.cu[it.seq]);
  const int64_t hi = std::min<int64_t>(first_pos + rows, len);
  int64_t lo = 0;
  if (P.sliding_window > 0) lo = std::max<int64_t>(0, first_pos - P.sliding_window + 1);

  thread_local std::vector<float> acc, scores, m, l;
  thread_local std::vector<uint16_t> qb;
  thread_local std::vector<int64_t> key_offset;
  qb.assign(nq4 * D, 0);
  acc.assign(nq4 * D, 0.0f);
  scores.resize(nq4 * kChunk);
  m.assign(nq4, -INFINITY);
  l.assign(nq4, 0.0f);
  key_offset.resize(kChunk);
  for (int64_t i = 0; i < nq; ++i) {
    std::memcpy(&qb[i * D], static_cast<const uint16_t*>(P.q) + QueryOffset(P, it, i), D * 2);
  }
  // The transposed keys pay a gather per 16 keys: worth it from 16 query rows on, and while
  // a head's pool (in 32-bit words) is addressable by 32-bit gather indices.
  const int64_t head_elems = P.num_pages * P.page_size * D;
  const int64_t head_base = it.kv_head * head_elems;
  const bool transposed =
      nq4 >= 16 && q_len > kMaxRowByRowTokens && head_elems / 2 < (int64_t{1} << 31);
  auto row_pos = [&](int64_t i) { return first_pos + std::min(i, nq - 1) / P.group; };

  for (int64_t c0 = lo; c0 < hi; c0 += kChunk) {
    const int64_t n = std::min<int64_t>(kChunk, hi - c0);
    ChunkKeyOffsets(P, it, c0, n, D * 2, key_offset.data());
    for (int64_t b0 = 0; b0 < n; b0 += 16) {
      const int64_t nb = std::min<int64_t>(16, n - b0);
      bool all_live = nb == 16;
      for (int64_t t = 0; t < nb; ++t) all_live &= key_offset[b0 + t] >= 0;
      __m512i kt[D / 2];
      if (transposed) {
        alignas(64) int32_t idx[16];
        __mmask16 live = 0;
        for (int64_t t = 0; t < 16; ++t) {
          const int64_t off = t < nb ? key_offset[b0 + t] : -1;
          idx[t] = off < 0 ? 0 : static_cast<int32_t>((off - head_base) / 2);
          if (off >= 0) live |= static_cast<__mmask16>(1u << t);
        }
        const __m512i vidx = _mm512_load_si512(idx);
        const int32_t* base = static_cast<const int32_t*>(P.k_pages) + head_base / 2;
        for (int j = 0; j < D / 2; ++j) {
          kt[j] = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, vidx, base + j, 4);
        }
      }
      for (int64_t r0 = 0; r0 < nq4; r0 += kRowGroup) {
        V16 sums[kRowGroup];
        if (transposed) {
          // kPartials sums per row, dimensions j = kPartials i + p in sum p: kRowGroup x
          // kPartials independent vdpbf16ps chains keep the unit busy (one chain per row
          // would wait out the instruction's latency at every step).
          constexpr int kPartials = 4;
          static_assert(D / 2 % kPartials == 0, "head_dim must be a multiple of 8");
          const int32_t* qdw = reinterpret_cast<const int32_t*>(qb.data()) + r0 * D / 2;
          __m512 part[kRowGroup][kPartials];
          for (int g = 0; g < kRowGroup; ++g) {
            for (int p = 0; p < kPartials; ++p) part[g][p] = _mm512_setzero_ps();
          }
          for (int j = 0; j < D / 2; j += kPartials) {
            for (int g = 0; g < kRowGroup; ++g) {
              for (int p = 0; p < kPartials; ++p) {
                part[g][p] = _mm512_dpbf16_ps(
                    part[g][p], (__m512bh)_mm512_set1_epi32(qdw[g * D / 2 + j + p]),
                    (__m512bh)kt[j + p]);
              }
            }
          }
          for (int g = 0; g < kRowGroup; ++g) {
            sums[g] = {_mm512_add_ps(_mm512_add_ps(part[g][0], part[g][1]),
                                     _mm512_add_ps(part[g][2], part[g][3]))};
          }
        } else {
          V16 dots[kRowGroup][16];
          for (int64_t t = 0; t < 16; ++t) {
            const int64_t off = t < nb ? key_offset[b0 + t] : -1;
            if (off < 0) {
              for (int g = 0; g < kRowGroup; ++g) dots[g][t] = V16::Zero();
              continue;
            }
            const uint16_t* krow = static_cast<const uint16_t*>(P.k_pages) + off;
            __m512i k[D / 32];
            for (int j = 0; j < D / 32; ++j) k[j] = _mm512_loadu_si512(krow + 32 * j);
            for (int g = 0; g < kRowGroup; ++g) {
              const uint16_t* qrow = &qb[(r0 + g) * D];
              __m512 s = _mm512_setzero_ps();
              for (int j = 0; j < D / 32; ++j) {
                s = _mm512_dpbf16_ps(s, (__m512bh)_mm512_loadu_si512(qrow + 32 * j),
                                     (__m512bh)k[j]);
              }
              dots[g][t] = {s};
            }
          }
          for (int g = 0; g < kRowGroup; ++g) sums[g] = Sum16(dots[g]);
        }
        for (int g = 0; g < kRowGroup; ++g) {
          float* out = &scores[(r0 + g) * kChunk + b0];
          Mul(sums[g], V16::Set(P.sm_scale)).Store(out);
          const int64_t p = row_pos(r0 + g), first = c0 + b0;
          // (a block every key of which the row sees, live, uncapped: nothing to mask)
          const bool whole = all_live && P.soft_cap <= 0.0f && Visible(first + 15, p, 0) &&
                             (P.sliding_window <= 0 || first > p - P.sliding_window);
          if (whole) continue;
          for (int64_t t = 0; t < 16; ++t) {
            const bool live = t < nb && key_offset[b0 + t] >= 0;
            out[t] = MaskedScore(P, out[t], live, c0 + b0 + t, p);
          }
        }
      }
    }
    SoftmaxRows(scores.data(), nq4, n, D, m.data(), l.data(), acc.data());
    AccumulatePv<D, Kv::kBf16>(P, key_offset.data(), n, scores.data(), kChunk, 1, nq4,
                               acc.data());
  }
  StoreOutputs(P, it, nq, acc.data(), l.data());
}
#endif  // __AVX512BF16__

template <int kHeadDim>
void RunItemFast(const Problem& P, const Item& it) {
#if defined(__AVX512BF16__)
  if (P.q_bf16 && P.kv == Kv::kBf16) return RunItemBf16Dot<kHeadDim>(P, it);
#endif
  switch (P.kv) {
    case Kv::kBf16:
      return RunItemV16<kHeadDim, Kv::kBf16>(P, it);
    case Kv::kI8:
      return RunItemV16<kHeadDim, Kv::kI8>(P, it);
    case Kv::kE4M3:
      return RunItemV16<kHeadDim, Kv::kE4M3>(P, it);
    case Kv::kE5M2:
      return RunItemV16<kHeadDim, Kv::kE5M2>(P, it);
    default:
      return RunItemV16<kHeadDim, Kv::kF32>(P, it);
  }
}
#define JAXCB_RUN_ITEM RunItemFast
#else
#define JAXCB_RUN_ITEM RunItem
#endif  // JAXCB_HAVE_V16

// The kind of a pool's dtype; false for a dtype the kernels do not read.
bool KvKind(ffi::DataType type, Kv* kind) {
  switch (type) {
    case ffi::DataType::F32:
      *kind = Kv::kF32;
      return true;
    case ffi::DataType::BF16:
      *kind = Kv::kBf16;
      return true;
    case ffi::DataType::S8:
      *kind = Kv::kI8;
      return true;
    case ffi::DataType::F8E4M3FN:
      *kind = Kv::kE4M3;
      return true;
    case ffi::DataType::F8E5M2:
      *kind = Kv::kE5M2;
      return true;
    default:
      return false;
  }
}

// Checks the pools' dtypes and, for quantized ones, that both scale arrays hold one float32
// per (head, page, slot).
ffi::Error CheckPools(const ffi::AnyBuffer& k_pages, const ffi::AnyBuffer& v_pages,
                      const ffi::AnyBuffer& k_scales, const ffi::AnyBuffer& v_scales, Kv* kind) {
  if (!KvKind(k_pages.element_type(), kind) || v_pages.element_type() != k_pages.element_type()) {
    return ffi::Error::InvalidArgument(
        "K/V pages must both be float32, bfloat16, int8, float8_e4m3fn or float8_e5m2");
  }
  if (!Quantized(*kind)) return ffi::Error::Success();
  const int64_t rows =
      static_cast<int64_t>(k_pages.element_count()) / k_pages.dimensions().back();
  for (const ffi::AnyBuffer* scales : {&k_scales, &v_scales}) {
    if (scales->element_type() != ffi::DataType::F32 ||
        static_cast<int64_t>(scales->element_count()) != rows) {
      return ffi::Error::InvalidArgument(
          "quantized K/V pages need float32 scales [Hkv, P, page_size]");
    }
  }
  return ffi::Error::Success();
}

ffi::Error RaggedPagedAttentionImpl(ffi::ThreadPool pool, ffi::AnyBuffer q,
                                    ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                                    ffi::Buffer<ffi::S32> kv_lens,
                                    ffi::Buffer<ffi::S32> page_indices,
                                    ffi::Buffer<ffi::S32> cu_q_lens,
                                    ffi::Buffer<ffi::S32> num_seqs, ffi::AnyBuffer k_scales,
                                    ffi::AnyBuffer v_scales, float sm_scale,
                                    int64_t sliding_window, float soft_cap,
                                    ffi::Result<ffi::AnyBuffer> out) {
  auto qd = q.dimensions();
  auto kd = k_pages.dimensions();
  if (qd.size() != 3 || kd.size() != 4) {
    return ffi::Error::InvalidArgument("q must be [T, Hq, D] and pages [Hkv, P, ps, D]");
  }
  Kv kv;
  if (ffi::Error error = CheckPools(k_pages, v_pages, k_scales, v_scales, &kv); error.failure()) {
    return error;
  }
  const int64_t num_tokens = qd[0], num_q_heads = qd[1], head_dim = qd[2];
  const int64_t num_kv_heads = kd[0], num_pages = kd[1], page_size = kd[2];
  const int64_t group = num_q_heads / num_kv_heads;
  const int64_t max_num_seqs = kv_lens.dimensions()[0];
  const int64_t pages_per_seq = page_indices.dimensions()[1];
  const bool q_bf16 = q.element_type() == ffi::DataType::BF16;
  const int32_t* kv_len = kv_lens.typed_data();
  const int32_t* pages = page_indices.typed_data();
  const int32_t* cu = cu_q_lens.typed_data();
  const int64_t live = std::clamp<int64_t>(num_seqs.typed_data()[0], 0, max_num_seqs);

  std::memset(out->untyped_data(), 0, out->size_bytes());

  std::vector<Item> items;
  for (int32_t s = 0; s < live; ++s) {
    for (int32_t r = cu[s]; r < cu[s + 1] && r < num_tokens; r += kRowsPerItem) {
      int32_t end = std::min<int32_t>({r + kRowsPerItem, cu[s + 1], (int32_t)num_tokens});
      for (int32_t h = 0; h < num_kv_heads; ++h) items.push_back({s, h, r, end});
    }
  }

  const bool quantized = Quantized(kv);
  const Problem problem{q.untyped_data(),
                        k_pages.untyped_data(),
                        v_pages.untyped_data(),
                        out->untyped_data(),
                        q_bf16,
                        kv,
                        quantized ? static_cast<const float*>(k_scales.untyped_data()) : nullptr,
                        quantized ? static_cast<const float*>(v_scales.untyped_data()) : nullptr,
                        kv_len,
                        pages,
                        cu,
                        num_q_heads,
                        num_kv_heads,
                        num_pages,
                        page_size,
                        head_dim,
                        group,
                        pages_per_seq,
                        sm_scale,
                        soft_cap,
                        sliding_window};
  // The head sizes of the supported families take the vector routines, compiled for each:
  // 64 and 128 (Llama, Qwen, Mistral), 96 (Phi-3), 256 (Gemma). Any other: the scalar one.
  auto run = [&](int64_t index) {
    switch (head_dim) {
      case 64:
        return JAXCB_RUN_ITEM<64>(problem, items[index]);
      case 96:
        return JAXCB_RUN_ITEM<96>(problem, items[index]);
      case 128:
        return JAXCB_RUN_ITEM<128>(problem, items[index]);
      case 256:
        return JAXCB_RUN_ITEM<256>(problem, items[index]);
      default:
        return RunItem<0>(problem, items[index]);
    }
  };
  ParallelFor(pool, static_cast<int64_t>(items.size()), run);
  return ffi::Error::Success();
}

// Scatters the new K/V rows of a step into their page slots; the pool buffers are aliased to
// the outputs, so the update is in place. Rows whose slot is out of range write nothing.
// Rows of the pool's own dtype are copied as they are, bit for bit (any dtype: a swapped-out
// quantized pool's codes, or its scales [Hkv, P, ps] from rows [T, Hkv]); float32 / bfloat16
// rows into a float32 / bfloat16 pool are converted (rounded to nearest even).
ffi::Error KvWriteImpl(ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages, ffi::AnyBuffer k_new,
                       ffi::AnyBuffer v_new, ffi::Buffer<ffi::S32> slot_mapping,
                       ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out) {
  auto kd = k_pages.dimensions();
  if (kd.size() != 4 && kd.size() != 3) {
    return ffi::Error::InvalidArgument("pools must be [Hkv, P, ps, D] (or scales [Hkv, P, ps])");
  }
  const int64_t num_kv_heads = kd[0], num_slots = kd[1] * kd[2];
  const int64_t head_dim = kd.size() == 4 ? kd[3] : 1;  // scales: rows of one value
  const int64_t num_tokens = slot_mapping.dimensions()[0];
  const ffi::DataType pool_type = k_pages.element_type(), new_type = k_new.element_type();
  const bool raw = new_type == pool_type && v_new.element_type() == v_pages.element_type();
  auto is_float = [](ffi::DataType t) {
    return t == ffi::DataType::F32 || t == ffi::DataType::BF16;
  };
  if (!raw && !(is_float(pool_type) && is_float(new_type))) {
    return ffi::Error::InvalidArgument(
        "the KV write converts float32 / bfloat16 rows only; quantized pages take the "
        "quantized write, or rows of their own dtype to copy");
  }
  const bool pool_bf16 = pool_type == ffi::DataType::BF16;
  const bool new_bf16 = new_type == ffi::DataType::BF16;
  const int64_t row_bytes = head_dim * static_cast<int64_t>(ffi::ByteWidth(pool_type));
  const int32_t* slots = slot_mapping.typed_data();
  std::vector<float> row(head_dim);
  auto write = [&](const ffi::AnyBuffer& pool_in, ffi::Result<ffi::AnyBuffer>& pool_out,
                   const ffi::AnyBuffer& src) {
    if (pool_out->untyped_data() != pool_in.untyped_data()) {  // not aliased: copy first
      std::memcpy(pool_out->untyped_data(), pool_in.untyped_data(), pool_in.size_bytes());
    }
    for (int64_t t = 0; t < num_tokens; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0 || slot >= num_slots) continue;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const int64_t from = (t * num_kv_heads + h) * head_dim;
        const int64_t to = (h * num_slots + slot) * head_dim;
        if (raw) {
          std::memcpy(static_cast<char*>(pool_out->untyped_data()) + to / head_dim * row_bytes,
                      static_cast<const char*>(src.untyped_data()) + from / head_dim * row_bytes,
                      row_bytes);
          continue;
        }
        LoadF32(src.untyped_data(), new_bf16, from, head_dim, row.data());
        StoreFromF32(pool_out->untyped_data(), pool_bf16, to, head_dim, row.data());
      }
    }
  };
  write(k_pages, k_out, k_new);
  write(v_pages, v_out, v_new);
  return ffi::Error::Success();
}

// One row of head_dim values into codes and their scale, as kv_quant.quantize_rows does:
// scale = max|x| / Qmax (1 for an all-zero row); int8 codes round(x / scale) half to even,
// clipped to +-127; float8 codes x / scale cast to nearest even, saturated to +-Qmax.
template <Kv kKv>
float QuantizeRow(const float* x, int64_t n, void* codes) {
  float amax = 0.0f;
  for (int64_t d = 0; d < n; ++d) amax = std::max(amax, std::fabs(x[d]));
  const float scale = amax > 0.0f ? amax / Qmax(kKv) : 1.0f;
  for (int64_t d = 0; d < n; ++d) {
    const float y = x[d] / scale;
    if constexpr (kKv == Kv::kI8) {
      static_cast<int8_t*>(codes)[d] =
          static_cast<int8_t>(std::clamp(std::nearbyint(y), -127.0f, 127.0f));
    } else if constexpr (kKv == Kv::kE4M3) {
      static_cast<uint8_t*>(codes)[d] = F32ToFp8<3, 7>(y, Qmax(kKv));
    } else {
      static_cast<uint8_t*>(codes)[d] = F32ToFp8<2, 15>(y, Qmax(kKv));
    }
  }
  return scale;
}

// The quantized pools' write: each new row's codes into its slot and its scale into the
// slot's scale, in place (pools and scales aliased to the outputs). Out-of-range slots write
// nothing. Scalar code: a step writes T x Hkv rows per layer, a small share of its work.
ffi::Error KvWriteQuantImpl(ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                            ffi::AnyBuffer k_scales, ffi::AnyBuffer v_scales, ffi::AnyBuffer k_new,
                            ffi::AnyBuffer v_new, ffi::Buffer<ffi::S32> slot_mapping,
                            ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out,
                            ffi::Result<ffi::AnyBuffer> k_scales_out,
                            ffi::Result<ffi::AnyBuffer> v_scales_out) {
  Kv kv;
  if (ffi::Error error = CheckPools(k_pages, v_pages, k_scales, v_scales, &kv); error.failure()) {
    return error;
  }
  if (!Quantized(kv)) return ffi::Error::InvalidArgument("the quantized KV write needs int8/fp8");
  auto kd = k_pages.dimensions();
  const int64_t num_kv_heads = kd[0], num_slots = kd[1] * kd[2], head_dim = kd[3];
  const int64_t num_tokens = slot_mapping.dimensions()[0];
  const bool new_bf16 = k_new.element_type() == ffi::DataType::BF16;
  const int32_t* slots = slot_mapping.typed_data();
  std::vector<float> row(head_dim);
  auto write = [&](const ffi::AnyBuffer& pool_in, ffi::Result<ffi::AnyBuffer>& pool_out,
                   const ffi::AnyBuffer& scales_in, ffi::Result<ffi::AnyBuffer>& scales_out,
                   const ffi::AnyBuffer& src) {
    for (auto [in, out] : {std::pair{&pool_in, &pool_out}, std::pair{&scales_in, &scales_out}}) {
      if ((*out)->untyped_data() != in->untyped_data()) {  // not aliased: copy first
        std::memcpy((*out)->untyped_data(), in->untyped_data(), in->size_bytes());
      }
    }
    auto* codes = static_cast<uint8_t*>(pool_out->untyped_data());
    auto* scales = static_cast<float*>(scales_out->untyped_data());
    for (int64_t t = 0; t < num_tokens; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0 || slot >= num_slots) continue;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        LoadF32(src.untyped_data(), new_bf16, (t * num_kv_heads + h) * head_dim, head_dim,
                row.data());
        const int64_t at = h * num_slots + slot;
        void* dst = codes + at * head_dim;
        switch (kv) {
          case Kv::kI8:
            scales[at] = QuantizeRow<Kv::kI8>(row.data(), head_dim, dst);
            break;
          case Kv::kE4M3:
            scales[at] = QuantizeRow<Kv::kE4M3>(row.data(), head_dim, dst);
            break;
          default:
            scales[at] = QuantizeRow<Kv::kE5M2>(row.data(), head_dim, dst);
            break;
        }
      }
    }
  };
  write(k_pages, k_out, k_scales, k_scales_out, k_new);
  write(v_pages, v_out, v_scales, v_scales_out, v_new);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcbRaggedPagedAttention, RaggedPagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()       // q
                                  .Arg<ffi::AnyBuffer>()       // k_pages
                                  .Arg<ffi::AnyBuffer>()       // v_pages
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_indices
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs
                                  .Arg<ffi::AnyBuffer>()  // k_scales (quantized pages; else any)
                                  .Arg<ffi::AnyBuffer>()  // v_scales
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcbKvWrite, KvWriteImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()       // k_pages (aliased to k_out)
                                  .Arg<ffi::AnyBuffer>()       // v_pages (aliased to v_out)
                                  .Arg<ffi::AnyBuffer>()       // k_new [T, Hkv, D]
                                  .Arg<ffi::AnyBuffer>()       // v_new
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot_mapping [T]
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcbKvWriteQuant, KvWriteQuantImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()       // k_pages (aliased to k_out)
                                  .Arg<ffi::AnyBuffer>()       // v_pages (aliased to v_out)
                                  .Arg<ffi::AnyBuffer>()       // k_scales (aliased)
                                  .Arg<ffi::AnyBuffer>()       // v_scales (aliased)
                                  .Arg<ffi::AnyBuffer>()       // k_new [T, Hkv, D]
                                  .Arg<ffi::AnyBuffer>()       // v_new
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot_mapping [T]
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
