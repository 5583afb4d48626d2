#include "model/transformer/kv_cache.hpp"

#include "model/base/error.hpp"
#include "model/kernels/attention.hpp"

#include <algorithm>
#include <cstring>
#include <functional>
#include <limits>
#include <new>
#include <string>
#include <utility>

namespace strata::model {

BlockPool::BlockPool(CacheShape shape, int64_t capacity, uint64_t owner)
  : shape_(shape), capacity_(std::clamp<int64_t>(capacity, 1, std::numeric_limits<int32_t>::max())), owner_(owner) {
  if (shape.n_layers <= 0 || shape.kv_dim <= 0)
    throw Error(errc::bad_argument, "a block pool needs layers and a kv width (got " + std::to_string(shape.n_layers) +
                                      " layers, kv_dim " + std::to_string(shape.kv_dim) + ")");
  const WType t = shape.kv_type;
  if (t != WType::f32 && t != WType::bf16 && t != WType::f16 && t != WType::q8_0)
    throw Error(errc::bad_argument, std::string("a KV cache cannot be kept as ") + to_string(t) +
                                      " (f32, bf16, f16 or q8_0)");
  if (shape.head_dim < 0 || shape.kv_dim % shape.head_values() != 0)
    throw Error(errc::bad_argument, "a block pool needs a kv width that is whole heads (got kv_dim " +
                                      std::to_string(shape.kv_dim) + ", head_dim " + std::to_string(shape.head_dim) + ")");
  if (shape.head_values() % block_values(t) != 0)
    throw Error(errc::bad_argument, "a " + std::string(to_string(t)) + " KV cache needs a head width that is a multiple of " +
                                      std::to_string(block_values(t)) + " (got " + std::to_string(shape.head_values()) + ")");
  // Each layer's place in its pool's blocks: global layers in order in this
  // pool, local ones in order in the local pool.
  int64_t global = 0;
  for (int64_t l = 0; l < shape.n_layers; ++l)
    layer_index_.push_back(shape.is_local(l) ? n_local_++ : global++);
  row_bytes_ = shape.kv_row_bytes();
  head_bytes_ = shape.head_row_bytes();
  run_bytes_ = static_cast<std::size_t>(block_tokens) * head_bytes_;
  kv_heads_ = static_cast<int64_t>(row_bytes_ / head_bytes_);
  keys_by_dim_ = shape.keys_by_dim();
  layer_bytes_ = static_cast<std::size_t>(2 * block_tokens) * row_bytes_;
  out_block_bytes_ = static_cast<std::size_t>(block_tokens * shape.out_dim) * sizeof(float);
  own_block_bytes_ = static_cast<std::size_t>(shape.n_layers - n_local_) * layer_bytes_ + out_block_bytes_;
  // Slabs of about 32 MB (at least one block; no more than the pool holds),
  // counted by the larger of this pool's blocks and its local pool's (which
  // takes the same slab size: every layer may be local).
  const std::size_t local_block = static_cast<std::size_t>(n_local_) * layer_bytes_;
  slab_blocks_ = std::clamp<std::size_t>((std::size_t{32} << 20) / std::max<std::size_t>({own_block_bytes_, local_block, 1}),
                                         1, static_cast<std::size_t>(capacity_));
  if (n_local_ > 0) {
    CacheShape ls{n_local_, shape.kv_dim, 0, {}, 0, shape.kv_type, shape.head_dim};
    local_ = std::make_unique<BlockPool>(std::move(ls), capacity_, owner);
    // As many blocks a slab as this pool: k_offset / v_offset of a local layer
    // (asked of this pool) step from layer to layer by the same stride.
    local_->slab_blocks_ = slab_blocks_;
  }
}

std::size_t BlockPool::bytes_in_use() const {
  return static_cast<std::size_t>(in_use_) * block_bytes() + (local_ ? local_->bytes_in_use() : 0);
}

void BlockPool::FreeBytes::operator()(uint8_t* p) const {
  ::operator delete[](p, std::align_val_t{4096});
}

int64_t BlockPool::blocks_for_budget(CacheShape shape, std::size_t bytes) {
  const auto per = block_bytes(shape);
  if (per == 0)
    return 1;
  return std::clamp<int64_t>(static_cast<int64_t>(bytes / per), 1, std::numeric_limits<int32_t>::max());
}

std::size_t BlockPool::allocated_bytes() const {
  return refs_.size() * block_bytes() +
         (local_ ? local_->allocated_bytes() : 0);
}

int32_t BlockPool::allocate() {
  if (in_use_ >= capacity_)
    return -1;
  int32_t id;
  if (!free_.empty()) {
    std::pop_heap(free_.begin(), free_.end(), std::greater<>{});
    id = free_.back();
    free_.pop_back();
  } else if (static_cast<int64_t>(refs_.size()) < capacity_) {
    // The first block of a new slab allocates it (before the count moves: a
    // failed allocation leaves the pool as it was).
    if (refs_.size() / slab_blocks_ == slabs_.size()) {
      std::unique_ptr<uint8_t, FreeBytes> slab(static_cast<uint8_t*>(
        ::operator new[](std::max<std::size_t>(64, slab_blocks_ * own_block_bytes_), std::align_val_t{4096})));
      slabs_.push_back(std::move(slab));
    }
    id = static_cast<int32_t>(refs_.size());
    refs_.push_back(0);
    ids_.emplace_back();
    has_id_.push_back(0);
    lru_pos_.push_back(lru_.end());
  } else {
    // Every block has storage and those not in use are cached: reclaim the
    // least recently released one.
    id = lru_.back();
    unpublish(id);
    ++reclaimed_;
  }
  refs_[static_cast<std::size_t>(id)] = 1;
  ++in_use_;
  return id;
}

void BlockPool::retain(int32_t block) {
  const auto b = static_cast<std::size_t>(block);
  if (refs_[b]++ == 0) { // a cached block comes back into use
    ++in_use_;
    if (lru_pos_[b] != lru_.end()) {
      lru_.erase(lru_pos_[b]);
      lru_pos_[b] = lru_.end();
    }
  }
}

void BlockPool::release(int32_t block) {
  const auto b = static_cast<std::size_t>(block);
  auto& r = refs_[b];
  if (r <= 0)
    return;
  if (--r == 0) {
    --in_use_;
    if (has_id_[b] != 0) {
      lru_.push_front(block);
      lru_pos_[b] = lru_.begin();
    } else {
      put_free(block);
    }
  }
}

void BlockPool::put_free(int32_t block) {
  free_.push_back(block);
  std::push_heap(free_.begin(), free_.end(), std::greater<>{});
}

void BlockPool::unpublish(int32_t block) {
  const auto b = static_cast<std::size_t>(block);
  if (has_id_[b] != 0) {
    index_.erase(ids_[b]);
    has_id_[b] = 0;
  }
  if (lru_pos_[b] != lru_.end()) {
    lru_.erase(lru_pos_[b]);
    lru_pos_[b] = lru_.end();
  }
}

void BlockPool::set_prefix_cache(bool on) {
  if (local_)
    local_->set_prefix_cache(on);
  prefix_on_ = on;
  if (on)
    return;
  while (!lru_.empty()) { // cached blocks become plain free ones
    const auto b = lru_.back();
    unpublish(b);
    put_free(b);
  }
  for (std::size_t b = 0; b < has_id_.size(); ++b)
    if (has_id_[b] != 0)
      unpublish(static_cast<int32_t>(b));
}

bool BlockPool::publish(int32_t block, const BlockId& id) {
  const auto b = static_cast<std::size_t>(block);
  if (!prefix_on_ || b >= refs_.size() || refs_[b] <= 0 || has_id_[b] != 0)
    return false;
  if (!index_.emplace(id, block).second)
    return false;
  ids_[b] = id;
  has_id_[b] = 1;
  return true;
}

int32_t BlockPool::lookup(const BlockId& id) const {
  if (!prefix_on_)
    return -1;
  auto it = index_.find(id);
  return it == index_.end() ? -1 : it->second;
}

KVCache::KVCache(std::shared_ptr<BlockPool> pool) : pool_(std::move(pool)) {
}

KVCache::~KVCache() {
  release_all();
}

KVCache::KVCache(KVCache&& o) noexcept
  : pool_(std::move(o.pool_)), table_(std::move(o.table_)), local_(std::move(o.local_)),
    local_first_(std::exchange(o.local_first_, 0)), seq_len_(std::exchange(o.seq_len_, 0)) {
  o.table_.clear();
  o.local_.clear();
}

KVCache& KVCache::operator=(KVCache&& o) noexcept {
  if (this != &o) {
    release_all();
    pool_ = std::move(o.pool_);
    table_ = std::move(o.table_);
    local_ = std::move(o.local_);
    o.table_.clear();
    o.local_.clear();
    local_first_ = std::exchange(o.local_first_, 0);
    seq_len_ = std::exchange(o.seq_len_, 0);
  }
  return *this;
}

void KVCache::release_all() {
  if (pool_) {
    for (auto b : table_)
      pool_->release(b);
    for (auto b : local_)
      if (b >= 0)
        pool_->local()->release(b);
  }
  table_.clear();
  local_.clear();
  local_first_ = 0;
  seq_len_ = 0;
}

int64_t KVCache::local_blocks() const {
  return static_cast<int64_t>(local_.size() - local_first_);
}

void KVCache::trim_window(int64_t certain) {
  if (local_.empty())
    return;
  // The next position, seq_len, sees keys from seq_len + 1 - window on; so does
  // every later one. Blocks that end before that are given back.
  const int64_t first_seen = std::min(seq_len_, certain) + 1 - pool_->shape().window;
  const auto keep_from =
    static_cast<std::size_t>(std::max<int64_t>(0, first_seen) / BlockPool::block_tokens); // block of first_seen
  for (; local_first_ < std::min(keep_from, local_.size()); ++local_first_) {
    pool_->local()->release(local_[local_first_]);
    local_[local_first_] = -1;
  }
}

int64_t KVCache::blocks_missing(int64_t tokens) const {
  return std::max<int64_t>(0, blocks_needed(tokens) - blocks());
}

std::size_t KVCache::bytes() const {
  if (!pool_)
    return 0;
  return table_.size() * pool_->block_bytes() +
         (pool_->local() ? static_cast<std::size_t>(local_blocks()) * pool_->local()->block_bytes() : 0);
}

bool KVCache::reserve(int64_t tokens) {
  trim_window();
  const int64_t missing = blocks_missing(tokens);
  if (missing == 0)
    return true;
  BlockPool* lp = pool_ ? pool_->local() : nullptr;
  if (!pool_ || pool_->available() < missing || (lp && lp->available() < missing))
    return false;
  for (int64_t i = 0; i < missing; ++i) {
    table_.push_back(pool_->allocate());
    if (lp)
      local_.push_back(lp->allocate());
  }
  return true;
}

void KVCache::truncate(int64_t n) {
  n = std::max<int64_t>(0, n);
  if (!local_.empty() && n < seq_len_) {
    const int64_t first_seen = std::max<int64_t>(0, n + 1 - pool_->shape().window);
    if (static_cast<std::size_t>(first_seen / BlockPool::block_tokens) < local_first_)
      throw Error(errc::bad_argument, "cannot truncate to " + std::to_string(n) +
                                        " positions: the window there reaches local blocks already given back");
  }
  if (n < seq_len_)
    seq_len_ = n;
  const auto keep = static_cast<std::size_t>(blocks_needed(n));
  while (table_.size() > keep) {
    pool_->release(table_.back());
    table_.pop_back();
    if (!local_.empty()) {
      if (local_.back() >= 0)
        pool_->local()->release(local_.back());
      local_.pop_back();
      local_first_ = std::min(local_first_, local_.size());
    }
  }
}

void KVCache::commit(int64_t n) {
  if (n > blocks() * BlockPool::block_tokens)
    throw Error(errc::bad_argument, "commit of " + std::to_string(n) + " positions past the " +
                                      std::to_string(blocks()) + " reserved blocks");
  seq_len_ = n;
}

bool KVCache::adopt(const BlockId& id) {
  if (!pool_ || seq_len_ != blocks() * BlockPool::block_tokens)
    return false;
  const int32_t block = pool_->lookup(id);
  if (block < 0)
    return false;
  BlockPool* lp = pool_->local();
  const int32_t lb = lp ? lp->lookup(id) : -1;
  if (lp && lb < 0)
    return false;
  pool_->retain(block);
  table_.push_back(block);
  if (lp) {
    lp->retain(lb);
    local_.push_back(lb);
  }
  seq_len_ += BlockPool::block_tokens;
  return true;
}

bool KVCache::publish(std::size_t index, const BlockId& id) {
  if (!pool_ || index >= table_.size())
    return false;
  const bool ok = pool_->publish(table_[index], id);
  // The local pool may still hold a block under this id whose main block was
  // reclaimed: the same id is the same contents, so either serves an adopter.
  if (ok && index < local_.size() && local_[index] >= 0)
    pool_->local()->publish(local_[index], id);
  return ok;
}

KVView KVCache::view() const {
  KVView v;
  v.pool = pool_.get();
  v.seq_len = seq_len_;
  v.blocks.reserve(table_.size());
  const bool out = pool_->shape().out_dim > 0;
  for (auto b : table_) {
    v.blocks.push_back(pool_->data(b));
    if (out)
      v.out_blocks.push_back(pool_->out_data(b));
  }
  if (!local_.empty()) {
    v.local_blocks.reserve(local_.size());
    for (auto b : local_)
      v.local_blocks.push_back(b >= 0 ? pool_->local()->data(b) : nullptr);
  }
  return v;
}

void KVView::put_key(int64_t layer, int64_t pos, int64_t head, const float* x, int64_t n) const {
  const WType t = pool->shape().kv_type;
  if (!pool->keys_by_dim())
    return quantize(t, x, k(layer, pos, head), n);
  constexpr int64_t bt = BlockPool::block_tokens;
  const int64_t slot = pos % bt;
  uint8_t* run = k(layer, pos - slot, head); // the head's run of keys in pos's block
  if (t == WType::f32) {
    auto* p = reinterpret_cast<float*>(run);
    for (int64_t i = 0; i < n; ++i)
      p[detail::by_dim_f32(bt, i, slot)] = x[i];
    return;
  }
  for (int64_t b = 0; b < n / 32; ++b) { // q8_0: each block as a row stores it, then spread
    uint8_t blk[34];
    quantize_q8_0_block(x + 32 * b, blk);
    std::memcpy(run + detail::by_dim_q8_scale(bt, b, slot), blk, 2);
    for (int64_t u = 0; u < 8; ++u)
      std::memcpy(run + detail::by_dim_q8_unit(bt, b, u, slot), blk + 2 + 4 * u, 4);
  }
}

float KVView::key_value(int64_t layer, int64_t pos, int64_t head, int64_t i) const {
  const WType t = pool->shape().kv_type;
  if (!pool->keys_by_dim()) {
    const int64_t b = block_values(t);
    float x[32];
    dequantize(t, k(layer, pos, head) + row_bytes(t, i / b * b), x, b);
    return x[i % b];
  }
  constexpr int64_t bt = BlockPool::block_tokens;
  const int64_t slot = pos % bt;
  const uint8_t* run = k(layer, pos - slot, head);
  if (t == WType::f32)
    return reinterpret_cast<const float*>(run)[detail::by_dim_f32(bt, i, slot)];
  uint16_t d;
  std::memcpy(&d, run + detail::by_dim_q8_scale(bt, i / 32, slot), 2);
  const auto q = static_cast<int8_t>(run[detail::by_dim_q8_unit(bt, i / 32, i % 32 / 4, slot) + i % 4]);
  return f16_to_f32(d) * static_cast<float>(q);
}

} // namespace strata::model
