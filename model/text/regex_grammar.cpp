#include "model/text/regex_grammar.hpp"

#include "model/base/error.hpp"

#include <bitset>
#include <vector>

namespace strata::model {

namespace {

using Set = std::bitset<128>; // ASCII characters

class RegexGrammar {
public:
  RegexGrammar(std::string_view p, std::string any, std::string mb, std::string path)
      : p_(p), any_(std::move(any)), mb_(std::move(mb)), path_(std::move(path)) {}

  std::string run() {
    bool head = false, tail = false;
    if (!p_.empty() && p_.front() == '^') {
      head = true;
      p_.remove_prefix(1);
    }
    if (!p_.empty() && p_.back() == '$' && (p_.size() < 2 || p_[p_.size() - 2] != '\\')) {
      tail = true;
      p_.remove_suffix(1);
    }
    std::string body = alternatives(0);
    if (i_ != p_.size())
      fail("unexpected '" + std::string(1, p_[i_]) + "' at offset " + std::to_string(i_));
    return (head ? "" : "( " + any_ + " )* ") + "( " + body + " )" + (tail ? "" : " ( " + any_ + " )*");
  }

private:
  [[noreturn]] void fail(const std::string& what) const {
    throw Error(errc::bad_argument, path_ + ": 'pattern' is not supported here: " + what);
  }

  std::string alternatives(int depth) {
    if (depth > 32)
      fail("nested deeper than 32 groups");
    std::string out = sequence(depth);
    while (i_ < p_.size() && p_[i_] == '|') {
      ++i_;
      out += " | " + sequence(depth);
    }
    return out;
  }

  std::string sequence(int depth) {
    std::string out;
    while (i_ < p_.size() && p_[i_] != '|' && p_[i_] != ')') {
      std::string atom = this->atom(depth);
      atom = repeat(std::move(atom));
      out += (out.empty() ? "" : " ") + atom;
    }
    return out.empty() ? "\"\"" : out;
  }

  std::string repeat(std::string atom) {
    if (i_ >= p_.size())
      return atom;
    std::string q;
    const char c = p_[i_];
    if (c == '*' || c == '+' || c == '?') {
      q = std::string(1, c);
      ++i_;
    } else if (c == '{') {
      const std::size_t close = p_.find('}', i_);
      if (close == std::string_view::npos)
        fail("'{' without '}'");
      const std::string inner(p_.substr(i_ + 1, close - i_ - 1));
      if (inner.empty() || inner.find_first_not_of("0123456789,") != std::string::npos || inner[0] == ',')
        fail("repetition {" + inner + "}");
      q = "{" + inner + "}";
      i_ = close + 1;
    } else {
      return atom;
    }
    if (i_ < p_.size() && p_[i_] == '?')
      ++i_; // lazy: the same strings match
    if (i_ < p_.size() && (p_[i_] == '*' || p_[i_] == '+' || p_[i_] == '{'))
      fail("a repetition of a repetition");
    return "( " + atom + " )" + q;
  }

  // One ASCII character as the bytes of its JSON encoding.
  static std::string encoded(unsigned char c) {
    static const char* hex = "0123456789abcdef";
    switch (c) {
      case '"': return "\"\\\\\\\"\"";    // \"
      case '\\': return "\"\\\\\\\\\"";   // \\ (two bytes)
      case '\n': return "\"\\\\n\"";
      case '\r': return "\"\\\\r\"";
      case '\t': return "\"\\\\t\"";
      case '\b': return "\"\\\\b\"";
      case '\f': return "\"\\\\f\"";
      default: break;
    }
    if (c < 0x20 || c == 0x7f)
      return std::string("\"\\\\u00") + hex[c >> 4] + hex[c & 15] + "\"";
    return std::string("[\\x") + hex[c >> 4] + hex[c & 15] + "]";
  }

  // A set of ASCII characters (and, negated, any non-ASCII one).
  std::string set_expr(const Set& s, bool non_ascii) {
    std::string plain, out;
    static const char* hex = "0123456789abcdef";
    for (int c = 0; c < 128; ++c) {
      if (!s[static_cast<std::size_t>(c)])
        continue;
      if (c >= 0x20 && c != '"' && c != '\\' && c != 0x7f) {
        plain += std::string("\\x") + hex[c >> 4] + hex[c & 15];
      } else {
        out += (out.empty() ? "" : " | ") + encoded(static_cast<unsigned char>(c));
      }
    }
    if (!plain.empty())
      out = "[" + plain + "]" + (out.empty() ? "" : " | " + out);
    if (non_ascii)
      out += (out.empty() ? "" : " | ") + mb_;
    if (out.empty())
      fail("a class that matches nothing");
    return "( " + out + " )";
  }

  static Set digits() {
    Set s;
    for (int c = '0'; c <= '9'; ++c)
      s.set(static_cast<std::size_t>(c));
    return s;
  }
  static Set word() {
    Set s = digits();
    for (int c = 'a'; c <= 'z'; ++c)
      s.set(static_cast<std::size_t>(c)), s.set(static_cast<std::size_t>(c - 32));
    s.set('_');
    return s;
  }
  static Set space() {
    Set s;
    for (char c : {' ', '\t', '\n', '\r', '\f', '\v'})
      s.set(static_cast<std::size_t>(c));
    return s;
  }

  // An escape after '\': a set (and whether it is negated), or one character.
  bool escape(Set& s, bool& negated) {
    if (i_ >= p_.size())
      fail("ends with '\\'");
    const char c = p_[i_++];
    negated = false;
    switch (c) {
      case 'd': s = digits(); return true;
      case 'w': s = word(); return true;
      case 's': s = space(); return true;
      case 'D': s = digits(); negated = true; return true;
      case 'W': s = word(); negated = true; return true;
      case 'S': s = space(); negated = true; return true;
      case 'n': s.reset(); s.set('\n'); return true;
      case 'r': s.reset(); s.set('\r'); return true;
      case 't': s.reset(); s.set('\t'); return true;
      case 'f': s.reset(); s.set('\f'); return true;
      case 'v': s.reset(); s.set('\v'); return true;
      case 'x':
      case 'u': {
        const std::size_t digits = c == 'x' ? 2 : 4;
        if (i_ + digits > p_.size())
          fail(std::string("escape '\\") + c + "' without its hex digits");
        int v = 0;
        for (std::size_t k = 0; k < digits; ++k) {
          const char h = p_[i_++];
          const int d = h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10 : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
          if (d < 0)
            fail(std::string("escape '\\") + c + "' without its hex digits");
          v = v * 16 + d;
        }
        if (v >= 0x80)
          fail(std::string("escape '\\") + c + "' of a non-ASCII character");
        s.reset();
        s.set(static_cast<std::size_t>(v));
        return true;
      }
      default: break;
    }
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'))
      fail(std::string("escape '\\") + c + "'");
    if (static_cast<unsigned char>(c) >= 0x80)
      fail("a non-ASCII escape");
    s.reset();
    s.set(static_cast<std::size_t>(static_cast<unsigned char>(c)));
    return true;
  }

  std::string atom(int depth) {
    const char c = p_[i_];
    if (c == '(') {
      ++i_;
      if (i_ < p_.size() && p_[i_] == '?') {
        if (i_ + 1 < p_.size() && p_[i_ + 1] == ':')
          i_ += 2;
        else
          fail("lookarounds and named groups");
      }
      std::string inner = alternatives(depth + 1);
      if (i_ >= p_.size() || p_[i_] != ')')
        fail("'(' without ')'");
      ++i_;
      return "( " + inner + " )";
    }
    if (c == '[')
      return klass();
    if (c == '.') {
      ++i_;
      Set s;
      for (int b = 0x20; b < 0x7f; ++b)
        s.set(static_cast<std::size_t>(b));
      s.set('\t');
      return set_expr(s, true); // every character but line ends
    }
    if (c == '^' || c == '$')
      fail("anchors inside the pattern");
    if (c == '*' || c == '+' || c == '?' || c == '{')
      fail("a repetition of nothing");
    if (c == '\\') {
      ++i_;
      Set s;
      bool neg = false;
      escape(s, neg);
      return neg ? set_expr(~s, true) : set_expr(s, false);
    }
    // A literal character (a UTF-8 sequence as it is).
    const auto b = static_cast<unsigned char>(c);
    if (b < 0x80) {
      ++i_;
      Set s;
      s.set(b);
      return set_expr(s, false);
    }
    std::size_t len = b >= 0xF0 ? 4 : b >= 0xE0 ? 3 : b >= 0xC0 ? 2 : 1;
    if (len == 1 || i_ + len > p_.size())
      fail("invalid UTF-8");
    std::string lit = "\"";
    static const char* hex = "0123456789abcdef";
    for (std::size_t k = 0; k < len; ++k) {
      const auto x = static_cast<unsigned char>(p_[i_ + k]);
      lit += std::string("\\x") + hex[x >> 4] + hex[x & 15];
    }
    i_ += len;
    return lit + "\"";
  }

  std::string klass() {
    ++i_; // '['
    bool negate = false;
    if (i_ < p_.size() && p_[i_] == '^') {
      negate = true;
      ++i_;
    }
    Set s;
    bool first = true;
    while (i_ < p_.size() && (p_[i_] != ']' || first)) {
      first = false;
      Set one;
      bool neg = false;
      int lo = -1;
      if (p_[i_] == '\\') {
        ++i_;
        escape(one, neg);
        if (neg)
          one = ~one;
        if (!neg && one.count() == 1)
          for (int k = 0; k < 128; ++k)
            if (one[static_cast<std::size_t>(k)])
              lo = k;
      } else {
        const auto b = static_cast<unsigned char>(p_[i_++]);
        if (b >= 0x80)
          fail("a non-ASCII character in a class");
        one.set(b);
        lo = b;
      }
      if (lo >= 0 && i_ + 1 < p_.size() && p_[i_] == '-' && p_[i_ + 1] != ']') {
        ++i_;
        int hi = static_cast<unsigned char>(p_[i_]);
        if (p_[i_] == '\\') {
          ++i_;
          Set h;
          bool hn = false;
          escape(h, hn);
          if (hn || h.count() != 1)
            fail("a class range to a set");
          for (int k = 0; k < 128; ++k)
            if (h[static_cast<std::size_t>(k)])
              hi = k;
        } else {
          ++i_;
        }
        if (hi >= 0x80 || hi < lo)
          fail("a class range that runs backwards or past ASCII");
        for (int k = lo; k <= hi; ++k)
          one.set(static_cast<std::size_t>(k));
      }
      s |= one;
    }
    if (i_ >= p_.size())
      fail("'[' without ']'");
    ++i_;
    return negate ? set_expr(~s, true) : set_expr(s, false);
  }

  std::string_view p_;
  std::string any_, mb_, path_;
  std::size_t i_ = 0;
};

} // namespace

std::string regex_grammar(std::string_view pattern, const std::string& any_char, const std::string& multibyte,
                          const std::string& path) {
  if (pattern.size() > 1000)
    throw Error(errc::bad_argument, path + ": 'pattern' is not supported here: longer than 1000 characters");
  return RegexGrammar(pattern, any_char, multibyte, path).run();
}

} // namespace strata::model
