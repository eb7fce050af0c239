// Torch-free global KV index: 64-bit page key -> which instances hold the page in L1, in L2, and
// whether the shared pool (L3) is believed to hold it.
//
// One open-addressing table (linear probing, backward-shift deletion, no tombstones) of fixed
// `slots` = capacity / 0.8 entries (range-reduced, not a power of two). Each slot is a run of
// 2 + 2W uint64 words: the key (0 = empty), the L3 stamp (0 = not in the pool; else the
// generation of the last L3 store event), then W words of the L1 instance mask and W words of the
// L2 mask (W = ceil(max_instances / 64)); at W = 1 a slot is 32 bytes. An entry exists while any
// bit or the stamp is set; when `capacity` entries exist a new key is refused (counted, the page
// simply goes unindexed: answers undercount, never invent hits).
//
// apply(): one call per event batch (ops of one instance: tier, set/clear, key count; keys
// concatenated). query(): one call per request: running ANDs of the masks along the request give
// each instance's cumulative L1 / L1+L2 / L1+L2+pool prefix and the pool's own prefix.
// clear_instance() and expire_pool() sweep the table; each sweeps a range of slots, so a caller
// can sweep in parts and let queries and other changes in between (l3pool/index/table.py): parts in
// order from slot 0 to slots(), no other sweep between them, give the same table as one whole sweep.
// Between the parts apply() may run if erases are deferred (defer_erases(true) before the first
// part, defer_erases(false) after the last, then erase_deferred()): the only thing that moves an entry is erase()'s
// backward shift, which could carry a not yet swept entry behind the sweep; an insertion takes the
// first empty slot of its probe run and moves nothing, clearing a bit moves nothing. A deferred
// entry keeps its key and its slot with no bit and no stamp (answered as absent; a store of its key
// takes it back) until erase_deferred() erases those still empty. Queries between parts see a
// consistent table (counts included) part way through the change.
// Not thread-safe: the caller serialises calls.
#pragma once
#include <cstdint>
#include <vector>

namespace l2core {

class KvIndex {
 public:
  KvIndex(int64_t capacity, int64_t max_instances);
  int64_t capacity() const { return cap_; }
  int64_t max_instances() const { return 64 * W_; }
  int64_t slots() const { return static_cast<int64_t>(slots_); }
  int64_t size() const { return size_; }
  int64_t rejected() const { return rejected_; }
  // ops: n_ops triples (tier 0 = L1, 1 = L2, 2 = pool; set 0/1; count); keys: sum(count) keys.
  // Each key is xor'ed with `salt` (the namespace). Pool sets write `stamp` (> 0). Returns the
  // number of keys refused because the table was full.
  int64_t apply(int64_t inst, const int64_t* ops, int64_t n_ops, const uint64_t* keys, int64_t n_keys,
                uint64_t salt, uint64_t stamp);
  // Clear the instance's bits in the tiers of `tier_mask` (bit 0: L1, bit 1: L2) in slots
  // [begin, min(end, slots())) (the whole table by default); returns how many of its bits in those
  // tiers remain in the table (0: nothing left to sweep). Writes only the entries holding a bit.
  int64_t clear_instance(int64_t inst, int tier_mask, uint64_t begin = 0, uint64_t end = UINT64_MAX);
  // Drop pool stamps < `min_stamp` (all of them with UINT64_MAX) in slots [begin, min(end, slots()));
  // returns how many were dropped.
  int64_t expire_pool(uint64_t min_stamp, uint64_t begin = 0, uint64_t end = UINT64_MAX);
  // on: apply() no longer erases the entries its removals empty (they stay, empty, in their slots:
  // they count in size(), so a full table refuses a new key meanwhile), it remembers their keys;
  // off: apply() erases again. The sweep's own erases are not deferred.
  void defer_erases(bool on) { deferring_ = on; }
  // Erase the entries of up to `n` remembered keys (the last remembered first) that are still
  // empty (not stored again meanwhile); returns how many were erased. deferred(): keys left.
  int64_t erase_deferred(int64_t n);
  int64_t deferred() const { return static_cast<int64_t>(deferred_.size()); }
  // Per live instance (bit set in live[W]) its L1, L2 and L3 prefix (out arrays of max_instances);
  // returns the pool's own prefix. A pool stamp < min_stamp counts as absent.
  int64_t query(const uint64_t* keys, int64_t n, uint64_t salt, uint64_t min_stamp, const uint64_t* live,
                int32_t* l1, int32_t* l2, int32_t* l3) const;
  // Entries per instance per tier (2 * max_instances: L1 then L2) and pool entries.
  const int64_t* counts() const { return counts_.data(); }
  int64_t pool_count() const { return pool_count_; }
  int64_t nbytes() const;
  void check() const;

 private:
  uint64_t home(uint64_t k) const;
  int64_t find(uint64_t k) const;  // slot or -1
  void erase(uint64_t i);
  bool empty_entry(const uint64_t* e) const;
  uint64_t* at(uint64_t i) { return table_.data() + i * stride_; }
  const uint64_t* at(uint64_t i) const { return table_.data() + i * stride_; }

  int64_t cap_;
  int64_t W_;
  uint64_t stride_;
  uint64_t slots_;
  int64_t size_ = 0;
  int64_t rejected_ = 0;
  int64_t pool_count_ = 0;
  bool deferring_ = false;
  std::vector<uint64_t> deferred_;  // keys of the entries apply() emptied while deferring
  std::vector<uint64_t> table_;
  std::vector<int64_t> counts_;
};

}  // namespace l2core
