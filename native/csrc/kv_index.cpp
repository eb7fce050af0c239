// KvIndex (see include/kv_index.h). Torch-free; the binding converts arguments in bindings.cpp.
#include "kv_index.h"
#include "hash_table.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace l2core {
namespace {

inline uint64_t norm(uint64_t k, uint64_t salt) {  // 0 marks an empty slot: key 0 is stored as 1
  k ^= salt;
  return k ? k : 1;
}

}  // namespace

KvIndex::KvIndex(int64_t capacity, int64_t max_instances) : cap_(capacity) {
  if (capacity < 1) throw std::invalid_argument("index capacity must be >= 1 page");
  if (max_instances < 1 || max_instances > 4096)
    throw std::invalid_argument("max_instances must be in [1, 4096], got " + std::to_string(max_instances));
  W_ = (max_instances + 63) / 64;
  stride_ = 2 + 2 * static_cast<uint64_t>(W_);
  slots_ = static_cast<uint64_t>(capacity) + static_cast<uint64_t>(capacity) / 4 + 16;  // load <= 0.8
  table_.assign(slots_ * stride_, 0);
  counts_.assign(static_cast<size_t>(2 * 64 * W_), 0);
}

uint64_t KvIndex::home(uint64_t k) const {
  return static_cast<uint64_t>((static_cast<unsigned __int128>(mix(k)) * slots_) >> 64);
}

int64_t KvIndex::find(uint64_t k) const {
  for (uint64_t i = home(k);; i = (i + 1 == slots_) ? 0 : i + 1) {
    const uint64_t s = at(i)[0];
    if (s == k) return static_cast<int64_t>(i);
    if (s == 0) return -1;
  }
}

bool KvIndex::empty_entry(const uint64_t* e) const {
  if (e[1]) return false;
  for (uint64_t w = 2; w < stride_; ++w)
    if (e[w]) return false;
  return true;
}

void KvIndex::erase(uint64_t i) {
  // backward-shift deletion: pull later entries of the cluster into the hole when their home allows
  uint64_t j = i;
  for (;;) {
    j = (j + 1 == slots_) ? 0 : j + 1;
    const uint64_t* e = at(j);
    if (e[0] == 0) break;
    const uint64_t k = home(e[0]);
    const bool move = i <= j ? (k <= i || k > j) : (k <= i && k > j);
    if (move) {
      std::copy(e, e + stride_, at(i));
      i = j;
    }
  }
  std::fill(at(i), at(i) + stride_, 0);
  --size_;
}

int64_t KvIndex::apply(int64_t inst, const int64_t* ops, int64_t n_ops, const uint64_t* keys, int64_t n_keys,
                       uint64_t salt, uint64_t stamp) {
  if (inst < 0 || inst >= 64 * W_) throw std::out_of_range("instance slot " + std::to_string(inst) + " out of range");
  if (n_ops < 0 || n_keys < 0) throw std::invalid_argument("negative op or key count");
  // each count against the keys left after the ops before it: no sum is taken, so no count can
  // wrap a total around to n_keys (and the loop below never reads past the key buffer)
  int64_t left = n_keys;
  for (int64_t o = 0; o < n_ops; ++o) {
    const int64_t tier = ops[3 * o], set = ops[3 * o + 1], cnt = ops[3 * o + 2];
    if (tier < 0 || tier > 2) throw std::invalid_argument("tier must be 0 (L1), 1 (L2) or 2 (pool)");
    if (set != 0 && set != 1) throw std::invalid_argument("op must be 0 (remove) or 1 (store)");
    if (cnt < 0) throw std::invalid_argument("negative key count");
    if (cnt > left)
      throw std::invalid_argument("ops name more keys than the " + std::to_string(n_keys) + " given: op " +
                                  std::to_string(o) + " names " + std::to_string(cnt) + ", " +
                                  std::to_string(left) + " left");
    left -= cnt;
  }
  if (left != 0)
    throw std::invalid_argument("ops name " + std::to_string(n_keys - left) + " keys, " + std::to_string(n_keys) +
                                " given");
  const uint64_t w = static_cast<uint64_t>(inst) / 64, bit = 1ULL << (inst % 64);
  int64_t refused = 0;
  const uint64_t* kp = keys;
  for (int64_t o = 0; o < n_ops; ++o) {
    const int64_t tier = ops[3 * o], set = ops[3 * o + 1], cnt = ops[3 * o + 2];
    const uint64_t word = tier == 2 ? 1 : 2 + static_cast<uint64_t>(tier) * W_ + w;
    int64_t* count = tier == 2 ? &pool_count_ : &counts_[static_cast<size_t>(tier * 64 * W_ + inst)];
    for (int64_t q = 0; q < cnt; ++q) {
      if (q + kAhead < cnt) prefetch(at(home(norm(kp[q + kAhead], salt))));
      const uint64_t k = norm(kp[q], salt);
      uint64_t i = home(k);
      uint64_t* e;
      for (;; i = (i + 1 == slots_) ? 0 : i + 1) {
        e = at(i);
        if (e[0] == k || e[0] == 0) break;
      }
      if (e[0] == 0) {  // absent
        if (!set) continue;
        if (size_ >= cap_) {
          ++refused;
          continue;
        }
        e[0] = k;
        ++size_;
      }
      bool cleared = false;  // a removal that took something away (an entry it may empty)
      if (tier == 2) {
        if (set) {
          if (!e[1]) ++*count;
          e[1] = stamp ? stamp : 1;
        } else if (e[1]) {
          e[1] = 0;
          --*count;
          cleared = true;
        }
      } else if (set) {
        if (!(e[word] & bit)) {
          e[word] |= bit;
          ++*count;
        }
      } else if (e[word] & bit) {
        e[word] &= ~bit;
        --*count;
        cleared = true;
      }
      if (cleared && empty_entry(e)) {
        if (deferring_)
          deferred_.push_back(k);  // stays where it is until defer_erases(false)
        else
          erase(i);
      }
    }
    kp += cnt;
  }
  rejected_ += refused;
  return refused;
}

int64_t KvIndex::clear_instance(int64_t inst, int tier_mask, uint64_t begin, uint64_t end) {
  if (inst < 0 || inst >= 64 * W_) throw std::out_of_range("instance slot " + std::to_string(inst) + " out of range");
  const uint64_t w = static_cast<uint64_t>(inst) / 64, bit = 1ULL << (inst % 64);
  uint64_t words[2];
  int64_t* count[2];
  int nt = 0;
  for (int t = 0; t < 2; ++t)
    if (tier_mask & (1 << t)) {
      words[nt] = 2 + static_cast<uint64_t>(t * W_) + w;
      count[nt++] = &counts_[static_cast<size_t>(t * 64 * W_ + inst)];
    }
  auto left = [&] {
    int64_t n = 0;
    for (int t = 0; t < nt; ++t) n += *count[t];
    return n;
  };
  end = std::min(end, slots_);
  for (uint64_t i = begin; i < end && left() > 0;) {
    uint64_t* e = at(i);
    bool hit = false;
    if (e[0] != 0)
      for (int t = 0; t < nt; ++t)
        if (e[words[t]] & bit) {  // only entries holding the bit are written
          e[words[t]] &= ~bit;
          --*count[t];
          hit = true;
        }
    if (hit && empty_entry(e))
      erase(i);  // a later entry may have moved into i: look at it again
    else
      ++i;
  }
  return left();
}

int64_t KvIndex::expire_pool(uint64_t min_stamp, uint64_t begin, uint64_t end) {
  int64_t dropped = 0;
  end = std::min(end, slots_);
  for (uint64_t i = begin; i < end && pool_count_ > 0;) {
    uint64_t* e = at(i);
    if (e[0] == 0 || e[1] == 0 || e[1] >= min_stamp) {
      ++i;
      continue;
    }
    e[1] = 0;
    ++dropped;
    --pool_count_;
    if (empty_entry(e))
      erase(i);
    else
      ++i;
  }
  return dropped;
}

int64_t KvIndex::erase_deferred(int64_t n) {
  int64_t erased = 0;
  for (; n > 0 && !deferred_.empty(); --n) {
    const int64_t i = find(deferred_.back());
    deferred_.pop_back();
    if (i >= 0 && empty_entry(at(static_cast<uint64_t>(i)))) {  // not stored again meanwhile
      erase(static_cast<uint64_t>(i));
      ++erased;
    }
  }
  if (deferred_.empty()) std::vector<uint64_t>().swap(deferred_);  // its memory back
  return erased;
}

int64_t KvIndex::query(const uint64_t* keys, int64_t n, uint64_t salt, uint64_t min_stamp, const uint64_t* live,
                       int32_t* l1, int32_t* l2, int32_t* l3) const {
  const int64_t M = 64 * W_;
  std::vector<uint64_t> acc(static_cast<size_t>(3 * W_));
  bool any = false;
  for (int64_t w = 0; w < W_; ++w) {
    acc[w] = acc[W_ + w] = acc[2 * W_ + w] = live[w];
    any = any || live[w];
  }
  for (int64_t b = 0; b < M; ++b) {
    const bool on = (live[b / 64] >> (b % 64)) & 1;
    l1[b] = l2[b] = l3[b] = on ? static_cast<int32_t>(n) : 0;
  }
  int64_t pool = n;
  bool pool_on = true;
  for (int64_t i = 0; i < n && (any || pool_on); ++i) {
    if (i + kAhead < n) prefetch(at(home(norm(keys[i + kAhead], salt))));
    const int64_t s = find(norm(keys[i], salt));
    const uint64_t* e = s >= 0 ? at(static_cast<uint64_t>(s)) : nullptr;
    const bool in_pool = e && e[1] && e[1] >= min_stamp;
    if (pool_on && !in_pool) {
      pool = i;
      pool_on = false;
    }
    any = false;
    for (int64_t w = 0; w < W_; ++w) {
      const uint64_t m1 = e ? e[2 + w] : 0, m2 = m1 | (e ? e[2 + W_ + w] : 0), m3 = in_pool ? ~0ULL : m2;
      const uint64_t ms[3] = {m1, m2, m3};
      int32_t* outs[3] = {l1, l2, l3};
      for (int t = 0; t < 3; ++t) {
        uint64_t& a = acc[t * W_ + w];
        uint64_t drop = a & ~ms[t];
        while (drop) {
          const int b = __builtin_ctzll(drop);
          outs[t][w * 64 + b] = static_cast<int32_t>(i);
          drop &= drop - 1;
        }
        a &= ms[t];
        any = any || a;
      }
    }
  }
  return pool;
}

int64_t KvIndex::nbytes() const {
  return static_cast<int64_t>(table_.capacity() * 8 + counts_.capacity() * 8 + deferred_.capacity() * 8 +
                              sizeof(*this));
}

void KvIndex::check() const {
  int64_t n = 0, pool = 0;
  std::vector<int64_t> counts(counts_.size(), 0);
  std::vector<uint64_t> deferred(deferred_);  // the only empty entries allowed
  std::sort(deferred.begin(), deferred.end());
  for (uint64_t i = 0; i < slots_; ++i) {
    const uint64_t* e = at(i);
    if (e[0] == 0) {
      if (!empty_entry(e)) throw std::logic_error("an empty slot holds bits");
      continue;
    }
    ++n;
    if (empty_entry(e) && !std::binary_search(deferred.begin(), deferred.end(), e[0]))
      throw std::logic_error("an entry with no bits and no stamp is kept");
    if (find(e[0]) != static_cast<int64_t>(i)) throw std::logic_error("an entry is not reachable from its home");
    if (e[1]) ++pool;
    for (int64_t t = 0; t < 2; ++t)
      for (int64_t w = 0; w < W_; ++w)
        for (int b = 0; b < 64; ++b)
          if ((e[2 + t * W_ + w] >> b) & 1) ++counts[static_cast<size_t>(t * 64 * W_ + w * 64 + b)];
  }
  if (n != size_) throw std::logic_error("size " + std::to_string(size_) + " != " + std::to_string(n) + " entries");
  if (pool != pool_count_) throw std::logic_error("pool count disagrees with the table");
  if (counts != counts_) throw std::logic_error("per-instance counts disagree with the table");
}

}  // namespace l2core
