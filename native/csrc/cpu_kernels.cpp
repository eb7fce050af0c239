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

int64_t gcd64(int64_t a, int64_t b) { return b == 0 ? a : gcd64(b, a % b); }

// Tokens per tile, measured on a 2-core EPYC (bench.transfer, 32K tokens): layouts whose page
// holds each layer's tokens adjacently (layer_first, page_first_direct) copy best layer by layer
// (T = n); page_first reads best token by token for H2D (T = 1, its host order) and in tiles of
// 32 tokens for D2H (runs of 32 items from each device buffer, of 32 * L items on the host):
// 1.4-1.7x faster than either extreme there.
int64_t cpu_tile_tokens(const TransferGeom& g, bool to_host) {
  const int64_t want = g.token_stride <= g.layer_stride ? g.n_tokens : (to_host ? 32 : 1);
  return gcd64(g.n_tokens, std::min<int64_t>(want, g.n_tokens));
}

}  // namespace

void cpu_transfer(const DevBuffers& dev, const int64_t* slots, char* host, const int64_t* pages,
                  const TransferGeom& g, bool to_host, int num_threads) {
  const int64_t n = g.n_tokens, nl = g.num_layers, nkv = g.num_kv, item = g.item_bytes;
  // Order: tiles of T tokens; inside a tile, layer by layer, token by token:
  //     u = ((k * n_tiles + tile) * nl + l) * T + t,   token i = tile * T + t.
  // T = 1 walks each token's layers (page_first's host order), T = n each layer's tokens (the
  // device buffers' order); a middle T keeps both sides in runs of T items / nl items.
  const int64_t T = cpu_tile_tokens(g, to_host);
  const int64_t n_tiles = n / T;
  const int64_t total = n * nl * nkv;
  // Streaming stores pay off once the destination outgrows the caches (~8 MiB here).
  const bool streaming = total * item >= (int64_t{8} << 20);
  auto body = [&](int64_t ub, int64_t ue) {
    for (int64_t u = ub; u < ue; ++u) {
      const int64_t t = u % T, r = u / T;
      const int64_t l = r % nl, r2 = r / nl;
      const int64_t i = (r2 % n_tiles) * T + t, k = r2 / n_tiles;
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
