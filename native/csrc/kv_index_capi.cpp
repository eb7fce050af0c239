// A plain C ABI over KvIndex (include/kv_index.h), for the torch-free index: compiled with
// kv_index.cpp alone into a shared library that l3pool/index/native.py builds at first use and
// loads with ctypes (no Python headers, no torch, no pybind11). Its Python half declares these
// signatures; KVX_ABI changes whenever one of them does, and the loader refuses a library whose
// kvx_abi() differs.
//
// No C++ exception crosses this boundary: every call that can fail takes a kvx_error, returns 0 on
// success and -1 on failure with the error's kind (KVX_VALUE: bad argument, KVX_INDEX: instance
// slot out of range, KVX_STATE: a broken table found by check(), KVX_MEMORY: allocation failed,
// KVX_OTHER) and message set. Counts are checked here as they are in KvIndex itself (apply()
// checks each op's count against the keys left); the caller passes every buffer's length.
#include "kv_index.h"

#include <cstdio>
#include <cstring>
#include <exception>
#include <new>
#include <stdexcept>
#include <string>

#define KVX_ABI 1
#define KVX_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

enum { KVX_OK = 0, KVX_VALUE = 1, KVX_INDEX = 2, KVX_STATE = 3, KVX_MEMORY = 4, KVX_OTHER = 5 };

struct kvx_error {
  int32_t kind;
  char message[500];
};

void set_error(kvx_error* err, int32_t kind, const char* what) {
  if (!err) return;
  err->kind = kind;
  std::snprintf(err->message, sizeof(err->message), "%s", what);
}

// Runs f(); maps what it throws onto err. Returns 0 or -1.
template <class F>
int32_t guarded(kvx_error* err, F&& f) {
  try {
    f();
    return 0;
  } catch (const std::invalid_argument& e) {
    set_error(err, KVX_VALUE, e.what());
  } catch (const std::out_of_range& e) {
    set_error(err, KVX_INDEX, e.what());
  } catch (const std::logic_error& e) {
    set_error(err, KVX_STATE, e.what());
  } catch (const std::bad_alloc&) {
    set_error(err, KVX_MEMORY, "out of memory");
  } catch (const std::exception& e) {
    set_error(err, KVX_OTHER, e.what());
  } catch (...) {
    set_error(err, KVX_OTHER, "unknown C++ exception");
  }
  return -1;
}

using l2core::KvIndex;

}  // namespace

KVX_EXPORT int32_t kvx_abi() { return KVX_ABI; }

KVX_EXPORT int32_t kvx_new(int64_t capacity, int64_t max_instances, void** out, kvx_error* err) {
  *out = nullptr;
  return guarded(err, [&] { *out = new KvIndex(capacity, max_instances); });
}

KVX_EXPORT void kvx_free(void* x) { delete static_cast<KvIndex*>(x); }

// capacity, max_instances, slots, size, rejected, pool_count, deferred, nbytes
KVX_EXPORT void kvx_info(const void* p, int64_t* out) {
  const KvIndex& x = *static_cast<const KvIndex*>(p);
  out[0] = x.capacity();
  out[1] = x.max_instances();
  out[2] = x.slots();
  out[3] = x.size();
  out[4] = x.rejected();
  out[5] = x.pool_count();
  out[6] = x.deferred();
  out[7] = x.nbytes();
}

KVX_EXPORT int32_t kvx_apply(void* p, int64_t inst, const int64_t* ops, int64_t n_ops, const uint64_t* keys,
                             int64_t n_keys, uint64_t salt, uint64_t stamp, int64_t* refused, kvx_error* err) {
  return guarded(err, [&] { *refused = static_cast<KvIndex*>(p)->apply(inst, ops, n_ops, keys, n_keys, salt, stamp); });
}

KVX_EXPORT int32_t kvx_clear_instance(void* p, int64_t inst, int32_t tier_mask, uint64_t begin, uint64_t end,
                                      int64_t* left, kvx_error* err) {
  return guarded(err, [&] { *left = static_cast<KvIndex*>(p)->clear_instance(inst, tier_mask, begin, end); });
}

KVX_EXPORT int64_t kvx_expire_pool(void* p, uint64_t min_stamp, uint64_t begin, uint64_t end) {
  return static_cast<KvIndex*>(p)->expire_pool(min_stamp, begin, end);
}

// live: n_live words (must be max_instances / 64); l1, l2, l3: max_instances int32 each.
KVX_EXPORT int32_t kvx_query(const void* p, const uint64_t* keys, int64_t n, uint64_t salt, uint64_t min_stamp,
                             const uint64_t* live, int64_t n_live, int32_t* l1, int32_t* l2, int32_t* l3,
                             int64_t* pool, kvx_error* err) {
  return guarded(err, [&] {
    const KvIndex& x = *static_cast<const KvIndex*>(p);
    if (n < 0) throw std::invalid_argument("negative key count");
    if (n_live != x.max_instances() / 64)
      throw std::invalid_argument("live must hold " + std::to_string(x.max_instances() / 64) + " uint64 words");
    *pool = x.query(keys, n, salt, min_stamp, live, l1, l2, l3);
  });
}

// out: 2 * max_instances int64 (L1 counts, then L2)
KVX_EXPORT void kvx_counts(const void* p, int64_t* out) {
  const KvIndex& x = *static_cast<const KvIndex*>(p);
  std::memcpy(out, x.counts(), static_cast<size_t>(2 * x.max_instances()) * sizeof(int64_t));
}

KVX_EXPORT void kvx_defer_erases(void* p, int32_t on) { static_cast<KvIndex*>(p)->defer_erases(on != 0); }

KVX_EXPORT int32_t kvx_erase_deferred(void* p, int64_t n, int64_t* erased, kvx_error* err) {
  return guarded(err, [&] { *erased = static_cast<KvIndex*>(p)->erase_deferred(n); });
}

KVX_EXPORT int32_t kvx_check(const void* p, kvx_error* err) {
  return guarded(err, [&] { static_cast<const KvIndex*>(p)->check(); });
}
