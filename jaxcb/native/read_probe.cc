// The machine's read bandwidth, measured the way a decode step streams its weights: every
// thread reads its own contiguous share of a buffer far larger than the caches, with the
// widest loads of the library's ISA level in eight independent chains (so neither the load
// ports nor one dependency chain set the pace: only the memory does). The single-stream
// benchmark calls it between its timed turns and states each system's decode rate as a
// share of this figure, taken in the same minute: on a shared VM the figure drifts by 2x
// between minutes (python -m jaxcb.bench single_stream, docs/benchmarks.md).
#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace {

inline void Spin() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

// Sums [p, p + n) (n a multiple of 512) into a value the caller keeps, so no load is dead.
float ReadRange(const char* p, int64_t n) {
#if defined(__AVX512F__)
  __m512 a[8];
  for (auto& x : a) x = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 512) {
    for (int c = 0; c < 8; ++c) {
      a[c] = _mm512_add_ps(a[c], _mm512_loadu_ps(reinterpret_cast<const float*>(p + i + 64 * c)));
    }
  }
  for (int c = 1; c < 8; ++c) a[0] = _mm512_add_ps(a[0], a[c]);
  return _mm512_reduce_add_ps(a[0]);
#elif defined(__AVX2__)
  __m256 a[8];
  for (auto& x : a) x = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 512) {
    for (int c = 0; c < 8; ++c) {
      const float* q = reinterpret_cast<const float*>(p + i + 64 * c);
      a[c] = _mm256_add_ps(a[c], _mm256_add_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(q + 8)));
    }
  }
  for (int c = 1; c < 8; ++c) a[0] = _mm256_add_ps(a[0], a[c]);
  alignas(32) float o[8];
  _mm256_store_ps(o, a[0]);
  return o[0] + o[1] + o[2] + o[3] + o[4] + o[5] + o[6] + o[7];
#else
  float a[8] = {};
  for (int64_t i = 0; i < n; i += 512) {
    for (int c = 0; c < 8; ++c) a[c] += reinterpret_cast<const float*>(p + i)[16 * c];
  }
  return a[0] + a[1] + a[2] + a[3] + a[4] + a[5] + a[6] + a[7];
#endif
}

}  // namespace

// The best of `passes` reads of buf[0, bytes) by `threads` threads, in bytes per second.
// Each pass starts on all threads together (a spinning barrier) and lasts until the slowest
// thread is done; the threads are started once, outside the timed passes.
extern "C" double JaxcbReadBandwidth(const char* buf, int64_t bytes, int threads, int passes) {
  if (threads < 1 || passes < 1) return 0.0;
  const int64_t share = bytes / (512 * threads) * 512;
  if (share == 0) return 0.0;
  std::atomic<int> arrived{0};   // threads at the start of the current pass
  std::atomic<int> finished{0};  // threads done with the current pass
  std::atomic<int> pass{-1};     // the pass the threads may start
  std::vector<float> sums(threads);
  auto worker = [&](int t) {
    for (int r = 0; r < passes; ++r) {
      arrived.fetch_add(1);
      while (pass.load(std::memory_order_acquire) < r) Spin();
      sums[t] += ReadRange(buf + t * share, share);
      finished.fetch_add(1, std::memory_order_acq_rel);
    }
  };
  std::vector<std::thread> helpers;
  for (int t = 1; t < threads; ++t) helpers.emplace_back(worker, t);
  double best = 1e30;
  for (int r = 0; r < passes; ++r) {
    // Thread 0 (this one) releases the pass once every helper waits at its start.
    while (arrived.load() < (threads - 1) * (r + 1) + r) Spin();
    arrived.fetch_add(1);
    const auto start = std::chrono::steady_clock::now();
    pass.store(r, std::memory_order_release);
    sums[0] += ReadRange(buf, share);
    finished.fetch_add(1, std::memory_order_acq_rel);
    while (finished.load(std::memory_order_acquire) < threads * (r + 1)) Spin();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (s < best) best = s;
  }
  for (auto& h : helpers) h.join();
  float total = 0;
  for (float v : sums) total += v;
  // The sums are kept alive through a volatile store; the figure does not depend on them.
  volatile float sink = total;
  (void)sink;
  return static_cast<double>(share * threads) / best;
}
