#pragma once
// The KV cache of one shard: a pool of fixed-size blocks, and per sequence a
// table of block ids into it (the layout vLLM calls paged attention).
//
// * BlockPool: one per shard, sized by the node's cache budget. A block holds the
//   keys and values of `block_tokens` positions for every layer of the shard:
//   (n_layers, 2 = k|v, kv head, block_tokens) rows of head_dim values in the
//   pool's KV type (f32, bf16, f16 or q8_0 blocks: CacheShape::kv_type): each kv
//   head's rows of a block lie together, so the decode attention, which reads
//   one kv head at a time, streams whole cache lines and pages (the layout vLLM
//   uses); then, on every shard
//   but the tail, the shard's output rows for those positions (block_tokens,
//   out_dim) in f32:
//   what it sent the next shard, kept so that a next shard that lost its cache
//   can be rebuilt without recomputing anything upstream.
//   Blocks carry reference counts. Storage is allocated on a block's first use and
//   reused after it is freed. Blocks are cut from slabs of about 32 MB laid out
//   layer by layer and, in a layer, kv head by kv head (a slab's blocks' keys
//   of layer 0, head 0 side by side, then their keys of head 1, ..., then the
//   values alike, then layer 1, ..., then their output rows;
//   BlockPool::slab_blocks()). A decode step reads one kv head of one layer of
//   a sequence's blocks at a time, and the pool hands out its lowest free
//   blocks first: a sequence's blocks taken one after another make each head's
//   keys (values) one run of memory, which the hardware prefetcher streams
//   (measured twice as fast as 8 KB pieces 32 KB apart on the AMD VM).
// * Sliding windows: a shard's local (windowed) layers keep their keys and
//   values in a second pool of their own (BlockPool::local(), same capacity, one
//   local block beside each block of the main pool). A sequence gives back its
//   local blocks that lie wholly before the window of its next position, so a
//   long sequence holds its global layers in full and its local layers for the
//   last `window` positions only (Gemma 3, 5 local layers in 6: ~1/6 of a full
//   cache). The output rows stay in the main block.
// * The prefix cache lives in the pool: a full block can be published under a
//   BlockId (a hash chain over the tokens of it and every block before it, made
//   by the actor layer). A block whose last reference goes is then kept, cached,
//   instead of freed; a later sequence that starts with the same blocks shares it
//   (lookup + KVCache::adopt). A block in use (referenced) is never evicted; a
//   cached one is reclaimed, least recently released first, only when the pool
//   has no never-used or free block left. Shared blocks are full, and a sequence
//   only writes positions past its length, so a shared block is never written.
// * KVCache: one sequence's block table and length. Move-only; dropping it hands
//   its blocks back to the pool. Growing it takes blocks from the pool and fails
//   (leaving it unchanged) when the pool has too few.
//
// Model math reads and writes a sequence through KVCache::view(); nothing
// outside this file knows how a block is laid out beyond what the view says.
// Torch-free. Not thread-safe: one shard actor owns a pool.

#include "model/formats/quant.hpp"

#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <unordered_map>
#include <vector>

namespace strata::model {

/// The geometry of one shard's cache.
struct CacheShape {
  int64_t n_layers = 0; ///< layers of the shard
  int64_t kv_dim = 0;   ///< n_kv_heads * head_dim
  int64_t out_dim = 0;  ///< width of the output rows kept per position (0: none, the tail)
  /// Sliding-window layers (Gemma 2/3, Mistral): local[l] != 0 for a layer of
  /// the shard that attends only to the last `window` positions. Empty: none.
  std::vector<uint8_t> local;
  int64_t window = 0;
  /// How keys and values are stored: f32, bf16, f16 or q8_0 (a head of whole
  /// blocks of 32 for q8_0).
  WType kv_type = WType::f32;
  /// Values of one kv head (kv_dim a multiple of it); 0: the whole row is one head.
  int64_t head_dim = 0;
  int64_t head_values() const { return head_dim > 0 ? head_dim : kv_dim; }
  /// Bytes of one position's keys (or values), every kv head.
  std::size_t kv_row_bytes() const { return row_bytes(kv_type, kv_dim); }
  /// Bytes of one kv head's key (or value) at one position.
  std::size_t head_row_bytes() const { return row_bytes(kv_type, head_values()); }
  /// f32 and q8_0 keys are stored by dimension inside a block, so the decode
  /// score pass loads 16 keys' value i (q8_0: 4 values, or a block's scale) as
  /// one vector instead of transposing 16 rows (docs/architecture.md). In a
  /// head's run of keys of a block (bt = block_tokens):
  /// - f32: value i of slot s at float i x bt + s;
  /// - q8_0: per block b of 32 values, bt x 34 bytes: the bt f16 scales (slot
  ///   s at byte 2s), then 8 units of 4 values (unit u of slot s at byte
  ///   2 bt + 4 (u bt + s)).
  /// Values, and keys of bf16 and f16, are stored by position.
  bool keys_by_dim() const { return kv_type == WType::f32 || kv_type == WType::q8_0; }
  bool is_local(int64_t layer) const {
    return window > 0 && static_cast<std::size_t>(layer) < local.size() && local[static_cast<std::size_t>(layer)] != 0;
  }
  int64_t n_local() const {
    int64_t n = 0;
    for (int64_t l = 0; l < n_layers; ++l)
      n += is_local(l) ? 1 : 0;
    return n;
  }
  bool operator==(const CacheShape& o) const {
    if (n_layers != o.n_layers || kv_dim != o.kv_dim || out_dim != o.out_dim || window != o.window ||
        kv_type != o.kv_type || head_values() != o.head_values())
      return false;
    for (int64_t l = 0; l < n_layers; ++l)
      if (is_local(l) != o.is_local(l))
        return false;
    return true;
  }
};

/// The identity of a full block's contents: 128 bits of a keyed hash chain.
struct BlockId {
  uint64_t hi = 0;
  uint64_t lo = 0;
  friend bool operator==(const BlockId&, const BlockId&) = default;
};
struct BlockIdHash {
  std::size_t operator()(const BlockId& b) const { return static_cast<std::size_t>(b.hi ^ (b.lo * 0x9E3779B97F4A7C15ull)); }
};

class BlockPool {
public:
  /// Token positions per block.
  static constexpr int64_t block_tokens = 32;
  /// A pool of at most `capacity` blocks of `shape`; `owner` names the shard
  /// that may run sequences of this pool (0: any shard of that shape).
  BlockPool(CacheShape shape, int64_t capacity, uint64_t owner = 0);
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  /// Bytes of one block (of this pool; the local pool's blocks are counted by it).
  std::size_t block_bytes() const { return own_block_bytes_; }
  /// The pool of the shard's sliding-window layers, or null when it has none.
  BlockPool* local() const { return local_.get(); }
  /// Whether shard layer `layer` lives in local() (the layer map of the shape).
  bool is_local(int64_t layer) const { return shape_.is_local(layer); }
  /// Blocks in use in both pools, and their bytes.
  std::size_t bytes_in_use() const;
  /// How many blocks a byte budget buys (at least 1).
  static int64_t blocks_for_budget(CacheShape shape, std::size_t bytes);

  const CacheShape& shape() const { return shape_; }
  uint64_t owner() const { return owner_; }
  int64_t capacity() const { return capacity_; }
  /// Blocks referenced by at least one sequence.
  int64_t in_use() const { return in_use_; }
  /// Blocks a sequence can take now (free ones and cached ones nobody uses).
  int64_t available() const { return capacity_ - in_use_; }
  /// Bytes of storage allocated so far (blocks in use plus freed ones kept for reuse).
  std::size_t allocated_bytes() const;

  /// A block with reference count 1 (a free one, a new one, or else the least
  /// recently released cached one, which leaves the prefix cache), or -1 when all
  /// `capacity` are in use.
  int32_t allocate();
  /// One more reference (a cached block nobody used is in use again).
  void retain(int32_t block);
  /// Drops one reference; at zero the block is cached (published) or free.
  void release(int32_t block);
  int32_t refcount(int32_t block) const { return refs_[static_cast<std::size_t>(block)]; }

  // The prefix cache.
  /// Turns publishing on or off (off: publish() refuses, lookup() finds nothing).
  void set_prefix_cache(bool on);
  bool prefix_cache() const { return prefix_on_; }
  /// Files a full, in-use block under `id`. False when the cache is off, the id
  /// is taken (another block with the same contents stays the shared one), or
  /// the block is already published.
  bool publish(int32_t block, const BlockId& id);
  /// The block published under `id`, or -1. (The caller adopts it into a cache.)
  int32_t lookup(const BlockId& id) const;
  /// Published blocks (in use or cached).
  int64_t published() const { return static_cast<int64_t>(index_.size()); }
  /// Published blocks nobody uses now (reclaimable).
  int64_t cached() const { return static_cast<int64_t>(lru_.size()); }
  /// Cached blocks reclaimed for new contents so far.
  uint64_t reclaimed() const { return reclaimed_; }

  /// Where block `block`'s layers are found: a layer's keys and values at
  /// data(block) + k_offset / v_offset (the layers and heads of a block are
  /// not contiguous: see slab_blocks()).
  uint8_t* data(int32_t block) const {
    const auto b = static_cast<std::size_t>(block);
    return slabs_[b / slab_blocks_].get() + (b % slab_blocks_) * run_bytes_;
  }
  /// Where block `block`'s output rows are found (out_offset from here).
  uint8_t* out_data(int32_t block) const {
    const auto b = static_cast<std::size_t>(block);
    return slabs_[b / slab_blocks_].get() + layers_bytes() + (b % slab_blocks_) * out_block_bytes_;
  }
  /// Blocks are cut from slabs of slab_blocks() blocks each, laid out layer by
  /// layer and head by head: a slab holds the keys of layer 0, kv head 0 of
  /// each of its blocks side by side (one run of block_tokens positions each),
  /// then those of head 1, ..., then the values of layer 0 alike, then layer
  /// 1, and so on, then the blocks' output rows. A decode step reads one kv
  /// head of one layer of every block of its sequence at a time, and blocks
  /// taken one after another lie side by side: the reads are one run of
  /// consecutive blocks' keys (values), not a few kilobytes from each of blocks
  /// further apart.
  std::size_t slab_blocks() const { return slab_blocks_; }
  /// Bytes from a block's part of one layer to its part of the next.
  std::size_t layer_stride() const { return slab_blocks_ * layer_bytes_; }

  /// The byte offset from data() where kv head `head`'s key (value) of position
  /// `slot` (0 .. block_tokens-1) of shard layer `layer` starts: from a block of
  /// local() for a local layer (which has this pool's slab_blocks()), of this
  /// pool otherwise. A head's positions are
  /// head_row_bytes() apart. Keys by dimension (keys_by_dim()) start
  /// key_unit() bytes apart (f32: value 0; q8_0: the scale of block 0), their
  /// other values spread over the head's run (CacheShape::keys_by_dim).
  std::size_t k_offset(int64_t layer, int64_t slot, int64_t head) const {
    return static_cast<std::size_t>(index_of(layer)) * layer_stride() +
           static_cast<std::size_t>(head) * slab_blocks_ * run_bytes_ +
           static_cast<std::size_t>(slot) * (keys_by_dim_ ? key_unit() : head_bytes_);
  }
  /// Whether keys lie by dimension (CacheShape::keys_by_dim).
  bool keys_by_dim() const { return keys_by_dim_; }
  /// Keys by dimension: the bytes from one slot's part to the next (f32: a
  /// value; q8_0: a scale, k_offset giving the slot's scale of block 0).
  std::size_t key_unit() const { return shape_.kv_type == WType::f32 ? sizeof(float) : 2; }
  std::size_t v_offset(int64_t layer, int64_t slot, int64_t head) const {
    return static_cast<std::size_t>(index_of(layer)) * layer_stride() +
           static_cast<std::size_t>(kv_heads_ + head) * slab_blocks_ * run_bytes_ +
           static_cast<std::size_t>(slot) * head_bytes_;
  }
  /// Bytes from one position of a kv head to the next inside a block.
  std::size_t head_row_bytes() const { return head_bytes_; }
  /// The byte offset from out_data() of the (f32) output row of position
  /// `slot` (shape().out_dim > 0).
  std::size_t out_offset(int64_t slot) const { return static_cast<std::size_t>(slot * shape_.out_dim) * sizeof(float); }
  /// Bytes of one block of the main pool and of its local block together.
  static std::size_t block_bytes(const CacheShape& s) {
    return static_cast<std::size_t>(s.n_layers * 2 * block_tokens) * s.kv_row_bytes() +
           static_cast<std::size_t>(block_tokens * s.out_dim) * sizeof(float);
  }
  /// Bytes per token position: keys and values of every layer (a local layer's
  /// count as long as the position is in its window), and the kept output row.
  static std::size_t kv_bytes_per_token(const CacheShape& s) {
    return static_cast<std::size_t>(s.n_layers * 2) * s.kv_row_bytes();
  }
  static std::size_t out_bytes_per_token(const CacheShape& s) {
    return static_cast<std::size_t>(s.out_dim) * sizeof(float);
  }

private:
  struct FreeBytes {
    void operator()(uint8_t* p) const;
  };
  std::size_t row_bytes_ = 0;       // one position's keys (or values), every head
  std::size_t head_bytes_ = 0;      // one kv head's key (or value) at one position
  std::size_t run_bytes_ = 0;       // one kv head's keys (or values) of one block
  int64_t kv_heads_ = 0;            // row_bytes_ / head_bytes_
  bool keys_by_dim_ = false;        // shape_.keys_by_dim()
  std::size_t own_block_bytes_ = 0; // one block of this pool
  std::size_t layer_bytes_ = 0;     // one layer of one block: keys, then values
  std::size_t out_block_bytes_ = 0; // one block's output rows
  std::size_t slab_blocks_ = 1;     // blocks a slab holds
  std::size_t layers_bytes() const {  // a slab's layers, before its output rows
    return static_cast<std::size_t>(shape_.n_layers - n_local_) * layer_stride();
  }
  int64_t index_of(int64_t layer) const { return layer_index_[static_cast<std::size_t>(layer)]; }
  int64_t n_local_ = 0;
  std::vector<int64_t> layer_index_;  // shard layer -> its place in its pool's blocks
  std::unique_ptr<BlockPool> local_;
  void unpublish(int32_t block);
  void put_free(int32_t block); // onto free_, keeping it a heap
  CacheShape shape_;
  int64_t capacity_;
  uint64_t owner_;
  int64_t in_use_ = 0;
  // The slabs (4,096-byte aligned), allocated as blocks are first used:
  // block b lies in slabs_[b / slab_blocks_].
  std::vector<std::unique_ptr<uint8_t, FreeBytes>> slabs_;
  std::vector<int32_t> refs_; // by block id, for every block that has had storage (ids 0 .. size - 1)
  // Ids with storage, no references, not published: a heap, the lowest id on
  // top, so that a sequence's next blocks are the lowest free ones (blocks
  // taken in ascending order make each kv head's keys and values of the
  // sequence one ascending run of memory: k_offset).
  std::vector<int32_t> free_;
  // Prefix cache: published blocks by id; per block its id (if any) and, when
  // unreferenced, its place in the LRU list (front = most recently released).
  bool prefix_on_ = true;
  std::unordered_map<BlockId, int32_t, BlockIdHash> index_;
  std::vector<BlockId> ids_;
  std::vector<char> has_id_;
  std::list<int32_t> lru_;
  std::vector<std::list<int32_t>::iterator> lru_pos_;
  uint64_t reclaimed_ = 0;
};

/// What attention needs to read one sequence's cache: block pointers in order.
struct KVView {
  const BlockPool* pool = nullptr;
  std::vector<uint8_t*> blocks;       ///< data of table[i]
  std::vector<uint8_t*> local_blocks; ///< data of the local table (null: before the window, given back)
  std::vector<uint8_t*> out_blocks;   ///< out_data of table[i] (pools with an out_dim only)
  int64_t seq_len = 0;
  /// The blocks that hold `layer`'s keys and values.
  const std::vector<uint8_t*>& blocks_of(int64_t layer) const { return pool->is_local(layer) ? local_blocks : blocks; }
  /// Where kv head `head`'s key (value) of `layer` at `pos` starts, in the
  /// pool's kv_type (head_values() of them). The head is always named: the
  /// heads of a position are not contiguous (head_row_bytes()). Keys stored
  /// by dimension (pool->keys_by_dim()) are not contiguous either: write keys
  /// with put_key, read them with key_value.
  uint8_t* k(int64_t layer, int64_t pos, int64_t head) const {
    return blocks_of(layer)[static_cast<std::size_t>(pos / BlockPool::block_tokens)] +
           pool->k_offset(layer, pos % BlockPool::block_tokens, head);
  }
  /// Stores n values (a head's key) as kv head `head`'s key of `layer` at `pos`.
  void put_key(int64_t layer, int64_t pos, int64_t head, const float* x, int64_t n) const;
  /// Value i of that key, as a float.
  float key_value(int64_t layer, int64_t pos, int64_t head, int64_t i) const;
  uint8_t* v(int64_t layer, int64_t pos, int64_t head) const {
    return blocks_of(layer)[static_cast<std::size_t>(pos / BlockPool::block_tokens)] +
           pool->v_offset(layer, pos % BlockPool::block_tokens, head);
  }
  /// The shard's output row of `pos` (pools with an out_dim only).
  float* out(int64_t pos) const {
    return reinterpret_cast<float*>(out_blocks[static_cast<std::size_t>(pos / BlockPool::block_tokens)] +
                                    pool->out_offset(pos % BlockPool::block_tokens));
  }
};

class KVCache {
public:
  KVCache() = default;
  explicit KVCache(std::shared_ptr<BlockPool> pool);
  ~KVCache();
  KVCache(KVCache&& o) noexcept;
  KVCache& operator=(KVCache&& o) noexcept;
  KVCache(const KVCache&) = delete;
  KVCache& operator=(const KVCache&) = delete;

  /// Number of positions whose keys and values are cached (committed).
  int64_t seq_len() const { return seq_len_; }
  /// Blocks in this sequence's table.
  int64_t blocks() const { return static_cast<int64_t>(table_.size()); }
  const std::vector<int32_t>& table() const { return table_; }
  /// Blocks a sequence of `tokens` positions needs in all.
  static int64_t blocks_needed(int64_t tokens) {
    return tokens <= 0 ? 0 : (tokens + BlockPool::block_tokens - 1) / BlockPool::block_tokens;
  }
  /// Extra blocks this cache must take from the pool to hold `tokens` positions.
  int64_t blocks_missing(int64_t tokens) const;
  /// Bytes of the blocks this sequence references (both pools).
  std::size_t bytes() const;
  /// Local blocks this sequence holds now (the window's; 0 without local layers).
  int64_t local_blocks() const;
  /// Takes blocks from the pool until `tokens` positions fit. All-or-nothing:
  /// false, and nothing taken, when the pool has too few free blocks. Gives
  /// back the local blocks before the window first (trim_window()).
  bool reserve(int64_t tokens);
  /// Gives back the local blocks no later position can see: those wholly before
  /// n + 1 - window, n = min(seq_len(), certain). A sequence that may still be
  /// cut back (speculative rows: truncate()) passes the length it will keep
  /// at least, so the window of any position it may restart from stays held.
  void trim_window(int64_t certain = INT64_MAX);
  /// Forgets everything from position `n` on; whole blocks past it go back to
  /// the pool. Refused (errc::bad_argument, nothing changed) when position n's
  /// window reaches local blocks already given back.
  void truncate(int64_t n);
  /// Marks positions [seq_len, n) as written (the forward pass calls this once
  /// every layer has written them). n must fit in the reserved blocks.
  void commit(int64_t n);
  /// Appends a full published block (one more reference to it; with local
  /// layers, also to the local block published under the same id) as the next
  /// block_tokens positions. Only while the cache is a whole number of full
  /// blocks with no block reserved past them, and the id is published in every
  /// pool the cache uses; false otherwise (nothing changed).
  bool adopt(const BlockId& id);
  /// Publishes block `index` of the table (and its local block while held)
  /// under `id`: see BlockPool::publish. False when the main block was not.
  bool publish(std::size_t index, const BlockId& id);

  BlockPool* pool() const { return pool_.get(); }
  const std::shared_ptr<BlockPool>& shared_pool() const { return pool_; }
  /// Pointers to this sequence's blocks, for the forward pass.
  KVView view() const;

private:
  void release_all();
  std::shared_ptr<BlockPool> pool_;
  std::vector<int32_t> table_;
  std::vector<int32_t> local_; // beside table_ when the pool has local layers; -1: given back
  std::size_t local_first_ = 0; // local_[0 .. local_first_) are given back
  int64_t seq_len_ = 0;
};

} // namespace strata::model
