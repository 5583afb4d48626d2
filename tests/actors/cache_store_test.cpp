// SessionCacheStore: every rule, then a randomized run against a plain
// reference model of the rules.

#include "actors/cache_store.hpp"
#include "tests/support.hpp"

#include <algorithm>
#include <list>
#include <map>
#include <random>

namespace strata {
namespace {

using actors::SessionCacheStore;
using actors::StoreLimits;
using msg::miss_reason;
using clk = std::chrono::steady_clock;

// Each session id's owner key in these tests (ownership has tests of its own).
msg::session_key key_of(const std::string& session) {
  return msg::session_key{std::hash<std::string>{}(session) | 1, 7};
}

struct Fixture : ::testing::Test {
  std::shared_ptr<model::Shard> shard = model::Shard::load("builtin:tiny", {0, 4});
  clk::time_point now = clk::time_point{} + std::chrono::hours(1);
  std::size_t block = 5 * 2 * model::BlockPool::block_tokens * 16 * sizeof(float); // 5 layers, kv_dim 16

  std::unique_ptr<SessionCacheStore> make(StoreLimits l) {
    return std::make_unique<SessionCacheStore>(l, shard->new_pool(l.max_bytes), [this] { return now; });
  }
  // Appends `n` tokens to a context through the real shard.
  void grow(SessionCacheStore& s, SessionCacheStore::Context& ctx, int64_t n, int64_t step) {
    ASSERT_FALSE(s.reserve(ctx, ctx.cache.seq_len() + n));
    std::vector<int32_t> t(static_cast<std::size_t>(n), 7);
    const auto past = ctx.cache.seq_len();
    shard->forward(t, model::consecutive_positions(past, n), ctx.cache);
    s.committed(ctx, step, past);
  }
};

TEST_F(Fixture, HitAndEveryMissReason) {
  auto s = make({});
  auto l = s->find("a", key_of("a"), 1, 0, 1);
  EXPECT_EQ(l.ctx, nullptr);
  EXPECT_EQ(l.miss, miss_reason::unknown_session);
  auto o = s->open("a", key_of("a"), 1);
  ASSERT_NE(o.ctx, nullptr);
  grow(*s, *o.ctx, 3, 1);
  auto h = s->find("a", key_of("a"), 1, 3, 2);
  ASSERT_NE(h.ctx, nullptr);
  EXPECT_EQ(s->counters().hits, 1u);
  // Sequence-length mismatch.
  auto m = s->find("a", key_of("a"), 1, 5, 3);
  EXPECT_EQ(m.miss, miss_reason::seq_mismatch);
  EXPECT_NE(m.detail.find("holds 3"), std::string::npos) << m.detail;
  // A newer epoch carries the context over (the session keeps unchanged hops);
  // the length check still applies.
  auto kept = s->find("a", key_of("a"), 2, 3, 3);
  ASSERT_NE(kept.ctx, nullptr);
  EXPECT_EQ(kept.ctx->epoch, 2);
  EXPECT_EQ(s->find("a", key_of("a"), 2, 4, 4).miss, miss_reason::seq_mismatch);
  // Superseded (by injection): history remembers why.
  s->evict("a", miss_reason::superseded);
  EXPECT_EQ(s->find("a", key_of("a"), 2, 3, 5).miss, miss_reason::superseded);
  EXPECT_EQ(s->find("a", key_of("a"), 2, 3, 5).miss, miss_reason::superseded) << "history remembers why";
  // Released.
  s->open("b", key_of("b"), 1);
  s->release("b", key_of("b"));
  EXPECT_EQ(s->find("b", key_of("b"), 1, 0, 1).miss, miss_reason::released);
  // Evicted (LRU) and (TTL) by injection, and forgotten.
  s->open("c", key_of("c"), 1);
  s->evict("c", miss_reason::evicted_lru);
  EXPECT_EQ(s->find("c", key_of("c"), 1, 0, 1).miss, miss_reason::evicted_lru);
  s->open("d", key_of("d"), 1);
  s->forget("d");
  EXPECT_EQ(s->find("d", key_of("d"), 1, 0, 1).miss, miss_reason::unknown_session);
  EXPECT_EQ(s->counters().misses[static_cast<int>(miss_reason::unknown_session)], 2u);
}

TEST_F(Fixture, StaleEpochIsAnError) {
  auto s = make({});
  s->open("a", key_of("a"), 5);
  auto l = s->find("a", key_of("a"), 4, 0, 1);
  EXPECT_EQ(l.ctx, nullptr);
  EXPECT_EQ(l.err, ec::stale_epoch);
  EXPECT_EQ(s->open("a", key_of("a"), 3).err, ec::stale_epoch);
  EXPECT_EQ(s->counters().stale, 2u);
  EXPECT_NE(s->open("a", key_of("a"), 6).ctx, nullptr);
}

TEST_F(Fixture, TtlExpiresIdleContextsButNotTheOneServed) {
  StoreLimits lim;
  lim.ttl = std::chrono::seconds(10);
  auto s = make(lim);
  s->open("a", key_of("a"), 1);
  s->open("b", key_of("b"), 1);
  now += std::chrono::seconds(11);
  // "a" is being served: not its own victim even though idle; "b" expires.
  auto a = s->find("a", key_of("a"), 1, 0, 1);
  ASSERT_NE(a.ctx, nullptr);
  EXPECT_EQ(s->find("b", key_of("b"), 1, 0, 1).miss, miss_reason::evicted_ttl);
  EXPECT_EQ(s->counters().evictions_ttl, 1u);
}

TEST_F(Fixture, SessionCapEvictsLeastRecentlyUsed) {
  StoreLimits lim;
  lim.max_sessions = 2;
  auto s = make(lim);
  s->open("a", key_of("a"), 1);
  now += std::chrono::seconds(1);
  s->open("b", key_of("b"), 1);
  now += std::chrono::seconds(1);
  ASSERT_NE(s->find("a", key_of("a"), 1, 0, 1).ctx, nullptr); // a is now more recent than b
  s->open("c", key_of("c"), 1);
  EXPECT_EQ(s->sessions(), 2u);
  EXPECT_EQ(s->find("b", key_of("b"), 1, 0, 1).miss, miss_reason::evicted_lru);
  EXPECT_TRUE(s->contains("a"));
}

TEST_F(Fixture, ByteBudgetEvictsOthersAndRefusesAGiant) {
  StoreLimits lim;
  lim.max_bytes = 3 * block;
  auto s = make(lim);
  auto a = s->open("a", key_of("a"), 1);
  grow(*s, *a.ctx, 40, 1); // 2 blocks
  now += std::chrono::seconds(1);
  auto b = s->open("b", key_of("b"), 1);
  grow(*s, *b.ctx, 40, 1); // 2 more: "a" must go
  EXPECT_FALSE(s->contains("a"));
  EXPECT_LE(s->bytes(), lim.max_bytes);
  EXPECT_EQ(s->find("a", key_of("a"), 1, 40, 2).miss, miss_reason::evicted_lru);
  // One session needing more than the whole budget: a budget error, no eviction loop.
  auto c = s->open("c", key_of("c"), 1);
  auto err = s->reserve(*c.ctx, 4 * model::BlockPool::block_tokens);
  EXPECT_EQ(err, ec::budget_exceeded);
  EXPECT_TRUE(s->contains("b")) << "others are not evicted for a request that can never fit";
  EXPECT_FALSE(s->contains("c"));
}

TEST_F(Fixture, DuplicateStepIsRecognised) {
  auto s = make({});
  auto a = s->open("a", key_of("a"), 1);
  grow(*s, *a.ctx, 4, 1);
  auto d = s->find("a", key_of("a"), 1, 4, 2);
  ASSERT_NE(d.ctx, nullptr);
  grow(*s, *d.ctx, 1, 2); // step 2 applied at past_len 4
  auto dup = s->find("a", key_of("a"), 1, 4, 2);
  ASSERT_NE(dup.ctx, nullptr);
  EXPECT_TRUE(dup.duplicate);
  EXPECT_EQ(dup.ctx->cache.seq_len(), 5);
  EXPECT_EQ(s->find("a", key_of("a"), 1, 4, 3).miss, miss_reason::seq_mismatch) << "another step at the old length is a mismatch";
}

// A plain reference model of the rules (LRU list, block-granular bytes, session
// cap, TTL, miss history, epochs), driven with the same random operations.
struct RefStore {
  struct E {
    std::string id;
    int64_t epoch, len;
    clk::time_point used;
  };
  StoreLimits lim;
  std::size_t block;
  std::list<E> lru;
  std::map<std::string, miss_reason> gone;
  std::map<std::string, int64_t> newest;

  std::size_t bytes_of(int64_t len) const { return static_cast<std::size_t>((len + 31) / 32) * block; }
  std::size_t bytes() const {
    std::size_t n = 0;
    for (auto& e : lru)
      n += bytes_of(e.len);
    return n;
  }
  std::list<E>::iterator at(const std::string& id) {
    return std::find_if(lru.begin(), lru.end(), [&](auto& e) { return e.id == id; });
  }
  void drop(std::list<E>::iterator it, miss_reason r) {
    gone[it->id] = r;
    lru.erase(it);
  }
  bool stale(const std::string& id, int64_t epoch) {
    if (newest.count(id) && epoch < newest[id])
      return true;
    newest[id] = epoch;
    return false;
  }
  void expire(clk::time_point now, const std::string& keep) {
    for (auto it = lru.begin(); it != lru.end();) {
      auto next = std::next(it);
      if (it->id != keep && now - it->used > lim.ttl)
        drop(it, miss_reason::evicted_ttl);
      it = next;
    }
  }
  // Returns false when stale.
  bool open(const std::string& id, int64_t epoch, clk::time_point now) {
    if (stale(id, epoch))
      return false;
    expire(now, "");
    if (auto it = at(id); it != lru.end())
      lru.erase(it);
    while (lru.size() >= lim.max_sessions)
      drop(std::prev(lru.end()), miss_reason::evicted_lru);
    lru.push_front({id, epoch, 0, now});
    gone.erase(id);
    return true;
  }
  // 0 = hit, -1 = stale, else the miss reason.
  int find(const std::string& id, int64_t epoch, int64_t past, clk::time_point now) {
    if (stale(id, epoch))
      return -1;
    expire(now, at(id) != lru.end() ? id : "");
    auto it = at(id);
    if (it == lru.end())
      return static_cast<int>(gone.count(id) ? gone[id] : miss_reason::unknown_session);
    if (it->epoch < epoch)
      it->epoch = epoch; // carried into the newer epoch
    if (past != it->len)
      return static_cast<int>(miss_reason::seq_mismatch);
    it->used = now;
    lru.splice(lru.begin(), lru, it);
    return 0;
  }
  // Returns false on a budget error.
  bool grow(const std::string& id, int64_t n, clk::time_point now) {
    auto it = at(id);
    const std::size_t need = std::max(bytes_of(it->len + n), bytes_of(it->len));
    if (need > lim.max_bytes) {
      drop(it, miss_reason::evicted_lru);
      return false;
    }
    std::size_t total = bytes() - bytes_of(it->len) + need;
    while (total > lim.max_bytes) {
      auto v = std::prev(lru.end());
      while (v == it)
        v = std::prev(v);
      total -= bytes_of(v->len);
      drop(v, miss_reason::evicted_lru);
    }
    it->len += n;
    it->used = now;
    return true;
  }
  void release(const std::string& id) {
    if (auto it = at(id); it != lru.end())
      drop(it, miss_reason::released);
    else
      gone[id] = miss_reason::released;
  }
};

TEST_F(Fixture, RandomizedAgainstReferenceModel) {
  StoreLimits lim;
  lim.max_sessions = 4;
  lim.max_bytes = 6 * block;
  lim.ttl = std::chrono::seconds(40);
  auto s = make(lim);
  RefStore ref{lim, block, {}, {}, {}};
  std::mt19937 rng(1234);
  int64_t step = 0;
  int hits = 0, misses = 0, stales = 0, budget = 0;
  for (int op = 0; op < 1500; ++op) {
    const std::string id = "s" + std::to_string(rng() % 7);
    now += std::chrono::seconds(rng() % 6);
    const int kind = static_cast<int>(rng() % 12);
    int64_t epoch = ref.newest.count(id) ? ref.newest[id] : 1;
    if (rng() % 10 == 0)
      ++epoch;
    else if (rng() % 20 == 0)
      --epoch;
    SCOPED_TRACE("op " + std::to_string(op) + " on " + id);
    if (kind < 3) {
      const int64_t n = 1 + static_cast<int64_t>(rng() % (kind == 0 ? 200 : 40));
      auto o = s->open(id, key_of(id), epoch);
      const bool ok = ref.open(id, epoch, now);
      ASSERT_EQ(o.ctx != nullptr, ok);
      if (!ok) {
        EXPECT_EQ(o.err, ec::stale_epoch);
        ++stales;
        continue;
      }
      const bool fits = ref.grow(id, n, now);
      auto err = s->reserve(*o.ctx, n);
      ASSERT_EQ(!err, fits);
      if (!fits) {
        EXPECT_EQ(err, ec::budget_exceeded);
        ++budget;
        continue;
      }
      std::vector<int32_t> t(static_cast<std::size_t>(n), 9);
      shard->forward(t, model::consecutive_positions(0, n), o.ctx->cache);
      s->committed(*o.ctx, ++step, 0);
    } else if (kind < 11) {
      auto it = ref.at(id);
      const int64_t past = it != ref.lru.end() && rng() % 8 != 0 ? it->len : static_cast<int64_t>(rng() % 50);
      auto f = s->find(id, key_of(id), epoch, past, ++step);
      const int want = ref.find(id, epoch, past, now);
      if (want == -1) {
        EXPECT_EQ(f.err, ec::stale_epoch);
        ++stales;
        continue;
      }
      if (want != 0) {
        ASSERT_EQ(f.ctx, nullptr) << "reference expects miss " << msg::to_string(static_cast<miss_reason>(want));
        EXPECT_EQ(static_cast<int>(f.miss), want) << msg::to_string(f.miss);
        ++misses;
        continue;
      }
      ASSERT_NE(f.ctx, nullptr) << "store missed (" << msg::to_string(f.miss) << ") where the reference hits";
      ++hits;
      if (!ref.grow(id, 1, now)) {
        EXPECT_EQ(s->reserve(*f.ctx, past + 1), ec::budget_exceeded);
        continue;
      }
      ASSERT_FALSE(s->reserve(*f.ctx, past + 1));
      std::vector<int32_t> t = {5};
      shard->forward(t, model::consecutive_positions(past, 1), f.ctx->cache);
      s->committed(*f.ctx, step, past);
    } else {
      s->release(id, key_of(id));
      ref.release(id);
    }
    ASSERT_EQ(s->sessions(), ref.lru.size());
    ASSERT_EQ(s->bytes(), ref.bytes());
    ASSERT_LE(s->bytes(), lim.max_bytes);
  }
  // The run exercised every path.
  EXPECT_GT(hits, 100);
  EXPECT_GT(misses, 50);
  EXPECT_GT(stales, 5);
  EXPECT_GT(budget, 0);
  EXPECT_GT(s->counters().evictions_lru, 0u);
  EXPECT_GT(s->counters().evictions_ttl, 0u);
}

} // namespace
} // namespace strata
