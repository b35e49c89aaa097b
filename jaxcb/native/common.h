// Helpers shared by jaxcb's native CPU kernels (attention.cc, matmul.cc): bf16 <-> f32,
// a vectorised exp, and a parallel loop over XLA's intra-op thread pool.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

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

// One layer of a weight stacked over the layers, [L, ...]: the matmul kernels take the whole
// stack and the layer's index (i32[1]) and read that layer in place, so a step that loops
// over the layers (a scan, or one call per layer) never copies a layer's weights out.
struct LayerOf {
  const char* data;
  ffi::Span<const int64_t> dims;  // the layer's own dims (the stack's without L)
  int64_t bytes;
};

// Layer layer[0] of stack w; false if w has no layer axis or the index is out of range.
template <typename B>
bool SliceLayer(const B& w, const ffi::Buffer<ffi::S32>& layer, LayerOf* out) {
  auto d = w.dimensions();
  if (d.size() < 2 || layer.element_count() != 1) return false;
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= d[0]) return false;
  out->bytes = static_cast<int64_t>(w.size_bytes()) / d[0];
  out->data = reinterpret_cast<const char*>(w.untyped_data()) + l * out->bytes;
  out->dims = d.last(d.size() - 1);
  return true;
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

#if defined(__AVX512F__)
// exp(x) for x <= 0 on 16 lanes, as attention.cc's ExpNonPositive (-inf lanes give ~0 and
// are masked by the caller).
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

#endif  // __AVX512F__

}  // namespace
