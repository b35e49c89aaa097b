// int8 / int4 weights (models/quant.py): matmul.cc includes this inside its namespace, after
// the float32 tiles (which the many-row path reuses), at every ISA level from AVX2.
//
// out[M, N] (f32) = a[M, K] (f32) x w[K, N], w = code * scale + min per column and group of
// 32 inputs (int8: code = q + 128, q the stored int8), packed by pack_int8 / pack_int4
// (packing.py) as [N/16, K/32, group bytes]: for each 16-column block and group, the codes in
// quads of inputs (each column's 4 consecutive inputs in 4 consecutive bytes: the operand
// order of x86's byte dot products), then the 16 columns' float16 scales and minimums.
// - int8 (576 bytes a group): byte 64 p + 4 c + j holds q of input 4 p + j, column c; in the
//   symmetric form (544 bytes: GGUF Q8_0 blocks, min = -128 scale) the minimums are left out;
// - int4 (320 bytes, GGUF Q4_0 / Q4_1 weights: codes 0..15): byte 64 p + 4 c + j holds the
//   code of input 4 p + j (low nibble) and of input 16 + 4 p + j (high nibble), p < 4.
// A group's share of a product is scale * sum_r a_r q_r + offset * sum_r a_r (int8: q signed,
// offset = 128 scale + min; int4: q = code, offset = min); sum_r a_r is taken in float32.
//
// Two paths, by the call's row count:
// - up to kQuantDirectRows rows (decode of a few sequences: bound by reading the weights) take
//   sum_r a_r q_r as integer dot products, each row's activations coded per group of 32 at
//   about 15 bits (finer than bfloat16's 8): one int8 code per activation, as llama.cpp's Q8
//   activations, moved SmolLM2's greedy tokens off the float32 ones (83% of the real-model
//   test's tokens agreed; with 15 bits, as many as with float32 activations).
//   int8 weights: codes widened to int16, vpmaddwd against int16 activation codes
//   (a ~ d c, d = max |a| / 32767), int32 sums. int4 weights: vpmaddubsw (codes as unsigned
//   bytes x signed bytes, pairs summed in int16) against two int8 codes an activation,
//   a ~ d (254 u + v) (u at e = max |a| / 127, v the remainder at d = e / 254), u's sums
//   weighted 254; codes are 0..15, so eight byte-pair sums fit int16 before widening. A
//   register holds 16 (int8) or 32 (int4) weights, where widening to float32 held 8: the
//   arithmetic of a decode row stays below the time its weights take to arrive. The same
//   AVX2 code runs at every ISA level.
// - more rows (prefill, batched decode) dequantize a work item's slice of w to float32 once,
//   in L2, and run the float32 tiles over all the rows, at their rate: exactly the products
//   with the dequantized weights (prefill and eval_ppl see no activation rounding).
constexpr int64_t kQuantGroup = 32;
// Calls of up to this many rows take the integer path; more dequantize slices.
constexpr int64_t kQuantDirectRows = 4;

// kSym (int8 only): symmetric codes, weight = q * scale (GGUF Q8_0 blocks: min = -128 scale),
// stored without the minimums (544 bytes a group).
template <int kBits, bool kSym = false>
struct CodeLayout {
  static_assert(kBits == 8 || !kSym, "symmetric codes are int8 only");
  static constexpr int64_t kCodeBytes = kQuantGroup * 16 * kBits / 8;
  // codes, scales (and minimums)
  static constexpr int64_t kGroupBytes = kCodeBytes + (kSym ? 1 : 2) * 16 * 2;
  static constexpr int kQuads = kCodeBytes / 64;  // 64-byte runs: 16 columns x 4 bytes

  // The scale and the offset of columns 8 h .. 8 h + 7 of a group.
  static void Scales(const char* group, int h, __m256& scale, __m256& offset) {
    const auto* f16 = reinterpret_cast<const __m128i*>(group + kCodeBytes);
    scale = _mm256_cvtph_ps(_mm_loadu_si128(f16 + h));
    if constexpr (kSym) {
      offset = _mm256_setzero_ps();
    } else {
      const __m256 minimum = _mm256_cvtph_ps(_mm_loadu_si128(f16 + 2 + h));
      offset = kBits == 8 ? _mm256_fmadd_ps(_mm256_set1_ps(128.0f), scale, minimum) : minimum;
    }
  }
};

inline __m256i Load256(const void* p) {
  return _mm256_loadu_si256(static_cast<const __m256i*>(p));
}

// Four bytes (a quad of int8 activations) in every 32-bit lane.
inline __m256i BroadcastQuad(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// The weight of an activation's first code against its second (4-bit weights, see the top).
constexpr int32_t kHighWeight = 254;

// Rows [0, m) of a [m, k] as integer codes per group of 32 (kQuantDirectRows rows at most:
// `codes` holds 2 m k bytes), for the weights' code width:
// - int8 weights: one int16 code each, a ~ d c, d = max |a| / 32767;
// - int4 weights: two int8 codes each, a ~ d (254 u + v): u = round(a / e) at e = max |a| /
//   127, v = round((a - e u) / d) at d = e / 254 (u at codes, v at codes + m k);
// and, per row and group, d (0 for a group of zeros) and the float32 sum of a.
template <int kBits>
void QuantizeActivations(const float* a, int64_t m, int64_t k, void* codes, float* d,
                         float* sums) {
  const int64_t groups = k / kQuantGroup;
  int16_t* c16 = static_cast<int16_t*>(codes);
  int8_t* u = static_cast<int8_t*>(codes);
  int8_t* v = u + m * k;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t at = i * k + g * kQuantGroup;
      const float* x = a + at;
      float amax = 0.0f, sum = 0.0f;
      for (int64_t r = 0; r < kQuantGroup; ++r) {
        amax = std::max(amax, std::fabs(x[r]));
        sum += x[r];
      }
      sums[i * groups + g] = sum;
      if constexpr (kBits == 8) {
        const float inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
        for (int64_t r = 0; r < kQuantGroup; ++r) {
          c16[at + r] = static_cast<int16_t>(std::nearbyint(x[r] * inv));
        }
        d[i * groups + g] = amax / 32767.0f;
      } else {
        const float e = amax / 127.0f, fine = e / kHighWeight;
        const float inv_e = amax > 0.0f ? 127.0f / amax : 0.0f;
        const float inv_fine = amax > 0.0f ? 1.0f / fine : 0.0f;
        for (int64_t r = 0; r < kQuantGroup; ++r) {
          const float hi = std::nearbyint(x[r] * inv_e);
          const float lo = std::nearbyint((x[r] - hi * e) * inv_fine);
          u[at + r] = static_cast<int8_t>(hi);
          v[at + r] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, lo)));
        }
        d[i * groups + g] = fine;
      }
    }
  }
}

// Four int16 activation codes in every 64-bit lane.
inline __m256i BroadcastQuad16(const int16_t* p) {
  int64_t v;
  std::memcpy(&v, p, 8);
  return _mm256_set1_epi64x(v);
}

// acc (8 columns, float32) += scale x d x dot + offset x sum.
inline __m256 FoldGroup(__m256 acc, __m256i dot, __m256 scale, __m256 offset, float d,
                        float sum) {
  const __m256 base = _mm256_fmadd_ps(offset, _mm256_set1_ps(sum), acc);
  return _mm256_fmadd_ps(_mm256_mul_ps(scale, _mm256_set1_ps(d)), _mm256_cvtepi32_ps(dot), base);
}

// How far ahead of its group the integer path asks for w's cache lines (_mm_prefetch; past
// the end of a block is the next block's start, which a work item runs next). A decode row
// does little arithmetic per byte, yet the loop's instructions leave the out-of-order window
// too few loads in flight for one core to reach the memory's speed: streaming SmolLM2's
// gate/up weights (113 MB, 1 row), a Zen 3 core read 12-15 GB/s without, 16-19 with (two
// cores 21-26 -> 27-33 GB/s; a plain read of the same bytes: 16-21 and 25-34).
constexpr int64_t kQuantPrefetchAhead = 2048;

// One 16-column block of w (group g at w + g * kGroupBytes) times MR <= 4 rows of activation
// codes (QuantizeActivations<kBits>; m rows in all, row i's groups' d and sums at ad / as +
// i * groups): the block's 16 results of row i at out + i * n. Each 64-byte run of codes
// (16 columns x 4 inputs) is read once, both 8-column halves against the same broadcast
// activations.
template <int kBits, bool kSym, int MR>
void IntDotBlock(const void* codes, int64_t m, int64_t k, const float* ad, const float* as,
                 int64_t groups, const char* w, float* out, int64_t n) {
  using L = CodeLayout<kBits, kSym>;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MR][2];
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const char* wg = w + g * L::kGroupBytes;
    for (int64_t line = 0; line < L::kGroupBytes; line += 64) {
      _mm_prefetch(wg + kQuantPrefetchAhead + line, _MM_HINT_T0);
    }
    __m256i dot[MR][2];  // int32 sums of columns 0..7 and 8..15
    if constexpr (kBits == 8) {
      // Codes widened to int16 (4 columns x 4 inputs a register), vpmaddwd against the int16
      // activations: int32 lanes (column, input pair), |.| <= 2 x 128 x 32767, 8 added a
      // group. Pairs summed (vphaddd) and put back in column order.
      const int16_t* ag = static_cast<const int16_t*>(codes) + g * kQuantGroup;
      __m256i part[MR][4];  // columns 0-3, 4-7, 8-11, 12-15
      for (int i = 0; i < MR; ++i)
        for (int q = 0; q < 4; ++q) part[i][q] = _mm256_setzero_si256();
      for (int p = 0; p < L::kQuads; ++p) {
        const auto* wp = reinterpret_cast<const __m128i*>(wg + 64 * p);
        __m256i wq[4];
        for (int q = 0; q < 4; ++q) wq[q] = _mm256_cvtepi8_epi16(_mm_loadu_si128(wp + q));
        for (int i = 0; i < MR; ++i) {
          const __m256i a4 = BroadcastQuad16(ag + i * k + 4 * p);
          for (int q = 0; q < 4; ++q) {
            part[i][q] = _mm256_add_epi32(part[i][q], _mm256_madd_epi16(wq[q], a4));
          }
        }
      }
      for (int i = 0; i < MR; ++i) {
        for (int h = 0; h < 2; ++h) {
          dot[i][h] = _mm256_permute4x64_epi64(
              _mm256_hadd_epi32(part[i][2 * h], part[i][2 * h + 1]), 0xD8);
        }
      }
    } else {
      // vpmaddubsw: codes (unsigned bytes) x activation codes (signed bytes), pairs summed in
      // int16; 8 byte-pair sums a lane, each |.| <= 2 x 15 x 127: 30480 fits int16.
      const int8_t* ug = static_cast<const int8_t*>(codes) + g * kQuantGroup;
      const int8_t* vg = ug + m * k;
      const __m256i mask = _mm256_set1_epi8(0x0f), high = _mm256_set1_epi16(kHighWeight);
      __m256i coarse[MR][2], fine[MR][2];  // u's and v's pair sums, per half
      for (int i = 0; i < MR; ++i)
        for (int h = 0; h < 2; ++h) coarse[i][h] = fine[i][h] = _mm256_setzero_si256();
      for (int p = 0; p < L::kQuads; ++p) {
        __m256i first[2], second[2];  // inputs 4 p + j, 16 + 4 p + j
        for (int h = 0; h < 2; ++h) {
          const __m256i wq = Load256(wg + 64 * p + 32 * h);
          first[h] = _mm256_and_si256(wq, mask);
          second[h] = _mm256_and_si256(_mm256_srli_epi16(wq, 4), mask);
        }
        for (int i = 0; i < MR; ++i) {
          const int8_t* ui = ug + i * k + 4 * p;
          const int8_t* vi = vg + i * k + 4 * p;
          const __m256i u0 = BroadcastQuad(ui), u1 = BroadcastQuad(ui + 16);
          const __m256i v0 = BroadcastQuad(vi), v1 = BroadcastQuad(vi + 16);
          for (int h = 0; h < 2; ++h) {
            coarse[i][h] = _mm256_add_epi16(
                coarse[i][h], _mm256_add_epi16(_mm256_maddubs_epi16(first[h], u0),
                                               _mm256_maddubs_epi16(second[h], u1)));
            fine[i][h] = _mm256_add_epi16(
                fine[i][h], _mm256_add_epi16(_mm256_maddubs_epi16(first[h], v0),
                                             _mm256_maddubs_epi16(second[h], v1)));
          }
        }
      }
      for (int i = 0; i < MR; ++i) {
        for (int h = 0; h < 2; ++h) {
          dot[i][h] = _mm256_add_epi32(_mm256_madd_epi16(coarse[i][h], high),
                                       _mm256_madd_epi16(fine[i][h], ones));
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      __m256 scale, offset;
      L::Scales(wg, h, scale, offset);
      for (int i = 0; i < MR; ++i) {
        acc[i][h] = FoldGroup(acc[i][h], dot[i][h], scale, offset, ad[i * groups + g],
                              as[i * groups + g]);
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    _mm256_storeu_ps(out + i * n, acc[i][0]);
    _mm256_storeu_ps(out + i * n + 8, acc[i][1]);
  }
}

template <int kBits, bool kSym, typename... Args>
void IntDotBlockRows(int64_t rows, Args... args) {
  switch (rows) {
    case 1: return IntDotBlock<kBits, kSym, 1>(args...);
    case 2: return IntDotBlock<kBits, kSym, 2>(args...);
    case 3: return IntDotBlock<kBits, kSym, 3>(args...);
    default: return IntDotBlock<kBits, kSym, 4>(args...);
  }
}

// Byte J of each 32-bit lane: sign-extended (int8 codes) or its two nibbles (int4 codes).
template <int J>
inline __m256i ByteAsInt(__m256i w) {
  return _mm256_srai_epi32(_mm256_slli_epi32(w, 24 - 8 * J), 24);
}
template <int J>
inline void NibblesAsInt(__m256i w, __m256i& low, __m256i& high) {
  const __m256i b = _mm256_srli_epi32(w, 8 * J);
  low = _mm256_and_si256(b, _mm256_set1_epi32(0x0f));
  high = _mm256_and_si256(_mm256_srli_epi32(b, 4), _mm256_set1_epi32(0x0f));
}

// Input quad p's four rows of 8 columns (32 code bytes wq) as float32 weights at d (row r of
// the group at d + 16 r).
template <int kBits, int J>
inline void DequantizeQuadByte(__m256i wq, __m256 scale, __m256 offset, float* d) {
  if constexpr (kBits == 8) {
    const __m256 code = _mm256_cvtepi32_ps(ByteAsInt<J>(wq));
    _mm256_storeu_ps(d + 16 * J, _mm256_fmadd_ps(code, scale, offset));
  } else {
    __m256i low, high;
    NibblesAsInt<J>(wq, low, high);
    _mm256_storeu_ps(d + 16 * J, _mm256_fmadd_ps(_mm256_cvtepi32_ps(low), scale, offset));
    _mm256_storeu_ps(d + 16 * (16 + J), _mm256_fmadd_ps(_mm256_cvtepi32_ps(high), scale, offset));
  }
}

// `blocks` blocks of w (block stride w_stride) as float32 in pack_f32's layout at dst.
template <int kBits, bool kSym>
void DequantizeCodes(const char* w, int64_t w_stride, int64_t groups, int64_t blocks,
                     float* dst) {
  using L = CodeLayout<kBits, kSym>;
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t g = 0; g < groups; ++g) {
      const char* wg = w + b * w_stride + g * L::kGroupBytes;
      float* d = dst + (b * groups + g) * kQuantGroup * 16;
      for (int h = 0; h < 2; ++h) {
        __m256 scale, offset;
        L::Scales(wg, h, scale, offset);
        for (int p = 0; p < L::kQuads; ++p) {
          const __m256i wq = Load256(wg + 64 * p + 32 * h);
          float* dp = d + 16 * 4 * p + 8 * h;
          DequantizeQuadByte<kBits, 0>(wq, scale, offset, dp);
          DequantizeQuadByte<kBits, 1>(wq, scale, offset, dp);
          DequantizeQuadByte<kBits, 2>(wq, scale, offset, dp);
          DequantizeQuadByte<kBits, 3>(wq, scale, offset, dp);
        }
      }
    }
  }
}

// out = a x w (kSwiglu: w is [K, 2 * I], gate columns then up, out [M, I] = silu(gate) * up),
// for the m real rows of a [M, K]; w holds n_blocks 16-column blocks.
template <int kBits, bool kSym, bool kSwiglu, bool kTall>
void QuantMatmulAs(ffi::ThreadPool& pool, const float* a, const char* w, float* out, int64_t m,
                   int64_t k, int64_t n_blocks) {
  using Shape = TileShape<Kind::kF32, kSwiglu, kTall>;  // the float32 tiles after dequantizing
  constexpr int64_t kMr = Shape::kMr, kNr = Shape::kNr;
  constexpr int64_t kGroup = kSwiglu ? kNr / 2 : kNr;  // output blocks per work group
  const int64_t groups = k / kQuantGroup;
  const int64_t w_stride = groups * CodeLayout<kBits, kSym>::kGroupBytes;
  const int64_t out_blocks = kSwiglu ? n_blocks / 2 : n_blocks, n = out_blocks * 16;
  const int64_t up_offset = kSwiglu ? out_blocks * w_stride : 0;
  const bool direct = m <= kQuantDirectRows;
  thread_local std::vector<int8_t> codes_storage;
  thread_local std::vector<float> scales_storage, sums_storage;
  if (direct) {
    codes_storage.resize(2 * m * k);
    scales_storage.resize(m * groups);
    sums_storage.resize(m * groups);
    QuantizeActivations<kBits>(a, m, k, codes_storage.data(), scales_storage.data(),
                               sums_storage.data());
  }
  const void* codes = codes_storage.data();
  const float* ad = scales_storage.data();
  const float* as = sums_storage.data();
  const int64_t col_groups = (out_blocks + kGroup - 1) / kGroup;
  const int64_t items = std::min<int64_t>(col_groups, 8 * (pool.num_threads() + 1));
  ParallelFor(pool, items, [&](int64_t item) {
    const int64_t g0 = col_groups * item / items, g1 = col_groups * (item + 1) / items;
    if (direct) {
      for (int64_t ob = g0 * kGroup; ob < std::min(g1 * kGroup, out_blocks); ++ob) {
        const char* wb = w + ob * w_stride;
        if constexpr (!kSwiglu) {
          IntDotBlockRows<kBits, kSym>(m, codes, m, k, ad, as, groups, wb, out + ob * 16, n);
        } else {
          alignas(64) float gate[kQuantDirectRows * 16], up[kQuantDirectRows * 16];
          IntDotBlockRows<kBits, kSym>(m, codes, m, k, ad, as, groups, wb, gate, int64_t{16});
          IntDotBlockRows<kBits, kSym>(m, codes, m, k, ad, as, groups, wb + up_offset, up,
                                 int64_t{16});
          for (int64_t i = 0; i < m; ++i) {
            Swiglu(V16::Load(gate + 16 * i), V16::Load(up + 16 * i)).Store(out + i * n + ob * 16);
          }
        }
      }
      return;
    }
    thread_local std::vector<float> slice;  // this worker's dequantized blocks
    // Each slice is dequantized once and runs over every row: dequantizing it again per
    // L2-sized chunk of rows (as the float kernels chunk them) cost more than the rows'
    // re-reads from L3 (int8, K = 1536, 512 rows: 12 dequantizations of each slice).
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t ob0 = g * kGroup, blocks = std::min<int64_t>(kGroup, out_blocks - ob0);
      const char* wb = w + ob0 * w_stride;
      float* ob = out + ob0 * 16;
      const int64_t f32_stride = k * 64;  // bytes of a dequantized block
      slice.resize((kSwiglu ? 2 : 1) * blocks * k * 16);
      DequantizeCodes<kBits, kSym>(wb, w_stride, groups, blocks, slice.data());
      if constexpr (kSwiglu) {
        DequantizeCodes<kBits, kSym>(wb + up_offset, w_stride, groups, blocks,
                               slice.data() + blocks * k * 16);
      }
      const char* sw = reinterpret_cast<const char*>(slice.data());
      const char* no_prefetch = nullptr;
      for (int64_t m0 = 0; m0 < m; m0 += kMr) {
        const int64_t rows = std::min<int64_t>(kMr, m - m0);
        const char* am = reinterpret_cast<const char*>(a + m0 * k);
        if constexpr (Shape::kSplitSwiglu) {
          SplitSwigluTile<Kind::kF32, kMr, kNr / 2>(rows, blocks, am, k * 4, k, sw, f32_stride,
                                                    blocks * f32_stride, ob + m0 * n, n,
                                                    no_prefetch, int64_t{0});
        } else {
          const RowArgmax* no_argmax = nullptr;
          PackedTile<Kind::kF32, kSwiglu, kMr, kNr>(
              rows, kSwiglu ? 2 * blocks : blocks, am, k * 4, k, sw, f32_stride,
              blocks * f32_stride, static_cast<void*>(ob + m0 * n), n, no_prefetch, int64_t{0},
              false, no_argmax);
        }
      }
    }
  });
}

// QuantMatmulAs at the float32 tile shape this CPU runs best (AtTileShape; the integer
// path of a few rows takes no tiles).
template <int kBits, bool kSym, bool kSwiglu>
void QuantMatmul(ffi::ThreadPool& pool, const float* a, const char* w, float* out, int64_t m,
                 int64_t k, int64_t n_blocks) {
  AtTileShape<Kind::kF32>(m, [&](auto tall) {
    QuantMatmulAs<kBits, kSym, kSwiglu, decltype(tall)::value>(pool, a, w, out, m, k, n_blocks);
  });
}

// out = a x w (or its SwiGLU), a's m real rows first RMS-normed with weight g ([K]; null:
// not normed): the checks and the call shared by both entry points.
template <int kBits, bool kSwiglu>
ffi::Error QuantMatmulEntry(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& a, const float* g,
                            float eps, ffi::Buffer<ffi::U8>& w, ffi::Buffer<ffi::S32>& layer,
                            ffi::Buffer<ffi::S32>& rows, ffi::Result<ffi::Buffer<ffi::F32>>& out) {
  auto ad = a.dimensions();
  LayerOf wl;
  const bool sliced = SliceLayer(w, layer, &wl);
  auto wd = wl.dims;
  // int8 weights come in both forms, told apart by their group bytes (576, or 544 symmetric)
  const bool sym = kBits == 8 && wd.size() == 3 && wd[2] == CodeLayout<8, true>::kGroupBytes;
  if (!sliced || ad.size() != 2 || wd.size() != 3 ||
      (wd[2] != CodeLayout<kBits>::kGroupBytes && !sym) || wd[1] * kQuantGroup != ad[1]) {
    return ffi::Error::InvalidArgument(
        kBits == 8 ? "a must be [M, K], w [L, N/16, K/32, 576 or 544] and layer i32[1]"
                   : "a must be [M, K], w [L, N/16, K/32, 320] and layer i32[1]");
  }
  if (kSwiglu && wd[0] % 2) {
    return ffi::Error::InvalidArgument("swiglu: w must hold as many up blocks as gate blocks");
  }
  const int64_t m = RealRows(ad, rows), k = ad[1];
  float* o = out->typed_data();
  const int64_t n = (kSwiglu ? wd[0] / 2 : wd[0]) * 16;
  std::fill(o + m * n, o + ad[0] * n, 0.0f);
  if (m == 0) return ffi::Error::Success();
  const float* x = a.typed_data();
  thread_local std::vector<float> normed;
  if (g != nullptr) {
    normed.resize(m * k);
    RmsNormRows(x, g, eps, m, k, normed.data());
    x = normed.data();
  }
  const char* wp = wl.data;
  if constexpr (kBits == 8) {
    if (sym) {
      QuantMatmul<8, true, kSwiglu>(pool, x, wp, o, m, k, wd[0]);
      return ffi::Error::Success();
    }
  }
  QuantMatmul<kBits, false, kSwiglu>(pool, x, wp, o, m, k, wd[0]);
  return ffi::Error::Success();
}

template <int kBits, bool kSwiglu>
ffi::Error MatmulQuantImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> a,
                           ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::S32> layer,
                           ffi::Buffer<ffi::S32> rows, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  return QuantMatmulEntry<kBits, kSwiglu>(pool, a, nullptr, 0.0f, w, layer, rows, out);
}

// The same with a's rows RMS-normed first (weight g [K], float32 or bfloat16 as the model
// stores it, eps): the norm before a layer's first matmuls, in the kernel's call rather than
// three XLA ops of its own (and a fourth converting g).
template <int kBits, bool kSwiglu>
ffi::Error NormMatmulQuantImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> a, ffi::AnyBuffer g,
                               ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::S32> layer,
                               ffi::Buffer<ffi::S32> rows, ffi::Result<ffi::Buffer<ffi::F32>> out,
                               float eps) {
  const float* g32 = NormWeightF32(g, a.dimensions().back());
  if (g32 == nullptr) return NormWeightError();
  return QuantMatmulEntry<kBits, kSwiglu>(pool, a, g32, eps, w, layer, rows, out);
}
