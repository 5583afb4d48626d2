#include "actors/drafter.hpp"

#include "model/base/error.hpp"
#include "model/transformer/math_thread.hpp"
#include "model/transformer/sampler.hpp"

#include <algorithm>
#include <unordered_set>

namespace strata::actors {

namespace {

// One request's work in a batch.
struct Job {
  std::size_t request = 0;
  std::list<drafter_state::Entry>::iterator entry;
  std::span<const int32_t> rest; // what the cache lacks of the sequence
  std::size_t fed = 0;           // of rest
  uint32_t k = 0;
  std::vector<int32_t> piece;    // this pass's rows
  std::vector<int64_t> positions;
  bool done = false;
};

} // namespace

std::vector<drafter_state::Answer> drafter_state::propose_all(const std::vector<Request>& requests) {
  const auto& cfg = model->config();
  std::vector<Answer> answers(requests.size());
  std::vector<bool> served(requests.size(), false);
  std::vector<std::string> dropped; // sessions whose request failed: their caches go
  for (;;) {
    // A batch: the first waiting request of each session (at most max_sessions
    // of them: every one of them keeps its cache for the whole batch).
    std::vector<Job> jobs;
    std::unordered_set<std::string> in_batch;
    for (std::size_t i = 0; i < requests.size() && jobs.size() < limits.max_sessions; ++i) {
      if (served[i] || !in_batch.insert(requests[i].session).second)
        continue;
      served[i] = true;
      const auto& rq = requests[i];
      uint32_t k = std::min<uint32_t>(rq.k, msg::max_draft);
      if (!rq.seq.empty() && static_cast<int64_t>(rq.seq.size()) + k > cfg.max_seq_len)
        k = static_cast<uint32_t>(std::max<int64_t>(0, cfg.max_seq_len - static_cast<int64_t>(rq.seq.size())));
      if (rq.seq.empty() || k == 0)
        continue; // nothing to propose
      auto it = index.find(rq.session);
      if (it == index.end()) {
        // Room for one more session: the least recently used ones not in this batch go.
        while (lru.size() >= limits.max_sessions && evict_outside(in_batch)) {
        }
        lru.push_front(Entry{rq.session, model::KVCache(pool), {}});
        it = index.emplace(rq.session, lru.begin()).first;
      } else {
        lru.splice(lru.begin(), lru, it->second);
      }
      auto& e = *it->second;
      // Keep the longest common prefix (always recomputing the last token,
      // whose logits give the first proposal).
      std::size_t c = 0;
      while (c < e.tokens.size() && c + 1 < rq.seq.size() && e.tokens[c] == rq.seq[c])
        ++c;
      try {
        e.cache.truncate(static_cast<int64_t>(c));
      } catch (const model::Error&) { // a window that cannot go back that far: start over
        e.cache = model::KVCache(pool);
        c = 0;
      }
      e.tokens.resize(c);
      Job j;
      j.request = i;
      j.entry = it->second;
      j.rest = std::span<const int32_t>(rq.seq.data() + c, rq.seq.size() - c);
      j.k = k;
      jobs.push_back(std::move(j));
    }
    if (jobs.empty())
      break;
    // Passes until every job has its k proposals: the rest of each sequence in
    // pieces (the last piece's logits propose), then a token a pass.
    constexpr std::size_t chunk = 256;
    for (;;) {
      std::vector<model::SeqStep> batch;
      std::vector<Job*> in;
      for (auto& j : jobs) {
        if (j.done)
          continue;
        auto& e = *j.entry;
        auto& out = answers[j.request].tokens;
        bool emit = true;
        if (j.fed < j.rest.size()) {
          const std::size_t n = std::min(chunk, j.rest.size() - j.fed);
          j.piece.assign(j.rest.begin() + static_cast<std::ptrdiff_t>(j.fed),
                         j.rest.begin() + static_cast<std::ptrdiff_t>(j.fed + n));
          emit = j.fed + n == j.rest.size();
        } else {
          j.piece.assign(1, out.back());
        }
        const auto L = static_cast<int64_t>(e.tokens.size());
        const auto n = static_cast<int64_t>(j.piece.size());
        // A full pool makes room from the least recently used sessions outside this batch.
        while (e.cache.blocks_missing(L + n) > pool->available() && evict_outside(in_batch)) {
        }
        if (!e.cache.reserve(L + n)) {
          answers[j.request].error = model::Error(model::errc::cache_full, "the draft model's cache cannot hold " +
                                                                              std::to_string(L + n) + " positions");
          j.done = true;
          continue;
        }
        j.positions = model::consecutive_positions(L, n);
        model::SeqStep st;
        st.tokens = j.piece;
        st.positions = j.positions;
        st.cache = &e.cache;
        st.emit = emit;
        batch.push_back(st);
        in.push_back(&j);
      }
      if (batch.empty())
        break;
      auto outs = model::run_math([&] { return model->forward(batch); });
      ++passes;
      for (std::size_t b = 0; b < in.size(); ++b) {
        Job& j = *in[b];
        auto& answer = answers[j.request];
        if (outs[b].error) {
          answer.error = std::move(outs[b].error);
          j.done = true;
          continue;
        }
        auto& e = *j.entry;
        e.tokens.insert(e.tokens.end(), j.piece.begin(), j.piece.end());
        computed += j.piece.size();
        if (j.fed < j.rest.size()) {
          j.fed += j.piece.size();
          if (j.fed < j.rest.size())
            continue; // not the last piece: no logits
        }
        answer.tokens.push_back(model::Sampler::argmax(outs[b].out.logits));
        if (answer.tokens.size() >= j.k) {
          j.done = true;
          ++proposals;
        }
      }
    }
    for (auto& j : jobs)
      if (answers[j.request].error) {
        answers[j.request].tokens.clear();
        dropped.push_back(requests[j.request].session);
      }
  }
  for (const auto& session : dropped)
    drop(session);
  return answers;
}

bool drafter_state::crowded(const std::string& session, std::chrono::steady_clock::time_point now) {
  drafting[session] = now;
  return limits.max_crowd > 0 && crowd(now) > limits.max_crowd;
}

std::size_t drafter_state::crowd(std::chrono::steady_clock::time_point now) {
  // (Sessions that ended without a release go too.)
  std::erase_if(drafting, [&](const auto& d) { return now - d.second > limits.crowd_idle; });
  return drafting.size();
}

bool drafter_state::evict_outside(const std::unordered_set<std::string>& keep) {
  for (auto it = lru.end(); it != lru.begin();) {
    --it;
    if (keep.count(it->session) == 0) {
      index.erase(it->session);
      lru.erase(it);
      return true;
    }
  }
  return false;
}

void drafter_state::drop(const std::string& session) {
  if (auto it = index.find(session); it != index.end()) {
    lru.erase(it->second);
    index.erase(it);
  }
}

std::vector<int32_t> drafter_state::propose(const std::string& session, const std::vector<int32_t>& seq, uint32_t k) {
  auto answers = propose_all({Request{session, seq, k}});
  if (answers[0].error)
    throw *answers[0].error;
  return std::move(answers[0].tokens);
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
      auto& st = self->state;
      for (auto id : seq)
        if (id < 0 || id >= st.model->config().vocab_size)
          return caf::make_error(ec::bad_request, "token " + std::to_string(id) + " is outside the draft model's vocabulary");
      if (st.crowded(session, std::chrono::steady_clock::now())) {
        ++st.declined; // too many drafting at once: this step goes without proposals
        return std::vector<int32_t>{};
      }
      // Answered at the next round, with every request that came before it.
      auto rp = self->make_response_promise<std::vector<int32_t>>();
      st.queued.emplace_back(drafter_state::Request{session, seq, k}, rp);
      if (!st.round_pending) {
        st.round_pending = true;
        self->send(self, atom::round_atom_v);
      }
      return rp;
    },
    [=](atom::round_atom) {
      auto& st = self->state;
      st.round_pending = false;
      auto queued = std::move(st.queued);
      st.queued.clear();
      if (queued.empty())
        return;
      std::vector<drafter_state::Request> requests;
      requests.reserve(queued.size());
      for (auto& q : queued)
        requests.push_back(std::move(q.first));
      try {
        auto answers = st.propose_all(requests);
        for (std::size_t i = 0; i < queued.size(); ++i)
          if (answers[i].error)
            queued[i].second.deliver(caf::make_error(ec::model_error, std::string("draft model failed: ") + answers[i].error->what()));
          else
            queued[i].second.deliver(std::move(answers[i].tokens));
      } catch (const std::exception& e) { // nothing escapes a handler: these sessions step without proposals
        for (auto& r : requests)
          st.drop(r.session);
        for (auto& q : queued)
          if (q.second.pending())
            q.second.deliver(caf::make_error(ec::model_error, std::string("draft model failed: ") + e.what()));
      }
    },
    [=](atom::release_atom, const std::string& session) {
      self->state.drop(session);
      self->state.drafting.erase(session);
    },
    [=](atom::stats_atom) -> caf::result<uint64_t, uint64_t, uint64_t, uint64_t, uint64_t> {
      auto& st = self->state;
      return {st.proposals, st.computed, st.passes, st.declined,
              static_cast<uint64_t>(st.crowd(std::chrono::steady_clock::now()))};
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
