// CUDA implementation of the l2core transfer kernel (torch-free).
//
// One launch moves every (token, layer, kv) item of a transfer. The work is flattened into
// vectors of sizeof(Vec) bytes: v = item * vecs_per_item + w. Each thread issues kUnroll loads
// before its stores so enough reads are in flight to cover PCIe latency when the source is
// pinned host memory (the H2D direct path). Grid = at most max_blocks blocks of 1024 threads,
// i.e. at most max_blocks SMs busy.
#include <cuda_runtime.h>

#include <cstdint>

#include "l2core_kernels.h"

namespace l2core {
namespace {

constexpr int kThreads = 1024;
constexpr int kUnroll = 4;

template <typename Vec, bool kToHost, bool kTokenInner>
__global__ void __launch_bounds__(kThreads, 1)
    transfer_kernel(DevBuffers dev, const int64_t* __restrict__ slots, char* __restrict__ host,
                    const int64_t* __restrict__ pages, TransferGeom g, uint32_t vecs_per_item,
                    uint64_t total_vecs, int* bad_index) {
  const uint32_t n = static_cast<uint32_t>(g.n_tokens);
  const uint32_t nl = static_cast<uint32_t>(g.num_layers);
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t base = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; base < total_vecs;
       base += stride * kUnroll) {
    Vec buf[kUnroll];
    Vec* dst[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const uint64_t v = base + j * stride;
      dst[j] = nullptr;
      if (v >= total_vecs) continue;
      const uint32_t u = static_cast<uint32_t>(v / vecs_per_item);
      const uint32_t w = static_cast<uint32_t>(v - static_cast<uint64_t>(u) * vecs_per_item);
      uint32_t i, l, k;
      if (kTokenInner) {  // u = (k * nl + l) * n + i
        i = u % n;
        const uint32_t r = u / n;
        l = r % nl;
        k = r / nl;
      } else {  // u = (k * n + i) * nl + l
        l = u % nl;
        const uint32_t r = u / nl;
        i = r % n;
        k = r / n;
      }
      const int64_t slot = slots[i];
      const uint32_t pi = i / static_cast<uint32_t>(g.page_size);
      const int64_t page = pages ? pages[pi] : static_cast<int64_t>(pi);
      if (slot < 0 || slot >= g.num_slots || page < 0 || page >= g.num_host_pages) {
        if (bad_index) *bad_index = 1;
        continue;
      }
      Vec* d = reinterpret_cast<Vec*>(dev.ptr[l * g.num_kv + k] + slot * g.item_bytes) + w;
      Vec* h = reinterpret_cast<Vec*>(host + page * g.page_stride +
                                      static_cast<int64_t>(i - pi * g.page_size) * g.token_stride +
                                      (g.layer_begin + l) * g.layer_stride + k * g.kv_stride) +
               w;
      if (kToHost) {
        buf[j] = *d;
        dst[j] = h;
      } else {
        buf[j] = *h;
        dst[j] = d;
      }
    }
#pragma unroll
    for (int j = 0; j < kUnroll; ++j)
      if (dst[j]) *dst[j] = buf[j];
  }
}

template <typename Vec>
int launch(const DevBuffers& dev, const int64_t* slots, char* host, const int64_t* pages,
           const TransferGeom& g, bool to_host, int max_blocks, int* bad_index, cudaStream_t s) {
  const uint32_t vpi = static_cast<uint32_t>(g.item_bytes / sizeof(Vec));
  const uint64_t total = static_cast<uint64_t>(g.n_tokens) * g.num_layers * g.num_kv * vpi;
  if (total == 0) return 0;
  const uint64_t want = (total + kThreads * kUnroll - 1) / (kThreads * kUnroll);
  const int blocks = static_cast<int>(want < static_cast<uint64_t>(max_blocks) ? want : max_blocks);
  const bool token_inner = g.token_stride <= g.layer_stride;
#define L2_LAUNCH(TH, TI) \
  transfer_kernel<Vec, TH, TI><<<blocks, kThreads, 0, s>>>(dev, slots, host, pages, g, vpi, total, bad_index)
  if (to_host) {
    if (token_inner) L2_LAUNCH(true, true); else L2_LAUNCH(true, false);
  } else {
    if (token_inner) L2_LAUNCH(false, true); else L2_LAUNCH(false, false);
  }
#undef L2_LAUNCH
  return static_cast<int>(cudaGetLastError());
}

bool aligned(const void* p, size_t a) { return (reinterpret_cast<uintptr_t>(p) % a) == 0; }

}  // namespace

int cuda_transfer_direct(const DevBuffers& dev, const int64_t* slots, char* host, const int64_t* pages,
                         const TransferGeom& g, bool to_host, int max_blocks, int* bad_index,
                         void* stream) {
  // Widest vector that divides every address and stride involved.
  size_t a = 16;
  auto fits = [&](size_t w) {
    if (g.item_bytes % w || g.page_stride % w || g.token_stride % w || g.layer_stride % w ||
        g.kv_stride % w || !aligned(host, w))
      return false;
    for (int64_t b = 0; b < g.num_layers * g.num_kv; ++b)
      if (!aligned(dev.ptr[b], w)) return false;
    return true;
  };
  while (a > 1 && !fits(a)) a /= 2;
  auto s = static_cast<cudaStream_t>(stream);
  switch (a) {
    case 16: return launch<int4>(dev, slots, host, pages, g, to_host, max_blocks, bad_index, s);
    case 8: return launch<int2>(dev, slots, host, pages, g, to_host, max_blocks, bad_index, s);
    case 4: return launch<int>(dev, slots, host, pages, g, to_host, max_blocks, bad_index, s);
    case 2: return launch<short>(dev, slots, host, pages, g, to_host, max_blocks, bad_index, s);
    default: return launch<char>(dev, slots, host, pages, g, to_host, max_blocks, bad_index, s);
  }
}

}  // namespace l2core
