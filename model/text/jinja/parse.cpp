// Lexer and parser of the template engine: splits the text into text, {{ }},
// {% %} and {# #} segments, applies whitespace control (-, +, trim_blocks,
// lstrip_blocks as transformers sets them), and parses each tag with Jinja2's
// operator precedence.

#include "model/text/jinja/jinja.hpp"
#include "model/text/jinja/ast.hpp"

#include <cctype>
#include <set>

namespace strata::model::jinja {

TemplateError::TemplateError(const std::string& message, int line, Kind kind)
    : std::runtime_error(line > 0 ? "chat template line " + std::to_string(line) + ": " + message
                                  : "chat template: " + message),
      line_(line), kind_(kind), message_(message) {}

TemplateError::TemplateError(const std::string& message, int line, Limit limit)
    : TemplateError(message, line, Kind::limit) {
  limit_ = limit;
}

const char* to_string(TemplateError::Limit l) {
  switch (l) {
  case TemplateError::Limit::none: return "none";
  case TemplateError::Limit::nesting: return "nesting";
  case TemplateError::Limit::steps: return "steps";
  case TemplateError::Limit::time: return "time";
  case TemplateError::Limit::memory: return "memory";
  case TemplateError::Limit::recursion: return "recursion";
  case TemplateError::Limit::output: return "output";
  case TemplateError::Limit::cancelled: return "cancelled";
  }
  return "?";
}

namespace {

struct Segment {
  enum class Kind : uint8_t { text, expr, stmt, comment } kind;
  std::string content;
  int line = 1;
  bool ltrim = false, rtrim = false, lplus = false, rplus = false;
};

int count_lines(std::string_view s, std::size_t from, std::size_t to) {
  int n = 0;
  for (std::size_t i = from; i < to && i < s.size(); ++i)
    n += s[i] == '\n';
  return n;
}

// Finds the closer of a tag that starts at `from` (after the opener), skipping
// string literals. Returns npos when the tag is not closed.
std::size_t find_closer(std::string_view t, std::size_t from, std::string_view closer) {
  char quote = 0;
  for (std::size_t i = from; i < t.size(); ++i) {
    const char c = t[i];
    if (quote) {
      if (c == '\\')
        ++i;
      else if (c == quote)
        quote = 0;
      continue;
    }
    if (c == '\'' || c == '"')
      quote = c;
    else if (t.compare(i, closer.size(), closer) == 0)
      return i;
  }
  return std::string_view::npos;
}

std::vector<Segment> split(std::string_view t) {
  std::vector<Segment> out;
  std::size_t pos = 0;
  int line = 1;
  while (pos < t.size()) {
    std::size_t open = std::string_view::npos;
    for (std::size_t i = pos; i + 1 < t.size(); ++i)
      if (t[i] == '{' && (t[i + 1] == '{' || t[i + 1] == '%' || t[i + 1] == '#')) {
        open = i;
        break;
      }
    if (open == std::string_view::npos) {
      out.push_back({Segment::Kind::text, std::string(t.substr(pos)), line});
      break;
    }
    if (open > pos) {
      out.push_back({Segment::Kind::text, std::string(t.substr(pos, open - pos)), line});
      line += count_lines(t, pos, open);
    }
    const char type = t[open + 1];
    Segment s{type == '{' ? Segment::Kind::expr : type == '%' ? Segment::Kind::stmt : Segment::Kind::comment, {}, line};
    std::size_t body = open + 2;
    if (body < t.size() && t[body] == '-') {
      s.ltrim = true;
      ++body;
    } else if (body < t.size() && t[body] == '+') {
      s.lplus = true;
      ++body;
    }
    const std::string_view closer = type == '{' ? "}}" : type == '%' ? "%}" : "#}";
    const std::size_t close = type == '#' ? t.find(closer, body) : find_closer(t, body, closer);
    if (close == std::string_view::npos)
      throw TemplateError(std::string("unclosed '{") + type + "'", line);
    std::size_t end = close;
    if (end > body && t[end - 1] == '-') {
      s.rtrim = true;
      --end;
    } else if (end > body && t[end - 1] == '+' && type != '{') {
      s.rplus = true;
      --end;
    }
    s.content = std::string(t.substr(body, end - body));
    line += count_lines(t, open, close + 2);
    pos = close + 2;
    out.push_back(std::move(s));
  }
  // Whitespace control.
  const auto is_block = [](const Segment& s) {
    return s.kind == Segment::Kind::stmt || s.kind == Segment::Kind::comment;
  };
  for (std::size_t i = 0; i < out.size(); ++i) {
    auto& s = out[i];
    if (s.kind != Segment::Kind::text)
      continue;
    // lstrip_blocks, decided on the source text: spaces and tabs between a line
    // start (or the template's start) and a block tag go.
    std::size_t keep_to = s.content.size();
    if (i + 1 < out.size() && !out[i + 1].ltrim && is_block(out[i + 1]) && !out[i + 1].lplus) {
      std::size_t k = s.content.size();
      while (k > 0 && (s.content[k - 1] == ' ' || s.content[k - 1] == '\t'))
        --k;
      if (k > 0 ? s.content[k - 1] == '\n' : i == 0)
        keep_to = k;
    }
    if (i + 1 < out.size() && out[i + 1].ltrim) {
      while (keep_to > 0 && std::isspace(static_cast<unsigned char>(s.content[keep_to - 1])))
        --keep_to;
    }
    std::size_t from = 0;
    if (i > 0) {
      const auto& prev = out[i - 1];
      if (prev.rtrim) {
        while (from < keep_to && std::isspace(static_cast<unsigned char>(s.content[from])))
          ++from;
      } else if (is_block(prev) && !prev.rplus) { // trim_blocks
        if (s.content.compare(0, 2, "\r\n") == 0)
          from = 2;
        else if (s.content.compare(0, 1, "\n") == 0)
          from = 1;
      }
    }
    s.content = from < keep_to ? s.content.substr(from, keep_to - from) : std::string();
  }
  return out;
}

struct Token {
  enum class Kind : uint8_t { name, string, integer, real, op, end } kind;
  std::string text;
  int64_t i = 0;
  double d = 0;
};

std::vector<Token> lex(const std::string& s, int line) {
  std::vector<Token> out;
  std::size_t i = 0;
  while (i < s.size()) {
    const char c = s[i];
    if (std::isspace(static_cast<unsigned char>(c))) {
      ++i;
      continue;
    }
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      std::size_t j = i;
      while (j < s.size() && (std::isalnum(static_cast<unsigned char>(s[j])) || s[j] == '_'))
        ++j;
      out.push_back({Token::Kind::name, s.substr(i, j - i)});
      i = j;
      continue;
    }
    if (std::isdigit(static_cast<unsigned char>(c))) {
      std::size_t j = i;
      bool real = false;
      while (j < s.size() && (std::isdigit(static_cast<unsigned char>(s[j])) || s[j] == '_'))
        ++j;
      if (j + 1 < s.size() && s[j] == '.' && std::isdigit(static_cast<unsigned char>(s[j + 1]))) {
        real = true;
        ++j;
        while (j < s.size() && std::isdigit(static_cast<unsigned char>(s[j])))
          ++j;
      }
      if (j < s.size() && (s[j] == 'e' || s[j] == 'E')) {
        std::size_t k = j + 1;
        if (k < s.size() && (s[k] == '+' || s[k] == '-'))
          ++k;
        if (k < s.size() && std::isdigit(static_cast<unsigned char>(s[k]))) {
          real = true;
          j = k;
          while (j < s.size() && std::isdigit(static_cast<unsigned char>(s[j])))
            ++j;
        }
      }
      std::string num;
      for (std::size_t k = i; k < j; ++k)
        if (s[k] != '_')
          num += s[k];
      Token t{real ? Token::Kind::real : Token::Kind::integer, num};
      try {
        if (real)
          t.d = std::stod(num);
        else
          t.i = std::stoll(num);
      } catch (const std::exception&) {
        throw TemplateError("number '" + num + "' is out of range", line);
      }
      out.push_back(t);
      i = j;
      continue;
    }
    if (c == '\'' || c == '"') {
      std::string v;
      std::size_t j = i + 1;
      for (; j < s.size() && s[j] != c; ++j) {
        if (s[j] != '\\' || j + 1 >= s.size()) {
          v += s[j];
          continue;
        }
        const char e = s[++j];
        switch (e) {
        case 'n': v += '\n'; break;
        case 't': v += '\t'; break;
        case 'r': v += '\r'; break;
        case 'b': v += '\b'; break;
        case 'f': v += '\f'; break;
        case '0': v += '\0'; break;
        case '\\': v += '\\'; break;
        case '\'': v += '\''; break;
        case '"': v += '"'; break;
        case '\n': break;
        default: v += '\\'; v += e;
        }
      }
      if (j >= s.size())
        throw TemplateError("unterminated string literal", line);
      out.push_back({Token::Kind::string, v});
      i = j + 1;
      continue;
    }
    static const char* two[] = {"//", "**", "==", "!=", "<=", ">="};
    bool matched = false;
    for (const char* op : two)
      if (s.compare(i, 2, op) == 0) {
        out.push_back({Token::Kind::op, op});
        i += 2;
        matched = true;
        break;
      }
    if (matched)
      continue;
    if (std::string_view("+-*/%~<>()[]{},.:|=").find(c) != std::string_view::npos) {
      out.push_back({Token::Kind::op, std::string(1, c)});
      ++i;
      continue;
    }
    throw TemplateError(std::string("unexpected character '") + c + "'", line);
  }
  out.push_back({Token::Kind::end, ""});
  return out;
}

// Counts how deep a recursive parser is; past max_parse_nesting it stops with
// a TemplateError (nesting) naming the line instead of exhausting the stack.
class NestGuard {
public:
  NestGuard(int& depth, int line, const char* what) : depth_(depth) {
    if (++depth_ > max_parse_nesting) {
      --depth_;
      throw TemplateError(std::string(what) + " nested deeper than " + std::to_string(max_parse_nesting) + " levels",
                          line, TemplateError::Limit::nesting);
    }
  }
  ~NestGuard() { --depth_; }
  NestGuard(const NestGuard&) = delete;
  NestGuard& operator=(const NestGuard&) = delete;

private:
  int& depth_;
};

class ExprParser {
public:
  ExprParser(std::vector<Token> toks, int line) : t_(std::move(toks)), line_(line) {}

  bool at_end() const { return t_[p_].kind == Token::Kind::end; }
  bool is_op(const char* op) const { return t_[p_].kind == Token::Kind::op && t_[p_].text == op; }
  bool is_name(const char* n) const { return t_[p_].kind == Token::Kind::name && t_[p_].text == n; }
  bool skip_op(const char* op) {
    if (!is_op(op))
      return false;
    ++p_;
    return true;
  }
  bool skip_name(const char* n) {
    if (!is_name(n))
      return false;
    ++p_;
    return true;
  }
  void expect_op(const char* op) {
    if (!skip_op(op))
      fail(std::string("expected '") + op + "'");
  }
  std::string expect_name() {
    if (t_[p_].kind != Token::Kind::name)
      fail("expected a name");
    return t_[p_++].text;
  }
  void expect_end() {
    if (!at_end())
      fail("unexpected '" + t_[p_].text + "'");
  }
  [[noreturn]] void fail(const std::string& what) const {
    const auto& t = t_[p_];
    throw TemplateError(what + (t.kind == Token::Kind::end ? " at the end of the tag" : " near '" + t.text + "'"),
                        line_);
  }

  ExprPtr make(Expr::Kind k) {
    auto e = std::make_unique<Expr>();
    e->kind = k;
    e->line = line_;
    return e;
  }

  ExprPtr expression(bool with_cond = true) {
    const NestGuard guard(nesting_, line_, "expressions");
    auto e = parse_or();
    while (with_cond && skip_name("if")) {
      auto c = make(Expr::Kind::cond);
      c->add(parse_or());
      c->add(std::move(e));
      c->add(skip_name("else") ? expression() : nullptr);
      e = std::move(c);
    }
    return e;
  }

  // A comma-separated list without brackets is a tuple (for `set a, b = ...`).
  ExprPtr tuple_or_expression(bool with_cond = true) {
    auto first = expression(with_cond);
    if (!is_op(","))
      return first;
    auto t = make(Expr::Kind::tuple);
    t->add(std::move(first));
    while (skip_op(",")) {
      if (at_end() || is_name("if"))
        break;
      t->add(expression(with_cond));
    }
    return t;
  }


private:
  ExprPtr binary(std::string op, ExprPtr a, ExprPtr b) {
    auto e = make(Expr::Kind::binary);
    e->name = std::move(op);
    e->add(std::move(a));
    e->add(std::move(b));
    return e;
  }
  // One precedence level of left-associative binary operators: symbols, or
  // words such as "or".
  ExprPtr level(std::initializer_list<const char*> ops, bool words, ExprPtr (ExprParser::*next)()) {
    auto e = (this->*next)();
    for (;;) {
      const char* hit = nullptr;
      for (const char* op : ops)
        if (words ? skip_name(op) : skip_op(op)) {
          hit = op;
          break;
        }
      if (!hit)
        return e;
      e = binary(hit, std::move(e), (this->*next)());
    }
  }
  ExprPtr parse_or() { return level({"or"}, true, &ExprParser::parse_and); }
  ExprPtr parse_and() { return level({"and"}, true, &ExprParser::parse_not); }
  ExprPtr parse_not() {
    const NestGuard guard(nesting_, line_, "expressions");
    if (skip_name("not")) {
      auto e = make(Expr::Kind::unary);
      e->name = "not";
      e->add(parse_not());
      return e;
    }
    return parse_compare();
  }
  ExprPtr parse_compare() {
    auto e = parse_math1();
    for (;;) {
      static const char* ops[] = {"==", "!=", "<", ">", "<=", ">="};
      bool done = true;
      for (const char* op : ops)
        if (skip_op(op)) {
          e = binary(op, std::move(e), parse_math1());
          done = false;
          break;
        }
      if (!done)
        continue;
      if (skip_name("in")) {
        e = binary("in", std::move(e), parse_math1());
        continue;
      }
      if (is_name("not") && t_[p_ + 1].kind == Token::Kind::name && t_[p_ + 1].text == "in") {
        p_ += 2;
        e = binary("not in", std::move(e), parse_math1());
        continue;
      }
      return e;
    }
  }
  ExprPtr parse_math1() { return level({"+", "-"}, false, &ExprParser::parse_concat); }
  ExprPtr parse_concat() { return level({"~"}, false, &ExprParser::parse_math2); }
  ExprPtr parse_math2() { return level({"*", "/", "//", "%"}, false, &ExprParser::parse_pow); }
  ExprPtr parse_pow() { return level({"**"}, false, &ExprParser::parse_operand); }
  ExprPtr parse_operand() { return parse_unary(true); }
  ExprPtr parse_unary(bool with_filter) {
    const NestGuard guard(nesting_, line_, "expressions");
    ExprPtr e;
    if (is_op("-") || is_op("+")) {
      e = make(Expr::Kind::unary);
      e->name = t_[p_++].text;
      e->add(parse_unary(false));
    } else {
      e = primary();
    }
    e = postfix(std::move(e));
    if (with_filter)
      e = filter_expr(std::move(e));
    return e;
  }
  ExprPtr primary() {
    const Token& t = t_[p_];
    switch (t.kind) {
    case Token::Kind::name: {
      ++p_;
      auto e = make(Expr::Kind::literal);
      if (t.text == "true" || t.text == "True")
        e->value = Value(true);
      else if (t.text == "false" || t.text == "False")
        e->value = Value(false);
      else if (t.text == "none" || t.text == "None")
        e->value = Value::none();
      else {
        e->kind = Expr::Kind::name;
        e->name = t.text;
      }
      return e;
    }
    case Token::Kind::string: {
      std::string s;
      while (t_[p_].kind == Token::Kind::string)
        s += t_[p_++].text;
      auto e = make(Expr::Kind::literal);
      e->value = Value(std::move(s));
      return e;
    }
    case Token::Kind::integer: {
      ++p_;
      auto e = make(Expr::Kind::literal);
      e->value = Value(t.i);
      return e;
    }
    case Token::Kind::real: {
      ++p_;
      auto e = make(Expr::Kind::literal);
      e->value = Value(t.d);
      return e;
    }
    case Token::Kind::op:
      if (skip_op("(")) {
        if (skip_op(")"))
          return make(Expr::Kind::tuple);
        auto first = expression();
        if (skip_op(")"))
          return first;
        auto tup = make(Expr::Kind::tuple);
        tup->add(std::move(first));
        while (skip_op(",")) {
          if (is_op(")"))
            break;
          tup->add(expression());
        }
        expect_op(")");
        return tup;
      }
      if (skip_op("[")) {
        auto l = make(Expr::Kind::list);
        while (!is_op("]")) {
          l->add(expression());
          if (!skip_op(","))
            break;
        }
        expect_op("]");
        return l;
      }
      if (skip_op("{")) {
        auto d = make(Expr::Kind::dict);
        while (!is_op("}")) {
          d->add(expression());
          expect_op(":");
          d->add(expression());
          if (!skip_op(","))
            break;
        }
        expect_op("}");
        return d;
      }
      break;
    default:
      break;
    }
    fail("expected an expression");
  }
  void call_args(Expr& e) {
    // after '('
    while (!is_op(")")) {
      if (t_[p_].kind == Token::Kind::name && t_[p_ + 1].kind == Token::Kind::op && t_[p_ + 1].text == "=") {
        std::string key = t_[p_].text;
        p_ += 2;
        e.add_kw(std::move(key), expression());
      } else {
        if (!e.kwargs.empty())
          fail("a positional argument after a keyword argument");
        e.add(expression());
      }
      if (!skip_op(","))
        break;
    }
    expect_op(")");
  }
  // callee(arguments), after the "(".
  ExprPtr call_of(ExprPtr callee) {
    auto c = make(Expr::Kind::call);
    c->add(std::move(callee));
    call_args(*c);
    return c;
  }
  ExprPtr postfix(ExprPtr e) {
    for (;;) {
      if (skip_op(".")) {
        auto a = make(Expr::Kind::attr);
        if (t_[p_].kind == Token::Kind::integer) {
          a->kind = Expr::Kind::index;
          auto lit = make(Expr::Kind::literal);
          lit->value = Value(t_[p_++].i);
          a->add(std::move(e));
          a->add(std::move(lit));
        } else {
          a->name = expect_name();
          a->add(std::move(e));
        }
        e = std::move(a);
      } else if (skip_op("[")) {
        ExprPtr parts[3];
        bool slice = false;
        if (!is_op(":"))
          parts[0] = expression();
        if (skip_op(":")) {
          slice = true;
          if (!is_op(":") && !is_op("]"))
            parts[1] = expression();
          if (skip_op(":") && !is_op("]"))
            parts[2] = expression();
        }
        expect_op("]");
        auto s = make(slice ? Expr::Kind::slice : Expr::Kind::index);
        s->add(std::move(e));
        if (slice)
          for (auto& p : parts)
            s->add(std::move(p));
        else
          s->add(std::move(parts[0]));
        e = std::move(s);
      } else if (skip_op("(")) {
        e = call_of(std::move(e));
      } else {
        return e;
      }
    }
  }
  ExprPtr filter_expr(ExprPtr e) {
    for (;;) {
      if (skip_op("|")) {
        auto f = make(Expr::Kind::filter);
        f->name = expect_name();
        if (!known_filter(f->name))
          throw TemplateError("unsupported filter '" + f->name + "'", line_, TemplateError::Kind::unsupported);
        f->add(std::move(e));
        if (skip_op("("))
          call_args(*f);
        e = std::move(f);
      } else if (skip_name("is")) {
        auto t = make(Expr::Kind::test);
        t->negate = skip_name("not");
        t->name = expect_name();
        if (!known_test(t->name))
          throw TemplateError("unsupported test '" + t->name + "'", line_, TemplateError::Kind::unsupported);
        t->add(std::move(e));
        const auto& n = t_[p_];
        static const std::set<std::string> stop = {"else", "or", "and", "if", "in", "is", "not"};
        if (skip_op("(")) {
          call_args(*t);
        } else if ((n.kind == Token::Kind::name && !stop.count(n.text)) || n.kind == Token::Kind::string ||
                   n.kind == Token::Kind::integer || n.kind == Token::Kind::real || is_op("[") || is_op("{")) {
          t->add(postfix(primary()));
        }
        e = std::move(t);
      } else if (skip_op("(")) {
        e = call_of(std::move(e));
      } else {
        return e;
      }
    }
  }

  std::vector<Token> t_;
  std::size_t p_ = 0;
  int line_;
  int nesting_ = 0;
};

class Parser {
public:
  explicit Parser(std::vector<Segment> segs) : s_(std::move(segs)) {}

  Body parse_all() {
    std::string end;
    auto body = parse_body({}, end, nullptr);
    return body;
  }

private:
  // Parses nodes until a statement whose keyword is in `ends`; returns that
  // keyword in `end` and leaves its parser (positioned after the keyword) in `tail`.
  Body parse_body(const std::set<std::string>& ends, std::string& end, std::unique_ptr<ExprParser>* tail) {
    Body body;
    while (i_ < s_.size()) {
      const Segment& seg = s_[i_++];
      switch (seg.kind) {
      case Segment::Kind::comment:
        break;
      case Segment::Kind::text:
        if (!seg.content.empty()) {
          auto n = node(Node::Kind::text, seg.line);
          n->text = seg.content;
          body.push_back(std::move(n));
        }
        break;
      case Segment::Kind::expr: {
        ExprParser p(lex(seg.content, seg.line), seg.line);
        auto n = node(Node::Kind::output, seg.line);
        n->expr = p.tuple_or_expression();
        p.expect_end();
        body.push_back(std::move(n));
        break;
      }
      case Segment::Kind::stmt: {
        auto p = std::make_unique<ExprParser>(lex(seg.content, seg.line), seg.line);
        const std::string kw = p->expect_name();
        if (ends.count(kw)) {
          end = kw;
          if (tail)
            *tail = std::move(p);
          return body;
        }
        body.push_back(statement(kw, *p, seg.line));
        break;
      }
      }
    }
    if (!ends.empty()) {
      std::string want;
      for (auto& e : ends)
        want += (want.empty() ? "'" : " or '") + e + "'";
      throw TemplateError("missing " + want + " before the end of the template", s_.empty() ? 0 : s_.back().line);
    }
    return body;
  }

  // The body up to one of `ends`, whose tag must say nothing more; `end` gets which.
  Body block(const std::set<std::string>& ends, std::string& end) {
    std::unique_ptr<ExprParser> tail;
    Body b = parse_body(ends, end, &tail);
    tail->expect_end();
    return b;
  }

  NodePtr node(Node::Kind k, int line) {
    auto n = std::make_unique<Node>();
    n->kind = k;
    n->line = line;
    return n;
  }

  NodePtr statement(const std::string& kw, ExprParser& p, int line) {
    const NestGuard guard(blocks_, line, "blocks");
    if (kw == "if") {
      auto n = node(Node::Kind::if_, line);
      n->conds.push_back(p.expression());
      p.expect_end();
      for (;;) {
        std::string end;
        std::unique_ptr<ExprParser> tail;
        n->bodies.push_back(parse_body({"elif", "else", "endif"}, end, &tail));
        if (end == "elif") {
          n->conds.push_back(tail->expression());
          tail->expect_end();
          continue;
        }
        tail->expect_end();
        if (end == "else") {
          n->bodies.push_back(block({"endif"}, end));
        }
        return n;
      }
    }
    if (kw == "for") {
      auto n = node(Node::Kind::for_, line);
      const bool paren = p.skip_op("(");
      n->targets.push_back(p.expect_name());
      while (p.skip_op(","))
        n->targets.push_back(p.expect_name());
      if (paren)
        p.expect_op(")");
      if (!p.skip_name("in"))
        p.fail("expected 'in'");
      n->expr = p.tuple_or_expression(false);
      if (p.skip_name("if"))
        n->cond = p.expression();
      if (p.is_name("recursive"))
        throw TemplateError("recursive for loops are not supported", line, TemplateError::Kind::unsupported);
      p.expect_end();
      std::string end;
      n->bodies.push_back(block({"else", "endfor"}, end));
      if (end == "else") {
        n->bodies.push_back(block({"endfor"}, end));
      }
      return n;
    }
    if (kw == "set") {
      auto n = node(Node::Kind::set, line);
      n->targets.push_back(p.expect_name());
      if (p.skip_op(".")) {
        n->attr = p.expect_name();
      } else {
        while (p.skip_op(","))
          n->targets.push_back(p.expect_name());
      }
      if (p.skip_op("=")) {
        n->expr = p.tuple_or_expression();
        p.expect_end();
        return n;
      }
      p.expect_end();
      if (n->targets.size() != 1 || !n->attr.empty())
        throw TemplateError("a block set takes one name", line);
      std::string end;
      n->bodies.push_back(block({"endset"}, end));
      return n;
    }
    if (kw == "macro") {
      auto n = node(Node::Kind::macro, line);
      n->text = p.expect_name();
      p.expect_op("(");
      while (!p.is_op(")")) {
        std::string name = p.expect_name();
        ExprPtr def;
        if (p.skip_op("="))
          def = p.expression();
        n->params.emplace_back(std::move(name), std::move(def));
        if (!p.skip_op(","))
          break;
      }
      p.expect_op(")");
      p.expect_end();
      std::string end;
      n->bodies.push_back(block({"endmacro"}, end));
      return n;
    }
    if (kw == "break" || kw == "continue") {
      p.expect_end();
      return node(kw == "break" ? Node::Kind::break_ : Node::Kind::continue_, line);
    }
    if (kw == "generation") { // transformers' assistant-mask marker: renders its body
      p.expect_end();
      auto n = node(Node::Kind::body, line);
      std::string end;
      n->bodies.push_back(block({"endgeneration"}, end));
      return n;
    }
    if (kw == "filter") {
      auto n = node(Node::Kind::filter_block, line);
      // Parse "NAME(args) | ..." as a filter chain applied to a placeholder.
      auto f = std::make_unique<Expr>();
      f->kind = Expr::Kind::name;
      f->name = "\x01input";
      f->line = line;
      ExprPtr chain = std::move(f);
      do {
        auto fe = std::make_unique<Expr>();
        fe->kind = Expr::Kind::filter;
        fe->line = line;
        fe->name = p.expect_name();
        if (!known_filter(fe->name))
          throw TemplateError("unsupported filter '" + fe->name + "'", line, TemplateError::Kind::unsupported);
        fe->add(std::move(chain));
        if (p.skip_op("(")) {
          // Reuse the expression parser for the arguments by parsing a call.
          while (!p.is_op(")")) {
            fe->add(p.expression());
            if (!p.skip_op(","))
              break;
          }
          p.expect_op(")");
        }
        chain = std::move(fe);
      } while (p.skip_op("|"));
      p.expect_end();
      n->expr = std::move(chain);
      std::string end;
      n->bodies.push_back(block({"endfilter"}, end));
      return n;
    }
    throw TemplateError("unsupported statement '" + kw + "'", line, TemplateError::Kind::unsupported);
  }

  std::vector<Segment> s_;
  std::size_t i_ = 0;
  int blocks_ = 0; // statements inside statements
};

} // namespace

Template Template::parse(std::string_view text) {
  // Jinja drops one newline at the very end (keep_trailing_newline is off).
  if (!text.empty() && text.back() == '\n')
    text.remove_suffix(text.size() > 1 && text[text.size() - 2] == '\r' ? 2 : 1);
  Parser p(split(text));
  auto root = std::make_shared<Node>();
  root->kind = Node::Kind::body;
  root->bodies.push_back(p.parse_all());
  Template t;
  t.root_ = std::move(root);
  return t;
}

} // namespace strata::model::jinja
