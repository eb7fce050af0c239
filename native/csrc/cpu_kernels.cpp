// CPU implementation of the l2core transfer kernels: multi-threaded memcpy of token items.
// Torch-free; argument checking lives in bindings.cpp.
#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#include "l2core_kernels.h"

namespace l2core {
namespace {

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
  // Walk the host side in address order: token-inner when a page's tokens of one layer are
  // adjacent (layer_first, page_first_direct), layer-inner otherwise (page_first).
  const bool token_inner = g.token_stride <= g.layer_stride;
  const int64_t total = n * nl * nkv;
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
      if (to_host)
        std::memcpy(h, d, item);
      else
        std::memcpy(d, h, item);
    }
  };
  // A thread starts only when it gets at least ~1 MiB of work.
  parallel_ranges(total, num_threads, std::max<int64_t>(1, (1 << 20) / std::max<int64_t>(1, item)), body);
}

void cpu_copy_runs(const CopyRun* runs, int64_t n, int num_threads) {
  // Split big runs into 1 MiB pieces so threads share the bytes evenly.
  constexpr int64_t kPiece = 1 << 20;
  std::vector<CopyRun> pieces;
  pieces.reserve(n);
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t off = 0; off < runs[r].bytes; off += kPiece) {
      pieces.push_back({runs[r].src + off, runs[r].dst + off, std::min(kPiece, runs[r].bytes - off)});
    }
  }
  parallel_ranges(static_cast<int64_t>(pieces.size()), num_threads, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      std::memcpy(reinterpret_cast<void*>(pieces[i].dst), reinterpret_cast<const void*>(pieces[i].src),
                  pieces[i].bytes);
  });
}

}  // namespace l2core
