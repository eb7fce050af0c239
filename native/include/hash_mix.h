// The 64-bit hash finaliser shared by the native tables (page_index.cpp, kv_index.cpp).
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

}  // namespace l2core
