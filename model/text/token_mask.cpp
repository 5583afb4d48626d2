#include "model/text/token_mask.hpp"

#include "model/base/error.hpp"

#include <algorithm>
#include <map>

namespace strata::model {

namespace {
constexpr std::size_t masks_kept = 2048;     // per constraint
constexpr std::size_t constraints_kept = 16; // per vocabulary
} // namespace

// ---------------------------------------------------------------- vocabulary

TokenVocabulary::TokenVocabulary(const Tokenizer& tok, int64_t model_vocab)
    : vocab_(std::max(tok.vocab_size(), model_vocab)) {
  const auto V = static_cast<std::size_t>(vocab_);
  bytes_.resize(V);
  first_bytes_.resize(V);
  control_.assign(V, 0);
  for (std::size_t i = 0; i < static_cast<std::size_t>(tok.vocab_size()); ++i) {
    const auto id = static_cast<int32_t>(i);
    try {
      // Bytes in the middle of a text (after an ordinary token) and at its start
      // (SentencePiece drops the leading space there).
      bytes_[i] = tok.token_bytes(id, tok.bos_id() == 0 ? 1 : 0);
      first_bytes_[i] = tok.token_bytes(id, -1);
    } catch (const Error&) {
      continue; // a gap in the vocabulary: never allowed
    }
    if (first_bytes_[i] != bytes_[i])
      has_first_ = true;
    const auto sp = tok.find_special(bytes_[i]);
    if (sp.size() == 1 && sp[0].first == 0 && sp[0].second == bytes_[i].size())
      control_[i] = 1;
  }
  rest_ = build(bytes_);
  if (has_first_)
    first_ = build(first_bytes_);
}

TokenVocabulary::Trie TokenVocabulary::build(const std::vector<std::string>& bytes) {
  // Sort ids by bytes; a trie in CSR form falls out of one pass over the sorted list.
  std::vector<int32_t> order;
  for (std::size_t i = 0; i < bytes.size(); ++i)
    if (!bytes[i].empty())
      order.push_back(static_cast<int32_t>(i));
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return bytes[static_cast<std::size_t>(a)] < bytes[static_cast<std::size_t>(b)];
  });
  // Build with explicit child lists first.
  struct N {
    std::map<uint8_t, int32_t> kids;
    std::vector<int32_t> toks;
  };
  std::vector<N> nodes(1);
  for (int32_t id : order) {
    int32_t cur = 0;
    for (char c : bytes[static_cast<std::size_t>(id)]) {
      const auto b = static_cast<uint8_t>(c);
      auto it = nodes[static_cast<std::size_t>(cur)].kids.find(b);
      if (it == nodes[static_cast<std::size_t>(cur)].kids.end()) {
        const auto n = static_cast<int32_t>(nodes.size());
        nodes[static_cast<std::size_t>(cur)].kids.emplace(b, n);
        nodes.emplace_back();
        cur = n;
      } else {
        cur = it->second;
      }
    }
    nodes[static_cast<std::size_t>(cur)].toks.push_back(id);
  }
  Trie t;
  t.child_begin.reserve(nodes.size() + 1);
  t.token_begin.reserve(nodes.size() + 1);
  for (const auto& n : nodes) {
    t.child_begin.push_back(static_cast<int32_t>(t.child.size()));
    t.token_begin.push_back(static_cast<int32_t>(t.tokens.size()));
    for (const auto& [b, k] : n.kids) {
      t.child.push_back(k);
      t.byte.push_back(b);
    }
    t.tokens.insert(t.tokens.end(), n.toks.begin(), n.toks.end());
  }
  t.child_begin.push_back(static_cast<int32_t>(t.child.size()));
  t.token_begin.push_back(static_cast<int32_t>(t.tokens.size()));
  return t;
}

std::shared_ptr<Constraint> TokenVocabulary::constraint(const std::string& grammar_text) {
  {
    std::lock_guard lock(mu_);
    for (auto it = constraints_.begin(); it != constraints_.end(); ++it)
      if (it->first == grammar_text) {
        constraints_.splice(constraints_.begin(), constraints_, it);
        return it->second;
      }
  }
  auto c = std::make_shared<Constraint>(Grammar::parse(grammar_text), *this); // outside the lock: may take a while
  std::lock_guard lock(mu_);
  constraints_.emplace_front(grammar_text, c);
  if (constraints_.size() > constraints_kept)
    constraints_.pop_back();
  return c;
}

// ---------------------------------------------------------------- constraint

Constraint::Constraint(std::shared_ptr<const Grammar> g, const TokenVocabulary& vocab)
    : vocab_(vocab), aut_(std::move(g)) {
  const auto V = static_cast<std::size_t>(vocab.size());
  eligible_.assign(V, 1);
  const auto& lits = aut_.grammar().literals();
  for (std::size_t i = 0; i < V; ++i) {
    if (!vocab.control(static_cast<int32_t>(i)))
      continue;
    const auto& b = vocab.bytes(static_cast<int32_t>(i), false);
    eligible_[i] = std::any_of(lits.begin(), lits.end(), [&](const std::string& l) { return l.find(b) != std::string::npos; });
  }
}

std::shared_ptr<const TokenBits> Constraint::allowed(int32_t state, bool first) {
  const int64_t key = static_cast<int64_t>(state) * 2 + (first ? 1 : 0);
  {
    std::lock_guard lock(mu_);
    auto it = masks_.find(key);
    if (it != masks_.end()) {
      lru_.splice(lru_.begin(), lru_, it->second.second);
      return it->second.first;
    }
  }
  auto bits = std::make_shared<TokenBits>(vocab_.words(), 0);
  if (state >= 0) {
    const auto& t = vocab_.trie(first);
    struct Item {
      int32_t node, state;
    };
    std::vector<Item> work{{0, state}};
    auto lock = aut_.lock();
    while (!work.empty()) {
      const Item it = work.back();
      work.pop_back();
      const auto n = static_cast<std::size_t>(it.node);
      for (auto c = t.child_begin[n]; c < t.child_begin[n + 1]; ++c) {
        const int32_t s = aut_.next_locked(it.state, t.byte[static_cast<std::size_t>(c)]);
        if (s == GrammarAutomaton::dead)
          continue;
        const auto k = static_cast<std::size_t>(t.child[static_cast<std::size_t>(c)]);
        for (auto i = t.token_begin[k]; i < t.token_begin[k + 1]; ++i) {
          const auto id = t.tokens[static_cast<std::size_t>(i)];
          if (eligible_[static_cast<std::size_t>(id)])
            (*bits)[static_cast<std::size_t>(id) >> 6] |= uint64_t{1} << (id & 63);
        }
        work.push_back({static_cast<int32_t>(k), s});
      }
    }
  }
  std::lock_guard lock(mu_);
  ++walks_;
  auto it = masks_.find(key);
  if (it != masks_.end())
    return it->second.first; // another session computed it meanwhile
  lru_.push_front(key);
  masks_.emplace(key, std::make_pair(bits, lru_.begin()));
  if (masks_.size() > masks_kept) {
    masks_.erase(lru_.back());
    lru_.pop_back();
  }
  return bits;
}

int32_t Constraint::after(int32_t state, int32_t id, bool first) {
  if (id < 0 || id >= vocab_.size() || !eligible_[static_cast<std::size_t>(id)])
    return GrammarAutomaton::dead;
  const auto& b = vocab_.bytes(id, first);
  if (b.empty())
    return GrammarAutomaton::dead;
  return aut_.next(state, b);
}

bool ConstraintMatcher::accept(int32_t id) {
  const int32_t s = c_->after(state_, id, first_);
  if (s == GrammarAutomaton::dead)
    return false;
  state_ = s;
  first_ = false;
  return true;
}

} // namespace strata::model
