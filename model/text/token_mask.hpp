#pragma once
// Constrained decoding over a tokenizer's vocabulary: which tokens a grammar
// allows next. The vocabulary's byte strings sit in a trie; a mask is one walk
// of the trie through the grammar's automaton (a branch ends where the grammar
// refuses a byte), and masks are kept per automaton state, so a state seen
// again (the inside of a string, the next array item) costs a lookup.
// Torch-free.
#include "model/text/grammar.hpp"
#include "model/text/tokenizer.hpp"

#include <atomic>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace strata::model {

/// A set of token ids as bits (bit i of word i / 64).
using TokenBits = std::vector<uint64_t>;

class TokenVocabulary;

/// One grammar over one vocabulary, shared by every session that uses it.
class Constraint {
public:
  Constraint(std::shared_ptr<const Grammar> g, const TokenVocabulary& vocab);
  GrammarAutomaton& automaton() { return aut_; }
  /// The tokens allowed in `state` (`first`: the generation's first token, whose
  /// bytes may differ at the start of a text). Stop tokens are not in it.
  std::shared_ptr<const TokenBits> allowed(int32_t state, bool first);
  /// The state after token `id` (dead: the grammar refuses it).
  int32_t after(int32_t state, int32_t id, bool first);
  /// Masks computed (not found kept) so far: for benchmarks and tests.
  uint64_t walks() const { return walks_.load(); }

private:
  const TokenVocabulary& vocab_;
  GrammarAutomaton aut_;
  std::vector<char> eligible_; // control tokens the grammar spells literally
  std::mutex mu_;
  std::list<int64_t> lru_;
  std::unordered_map<int64_t, std::pair<std::shared_ptr<const TokenBits>, std::list<int64_t>::iterator>> masks_;
  std::atomic<uint64_t> walks_{0};
};

/// A session's place in a constraint: the automaton state after its tokens.
class ConstraintMatcher {
public:
  explicit ConstraintMatcher(std::shared_ptr<Constraint> c) : c_(std::move(c)), state_(c_->automaton().start()) {}
  std::shared_ptr<const TokenBits> allowed() { return c_->allowed(state_, first_); }
  /// Takes a token; false (state unchanged) when the grammar refuses it.
  bool accept(int32_t id);
  bool complete() { return c_->automaton().accepting(state_); }
  bool can_continue() { return c_->automaton().can_continue(state_); }

private:
  std::shared_ptr<Constraint> c_;
  int32_t state_;
  bool first_ = true;
};

/// A tokenizer's byte strings as a trie, and the constraints compiled over it
/// (the last few kept by grammar text).
class TokenVocabulary {
public:
  /// `model_vocab`: the model's vocabulary when larger than the tokenizer's
  /// (padded embeddings): the ids past the tokenizer's are never allowed.
  explicit TokenVocabulary(const Tokenizer& tok, int64_t model_vocab = 0);
  int64_t size() const { return vocab_; }
  /// The constraint for a grammar text: parsed once, shared. Throws
  /// Error(bad_argument) for a grammar that does not parse.
  std::shared_ptr<Constraint> constraint(const std::string& grammar_text);
  /// Words of a TokenBits for this vocabulary.
  std::size_t words() const { return static_cast<std::size_t>((vocab_ + 63) / 64); }

  struct Trie {
    // Node n's children are child_[child_begin_[n] .. child_begin_[n + 1]) with bytes byte_[...];
    // tokens ending at node n are tokens_[token_begin_[n] .. token_begin_[n + 1]).
    std::vector<int32_t> child_begin, child, token_begin, tokens;
    std::vector<uint8_t> byte;
  };
  const Trie& trie(bool first) const { return first && has_first_ ? first_ : rest_; }
  const std::string& bytes(int32_t id, bool first) const {
    return first && has_first_ ? first_bytes_[static_cast<std::size_t>(id)] : bytes_[static_cast<std::size_t>(id)];
  }
  /// Control tokens (a tokenizer's special tokens): allowed only where a
  /// grammar spells their text.
  bool control(int32_t id) const { return control_[static_cast<std::size_t>(id)] != 0; }

private:
  static Trie build(const std::vector<std::string>& bytes);
  int64_t vocab_ = 0;
  std::vector<std::string> bytes_, first_bytes_;
  std::vector<char> control_;
  bool has_first_ = false;
  Trie rest_, first_;
  std::mutex mu_;
  std::list<std::pair<std::string, std::shared_ptr<Constraint>>> constraints_;
};

} // namespace strata::model
