// PageIndex and GhostSet (see include/page_index.h). Torch-free; the binding converts the
// arguments in bindings.cpp.
#include "page_index.h"
#include "hash_table.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace l2core {
namespace {

uint64_t table_size(int64_t entries) {  // a power of two >= 2 * entries (load <= 1/2), >= 16
  uint64_t s = 16;
  while (s < 2 * static_cast<uint64_t>(entries)) s <<= 1;
  return s;
}

// Is slot j's entry (home slot k) allowed to move back into the hole at i? (linear probing)
inline bool movable(uint64_t i, uint64_t j, uint64_t k) {
  return i <= j ? (k <= i || k > j) : (k <= i && k > j);
}

}  // namespace

// -- GhostSet -------------------------------------------------------------------------------------
GhostSet::GhostSet(int64_t capacity) : cap_(capacity) {
  if (capacity < 0) throw std::invalid_argument("ghost list capacity must be >= 0");
  ring_.assign(static_cast<size_t>(capacity), 0);
  if (capacity > 0) {
    table_.assign(table_size(capacity), 0);
    mask_ = table_.size() - 1;
  }
}

bool GhostSet::contains(uint64_t k) const { return table_.empty() ? false : contains(k, mix(k)); }

bool GhostSet::contains(uint64_t k, uint64_t h) const {
  if (k == 0) return has_zero_;
  for (uint64_t i = h & mask_;; i = (i + 1) & mask_) {
    if (table_[i] == k) return true;
    if (table_[i] == 0) return false;
  }
}

void GhostSet::set_insert(uint64_t k, uint64_t h) {
  if (k == 0) {
    has_zero_ = true;
    return;
  }
  uint64_t i = h & mask_;
  while (table_[i] != 0) i = (i + 1) & mask_;
  table_[i] = k;
}

void GhostSet::set_erase(uint64_t k, uint64_t h) {
  if (k == 0) {
    has_zero_ = false;
    return;
  }
  uint64_t i = h & mask_;
  while (table_[i] != k) {
    if (table_[i] == 0) return;
    i = (i + 1) & mask_;
  }
  for (uint64_t j = i;;) {  // backward-shift deletion
    j = (j + 1) & mask_;
    if (table_[j] == 0) break;
    if (movable(i, j, mix(table_[j]) & mask_)) {
      table_[i] = table_[j];
      i = j;
    }
  }
  table_[i] = 0;
}

void GhostSet::add(const uint64_t* keys, int64_t n, int64_t stride) {
  if (cap_ == 0 || n <= 0) return;
  // The table lines are prefetched kAhead keys before their probe: enough misses in flight to
  // overlap their latency, few enough that the prefetches are not dropped.
  // 1. the keys not present (their hashes kept beside them)
  auto& h = h_;
  auto& fresh = fresh_;
  auto& fh = fh_;
  h.resize(static_cast<size_t>(n));
  fresh.clear();
  fh.clear();
  for (int64_t i = 0; i < n; ++i) h[static_cast<size_t>(i)] = mix(keys[i * stride]);
  for (int64_t i = 0; i < std::min(n, kAhead); ++i) prefetch(&table_[h[static_cast<size_t>(i)] & mask_]);
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n) prefetch(&table_[h[static_cast<size_t>(i + kAhead)] & mask_]);
    const uint64_t k = keys[i * stride];
    if (!contains(k, h[static_cast<size_t>(i)])) {
      fresh.push_back(k);
      fh.push_back(h[static_cast<size_t>(i)]);
    }
  }
  // 2. repeats within the batch dropped (the first occurrence stays): a small local set
  if (fresh.size() > 1) {
    auto& seen = seen_;
    seen.assign(table_size(static_cast<int64_t>(fresh.size())), 0);
    const uint64_t sm = seen.size() - 1;
    bool zero = false;
    size_t w = 0;
    for (size_t r = 0; r < fresh.size(); ++r) {
      const uint64_t k = fresh[r];
      bool dup = false;
      if (k == 0) {
        dup = zero;
        zero = true;
      } else {
        uint64_t i = fh[r] & sm;
        while (seen[i] != 0 && seen[i] != k) i = (i + 1) & sm;
        dup = seen[i] == k;
        seen[i] = k;
      }
      if (!dup) {
        fresh[w] = k;
        fh[w++] = fh[r];
      }
    }
    fresh.resize(w);
    fh.resize(w);
  }
  // 3. into the ring, newest last (only the newest cap_ can stay); each one that arrives at a
  // full ring pushes the oldest out of the set
  const int64_t m = static_cast<int64_t>(fresh.size());
  const int64_t first = std::max<int64_t>(0, m - cap_);
  const int64_t leave = std::max<int64_t>(0, size_ + (m - first) - cap_);
  auto& oh = oh_;  // hashes of the entries that leave, oldest first
  oh.resize(static_cast<size_t>(leave));
  int64_t at = (head_ + cap_ - size_) % cap_;  // the first one leaves once the ring is full
  for (int64_t i = 0; i < leave; ++i) {
    oh[static_cast<size_t>(i)] = mix(ring_[static_cast<size_t>(at)]);
    at = at + 1 == cap_ ? 0 : at + 1;
  }
  // the leavers go first, then the new keys arrive (the ring slots they take are those the
  // leavers held): two passes, each with its own prefetch window
  for (int64_t o = 0; o < std::min(leave, kAhead); ++o) prefetch(&table_[oh[static_cast<size_t>(o)] & mask_]);
  at = (head_ + cap_ - size_) % cap_;
  for (int64_t o = 0; o < leave; ++o) {
    if (o + kAhead < leave) prefetch(&table_[oh[static_cast<size_t>(o + kAhead)] & mask_]);
    set_erase(ring_[static_cast<size_t>(at)], oh[static_cast<size_t>(o)]);
    at = at + 1 == cap_ ? 0 : at + 1;
  }
  for (int64_t j = first; j < std::min(m, first + kAhead); ++j) prefetch(&table_[fh[static_cast<size_t>(j)] & mask_]);
  for (int64_t i = first; i < m; ++i) {
    if (i + kAhead < m) prefetch(&table_[fh[static_cast<size_t>(i + kAhead)] & mask_]);
    ring_[static_cast<size_t>(head_)] = fresh[static_cast<size_t>(i)];
    set_insert(fresh[static_cast<size_t>(i)], fh[static_cast<size_t>(i)]);
    head_ = head_ + 1 == cap_ ? 0 : head_ + 1;
  }
  size_ = std::min(cap_, size_ + (m - first));
}

int64_t GhostSet::leading(const uint64_t* keys, int64_t n, int64_t stride) const {
  if (size_ == 0) return 0;
  for (int64_t i = 0; i < n; ++i)
    if (!contains(keys[i * stride])) return i;
  return n;
}

void GhostSet::order(uint64_t* out) const {
  for (int64_t i = 0; i < size_; ++i) out[i] = ring_[static_cast<size_t>((head_ - size_ + i + cap_) % cap_)];
}

int64_t GhostSet::nbytes() const {
  const size_t scratch = h_.capacity() + fresh_.capacity() + fh_.capacity() + oh_.capacity() + seen_.capacity();
  return static_cast<int64_t>(sizeof(*this) + (ring_.capacity() + table_.capacity() + scratch) * sizeof(uint64_t));
}

void GhostSet::check() const {
  int64_t in_table = has_zero_ ? 1 : 0;
  for (uint64_t k : table_) in_table += k != 0;
  if (in_table != size_) throw std::logic_error("ghost list: set and ring differ in size");
  for (int64_t i = 0; i < size_; ++i)
    if (!contains(ring_[static_cast<size_t>((head_ - size_ + i + cap_) % cap_)]))
      throw std::logic_error("ghost list: a ring entry is missing from the set");
}

// -- PageIndex ------------------------------------------------------------------------------------
PageIndex::PageIndex(std::string name, int64_t num_pages, int64_t key_bytes)
    : name_(std::move(name)), n_(num_pages), kw_(key_bytes / 8) {
  if (num_pages < 1 || num_pages > INT32_MAX) throw std::invalid_argument("num_pages must be in [1, 2^31)");
  if (key_bytes != 16) throw std::invalid_argument("key_bytes must be 16 (the page hashes)");
  table_.assign(table_size(num_pages), Slot{0, -1});
  mask_ = table_.size() - 1;
  const auto n = static_cast<size_t>(num_pages);
  node_.assign(n, Node{{0, 0}, -1, -1, 0, 0});
  cached_.assign(n, 0);
  inl_.assign(n, 0);
}

uint64_t PageIndex::hash(const uint64_t* key) const { return mix(mix(0x9e3779b97f4a7c15ULL ^ key[0]) ^ key[1]); }

bool PageIndex::same(const uint64_t* a, const uint64_t* b) const { return a[0] == b[0] && a[1] == b[1]; }

int64_t PageIndex::find(const uint64_t* key, uint64_t h) const {
  const auto tag = static_cast<uint32_t>(h);
  for (uint64_t i = tag & mask_;; i = (i + 1) & mask_) {
    const Slot s = table_[i];
    if (s.page < 0) return -1;
    if (s.tag == tag && same(key_of(s.page), key)) return s.page;
  }
}

void PageIndex::map_insert(int64_t page, uint64_t h) {
  const auto tag = static_cast<uint32_t>(h);
  uint64_t i = tag & mask_;
  while (table_[i].page >= 0) i = (i + 1) & mask_;
  table_[i] = Slot{tag, static_cast<int32_t>(page)};
}

void PageIndex::prepare(const uint64_t* keys, int64_t n) const {
  hs_.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) hs_[static_cast<size_t>(i)] = hash(keys + i * kw_);
  for (int64_t i = 0; i < std::min(n, kAhead); ++i) ahead(i - kAhead, n);
}

void PageIndex::ahead(int64_t i, int64_t n) const {
  // the table line of key i + kAhead now; the record of the page in key i + kAhead / 2's home
  // slot (its line was fetched kAhead / 2 steps ago) for the key comparison
  if (i + kAhead < n) prefetch(&table_[hs_[static_cast<size_t>(i + kAhead)] & mask_]);
  const int64_t j = i + kAhead / 2;
  if (j >= 0 && j < n) {
    const Slot s = table_[hs_[static_cast<size_t>(j)] & mask_];
    if (s.page >= 0) prefetch(key_of(s.page));
  }
}

void PageIndex::map_erase(int64_t page, uint64_t h) {
  uint64_t i = static_cast<uint32_t>(h) & mask_;
  while (table_[i].page != page) {
    if (table_[i].page < 0) throw std::logic_error(name_ + ": a cached page is missing from the map");
    i = (i + 1) & mask_;
  }
  for (uint64_t j = i;;) {  // backward-shift deletion
    j = (j + 1) & mask_;
    if (table_[j].page < 0) break;
    if (movable(i, j, table_[j].tag & mask_)) {
      table_[i] = table_[j];
      i = j;
    }
  }
  table_[i].page = -1;
}

void PageIndex::lru_push(int64_t p) {
  node_[p].prev = tail_;
  node_[p].next = -1;
  if (tail_ >= 0)
    node_[tail_].next = static_cast<int32_t>(p);
  else
    head_ = static_cast<int32_t>(p);
  tail_ = static_cast<int32_t>(p);
  inl_[p] = 1;
  ++nev_;
}

void PageIndex::lru_remove(int64_t p) {
  const int32_t a = node_[p].prev, b = node_[p].next;
  if (a >= 0)
    node_[a].next = b;
  else
    head_ = b;
  if (b >= 0)
    node_[b].prev = a;
  else
    tail_ = a;
  inl_[p] = 0;
  --nev_;
}

void PageIndex::check_pages(const int64_t* pages, int64_t n) const {
  for (int64_t i = 0; i < n; ++i)
    if (pages[i] < 0 || pages[i] >= n_)
      throw std::out_of_range(name_ + ": page id " + std::to_string(pages[i]) + " out of range [0, " +
                              std::to_string(n_) + ")");
}

int64_t PageIndex::lookup(const uint64_t* keys, int64_t n, int64_t* out) const {
  int64_t found = 0;
  if (size_ == 0) {
    std::fill(out, out + n, -1);
    return 0;
  }
  prepare(keys, n);
  for (int64_t i = 0; i < n; ++i) {
    ahead(i, n);
    out[i] = find(keys + i * kw_, hs_[static_cast<size_t>(i)]);
    found += out[i] >= 0;
  }
  return found;
}

int64_t PageIndex::pin_prefix(const uint64_t* keys, int64_t n, int64_t* out) {
  int64_t m = 0;
  if (size_ > 0) prepare(keys, n);
  for (; m < n && size_ > 0; ++m) {
    ahead(m, n);
    const int64_t p = find(keys + m * kw_, hs_[static_cast<size_t>(m)]);
    if (p < 0) break;
    out[m] = p;
  }
  pin(out, m);
  return m;
}

int64_t PageIndex::count_hits(const uint64_t* keys, int64_t n) {
  int64_t found = 0;
  if (size_ == 0) return 0;
  prepare(keys, n);
  for (int64_t i = 0; i < n; ++i) {
    ahead(i, n);
    const int64_t p = find(keys + i * kw_, hs_[static_cast<size_t>(i)]);
    if (p < 0) continue;
    ++found;
    ++node_[p].hits;
    if (inl_[p]) {
      lru_remove(p);
      lru_push(p);
    }
  }
  return found;
}

void PageIndex::hit_pages(const int64_t* pages, int64_t n) {
  check_pages(pages, n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = pages[i];
    if (!cached_[p]) continue;
    ++node_[p].hits;
    if (inl_[p]) {
      lru_remove(p);
      lru_push(p);
    }
  }
}

void PageIndex::pin(const int64_t* pages, int64_t n) {
  check_pages(pages, n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = pages[i];
    if (inl_[p]) lru_remove(p);
    ++node_[p].ref;
  }
}

void PageIndex::unpin(const int64_t* pages, int64_t n) {
  check_pages(pages, n);
  for (int64_t i = 0; i < n; ++i) {
    if (--node_[pages[i]].ref < 0) {
      for (int64_t j = 0; j <= i; ++j) ++node_[pages[j]].ref;  // undo: nothing changed
      throw std::logic_error(name_ + ": reference count of page " + std::to_string(pages[i]) + " below zero");
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = pages[i];
    if (cached_[p] && node_[p].ref == 0 && !inl_[p]) lru_push(p);
  }
}

void PageIndex::touch(const int64_t* pages, int64_t n) {
  check_pages(pages, n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = pages[i];
    if (inl_[p]) {
      lru_remove(p);
      lru_push(p);
    }
  }
}

int64_t PageIndex::insert(const uint64_t* keys, const int64_t* pages, int64_t n, bool pin, int64_t* used,
                          int64_t* newly) {
  check_pages(pages, n);
  int64_t fresh = 0;
  prepare(keys, n);
  for (int64_t i = 0; i < std::min(n, kAhead); ++i) prefetch(&node_[static_cast<size_t>(pages[i])]);
  for (int64_t i = 0; i < n; ++i) {  // validate before changing anything
    ahead(i, n);
    if (i + kAhead < n) prefetch(&node_[static_cast<size_t>(pages[i + kAhead])]);
    used[i] = size_ ? find(keys + i * kw_, hs_[static_cast<size_t>(i)]) : -1;
    if (used[i] < 0) {
      ++fresh;
      if (cached_[pages[i]])
        throw std::invalid_argument(name_ + ": page " + std::to_string(pages[i]) +
                                    " is indexed under another key already");
    }
  }
  for (int64_t i = 0; fresh < n && i < n; ++i) {  // present keys: used now (before the new pages)
    const int64_t p = used[i];
    if (p >= 0 && inl_[p]) {
      lru_remove(p);
      lru_push(p);
    }
  }
  int64_t k = 0;
  for (int64_t i = 0; fresh > 0 && i < n; ++i) {
    if (used[i] >= 0) continue;
    const uint64_t* key = keys + i * kw_;
    const uint64_t h = hs_[static_cast<size_t>(i)];
    const int64_t again = find(key, h);  // a key repeated within this call: its first page won
    if (again >= 0) {
      used[i] = again;
      continue;
    }
    const int64_t p = pages[i];
    if (cached_[p]) throw std::invalid_argument(name_ + ": the same page appears twice in one insert");
    std::memcpy(node_[p].key, key, sizeof(Node::key));
    map_insert(p, h);
    cached_[p] = 1;
    node_[p].hits = 0;
    ++size_;
    if (pin)
      ++node_[p].ref;
    else if (node_[p].ref == 0)
      lru_push(p);
    used[i] = p;
    newly[k++] = p;
  }
  return k;
}

void PageIndex::unindex(int64_t p, uint64_t h) {
  map_erase(p, h);
  cached_[p] = 0;
  --size_;
}

int64_t PageIndex::evict(int64_t n, int64_t* out_pages, uint64_t* out_keys, GhostSet* ghost) {
  // the victims first (the oldest end of the list), then their keys' hashes with the table
  // lines prefetched, then the removals: the cache misses overlap
  int64_t k = 0;
  for (int32_t p = head_; p >= 0 && k < n; p = node_[p].next) {
    out_pages[k++] = p;
    prefetch(key_of(p));
  }
  hs_.resize(static_cast<size_t>(k));
  for (int64_t i = 0; i < k; ++i) hs_[static_cast<size_t>(i)] = hash(key_of(out_pages[i]));
  for (int64_t i = 0; i < std::min(k, kAhead); ++i) prefetch(&table_[hs_[static_cast<size_t>(i)] & mask_]);
  for (int64_t i = 0; i < k; ++i) {
    if (i + kAhead < k) prefetch(&table_[hs_[static_cast<size_t>(i + kAhead)] & mask_]);
    const int64_t p = out_pages[i];
    lru_remove(p);
    std::memcpy(out_keys + i * kw_, key_of(p), static_cast<size_t>(kw_) * 8);
    unindex(p, hs_[static_cast<size_t>(i)]);
  }
  evictions_ += k;
  if (ghost != nullptr && k > 0) ghost->add(out_keys, k, kw_);
  return k;
}

int64_t PageIndex::drop(const int64_t* pages, int64_t n, uint64_t* out_keys) {
  check_pages(pages, n);
  int64_t k = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = pages[i];
    if (!cached_[p]) continue;
    if (inl_[p]) lru_remove(p);
    std::memcpy(out_keys + k * kw_, key_of(p), static_cast<size_t>(kw_) * 8);
    unindex(p, hash(key_of(p)));
    ++k;
  }
  return k;
}

void PageIndex::lru(int64_t* out) const {
  int64_t i = 0;
  for (int32_t p = head_; p >= 0 && i < nev_; p = node_[p].next) out[i++] = p;
}

int64_t PageIndex::nbytes() const {
  return static_cast<int64_t>(sizeof(*this) + table_.capacity() * sizeof(Slot) + node_.capacity() * sizeof(Node) +
                              cached_.capacity() + inl_.capacity() + hs_.capacity() * 8);
}

void PageIndex::check() const {
  auto fail = [this](const std::string& what) { throw std::logic_error(name_ + ": " + what); };
  int64_t in_map = 0;
  for (uint64_t i = 0; i <= mask_; ++i) {
    const Slot s = table_[i];
    if (s.page < 0) continue;
    ++in_map;
    if (s.page >= n_ || !cached_[s.page]) fail("the map holds a page that is not cached");
    const uint64_t h = hash(key_of(s.page));
    if (s.tag != static_cast<uint32_t>(h) || find(key_of(s.page), h) != s.page)
      fail("a cached page cannot be found under its key");
  }
  int64_t cached = 0, evictable = 0;
  for (int64_t p = 0; p < n_; ++p) {
    cached += cached_[p] != 0;
    if (node_[p].ref < 0) fail("a negative reference count");
    const bool ev = cached_[p] && node_[p].ref == 0;
    evictable += ev;
    if (ev != (inl_[p] != 0)) fail("LRU list out of sync with the evictable pages");
  }
  if (cached != size_ || in_map != size_) fail("map size, cached pages and size() differ");
  int64_t walked = 0;
  for (int32_t p = head_, before = -1; p >= 0; before = p, p = node_[p].next) {
    if (node_[p].prev != before || !inl_[p] || ++walked > evictable) fail("LRU list links broken");
    if (node_[p].next < 0 && tail_ != p) fail("LRU list tail wrong");
  }
  if (walked != evictable || nev_ != evictable)
    fail("LRU out of sync (" + std::to_string(walked) + " listed, " + std::to_string(evictable) +
         " evictable, " + std::to_string(nev_) + " counted)");
}

bool keys_distinct(const uint64_t* keys, int64_t n, int64_t words) {
  if (n < 2) return true;
  // a local open-addressing set of key indices (at most half full)
  std::vector<int32_t> t(table_size(n), -1);
  const uint64_t m = t.size() - 1;
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t* k = keys + i * words;
    uint64_t h = 0x9e3779b97f4a7c15ULL;
    for (int64_t w = 0; w < words; ++w) h = mix(h ^ k[w]);
    for (uint64_t j = h & m;; j = (j + 1) & m) {
      if (t[j] < 0) {
        t[j] = static_cast<int32_t>(i);
        break;
      }
      if (std::memcmp(keys + t[j] * words, k, static_cast<size_t>(words) * 8) == 0) return false;
    }
  }
  return true;
}

}  // namespace l2core
