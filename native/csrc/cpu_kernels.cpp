// CPU implementation of the l2core transfer kernels: multi-threaded memcpy of token items.
// Torch-free; argument checking lives in bindings.cpp.
#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#include "l2core_kernels.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace l2core {
namespace {

// Copy with non-temporal (streaming) stores: a large transfer's destination will not be read
// soon, and streaming stores skip the read-for-ownership of each destination line (a third of
// the memory traffic of a plain copy). Falls back to memcpy when unaligned or without SSE2.
inline void stream_copy(char* dst, const char* src, int64_t n) {
#if defined(__SSE2__)
  if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | static_cast<uintptr_t>(n)) & 15) == 0) {
    auto* d = reinterpret_cast<__m128i*>(dst);
    const auto* s = reinterpret_cast<const __m128i*>(src);
    int64_t v = n / 16, i = 0;
    for (; i + 4 <= v; i += 4) {
      __m128i a = _mm_loadu_si128(s + i), b = _mm_loadu_si128(s + i + 1);
      __m128i c = _mm_loadu_si128(s + i + 2), e = _mm_loadu_si128(s + i + 3);
      _mm_stream_si128(d + i, a);
      _mm_stream_si128(d + i + 1, b);
      _mm_stream_si128(d + i + 2, c);
      _mm_stream_si128(d + i + 3, e);
    }
    for (; i < v; ++i) _mm_stream_si128(d + i, _mm_loadu_si128(s + i));
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

inline void store_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

template <typename F>
void parallel_ranges(int64_t n, int num_threads, int64_t min_per_thread, F&& fn) {
  int64_t t = std::max<int64_t>(1, std::min<int64_t>(num_threads, n / std::max<int64_t>(1, min_per_thread)));
  if (t <= 1) {
    fn(0, n);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(t - 1);
  int64_t chunk = (n + t - 1) / t;
  for (int64_t i = 1; i < t; ++i) {
    int64_t b = i * chunk, e = std::min(n, b + chunk);
    if (b < e) pool.emplace_back([&fn, b, e] { fn(b, e); });
  }
  fn(0, std::min(n, chunk));
  for (auto& th : pool) th.join();
}

}  // namespace

void cpu_transfer(const DevBuffers& dev, const int64_t* slots, char* host, const int64_t* pages,
                  const TransferGeom& g, bool to_host, int num_threads) {
  const int64_t n = g.n_tokens, nl = g.num_layers, nkv = g.num_kv, item = g.item_bytes;
  // Walk the source in address order so hardware prefetch streams it; the destination takes
  // full-line streaming stores anywhere. D2H reads per-layer device buffers: token-inner.
  // H2D reads host pages: token-inner when a page's tokens of one layer are adjacent
  // (layer_first, page_first_direct), layer-inner for page_first.
  const bool token_inner = to_host || g.token_stride <= g.layer_stride;
  const int64_t total = n * nl * nkv;
  // Streaming stores pay off once the destination outgrows the caches (~8 MiB here).
  const bool streaming = total * item >= (int64_t{8} << 20);
  auto body = [&](int64_t ub, int64_t ue) {
    for (int64_t u = ub; u < ue; ++u) {
      int64_t k, l, i;
      if (token_inner) {  // u = (k * nl + l) * n + i
        i = u % n;
        l = (u / n) % nl;
        k = u / (n * nl);
      } else {  // u = (k * n + i) * nl + l
        l = u % nl;
        i = (u / nl) % n;
        k = u / (n * nl);
      }
      const int64_t slot = slots[i];
      const int64_t page = pages ? pages[i / g.page_size] : i / g.page_size;
      if (slot < 0 || slot >= g.num_slots || page < 0 || page >= g.num_host_pages) continue;
      char* d = dev.ptr[l * nkv + k] + slot * item;
      char* h = host + page * g.page_stride + (i % g.page_size) * g.token_stride +
                (g.layer_begin + l) * g.layer_stride + k * g.kv_stride;
      if (streaming) {
        if (to_host)
          stream_copy(h, d, item);
        else
          stream_copy(d, h, item);
      } else if (to_host) {
        std::memcpy(h, d, item);
      } else {
        std::memcpy(d, h, item);
      }
    }
    if (streaming) store_fence();
  };
  // A thread starts only when it gets at least ~1 MiB of work.
  parallel_ranges(total, num_threads, std::max<int64_t>(1, (1 << 20) / std::max<int64_t>(1, item)), body);
}

void cpu_copy_runs(const CopyRun* runs, int64_t n, int num_threads) {
  // Split big runs into 1 MiB pieces so threads share the bytes evenly; large copies use the
  // same streaming stores as cpu_transfer, so a benchmark baseline built on this is not weaker
  // than the kernels it is compared with.
  constexpr int64_t kPiece = 1 << 20;
  std::vector<CopyRun> pieces;
  pieces.reserve(n);
  int64_t total = 0;
  for (int64_t r = 0; r < n; ++r) {
    total += runs[r].bytes;
    for (int64_t off = 0; off < runs[r].bytes; off += kPiece) {
      pieces.push_back({runs[r].src + off, runs[r].dst + off, std::min(kPiece, runs[r].bytes - off)});
    }
  }
  const bool streaming = total >= (int64_t{8} << 20);
  parallel_ranges(static_cast<int64_t>(pieces.size()), num_threads, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      char* dst = reinterpret_cast<char*>(pieces[i].dst);
      const char* src = reinterpret_cast<const char*>(pieces[i].src);
      if (streaming)
        stream_copy(dst, src, pieces[i].bytes);
      else
        std::memcpy(dst, src, pieces[i].bytes);
    }
    if (streaming) store_fence();
  });
}

}  // namespace l2core
