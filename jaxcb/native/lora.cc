// LoRA adapters' term of a layer's matmul, as an XLA FFI handler for XLA's CPU backend: each
// token row through its own adapter's slot only, added to the base matmul's output in place,
//
//   y[t] += round(round(x[t]) @ A[s]) @ B[s]     for every real row t whose slot s is not 0,
//
// x[t] RMS-normed first when a norm weight is given (the layer's input norm, which the base
// matmul's kernel applies in its own call: only the adapter rows are normed here),
// reading the slot arrays of one layer in place from their stacks over the layers (jaxcb/
// lora.py's layout: A [L, K, P, N, R], one B per part p [L, N, R, cols_p]; the rounding is to
// the slot arrays' dtype, as XLA's dot of the same arrays rounds its inputs). A row of the
// base model (slot 0) and a bucket's padding cost nothing: a step without adapter rows returns
// at once, where an XLA form would multiply every row by every slot or branch around it.
//
// A weight of several parts (q, k, v; gate, up) has one A per part ([K, P, N, R]: the parts'
// R columns of slot s side by side) and one B per part, whose columns land in the output in
// runs: part p's column c goes to offset_p + (c / run_p) * stride_p + c % run_p (`layout`:
// (run, stride, offset) per part), e.g. q's heads interleaved with k and v per KV head.
//
// bfloat16 slot arrays on a CPU with AVX512-BF16 take vdpbf16ps: two rows of A (or B) are
// interleaved into (even, odd) pairs in registers, one vector of pairs per 16 columns, and
// each rounded input pair of a row is one broadcast against it: half the multiply
// instructions of the widened FMA form, the interleave paid once per block of rows.

#include <cstring>
#include <type_traits>
#include <utility>

#include "simd.h"

namespace {

#if defined(JAXCB_HAVE_V16)

template <typename W>
V16 LoadW(const W* p) {
  if constexpr (std::is_same_v<W, float>) {
    return V16::Load(p);
  } else {
    return V16::LoadBf16(p);
  }
}

template <typename W>
float ToF32(W v) {
  if constexpr (std::is_same_v<W, float>) {
    return v;
  } else {
    return Bf16ToF32(v);
  }
}

// v rounded to W (bf16: to nearest even), back as f32.
template <typename W>
float RoundTo(float v) {
  if constexpr (std::is_same_v<W, float>) {
    return v;
  } else {
    return Bf16ToF32(F32ToBf16(v));
  }
}

// Up to kBlock rows that share a slot go through it together: each value of A and B loaded
// once per block, not once per row (a decode step's few rows per adapter; prefill's many).
constexpr int kBlock = 8;

// f(std::integral_constant<int, nr>) for a block of nr rows (1..kBlock).
template <typename F>
void WithRows(int nr, F&& f) {
  switch (nr) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

// u_j[0:r] = x_j[0:k] @ a for the block's NR rows (x_j at x + j * k, u_j at u + j * u_stride);
// a's row kk at a + kk * row_stride, r contiguous values a row.
template <typename W, int NR>
void Shrink(const float* x, const W* a, int64_t k, int64_t row_stride, int64_t r, float* u,
            int64_t u_stride) {
  int64_t r0 = 0;
  for (; r0 + 16 <= r; r0 += 16) {
    V16 even[NR], odd[NR];  // (two FMA chains a row over kk)
    for (int j = 0; j < NR; ++j) even[j] = odd[j] = V16::Zero();
    int64_t kk = 0;
    for (; kk + 2 <= k; kk += 2) {
      const V16 w0 = LoadW(a + kk * row_stride + r0), w1 = LoadW(a + (kk + 1) * row_stride + r0);
      for (int j = 0; j < NR; ++j) {
        even[j] = Fma(V16::Set(x[j * k + kk]), w0, even[j]);
        odd[j] = Fma(V16::Set(x[j * k + kk + 1]), w1, odd[j]);
      }
    }
    if (kk < k) {
      const V16 w0 = LoadW(a + kk * row_stride + r0);
      for (int j = 0; j < NR; ++j) even[j] = Fma(V16::Set(x[j * k + kk]), w0, even[j]);
    }
    for (int j = 0; j < NR; ++j) Add(even[j], odd[j]).Store(u + j * u_stride + r0);
  }
  for (; r0 < r; ++r0) {  // a rank that is not a multiple of 16: its last columns
    for (int j = 0; j < NR; ++j) {
      float sum = 0.0f;
      for (int64_t kk = 0; kk < k; ++kk) sum += x[j * k + kk] * ToF32(a[kk * row_stride + r0]);
      u[j * u_stride + r0] = sum;
    }
  }
}

// y_j[0:width] += u_j[0:r] @ b for the block's NR rows (u_j at u + j * u_stride, y_j at
// y + j * y_stride); b's row rr at b + rr * row_stride, width contiguous values used.
template <typename W, int NR>
void Expand(const float* u, int64_t u_stride, const W* b, int64_t r, int64_t row_stride,
            int64_t width, float* y, int64_t y_stride) {
  int64_t c = 0;
  for (; c + 32 <= width; c += 32) {  // two column blocks a row: 2 x NR FMA chains
    V16 lo[NR], hi[NR];
    for (int j = 0; j < NR; ++j) {
      lo[j] = V16::Load(y + j * y_stride + c);
      hi[j] = V16::Load(y + j * y_stride + c + 16);
    }
    for (int64_t rr = 0; rr < r; ++rr) {
      const V16 w0 = LoadW(b + rr * row_stride + c), w1 = LoadW(b + rr * row_stride + c + 16);
      for (int j = 0; j < NR; ++j) {
        const V16 ur = V16::Set(u[j * u_stride + rr]);
        lo[j] = Fma(ur, w0, lo[j]);
        hi[j] = Fma(ur, w1, hi[j]);
      }
    }
    for (int j = 0; j < NR; ++j) {
      lo[j].Store(y + j * y_stride + c);
      hi[j].Store(y + j * y_stride + c + 16);
    }
  }
  for (; c + 16 <= width; c += 16) {
    V16 acc[NR];
    for (int j = 0; j < NR; ++j) acc[j] = V16::Load(y + j * y_stride + c);
    for (int64_t rr = 0; rr < r; ++rr) {
      const V16 w = LoadW(b + rr * row_stride + c);
      for (int j = 0; j < NR; ++j) acc[j] = Fma(V16::Set(u[j * u_stride + rr]), w, acc[j]);
    }
    for (int j = 0; j < NR; ++j) acc[j].Store(y + j * y_stride + c);
  }
  for (; c < width; ++c) {
    for (int j = 0; j < NR; ++j) {
      float sum = y[j * y_stride + c];
      for (int64_t rr = 0; rr < r; ++rr) sum += u[j * u_stride + rr] * ToF32(b[rr * row_stride + c]);
      y[j * y_stride + c] = sum;
    }
  }
}

#if defined(__AVX512BF16__)
// 16 columns of two rows of bfloat16 values as vdpbf16ps takes them: lane c holds (p[c],
// q[c]) (q null: (p[c], 0)).
inline __m512i PairRows(const uint16_t* p, const uint16_t* q) {
  const __m512i lo =
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  if (q == nullptr) return lo;
  const __m512i hi =
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
  return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}

// Input values i, i + 1 of a row of bfloat16 values, as one broadcast pair.
inline __m512bh PairAt(const uint16_t* v, int64_t i) {
  int32_t bits;
  std::memcpy(&bits, v + i, sizeof(bits));
  return (__m512bh)_mm512_set1_epi32(bits);
}

// Shrink on vdpbf16ps: xb_j (at xb + j * kp) the block's rows in bfloat16, k values padded
// with a zero to kp (even).
template <int NR>
void ShrinkDot(const uint16_t* xb, int64_t kp, const uint16_t* a, int64_t k,
               int64_t row_stride, int64_t r, float* u, int64_t u_stride) {
  int64_t r0 = 0;
  for (; r0 + 16 <= r; r0 += 16) {
    __m512 acc[NR];
    for (int j = 0; j < NR; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < k; kk += 2) {
      const uint16_t* row = a + kk * row_stride + r0;
      const __m512bh w = (__m512bh)PairRows(row, kk + 1 < k ? row + row_stride : nullptr);
      for (int j = 0; j < NR; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], PairAt(xb + j * kp, kk), w);
    }
    for (int j = 0; j < NR; ++j) _mm512_storeu_ps(u + j * u_stride + r0, acc[j]);
  }
  for (; r0 < r; ++r0) {
    for (int j = 0; j < NR; ++j) {
      float sum = 0.0f;
      for (int64_t kk = 0; kk < k; ++kk) {
        sum += Bf16ToF32(xb[j * kp + kk]) * Bf16ToF32(a[kk * row_stride + r0]);
      }
      u[j * u_stride + r0] = sum;
    }
  }
}

// Expand on vdpbf16ps: ub_j (at ub + j * ub_stride) the block's u in bfloat16, r values
// padded with a zero to an even count.
template <int NR>
void ExpandDot(const uint16_t* ub, int64_t ub_stride, const uint16_t* b, int64_t r,
               int64_t row_stride, int64_t width, float* y, int64_t y_stride) {
  int64_t c = 0;
  for (; c + 32 <= width; c += 32) {
    __m512 lo[NR], hi[NR];
    for (int j = 0; j < NR; ++j) {
      lo[j] = _mm512_loadu_ps(y + j * y_stride + c);
      hi[j] = _mm512_loadu_ps(y + j * y_stride + c + 16);
    }
    for (int64_t rr = 0; rr < r; rr += 2) {
      const uint16_t* b0 = b + rr * row_stride + c;
      const uint16_t* b1 = rr + 1 < r ? b0 + row_stride : nullptr;
      const __m512bh w0 = (__m512bh)PairRows(b0, b1);
      const __m512bh w1 = (__m512bh)PairRows(b0 + 16, b1 ? b1 + 16 : nullptr);
      for (int j = 0; j < NR; ++j) {
        const __m512bh pair = PairAt(ub + j * ub_stride, rr);
        lo[j] = _mm512_dpbf16_ps(lo[j], pair, w0);
        hi[j] = _mm512_dpbf16_ps(hi[j], pair, w1);
      }
    }
    for (int j = 0; j < NR; ++j) {
      _mm512_storeu_ps(y + j * y_stride + c, lo[j]);
      _mm512_storeu_ps(y + j * y_stride + c + 16, hi[j]);
    }
  }
  for (; c + 16 <= width; c += 16) {
    __m512 acc[NR];
    for (int j = 0; j < NR; ++j) acc[j] = _mm512_loadu_ps(y + j * y_stride + c);
    for (int64_t rr = 0; rr < r; rr += 2) {
      const uint16_t* b0 = b + rr * row_stride + c;
      const __m512bh w = (__m512bh)PairRows(b0, rr + 1 < r ? b0 + row_stride : nullptr);
      for (int j = 0; j < NR; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], PairAt(ub + j * ub_stride, rr), w);
    }
    for (int j = 0; j < NR; ++j) _mm512_storeu_ps(y + j * y_stride + c, acc[j]);
  }
  for (; c < width; ++c) {
    for (int j = 0; j < NR; ++j) {
      float sum = y[j * y_stride + c];
      for (int64_t rr = 0; rr < r; ++rr) {
        sum += Bf16ToF32(ub[j * ub_stride + rr]) * Bf16ToF32(b[rr * row_stride + c]);
      }
      y[j * y_stride + c] = sum;
    }
  }
}
#endif  // __AVX512BF16__

// Blocks per work item: decode's few blocks go on the calling thread alone (waking the pool
// costs more than a block's few microseconds); prefill's spread over the cores.
constexpr int64_t kBlocksPerItem = 1;

template <typename W, ffi::DataType T>
ffi::Error LoraAddImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> y, ffi::Buffer<ffi::F32> x,
                       ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::S32> rows,
                       ffi::Buffer<ffi::S32> layer, ffi::Buffer<T> a, ffi::Buffer<T> b0,
                       ffi::Buffer<T> b1, ffi::Buffer<T> b2, ffi::AnyBuffer norm,
                       ffi::Result<ffi::Buffer<ffi::F32>> out, ffi::Span<const int64_t> layout,
                       float eps) {
  const auto xd = x.dimensions(), ad = a.dimensions(), yd = y.dimensions();
  if (xd.size() != 2 || yd.size() != 2 || ad.size() != 5 || yd[0] != xd[0] || ad[1] != xd[1] ||
      static_cast<int64_t>(slots.element_count()) != xd[0]) {
    return ffi::Error::InvalidArgument(
        "lora: x [M, K], y [M, N], slots [M] and A [L, K, P, N, R] must agree");
  }
  const int64_t m = xd[0], k = xd[1], cols = yd[1];
  const int64_t parts = ad[2], num_slots = ad[3], rank = ad[4];
  if (parts < 1 || parts > 3 || static_cast<int64_t>(layout.size()) != 3 * parts) {
    return ffi::Error::InvalidArgument("lora: 1 to 3 parts, each with (run, stride, offset)");
  }
  LayerOf a_layer;
  if (!SliceLayer(a, layer, &a_layer)) return ffi::Error::InvalidArgument("lora: bad layer");
  const ffi::Buffer<T>* bs[3] = {&b0, &b1, &b2};
  const W* b_layer[3] = {};
  int64_t widths[3] = {};
  for (int64_t p = 0; p < parts; ++p) {
    LayerOf one;
    if (!SliceLayer(*bs[p], layer, &one) || one.dims.size() < 3 || one.dims[0] != num_slots ||
        one.dims[1] != rank) {
      return ffi::Error::InvalidArgument("lora: each B must be [L, N, R, ...]");
    }
    b_layer[p] = reinterpret_cast<const W*>(one.data);
    widths[p] = one.bytes / static_cast<int64_t>(sizeof(W)) / (num_slots * rank);
    const int64_t run = layout[3 * p], stride = layout[3 * p + 1], offset = layout[3 * p + 2];
    if (run < 1 || widths[p] % run || offset + (widths[p] / run - 1) * stride + run > cols) {
      return ffi::Error::InvalidArgument("lora: a part's columns fall outside y");
    }
  }
  const float* g32 = nullptr;  // the norm weight as f32 (none: x taken as it is)
  if (norm.element_count() != 0) {
    g32 = NormWeightF32(norm, k);
    if (g32 == nullptr) return NormWeightError();
  }
  float* o = out->typed_data();
  if (o != y.typed_data()) std::memcpy(o, y.typed_data(), y.size_bytes());  // (not aliased)

  const int32_t* slot = slots.typed_data();
  int64_t real = m;
  if (rows.element_count() >= 1 && rows.typed_data()[0] >= 0 && rows.typed_data()[0] < m) {
    real = rows.typed_data()[0];
  }
  // The real rows with an adapter, by slot (a counting sort), in blocks of kBlock rows of
  // one slot.
  std::vector<int64_t> count(num_slots + 1, 0);
  for (int64_t t = 0; t < real; ++t) {
    if (slot[t] >= 1 && slot[t] <= num_slots) ++count[slot[t]];
  }
  std::vector<int64_t> first(num_slots + 2, 0), rows_by_slot;
  for (int64_t s = 1; s <= num_slots; ++s) first[s + 1] = first[s] + count[s];
  if (first[num_slots + 1] == 0) return ffi::Error::Success();  // no adapter row: y as it is
  rows_by_slot.resize(first[num_slots + 1]);
  std::vector<int64_t> next(first.begin(), first.end() - 1);
  for (int64_t t = 0; t < real; ++t) {
    if (slot[t] >= 1 && slot[t] <= num_slots) rows_by_slot[next[slot[t]]++] = t;
  }
  std::vector<std::pair<int64_t, int64_t>> blocks;  // [start, end) in rows_by_slot
  for (int64_t s = 1; s <= num_slots; ++s) {
    for (int64_t b = first[s]; b < first[s + 1]; b += kBlock) {
      blocks.emplace_back(b, std::min<int64_t>(b + kBlock, first[s + 1]));
    }
  }

  const W* a_data = reinterpret_cast<const W*>(a_layer.data);
  const int64_t a_row = parts * num_slots * rank;  // A's stride over K
  const int64_t u_stride = parts * rank;
#if defined(__AVX512BF16__)
  constexpr bool kDot = std::is_same_v<W, uint16_t>;  // vdpbf16ps on bfloat16 slot arrays
#else
  constexpr bool kDot = false;
#endif
  const int64_t kp = k + (k & 1), rp = rank + (rank & 1);  // (pairs: padded to even)
  struct Scratch {
    std::vector<float> x, u, y;
    std::vector<uint16_t> xb, ub;
  };
  auto run_block = [&](int64_t i, Scratch& scratch) {
    const auto [b0, b1] = blocks[i];
    const int nr = static_cast<int>(b1 - b0);
    const int64_t s = slot[rows_by_slot[b0]] - 1;
    float *xr = scratch.x.data(), *u = scratch.u.data(), *yr = scratch.y.data();
    uint16_t *xb = scratch.xb.data(), *ub = scratch.ub.data();
    for (int j = 0; j < nr; ++j) {  // the rows' inputs (normed) rounded, outputs gathered
      const int64_t t = rows_by_slot[b0 + j];
      const float* xt = x.typed_data() + t * k;
      if (g32 != nullptr) {
        RmsNormRows(xt, g32, eps, 1, k, xr + j * k);
        xt = xr + j * k;
      }
      if constexpr (kDot) {
        for (int64_t kk = 0; kk < k; ++kk) xb[j * kp + kk] = F32ToBf16(xt[kk]);
        if (kp != k) xb[j * kp + k] = 0;
      } else {
        for (int64_t kk = 0; kk < k; ++kk) xr[j * k + kk] = RoundTo<W>(xt[kk]);
      }
      std::memcpy(yr + j * cols, o + t * cols, cols * sizeof(float));
    }
    WithRows(nr, [&](auto rows) {
      constexpr int NR = decltype(rows)::value;
      for (int64_t p = 0; p < parts; ++p) {
        const W* a_ps = a_data + (p * num_slots + s) * rank;
#if defined(__AVX512BF16__)
        if constexpr (kDot) {
          ShrinkDot<NR>(xb, kp, a_ps, k, a_row, rank, u + p * rank, u_stride);
          continue;
        }
#endif
        Shrink<W, NR>(xr, a_ps, k, a_row, rank, u + p * rank, u_stride);
      }
      if constexpr (kDot) {  // u rounded as XLA's dot rounds its input, in pairs per part
        for (int j = 0; j < nr; ++j) {
          for (int64_t p = 0; p < parts; ++p) {
            uint16_t* dst = ub + j * parts * rp + p * rp;
            for (int64_t rr = 0; rr < rank; ++rr) dst[rr] = F32ToBf16(u[j * u_stride + p * rank + rr]);
            if (rp != rank) dst[rank] = 0;
          }
        }
      } else {
        for (int64_t i2 = 0; i2 < nr * u_stride; ++i2) u[i2] = RoundTo<W>(u[i2]);
      }
      for (int64_t p = 0; p < parts; ++p) {
        const int64_t run = layout[3 * p], stride = layout[3 * p + 1], offset = layout[3 * p + 2];
        const W* b = b_layer[p] + s * rank * widths[p];
        for (int64_t j = 0; j < widths[p] / run; ++j) {
          float* yj = yr + offset + j * stride;
#if defined(__AVX512BF16__)
          if constexpr (kDot) {
            ExpandDot<NR>(ub + p * rp, parts * rp, b + j * run, rank, widths[p], run, yj, cols);
            continue;
          }
#endif
          Expand<W, NR>(u + p * rank, u_stride, b + j * run, rank, widths[p], run, yj, cols);
        }
      }
    });
    for (int j = 0; j < nr; ++j) {
      std::memcpy(o + rows_by_slot[b0 + j] * cols, yr + j * cols, cols * sizeof(float));
    }
  };
  const int64_t num_blocks = static_cast<int64_t>(blocks.size());
  const int64_t items = (num_blocks + kBlocksPerItem - 1) / kBlocksPerItem;
  auto item = [&](int64_t i) {
    thread_local Scratch scratch;  // reused: this runs every layer of every step
    scratch.x.resize(kBlock * k);
    scratch.u.resize(kBlock * u_stride);
    scratch.y.resize(kBlock * cols);
    scratch.xb.resize(kBlock * kp);
    scratch.ub.resize(kBlock * parts * rp);
    const int64_t end = std::min<int64_t>((i + 1) * kBlocksPerItem, num_blocks);
    for (int64_t j = i * kBlocksPerItem; j < end; ++j) run_block(j, scratch);
  };
  if (items == 1) {
    item(0);
  } else {
    ParallelFor(pool, items, item);
  }
  return ffi::Error::Success();
}

#define JAXCB_LORA_ADD(name, w_type, dtype)                                       \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, (LoraAddImpl<w_type, ffi::dtype>),          \
                                ffi::Ffi::Bind()                                  \
                                    .Ctx<ffi::ThreadPool>()                       \
                                    .Arg<ffi::Buffer<ffi::F32>>() /* y [M, N] */  \
                                    .Arg<ffi::Buffer<ffi::F32>>() /* x [M, K] */  \
                                    .Arg<ffi::Buffer<ffi::S32>>() /* slots [M] */ \
                                    .Arg<ffi::Buffer<ffi::S32>>() /* rows [1] */  \
                                    .Arg<ffi::Buffer<ffi::S32>>() /* layer [1] */ \
                                    .Arg<ffi::Buffer<ffi::dtype>>() /* A */       \
                                    .Arg<ffi::Buffer<ffi::dtype>>() /* B, part 0 */ \
                                    .Arg<ffi::Buffer<ffi::dtype>>() /* part 1 */  \
                                    .Arg<ffi::Buffer<ffi::dtype>>() /* part 2 */  \
                                    .Arg<ffi::AnyBuffer>() /* norm weight [K] or [0] */ \
                                    .Ret<ffi::Buffer<ffi::F32>>() /* y, aliased */ \
                                    .Attr<ffi::Span<const int64_t>>("layout")     \
                                    .Attr<float>("eps"));

#endif  // JAXCB_HAVE_V16

}  // namespace

#if defined(JAXCB_HAVE_V16)
JAXCB_LORA_ADD(JaxcbLoraAddF32, float, F32)
JAXCB_LORA_ADD(JaxcbLoraAddBf16, uint16_t, BF16)
#endif
