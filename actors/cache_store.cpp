#include "actors/cache_store.hpp"

#include <algorithm>

namespace strata::actors {

using msg::miss_reason;

SessionCacheStore::SessionCacheStore(StoreLimits limits, std::shared_ptr<model::BlockPool> pool, now_fn now)
  : limits_(limits), pool_(std::move(pool)), now_(std::move(now)) {
}

std::size_t SessionCacheStore::bytes() const {
  return pool_->bytes_in_use();
}

void SessionCacheStore::remember(const std::string& session, miss_reason why) {
  if (why_gone_.count(session) == 0 && newest_epoch_.count(session) == 0)
    memory_order_.push_back(session);
  why_gone_[session] = why;
  while (memory_order_.size() > limits_.history) {
    const auto& old = memory_order_.front();
    if (index_.count(old) == 0) { // never forget the epoch or owner of a live session
      why_gone_.erase(old);
      newest_epoch_.erase(old);
      owner_.erase(old);
    }
    memory_order_.pop_front();
  }
}

void SessionCacheStore::drop(list_type::iterator it, miss_reason why) {
  const std::string session = it->session;
  index_.erase(session);
  lru_.erase(it);
  remember(session, why);
}

void SessionCacheStore::touch(list_type::iterator it) {
  it->last_used = now_();
  lru_.splice(lru_.begin(), lru_, it);
}

SessionCacheStore::Lookup SessionCacheStore::miss(const std::string& session, miss_reason why, std::string detail) {
  ++counters_.misses[static_cast<std::size_t>(why)];
  Lookup l;
  l.miss = why;
  l.detail = "session '" + session + "': " + std::move(detail);
  return l;
}

bool SessionCacheStore::check_epoch(const std::string& session, int64_t epoch, Lookup& out) {
  auto it = newest_epoch_.find(session);
  if (it != newest_epoch_.end() && epoch < it->second) {
    ++counters_.stale;
    out.err = caf::make_error(ec::stale_epoch, "session '" + session + "' request at epoch " + std::to_string(epoch) +
                                                 " but epoch " + std::to_string(it->second) + " was already seen");
    return false;
  }
  if (it == newest_epoch_.end()) {
    if (why_gone_.count(session) == 0)
      memory_order_.push_back(session);
    newest_epoch_[session] = epoch;
  } else {
    it->second = epoch;
  }
  return true;
}

caf::error SessionCacheStore::check_owner(const std::string& session, const msg::session_key& key) {
  auto it = owner_.find(session);
  if (it == owner_.end() || it->second == key)
    return {};
  ++counters_.conflicts;
  return caf::make_error(ec::session_conflict, "session '" + session +
                                                 "' belongs to another owner (the request's session key does not "
                                                 "match); its caches were not touched");
}

SessionCacheStore::Lookup SessionCacheStore::open(const std::string& session, const msg::session_key& key,
                                                  int64_t epoch, int64_t step_id, const pin_fn& pinned) {
  Lookup out;
  if ((out.err = check_owner(session, key)))
    return out;
  if (!check_epoch(session, epoch, out))
    return out;
  owner_[session] = key;
  expire();
  if (auto it = index_.find(session); it != index_.end()) {
    if (step_id >= 0 && it->second->epoch <= epoch && it->second->last_step == step_id) {
      out.ctx = &*it->second; // this very step was applied already
      out.ctx->epoch = epoch;
      out.duplicate = true;
      touch(it->second);
      return out;
    }
    lru_.erase(it->second); // replaced by the fresh context
    index_.erase(it);
  }
  // Session cap: evict the least recently used others (never pinned ones: the
  // cap may be exceeded for the length of a round).
  for (auto it = lru_.end(); index_.size() >= limits_.max_sessions && it != lru_.begin();) {
    --it;
    if (pinned && pinned(*it))
      continue;
    ++counters_.evictions_lru;
    auto victim = it++;
    drop(victim, miss_reason::evicted_lru);
  }
  Context fresh;
  fresh.session = session;
  fresh.epoch = epoch;
  fresh.cache = model::KVCache(pool_);
  fresh.last_used = now_();
  lru_.push_front(std::move(fresh));
  index_[session] = lru_.begin();
  why_gone_.erase(session);
  out.ctx = &lru_.front();
  return out;
}

SessionCacheStore::Lookup SessionCacheStore::find(const std::string& session, const msg::session_key& key,
                                                  int64_t epoch, int64_t past_len, int64_t step_id) {
  Lookup out;
  if ((out.err = check_owner(session, key)))
    return out;
  if (!check_epoch(session, epoch, out))
    return out;
  auto it = index_.find(session);
  if (it != index_.end())
    expire(&*it->second);
  else
    expire();
  it = index_.find(session);
  if (it == index_.end()) {
    auto gone = why_gone_.find(session);
    if (gone == why_gone_.end())
      return miss(session, miss_reason::unknown_session, "no cache was ever opened here");
    return miss(session, gone->second, std::string("cache is gone: ") + msg::to_string(gone->second));
  }
  Context& ctx = *it->second;
  ctx.renewed = true;
  if (ctx.epoch < epoch)
    ctx.epoch = epoch; // kept across a route change (the session asked for this hop as it is)
  const int64_t held = ctx.cache.seq_len();
  if (past_len != held) {
    if (step_id == ctx.last_step && past_len == ctx.last_past_len) {
      out.ctx = &ctx;
      out.duplicate = true;
      touch(it->second);
      return out;
    }
    if (step_id >= 0 && step_id != ctx.last_step && past_len < held && past_len >= ctx.certain) {
      // A new step after a speculative one: the proposals past past_len were
      // rejected. Forget them (their blocks go back; published blocks all lie
      // before `certain`), and what the prefix cache knew of them.
      ctx.cache.truncate(past_len);
      constexpr auto bt = model::BlockPool::block_tokens;
      ctx.ids.resize(std::min(ctx.ids.size(), static_cast<std::size_t>(past_len / bt)));
      ctx.published = std::min(ctx.published, ctx.ids.size());
      if (ctx.tokens.size() > static_cast<std::size_t>(past_len))
        ctx.tokens.resize(static_cast<std::size_t>(past_len));
      counters_.rolled_back += static_cast<uint64_t>(held - past_len);
      ctx.rolled_back += static_cast<uint64_t>(held - past_len);
      ++counters_.hits;
      touch(it->second);
      out.ctx = &ctx;
      return out;
    }
    return miss(session, miss_reason::seq_mismatch,
                "request expects " + std::to_string(past_len) + " cached tokens, the cache holds " + std::to_string(held));
  }
  ++counters_.hits;
  touch(it->second);
  out.ctx = &ctx;
  return out;
}

caf::error SessionCacheStore::reserve(Context& ctx, int64_t tokens, const pin_fn& pinned) {
  const int64_t need = model::KVCache::blocks_needed(tokens);
  if (need > pool_->capacity()) {
    ++counters_.budget_errors;
    const std::string session = ctx.session;
    auto it = index_.find(session);
    if (it != index_.end())
      drop(it->second, miss_reason::evicted_lru);
    return caf::make_error(ec::budget_exceeded,
                           "session '" + session + "' needs " + std::to_string(need) + " cache blocks (" +
                             std::to_string(static_cast<std::size_t>(need) * pool_->block_bytes()) + " bytes) for " +
                             std::to_string(tokens) + " tokens, more than the shard's whole pool of " +
                             std::to_string(pool_->capacity()) + " blocks");
  }
  const int64_t missing = ctx.cache.blocks_missing(tokens);
  if (pool_->available() < missing) {
    // Victims, least recently used first, until enough blocks would be free.
    std::vector<list_type::iterator> victims;
    int64_t freed = 0;
    for (auto it = lru_.end(); it != lru_.begin() && pool_->available() + freed < missing;) {
      --it;
      if (&*it == &ctx || (pinned && pinned(*it)))
        continue;
      victims.push_back(it);
      freed += it->cache.blocks(); // a shared block frees nothing; that only makes us evict more
    }
    if (pool_->available() + freed < missing)
      return caf::make_error(ec::overloaded, "session '" + ctx.session + "' needs " + std::to_string(missing) +
                                               " more cache blocks; the pool's other blocks belong to steps in flight");
    for (auto it : victims) {
      if (pool_->available() >= missing)
        break;
      ++counters_.evictions_lru;
      drop(it, miss_reason::evicted_lru);
    }
  }
  if (!ctx.cache.reserve(tokens))
    return caf::make_error(ec::overloaded, "session '" + ctx.session + "': cache blocks are shared and cannot be freed");
  return {};
}

void SessionCacheStore::committed(Context& ctx, int64_t step_id, int64_t past_len, int64_t draft) {
  ctx.last_step = step_id;
  ctx.last_past_len = past_len;
  ctx.last_used = now_();
  ctx.certain = std::max<int64_t>(0, ctx.cache.seq_len() - std::max<int64_t>(0, draft));
  const auto full = static_cast<std::size_t>(ctx.certain / model::BlockPool::block_tokens);
  for (; ctx.published < std::min(full, ctx.ids.size()); ++ctx.published)
    ctx.cache.publish(ctx.published, ctx.ids[ctx.published]); // an id taken by another block: ours stays private
  ctx.cache.trim_window(ctx.certain); // after publishing: a later session may still share the blocks it gives back
}

int64_t SessionCacheStore::share_prefix(Context& ctx, int64_t limit) {
  constexpr auto bt = model::BlockPool::block_tokens;
  for (std::size_t b = static_cast<std::size_t>(ctx.cache.blocks()); b < ctx.ids.size(); ++b) {
    if (static_cast<int64_t>(b + 1) * bt > limit)
      break;
    if (!ctx.cache.adopt(ctx.ids[b]))
      break;
    counters_.prefix_hit_tokens += bt;
  }
  ctx.published = static_cast<std::size_t>(ctx.cache.blocks());
  return ctx.cache.seq_len();
}

caf::error SessionCacheStore::release(const std::string& session, const msg::session_key& key) {
  if (auto err = check_owner(session, key))
    return err;
  if (auto it = index_.find(session); it != index_.end())
    drop(it->second, miss_reason::released);
  else
    remember(session, miss_reason::released);
  return {};
}

caf::error SessionCacheStore::renew(const std::string& session, const msg::session_key& key) {
  if (auto err = check_owner(session, key))
    return err;
  if (auto it = index_.find(session); it != index_.end())
    it->second->renewed = true;
  return {};
}

void SessionCacheStore::orphan(const std::string& session) {
  if (auto it = index_.find(session); it != index_.end()) {
    ++counters_.orphans;
    drop(it->second, miss_reason::released);
  }
}

std::vector<std::string> SessionCacheStore::lease_sweep() {
  std::vector<std::string> gone;
  if (limits_.lease_missed <= 0)
    return gone;
  for (auto& c : lru_) {
    c.missed = c.renewed ? 0 : c.missed + 1;
    c.renewed = false;
    if (c.missed >= limits_.lease_missed)
      gone.push_back(c.session);
  }
  for (auto& s : gone)
    orphan(s);
  return gone;
}

void SessionCacheStore::evict(const std::string& session, miss_reason reason) {
  if (auto it = index_.find(session); it != index_.end()) {
    if (reason == miss_reason::evicted_ttl)
      ++counters_.evictions_ttl;
    else if (reason == miss_reason::evicted_lru)
      ++counters_.evictions_lru;
    drop(it->second, reason);
  }
}

void SessionCacheStore::evict_all(miss_reason reason) {
  std::vector<std::string> all;
  for (auto& c : lru_)
    all.push_back(c.session);
  for (auto& s : all)
    evict(s, reason);
}

void SessionCacheStore::forget(const std::string& session) {
  if (auto it = index_.find(session); it != index_.end()) {
    lru_.erase(it->second);
    index_.erase(it);
  }
  why_gone_.erase(session);
  newest_epoch_.erase(session);
  owner_.erase(session);
}

void SessionCacheStore::expire(const Context* keep) {
  const auto now = now_();
  for (auto it = lru_.begin(); it != lru_.end();) {
    auto next = std::next(it);
    if (&*it != keep && now - it->last_used > limits_.ttl) {
      ++counters_.evictions_ttl;
      drop(it, miss_reason::evicted_ttl);
    }
    it = next;
  }
}

} // namespace strata::actors
