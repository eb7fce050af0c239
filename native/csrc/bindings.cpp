// The one binding file: checks every tensor (device, dtype, contiguity, shape, bounds), then
// calls the torch-free kernels in cpu_kernels.cpp / cuda_kernels.cu.
#include <pybind11/numpy.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <stdexcept>
#include <string>
#include <vector>

#include "l2core_kernels.h"
#include "page_index.h"

#ifdef L2CORE_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#endif

namespace l2core {
namespace {

struct Checked {
  DevBuffers dev{};
  TransferGeom g{};
  c10::Device device{c10::kCPU};
};

// Validates the per-layer buffers, slots, host pool and pages; fills the kernel arguments.
Checked check_transfer(const std::vector<torch::Tensor>& bufs, const torch::Tensor& slots,
                       const torch::Tensor& host, const torch::Tensor& pages, int64_t page_size,
                       int64_t layer_begin, int64_t num_layers, int64_t num_kv,
                       const std::vector<int64_t>& strides, int64_t num_host_pages, bool check_slots) {
  Checked c;
  TransferGeom& g = c.g;
  TORCH_CHECK_VALUE(page_size >= 1, "page_size must be >= 1");
  TORCH_CHECK_VALUE(num_kv == 1 || num_kv == 2, "num_kv must be 1 (MLA) or 2 (MHA)");
  TORCH_CHECK_VALUE(num_layers >= 1 && layer_begin >= 0, "bad layer range");
  TORCH_CHECK_VALUE(strides.size() == 4, "strides must be (page, token, layer, kv)");
  const int64_t nb = num_layers * num_kv;
  TORCH_CHECK_VALUE(static_cast<int64_t>(bufs.size()) == nb, "expected ", nb,
                    " device buffers (layers * kv), got ", bufs.size());
  TORCH_CHECK_VALUE(nb <= kMaxBuffers, "at most ", kMaxBuffers, " buffers per call");
  const auto& b0 = bufs[0];
  c.device = b0.device();
  TORCH_CHECK_VALUE(b0.dim() >= 1 && b0.size(0) > 0, "device buffers must be [slots, ...]");
  const int64_t num_slots = b0.size(0);
  const int64_t item = b0.numel() / num_slots * b0.element_size();
  for (int64_t i = 0; i < nb; ++i) {
    const auto& b = bufs[i];
    TORCH_CHECK_VALUE(b.device() == c.device, "device buffer ", i, " is on ", b.device(), ", buffer 0 on ",
                      c.device);
    TORCH_CHECK_TYPE(b.scalar_type() == b0.scalar_type(), "device buffer ", i, " has dtype ", b.scalar_type(),
                     ", buffer 0 has ", b0.scalar_type());
    TORCH_CHECK_VALUE(b.is_contiguous(), "device buffer ", i, " is not contiguous");
    TORCH_CHECK_VALUE(b.dim() >= 1 && b.size(0) == num_slots && b.numel() * b.element_size() == num_slots * item,
                      "device buffer ", i, " has shape ", b.sizes(), ", buffer 0 has ", b0.sizes());
    c.dev.ptr[i] = static_cast<char*>(b.data_ptr());
  }
  TORCH_CHECK_TYPE(slots.scalar_type() == torch::kInt64 && slots.dim() == 1, "slots must be a 1-D int64 tensor");
  TORCH_CHECK_TYPE(pages.scalar_type() == torch::kInt64 && pages.dim() == 1, "pages must be a 1-D int64 tensor");
  TORCH_CHECK_VALUE(slots.numel() % page_size == 0, "number of slots (", slots.numel(),
                    ") is not a multiple of page_size ", page_size);
  TORCH_CHECK_VALUE(pages.numel() * page_size == slots.numel(), "got ", pages.numel(), " pages for ",
                    slots.numel(), " slots (page_size ", page_size, ")");
  TORCH_CHECK_VALUE(pages.device().is_cpu(), "pages must be a CPU tensor");
  TORCH_CHECK_TYPE(host.device().is_cpu() && host.scalar_type() == torch::kUInt8 && host.is_contiguous(),
                   "host pool must be a contiguous CPU uint8 tensor");
  TORCH_CHECK_VALUE(num_host_pages >= 1, "num_host_pages must be >= 1");
  for (auto s : strides) TORCH_CHECK_VALUE(s >= 0, "strides must be non-negative");
  const int64_t extent = (num_host_pages - 1) * strides[0] + (page_size - 1) * strides[1] +
                         (layer_begin + num_layers - 1) * strides[2] + (num_kv - 1) * strides[3] + item;
  TORCH_CHECK_VALUE(extent <= host.numel(), "host pool of ", host.numel(), " bytes is smaller than the layout (",
                    extent, " bytes)");
  // Range errors are ValueError here: l2core.ops raises the user-facing IndexError before this
  // (a c10::IndexError thrown from this binding crashed CUDA builds with SIGSEGV).
  if (pages.numel() > 0) {
    auto mm = pages.aminmax();
    int64_t lo = std::get<0>(mm).item<int64_t>(), hi = std::get<1>(mm).item<int64_t>();
    TORCH_CHECK_VALUE(lo >= 0 && hi < num_host_pages, "host page index out of range [0, ", num_host_pages,
                      "): min ", lo, ", max ", hi);
    // A slot check on a CUDA tensor waits for the GPU; callers that cannot afford that pass
    // check_slots=false and an error flag instead (kernels skip out-of-range slots either way).
    if (check_slots || slots.device().is_cpu()) {
      auto sm = slots.aminmax();
      lo = std::get<0>(sm).item<int64_t>();
      hi = std::get<1>(sm).item<int64_t>();
      TORCH_CHECK_VALUE(lo >= 0 && hi < num_slots, "device slot out of range [0, ", num_slots, "): min ", lo,
                        ", max ", hi);
    }
  }
  g.n_tokens = slots.numel();
  g.page_size = page_size;
  g.num_layers = num_layers;
  g.layer_begin = layer_begin;
  g.num_kv = num_kv;
  g.item_bytes = item;
  g.page_stride = strides[0];
  g.token_stride = strides[1];
  g.layer_stride = strides[2];
  g.kv_stride = strides[3];
  g.num_slots = num_slots;
  g.num_host_pages = num_host_pages;
  return c;
}

#ifdef L2CORE_WITH_CUDA
void cuda_ok(int err, const char* what) {
  TORCH_CHECK(err == 0, what, " failed: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
}

char* mapped_host_ptr(const torch::Tensor& host) {
  void* dptr = nullptr;
  cudaError_t e = cudaHostGetDevicePointer(&dptr, host.data_ptr(), 0);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error
    TORCH_CHECK_VALUE(false, "host pool is not pinned/registered with CUDA (",
                      cudaGetErrorString(e), "); allocate it through l2core.memory with pin=True");
  }
  return static_cast<char*>(dptr);
}

// base + offset as an address; a null base makes the offsets absolute addresses (method "dma")
inline void* at(const char* base, int64_t off) {
  return reinterpret_cast<void*>(reinterpret_cast<intptr_t>(base) + static_cast<intptr_t>(off));
}

// Submits `n` copies on `stream`: with CUDA >= 12.8 as one cudaMemcpyBatchAsync (one driver call
// for thousands of small runs, copy engines preferred), else one cudaMemcpyAsync each. A batch the
// driver refuses (old driver) falls back to the loop once and is not tried again.
void memcpy_runs(const CopyRun* runs, size_t n, const char* src_base, char* dst_base, bool to_host,
                 cudaStream_t stream) {
  const cudaMemcpyKind kind = to_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice;
#if CUDART_VERSION >= 12080
  static bool batch_ok = true;
  if (batch_ok && n >= 8) {
    std::vector<void*> dsts(n);
    std::vector<const void*> srcs(n);
    std::vector<size_t> sizes(n);
    for (size_t i = 0; i < n; ++i) {
      dsts[i] = at(dst_base, runs[i].dst);
      srcs[i] = at(src_base, runs[i].src);
      sizes[i] = static_cast<size_t>(runs[i].bytes);
    }
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;  // copy engines, not SMs
    size_t attr_idx = 0;
#if CUDART_VERSION >= 13000
    cudaError_t e = cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), n, &attr, &attr_idx, 1, stream);
#else
    size_t fail_idx = 0;
    cudaError_t e =
        cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), n, &attr, &attr_idx, 1, &fail_idx, stream);
#endif
    if (e == cudaSuccess) return;
    cudaGetLastError();
    TORCH_WARN_ONCE("cudaMemcpyBatchAsync unavailable (", cudaGetErrorString(e), "); using one copy per run");
    batch_ok = false;
  }
#endif
  for (size_t i = 0; i < n; ++i)
    cuda_ok(cudaMemcpyAsync(at(dst_base, runs[i].dst), at(src_base, runs[i].src), runs[i].bytes, kind, stream),
            "cudaMemcpyAsync");
}

// Staged path: kernel gather/scatter into a compact device staging area, plus one DMA per
// contiguous host run (adjacent pages are merged). Returns false when the layout has no
// page-contiguous runs for this layer range (the caller then uses the direct kernel).
void staged_transfer(const Checked& c, const torch::Tensor& slots_dev, const torch::Tensor& host,
                     const torch::Tensor& pages, bool to_host, int64_t max_blocks, int64_t staging_bytes,
                     int* bad_index, cudaStream_t stream) {
  const TransferGeom& g = c.g;
  const int64_t item = g.item_bytes, P = g.page_size, nl = g.num_layers, nkv = g.num_kv;
  // Which host runs are contiguous: case A (layer-major inside a page, any layer range),
  // case B (token-major inside a page, all layers), case C (one run per layer per page).
  const bool case_a = g.token_stride == item && g.layer_stride == P * item;
  const bool case_b = !case_a && g.layer_begin == 0 && g.layer_stride == item && g.token_stride == nl * item;
  const bool case_c = !case_a && !case_b && g.token_stride == item;
  TORCH_CHECK_VALUE(case_a || case_b || case_c,
                    "the staged path needs page-contiguous host runs for this layout/layer range; "
                    "use method='direct'");
  const int64_t moved_per_page = P * nl * nkv * item;
  const int64_t n_pages = pages.numel();
  // Two staging halves: the kernel fills/drains one while the copy engine DMAs the other.
  // About 8 chunks so the first gather and the last DMA (the parts that do not overlap) are
  // short, capped by the staging budget.
  const int64_t chunk =
      std::max<int64_t>(1, std::min<int64_t>((n_pages + 7) / 8, staging_bytes / 2 / moved_per_page));
  auto staging = torch::empty({2 * chunk * moved_per_page}, torch::dtype(torch::kUInt8).device(c.device));
  const int64_t* pg = pages.data_ptr<int64_t>();
  char* host_base = static_cast<char*>(host.data_ptr());
  cudaStream_t copy_stream = c10::cuda::getStreamFromPool(false, c.device.index()).stream();
  // kernel_done[h]: the kernel last using half h finished; dma_done[h]: the DMAs of half h finished.
  cudaEvent_t kernel_done[2], dma_done[2];
  for (int h = 0; h < 2; ++h) {
    cuda_ok(cudaEventCreateWithFlags(&kernel_done[h], cudaEventDisableTiming), "cudaEventCreate");
    cuda_ok(cudaEventCreateWithFlags(&dma_done[h], cudaEventDisableTiming), "cudaEventCreate");
  }
  // the copy stream starts after everything already queued on the caller's stream
  cuda_ok(cudaEventRecord(kernel_done[1], stream), "cudaEventRecord");
  cuda_ok(cudaStreamWaitEvent(copy_stream, kernel_done[1], 0), "cudaStreamWaitEvent");
  std::vector<CopyRun> runs;
  for (int64_t p0 = 0, it = 0; p0 < n_pages; p0 += chunk, ++it) {
    const int half = static_cast<int>(it & 1);
    char* st = static_cast<char*>(staging.data_ptr()) + half * chunk * moved_per_page;
    const int64_t np = std::min(chunk, n_pages - p0);
    TransferGeom sg = g;  // compact staging geometry for pages p0 .. p0+np-1
    sg.n_tokens = np * P;
    sg.layer_begin = 0;
    sg.num_host_pages = np;
    int64_t run_bytes, n_inner;  // runs per (page, kv): 1 (A, B) or nl (C)
    if (case_a) {
      sg.token_stride = item, sg.layer_stride = P * item, sg.page_stride = nl * P * item;
      sg.kv_stride = np * sg.page_stride, run_bytes = nl * P * item, n_inner = 1;
    } else if (case_b) {
      sg.layer_stride = item, sg.token_stride = nl * item, sg.page_stride = P * nl * item;
      sg.kv_stride = np * sg.page_stride, run_bytes = P * nl * item, n_inner = 1;
    } else {
      sg.token_stride = item, sg.page_stride = P * item, sg.layer_stride = np * P * item;
      sg.kv_stride = nl * sg.layer_stride, run_bytes = P * item, n_inner = nl;
    }
    // Host run of (page j, kv k, inner layer l): A/C start at layer_begin+l, B at layer 0.
    runs.clear();
    for (int64_t k = 0; k < nkv; ++k)
      for (int64_t l = 0; l < n_inner; ++l)
        for (int64_t j = 0; j < np; ++j) {
          const int64_t layer = case_b ? 0 : g.layer_begin + (case_c ? l : 0);
          const int64_t h = pg[p0 + j] * g.page_stride + layer * g.layer_stride + k * g.kv_stride;
          const int64_t s = j * sg.page_stride + l * sg.layer_stride + k * sg.kv_stride;
          const int64_t src = to_host ? s : h, dst = to_host ? h : s;
          if (!runs.empty() && runs.back().src + runs.back().bytes == src && runs.back().dst + runs.back().bytes == dst)
            runs.back().bytes += run_bytes;
          else
            runs.push_back({src, dst, run_bytes});
        }
    const int64_t* slot_ptr = slots_dev.data_ptr<int64_t>() + p0 * P;
    auto dma = [&] {
      memcpy_runs(runs.data(), runs.size(), to_host ? st : host_base, to_host ? host_base : st, to_host, copy_stream);
      cuda_ok(cudaEventRecord(dma_done[half], copy_stream), "cudaEventRecord");
    };
    auto kernel = [&] {
      cuda_ok(cuda_transfer_direct(c.dev, slot_ptr, st, nullptr, sg, to_host, static_cast<int>(max_blocks),
                                   bad_index, stream),
              "staging kernel");
      cuda_ok(cudaEventRecord(kernel_done[half], stream), "cudaEventRecord");
    };
    if (to_host) {  // gather (after the DMAs that last drained this half), then DMA out
      if (it >= 2) cuda_ok(cudaStreamWaitEvent(stream, dma_done[half], 0), "cudaStreamWaitEvent");
      kernel();
      cuda_ok(cudaStreamWaitEvent(copy_stream, kernel_done[half], 0), "cudaStreamWaitEvent");
      dma();
    } else {  // DMA in (after the kernel that last read this half), then scatter
      if (it >= 2) cuda_ok(cudaStreamWaitEvent(copy_stream, kernel_done[half], 0), "cudaStreamWaitEvent");
      dma();
      cuda_ok(cudaStreamWaitEvent(stream, dma_done[half], 0), "cudaStreamWaitEvent");
      kernel();
    }
  }
  // The caller's stream completes after every DMA; the staging block then returns to the caching
  // allocator, whose reuse is ordered on the caller's stream.
  for (int h = 0; h < 2; ++h) {
    if (n_pages > h * chunk) cuda_ok(cudaStreamWaitEvent(stream, dma_done[h], 0), "cudaStreamWaitEvent");
    cudaEventDestroy(kernel_done[h]);
    cudaEventDestroy(dma_done[h]);
  }
}
#endif

}  // namespace

// method: "direct" (kernel touches host memory), "staged" (device staging + DMA), "naive" (one
// DMA/memcpy per (page, layer, kv); needs each page's slots contiguous; a baseline only) or "dma"
// (the same runs, merged where both sides continue (consecutive slots over a layer_first L2), all
// submitted in one cudaMemcpyBatchAsync on the copy engines: no kernel, no SM; for a copy process,
// whose kernels would time-slice with the compute's context).
void transfer(const std::vector<torch::Tensor>& bufs, const torch::Tensor& slots, const torch::Tensor& host,
              const torch::Tensor& pages, int64_t page_size, int64_t layer_begin, int64_t num_layers,
              int64_t num_kv, const std::vector<int64_t>& strides, int64_t num_host_pages, bool to_host,
              const std::string& method, int64_t max_blocks, int64_t num_threads, int64_t staging_bytes,
              bool check_slots, const c10::optional<torch::Tensor>& error_flag) {
  TORCH_CHECK_VALUE(method == "direct" || method == "staged" || method == "naive" || method == "dma",
                    "unknown method '", method, "' (direct, staged, naive, dma)");
  TORCH_CHECK_VALUE(max_blocks >= 1 && num_threads >= 1 && staging_bytes >= 1,
                    "max_blocks, num_threads and staging_bytes must be >= 1");
  Checked c = check_transfer(bufs, slots, host, pages, page_size, layer_begin, num_layers, num_kv, strides,
                             num_host_pages, check_slots);
  if (c.g.n_tokens == 0) return;
  const TransferGeom& g = c.g;
  if (method == "naive" || method == "dma") {
    const bool dma = method == "dma";
    auto sl = slots.cpu();
    const int64_t* s = sl.data_ptr<int64_t>();
    const int64_t* pg = pages.data_ptr<int64_t>();
    const int64_t n_pages = pages.numel(), run = page_size * g.item_bytes;
    for (int64_t j = 0; j < n_pages; ++j)
      for (int64_t t = 1; t < page_size; ++t)
        TORCH_CHECK_VALUE(s[j * page_size + t] == s[j * page_size] + t, "method='", method,
                          "' needs the slots of each page to be contiguous");
    TORCH_CHECK_VALUE(g.token_stride == g.item_bytes, "method='", method, "' needs token-contiguous host pages");
    std::vector<CopyRun> runs;
    runs.reserve(n_pages * num_layers * num_kv);
    char* hb = static_cast<char*>(host.data_ptr());
    auto add = [&](int64_t j, int64_t l, int64_t k) {
      auto d = reinterpret_cast<int64_t>(c.dev.ptr[l * num_kv + k] + s[j * page_size] * g.item_bytes);
      auto h = reinterpret_cast<int64_t>(hb + pg[j] * g.page_stride + (layer_begin + l) * g.layer_stride +
                                         k * g.kv_stride);
      CopyRun r = to_host ? CopyRun{d, h, run} : CopyRun{h, d, run};
      CopyRun* last = runs.empty() ? nullptr : &runs.back();
      if (dma && last != nullptr && last->src + last->bytes == r.src && last->dst + last->bytes == r.dst)
        last->bytes += run;  // both sides continue: one larger DMA
      else
        runs.push_back(r);
    };
    if (dma) {  // per (layer, kv), pages in order: consecutive pages can merge
      for (int64_t l = 0; l < num_layers; ++l)
        for (int64_t k = 0; k < num_kv; ++k)
          for (int64_t j = 0; j < n_pages; ++j) add(j, l, k);
    } else {
      for (int64_t j = 0; j < n_pages; ++j)
        for (int64_t l = 0; l < num_layers; ++l)
          for (int64_t k = 0; k < num_kv; ++k) add(j, l, k);
    }
    if (c.device.is_cpu()) {
      cpu_copy_runs(runs.data(), static_cast<int64_t>(runs.size()), dma ? static_cast<int>(num_threads) : 1);
      return;
    }
#ifdef L2CORE_WITH_CUDA
    c10::cuda::CUDAGuard guard(c.device);
    cudaStream_t st = c10::cuda::getCurrentCUDAStream();
    if (dma) {  // absolute addresses: null bases
      memcpy_runs(runs.data(), runs.size(), nullptr, nullptr, to_host, st);
      return;
    }
    for (const auto& r : runs)
      cuda_ok(cudaMemcpyAsync(reinterpret_cast<void*>(r.dst), reinterpret_cast<const void*>(r.src), r.bytes,
                              cudaMemcpyDefault, st),
              "cudaMemcpyAsync");
    return;
#endif
  }
  if (c.device.is_cpu()) {
    TORCH_CHECK_VALUE(slots.device().is_cpu(), "slots must be on the device buffers' device (cpu)");
    cpu_transfer(c.dev, slots.data_ptr<int64_t>(), static_cast<char*>(host.data_ptr()), pages.data_ptr<int64_t>(),
                 g, to_host, static_cast<int>(num_threads));
    return;
  }
#ifdef L2CORE_WITH_CUDA
  TORCH_CHECK_VALUE(c.device.is_cuda(), "device buffers must be CPU or CUDA tensors");
  c10::cuda::CUDAGuard guard(c.device);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  auto slots_dev = slots.to(c.device, /*non_blocking=*/true);
  int* bad_index = nullptr;  // a pinned host int the kernels set to 1 on a skipped index
  if (error_flag.has_value()) {
    const auto& f = *error_flag;
    TORCH_CHECK_VALUE(f.device().is_cpu() && f.scalar_type() == torch::kInt32 && f.numel() == 1,
                      "error_flag must be a pinned CPU int32 tensor of one element");
    bad_index = reinterpret_cast<int*>(mapped_host_ptr(f));
  }
  if (method == "staged") {
    staged_transfer(c, slots_dev, host, pages, to_host, max_blocks, staging_bytes, bad_index, stream);
    return;
  }
  char* hptr = mapped_host_ptr(host);
  auto pages_dev = pages.to(c.device, /*non_blocking=*/true);
  cuda_ok(cuda_transfer_direct(c.dev, slots_dev.data_ptr<int64_t>(), hptr, pages_dev.data_ptr<int64_t>(), g,
                               to_host, static_cast<int>(max_blocks), bad_index, stream),
          "transfer kernel");
#else
  (void)error_flag;
  TORCH_CHECK_VALUE(false, "l2core native was built without CUDA; device buffers are on ", c.device);
#endif
}

// Multi-threaded memcpy of one CPU tensor into another of the same byte size (bench baseline).
void cpu_memcpy(torch::Tensor dst, const torch::Tensor& src, int64_t num_threads) {
  TORCH_CHECK_VALUE(dst.device().is_cpu() && src.device().is_cpu(), "cpu_memcpy takes CPU tensors");
  TORCH_CHECK_VALUE(dst.is_contiguous() && src.is_contiguous(), "cpu_memcpy takes contiguous tensors");
  const int64_t nbytes = src.numel() * src.element_size();
  TORCH_CHECK_VALUE(dst.numel() * dst.element_size() == nbytes, "cpu_memcpy: sizes differ");
  CopyRun r{reinterpret_cast<int64_t>(src.data_ptr()), reinterpret_cast<int64_t>(dst.data_ptr()), nbytes};
  cpu_copy_runs(&r, 1, static_cast<int>(std::max<int64_t>(1, num_threads)));
}

// Returns and clears the CUDA runtime's last error (0 on CPU builds). A failed runtime call made
// outside torch (cudaHostRegister/Unregister through torch.cuda.cudart()) leaves it set, and
// torch's next kernel-launch check would then report it as its own failure.
int64_t cuda_clear_error() {
#ifdef L2CORE_WITH_CUDA
  return static_cast<int64_t>(cudaGetLastError());
#else
  return 0;
#endif
}

bool with_cuda() {
#ifdef L2CORE_WITH_CUDA
  return true;
#else
  return false;
#endif
}

// -- page index / ghost list (page_index.h): keys arrive as one buffer of n * key_bytes bytes ------
namespace {

namespace py = pybind11;
using Pages = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

// The keys [lo, hi) of a buffer of whole keys (hi < 0: to the end), 8-byte aligned (copied into
// `tmp` if the buffer is not).
struct Keys {
  const uint64_t* ptr = nullptr;
  int64_t n = 0;
  std::vector<uint64_t> tmp;
};

Keys keys_of_buffer(const py::buffer& buf, int64_t key_bytes, int64_t lo, int64_t hi) {
  py::buffer_info info = buf.request();
  const int64_t bytes = info.size * info.itemsize;
  if (bytes % key_bytes != 0)
    throw std::invalid_argument("a key buffer of " + std::to_string(bytes) + " bytes is not whole " +
                                std::to_string(key_bytes) + "-byte keys");
  const int64_t total = bytes / key_bytes;
  if (hi < 0 || hi > total) hi = total;
  lo = std::min(std::max<int64_t>(lo, 0), hi);
  Keys k;
  k.n = hi - lo;
  const char* p = static_cast<const char*>(info.ptr) + lo * key_bytes;
  if (reinterpret_cast<uintptr_t>(p) % 8) {
    k.tmp.resize(static_cast<size_t>(k.n * key_bytes / 8));
    std::memcpy(k.tmp.data(), p, static_cast<size_t>(k.n * key_bytes));
    k.ptr = k.tmp.data();
  } else {
    k.ptr = reinterpret_cast<const uint64_t*>(p);
  }
  return k;
}

py::array_t<int64_t> to_array(const int64_t* p, int64_t n) {
  py::array_t<int64_t> a(n);
  if (n) std::memcpy(a.mutable_data(), p, static_cast<size_t>(n) * 8);
  return a;
}

int64_t key_bytes(const PageIndex& x) { return x.key_words() * 8; }

void bind_page_index(py::module_& m) {
  py::class_<GhostSet>(m, "GhostSet", "Bounded set of 64-bit keys recently evicted (ring + hash set)")
      .def(py::init<int64_t>(), py::arg("capacity"))
      .def_property_readonly("capacity", &GhostSet::capacity)
      .def("__len__", &GhostSet::size)
      .def("__contains__", [](const GhostSet& g, uint64_t k) { return g.contains(k); })
      .def("add",
           [](GhostSet& g, const py::array_t<uint64_t, py::array::c_style | py::array::forcecast>& k) {
             g.add(k.data(), k.size(), 1);
           })
      .def("leading",
           [](const GhostSet& g, const py::array_t<uint64_t, py::array::c_style | py::array::forcecast>& k) {
             return g.leading(k.data(), k.size(), 1);
           })
      .def(
          "leading_of",
          [](const GhostSet& g, const py::buffer& buf, int64_t start, int64_t kb) {
            if (kb < 8 || kb % 8 != 0) throw std::invalid_argument("key_bytes must be a positive multiple of 8");
            Keys k = keys_of_buffer(buf, kb, start, -1);
            return g.leading(k.ptr, k.n, kb / 8);
          },
          py::arg("keys"), py::arg("start") = 0, py::arg("key_bytes") = 16)
      .def("order",
           [](const GhostSet& g) {
             py::array_t<uint64_t> a(g.size());
             g.order(a.mutable_data());
             return a;
           })
      .def("nbytes", &GhostSet::nbytes)
      .def("check", &GhostSet::check);

  py::class_<PageIndex>(m, "PageIndex", "Key -> page index of one cache tier with refs, hits and LRU")
      .def(py::init<std::string, int64_t, int64_t>(), py::arg("name"), py::arg("num_pages"),
           py::arg("key_bytes") = 16)
      .def_property_readonly("num_pages", &PageIndex::num_pages)
      .def_property_readonly("key_bytes", &key_bytes)
      .def_property_readonly("evictable", &PageIndex::evictable)
      .def_property_readonly("size", &PageIndex::size)
      .def_property_readonly("evictions", &PageIndex::evictions)
      .def(
          "lookup",
          [](const PageIndex& x, const py::buffer& buf, int64_t lo, int64_t hi) {
            Keys k = keys_of_buffer(buf, key_bytes(x), lo, hi);
            py::array_t<int64_t> out(k.n);
            x.lookup(k.ptr, k.n, out.mutable_data());
            return out;
          },
          py::arg("keys"), py::arg("lo") = 0, py::arg("hi") = -1)
      .def(
          "pin_prefix",
          [](PageIndex& x, const py::buffer& buf, int64_t lo, int64_t hi) {
            Keys k = keys_of_buffer(buf, key_bytes(x), lo, hi);
            std::vector<int64_t> out(static_cast<size_t>(k.n));
            return to_array(out.data(), x.pin_prefix(k.ptr, k.n, out.data()));
          },
          py::arg("keys"), py::arg("lo") = 0, py::arg("hi") = -1)
      .def(
          "count_hits",
          [](PageIndex& x, const py::buffer& buf, int64_t lo, int64_t hi) {
            Keys k = keys_of_buffer(buf, key_bytes(x), lo, hi);
            return x.count_hits(k.ptr, k.n);
          },
          py::arg("keys"), py::arg("lo") = 0, py::arg("hi") = -1)
      .def("hit_pages", [](PageIndex& x, const Pages& p) { x.hit_pages(p.data(), p.size()); })
      .def("pin", [](PageIndex& x, const Pages& p) { x.pin(p.data(), p.size()); })
      .def("unpin", [](PageIndex& x, const Pages& p) { x.unpin(p.data(), p.size()); })
      .def("touch", [](PageIndex& x, const Pages& p) { x.touch(p.data(), p.size()); })
      .def(
          "insert",
          [](PageIndex& x, const py::buffer& buf, int64_t lo, const Pages& p, bool pin) {
            Keys k = keys_of_buffer(buf, key_bytes(x), lo, lo + p.size());
            if (k.n != p.size())
              throw std::invalid_argument("insert: " + std::to_string(p.size()) + " pages but " + std::to_string(k.n) +
                                          " keys");
            py::array_t<int64_t> used(k.n);
            std::vector<int64_t> newly(static_cast<size_t>(k.n));
            const int64_t m = x.insert(k.ptr, p.data(), k.n, pin, used.mutable_data(), newly.data());
            return py::make_tuple(used, to_array(newly.data(), m));
          },
          py::arg("keys"), py::arg("lo"), py::arg("pages"), py::arg("pin"))
      .def(
          "evict",
          [](PageIndex& x, int64_t n, GhostSet* ghost) {
            n = std::max<int64_t>(0, std::min(n, x.evictable()));
            std::vector<int64_t> pages(static_cast<size_t>(n));
            std::string keys(static_cast<size_t>(n * key_bytes(x)), '\0');
            const int64_t k = x.evict(n, pages.data(), reinterpret_cast<uint64_t*>(keys.data()), ghost);
            return py::make_tuple(to_array(pages.data(), k), py::bytes(keys.data(), k * key_bytes(x)));
          },
          py::arg("n"), py::arg("ghost") = nullptr)
      .def("drop",
           [](PageIndex& x, const Pages& p) {
             std::string keys(static_cast<size_t>(p.size() * key_bytes(x)), '\0');
             const int64_t k = x.drop(p.data(), p.size(), reinterpret_cast<uint64_t*>(keys.data()));
             return py::bytes(keys.data(), k * key_bytes(x));
           })
      .def("keys_of",
           [](const PageIndex& x, const Pages& p) {
             x.check_pages(p.data(), p.size());
             py::list out(p.size());
             for (int64_t i = 0; i < p.size(); ++i) {
               const int64_t q = p.data()[i];
               if (x.cached_at(q))
                 out[i] = py::bytes(reinterpret_cast<const char*>(x.key_of(q)), key_bytes(x));
               else
                 out[i] = py::none();
             }
             return out;
           })
      .def("key64_of",
           [](const PageIndex& x, const Pages& p) {
             x.check_pages(p.data(), p.size());
             py::array_t<uint64_t> out(p.size());
             uint64_t* o = out.mutable_data();
             for (int64_t i = 0; i < p.size(); ++i) {
               const int64_t q = p.data()[i];
               if (!x.cached_at(q)) throw std::invalid_argument("key64_of: page " + std::to_string(q) + " is not cached");
               o[i] = x.key_of(q)[0];
             }
             return out;
           })
      .def("state",
           [](py::object self) {
             auto& x = self.cast<PageIndex&>();
             const int64_t n = x.num_pages();
             const int64_t st = PageIndex::node_bytes();  // ref and hits live in per-page records
             return py::make_tuple(py::array_t<int32_t>({n}, {st}, x.ref(), self),
                                   py::array(py::dtype("bool"), {n}, {int64_t{1}}, x.cached(), self),
                                   py::array_t<int32_t>({n}, {st}, x.hits(), self));
           })
      .def("lru",
           [](const PageIndex& x) {
             py::array_t<int64_t> a(x.evictable());
             x.lru(a.mutable_data());
             return a;
           })
      .def("nbytes", &PageIndex::nbytes)
      .def("check", &PageIndex::check);

  m.def(
      "keys_distinct",
      [](const py::buffer& buf, int64_t kb) {
        if (kb < 8 || kb % 8 != 0) throw std::invalid_argument("key_bytes must be a positive multiple of 8");
        Keys k = keys_of_buffer(buf, kb, 0, -1);
        return keys_distinct(k.ptr, k.n, kb / 8);
      },
      py::arg("keys"), py::arg("key_bytes") = 16);
}

}  // namespace
}  // namespace l2core

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "l2core native kernels: batched page gather/scatter (CPU + CUDA)";
  m.def("transfer", &l2core::transfer, "Gather/scatter token items between per-layer buffers and host pages",
        py::call_guard<py::gil_scoped_release>());
  m.def("cpu_memcpy", &l2core::cpu_memcpy, "Multi-threaded memcpy (benchmark baseline)",
        py::call_guard<py::gil_scoped_release>());
  m.def("with_cuda", &l2core::with_cuda);
  m.def("cuda_clear_error", &l2core::cuda_clear_error, "Return and clear the CUDA runtime's last error");
  m.def("max_buffers", [] { return l2core::kMaxBuffers; });
  // TP-shared pool readiness (l2core.shm): the generation words are plain stores/loads in a shared
  // mapping, ordered against the page bytes by these fences (x86-64: compiler barriers only; aarch64: dmb).
  m.def("fence_release", [] { std::atomic_thread_fence(std::memory_order_release); },
        "Order this thread's earlier loads/stores before its later stores");
  m.def("fence_acquire", [] { std::atomic_thread_fence(std::memory_order_acquire); },
        "Order this thread's earlier loads before its later loads/stores");
  l2core::bind_page_index(m);
}
