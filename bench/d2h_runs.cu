// bench/d2h_runs.cu: the H200 platform limit for layer_first-style D2H (many ~74-131 KB runs). Standalone:
//   nvcc -O2 -std=c++17 -arch=sm_90 -o d2h_runs bench/d2h_runs.cu && ./d2h_runs RUN_BYTES N_RUNS
// Times one contiguous memcpy (the raw baseline of bench.transfer) against the same bytes as N runs of
// RUN_BYTES to random / sorted / contiguous pinned host slots via cudaMemcpyBatchAsync, a per-copy loop,
// an SM copy kernel (16/32/132 blocks), and SM + DMA hybrids. Results: bench/results/2026-12-01-h200-d2h-runs.txt
#include <cuda_runtime.h>
#include <sys/mman.h>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <random>
#include <algorithm>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1);} } while (0)

__global__ void sm_copy(char* const* dsts, const char* const* srcs, size_t run, int n) {
  // one block per run at a time, 16-byte vector stores
  for (int r = blockIdx.x; r < n; r += gridDim.x) {
    const int4* s = reinterpret_cast<const int4*>(srcs[r]);
    int4* d = reinterpret_cast<int4*>(dsts[r]);
    size_t m = run / 16;
    for (size_t i = threadIdx.x; i < m; i += blockDim.x) d[i] = s[i];
  }
}

int main(int argc, char** argv) {
  size_t run = argc > 1 ? atol(argv[1]) : 73728;
  int n = argc > 2 ? atoi(argv[2]) : 40000;
  size_t slots = n * 3 / 2;
  size_t hbytes = slots * run, dbytes = (size_t)n * run;
  char* h = (char*)mmap(nullptr, hbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  madvise(h, hbytes, MADV_HUGEPAGE);
  for (size_t i = 0; i < hbytes; i += 4096) h[i] = 1;
  CK(cudaHostRegister(h, hbytes, cudaHostRegisterMapped));
  char* hd; CK(cudaHostGetDevicePointer((void**)&hd, h, 0));
  char* d; CK(cudaMalloc(&d, dbytes)); CK(cudaMemset(d, 3, dbytes));
  std::vector<size_t> perm(slots); for (size_t i = 0; i < slots; ++i) perm[i] = i;
  std::mt19937 rng(1); std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<void*> dsts(n), dsts_dev(n); std::vector<const void*> srcs(n); std::vector<size_t> sizes(n, run);
  for (int i = 0; i < n; ++i) { dsts[i] = h + perm[i] * run; dsts_dev[i] = hd + perm[i] * run; srcs[i] = d + (size_t)i * run; }
  char **kd, **ks; CK(cudaMalloc(&kd, n * sizeof(void*))); CK(cudaMalloc(&ks, n * sizeof(void*)));
  CK(cudaMemcpy(kd, dsts_dev.data(), n * sizeof(void*), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(ks, srcs.data(), n * sizeof(void*), cudaMemcpyHostToDevice));
  cudaStream_t s1, s2; CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking)); CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  auto batch = [&](int lo, int hi, unsigned flags, cudaStream_t s) {
    cudaMemcpyAttributes attr{}; attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream; attr.flags = flags; size_t idx = 0;
    CK(cudaMemcpyBatchAsync(dsts.data() + lo, srcs.data() + lo, sizes.data() + lo, hi - lo, &attr, &idx, 1, s));
  };
  auto timeit = [&](const char* name, auto fn) {
    for (int w = 0; w < 2; ++w) fn();
    CK(cudaDeviceSynchronize());
    float best = 1e9;
    for (int it = 0; it < 5; ++it) {
      CK(cudaEventRecord(a, s1)); CK(cudaStreamWaitEvent(s2, a, 0));
      fn();
      cudaEvent_t c; cudaEventCreate(&c); CK(cudaEventRecord(c, s2)); CK(cudaStreamWaitEvent(s1, c, 0));
      CK(cudaEventRecord(b, s1)); CK(cudaEventSynchronize(b));
      float ms; cudaEventElapsedTime(&ms, a, b); best = std::min(best, ms); cudaEventDestroy(c);
    }
    printf("%-40s %7.2f GB/s\n", name, dbytes / best / 1e6);
  };
  timeit("raw one memcpy", [&] { CK(cudaMemcpyAsync(h, d, dbytes, cudaMemcpyDeviceToHost, s1)); });
  timeit("batch flags=overlap", [&] { batch(0, n, cudaMemcpyFlagPreferOverlapWithCompute, s1); });
  timeit("batch flags=0", [&] { batch(0, n, 0, s1); });
  timeit("batch chunks of 5000", [&] { for (int i = 0; i < n; i += 5000) batch(i, std::min(n, i + 5000), cudaMemcpyFlagPreferOverlapWithCompute, s1); });
  timeit("batch 2 streams", [&] { batch(0, n / 2, 1, s1); batch(n / 2, n, 1, s2); });
  timeit("per-copy loop", [&] { for (int i = 0; i < n; ++i) CK(cudaMemcpyAsync(dsts[i], srcs[i], run, cudaMemcpyDeviceToHost, s1)); });
  for (int blocks : {16, 32, 132}) {
    char nm[64]; snprintf(nm, 64, "sm kernel %d blocks", blocks);
    timeit(nm, [&] { sm_copy<<<blocks, 1024, 0, s1>>>(kd, ks, run, n); });
  }
  for (double f : {0.2, 0.35, 0.5, 0.65}) {
    int k = (int)(n * f);
    char nm[64]; snprintf(nm, 64, "hybrid sm16 %.2f + batch", f);
    timeit(nm, [&] { sm_copy<<<16, 1024, 0, s1>>>(kd, ks, run, k); batch(k, n, 1, s2); });
  }
  // same runs, host destinations in ascending address order (gaps stay)
  std::vector<size_t> first(perm.begin(), perm.begin() + n); std::sort(first.begin(), first.end());
  for (int i = 0; i < n; ++i) { dsts[i] = h + first[i] * run; dsts_dev[i] = hd + first[i] * run; }
  CK(cudaMemcpy(kd, dsts_dev.data(), n * sizeof(void*), cudaMemcpyHostToDevice));
  timeit("sorted: batch", [&] { batch(0, n, 1, s1); });
  timeit("sorted: sm kernel 16 blocks", [&] { sm_copy<<<16, 1024, 0, s1>>>(kd, ks, run, n); });
  // fully contiguous destinations, still as runs
  for (int i = 0; i < n; ++i) { dsts[i] = h + (size_t)i * run; dsts_dev[i] = hd + (size_t)i * run; }
  CK(cudaMemcpy(kd, dsts_dev.data(), n * sizeof(void*), cudaMemcpyHostToDevice));
  timeit("contiguous: batch", [&] { batch(0, n, 1, s1); });
  timeit("contiguous: sm kernel 16 blocks", [&] { sm_copy<<<16, 1024, 0, s1>>>(kd, ks, run, n); });
  return 0;
}
