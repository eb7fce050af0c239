// Torch-free kernel interface of l2core: batched page gather/scatter between per-layer device
// KV buffers (token-slot indexed) and host pages of any layout described by four byte strides.
//
// Host byte offset of (page p, token-in-page t, layer l, kv k):
//     p * page_stride + t * token_stride + l * layer_stride + k * kv_stride
// Device byte address of (token i, layer l, kv k):
//     dev[(l - layer_begin) * num_kv + k] + slots[i] * item_bytes
// Token i of the transfer lives in host page pages[i / page_size] at position i % page_size.
//
// The binding layer (csrc/bindings.cpp) checks every argument before calling in here; these
// functions still never touch a slot or page outside [0, num_slots) / [0, num_host_pages).
#pragma once
#include <cstddef>
#include <cstdint>

namespace l2core {

constexpr int kMaxBuffers = 1024;  // layers * kv moved in one call

struct DevBuffers {
  char* ptr[kMaxBuffers];
};

struct TransferGeom {
  int64_t n_tokens = 0;     // tokens moved (multiple of page_size)
  int64_t page_size = 0;
  int64_t num_layers = 0;   // layers moved in this call: [layer_begin, layer_begin + num_layers)
  int64_t layer_begin = 0;  // absolute index of the first moved layer (for host offsets)
  int64_t num_kv = 0;       // 2 for MHA (K, V), 1 for MLA
  int64_t item_bytes = 0;   // bytes of one token of one layer's K/V/latent
  int64_t page_stride = 0, token_stride = 0, layer_stride = 0, kv_stride = 0;
  int64_t num_slots = 0;       // device slots per buffer (bound for slots[])
  int64_t num_host_pages = 0;  // bound for pages[]
};

// One contiguous copy: dst[0:bytes] = src[0:bytes]
struct CopyRun {
  int64_t src;
  int64_t dst;
  int64_t bytes;
};

// ---- CPU (multi-threaded memcpy) ------------------------------------------------------------
// to_host: device buffers -> host pages; else host pages -> device buffers.
void cpu_transfer(const DevBuffers& dev, const int64_t* slots, char* host, const int64_t* pages,
                  const TransferGeom& g, bool to_host, int num_threads);
void cpu_copy_runs(const CopyRun* runs, int64_t n, int num_threads);

// ---- CUDA --------------------------------------------------------------------------------
#ifdef L2CORE_WITH_CUDA
// Direct: SM threads read/write the (pinned, mapped) host memory. `host` is a device-visible
// pointer. slots/pages are device pointers; pages == nullptr means page i/page_size
// (a compact staging area, used by the staged path before/after its DMAs). max_blocks bounds the SMs used (one block per SM).
// bad_index (device int) is set to 1 when an out-of-range slot or page is skipped.
int cuda_transfer_direct(const DevBuffers& dev, const int64_t* slots, char* host,
                         const int64_t* pages, const TransferGeom& g, bool to_host,
                         int max_blocks, int* bad_index, void* stream);
#endif

}  // namespace l2core
