#include "actors/drafter.hpp"

#include "model/base/error.hpp"
#include "model/transformer/math_thread.hpp"
#include "model/transformer/sampler.hpp"

#include <algorithm>

namespace strata::actors {

std::vector<int32_t> drafter_state::propose(const std::string& session, const std::vector<int32_t>& seq, uint32_t k) {
  const auto& cfg = model->config();
  k = std::min<uint32_t>(k, msg::max_draft);
  if (seq.empty() || k == 0)
    return {};
  if (static_cast<int64_t>(seq.size()) + k > cfg.max_seq_len)
    k = static_cast<uint32_t>(std::max<int64_t>(0, cfg.max_seq_len - static_cast<int64_t>(seq.size())));
  if (k == 0)
    return {};
  auto it = index.find(session);
  if (it == index.end()) {
    while (lru.size() >= limits.max_sessions) {
      index.erase(lru.back().session);
      lru.pop_back();
    }
    lru.push_front(Entry{session, model::KVCache(pool), {}});
    it = index.emplace(session, lru.begin()).first;
  } else {
    lru.splice(lru.begin(), lru, it->second);
  }
  auto& e = *it->second;
  // Keep the longest common prefix (always recomputing the last token, whose
  // logits give the first proposal).
  std::size_t c = 0;
  while (c < e.tokens.size() && c + 1 < seq.size() && e.tokens[c] == seq[c])
    ++c;
  try {
    e.cache.truncate(static_cast<int64_t>(c));
  } catch (const model::Error&) { // a window that cannot go back that far: start over
    e.cache = model::KVCache(pool);
    c = 0;
  }
  e.tokens.resize(c);
  auto run = [&](std::span<const int32_t> tokens) {
    const auto L = static_cast<int64_t>(e.tokens.size());
    const auto n = static_cast<int64_t>(tokens.size());
    // A full pool makes room from the least recently used other sessions (e is
    // at the front: it was just used).
    while (e.cache.blocks_missing(L + n) > pool->available() && lru.size() > 1) {
      index.erase(lru.back().session);
      lru.pop_back();
    }
    if (!e.cache.reserve(L + n))
      throw model::Error(model::errc::cache_full, "the draft model's cache cannot hold " + std::to_string(L + n) +
                                                    " positions");
    auto out = model::run_math([&] { return model->forward(tokens, model::consecutive_positions(L, n), e.cache); });
    e.tokens.insert(e.tokens.end(), tokens.begin(), tokens.end());
    computed += static_cast<uint64_t>(n);
    return model::Sampler::argmax(out.logits);
  };
  const std::span<const int32_t> rest(seq.data() + c, seq.size() - c);
  std::vector<int32_t> out;
  // The rest of the sequence in pieces (the last piece's logits propose).
  constexpr std::size_t chunk = 256;
  int32_t next = -1;
  for (std::size_t i = 0; i < rest.size(); i += chunk)
    next = run(rest.subspan(i, std::min(chunk, rest.size() - i)));
  out.push_back(next);
  while (out.size() < k) {
    const int32_t t = out.back();
    out.push_back(run(std::span<const int32_t>(&t, 1)));
  }
  ++proposals;
  return out;
}

drafter_actor::behavior_type drafter(drafter_self self, std::shared_ptr<model::Shard> model, DrafterLimits limits) {
  auto& st = self->state;
  st.model = std::move(model);
  st.limits = limits;
  st.pool = st.model->new_pool(limits.cache_bytes);
  st.pool->set_prefix_cache(false);
  return {
    [=](atom::propose_atom, const std::string& session, const std::vector<int32_t>& seq,
        uint32_t k) -> caf::result<std::vector<int32_t>> {
      try {
        for (auto id : seq)
          if (id < 0 || id >= self->state.model->config().vocab_size)
            return caf::make_error(ec::bad_request, "token " + std::to_string(id) + " is outside the draft model's vocabulary");
        return self->state.propose(session, seq, k);
      } catch (const std::exception& e) { // nothing escapes a handler: the session steps without proposals
        auto& st = self->state;
        if (auto it = st.index.find(session); it != st.index.end()) {
          st.lru.erase(it->second);
          st.index.erase(it);
        }
        return caf::make_error(ec::model_error, std::string("draft model failed: ") + e.what());
      }
    },
    [=](atom::release_atom, const std::string& session) {
      auto& st = self->state;
      if (auto it = st.index.find(session); it != st.index.end()) {
        st.lru.erase(it->second);
        st.index.erase(it);
      }
    },
  };
}

drafter_actor spawn_drafter(caf::actor_system& sys, const std::string& path, int64_t vocab_size,
                            const model::LoadOptions& load, DrafterLimits limits) {
  return spawn_drafter(sys, std::shared_ptr<model::Shard>(model::Shard::load(path, load)), vocab_size, limits);
}

drafter_actor spawn_drafter(caf::actor_system& sys, std::shared_ptr<model::Shard> m, int64_t vocab_size,
                            DrafterLimits limits) {
  if (!m->is_head() || !m->is_tail())
    throw model::Error(model::errc::bad_argument, "a draft model must be a whole model, not layers " +
                                                    std::to_string(m->range().first) + "-" + std::to_string(m->range().last));
  if (vocab_size > 0 && m->config().vocab_size != vocab_size)
    throw model::Error(model::errc::bad_argument, "the draft model '" + m->config().identity + "' has a vocabulary of " +
                                                    std::to_string(m->config().vocab_size) + " tokens, the model's is " +
                                                    std::to_string(vocab_size) + ": a draft must share the tokenizer");
  return sys.spawn<caf::detached>(drafter, std::move(m), limits);
}

} // namespace strata::actors
