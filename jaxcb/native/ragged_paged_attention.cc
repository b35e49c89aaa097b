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
// pool in place, which XLA's CPU scatter cannot do for bfloat16).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#if defined(__AVX512F__) || defined(__AMX_TILE__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kRowsPerItem = 16;  // query rows of one sequence handled by one work item

inline float Bf16ToF32(uint16_t bits) {
  return __builtin_bit_cast(float, static_cast<uint32_t>(bits) << 16);
}

inline uint16_t F32ToBf16(float f) {  // round to nearest even, NaN kept NaN
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

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

// Runs body(i) for i in [0, n) on the caller and XLA's intra-op pool. The caller works too and
// only waits for items some worker has already taken, so a busy pool cannot deadlock it.
template <typename Body>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, Body body) {
  if (n <= 0) return;
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto state = std::make_shared<State>();
  auto work = [state, n, body]() {
    for (int64_t i; (i = state->next.fetch_add(1)) < n;) {
      body(i);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  // The caller is one of the workers: one thread per core in all (more only time-share).
  int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, n - 1);
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([work]() { work(); });
  work();
  while (state->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
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
  bool q_bf16, kv_bf16;
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
    if (P.kv_bf16) {
      LoadF32(P.k_pages, true, base, t_end * head_dim, kbuf.data());
      LoadF32(P.v_pages, true, base, t_end * head_dim, vbuf.data());
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

#if defined(__AVX512F__)
// The AVX-512 item routine: the same work as RunItem, organised for the vector units.
// Query rows go in groups of four so that each K or V row loaded is used four times (with
// GQA the four query heads of a KV head share it). Scores of 16 keys x 4 rows are summed
// across lanes together (Sum16: 46 shuffles and adds per 16 dot products instead of a full
// horizontal reduction each), then a chunk of up to kChunk keys gets one online-softmax
// update, so the running maximum and the accumulators are rescaled once per chunk, not per
// page. bfloat16 q with bfloat16 pages uses the AVX512_BF16 dot product straight on the
// stored bits; any other pairing converts K/V rows to float32 on load.

constexpr int kChunk = 256;  // keys per online-softmax update
constexpr int kGroup = 4;    // query rows sharing each loaded K/V row

inline __m512 LoadBf16Row(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <bool kBf16>
inline __m512 Load16(const void* base, int64_t offset) {
  if constexpr (kBf16) {
    return LoadBf16Row(static_cast<const uint16_t*>(base) + offset);
  } else {
    return _mm512_loadu_ps(static_cast<const float*>(base) + offset);
  }
}

// ExpNonPositive on 16 lanes (x <= 0; -inf lanes give ~0 and are masked by the caller).
inline __m512 Exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_setzero_ps());
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 e = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i bits =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(e, _mm512_castsi512_ps(bits));
}

// Lane t of the result is the sum of all lanes of v[t].
inline __m512 Sum16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {  // 256-bit halves: 8 partials of token i, then of i + 8
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44),
                         _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
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
  return _mm512_permutexvar_ps(order, d);
}

// kDot: q and K both bfloat16, dotted with vdpbf16ps. Otherwise q is float32 (converted
// once per item) and K rows are converted as they are loaded.
template <int kHeadDim, bool kKvBf16, bool kDot>
void RunItemAvx512(const Problem& P, const Item& it) {
  constexpr int D = kHeadDim;
  constexpr int kVecs = D / 16;
  const int64_t page_size = P.page_size, group = P.group;
  const int64_t rows = it.row_end - it.row_begin, nq = rows * group;
  const int64_t nq4 = (nq + kGroup - 1) / kGroup * kGroup;  // padded with zero rows
  const int64_t q_len = P.cu[it.seq + 1] - P.cu[it.seq];
  const int64_t len = P.kv_len[it.seq];
  const int64_t first_pos = len - q_len + (it.row_begin - P.cu[it.seq]);
  const int64_t hi = std::min<int64_t>(first_pos + rows, len);
  int64_t lo = 0;
  if (P.sliding_window > 0) lo = std::max<int64_t>(0, first_pos - P.sliding_window + 1);

  thread_local std::vector<float> qf, acc, scores, m, l;
  thread_local std::vector<uint16_t> qb;
  thread_local std::vector<int64_t> key_offset;
  qf.assign(kDot ? 0 : nq4 * D, 0.0f);
  qb.assign(kDot ? nq4 * D : 0, 0);
  acc.assign(nq4 * D, 0.0f);
  scores.resize(nq4 * kChunk);  // kChunk is a multiple of 16
  m.assign(nq4, -INFINITY);
  l.assign(nq4, 0.0f);
  key_offset.resize(kChunk);

  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < group; ++g) {
      const int64_t src = ((it.row_begin + r) * P.num_q_heads + it.kv_head * group + g) * D;
      if constexpr (kDot) {
        std::memcpy(&qb[(r * group + g) * D], static_cast<const uint16_t*>(P.q) + src, D * 2);
      } else {
        LoadF32(P.q, P.q_bf16, src, D, &qf[(r * group + g) * D]);
      }
    }
  }
  // The transposed-key scores pay a gather per 16 keys: worth it from 16 query rows on, and
  // while a head's pool (in 32-bit words) is addressable by 32-bit gather indices.
  const int64_t head_elems = P.num_pages * page_size * D;
  const int64_t head_base = it.kv_head * head_elems;
  const bool transposed = kDot && nq4 >= 16 && head_elems / 2 < (int64_t{1} << 31);
  // Query row i sits at position first_pos + i / group; padding rows copy the last one.
  auto row_pos = [&](int64_t i) { return first_pos + std::min(i, nq - 1) / group; };
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);

  for (int64_t c0 = lo; c0 < hi; c0 += kChunk) {
    const int64_t n = std::min<int64_t>(kChunk, hi - c0);
    for (int64_t t = 0, pos = c0; t < n;) {  // where each key's row is, page by page
      const int64_t page = P.pages[it.seq * P.pages_per_seq + pos / page_size];
      const bool live = page >= 0 && page < P.num_pages;  // never false: validation
      int64_t off = ((it.kv_head * P.num_pages + page) * page_size + pos % page_size) * D;
      for (int64_t in_page = pos % page_size; in_page < page_size && t < n; ++in_page) {
        key_offset[t++] = live ? off : -1;
        off += D;
        ++pos;
      }
    }
    // Scores, 16 keys at a time, masked to -inf where a key is not visible.
    // The pool is far larger than the caches: ask for all of the chunk's K and V rows now.
    for (int64_t t = 0; t < n; ++t) {
      if (key_offset[t] < 0) continue;
      constexpr int64_t kRowBytes = D * (kKvBf16 ? 2 : 4);
      const char* krow = static_cast<const char*>(P.k_pages) + key_offset[t] * (kRowBytes / D);
      const char* vrow = static_cast<const char*>(P.v_pages) + key_offset[t] * (kRowBytes / D);
      for (int64_t b = 0; b < kRowBytes; b += 64) {
        _mm_prefetch(krow + b, _MM_HINT_T1);
        _mm_prefetch(vrow + b, _MM_HINT_T1);
      }
    }
    for (int64_t b0 = 0; b0 < n; b0 += 16) {
      const int64_t nb = std::min<int64_t>(16, n - b0);
      // Many query rows (a prefill block): gather the 16 keys transposed once, two bf16
      // dimensions per 32-bit lane, so each row's 16 scores come from D/2 dot products
      // with no cross-lane sums.
      __m512i kt[kDot ? D / 2 : 1];
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
        for (int j = 0; j < (kDot ? D / 2 : 0); ++j) {
          kt[j] = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, vidx, base + j, 4);
        }
      }
      for (int64_t r0 = 0; r0 < nq4; r0 += kGroup) {
        __m512 sums[kGroup];
        bool summed = false;
        if constexpr (kDot) {
          if (transposed) {
            const int32_t* qdw = reinterpret_cast<const int32_t*>(qb.data()) + r0 * D / 2;
            for (int g = 0; g < kGroup; ++g) sums[g] = _mm512_setzero_ps();
            for (int j = 0; j < D / 2; ++j) {
              for (int g = 0; g < kGroup; ++g) {
                sums[g] = _mm512_dpbf16_ps(
                    sums[g], (__m512bh)_mm512_set1_epi32(qdw[g * D / 2 + j]), (__m512bh)kt[j]);
              }
            }
            summed = true;
          }
        }
        if (!summed) {
        __m512 dots[kGroup][16];
        for (int64_t t = 0; t < 16; ++t) {
          const int64_t off = t < nb ? key_offset[b0 + t] : -1;
          if (off < 0) {
            for (int g = 0; g < kGroup; ++g) dots[g][t] = _mm512_setzero_ps();
            continue;
          }
          if constexpr (kDot) {
            const uint16_t* krow = static_cast<const uint16_t*>(P.k_pages) + off;
            __m512i k[D / 32];
            for (int j = 0; j < D / 32; ++j) k[j] = _mm512_loadu_si512(krow + 32 * j);
            for (int g = 0; g < kGroup; ++g) {
              const uint16_t* qrow = &qb[(r0 + g) * D];
              __m512 s = _mm512_setzero_ps();
              for (int j = 0; j < D / 32; ++j) {
                s = _mm512_dpbf16_ps(s, (__m512bh)_mm512_loadu_si512(qrow + 32 * j),
                                     (__m512bh)k[j]);
              }
              dots[g][t] = s;
            }
          } else {
            __m512 k[kVecs];
            for (int j = 0; j < kVecs; ++j) k[j] = Load16<kKvBf16>(P.k_pages, off + 16 * j);
            for (int g = 0; g < kGroup; ++g) {
              const float* qrow = &qf[(r0 + g) * D];
              __m512 s = _mm512_mul_ps(_mm512_loadu_ps(qrow), k[0]);
              for (int j = 1; j < kVecs; ++j) {
                s = _mm512_fmadd_ps(_mm512_loadu_ps(qrow + 16 * j), k[j], s);
              }
              dots[g][t] = s;
            }
          }
        }
        for (int g = 0; g < kGroup; ++g) sums[g] = Sum16(dots[g]);
        }
        const __m512i kv_pos = _mm512_add_epi32(iota, _mm512_set1_epi32(c0 + b0));
        const __mmask16 in_block = static_cast<__mmask16>((1u << nb) - 1);
        for (int g = 0; g < kGroup; ++g) {
          __m512 s = _mm512_mul_ps(sums[g], _mm512_set1_ps(P.sm_scale));
          float* out = &scores[(r0 + g) * kChunk + b0];
          const int64_t pos = row_pos(r0 + g);
          __mmask16 ok = in_block & _mm512_cmple_epi32_mask(kv_pos, _mm512_set1_epi32(pos));
          if (P.sliding_window > 0) {
            ok &= _mm512_cmpgt_epi32_mask(kv_pos, _mm512_set1_epi32(pos - P.sliding_window));
          }
          for (int64_t t = 0; t < nb; ++t) ok &= key_offset[b0 + t] < 0 ? ~(1u << t) : 0xffffu;
          if (P.soft_cap > 0.0f) {
            alignas(64) float tmp[16];
            _mm512_store_ps(tmp, s);
            for (float& x : tmp) x = P.soft_cap * std::tanh(x / P.soft_cap);
            s = _mm512_load_ps(tmp);
          }
          _mm512_storeu_ps(out, _mm512_mask_blend_ps(ok, _mm512_set1_ps(-INFINITY), s));
        }
      }
    }
    // Online softmax over the chunk: scores become weights, accumulators are rescaled.
    // (Scores past n, up to a multiple of 16, were stored as -inf.)
    const int64_t n16 = (n + 15) / 16 * 16;
    for (int64_t i = 0; i < nq4; ++i) {
      float* s = &scores[i * kChunk];
      __m512 vmax = _mm512_set1_ps(-INFINITY);
      for (int64_t t = 0; t < n16; t += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + t));
      const float mx = _mm512_reduce_max_ps(vmax);
      if (mx == -INFINITY) {  // nothing visible to this row in this chunk
        std::fill(s, s + n16, 0.0f);
        continue;
      }
      const float m_new = std::max(m[i], mx);
      const float alpha = std::exp(m[i] - m_new);  // exp(-inf) = 0 on the first chunk
      const __m512 vm = _mm512_set1_ps(m_new);
      __m512 vsum = _mm512_setzero_ps();
      for (int64_t t = 0; t < n16; t += 16) {
        const __m512 x = _mm512_loadu_ps(s + t);
        const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
        const __m512 w = _mm512_maskz_mov_ps(live, Exp512(_mm512_sub_ps(x, vm)));
        _mm512_storeu_ps(s + t, w);
        vsum = _mm512_add_ps(vsum, w);
      }
      const float sum = _mm512_reduce_add_ps(vsum);
      l[i] = l[i] * alpha + sum;
      m[i] = m_new;
      if (alpha != 1.0f) {
        for (int64_t d = 0; d < D; ++d) acc[i * D + d] *= alpha;
      }
    }
    // acc += weights x V, four rows and up to 64 dimensions of V in registers at a time.
    constexpr int kSlice = kVecs >= 4 ? 4 : kVecs;
    static_assert(kVecs % kSlice == 0, "head_dim must be a multiple of 64 or 16");
    for (int64_t r0 = 0; r0 < nq4; r0 += kGroup) {
      for (int d0 = 0; d0 < kVecs; d0 += kSlice) {
        __m512 a[kGroup][kSlice];
        for (int g = 0; g < kGroup; ++g) {
          for (int j = 0; j < kSlice; ++j) a[g][j] = _mm512_loadu_ps(&acc[(r0 + g) * D + 16 * (d0 + j)]);
        }
        for (int64_t t = 0; t < n; ++t) {
          const int64_t off = key_offset[t];
          if (off < 0) continue;
          __m512 v[kSlice];
          for (int j = 0; j < kSlice; ++j) v[j] = Load16<kKvBf16>(P.v_pages, off + 16 * (d0 + j));
          for (int g = 0; g < kGroup; ++g) {
            const __m512 w = _mm512_set1_ps(scores[(r0 + g) * kChunk + t]);
            for (int j = 0; j < kSlice; ++j) a[g][j] = _mm512_fmadd_ps(w, v[j], a[g][j]);
          }
        }
        for (int g = 0; g < kGroup; ++g) {
          for (int j = 0; j < kSlice; ++j) _mm512_storeu_ps(&acc[(r0 + g) * D + 16 * (d0 + j)], a[g][j]);
        }
      }
    }
  }
  float o[D];
  for (int64_t i = 0; i < nq; ++i) {
    const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
    for (int64_t d = 0; d < D; ++d) o[d] = acc[i * D + d] * inv;
    const int64_t r = i / group, g = i % group;
    StoreFromF32(P.out, P.q_bf16,
                 ((it.row_begin + r) * P.num_q_heads + it.kv_head * group + g) * D, D, o);
  }
}

template <int kHeadDim>
void RunItemFast(const Problem& P, const Item& it) {
#if defined(__AVX512BF16__)
  if (P.q_bf16 && P.kv_bf16) return RunItemAvx512<kHeadDim, true, true>(P, it);
#endif
  if (P.kv_bf16) return RunItemAvx512<kHeadDim, true, false>(P, it);
  return RunItemAvx512<kHeadDim, false, false>(P, it);
}
#define JAXCB_RUN_ITEM RunItemFast
#else
#define JAXCB_RUN_ITEM RunItem
#endif  // __AVX512F__

ffi::Error RaggedPagedAttentionImpl(ffi::ThreadPool pool, ffi::AnyBuffer q,
                                    ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                                    ffi::Buffer<ffi::S32> kv_lens,
                                    ffi::Buffer<ffi::S32> page_indices,
                                    ffi::Buffer<ffi::S32> cu_q_lens,
                                    ffi::Buffer<ffi::S32> num_seqs, float sm_scale,
                                    int64_t sliding_window, float soft_cap,
                                    ffi::Result<ffi::AnyBuffer> out) {
  auto qd = q.dimensions();
  auto kd = k_pages.dimensions();
  if (qd.size() != 3 || kd.size() != 4) {
    return ffi::Error::InvalidArgument("q must be [T, Hq, D] and pages [Hkv, P, ps, D]");
  }
  const int64_t num_tokens = qd[0], num_q_heads = qd[1], head_dim = qd[2];
  const int64_t num_kv_heads = kd[0], num_pages = kd[1], page_size = kd[2];
  const int64_t group = num_q_heads / num_kv_heads;
  const int64_t max_num_seqs = kv_lens.dimensions()[0];
  const int64_t pages_per_seq = page_indices.dimensions()[1];
  const bool q_bf16 = q.element_type() == ffi::DataType::BF16;
  const bool kv_bf16 = k_pages.element_type() == ffi::DataType::BF16;
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

  const Problem problem{q.untyped_data(), k_pages.untyped_data(), v_pages.untyped_data(),
                        out->untyped_data(), q_bf16, kv_bf16, kv_len, pages, cu, num_q_heads,
                        num_kv_heads, num_pages, page_size, head_dim, group, pages_per_seq,
                        sm_scale, soft_cap, sliding_window};
  auto run = [&](int64_t index) {
    switch (head_dim) {
      case 64:
        return JAXCB_RUN_ITEM<64>(problem, items[index]);
      case 128:
        return JAXCB_RUN_ITEM<128>(problem, items[index]);
      default:
        return RunItem<0>(problem, items[index]);
    }
  };
  ParallelFor(pool, static_cast<int64_t>(items.size()), run);
  return ffi::Error::Success();
}

// Scatters the new K/V rows of a step into their page slots; the pool buffers are aliased to
// the outputs, so the update is in place. Rows whose slot is out of range write nothing.
ffi::Error KvWriteImpl(ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages, ffi::AnyBuffer k_new,
                       ffi::AnyBuffer v_new, ffi::Buffer<ffi::S32> slot_mapping,
                       ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out) {
  auto kd = k_pages.dimensions();
  const int64_t num_kv_heads = kd[0], num_slots = kd[1] * kd[2], head_dim = kd[3];
  const int64_t num_tokens = slot_mapping.dimensions()[0];
  const bool pool_bf16 = k_pages.element_type() == ffi::DataType::BF16;
  const bool new_bf16 = k_new.element_type() == ffi::DataType::BF16;
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
        LoadF32(src.untyped_data(), new_bf16, (t * num_kv_heads + h) * head_dim, head_dim,
                row.data());
        StoreFromF32(pool_out->untyped_data(), pool_bf16, (h * num_slots + slot) * head_dim,
                     head_dim, row.data());
      }
    }
  };
  write(k_pages, k_out, k_new);
  write(v_pages, v_out, v_new);
  return ffi::Error::Success();
}

// ---- bf16 matmul on AMX tiles ----------------------------------------------------------
//
// out[M, N] (f32) = a[M, K] (bf16) x w[K, N] (bf16), with w packed once at load time into
// the tile layout the AMX B operand wants (pack_amx in __init__.py): [N/16, K/32, 16, 32],
// block (n, k) holding rows k*32 .. k*32+31 and columns n*16 .. n*16+15 as 16 rows of
// (even row, odd row) pairs per column. XLA's own bf16 dots reach about half the AMX peak
// on the narrow batches of decode steps; here each thread streams its own columns of w once
// and keeps four 16x16 accumulator tiles (32 rows x 32 columns) busy.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>

bool AmxEnabled() {  // Linux hands out AMX state only on request, once per process
  static const bool enabled = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return enabled;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: accumulators C[i][j] (rows i, columns j of the 32 x 32 block); 4-5: a rows;
// 6-7: w columns. All 16 rows x 64 bytes.
void LoadTileConfig() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// Columns [16 * nb0, 16 * (nb0 + nbs)) of out, nbs in {1, 2}, for rows [m_begin, m_end)
// (32-row blocks; `a` is zero-padded to whole blocks and rows past m are dropped).
void MatmulColumns(const uint16_t* a, int64_t m, int64_t m_begin, int64_t m_end, int64_t k,
                   const uint16_t* w, int64_t n, int64_t nb0, int64_t nbs, float* out) {
  const int64_t kb_count = k / 32;
  const uint16_t* w0 = w + nb0 * kb_count * 512;
  const uint16_t* w1 = w0 + kb_count * 512;
  alignas(64) float tail[32 * 32];
  constexpr int64_t kAhead = 4;  // k-blocks of w requested ahead of use (they stream from DRAM)
  for (int64_t m0 = m_begin; m0 < m_end; m0 += 32) {
    const bool lower = m0 + 16 < m;  // rows 16..31 of the block hold any real row
    const bool first = m0 == m_begin;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const uint16_t* a0 = a + m0 * k;
    const uint16_t* a1 = a0 + 16 * k;
    for (int64_t kb = 0; kb < kb_count; ++kb) {
      if (first && kb + kAhead < kb_count) {
        for (int line = 0; line < 1024; line += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(w0 + (kb + kAhead) * 512) + line,
                       _MM_HINT_T0);
          if (nbs == 2) {
            _mm_prefetch(reinterpret_cast<const char*>(w1 + (kb + kAhead) * 512) + line,
                         _MM_HINT_T0);
          }
        }
      }
      _tile_loadd(4, a0 + kb * 32, k * 2);
      _tile_loadd(6, w0 + kb * 512, 64);
      _tile_dpbf16ps(0, 4, 6);
      if (lower) {
        _tile_loadd(5, a1 + kb * 32, k * 2);
        _tile_dpbf16ps(2, 5, 6);
      }
      if (nbs == 2) {
        _tile_loadd(7, w1 + kb * 512, 64);
        _tile_dpbf16ps(1, 4, 7);
        if (lower) _tile_dpbf16ps(3, 5, 7);
      }
    }
    const bool whole = m0 + 32 <= m;
    float* dst = whole ? out + m0 * n + nb0 * 16 : tail;
    const int64_t ld = whole ? n : 32;
    _tile_stored(0, dst, ld * 4);
    if (nbs == 2) _tile_stored(1, dst + 16, ld * 4);
    if (lower) {
      _tile_stored(2, dst + 16 * ld, ld * 4);
      if (nbs == 2) _tile_stored(3, dst + 16 * ld + 16, ld * 4);
    }
    if (!whole) {
      for (int64_t r = 0; m0 + r < m; ++r) {
        std::memcpy(out + (m0 + r) * n + nb0 * 16, tail + r * 32, nbs * 16 * sizeof(float));
      }
    }
  }
}

ffi::Error MatmulAmxImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> a,
                         ffi::Buffer<ffi::BF16> w, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  auto ad = a.dimensions();
  auto wd = w.dimensions();
  if (ad.size() != 2 || wd.size() != 4 || wd[2] != 16 || wd[3] != 32 || wd[1] * 32 != ad[1]) {
    return ffi::Error::InvalidArgument("a must be [M, K] and w [N/16, K/32, 16, 32]");
  }
  if (!AmxEnabled()) return ffi::Error::Internal("the kernel refused AMX state (arch_prctl)");
  const int64_t m = ad[0], k = ad[1], n = wd[0] * 16, n_blocks = wd[0];
  if (m == 0) return ffi::Error::Success();
  const int64_t m_pad = (m + 31) / 32 * 32;
  const uint16_t* a_data = reinterpret_cast<const uint16_t*>(a.typed_data());
  thread_local std::vector<uint16_t> padded;  // reused: this runs every step
  if (m_pad != m) {  // rows of zeros up to a whole 32-row block
    padded.assign(m_pad * k, 0);
    std::memcpy(padded.data(), a_data, m * k * sizeof(uint16_t));
    a_data = padded.data();
  }
  const uint16_t* w_data = reinterpret_cast<const uint16_t*>(w.typed_data());
  float* out_data = out->typed_data();
  // Work items: pairs of 16-column blocks, in a few contiguous runs per thread.
  const int64_t pairs = (n_blocks + 1) / 2;
  const int64_t items = std::min<int64_t>(pairs, 8 * (pool.num_threads() + 1));
  ParallelFor(pool, items, [&](int64_t item) {
    const int64_t p0 = pairs * item / items, p1 = pairs * (item + 1) / items;
    LoadTileConfig();
    // Rows in chunks whose slice of `a` stays in L2 while the columns stream past it.
    const int64_t chunk = std::max<int64_t>(32, (256 * 1024 / (k * 2)) / 32 * 32);
    for (int64_t mc = 0; mc < m_pad; mc += chunk) {
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t nb0 = 2 * p;
        MatmulColumns(a_data, m, mc, std::min(mc + chunk, m_pad), k, w_data, n, nb0,
                      std::min<int64_t>(2, n_blocks - nb0), out_data);
      }
    }
    _tile_release();
  });
  return ffi::Error::Success();
}
#endif  // AMX


// ---- AVX-512 matmuls over packed weights: bf16 (vdpbf16ps) and f32 (FMA) -------------
//
// out[M, N] (f32) = a[M, K] x w[K, N], w packed once at load time in 16-column blocks that
// run contiguous along K, so that each 4-byte step of K is one 64-byte vector of w:
// - bf16 (pack_bf16, the AMX layout): a step is a k-pair (rows 2p, 2p+1), the vector holds
//   (even row, odd row) for each of the 16 columns, which vdpbf16ps takes against a
//   broadcast pair of a (CPUs with AVX512-BF16 but no AMX: AMD Zen 4 and later);
// - f32 (pack_f32, [N/16, K, 16]): a step is one row k, FMA against a broadcast of a[m, k].
// A micro-tile keeps kMr x kNr accumulators (rows x 16-column blocks) in registers; XLA's
// own dots lose a third of that on the narrow batches of decode steps.
#if defined(__AVX512F__)
constexpr int kPackedMr = 6, kPackedNr = 4;

// silu(g) * u on 16 lanes: g * sigmoid(g), sigmoid from e = exp(-|g|) <= 1.
inline __m512 Swiglu512(__m512 g, __m512 u) {
  const __m512 abs = _mm512_abs_ps(g);
  const __m512 e = Exp512(_mm512_sub_ps(_mm512_setzero_ps(), abs));
  const __m512 num = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(g, abs, _CMP_EQ_OQ), e,
                                          _mm512_set1_ps(1.0f));  // g >= 0: 1, else e
  const __m512 sig = _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
  return _mm512_mul_ps(_mm512_mul_ps(g, sig), u);
}

// Running (max, first column holding it) of the rows of a tile, over the columns seen so far:
// the greedy token of an LM head's rows, taken from the accumulators on the way out.
struct RowArgmax {
  float* val;      // [rows of the tile]
  int32_t* idx;    // [rows of the tile]
  int64_t col0;    // the tile's first output column
};

// Micro-tile of MR rows x NR 16-column blocks. Plain: blocks j at w + j * w_stride, written
// as f32 to out (row stride n; non-temporal if `stream`), and folded into `argmax` if given.
// kSwiglu: blocks j < NR/2 are gate columns, j >= NR/2 the matching up columns at up_offset
// bytes further; silu(gate) * up (NR/2 blocks) is written to out in the weights' dtype (bf16
// feeds the next matmul as it is).
template <bool kBf16, bool kSwiglu, int MR, int NR>
void PackedMicroTile(const char* a, int64_t a_stride, int64_t steps, const char* w,
                     int64_t w_stride, int64_t up_offset, void* out, int64_t n,
                     const char* prefetch, int64_t prefetch_bytes, bool stream,
                     const RowArgmax* argmax) {
  for (int64_t off = 0; off < prefetch_bytes; off += 64) {
    _mm_prefetch(prefetch + off, _MM_HINT_T1);
    if (kSwiglu) _mm_prefetch(prefetch + up_offset + off, _MM_HINT_T1);
  }
  const char* wj[NR];
  for (int j = 0; j < NR; ++j) {
    wj[j] = kSwiglu && j >= NR / 2 ? w + up_offset + (j - NR / 2) * w_stride : w + j * w_stride;
  }
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < steps; ++p) {
    __m512i b[NR];
    for (int j = 0; j < NR; ++j) b[j] = _mm512_loadu_si512(wj[j] + p * 64);
    for (int i = 0; i < MR; ++i) {
      int32_t bits;
      std::memcpy(&bits, a + i * a_stride + p * 4, sizeof(bits));
      const __m512i av = _mm512_set1_epi32(bits);
      for (int j = 0; j < NR; ++j) {
        if constexpr (kBf16) {
#if defined(__AVX512BF16__)
          acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)av, (__m512bh)b[j]);
#endif
        } else {
          acc[i][j] = _mm512_fmadd_ps(_mm512_castsi512_ps(av), _mm512_castsi512_ps(b[j]),
                                      acc[i][j]);
        }
      }
    }
  }
  if constexpr (!kSwiglu) {
    float* o = static_cast<float*>(out);
    if (stream) {
      for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) _mm512_stream_ps(o + i * n + 16 * j, acc[i][j]);
    } else {
      for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) _mm512_storeu_ps(o + i * n + 16 * j, acc[i][j]);
    }
    if (argmax != nullptr) {
      for (int i = 0; i < MR; ++i) {
        __m512 mx = acc[i][0];
        for (int j = 1; j < NR; ++j) mx = _mm512_max_ps(mx, acc[i][j]);
        const float best = _mm512_reduce_max_ps(mx);
        if (best > argmax->val[i]) {  // strictly: an earlier column keeps a tie
          const __m512 target = _mm512_set1_ps(best);
          for (int j = 0; j < NR; ++j) {
            const __mmask16 hit = _mm512_cmp_ps_mask(acc[i][j], target, _CMP_EQ_OQ);
            if (hit) {
              argmax->idx[i] = static_cast<int32_t>(argmax->col0 + 16 * j + __builtin_ctz(hit));
              break;
            }
          }
          argmax->val[i] = best;
        }
      }
    }
  } else {
    for (int i = 0; i < MR; ++i) {
      for (int j = 0; j < NR / 2; ++j) {
        const __m512 v = Swiglu512(acc[i][j], acc[i][j + NR / 2]);
        if constexpr (kBf16) {
#if defined(__AVX512BF16__)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i * n) +
                                  j,
                              (__m256i)_mm512_cvtneps_pbh(v));
#endif
        } else {
          _mm512_storeu_ps(static_cast<float*>(out) + i * n + 16 * j, v);
        }
      }
    }
  }
}

template <bool kBf16, bool kSwiglu, int NR, typename... Args>
void PackedRowsTile(int64_t rows, Args... args) {
  switch (rows) {
    case 6: return PackedMicroTile<kBf16, kSwiglu, 6, NR>(args...);
    case 5: return PackedMicroTile<kBf16, kSwiglu, 5, NR>(args...);
    case 4: return PackedMicroTile<kBf16, kSwiglu, 4, NR>(args...);
    case 3: return PackedMicroTile<kBf16, kSwiglu, 3, NR>(args...);
    case 2: return PackedMicroTile<kBf16, kSwiglu, 2, NR>(args...);
    default: return PackedMicroTile<kBf16, kSwiglu, 1, NR>(args...);
  }
}

template <bool kBf16, bool kSwiglu, typename... Args>
void PackedTile(int64_t rows, int64_t blocks, Args... args) {
  if (blocks == 4) return PackedRowsTile<kBf16, kSwiglu, 4>(rows, args...);
  if (blocks == 2) return PackedRowsTile<kBf16, kSwiglu, 2>(rows, args...);
  if constexpr (!kSwiglu) {  // fused: gate and up blocks come in pairs
    if (blocks == 3) return PackedRowsTile<kBf16, kSwiglu, 3>(rows, args...);
    return PackedRowsTile<kBf16, kSwiglu, 1>(rows, args...);
  }
}

// a: [M, K] of 2-byte (bf16) or 4-byte (f32) elements; w: its packed blocks, n_blocks of
// them. kSwiglu: w is [K, 2 * I] (gate columns, then up), out [M, I] = silu(gate) * up.
// best_val / best_idx ([M, slots], or null): per row and work item, the largest output and
// its first column (items cover increasing column ranges; unused slots keep -inf).
template <bool kBf16, bool kSwiglu>
void PackedMatmul(ffi::ThreadPool& pool, const char* a, const char* w, void* out, int64_t m,
                  int64_t k, int64_t n_blocks, float* best_val = nullptr,
                  int32_t* best_idx = nullptr, int64_t slots = 0) {
  constexpr int64_t kElem = kBf16 ? 2 : 4;
  constexpr int64_t kOutElem = kSwiglu ? kElem : 4;
  const int64_t a_stride = k * kElem, steps = k * kElem / 4;
  const int64_t w_stride = steps * 64;  // bytes of one 16-column block of w
  // Output blocks: with kSwiglu, each pairs a gate block with its up block.
  const int64_t out_blocks = kSwiglu ? n_blocks / 2 : n_blocks, n = out_blocks * 16;
  const int64_t up_offset = kSwiglu ? out_blocks * w_stride : 0;
  constexpr int64_t kGroup = kSwiglu ? kPackedNr / 2 : kPackedNr;  // output blocks per tile
  // Work items: groups of output blocks, in a few contiguous runs per thread; a group's
  // slice of w (K x 64 columns) stays in L2 while the rows of a pass over it.
  const int64_t groups = (out_blocks + kGroup - 1) / kGroup;
  int64_t items = std::min<int64_t>(groups, 8 * (pool.num_threads() + 1));
  if (best_val != nullptr) {
    items = std::min(items, slots);
    std::fill(best_val, best_val + m * slots, -std::numeric_limits<float>::infinity());
    std::fill(best_idx, best_idx + m * slots, 0);
  }
  // Rows in chunks whose slice of a stays in L2 too (prefill's long batches).
  const int64_t chunk =
      std::max<int64_t>(kPackedMr, (256 * 1024 / a_stride) / kPackedMr * kPackedMr);
  char* out_bytes = static_cast<char*>(out);
  // An output of several MB (the LM head's logits: 16 MB at 128 rows) is written with
  // non-temporal stores: it leaves the cache by the time it is read anyway, and ordinary
  // stores would first read every line from DRAM (LM head + argmax 12.3-12.7 -> 11.2-11.4 ms).
  const bool stream = !kSwiglu && m * n * 4 >= (8 << 20) &&
                      reinterpret_cast<uintptr_t>(out) % 64 == 0;
  ParallelFor(pool, items, [&](int64_t item) {
    const int64_t g0 = groups * item / items, g1 = groups * (item + 1) / items;
    std::vector<float> row_val;
    std::vector<int32_t> row_idx;
    if (best_val != nullptr) {
      row_val.assign(m, -std::numeric_limits<float>::infinity());
      row_idx.assign(m, 0);
    }
    for (int64_t mc = 0; mc < m; mc += chunk) {
      const int64_t mc_end = std::min(mc + chunk, m);
      const int64_t tiles = (mc_end - mc + kPackedMr - 1) / kPackedMr;
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t ob0 = g * kGroup, blocks = std::min<int64_t>(kGroup, out_blocks - ob0);
        // The next group's slice of w is requested into L2 in equal parts by this group's
        // row tiles (it streams from DRAM: the weights of a whole model do not fit in L3).
        const int64_t next_bytes =
            g + 1 < g1 ? std::min<int64_t>(kGroup, out_blocks - ob0 - kGroup) * w_stride : 0;
        const int64_t part = (next_bytes / tiles + 63) / 64 * 64;
        const char* next = w + (ob0 + kGroup) * w_stride;
        for (int64_t m0 = mc, t = 0; m0 < mc_end; m0 += kPackedMr, ++t) {
          const int64_t from = std::min(t * part, next_bytes);
          const RowArgmax argmax{row_val.data() + m0, row_idx.data() + m0, ob0 * 16};
          PackedTile<kBf16, kSwiglu>(
              std::min<int64_t>(kPackedMr, mc_end - m0), kSwiglu ? 2 * blocks : blocks,
              a + m0 * a_stride, a_stride, steps, w + ob0 * w_stride, w_stride, up_offset,
              static_cast<void*>(out_bytes + (m0 * n + ob0 * 16) * kOutElem), n, next + from,
              std::min(part, next_bytes - from), stream,
              best_val != nullptr ? &argmax : nullptr);
        }
      }
    }
    if (stream) _mm_sfence();
    if (best_val != nullptr) {
      for (int64_t r = 0; r < m; ++r) {
        best_val[r * slots + item] = row_val[r];
        best_idx[r * slots + item] = row_idx[r];
      }
    }
  });
}

// a is [M, K]; w is packed from a [K, N] weight (pack_bf16 / pack_f32 layout).
template <bool kBf16, typename Dims>
bool PackedShapesOk(const Dims& ad, const Dims& wd) {
  const bool w_ok = kBf16 ? (wd.size() == 4 && wd[2] == 16 && wd[3] == 32)
                          : (wd.size() == 3 && wd[2] == 16);
  return ad.size() == 2 && w_ok && wd[1] * (kBf16 ? 32 : 1) == ad[1];
}

// The rows of a that are real: `rows` holds the count (the rest of the bucket is padding);
// out of range means all. Padding rows of the result are zeros: they cost no arithmetic.
template <typename Dims>
int64_t RealRows(const Dims& ad, ffi::Buffer<ffi::S32>& rows) {
  const int64_t m = ad[0];
  if (rows.element_count() < 1) return m;
  const int64_t r = rows.typed_data()[0];
  return r < 0 || r > m ? m : r;
}

// Rows [m, rows) of a [rows, ...] result are zeros.
inline void ZeroRowsFrom(ffi::AnyBuffer& out, int64_t rows, int64_t m) {
  const int64_t row_bytes = out.size_bytes() / std::max<int64_t>(rows, 1);
  std::memset(static_cast<char*>(out.untyped_data()) + m * row_bytes, 0, (rows - m) * row_bytes);
}

template <ffi::DataType T, bool kSwiglu>
ffi::Error MatmulPackedImpl(ffi::ThreadPool pool, ffi::Buffer<T> a, ffi::Buffer<T> w,
                            ffi::Buffer<ffi::S32> rows, ffi::Result<ffi::AnyBuffer> out) {
  constexpr bool kBf16 = T == ffi::DataType::BF16;
  auto ad = a.dimensions();
  auto wd = w.dimensions();
  if (!PackedShapesOk<kBf16>(ad, wd)) {
    return ffi::Error::InvalidArgument(kBf16 ? "a must be [M, K] and w [N/16, K/32, 16, 32]"
                                             : "a must be [M, K] and w [N/16, K, 16]");
  }
  if (kSwiglu && wd[0] % 2) {
    return ffi::Error::InvalidArgument("swiglu: w must hold as many up blocks as gate blocks");
  }
  const int64_t m = RealRows(ad, rows);
  ZeroRowsFrom(*out, ad[0], m);
  if (m == 0) return ffi::Error::Success();
  PackedMatmul<kBf16, kSwiglu>(pool, reinterpret_cast<const char*>(a.typed_data()),
                               reinterpret_cast<const char*>(w.typed_data()),
                               out->untyped_data(), m, ad[1], wd[0]);
  return ffi::Error::Success();
}

// The plain matmul that also returns, per row, the max and first argmax of each work item's
// columns ([M, slots] each; the caller reduces over slots). Padding rows: zeros, and every
// slot -inf at column 0.
template <ffi::DataType T>
ffi::Error MatmulArgmaxImpl(ffi::ThreadPool pool, ffi::Buffer<T> a, ffi::Buffer<T> w,
                            ffi::Buffer<ffi::S32> rows, ffi::Result<ffi::AnyBuffer> out,
                            ffi::Result<ffi::Buffer<ffi::F32>> best_val,
                            ffi::Result<ffi::Buffer<ffi::S32>> best_idx) {
  constexpr bool kBf16 = T == ffi::DataType::BF16;
  auto ad = a.dimensions();
  auto wd = w.dimensions();
  auto bd = best_val->dimensions();
  if (!PackedShapesOk<kBf16>(ad, wd)) {
    return ffi::Error::InvalidArgument(kBf16 ? "a must be [M, K] and w [N/16, K/32, 16, 32]"
                                             : "a must be [M, K] and w [N/16, K, 16]");
  }
  if (bd.size() != 2 || bd[0] != ad[0] || bd[1] < 1) {
    return ffi::Error::InvalidArgument("best_val / best_idx must be [M, slots]");
  }
  const int64_t m = RealRows(ad, rows), slots = bd[1];
  ZeroRowsFrom(*out, ad[0], m);
  std::fill(best_val->typed_data() + m * slots, best_val->typed_data() + ad[0] * slots,
            -std::numeric_limits<float>::infinity());
  std::fill(best_idx->typed_data() + m * slots, best_idx->typed_data() + ad[0] * slots, 0);
  if (m == 0) return ffi::Error::Success();
  PackedMatmul<kBf16, false>(pool, reinterpret_cast<const char*>(a.typed_data()),
                             reinterpret_cast<const char*>(w.typed_data()), out->untyped_data(),
                             m, ad[1], wd[0], best_val->typed_data(), best_idx->typed_data(),
                             slots);
  return ffi::Error::Success();
}

#if defined(__AVX512BF16__)
// The greedy token of each row of a[M, K] x w[K, N] in float32: exactly the argmax of the
// logits MatmulArgmaxImpl<F32> computes (first column on ties), for about the cost of a bf16
// matmul. The rows are multiplied once in bf16 (w_screen: w rounded to bf16, pack_bf16
// layout); every output then lies within a bound of its float32 value,
//   |bf16 result - f32 result| <= ||a~|| ||w~_j - w_j|| + ||a~ - a|| ||w_j|| + rounding,
// a~ and w~ the bf16 roundings (col_stats holds ||w_j|| and ||w~_j - w_j||, rounded up). Only
// the columns whose upper bound reaches the row's best lower bound can hold the argmax
// (usually one or two of 32000); their 16-column blocks are recomputed in float32, with the
// FMA sequence of the float32 kernel, so the values compared are bit for bit that kernel's.
// out gets the bf16-product logits (what a caller reading them sees: a screen, not logits).
ffi::Error MatmulArgmaxScreenedImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> a,
                                    ffi::Buffer<ffi::BF16> w_screen, ffi::Buffer<ffi::F32> w,
                                    ffi::Buffer<ffi::F32> col_stats,
                                    ffi::Buffer<ffi::S32> rows, ffi::Result<ffi::AnyBuffer> out,
                                    ffi::Result<ffi::Buffer<ffi::S32>> ids) {
  auto ad = a.dimensions();
  auto sd = w_screen.dimensions();
  auto wd = w.dimensions();
  auto cd = col_stats.dimensions();
  if (!PackedShapesOk<true>(ad, sd) || !PackedShapesOk<false>(ad, wd) || sd[0] != wd[0]) {
    return ffi::Error::InvalidArgument(
        "a must be [M, K], w_screen [N/16, K/32, 16, 32] and w [N/16, K, 16]");
  }
  if (cd.size() != 2 || cd[0] != 2 || cd[1] != wd[0] * 16) {
    return ffi::Error::InvalidArgument("col_stats must be [2, N]");
  }
  const int64_t m = RealRows(ad, rows), k = ad[1], n_blocks = wd[0], n = n_blocks * 16;
  ZeroRowsFrom(*out, ad[0], m);
  int32_t* id_data = ids->typed_data();
  std::fill(id_data + m, id_data + ad[0], 0);
  if (m == 0) return ffi::Error::Success();

  // a in bf16, and each row's share of the bound.
  thread_local std::vector<uint16_t> a_bf16;
  thread_local std::vector<float> row_a, row_b;
  thread_local std::vector<char> exhaustive;
  a_bf16.resize(m * k);
  row_a.resize(m);
  row_b.resize(m);
  exhaustive.assign(m, 0);
  const float* a_data = a.typed_data();
  // Rounding of the two float32 sums (Higham's gamma_K) plus a margin that covers the float
  // arithmetic of the bound itself; bf16 dot products flush subnormals (a K * 2^-126 term).
  const double gamma = k * 0x1p-24 / (1 - k * 0x1p-24) + 0x1p-20, inflate = 1 + 0x1p-10;
  for (int64_t i = 0; i < m; ++i) {
    double s_screen = 0, s_diff = 0, s_exact = 0;
    for (int64_t kk = 0; kk < k; ++kk) {
      const float x = a_data[i * k + kk];
      const uint16_t xb = F32ToBf16(x);
      const double xt = Bf16ToF32(xb);
      a_bf16[i * k + kk] = xb;
      s_screen += xt * xt;
      s_diff += (xt - x) * (xt - x);
      s_exact += static_cast<double>(x) * x;
    }
    const double n_screen = std::sqrt(s_screen), n_exact = std::sqrt(s_exact);
    row_a[i] = static_cast<float>(n_screen * (1 + gamma) * inflate);
    row_b[i] = static_cast<float>(
        (std::sqrt(s_diff) + gamma * (n_screen + n_exact) + k * 0x1p-95) * inflate);
    // Inf or NaN (or a bound past float's range): every column is a candidate.
    exhaustive[i] = !std::isfinite(row_a[i]) || !std::isfinite(row_b[i]);
  }

  float* screen = static_cast<float*>(out->untyped_data());
  PackedMatmul<true, false>(pool, reinterpret_cast<const char*>(a_bf16.data()),
                            reinterpret_cast<const char*>(w_screen.typed_data()), screen, m, k,
                            n_blocks);

  const float *w_data = w.typed_data(), *col_n = col_stats.typed_data(), *col_r = col_n + n;
  // (The thread-local vectors by pointer: in a worker thread their names are its own.)
  const float *a_bound = row_a.data(), *b_bound = row_b.data();
  const char* scan_all = exhaustive.data();
  ParallelFor(pool, m, [&](int64_t i) {
    const __m512 ra = _mm512_set1_ps(a_bound[i]), rb = _mm512_set1_ps(b_bound[i]);
    const float* row = screen + i * n;
    auto bound = [&](int64_t c) {  // of columns c .. c + 15
      return _mm512_fmadd_ps(ra, _mm512_loadu_ps(col_r + c),
                             _mm512_mul_ps(rb, _mm512_loadu_ps(col_n + c)));
    };
    // The row's largest lower bound: its argmax in float32 is at least this.
    __m512 lo = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t c = 0; c < n; c += 16) {
      lo = _mm512_max_ps(_mm512_sub_ps(_mm512_loadu_ps(row + c), bound(c)), lo);  // drops NaN
    }
    const __m512 floor = _mm512_set1_ps(_mm512_reduce_max_ps(lo));
    const float* x = a_data + i * k;
    float best = -std::numeric_limits<float>::infinity();
    int32_t best_col = 0;
    for (int64_t b = 0; b < n_blocks; ++b) {
      const int64_t c = b * 16;
      const __m512 upper = _mm512_add_ps(_mm512_loadu_ps(row + c), bound(c));
      const __mmask16 cand =
          scan_all[i] ? __mmask16(0xffff) : _mm512_cmp_ps_mask(upper, floor, _CMP_GE_OQ);
      if (!cand) continue;
      // The block in float32, as PackedMicroTile<false, ...> sums it: one FMA chain per column.
      const float* wb = w_data + b * k * 16;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t kk = 0; kk < k; ++kk) {
        acc = _mm512_fmadd_ps(_mm512_set1_ps(x[kk]), _mm512_loadu_ps(wb + kk * 16), acc);
      }
      alignas(64) float exact[16];
      _mm512_store_ps(exact, acc);
      for (int lane = 0; lane < 16; ++lane) {
        if (((cand >> lane) & 1) && exact[lane] > best) {  // strictly: the first column wins a tie
          best = exact[lane];
          best_col = static_cast<int32_t>(c + lane);
        }
      }
    }
    id_data[i] = best_col;
  });
  return ffi::Error::Success();
}
#endif  // __AVX512BF16__
#endif  // __AVX512F__

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

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcbMatmulAmx, MatmulAmxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // a [M, K]
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // w packed
                                  .Ret<ffi::Buffer<ffi::F32>>());  // [M, N]

extern "C" int JaxcbAmxAvailable() { return AmxEnabled() ? 1 : 0; }
#else
extern "C" int JaxcbAmxAvailable() { return 0; }
#endif

#if defined(__AVX512F__)
#define JAXCB_PACKED_MATMUL(name, T, swiglu)                                            \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, (MatmulPackedImpl<ffi::DataType::T, swiglu>),   \
                                ffi::Ffi::Bind()                                        \
                                    .Ctx<ffi::ThreadPool>()                             \
                                    .Arg<ffi::Buffer<ffi::DataType::T>>() /* a [M, K] */ \
                                    .Arg<ffi::Buffer<ffi::DataType::T>>() /* w packed */ \
                                    .Arg<ffi::Buffer<ffi::S32>>() /* real rows [1] */    \
                                    .Ret<ffi::AnyBuffer>());

// -> f32 [M, N], f32 [M, slots], i32 [M, slots]
#define JAXCB_MATMUL_ARGMAX(name, T)                                                    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, (MatmulArgmaxImpl<ffi::DataType::T>),             \
                                ffi::Ffi::Bind()                                        \
                                    .Ctx<ffi::ThreadPool>()                             \
                                    .Arg<ffi::Buffer<ffi::DataType::T>>() /* a [M, K] */ \
                                    .Arg<ffi::Buffer<ffi::DataType::T>>() /* w packed */ \
                                    .Arg<ffi::Buffer<ffi::S32>>() /* real rows [1] */    \
                                    .Ret<ffi::AnyBuffer>()                              \
                                    .Ret<ffi::Buffer<ffi::F32>>()                       \
                                    .Ret<ffi::Buffer<ffi::S32>>());

JAXCB_PACKED_MATMUL(JaxcbMatmulF32Avx512, F32, false)    // -> f32 [M, N]
JAXCB_PACKED_MATMUL(JaxcbSwigluF32Avx512, F32, true)     // -> f32 [M, N / 2]
JAXCB_MATMUL_ARGMAX(JaxcbMatmulArgmaxF32Avx512, F32)
extern "C" int JaxcbAvx512Available() { return 1; }
#else
extern "C" int JaxcbAvx512Available() { return 0; }
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
JAXCB_PACKED_MATMUL(JaxcbMatmulBf16Avx512, BF16, false)  // -> f32 [M, N]
JAXCB_PACKED_MATMUL(JaxcbSwigluBf16Avx512, BF16, true)   // -> bf16 [M, N / 2]
JAXCB_MATMUL_ARGMAX(JaxcbMatmulArgmaxBf16Avx512, BF16)
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcbMatmulArgmaxScreenedF32, MatmulArgmaxScreenedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // a [M, K]
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // w_screen (pack_bf16)
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w (pack_f32)
                                  .Arg<ffi::Buffer<ffi::F32>>()   // col_stats [2, N]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // real rows [1]
                                  .Ret<ffi::AnyBuffer>()          // f32 [M, N] (the screen)
                                  .Ret<ffi::Buffer<ffi::S32>>());  // i32 [M]
extern "C" int JaxcbAvx512Bf16Available() { return 1; }
#else
extern "C" int JaxcbAvx512Bf16Available() { return 0; }
#endif
