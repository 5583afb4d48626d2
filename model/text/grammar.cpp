#include "model/text/grammar.hpp"

#include "model/base/error.hpp"

#include <algorithm>
#include <functional>

namespace strata::model {

// ---------------------------------------------------------------- parsing

class GrammarParser {
public:
  explicit GrammarParser(std::string_view text) : s_(text) {}

  std::shared_ptr<const Grammar> run() {
    auto g = std::make_shared<Grammar>();
    g_ = g.get();
    g_->text_ = std::string(s_);
    // First pass: rule names, in order (the first is the root).
    std::vector<std::pair<std::string, std::size_t>> heads; // name, offset of the body
    for (pos_ = 0; skip_space(true), pos_ < s_.size();) {
      const std::size_t at = pos_;
      std::string name = read_name();
      if (name.empty())
        fail(at, "a rule must start with a name");
      skip_space(false);
      if (s_.substr(pos_, 3) != "::=")
        fail(pos_, "expected '::=' after rule name '" + name + "'");
      pos_ += 3;
      if (ids_.count(name))
        fail(at, "rule '" + name + "' is defined twice");
      ids_.emplace(name, static_cast<int32_t>(ids_.size()));
      heads.emplace_back(name, pos_);
      skip_body();
    }
    if (heads.empty())
      fail(0, "the grammar has no rules");
    bodies_.resize(heads.size());
    g_->rules_.resize(heads.size());
    for (std::size_t r = 0; r < heads.size(); ++r) {
      pos_ = heads[r].second;
      bodies_[r] = parse_alternatives(0);
      skip_space(true);
      if (pos_ < s_.size() && !at_rule_start())
        fail(pos_, "unexpected '" + std::string(1, s_[pos_]) + "'");
    }
    // Lower every body (and the helper rules repetitions make) into elements.
    for (std::size_t r = 0; r < heads.size(); ++r) // (helper rules are lowered with the rule that made them)
      lower_rule(static_cast<int32_t>(r), bodies_[r]);
    check_recursion();
    return g;
  }

private:
  // A parsed expression before lowering.
  struct Expr {
    enum Kind { alt, seq, bytes, ref, repeat } kind = seq;
    std::vector<Expr> items;    // alt: alternatives; seq: elements; repeat: the one item
    std::vector<uint64_t> set;  // bytes
    int32_t rule = -1;          // ref
    int min = 0, max = -1;      // repeat (-1: unbounded)
  };

  [[noreturn]] void fail(std::size_t at, const std::string& what) const {
    std::size_t line = 1 + static_cast<std::size_t>(std::count(s_.begin(), s_.begin() + static_cast<long>(std::min(at, s_.size())), '\n'));
    throw Error(errc::bad_argument, "grammar line " + std::to_string(line) + ": " + what);
  }

  void skip_space(bool newlines) {
    while (pos_ < s_.size()) {
      const char c = s_[pos_];
      if (c == '#') {
        while (pos_ < s_.size() && s_[pos_] != '\n')
          ++pos_;
      } else if (c == ' ' || c == '\t' || c == '\r' || (newlines && c == '\n')) {
        ++pos_;
      } else {
        break;
      }
    }
  }

  static bool name_char(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_';
  }

  std::string read_name() {
    const std::size_t b = pos_;
    while (pos_ < s_.size() && name_char(s_[pos_]))
      ++pos_;
    return std::string(s_.substr(b, pos_ - b));
  }

  // Skips to the end of a rule body: the next line that starts a new rule.
  void skip_body() {
    int depth = 0;
    while (pos_ < s_.size()) {
      const char c = s_[pos_];
      if (c == '"' || c == '[') {
        const char close = c == '"' ? '"' : ']';
        ++pos_;
        while (pos_ < s_.size() && s_[pos_] != close) {
          if (s_[pos_] == '\\')
            ++pos_;
          ++pos_;
        }
        ++pos_;
        continue;
      }
      if (c == '#') {
        skip_space(false);
        continue;
      }
      if (c == '(')
        ++depth;
      if (c == ')')
        --depth;
      if (c == '\n' && depth <= 0) {
        // A continuation line starts with space, '|' or ')'; a new rule with "name ::=".
        std::size_t p = pos_ + 1;
        while (p < s_.size() && (s_[p] == ' ' || s_[p] == '\t' || s_[p] == '\r' || s_[p] == '\n'))
          ++p;
        if (rule_start_at(p)) {
          pos_ = p;
          return;
        }
        if (p >= s_.size()) {
          pos_ = p;
          return;
        }
      }
      ++pos_;
    }
  }

  int parse_escape(std::size_t at) {
    if (pos_ >= s_.size())
      fail(at, "an escape at the end of the text");
    const char c = s_[pos_++];
    switch (c) {
      case 'n': return '\n';
      case 'r': return '\r';
      case 't': return '\t';
      case '\\': return '\\';
      case '"': return '"';
      case ']': return ']';
      case '[': return '[';
      case '-': return '-';
      case '^': return '^';
      case 'x': {
        if (pos_ + 2 > s_.size())
          fail(at, "\\x needs two hex digits");
        int v = 0;
        for (int i = 0; i < 2; ++i) {
          const char h = s_[pos_++];
          v = v * 16 + (h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10 : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1000);
        }
        if (v < 0)
          fail(at, "\\x needs two hex digits");
        return v;
      }
      default: fail(at, std::string("unknown escape '\\") + c + "'");
    }
  }

  // Within a rule body (newlines continue the body).
  Expr parse_alternatives(int depth) {
    if (depth > 64)
      fail(pos_, "groups nested too deeply");
    Expr a;
    a.kind = Expr::alt;
    a.items.push_back(parse_sequence(depth));
    for (;;) {
      skip_space(true);
      if (pos_ < s_.size() && s_[pos_] == '|') {
        ++pos_;
        a.items.push_back(parse_sequence(depth));
      } else {
        break;
      }
    }
    return a;
  }

  // Whether a rule ("name ::=") starts at offset p.
  bool rule_start_at(std::size_t p) const {
    std::size_t q = p;
    while (q < s_.size() && name_char(s_[q]))
      ++q;
    std::size_t r = q;
    while (r < s_.size() && (s_[r] == ' ' || s_[r] == '\t'))
      ++r;
    return q > p && s_.substr(r, 3) == "::=";
  }
  bool at_rule_start() const { return rule_start_at(pos_); }

  Expr parse_sequence(int depth) {
    Expr seq;
    seq.kind = Expr::seq;
    for (;;) {
      skip_space(true);
      if (pos_ >= s_.size() || s_[pos_] == '|' || s_[pos_] == ')' || at_rule_start())
        break;
      Expr item = parse_atom(depth);
      item = parse_repeat(std::move(item));
      seq.items.push_back(std::move(item));
    }
    return seq;
  }

  Expr parse_atom(int depth) {
    const std::size_t at = pos_;
    const char c = s_[pos_];
    if (c == '"') {
      ++pos_;
      Expr seq;
      seq.kind = Expr::seq;
      std::string lit;
      while (pos_ < s_.size() && s_[pos_] != '"') {
        int b = static_cast<unsigned char>(s_[pos_++]);
        if (b == '\\')
          b = parse_escape(at);
        lit.push_back(static_cast<char>(b));
        Expr e;
        e.kind = Expr::bytes;
        e.set.assign(4, 0);
        e.set[static_cast<std::size_t>(b) >> 6] |= uint64_t{1} << (b & 63);
        seq.items.push_back(std::move(e));
      }
      if (pos_ >= s_.size())
        fail(at, "unterminated literal");
      ++pos_;
      if (!lit.empty())
        g_->literals_.push_back(std::move(lit));
      return seq;
    }
    if (c == '[') {
      ++pos_;
      Expr e;
      e.kind = Expr::bytes;
      e.set.assign(4, 0);
      bool negate = false;
      if (pos_ < s_.size() && s_[pos_] == '^') {
        negate = true;
        ++pos_;
      }
      bool any = false;
      while (pos_ < s_.size() && s_[pos_] != ']') {
        int lo = static_cast<unsigned char>(s_[pos_++]);
        if (lo == '\\')
          lo = parse_escape(at);
        int hi = lo;
        if (pos_ + 1 < s_.size() && s_[pos_] == '-' && s_[pos_ + 1] != ']') {
          ++pos_;
          hi = static_cast<unsigned char>(s_[pos_++]);
          if (hi == '\\')
            hi = parse_escape(at);
        }
        if (hi < lo)
          fail(at, "a class range runs backwards");
        for (int b = lo; b <= hi; ++b)
          e.set[static_cast<std::size_t>(b) >> 6] |= uint64_t{1} << (b & 63);
        any = true;
      }
      if (pos_ >= s_.size())
        fail(at, "unterminated class");
      ++pos_;
      if (!any)
        fail(at, "an empty class");
      if (negate)
        for (auto& w : e.set)
          w = ~w;
      return e;
    }
    if (c == '(') {
      ++pos_;
      Expr a = parse_alternatives(depth + 1);
      skip_space(true);
      if (pos_ >= s_.size() || s_[pos_] != ')')
        fail(at, "unclosed '('");
      ++pos_;
      return a;
    }
    if (name_char(c)) {
      std::string name = read_name();
      auto it = ids_.find(name);
      if (it == ids_.end())
        fail(at, "unknown rule '" + name + "'");
      Expr e;
      e.kind = Expr::ref;
      e.rule = it->second;
      return e;
    }
    fail(at, std::string("unexpected '") + c + "'");
  }

  Expr parse_repeat(Expr item) {
    if (pos_ >= s_.size())
      return item;
    const std::size_t at = pos_;
    int mn = 1, mx = 1;
    const char c = s_[pos_];
    if (c == '*') {
      mn = 0, mx = -1;
      ++pos_;
    } else if (c == '+') {
      mn = 1, mx = -1;
      ++pos_;
    } else if (c == '?') {
      mn = 0, mx = 1;
      ++pos_;
    } else if (c == '{') {
      ++pos_;
      auto number = [&]() {
        long v = 0;
        const std::size_t b = pos_;
        while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') {
          v = v * 10 + (s_[pos_++] - '0');
          if (v > 100000)
            fail(at, "a repetition count over 100000");
        }
        return pos_ == b ? -1 : static_cast<int>(v);
      };
      mn = number();
      if (mn < 0)
        fail(at, "a repetition needs a count");
      mx = mn;
      if (pos_ < s_.size() && s_[pos_] == ',') {
        ++pos_;
        mx = number(); // -1: unbounded
      }
      if (pos_ >= s_.size() || s_[pos_] != '}')
        fail(at, "unclosed '{'");
      ++pos_;
      if (mx >= 0 && mx < mn)
        fail(at, "a repetition's maximum is below its minimum");
    } else {
      return item;
    }
    Expr r;
    r.kind = Expr::repeat;
    r.min = mn;
    r.max = mx;
    r.items.push_back(std::move(item));
    return r;
  }

  // ---- lowering

  int32_t new_rule() {
    g_->rules_.emplace_back();
    return static_cast<int32_t>(g_->rules_.size() - 1);
  }

  void push(Grammar::Element e) {
    if (g_->elements_.size() >= Grammar::max_elements)
      throw Error(errc::bad_argument, "grammar too large (over " + std::to_string(Grammar::max_elements) + " elements)");
    g_->elements_.push_back(std::move(e));
  }

  // The rule an expression becomes when it is not a plain byte class or reference.
  int32_t rule_for(const Expr& e) {
    if (e.kind == Expr::ref)
      return e.rule;
    const int32_t r = new_rule();
    Expr body = e;
    if (body.kind != Expr::alt) {
      Expr a;
      a.kind = Expr::alt;
      a.items.push_back(std::move(body));
      body = std::move(a);
    }
    pending_.emplace_back(r, std::move(body));
    return r;
  }

  void emit_ref(int32_t r) {
    Grammar::Element e;
    e.kind = Grammar::Element::rule;
    e.rule_id = r;
    push(std::move(e));
  }

  // Appends the elements of a sequence item to the alternative being built.
  void emit(const Expr& e) {
    switch (e.kind) {
      case Expr::bytes: {
        Grammar::Element el;
        el.kind = Grammar::Element::bytes;
        el.set = e.set;
        push(std::move(el));
        break;
      }
      case Expr::ref: emit_ref(e.rule); break;
      case Expr::seq:
        for (const auto& i : e.items)
          emit(i);
        break;
      case Expr::alt:
        if (e.items.size() == 1)
          emit(e.items[0]);
        else
          emit_ref(rule_for(e));
        break;
      case Expr::repeat: {
        const Expr& x = e.items[0];
        for (int i = 0; i < e.min; ++i)
          emit(x);
        if (e.max < 0) { // star ::= x star | ()
          const int32_t star = new_rule();
          Expr body;
          body.kind = Expr::alt;
          Expr again;
          again.kind = Expr::seq;
          again.items.push_back(x);
          Expr self;
          self.kind = Expr::ref;
          self.rule = star;
          again.items.push_back(self);
          body.items.push_back(std::move(again));
          body.items.emplace_back(); // empty sequence
          pending_.emplace_back(star, std::move(body));
          repeated_.emplace_back(star, x);
          emit_ref(star);
        } else if (e.max > e.min) { // opt_k ::= x opt_{k-1} | ()
          int32_t next = -1;
          for (int k = 0; k < e.max - e.min; ++k) {
            const int32_t opt = new_rule();
            Expr body;
            body.kind = Expr::alt;
            Expr more;
            more.kind = Expr::seq;
            more.items.push_back(x);
            if (next >= 0) {
              Expr ref;
              ref.kind = Expr::ref;
              ref.rule = next;
              more.items.push_back(ref);
            }
            body.items.push_back(std::move(more));
            body.items.emplace_back();
            pending_.emplace_back(opt, std::move(body));
            next = opt;
          }
          emit_ref(next);
        }
        break;
      }
    }
  }

  void lower_rule(int32_t r, const Expr& body) {
    pending_.emplace_back(r, body);
    while (!pending_.empty()) {
      auto [rid, b] = std::move(pending_.back());
      pending_.pop_back();
      for (const auto& a : b.items) {
        // (by index: lowering may add rules)
        g_->rules_[static_cast<std::size_t>(rid)].push_back(static_cast<int32_t>(g_->elements_.size()));
        emit(a);
        push(Grammar::Element{});
      }
    }
  }

  // Nullable rules; left recursion (a rule reachable from itself without
  // consuming a byte) and repetitions of something that can match nothing are
  // refused: the matcher would never end expanding them.
  void check_recursion() {
    const auto& els = g_->elements_;
    const std::size_t R = g_->rules_.size();
    std::vector<char> nullable(R, 0);
    for (bool changed = true; changed;) {
      changed = false;
      for (std::size_t r = 0; r < R; ++r) {
        if (nullable[r])
          continue;
        for (int32_t a : g_->rules_[r]) {
          bool all = true;
          for (auto p = static_cast<std::size_t>(a); els[p].kind != Grammar::Element::end; ++p)
            if (els[p].kind == Grammar::Element::bytes ||
                !nullable[static_cast<std::size_t>(els[p].rule_id)]) {
              all = false;
              break;
            }
          if (all) {
            nullable[r] = 1;
            changed = true;
            break;
          }
        }
      }
    }
    // Rules reachable leftmost (before any byte) from each rule.
    std::vector<std::vector<int32_t>> left(R);
    for (std::size_t r = 0; r < R; ++r)
      for (int32_t a : g_->rules_[r])
        for (auto p = static_cast<std::size_t>(a); els[p].kind == Grammar::Element::rule; ++p) {
          left[r].push_back(els[p].rule_id);
          if (!nullable[static_cast<std::size_t>(els[p].rule_id)])
            break;
        }
    std::vector<int> color(R, 0);
    std::function<void(std::size_t)> dfs = [&](std::size_t r) {
      color[r] = 1;
      for (int32_t n : left[r]) {
        const auto u = static_cast<std::size_t>(n);
        if (color[u] == 1)
          throw Error(errc::bad_argument, "grammar is left-recursive or repeats what can match nothing (rule " + std::to_string(n) +
                                            " reaches itself without consuming a byte)");
        if (color[u] == 0)
          dfs(u);
      }
      color[r] = 2;
    };
    for (std::size_t r = 0; r < R; ++r)
      if (color[r] == 0)
        dfs(r);
    // A repeated item that can match nothing: its rule's first alternative is nullable.
    for (const auto& [star, x] : repeated_) {
      const int32_t a = g_->rules_[static_cast<std::size_t>(star)][0];
      bool all = true;
      for (auto p = static_cast<std::size_t>(a); els[p].kind != Grammar::Element::end; ++p) {
        if (els[p].kind == Grammar::Element::rule && els[p].rule_id == star)
          break;
        if (els[p].kind == Grammar::Element::bytes || !nullable[static_cast<std::size_t>(els[p].rule_id)]) {
          all = false;
          break;
        }
      }
      if (all)
        throw Error(errc::bad_argument, "grammar repeats something that can match nothing (x* with x empty)");
    }
  }

  std::string_view s_;
  std::size_t pos_ = 0;
  Grammar* g_ = nullptr;
  std::unordered_map<std::string, int32_t> ids_;
  std::vector<Expr> bodies_;
  std::vector<std::pair<int32_t, Expr>> pending_;
  std::vector<std::pair<int32_t, Expr>> repeated_;
};

std::shared_ptr<const Grammar> Grammar::parse(std::string_view text) {
  return GrammarParser(text).run();
}

// ---------------------------------------------------------------- automaton

namespace {
constexpr std::size_t max_nodes = 4'000'000;
constexpr std::size_t max_states = 1'000'000;
constexpr int max_expand_depth = 10000;
} // namespace

GrammarAutomaton::GrammarAutomaton(std::shared_ptr<const Grammar> g) : g_(std::move(g)) {
  nodes_.push_back({-1, 0}); // 0: the empty stack
  std::vector<Stack> tops, seen;
  // The root: every alternative of rule 0 with nothing after it.
  for (int32_t a : g_->alternatives(0)) {
    const Stack s = g_->elements()[static_cast<std::size_t>(a)].kind == Grammar::Element::end ? 0 : node(a, 0);
    expand(s, tops, seen);
  }
  start_ = intern_state(std::move(tops));
}

GrammarAutomaton::Stack GrammarAutomaton::node(int32_t pos, Stack parent) {
  const uint64_t key = (static_cast<uint64_t>(static_cast<uint32_t>(pos)) << 32) | static_cast<uint32_t>(parent);
  auto it = node_ids_.find(key);
  if (it != node_ids_.end())
    return it->second;
  if (nodes_.size() >= max_nodes)
    throw Error(errc::bad_argument, "grammar state grew past " + std::to_string(max_nodes) + " stack nodes");
  const auto id = static_cast<Stack>(nodes_.size());
  nodes_.push_back({pos, parent});
  node_ids_.emplace(key, id);
  return id;
}

// The byte-class tops (or 0, accept) stack s stands for.
void GrammarAutomaton::expand(Stack s, std::vector<Stack>& out, std::vector<Stack>& seen) {
  struct Frame {
    Stack s;
    int depth;
  };
  std::vector<Frame> work{{s, 0}};
  const auto& els = g_->elements();
  while (!work.empty()) {
    auto [cur, depth] = work.back();
    work.pop_back();
    if (std::find(seen.begin(), seen.end(), cur) != seen.end())
      continue;
    seen.push_back(cur);
    if (cur == 0) {
      out.push_back(0);
      continue;
    }
    const Node nd = nodes_[static_cast<std::size_t>(cur)];
    const auto& e = els[static_cast<std::size_t>(nd.pos)];
    if (e.kind == Grammar::Element::bytes) {
      out.push_back(cur);
      continue;
    }
    if (depth > max_expand_depth)
      throw Error(errc::bad_argument, "grammar nests deeper than " + std::to_string(max_expand_depth));
    // A rule: what follows it (the parent itself when the rule ends the alternative).
    const int32_t after = nd.pos + 1;
    const Stack cont = els[static_cast<std::size_t>(after)].kind == Grammar::Element::end ? nd.parent : node(after, nd.parent);
    for (int32_t a : g_->alternatives(e.rule_id)) {
      const Stack n = els[static_cast<std::size_t>(a)].kind == Grammar::Element::end ? cont : node(a, cont);
      work.push_back({n, depth + 1});
    }
  }
}

int32_t GrammarAutomaton::intern_state(std::vector<Stack> stacks) {
  if (stacks.empty())
    return dead;
  std::sort(stacks.begin(), stacks.end());
  stacks.erase(std::unique(stacks.begin(), stacks.end()), stacks.end());
  std::string key(reinterpret_cast<const char*>(stacks.data()), stacks.size() * sizeof(Stack));
  auto it = state_ids_.find(key);
  if (it != state_ids_.end())
    return it->second;
  if (states_.size() >= max_states)
    throw Error(errc::bad_argument, "grammar automaton grew past " + std::to_string(max_states) + " states");
  const auto id = static_cast<int32_t>(states_.size());
  states_.push_back(std::move(stacks));
  trans_.emplace_back(256, -2);
  state_ids_.emplace(std::move(key), id);
  return id;
}

int32_t GrammarAutomaton::step_locked(int32_t state, uint8_t b) {
  if (state < 0)
    return dead;
  auto& t = trans_[static_cast<std::size_t>(state)][b];
  if (t != -2)
    return t;
  std::vector<Stack> out, seen;
  const auto& els = g_->elements();
  const std::vector<Stack> tops = states_[static_cast<std::size_t>(state)]; // copy: interning may grow states_
  for (Stack s : tops) {
    if (s == 0)
      continue;
    const Node nd = nodes_[static_cast<std::size_t>(s)];
    if (!els[static_cast<std::size_t>(nd.pos)].has(b))
      continue;
    const int32_t after = nd.pos + 1;
    const Stack n = els[static_cast<std::size_t>(after)].kind == Grammar::Element::end ? nd.parent : node(after, nd.parent);
    expand(n, out, seen);
  }
  const int32_t r = intern_state(std::move(out));
  trans_[static_cast<std::size_t>(state)][b] = r; // re-index: trans_ may have grown
  return r;
}

int32_t GrammarAutomaton::next(int32_t state, uint8_t b) {
  std::lock_guard lock(mu_);
  return step_locked(state, b);
}

int32_t GrammarAutomaton::next(int32_t state, std::string_view bytes) {
  std::lock_guard lock(mu_);
  for (char c : bytes) {
    state = step_locked(state, static_cast<uint8_t>(c));
    if (state < 0)
      return dead;
  }
  return state;
}

bool GrammarAutomaton::accepting(int32_t state) {
  if (state < 0)
    return false;
  std::lock_guard lock(mu_);
  const auto& s = states_[static_cast<std::size_t>(state)];
  return !s.empty() && s.front() == 0;
}

bool GrammarAutomaton::can_continue(int32_t state) {
  if (state < 0)
    return false;
  std::lock_guard lock(mu_);
  const auto& s = states_[static_cast<std::size_t>(state)];
  return !s.empty() && s.back() != 0;
}

std::size_t GrammarAutomaton::state_count() {
  std::lock_guard lock(mu_);
  return states_.size();
}

} // namespace strata::model
