// What the native hash tables (page_index.cpp, kv_index.cpp) share: the hash finaliser and the
// software prefetch of batched probes.
#pragma once

#include <cstdint>

namespace l2core {

// splitmix64's finaliser: every input bit reaches every output bit.
inline uint64_t mix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

inline void prefetch(const void* p) {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(p);
#else
  (void)p;
#endif
}

constexpr int64_t kAhead = 16;  // keys between a batch's prefetch and its probe

}  // namespace l2core
