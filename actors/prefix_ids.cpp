#include "actors/prefix_ids.hpp"

#include "messages/session_id.hpp"

#include <cstring>

namespace strata::actors {

namespace {

inline uint64_t rotl(uint64_t x, int b) {
  return (x << b) | (x >> (64 - b));
}

struct Sip {
  uint64_t v0, v1, v2, v3;
  void round() {
    v0 += v1;
    v1 = rotl(v1, 13);
    v1 ^= v0;
    v0 = rotl(v0, 32);
    v2 += v3;
    v3 = rotl(v3, 16);
    v3 ^= v2;
    v0 += v3;
    v3 = rotl(v3, 21);
    v3 ^= v0;
    v2 += v1;
    v1 = rotl(v1, 17);
    v1 ^= v2;
    v2 = rotl(v2, 32);
  }
  void absorb(uint64_t m) {
    v3 ^= m;
    round();
    round();
    v0 ^= m;
  }
  uint64_t squeeze(uint64_t mark) {
    v2 ^= mark;
    for (int i = 0; i < 4; ++i)
      round();
    return v0 ^ v1 ^ v2 ^ v3;
  }
};

} // namespace

model::BlockId siphash24(uint64_t k0, uint64_t k1, std::span<const uint8_t> bytes, bool wide) {
  Sip s{k0 ^ 0x736f6d6570736575ull, k1 ^ 0x646f72616e646f6dull, k0 ^ 0x6c7967656e657261ull,
        k1 ^ 0x7465646279746573ull};
  if (wide)
    s.v1 ^= 0xee;
  const std::size_t n = bytes.size();
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t m;
    std::memcpy(&m, bytes.data() + i, 8); // little-endian hosts (as the wire)
    s.absorb(m);
  }
  uint64_t last = static_cast<uint64_t>(n & 0xff) << 56;
  for (std::size_t j = 0; i + j < n; ++j)
    last |= static_cast<uint64_t>(bytes[i + j]) << (8 * j);
  s.absorb(last);
  model::BlockId out;
  out.hi = s.squeeze(wide ? 0xee : 0xff);
  if (wide) {
    s.v1 ^= 0xdd;
    for (int r = 0; r < 4; ++r)
      s.round();
    out.lo = s.v0 ^ s.v1 ^ s.v2 ^ s.v3;
  }
  return out;
}

PrefixIds::PrefixIds(const msg::cache_recipe& recipe)
  : PrefixIds(recipe, msg::mint_session_key().hi, msg::mint_session_key().lo) {
}

PrefixIds::PrefixIds(const msg::cache_recipe& recipe, uint64_t k0, uint64_t k1) : k0_(k0), k1_(k1) {
  std::string r = recipe.architecture + '\n' + recipe.model + '\n' + recipe.dtype + '\n' + recipe.kv_dtype + '\n' +
                  std::to_string(recipe.n_layers) + '\n' + std::to_string(recipe.n_kv_heads) + '\n' +
                  std::to_string(recipe.head_dim);
  seed_ = siphash24(k0_, k1_, std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(r.data()), r.size()));
}

model::BlockId PrefixIds::next(const model::BlockId* prev, std::span<const int32_t> tokens) const {
  std::vector<uint8_t> buf(16 + tokens.size() * sizeof(int32_t));
  const auto& p = prev ? *prev : seed_;
  std::memcpy(buf.data(), &p.hi, 8);
  std::memcpy(buf.data() + 8, &p.lo, 8);
  std::memcpy(buf.data() + 16, tokens.data(), tokens.size() * sizeof(int32_t));
  return siphash24(k0_, k1_, buf);
}

void PrefixIds::extend(std::vector<model::BlockId>& ids, std::span<const int32_t> tokens) const {
  constexpr auto bt = static_cast<std::size_t>(model::BlockPool::block_tokens);
  for (std::size_t b = ids.size(); (b + 1) * bt <= tokens.size(); ++b)
    ids.push_back(next(b == 0 ? nullptr : &ids[b - 1], tokens.subspan(b * bt, bt)));
}

std::vector<uint64_t> to_words(const std::vector<model::BlockId>& ids, std::size_t from, std::size_t to) {
  std::vector<uint64_t> w;
  to = std::min(to, ids.size());
  for (std::size_t b = from; b < to; ++b) {
    w.push_back(ids[b].hi);
    w.push_back(ids[b].lo);
  }
  return w;
}

} // namespace strata::actors
