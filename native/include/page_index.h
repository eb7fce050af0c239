// Torch-free page index of one cache tier and the ghost list of recently evicted keys.
//
// PageIndex maps 16-byte keys (the page hashes) to the page ids of one tier of `num_pages` pages
// and keeps per page, in one 32-byte record: the key, a reference count (pins), a hit count and
// its links in the LRU order of the evictable pages (cached, no pins), an intrusive doubly linked
// list over page ids (O(1) per move); whether it is indexed ("cached") is a byte array. The map
// compares the whole key: two keys that share their first 8 bytes are two entries. It is an
// open-addressing table of (32 bits of the key's hash, page) slots with linear probing and
// backward-shift deletion (no tombstones), at most half full since a page holds at most one key.
// Batch calls hash their keys first and prefetch table lines and records a few keys ahead.
//
// GhostSet is a bounded set of 64-bit keys: a ring (the order: the oldest entry leaves when a
// new one arrives) and an open-addressing set of the same keys (the membership).
//
// Neither is thread-safe: the caller serialises calls (the cache controller holds its lock).
// Bad arguments throw std::invalid_argument / std::out_of_range before anything is changed;
// a broken invariant found by check() throws std::logic_error.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace l2core {

class GhostSet {
 public:
  explicit GhostSet(int64_t capacity);
  int64_t capacity() const { return cap_; }
  int64_t size() const { return size_; }
  bool contains(uint64_t k) const;
  // Remember keys[0], keys[stride], ... (newest last): the keys not present, once each, of
  // which the newest `capacity` stay; present keys keep their place.
  void add(const uint64_t* keys, int64_t n, int64_t stride);
  // Length of the leading run of keys[0], keys[stride], ... present.
  int64_t leading(const uint64_t* keys, int64_t n, int64_t stride) const;
  void order(uint64_t* out) const;  // the size() entries, oldest first
  int64_t nbytes() const;
  void check() const;

 private:
  bool contains(uint64_t k, uint64_t h) const;  // h: the key's hash
  void set_insert(uint64_t k, uint64_t h);
  void set_erase(uint64_t k, uint64_t h);
  int64_t cap_, size_ = 0, head_ = 0;  // head_: the slot the next entry goes to
  std::vector<uint64_t> ring_;
  std::vector<uint64_t> table_;  // 0 = empty; the key 0 lives in has_zero_
  uint64_t mask_ = 0;
  bool has_zero_ = false;
  std::vector<uint64_t> h_, fresh_, fh_, oh_, seen_;  // add()'s scratch (kept: no allocations per call)
};

class PageIndex {
 public:
  PageIndex(std::string name, int64_t num_pages, int64_t key_bytes);

  int64_t num_pages() const { return n_; }
  int64_t key_words() const { return kw_; }
  const std::string& name() const { return name_; }

  // Page of each of n keys (-1 where absent) into out; returns how many were found.
  int64_t lookup(const uint64_t* keys, int64_t n, int64_t* out) const;
  // Leading run of the n keys present: their pages into out, each pinned once; returns its length.
  int64_t pin_prefix(const uint64_t* keys, int64_t n, int64_t* out);
  // Every present key's page: hit count + 1, and used now (LRU); returns how many were present.
  int64_t count_hits(const uint64_t* keys, int64_t n);

  // count_hits() for pages already looked up: the cached ones among `pages`
  void hit_pages(const int64_t* pages, int64_t n);

  void pin(const int64_t* pages, int64_t n);
  void unpin(const int64_t* pages, int64_t n);  // out_of_range... / logic_error below zero
  void touch(const int64_t* pages, int64_t n);  // the evictable ones become the youngest, in order

  // Index pages[i] under keys[i] where the key is absent (those pages must not be cached);
  // present keys keep their page, which counts as used. used[i] = the page now indexed for
  // key i; the pages newly indexed go to newly[0:returned]. With `pin` they get one reference
  // (no LRU entry), otherwise they become the youngest evictable pages.
  int64_t insert(const uint64_t* keys, const int64_t* pages, int64_t n, bool pin, int64_t* used,
                 int64_t* newly);
  // Up to n evictable pages, least recently used first, removed from the index: pages and
  // keys into the outputs (room for n each), their first key words added to `ghost` if given.
  int64_t evict(int64_t n, int64_t* out_pages, uint64_t* out_keys, GhostSet* ghost);
  // Remove the cached ones of `pages` from the index (not freed); their keys into out_keys
  // (room for n), in order; returns how many.
  int64_t drop(const int64_t* pages, int64_t n, uint64_t* out_keys);

  const uint64_t* key_of(int64_t page) const { return node_[static_cast<size_t>(page)].key; }
  bool cached_at(int64_t page) const { return cached_[static_cast<size_t>(page)] != 0; }
  // per-page state for strided views (stride node_bytes())
  int32_t* ref() { return &node_[0].ref; }
  uint8_t* cached() { return cached_.data(); }
  int32_t* hits() { return &node_[0].hits; }
  static constexpr int64_t node_bytes() { return sizeof(Node); }
  int64_t evictable() const { return nev_; }
  int64_t size() const { return size_; }
  int64_t evictions() const { return evictions_; }
  void lru(int64_t* out) const;  // the evictable() pages, oldest first
  int64_t nbytes() const;
  void check() const;
  void check_pages(const int64_t* pages, int64_t n) const;  // out_of_range unless all in [0, n)

 private:
  uint64_t hash(const uint64_t* key) const;
  bool same(const uint64_t* a, const uint64_t* b) const;
  int64_t find(const uint64_t* key, uint64_t h) const;  // page or -1
  void map_insert(int64_t page, uint64_t h);
  void map_erase(int64_t page, uint64_t h);
  void prepare(const uint64_t* keys, int64_t n) const;  // hashes into hs_, the first lines prefetched
  void ahead(int64_t i, int64_t n) const;  // at step i of a pass over hs_: prefetch for later steps
  void lru_push(int64_t p);    // at the young end (p not in the list)
  void lru_remove(int64_t p);  // p in the list
  void unindex(int64_t p, uint64_t h);

  struct Slot {
    uint32_t tag;  // low 32 bits of the key's hash (home slot = tag & mask)
    int32_t page;  // -1: empty
  };
  std::string name_;
  int64_t n_, kw_;
  std::vector<Slot> table_;
  uint64_t mask_;
  // per page, one 32-byte record (the fields a step touches share a cache line): its key (valid
  // while cached), LRU links, reference and hit counts
  struct Node {
    uint64_t key[2];
    int32_t prev, next, ref, hits;
  };
  std::vector<Node> node_;
  std::vector<uint8_t> cached_, inl_;  // inl_: in the LRU list
  int32_t head_ = -1, tail_ = -1;      // oldest / youngest evictable page
  int64_t nev_ = 0, size_ = 0, evictions_ = 0;
  mutable std::vector<uint64_t> hs_;  // scratch: the hashes of the keys of the current call
};

// True when the n keys of `words` 64-bit words each are pairwise different.
bool keys_distinct(const uint64_t* keys, int64_t n, int64_t words);

}  // namespace l2core
