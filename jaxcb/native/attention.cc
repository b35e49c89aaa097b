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

#include "common.h"

namespace {

constexpr int kRowsPerItem = 16;  // query rows of one sequence handled by one work item

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
