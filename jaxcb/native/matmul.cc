// Matmuls over weights packed once at load time, as XLA FFI handlers for XLA's CPU backend:
// bf16 on AMX tiles; bf16 with AVX512-BF16 dot products, or widened to f32 in registers
// (AVX2 / AVX-512 without BF16); f32 with FMAs (SiLU * up fused into the gate/up matmul's
// epilogue, an LM head's greedy argmax taken from its accumulators); the screened greedy
// argmax of a float32 LM head; and grouped forms of the AMX and vector matmuls for a mixture
// of experts (rows sorted by expert, each through its own expert's slice of a stack of packed
// weights). The weight layouts are written by pack_bf16 / pack_f32 / pack_argmax_screen in
// packing.py. build.py compiles this file once per ISA level: what a level defines is reported
// by JaxcbIsaFeatures().

#include <chrono>
#include <type_traits>

#include "simd.h"

namespace {

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

// The rows of each group of a grouped matmul's a [m, K] (sorted by group): group g holds rows
// [first[g], first[g + 1]). Negative sizes count as 0 and groups past m rows are cut at m (as
// ragged_dot reads them); rows from first[G] on are padding.
inline std::vector<int64_t> GroupRows(ffi::Buffer<ffi::S32>& group_sizes, int64_t m) {
  const int64_t groups = group_sizes.element_count();
  const int32_t* sizes = group_sizes.typed_data();
  std::vector<int64_t> first(groups + 1, 0);
  for (int64_t g = 0; g < groups; ++g) {
    first[g + 1] = std::min<int64_t>(m, first[g] + std::max<int32_t>(sizes[g], 0));
  }
  return first;
}

// Work items of a grouped matmul: each group that has rows splits its columns as one matmul
// of its rows would (split(rows) -> {units of its columns, runs of them}), and all groups'
// items go into one ParallelFor. Decode gives each expert a row or two: one ParallelFor per
// group waited for its slowest run before the next group began, G times a call (8 experts,
// top-2, K=512, I=1024 float32, a 16-thread Xeon: T=16 0.30 -> 0.11 ms, T=512 1.37 -> 0.80).
struct GroupItem {
  int64_t group, u0, u1;  // units [u0, u1) of the group's columns
};

template <typename Split>
std::vector<GroupItem> GroupItems(const std::vector<int64_t>& first, Split split) {
  std::vector<GroupItem> items;
  for (int64_t g = 0; g + 1 < static_cast<int64_t>(first.size()); ++g) {
    if (first[g + 1] == first[g]) continue;  // an expert no row chose: its weights unread
    const auto [units, runs] = split(first[g + 1] - first[g]);
    for (int64_t i = 0; i < runs; ++i) {
      items.push_back({g, units * i / runs, units * (i + 1) / runs});
    }
  }
  return items;
}

// ---- bf16 matmul on AMX tiles ----------------------------------------------------------
//
// out[M, N] (f32) = a[M, K] (bf16) x w[K, N] (bf16), with w packed once at load time into
// the tile layout the AMX B operand wants (pack_bf16 in ops.py): [N/16, K/32, 16, 32],
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

// Pairs [p0, p1) of 16-column blocks of out (row stride 16 n_blocks) for the m rows of a:
// one work item. a must be readable up to whole 32-row blocks (the products of rows past m
// are dropped).
void AmxColumnRun(const uint16_t* a, int64_t m, int64_t k, const uint16_t* w, int64_t n_blocks,
                  int64_t p0, int64_t p1, float* out) {
  LoadTileConfig();
  const int64_t m_pad = (m + 31) / 32 * 32;
  // Rows in chunks whose slice of `a` stays in L2 while the columns stream past it.
  const int64_t chunk = std::max<int64_t>(32, (256 * 1024 / (k * 2)) / 32 * 32);
  for (int64_t mc = 0; mc < m_pad; mc += chunk) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t nb0 = 2 * p;
      MatmulColumns(a, m, mc, std::min(mc + chunk, m_pad), k, w, n_blocks * 16, nb0,
                    std::min<int64_t>(2, n_blocks - nb0), out);
    }
  }
  _tile_release();
}

// Work items of one AMX matmul: pairs of 16-column blocks, in a few contiguous runs per thread.
inline int64_t AmxItems(ffi::ThreadPool& pool, int64_t pairs) {
  return std::min<int64_t>(pairs, 8 * (pool.num_threads() + 1));
}

ffi::Error MatmulAmxImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> a,
                         ffi::Buffer<ffi::BF16> w, ffi::Buffer<ffi::S32> layer,
                         ffi::Buffer<ffi::S32> rows, ffi::Result<ffi::AnyBuffer> out) {
  auto ad = a.dimensions();
  LayerOf wl;
  const bool sliced = SliceLayer(w, layer, &wl);
  auto wd = wl.dims;
  if (!sliced || ad.size() != 2 || wd.size() != 4 || wd[2] != 16 || wd[3] != 32 ||
      wd[1] * 32 != ad[1]) {
    return ffi::Error::InvalidArgument(
        "a must be [M, K], w [L, N/16, K/32, 16, 32] and layer i32[1] in range");
  }
  if (!AmxEnabled()) return ffi::Error::Internal("the kernel refused AMX state (arch_prctl)");
  const int64_t m = RealRows(ad, rows), k = ad[1], n_blocks = wd[0];
  ZeroRowsFrom(*out, ad[0], m);
  if (m == 0) return ffi::Error::Success();
  const int64_t m_pad = (m + 31) / 32 * 32;
  const uint16_t* a_data = reinterpret_cast<const uint16_t*>(a.typed_data());
  thread_local std::vector<uint16_t> padded;  // reused: this runs every step
  if (m_pad != m) {  // rows of zeros up to a whole 32-row block
    padded.assign(m_pad * k, 0);
    std::memcpy(padded.data(), a_data, m * k * sizeof(uint16_t));
    a_data = padded.data();
  }
  const uint16_t* w_data = reinterpret_cast<const uint16_t*>(wl.data);
  float* out_data = static_cast<float*>(out->untyped_data());
  const int64_t pairs = (n_blocks + 1) / 2, items = AmxItems(pool, pairs);
  ParallelFor(pool, items, [&](int64_t item) {
    AmxColumnRun(a_data, m, k, w_data, n_blocks, pairs * item / items,
                 pairs * (item + 1) / items, out_data);
  });
  return ffi::Error::Success();
}

#endif  // AMX


// ---- matmuls over packed weights with 16-lane vectors (V16: AVX-512 or AVX2) -----------
//
// out[M, N] (f32) = a[M, K] x w[K, N], w packed once at load time in 16-column blocks that
// run contiguous along K, each 64-byte step of a block one vector of w:
// - kF32 (pack_f32, [N/16, K, 16]): a step is one row k, FMA against a broadcast of a[m, k];
// - kBf16Dot (pack_bf16, the AMX layout): a step is a k-pair (rows 2p, 2p+1), the vector holds
//   (even row, odd row) for each of the 16 columns, which vdpbf16ps takes against a broadcast
//   pair of a (bf16); CPUs with AVX512-BF16 (AMD Zen 4 and later, Intel Cooper Lake and later);
// - kBf16Wide: the same weights widened to f32 in registers (a shift and a mask per pair),
//   two FMAs against a[m, 2p] and a[m, 2p + 1] (f32): every CPU with AVX2 + FMA.
// A micro-tile keeps MR x NR accumulators (rows x 16-column blocks) in registers; XLA's own
// dots lose a third of that on the narrow batches of decode steps.
#if defined(JAXCB_HAVE_V16)
enum class Kind { kF32, kBf16Dot, kBf16Wide };

// Rows x 16-column blocks of a micro-tile: as many accumulators as the registers hold beside
// the vectors of w and the broadcasts of a (32 zmm with AVX-512; 16 ymm with AVX2, where a
// V16 takes two). AVX2 has two shapes, and which one is faster depends on the core, not on
// its ISA (TallTiles probes this CPU once):
// - wide, 2 rows x 3 blocks: 12 accumulators, the 6 vectors of w read from memory by every
//   FMA (no registers left): 14 loads a step of 12 FMAs. Cores with 3 or more loads a cycle
//   run it best (an AMD Zen 5 core, SmolLM2's shapes, M = 64: ~210 GFLOP/s on two cores,
//   6 x 1 ~110, 2 x 2 ~150);
// - tall, 6 rows x 1 block (BLIS's classic 6 x 16; 4 x 1 for widened bf16, whose even/odd
//   vectors take 4 registers): w in registers, 8 loads a step of 12 FMAs (6 of 8 for bf16).
//   Cores with 2 loads a cycle run it best (AMD Zen 3, one thread, SmolLM2's shapes, 252 rows:
//   float32 ~88 GFLOP/s against ~51 wide; bf16 widened ~94 against ~66).
template <Kind kKind, bool kSwiglu, bool kTall = false>
struct TileShape {
#if defined(__AVX512F__)
  static constexpr int kMr = kKind == Kind::kBf16Wide ? 4 : 6;
  static constexpr int kNr = 4;
  static constexpr bool kSplitSwiglu = false;
#else
  static constexpr int kMr = !kTall ? 2 : kKind == Kind::kBf16Wide ? 4 : 6;
  static constexpr int kNr = (kTall ? 1 : 3) * (kSwiglu ? 2 : 1);
  // A fused SwiGLU tile holds gate/up pairs: 2 x 2 blocks leave 8 ymm accumulators, too few
  // to hide the FMA latency (~160 GFLOP/s, 3 x 2 spills: ~137). Two plain tiles, gate then
  // up, into an L1 scratch, then silu(gate) * up, run at the plain tile's rate.
  static constexpr bool kSplitSwiglu = kSwiglu;
#endif
};

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
// bytes further; silu(gate) * up (NR/2 blocks) is written to out, in bf16 for kBf16Dot (it
// feeds the next matmul as it is), else in f32.
template <Kind kKind, bool kSwiglu, int MR, int NR>
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
  V16 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = V16::Zero();
  for (int64_t p = 0; p < steps; ++p) {
    if constexpr (kKind == Kind::kF32) {
      V16 b[NR];
      for (int j = 0; j < NR; ++j) b[j] = V16::Load(wj[j] + p * 64);
      for (int i = 0; i < MR; ++i) {
        const V16 av = V16::Set(reinterpret_cast<const float*>(a + i * a_stride)[p]);
        for (int j = 0; j < NR; ++j) acc[i][j] = Fma(av, b[j], acc[i][j]);
      }
    } else if constexpr (kKind == Kind::kBf16Wide) {
      for (int j = 0; j < NR; ++j) {
        V16 even, odd;
        WidenBf16Pairs(wj[j] + p * 64, even, odd);
        for (int i = 0; i < MR; ++i) {
          const float* ai = reinterpret_cast<const float*>(a + i * a_stride) + 2 * p;
          acc[i][j] = Fma(V16::Set(ai[1]), odd, Fma(V16::Set(ai[0]), even, acc[i][j]));
        }
      }
    } else {
#if defined(__AVX512BF16__)
      __m512i b[NR];
      for (int j = 0; j < NR; ++j) b[j] = _mm512_loadu_si512(wj[j] + p * 64);
      for (int i = 0; i < MR; ++i) {
        int32_t bits;
        std::memcpy(&bits, a + i * a_stride + p * 4, sizeof(bits));
        const __m512i av = _mm512_set1_epi32(bits);
        for (int j = 0; j < NR; ++j) {
          acc[i][j] = {_mm512_dpbf16_ps(acc[i][j].v, (__m512bh)av, (__m512bh)b[j])};
        }
      }
#endif
    }
  }
  if constexpr (!kSwiglu) {
    float* o = static_cast<float*>(out);
    for (int i = 0; i < MR; ++i) {
      for (int j = 0; j < NR; ++j) {
        if (stream) {
          acc[i][j].Stream(o + i * n + 16 * j);
        } else {
          acc[i][j].Store(o + i * n + 16 * j);
        }
      }
    }
    if (argmax != nullptr) {
      for (int i = 0; i < MR; ++i) {
        V16 mx = acc[i][0];
        for (int j = 1; j < NR; ++j) mx = Max(mx, acc[i][j]);
        const float best = mx.MaxLane();
        if (best > argmax->val[i]) {  // strictly: an earlier column keeps a tie
          for (int j = 0; j < NR; ++j) {
            if (const uint32_t hit = acc[i][j].LanesEqual(best)) {
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
        const V16 v = Swiglu(acc[i][j], acc[i][j + NR / 2]);
        if constexpr (kKind == Kind::kBf16Dot) {
          StoreBf16(v, static_cast<uint16_t*>(out) + i * n + 16 * j);
        } else {
          v.Store(static_cast<float*>(out) + i * n + 16 * j);
        }
      }
    }
  }
}

// PackedMicroTile<..., rows, blocks> for 1 <= rows <= MR and 1 <= blocks <= NR (kSwiglu:
// blocks even: gate and up blocks come in pairs).
template <Kind kKind, bool kSwiglu, int MR, int NR, typename... Args>
void PackedTile(int64_t rows, int64_t blocks, Args... args) {
  if (blocks < NR) {
    if constexpr (NR > (kSwiglu ? 2 : 1)) {
      return PackedTile<kKind, kSwiglu, MR, NR - (kSwiglu ? 2 : 1)>(rows, blocks, args...);
    }
  }
  if (rows < MR) {
    if constexpr (MR > 1) return PackedTile<kKind, kSwiglu, MR - 1, NR>(rows, blocks, args...);
  }
  PackedMicroTile<kKind, kSwiglu, MR, NR>(args...);
}

// SwiGLU for TileShape::kSplitSwiglu: `blocks` gate blocks and the matching up blocks (at
// up_offset bytes further) as two plain tiles into a scratch, then f32 silu(gate) * up.
template <Kind kKind, int MR, int NR>
void SplitSwigluTile(int64_t rows, int64_t blocks, const char* a, int64_t a_stride,
                     int64_t steps, const char* w, int64_t w_stride, int64_t up_offset,
                     void* out, int64_t n, const char* prefetch, int64_t prefetch_bytes) {
  static_assert(kKind != Kind::kBf16Dot, "the split SwiGLU writes float32");
  constexpr int64_t kLd = NR * 16;
  alignas(64) float gate[MR * kLd], up[MR * kLd];
  const RowArgmax* no_argmax = nullptr;
  PackedTile<kKind, false, MR, NR>(rows, blocks, a, a_stride, steps, w, w_stride, int64_t{0},
                                   static_cast<void*>(gate), kLd, prefetch, prefetch_bytes,
                                   false, no_argmax);
  PackedTile<kKind, false, MR, NR>(rows, blocks, a, a_stride, steps, w + up_offset, w_stride,
                                   int64_t{0}, static_cast<void*>(up), kLd, prefetch + up_offset,
                                   prefetch_bytes, false, no_argmax);
  float* o = static_cast<float*>(out);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < blocks; ++j) {
      Swiglu(V16::Load(gate + i * kLd + 16 * j), V16::Load(up + i * kLd + 16 * j))
          .Store(o + i * n + 16 * j);
    }
  }
}

// The geometry of a packed matmul of kKind: bytes per element of a and of out, the strides,
// and its output blocks grouped the way a work item takes them.
template <Kind kKind, bool kSwiglu, bool kTall = false>
struct PackedPlan {
  using Shape = TileShape<kKind, kSwiglu, kTall>;
  static constexpr int64_t kMr = Shape::kMr, kNr = Shape::kNr;
  static constexpr int64_t kElem = kKind == Kind::kBf16Dot ? 2 : 4;
  static constexpr int64_t kOutElem = kSwiglu ? kElem : 4;
  static constexpr int64_t kGroup = kSwiglu ? kNr / 2 : kNr;  // output blocks per tile

  int64_t a_stride, steps, w_stride, out_blocks, n, up_offset, col_groups;

  PackedPlan(int64_t k, int64_t n_blocks)
      : a_stride(k * kElem),
        steps(kKind == Kind::kF32 ? k : k / 2),
        w_stride(steps * 64),  // bytes of one 16-column block of w
        // Output blocks: with kSwiglu, each pairs a gate block with its up block.
        out_blocks(kSwiglu ? n_blocks / 2 : n_blocks),
        n(out_blocks * 16),
        up_offset(kSwiglu ? out_blocks * w_stride : 0),
        col_groups((out_blocks + kGroup - 1) / kGroup) {}

  // Work items of one matmul: runs of column groups, a few per thread; a group's slice of w
  // (K x 16 * kGroup columns) stays in L2 while the rows of a pass over it.
  static int64_t Items(ffi::ThreadPool& pool, int64_t col_groups) {
    return std::min<int64_t>(col_groups, 8 * (pool.num_threads() + 1));
  }
  // Rows in chunks whose slice of a stays in L2 too (prefill's long batches).
  int64_t RowChunk() const { return std::max<int64_t>(kMr, (256 * 1024 / a_stride) / kMr * kMr); }
  // An output of several MB (the LM head's logits: 16 MB at 128 rows) is written with
  // non-temporal stores: it leaves the cache by the time it is read anyway, and ordinary
  // stores would first read every line from DRAM (LM head + argmax 12.3-12.7 -> 11.2-11.4 ms).
  bool Stream(int64_t m, const void* out) const {
    return !kSwiglu && m * n * 4 >= (8 << 20) && reinterpret_cast<uintptr_t>(out) % 64 == 0;
  }
};

// One work item of a packed matmul: column groups [g0, g1) of out for the m rows of a,
// folding each row's (max, first column) into row_val / row_idx if given.
template <Kind kKind, bool kSwiglu, bool kTall>
void PackedColumnRun(const PackedPlan<kKind, kSwiglu, kTall>& plan, const char* a, const char* w,
                     void* out, int64_t m, int64_t g0, int64_t g1, bool stream, float* row_val,
                     int32_t* row_idx) {
  using Plan = PackedPlan<kKind, kSwiglu, kTall>;
  constexpr int64_t kMr = Plan::kMr, kNr = Plan::kNr, kGroup = Plan::kGroup;
  const int64_t a_stride = plan.a_stride, w_stride = plan.w_stride, n = plan.n;
  const int64_t out_blocks = plan.out_blocks;
  char* out_bytes = static_cast<char*>(out);
  const int64_t chunk = plan.RowChunk();
  for (int64_t mc = 0; mc < m; mc += chunk) {
    const int64_t mc_end = std::min(mc + chunk, m);
    const int64_t tiles = (mc_end - mc + kMr - 1) / kMr;
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t ob0 = g * kGroup, blocks = std::min<int64_t>(kGroup, out_blocks - ob0);
      // The next group's slice of w is requested into L2 in equal parts by this group's
      // row tiles (it streams from DRAM: the weights of a whole model do not fit in L3).
      const int64_t next_bytes =
          g + 1 < g1 ? std::min<int64_t>(kGroup, out_blocks - ob0 - kGroup) * w_stride : 0;
      const int64_t part = (next_bytes / tiles + 63) / 64 * 64;
      const char* next = w + (ob0 + kGroup) * w_stride;
      for (int64_t m0 = mc, t = 0; m0 < mc_end; m0 += kMr, ++t) {
        const int64_t from = std::min(t * part, next_bytes);
        void* o = static_cast<void*>(out_bytes + (m0 * n + ob0 * 16) * Plan::kOutElem);
        if constexpr (Plan::Shape::kSplitSwiglu) {
          SplitSwigluTile<kKind, kMr, kNr / 2>(
              std::min<int64_t>(kMr, mc_end - m0), blocks, a + m0 * a_stride, a_stride,
              plan.steps, w + ob0 * w_stride, w_stride, plan.up_offset, o, n, next + from,
              std::min(part, next_bytes - from));
          continue;
        }
        RowArgmax argmax{};
        if (row_val != nullptr) argmax = {row_val + m0, row_idx + m0, ob0 * 16};
        PackedTile<kKind, kSwiglu, kMr, kNr>(
            std::min<int64_t>(kMr, mc_end - m0), kSwiglu ? 2 * blocks : blocks,
            a + m0 * a_stride, a_stride, plan.steps, w + ob0 * w_stride, w_stride,
            plan.up_offset, o, n, next + from, std::min(part, next_bytes - from), stream,
            row_val != nullptr ? static_cast<const RowArgmax*>(&argmax) : nullptr);
      }
    }
  }
  if (stream) _mm_sfence();
}

// ---- AVX2's tile shape on this CPU (TileShape: wide or tall) ----
//
// Timed once per process and kind, on a problem that stays in L2 (48 rows, K = 256, 6
// blocks: 25-50 us a pass on one thread), the shapes alternating, the best of 15 passes each
// (~1-2 ms in all, at the first many-row matmul of the kind). Both shapes sum each output
// along K in the same order, so the choice never changes a result.
// JaxcbForceTiles overrides the probe (tests run both shapes on one machine).
std::atomic<int> forced_tiles{-1};  // -1: probe; 0: wide; 1: tall

// One pass of the matmul's own column run (m rows, all columns) at a shape, in seconds.
template <Kind kKind, bool kTall>
double TimeTiles(const char* a, int64_t m, int64_t k, const char* w, int64_t blocks, float* out) {
  const PackedPlan<kKind, false, kTall> plan(k, blocks);
  const auto t0 = std::chrono::steady_clock::now();
  PackedColumnRun(plan, a, w, out, m, 0, plan.col_groups, false, nullptr, nullptr);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

template <Kind kKind>
bool ProbeTallTiles() {
  // The sizes through volatiles: the compiler must not specialise the code timed here into
  // something the real calls never run.
  volatile int64_t sizes[3] = {48, 256, 6};
  const int64_t m = sizes[0], k = sizes[1], blocks = sizes[2];
  std::vector<float> a(m * k, 0.5f), out(m * blocks * 16);
  // w 64-byte aligned, as the packed weights are (a vector's heap block is 16-byte aligned:
  // each 64-byte step of w would straddle two lines); zeros: +0.0 as float32 and as bf16.
  std::vector<char> w_bytes(k * blocks * 64 + 64, 0);
  char* w = w_bytes.data() + (64 - reinterpret_cast<uintptr_t>(w_bytes.data()) % 64) % 64;
  double wide = 1e30, tall = 1e30;
  for (int pass = 0; pass < 15; ++pass) {
    const char* ap = reinterpret_cast<const char*>(a.data());
    wide = std::min(wide, TimeTiles<kKind, false>(ap, m, k, w, blocks, out.data()));
    tall = std::min(tall, TimeTiles<kKind, true>(ap, m, k, w, blocks, out.data()));
  }
  return tall < wide;
}

// Whether kKind's many-row products take the tall AVX2 tiles here (never with AVX-512).
template <Kind kKind>
bool TallTiles() {
#if defined(__AVX512F__)
  return false;
#else
  const int forced = forced_tiles.load(std::memory_order_relaxed);
  if (forced >= 0) return forced == 1;
  static const bool probed = ProbeTallTiles<kKind>();
  return probed;
#endif
}

// fn(std::true_type) if a product of m rows takes the tall tiles (they win here and it fills
// at least one), else fn(std::false_type): the kTall argument of the matmuls' templates.
template <Kind kKind, typename Fn>
void AtTileShape(int64_t m, Fn&& fn) {
  if (m >= TileShape<kKind, false, true>::kMr && TallTiles<kKind>()) {
    fn(std::true_type{});
  } else {
    fn(std::false_type{});
  }
}

// a: [M, K] of 2-byte (bf16, kBf16Dot) or 4-byte (f32) elements; w: its packed blocks,
// n_blocks of them. kSwiglu: w is [K, 2 * I] (gate columns, then up), out [M, I] =
// silu(gate) * up. best_val / best_idx ([M, slots], or null): per row and work item, the
// largest output and its first column (items cover increasing column ranges; unused slots
// keep -inf).
template <Kind kKind, bool kSwiglu, bool kTall>
void PackedMatmulAs(ffi::ThreadPool& pool, const char* a, const char* w, void* out, int64_t m,
                    int64_t k, int64_t n_blocks, float* best_val, int32_t* best_idx,
                    int64_t slots) {
  const PackedPlan<kKind, kSwiglu, kTall> plan(k, n_blocks);
  const int64_t groups = plan.col_groups;
  int64_t items = plan.Items(pool, groups);
  if (best_val != nullptr) {
    items = std::min(items, slots);
    std::fill(best_val, best_val + m * slots, -std::numeric_limits<float>::infinity());
    std::fill(best_idx, best_idx + m * slots, 0);
  }
  const bool stream = plan.Stream(m, out);
  ParallelFor(pool, items, [&](int64_t item) {
    const int64_t g0 = groups * item / items, g1 = groups * (item + 1) / items;
    std::vector<float> row_val;
    std::vector<int32_t> row_idx;
    if (best_val != nullptr) {
      row_val.assign(m, -std::numeric_limits<float>::infinity());
      row_idx.assign(m, 0);
    }
    PackedColumnRun(plan, a, w, out, m, g0, g1, stream,
                    best_val != nullptr ? row_val.data() : nullptr, row_idx.data());
    if (best_val != nullptr) {
      for (int64_t r = 0; r < m; ++r) {
        best_val[r * slots + item] = row_val[r];
        best_idx[r * slots + item] = row_idx[r];
      }
    }
  });
}

template <Kind kKind, bool kSwiglu>
void PackedMatmul(ffi::ThreadPool& pool, const char* a, const char* w, void* out, int64_t m,
                  int64_t k, int64_t n_blocks, float* best_val = nullptr,
                  int32_t* best_idx = nullptr, int64_t slots = 0) {
  AtTileShape<kKind>(m, [&](auto tall) {
    PackedMatmulAs<kKind, kSwiglu, decltype(tall)::value>(pool, a, w, out, m, k, n_blocks,
                                                          best_val, best_idx, slots);
  });
}

// Buffers of a and of the packed w: bf16 weights with f32 rows for kBf16Wide.
template <Kind kKind>
struct KindTypes {
  static constexpr ffi::DataType kA =
      kKind == Kind::kBf16Dot ? ffi::DataType::BF16 : ffi::DataType::F32;
  static constexpr ffi::DataType kW =
      kKind == Kind::kF32 ? ffi::DataType::F32 : ffi::DataType::BF16;
};

// a is [M, K]; w is packed from a [K, N] weight (pack_bf16 / pack_f32 layout).
template <Kind kKind, typename Dims>
bool PackedShapesOk(const Dims& ad, const Dims& wd) {
  constexpr bool kBf16 = kKind != Kind::kF32;
  const bool w_ok = kBf16 ? (wd.size() == 4 && wd[2] == 16 && wd[3] == 32)
                          : (wd.size() == 3 && wd[2] == 16);
  return ad.size() == 2 && w_ok && wd[1] * (kBf16 ? 32 : 1) == ad[1];
}

template <Kind kKind>
ffi::Error ShapeError() {
  return ffi::Error::InvalidArgument(kKind != Kind::kF32
                                         ? "a must be [M, K] and w [N/16, K/32, 16, 32]"
                                         : "a must be [M, K] and w [N/16, K, 16]");
}

template <Kind kKind>
ffi::Error LayerShapeError() {
  return ffi::Error::InvalidArgument(
      kKind != Kind::kF32
          ? "a must be [M, K], w [L, N/16, K/32, 16, 32] and layer i32[1] in range"
          : "a must be [M, K], w [L, N/16, K, 16] and layer i32[1] in range");
}

template <Kind kKind, bool kSwiglu>
ffi::Error MatmulPackedImpl(ffi::ThreadPool pool, ffi::Buffer<KindTypes<kKind>::kA> a,
                            ffi::Buffer<KindTypes<kKind>::kW> w, ffi::Buffer<ffi::S32> layer,
                            ffi::Buffer<ffi::S32> rows, ffi::Result<ffi::AnyBuffer> out) {
  auto ad = a.dimensions();
  LayerOf wl;
  if (!SliceLayer(w, layer, &wl) || !PackedShapesOk<kKind>(ad, wl.dims)) {
    return LayerShapeError<kKind>();
  }
  auto wd = wl.dims;
  if (kSwiglu && wd[0] % 2) {
    return ffi::Error::InvalidArgument("swiglu: w must hold as many up blocks as gate blocks");
  }
  const int64_t m = RealRows(ad, rows);
  ZeroRowsFrom(*out, ad[0], m);
  if (m == 0) return ffi::Error::Success();
  PackedMatmul<kKind, kSwiglu>(pool, reinterpret_cast<const char*>(a.untyped_data()), wl.data,
                               out->untyped_data(), m, ad[1], wd[0]);
  return ffi::Error::Success();
}

// The packed matmul (or its SwiGLU) of a's rows RMS-normed first: a f32 [M, K] (the
// residual stream), g its norm weight, eps. The norm before a layer's QKV and gate/up
// matmuls in the kernel's call rather than four XLA ops of their own (a decode step of a
// small model spends a few microseconds on each op whatever it computes). The normed rows
// are rounded to the weights' dtype as the unfused path's input is (packed_matmul's
// _kernel_input): bf16 for kBf16Dot, bf16 widened back for kBf16Wide.
template <Kind kKind, bool kSwiglu>
ffi::Error NormMatmulPackedImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> a, ffi::AnyBuffer g,
                                ffi::Buffer<KindTypes<kKind>::kW> w, ffi::Buffer<ffi::S32> layer,
                                ffi::Buffer<ffi::S32> rows, ffi::Result<ffi::AnyBuffer> out,
                                float eps) {
  auto ad = a.dimensions();
  LayerOf wl;
  if (!SliceLayer(w, layer, &wl) || !PackedShapesOk<kKind>(ad, wl.dims)) {
    return LayerShapeError<kKind>();
  }
  if (kSwiglu && wl.dims[0] % 2) {
    return ffi::Error::InvalidArgument("swiglu: w must hold as many up blocks as gate blocks");
  }
  const int64_t k = ad[1];
  const float* g32 = NormWeightF32(g, k);
  if (g32 == nullptr) return NormWeightError();
  const int64_t m = RealRows(ad, rows);
  ZeroRowsFrom(*out, ad[0], m);
  if (m == 0) return ffi::Error::Success();
  thread_local std::vector<float> normed;
  thread_local std::vector<uint16_t> normed_bf16;
  normed.resize(m * k);
  if (kKind == Kind::kBf16Dot) normed_bf16.resize(m * k);
  float* y = normed.data();
  uint16_t* y16 = normed_bf16.data();
  const float* x_data = a.typed_data();
  // Rows in items of 32 over the pool: a prefill's 1,024 rows would take ~0.3 ms on one
  // thread, 60 times a step.
  constexpr int64_t kNormRows = 32;
  ParallelFor(pool, (m + kNormRows - 1) / kNormRows, [&](int64_t item) {
    const int64_t r0 = item * kNormRows, r1 = std::min(m, r0 + kNormRows);
    RmsNormRows(x_data + r0 * k, g32, eps, r1 - r0, k, y + r0 * k);
    for (int64_t i = r0 * k; i < r1 * k; ++i) {
      if constexpr (kKind == Kind::kBf16Dot) {
        y16[i] = F32ToBf16(y[i]);
      } else if constexpr (kKind == Kind::kBf16Wide) {
        y[i] = Bf16ToF32(F32ToBf16(y[i]));
      }
    }
  });
  const char* x = kKind == Kind::kBf16Dot ? reinterpret_cast<const char*>(y16)
                                          : reinterpret_cast<const char*>(y);
  PackedMatmul<kKind, kSwiglu>(pool, x, wl.data, out->untyped_data(), m, k, wl.dims[0]);
  return ffi::Error::Success();
}

// ---- grouped matmuls: a mixture of experts' rows, each through its own expert's weights ---
//
// a [M, K] holds rows sorted by group (a mixture of experts' tokens by expert), group_sizes
// i32[G] how many each group has, and w the G packed weights stacked ([G, ...] of the layout
// above: pack_f32 / pack_bf16 of each expert's [K, N] matrix). Rows of group g meet w[g]
// only: XLA's CPU ragged_dot multiplies every row by every group's matrix and masks the
// products (8 groups: 8x the arithmetic of one dense matmul of the same rows). Rows past
// sum(group_sizes) (the bucket's padding) come out zero (see GroupRows); each group's rows
// run through PackedColumnRun as one matmul of those rows would (see GroupItems).

// The grouped matmul's work, at one tile shape: each group's rows through PackedColumnRun as
// one matmul of those rows would run.
template <Kind kKind, bool kSwiglu, bool kTall>
void GroupedRun(ffi::ThreadPool& pool, const std::vector<int64_t>& first, const char* a_data,
                const char* w_data, int64_t w_bytes, char* out_data, int64_t k,
                int64_t n_blocks) {
  using Plan = PackedPlan<kKind, kSwiglu, kTall>;
  const Plan plan(k, n_blocks);
  const int64_t out_row = plan.n * Plan::kOutElem;
  const int64_t runs = Plan::Items(pool, plan.col_groups);
  const std::vector<GroupItem> items = GroupItems(first, [&](int64_t) {
    return std::pair<int64_t, int64_t>{plan.col_groups, runs};
  });
  ParallelFor(pool, static_cast<int64_t>(items.size()), [&](int64_t i) {
    const GroupItem& item = items[i];
    const int64_t g = item.group, rows = first[g + 1] - first[g];
    void* o = out_data + first[g] * out_row;
    PackedColumnRun(plan, a_data + first[g] * plan.a_stride, w_data + g * w_bytes, o, rows,
                    item.u0, item.u1, plan.Stream(rows, o), nullptr, nullptr);
  });
}

// The grouped matmul's FFI handler: checks, the rows of each group, the tile shape.
template <Kind kKind, bool kSwiglu>
ffi::Error GroupedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<KindTypes<kKind>::kA> a,
                             ffi::Buffer<KindTypes<kKind>::kW> w, ffi::Buffer<ffi::S32> layer,
                             ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> out) {
  auto ad = a.dimensions();
  LayerOf wl;
  const bool sliced = SliceLayer(w, layer, &wl);
  auto wd = wl.dims;
  const int64_t groups = group_sizes.element_count();
  if (!sliced || wd.size() < 2 || wd[0] != groups ||
      !PackedShapesOk<kKind>(ad, wd.last(wd.size() - 1))) {
    return ffi::Error::InvalidArgument(
        kKind != Kind::kF32
            ? "a must be [M, K], group_sizes [G], w [L, G, N/16, K/32, 16, 32], layer i32[1]"
            : "a must be [M, K], group_sizes [G], w [L, G, N/16, K, 16], layer i32[1]");
  }
  if (kSwiglu && wd[1] % 2) {
    return ffi::Error::InvalidArgument("swiglu: w must hold as many up blocks as gate blocks");
  }
  const std::vector<int64_t> first = GroupRows(group_sizes, ad[0]);
  const int64_t m = first[groups];
  ZeroRowsFrom(*out, ad[0], m);
  if (m == 0) return ffi::Error::Success();
  const char* a_data = reinterpret_cast<const char*>(a.untyped_data());
  const char* w_data = wl.data;
  char* out_data = static_cast<char*>(out->untyped_data());
  const int64_t w_bytes = wl.bytes / groups;  // one expert's packed weight
  int64_t most = 0;  // the largest group's rows pick the tile shape
  for (int64_t g = 0; g < groups; ++g) most = std::max(most, first[g + 1] - first[g]);
  AtTileShape<kKind>(most, [&](auto tall) {
    GroupedRun<kKind, kSwiglu, decltype(tall)::value>(pool, first, a_data, w_data, w_bytes,
                                                      out_data, ad[1], wd[1]);
  });
  return ffi::Error::Success();
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
// The grouped matmul on AMX tiles, w [G, N/16, K/32, 16, 32] (pack_bf16 per expert). An
// AMX tile holds 16 rows: a group of fewer (decode's experts get a row or a few) leaves most
// of it idle and takes the vdpbf16ps tiles instead, which read the same layout; a group of a
// tile or more (prefill) runs at AMX's rate. (8 experts, top-2, K=512, I=1024, a 16-thread
// Xeon: T=16 ~0.15 ms all on AMX, ~0.13 split so; T=64..512 2-2.5x slower all on vdpbf16ps.)
constexpr int64_t kAmxMinRows = 16;

ffi::Error GroupedMatmulAmxImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> a,
                                ffi::Buffer<ffi::BF16> w, ffi::Buffer<ffi::S32> layer,
                                ffi::Buffer<ffi::S32> group_sizes,
                                ffi::Result<ffi::AnyBuffer> out) {
  using DotPlan = PackedPlan<Kind::kBf16Dot, false>;
  auto ad = a.dimensions();
  LayerOf wl;
  const bool sliced = SliceLayer(w, layer, &wl);
  auto wd = wl.dims;
  const int64_t groups = group_sizes.element_count();
  if (!sliced || ad.size() != 2 || wd.size() != 5 || wd[0] != groups || wd[3] != 16 ||
      wd[4] != 32 || wd[2] * 32 != ad[1]) {
    return ffi::Error::InvalidArgument(
        "a must be [M, K], group_sizes [G], w [L, G, N/16, K/32, 16, 32] and layer i32[1]");
  }
  if (!AmxEnabled()) return ffi::Error::Internal("the kernel refused AMX state (arch_prctl)");
  const std::vector<int64_t> first = GroupRows(group_sizes, ad[0]);
  const int64_t m = first[groups], k = ad[1], n_blocks = wd[1], n = n_blocks * 16;
  ZeroRowsFrom(*out, ad[0], m);
  if (m == 0) return ffi::Error::Success();
  // An AMX group's last 32-row block reads up to 31 rows past it: the next group's rows or
  // the padding (their products are dropped), or past the end of a, which then gets a copy
  // with zero rows up to that far.
  int64_t reach = 0;
  for (int64_t g = 0; g < groups; ++g) {
    if (first[g + 1] - first[g] >= kAmxMinRows) {
      reach = std::max(reach, first[g] + (first[g + 1] - first[g] + 31) / 32 * 32);
    }
  }
  const uint16_t* a_data = reinterpret_cast<const uint16_t*>(a.typed_data());
  thread_local std::vector<uint16_t> padded;
  if (reach > ad[0]) {
    padded.assign(reach * k, 0);
    std::memcpy(padded.data(), a_data, m * k * sizeof(uint16_t));
    a_data = padded.data();
  }
  const uint16_t* w_data = reinterpret_cast<const uint16_t*>(wl.data);
  float* out_data = static_cast<float*>(out->untyped_data());
  const int64_t w_elems = wd[1] * wd[2] * 16 * 32;  // one expert's packed weight
  const int64_t pairs = (n_blocks + 1) / 2, amx_runs = AmxItems(pool, pairs);
  const DotPlan dot(k, n_blocks);
  const int64_t dot_runs = DotPlan::Items(pool, dot.col_groups);
  const std::vector<GroupItem> items = GroupItems(first, [&](int64_t rows) {
    return rows >= kAmxMinRows ? std::pair<int64_t, int64_t>{pairs, amx_runs}
                            : std::pair<int64_t, int64_t>{dot.col_groups, dot_runs};
  });
  ParallelFor(pool, static_cast<int64_t>(items.size()), [&](int64_t i) {
    const GroupItem& item = items[i];
    const int64_t g = item.group, rows = first[g + 1] - first[g];
    const uint16_t* ag = a_data + first[g] * k;
    const uint16_t* wg = w_data + g * w_elems;
    if (rows >= kAmxMinRows) {
      AmxColumnRun(ag, rows, k, wg, n_blocks, item.u0, item.u1, out_data + first[g] * n);
    } else {
      PackedColumnRun(dot, reinterpret_cast<const char*>(ag), reinterpret_cast<const char*>(wg),
                      out_data + first[g] * n, rows, item.u0, item.u1, false, nullptr, nullptr);
    }
  });
  return ffi::Error::Success();
}
#endif  // AMX

// The plain matmul that also returns, per row, the max and first argmax of each work item's
// columns ([M, slots] each; the caller reduces over slots). Padding rows: zeros, and every
// slot -inf at column 0.
template <Kind kKind>
ffi::Error MatmulArgmaxImpl(ffi::ThreadPool pool, ffi::Buffer<KindTypes<kKind>::kA> a,
                            ffi::Buffer<KindTypes<kKind>::kW> w, ffi::Buffer<ffi::S32> rows,
                            ffi::Result<ffi::AnyBuffer> out,
                            ffi::Result<ffi::Buffer<ffi::F32>> best_val,
                            ffi::Result<ffi::Buffer<ffi::S32>> best_idx) {
  auto ad = a.dimensions();
  auto wd = w.dimensions();
  auto bd = best_val->dimensions();
  if (!PackedShapesOk<kKind>(ad, wd)) return ShapeError<kKind>();
  if (bd.size() != 2 || bd[0] != ad[0] || bd[1] < 1) {
    return ffi::Error::InvalidArgument("best_val / best_idx must be [M, slots]");
  }
  const int64_t m = RealRows(ad, rows), slots = bd[1];
  ZeroRowsFrom(*out, ad[0], m);
  std::fill(best_val->typed_data() + m * slots, best_val->typed_data() + ad[0] * slots,
            -std::numeric_limits<float>::infinity());
  std::fill(best_idx->typed_data() + m * slots, best_idx->typed_data() + ad[0] * slots, 0);
  if (m == 0) return ffi::Error::Success();
  PackedMatmul<kKind, false>(pool, reinterpret_cast<const char*>(a.untyped_data()),
                             reinterpret_cast<const char*>(w.untyped_data()),
                             out->untyped_data(), m, ad[1], wd[0], best_val->typed_data(),
                             best_idx->typed_data(), slots);
  return ffi::Error::Success();
}

// The greedy token of each row of a[M, K] x w[K, N] in float32: exactly the argmax of the
// logits MatmulArgmaxImpl<kF32> computes (first column on ties), for about the cost of a bf16
// matmul. The rows are multiplied once in bf16 (w_screen: w rounded to bf16, pack_bf16
// layout; with vdpbf16ps where the CPU has it, else widened); every output then lies within a
// bound of its float32 value,
//   |bf16 result - f32 result| <= ||a~|| ||w~_j - w_j|| + ||a~ - a|| ||w_j|| + rounding,
// a~ and w~ the bf16 roundings (col_stats holds ||w_j|| and ||w~_j - w_j||, rounded up). Only
// the columns whose upper bound reaches the row's best lower bound can hold the argmax
// (usually one or two of 32000); their 16-column blocks are recomputed in float32, with the
// FMA sequence of the float32 kernel (one chain per column, the same at every ISA level), so
// the values compared are bit for bit that kernel's. out gets the bf16-product logits (what a
// caller reading them sees: a screen, not logits).
ffi::Error MatmulArgmaxScreenedImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> a,
                                    ffi::Buffer<ffi::BF16> w_screen, ffi::Buffer<ffi::F32> w,
                                    ffi::Buffer<ffi::F32> col_stats,
                                    ffi::Buffer<ffi::S32> rows, ffi::Result<ffi::AnyBuffer> out,
                                    ffi::Result<ffi::Buffer<ffi::S32>> ids) {
  auto ad = a.dimensions();
  auto sd = w_screen.dimensions();
  auto wd = w.dimensions();
  auto cd = col_stats.dimensions();
  if (!PackedShapesOk<Kind::kBf16Wide>(ad, sd) || !PackedShapesOk<Kind::kF32>(ad, wd) ||
      sd[0] != wd[0]) {
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

  // a rounded to bf16 (kept as bf16, or as the f32 values of those bf16 for the widened
  // kernel: the products are exact either way), and each row's share of the bound.
  constexpr bool kDot =
#if defined(__AVX512BF16__)
      true;
#else
      false;
#endif
  thread_local std::vector<uint16_t> a_bf16;
  thread_local std::vector<float> a_rounded, row_a, row_b;
  thread_local std::vector<char> exhaustive;
  if (kDot) {
    a_bf16.resize(m * k);
  } else {
    a_rounded.resize(m * k);
  }
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
      const float xt = Bf16ToF32(xb);
      if (kDot) {
        a_bf16[i * k + kk] = xb;
      } else {
        a_rounded[i * k + kk] = xt;
      }
      s_screen += static_cast<double>(xt) * xt;
      s_diff += (static_cast<double>(xt) - x) * (static_cast<double>(xt) - x);
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
  const char* screen_w = reinterpret_cast<const char*>(w_screen.untyped_data());
  if constexpr (kDot) {
    PackedMatmul<Kind::kBf16Dot, false>(pool, reinterpret_cast<const char*>(a_bf16.data()),
                                        screen_w, screen, m, k, n_blocks);
  } else {
    PackedMatmul<Kind::kBf16Wide, false>(pool, reinterpret_cast<const char*>(a_rounded.data()),
                                         screen_w, screen, m, k, n_blocks);
  }

  const float *w_data = w.typed_data(), *col_n = col_stats.typed_data(), *col_r = col_n + n;
  // (The thread-local vectors by pointer: in a worker thread their names are its own.)
  const float *a_bound = row_a.data(), *b_bound = row_b.data();
  const char* scan_all = exhaustive.data();
  ParallelFor(pool, m, [&](int64_t i) {
    const V16 ra = V16::Set(a_bound[i]), rb = V16::Set(b_bound[i]);
    const float* row = screen + i * n;
    auto bound = [&](int64_t c) {  // of columns c .. c + 15
      return Fma(ra, V16::Load(col_r + c), Mul(rb, V16::Load(col_n + c)));
    };
    // The row's largest lower bound: its argmax in float32 is at least this.
    V16 lo = V16::Set(-std::numeric_limits<float>::infinity());
    for (int64_t c = 0; c < n; c += 16) {
      lo = Max(Sub(V16::Load(row + c), bound(c)), lo);  // drops NaN
    }
    const V16 floor = V16::Set(lo.MaxLane());
    const float* x = a_data + i * k;
    float best = -std::numeric_limits<float>::infinity();
    int32_t best_col = 0;
    for (int64_t b = 0; b < n_blocks; ++b) {
      const int64_t c = b * 16;
      const V16 upper = Add(V16::Load(row + c), bound(c));
      const uint32_t cand = scan_all[i] ? 0xffffu : upper.LanesAtLeast(floor);
      if (!cand) continue;
      // The block in float32, as PackedMicroTile<kF32, ...> sums it: one FMA chain per column.
      const float* wb = w_data + b * k * 16;
      V16 acc = V16::Zero();
      for (int64_t kk = 0; kk < k; ++kk) acc = Fma(V16::Set(x[kk]), V16::Load(wb + kk * 16), acc);
      alignas(64) float exact[16];
      acc.Store(exact);
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

#include "quant_matmul.h"  // int8 / int4 weights
#endif  // JAXCB_HAVE_V16

}  // namespace

// The AVX2 tile shape (TileShape): -1 probes this CPU (the default), 0 forces the wide tiles,
// 1 the tall ones. For tests and benchmarks; a no-op with AVX-512.
extern "C" void JaxcbForceTiles(int choice) {
#if defined(JAXCB_HAVE_V16)
  forced_tiles.store(choice < 0 ? -1 : choice > 0 ? 1 : 0);
#endif
}

// Whether many-row products take the tall AVX2 tiles here (probing if not yet): bit 0 for
// float32 weights, bit 1 for widened bf16.
extern "C" int JaxcbTallTiles() {
#if defined(JAXCB_HAVE_V16)
  return (TallTiles<Kind::kF32>() ? 1 : 0) | (TallTiles<Kind::kBf16Wide>() ? 2 : 0);
#else
  return 0;
#endif
}

// What this build of the library defines (bits): 1 the V16 kernels (f32, widened bf16, int8, int4,
// the screened argmax), 4 the vdpbf16ps kernels, 8 the AMX kernel (and the OS granted the tile
// state). (Bit 2 is free: it said "AVX-512 vectors", which nothing asks.)
extern "C" int JaxcbIsaFeatures() {
  int features = 0;
#if defined(JAXCB_HAVE_V16)
  features |= 1;
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  features |= 4;
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (AmxEnabled()) features |= 8;
#endif
  return features;
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcbMatmulAmx, MatmulAmxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // a [M, K]
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // w [L, ...packed]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer [1]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // real rows [1]
                                  .Ret<ffi::AnyBuffer>());        // f32 [M, N]
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcbGroupedMatmulAmx, GroupedMatmulAmxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // a [M, K]
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // w [L, G, ...packed]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer [1]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // group sizes [G]
                                  .Ret<ffi::AnyBuffer>());        // f32 [M, N]
#endif

#if defined(JAXCB_HAVE_V16)
#define JAXCB_PACKED_MATMUL(name, kind, swiglu)                                              \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, (MatmulPackedImpl<Kind::kind, swiglu>),                \
                                ffi::Ffi::Bind()                                             \
                                    .Ctx<ffi::ThreadPool>()                                  \
                                    .Arg<ffi::Buffer<KindTypes<Kind::kind>::kA>>() /* a */   \
                                    .Arg<ffi::Buffer<KindTypes<Kind::kind>::kW>>() /* w */   \
                                    .Arg<ffi::Buffer<ffi::S32>>() /* layer [1] */            \
                                    .Arg<ffi::Buffer<ffi::S32>>() /* real rows [1] */        \
                                    .Ret<ffi::AnyBuffer>());

// -> f32 [M, N], f32 [M, slots], i32 [M, slots]
#define JAXCB_MATMUL_ARGMAX(name, kind)                                                      \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, (MatmulArgmaxImpl<Kind::kind>),                        \
                                ffi::Ffi::Bind()                                             \
                                    .Ctx<ffi::ThreadPool>()                                  \
                                    .Arg<ffi::Buffer<KindTypes<Kind::kind>::kA>>() /* a */   \
                                    .Arg<ffi::Buffer<KindTypes<Kind::kind>::kW>>() /* w */   \
                                    .Arg<ffi::Buffer<ffi::S32>>() /* real rows [1] */        \
                                    .Ret<ffi::AnyBuffer>()                                   \
                                    .Ret<ffi::Buffer<ffi::F32>>()                            \
                                    .Ret<ffi::Buffer<ffi::S32>>());

// Grouped: (a [M, K], w [L, G, ...packed], layer i32[1], group_sizes i32[G]) -> as the
// plain ones.
#define JAXCB_GROUPED_MATMUL(name, kind, swiglu)                                             \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, (GroupedMatmulImpl<Kind::kind, swiglu>),               \
                                ffi::Ffi::Bind()                                             \
                                    .Ctx<ffi::ThreadPool>()                                  \
                                    .Arg<ffi::Buffer<KindTypes<Kind::kind>::kA>>() /* a */   \
                                    .Arg<ffi::Buffer<KindTypes<Kind::kind>::kW>>() /* w */   \
                                    .Arg<ffi::Buffer<ffi::S32>>() /* layer [1] */            \
                                    .Arg<ffi::Buffer<ffi::S32>>() /* group sizes [G] */      \
                                    .Ret<ffi::AnyBuffer>());

// The same, a's rows RMS-normed first: (a f32 [M, K], g f32 / bf16 [K], w, layer, rows;
// eps) -> as the plain ones.
#define JAXCB_NORM_PACKED_MATMUL(name, kind, swiglu)                                         \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, (NormMatmulPackedImpl<Kind::kind, swiglu>),            \
                                ffi::Ffi::Bind()                                             \
                                    .Ctx<ffi::ThreadPool>()                                  \
                                    .Arg<ffi::Buffer<ffi::F32>>() /* a [M, K] */             \
                                    .Arg<ffi::AnyBuffer>() /* norm weight [K] */             \
                                    .Arg<ffi::Buffer<KindTypes<Kind::kind>::kW>>() /* w */   \
                                    .Arg<ffi::Buffer<ffi::S32>>() /* layer [1] */            \
                                    .Arg<ffi::Buffer<ffi::S32>>() /* real rows [1] */        \
                                    .Ret<ffi::AnyBuffer>()                                   \
                                    .Attr<float>("eps"));

JAXCB_PACKED_MATMUL(JaxcbMatmulF32, kF32, false)          // -> f32 [M, N]
JAXCB_PACKED_MATMUL(JaxcbSwigluF32, kF32, true)           // -> f32 [M, N / 2]
JAXCB_MATMUL_ARGMAX(JaxcbMatmulArgmaxF32, kF32)
JAXCB_PACKED_MATMUL(JaxcbMatmulBf16Wide, kBf16Wide, false)  // f32 a -> f32 [M, N]
JAXCB_PACKED_MATMUL(JaxcbSwigluBf16Wide, kBf16Wide, true)   // -> f32 [M, N / 2]
JAXCB_MATMUL_ARGMAX(JaxcbMatmulArgmaxBf16Wide, kBf16Wide)
JAXCB_NORM_PACKED_MATMUL(JaxcbNormMatmulF32, kF32, false)
JAXCB_NORM_PACKED_MATMUL(JaxcbNormSwigluF32, kF32, true)
JAXCB_NORM_PACKED_MATMUL(JaxcbNormMatmulBf16Wide, kBf16Wide, false)
JAXCB_NORM_PACKED_MATMUL(JaxcbNormSwigluBf16Wide, kBf16Wide, true)
JAXCB_GROUPED_MATMUL(JaxcbGroupedMatmulF32, kF32, false)          // -> f32 [M, N]
JAXCB_GROUPED_MATMUL(JaxcbGroupedSwigluF32, kF32, true)           // -> f32 [M, N / 2]
JAXCB_GROUPED_MATMUL(JaxcbGroupedMatmulBf16Wide, kBf16Wide, false)  // f32 a -> f32 [M, N]
JAXCB_GROUPED_MATMUL(JaxcbGroupedSwigluBf16Wide, kBf16Wide, true)   // -> f32 [M, N / 2]
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
#endif

#if defined(JAXCB_HAVE_V16)
#define JAXCB_QUANT_MATMUL(name, bits, swiglu)                                               \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, (MatmulQuantImpl<bits, swiglu>),                        \
                                ffi::Ffi::Bind()                                             \
                                    .Ctx<ffi::ThreadPool>()                                  \
                                    .Arg<ffi::Buffer<ffi::F32>>() /* a [M, K] */             \
                                    .Arg<ffi::Buffer<ffi::U8>>() /* w [L, ...pack_int8/4] */ \
                                    .Arg<ffi::Buffer<ffi::S32>>() /* layer [1] */            \
                                    .Arg<ffi::Buffer<ffi::S32>>() /* real rows [1] */        \
                                    .Ret<ffi::Buffer<ffi::F32>>());

// The same, a's rows RMS-normed first: (a, g f32[K], w, rows; eps) -> as above.
#define JAXCB_NORM_QUANT_MATMUL(name, bits, swiglu)                                          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, (NormMatmulQuantImpl<bits, swiglu>),                    \
                                ffi::Ffi::Bind()                                             \
                                    .Ctx<ffi::ThreadPool>()                                  \
                                    .Arg<ffi::Buffer<ffi::F32>>() /* a [M, K] */             \
                                    .Arg<ffi::AnyBuffer>() /* norm weight f32 / bf16 [K] */  \
                                    .Arg<ffi::Buffer<ffi::U8>>() /* w [L, ...pack_int8/4] */ \
                                    .Arg<ffi::Buffer<ffi::S32>>() /* layer [1] */            \
                                    .Arg<ffi::Buffer<ffi::S32>>() /* real rows [1] */        \
                                    .Ret<ffi::Buffer<ffi::F32>>()                            \
                                    .Attr<float>("eps"));

JAXCB_QUANT_MATMUL(JaxcbMatmulInt8, 8, false)  // -> f32 [M, N]
JAXCB_QUANT_MATMUL(JaxcbSwigluInt8, 8, true)   // -> f32 [M, N / 2]
JAXCB_QUANT_MATMUL(JaxcbMatmulInt4, 4, false)  // -> f32 [M, N]
JAXCB_QUANT_MATMUL(JaxcbSwigluInt4, 4, true)   // -> f32 [M, N / 2]
JAXCB_NORM_QUANT_MATMUL(JaxcbNormMatmulInt8, 8, false)
JAXCB_NORM_QUANT_MATMUL(JaxcbNormSwigluInt8, 8, true)
JAXCB_NORM_QUANT_MATMUL(JaxcbNormMatmulInt4, 4, false)
JAXCB_NORM_QUANT_MATMUL(JaxcbNormSwigluInt4, 4, true)
#endif

#if defined(JAXCB_HAVE_V16) && defined(__AVX512BF16__)
JAXCB_PACKED_MATMUL(JaxcbMatmulBf16Dot, kBf16Dot, false)  // bf16 a -> f32 [M, N]
JAXCB_PACKED_MATMUL(JaxcbSwigluBf16Dot, kBf16Dot, true)   // -> bf16 [M, N / 2]
JAXCB_MATMUL_ARGMAX(JaxcbMatmulArgmaxBf16Dot, kBf16Dot)
JAXCB_NORM_PACKED_MATMUL(JaxcbNormMatmulBf16Dot, kBf16Dot, false)
JAXCB_NORM_PACKED_MATMUL(JaxcbNormSwigluBf16Dot, kBf16Dot, true)
JAXCB_GROUPED_MATMUL(JaxcbGroupedMatmulBf16Dot, kBf16Dot, false)  // bf16 a -> f32 [M, N]
JAXCB_GROUPED_MATMUL(JaxcbGroupedSwigluBf16Dot, kBf16Dot, true)   // -> bf16 [M, N / 2]
#endif
