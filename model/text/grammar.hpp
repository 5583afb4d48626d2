#pragma once
// Grammars over bytes for constrained decoding: a GBNF-like text form, its
// parser, and a matcher that follows bytes through it (a pushdown automaton
// whose stacks are interned, so equal states get equal ids and every
// transition is computed once per grammar). Torch-free.
//
// Text form (one rule per `name ::= ...`, the first rule is the root):
//   "literal"   bytes, with escapes \n \r \t \\ \" \xHH
//   [a-z\x80-\xff]  a byte class; [^...] its complement
//   name        another rule
//   ( ... )     a group; `|` separates alternatives
//   x*  x+  x?  x{m}  x{m,}  x{m,n}   repetitions
//   # to the end of the line: a comment
// Left recursion and rules that can repeat an empty match forever are refused.
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace strata::model {

/// A parsed grammar: rules of alternatives of elements, flattened.
class Grammar {
public:
  /// Parses the text form. Throws Error(bad_argument) naming the line and what
  /// is wrong (unknown rule, bad class, left recursion, too large).
  static std::shared_ptr<const Grammar> parse(std::string_view text);

  /// An element: a byte class (lo..hi ranges), a rule reference, or the end of
  /// an alternative.
  struct Element {
    enum Kind : uint8_t { bytes, rule, end } kind = end;
    int32_t rule_id = -1;         ///< kind == rule
    std::vector<uint64_t> set;    ///< kind == bytes: 256 bits
    bool has(uint8_t b) const { return (set[b >> 6] >> (b & 63)) & 1; }
  };
  const std::vector<Element>& elements() const { return elements_; }
  /// Rule r's alternatives: the element index where each starts.
  const std::vector<int32_t>& alternatives(int32_t r) const { return rules_[static_cast<std::size_t>(r)]; }
  std::size_t rule_count() const { return rules_.size(); }
  /// Every quoted literal of the text (what special tokens may spell).
  const std::vector<std::string>& literals() const { return literals_; }
  const std::string& text() const { return text_; }

  /// Upper bound on elements a grammar may have (a client's schema expands into one).
  static constexpr std::size_t max_elements = 200000;

private:
  friend class GrammarParser;
  std::vector<Element> elements_;
  std::vector<std::vector<int32_t>> rules_;
  std::vector<std::string> literals_;
  std::string text_;
};

/// Follows bytes through a grammar. States are interned sets of stacks: equal
/// states have equal ids, and a state's transition on a byte is computed once.
/// Thread-safe (one mutex); many sessions may share one automaton.
class GrammarAutomaton {
public:
  explicit GrammarAutomaton(std::shared_ptr<const Grammar> g);
  static constexpr int32_t dead = -1;
  /// The state before any byte.
  int32_t start() const { return start_; }
  /// The state after byte b, or dead.
  int32_t next(int32_t state, uint8_t b);
  /// The state after `bytes`, or dead.
  int32_t next(int32_t state, std::string_view bytes);
  /// Whether the text so far is a complete sentence.
  bool accepting(int32_t state);
  /// Whether some byte may follow.
  bool can_continue(int32_t state);
  const Grammar& grammar() const { return *g_; }
  std::size_t state_count();
  /// For walks of many bytes (a vocabulary's trie): hold lock() and call next_locked.
  std::unique_lock<std::mutex> lock() { return std::unique_lock<std::mutex>(mu_); }
  int32_t next_locked(int32_t state, uint8_t b) { return step_locked(state, b); }

private:
  using Stack = int32_t; // an interned stack node; 0 = the empty stack
  struct Node {
    int32_t pos;    // element index of the next element to match
    Stack parent;   // what follows once this alternative ends
  };
  Stack node(int32_t pos, Stack parent);
  void expand(Stack s, std::vector<Stack>& out, std::vector<Stack>& seen);
  int32_t intern_state(std::vector<Stack> stacks);
  int32_t step_locked(int32_t state, uint8_t b);

  std::shared_ptr<const Grammar> g_;
  std::mutex mu_;
  std::vector<Node> nodes_;
  std::unordered_map<uint64_t, Stack> node_ids_;
  std::vector<std::vector<Stack>> states_;       // sorted tops (byte-class nodes, or 0)
  std::unordered_map<std::string, int32_t> state_ids_;
  std::vector<std::vector<int32_t>> trans_;      // per state: 256 entries, -2 = unknown
  int32_t start_ = 0;
};

} // namespace strata::model
