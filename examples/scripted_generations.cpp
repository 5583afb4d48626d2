// An example actor that scripts several generations against a strata route,
// prints tokens as they stream, then injects a cache eviction and a shard kill
// mid-generation and shows that the text comes out the same.
//
//   build/scripted_generations [--model PATH|builtin:NAME] [--shards 0-1,2-3,4]
//   build/scripted_generations --cluster HOST:PORT      (a running cluster of processes)
//
// The script itself is an actor (`director`): it spawns one session actor per
// generation with itself as the client, and reacts to token_event /
// generation_result / error messages. Injections happen from the token stream,
// the way an operator would pull a plug mid-sentence.

#include "actors/cluster.hpp"
#include "messages/session_id.hpp"
#include "model/text/tokenizer.hpp"
#include "runtime/cluster.hpp"

#include <caf/all.hpp>

#include <cstdio>
#include <cstring>
#include <iostream>

using namespace strata;

namespace {

struct Script {
  std::string title;
  std::string prompt;
  std::vector<actors::Injection> inject;
};

// Where the generations run: shard actors in this process, or a cluster of processes.
struct Target {
  msg::supervisor_actor supervisor;
  actors::SessionOptions opts;
  model::ModelConfig cfg;
  std::function<void(const actors::Injection&, const std::string&)> apply;
};

struct director_state {
  Target* cluster = nullptr;
  const model::Tokenizer* tok = nullptr;
  std::vector<Script> scripts;
  std::size_t current = 0;
  std::vector<std::vector<int32_t>> outputs;
  std::unique_ptr<model::StreamDecoder> dec;
  std::vector<bool> fired;
  static inline const char* name = "director";
};

using director = caf::stateful_actor<director_state>;

void start_next(director* self) {
  auto& st = self->state;
  if (st.current == st.scripts.size()) {
    std::printf("\n== summary\n");
    for (std::size_t i = 0; i < st.scripts.size(); ++i)
      std::printf("%-34s %zu tokens\n", st.scripts[i].title.c_str(), st.outputs[i].size());
    const bool same = st.outputs[0] == st.outputs[2] && st.outputs[0] == st.outputs[3];
    std::printf("identical with and without failures: %s\n", same ? "yes" : "NO");
    self->quit(same ? caf::error{} : caf::make_error(ec::retries_exhausted, "outputs differ"));
    return;
  }
  const auto& s = st.scripts[st.current];
  std::printf("\n== %s\n", s.title.c_str());
  msg::generation_request req;
  req.session = msg::mint_session_id("example");
  req.prompt = st.tok->encode(s.prompt, true);
  req.max_tokens = 60;
  req.stop_ids = st.cluster->cfg.eos_ids;
  st.dec = std::make_unique<model::StreamDecoder>(*st.tok);
  std::string head;
  for (auto id : req.prompt)
    head += st.dec->push(id);
  std::fwrite(head.data(), 1, head.size(), stdout);
  st.fired.assign(s.inject.size(), false);
  for (auto& inj : s.inject)
    req.pause_after.push_back(inj.at_token); // the session waits there for us
  st.outputs.emplace_back();
  actors::spawn_session(self->system(), st.cluster->supervisor, caf::actor_cast<msg::session_client_actor>(self), req,
                        st.cluster->opts);
}

caf::behavior director_actor(director* self, Target* cluster, const model::Tokenizer* tok,
                             std::vector<Script> scripts) {
  self->state.cluster = cluster;
  self->state.tok = tok;
  self->state.scripts = std::move(scripts);
  // A session's failure arrives as an error message: CAF 0.17 hands those to the
  // error handler of an event-based actor, not to its behavior.
  self->set_error_handler([=](caf::error& e) {
    std::printf("\n-- generation failed: %s\n", self->system().render(e).c_str());
    self->quit(e);
  });
  start_next(self);
  return {
    [=](msg::token_event& ev) {
      auto& st = self->state;
      st.outputs.back().push_back(ev.token);
      const auto piece = st.dec->push(ev.token);
      std::fwrite(piece.data(), 1, piece.size(), stdout);
      std::fflush(stdout);
      const auto& inj = st.scripts[st.current].inject;
      for (std::size_t k = 0; k < inj.size(); ++k)
        if (!st.fired[k] && inj[k].at_token == ev.index + 1) {
          st.fired[k] = true;
          const char* what = inj[k].kind == actors::Injection::kill ? "kill" : "evict";
          std::printf(" [%s shard %lld] ", what, static_cast<long long>(inj[k].shard));
          std::fflush(stdout);
          st.cluster->apply(inj[k], ev.session);
          self->send(caf::actor_cast<msg::session_actor>(self->current_sender()), atom::resume_atom_v);
        }
    },
    [=](msg::generation_result& r) {
      auto& st = self->state;
      uint64_t misses = 0;
      for (auto m : r.misses)
        misses += m;
      std::printf("%s\n-- %zu tokens, finish=%s, prefill %.1f ms, total %.1f ms, cache misses %llu, recoveries %llu, "
                  "recomputed %llu layer-tokens (full re-prefill: %llu), route changes %llu\n",
                  st.dec->finish().c_str(), r.ids.size(), r.finish.c_str(), r.prefill_ms, r.total_ms,
                  static_cast<unsigned long long>(misses), static_cast<unsigned long long>(r.reprefills),
                  static_cast<unsigned long long>(r.recomputed_layer_tokens),
                  static_cast<unsigned long long>(r.full_layer_tokens), static_cast<unsigned long long>(r.route_changes));
      ++st.current;
      start_next(self);
    },
  };
}

} // namespace

int run(int argc, char** argv) {
  std::string model = "builtin:tiny", shards = "0-1,2-3,4", cluster_address;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--model") == 0)
      model = argv[i + 1];
    else if (std::strcmp(argv[i], "--shards") == 0)
      shards = argv[i + 1];
    else if (std::strcmp(argv[i], "--cluster") == 0)
      cluster_address = argv[i + 1];
    else {
      std::fprintf(stderr, "usage: scripted_generations [--model PATH|builtin:NAME] [--shards RANGES] "
                           "[--cluster HOST:PORT]\n");
      return 2;
    }
  }
  try {
    // strata's types + the middleman (used only with --cluster); never torn down (see client_system)
    caf::actor_system& sys = runtime::client_system();
    std::unique_ptr<actors::LocalCluster> local;
    Target target;
    if (cluster_address.empty()) {
      local = std::make_unique<actors::LocalCluster>(sys, model, model::parse_layer_ranges(shards));
      target = {local->supervisor(), local->session_options(), local->config(),
                [&](const actors::Injection& inj, const std::string& s) { local->apply(inj, s); }};
    } else {
      auto sup = runtime::connect_coordinator(sys, runtime::parse_endpoint(cluster_address, "cluster"));
      caf::scoped_actor self{sys};
      msg::route_info plan;
      self->request(sup, std::chrono::seconds(30), atom::route_atom_v, std::vector<msg::shard_actor>{})
        .receive([&](msg::route_info& r) { plan = std::move(r); }, [](caf::error&) {});
      if (plan.hops.empty()) {
        std::fprintf(stderr, "scripted_generations: the cluster at %s has no complete route\n", cluster_address.c_str());
        return 1;
      }
      target.supervisor = sup;
      target.cfg = runtime::cluster_model(sys, sup).to_config(); // from the cluster, no model files
      target.opts.max_context = target.cfg.max_seq_len;
      target.apply = [&sys, sup](const actors::Injection& inj, const std::string& s) {
        // Against processes an evicted cache and a killed node (replica or restart needed).
        runtime::apply_remote_injection(sys, sup, inj, s);
      };
    }
    auto tok = model::default_tokenizer_for(target.cfg);
    if (!tok) {
      std::fprintf(stderr, "scripted_generations: %s brings no tokenizer; use builtin:tiny\n", target.cfg.identity.c_str());
      return 2;
    }
    const std::string story = "Once upon a time";
    std::vector<Script> scripts = {
      {"plain generation", story, {}},
      {"another prompt", "The little robot", {}},
      {"same story, shard 1 evicts at token 15", story,
       {actors::Injection{actors::Injection::evict, 1, 15, msg::miss_reason::evicted_lru}}},
      {"same story, shard 0 killed at token 25", story, {actors::Injection{actors::Injection::kill, 0, 25, {}}}},
    };
    caf::error result;
    {
      caf::scoped_actor self{sys};
      // Detached: the director blocks on the cluster's injection calls.
      auto d = self->spawn<caf::monitored + caf::detached>(director_actor, &target, tok.get(), scripts);
      self->receive([&](caf::down_msg& dm) { result = dm.reason; });
    }
    return result ? 1 : 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "scripted_generations: error: %s\n", e.what());
    return 1;
  }
}

int main(int argc, char** argv) {
  runtime::end_process(run(argc, argv));
}
