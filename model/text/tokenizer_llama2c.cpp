// llama2.c `tokenizer.bin`: SentencePiece-style BPE. Encoding follows
// llama2.c's encode(): a dummy-prefix space, one token per UTF-8 character
// (byte fallback <0xXX> = byte + 3 when absent), then repeated merging of the
// adjacent pair whose concatenation has the highest score (O(n log n) with a
// heap of candidate pairs; the same result as llama2.c's O(n^2) loop).

#include "model/base/error.hpp"
#include "model/text/tokenizer_impl.hpp"

#include <cmath>
#include <cstring>
#include <queue>
#include <unordered_map>

namespace strata::model::detail {

namespace {

class Llama2cTokenizer final : public Tokenizer {
public:
  Llama2cTokenizer(const std::string& path, const std::string& data) {
    auto fail = [&](const std::string& what) {
      throw Error(errc::bad_format, "'" + path + "' is not a llama2.c tokenizer.bin: " + what);
    };
    if (data.size() < 4)
      fail("shorter than its 4-byte header");
    int32_t max_len = 0;
    std::memcpy(&max_len, data.data(), 4);
    if (max_len <= 0 || max_len > 4096)
      fail("max_token_length " + std::to_string(max_len) + " is out of range 1..4096");
    std::size_t off = 4;
    while (off < data.size()) {
      if (data.size() - off < 8)
        fail("token " + std::to_string(pieces_.size()) + " is truncated at offset " + std::to_string(off));
      float score;
      int32_t len;
      std::memcpy(&score, data.data() + off, 4);
      std::memcpy(&len, data.data() + off + 4, 4);
      off += 8;
      if (!std::isfinite(score))
        fail("token " + std::to_string(pieces_.size()) + " has a non-finite score");
      if (len < 0 || len > max_len || static_cast<std::size_t>(len) > data.size() - off)
        fail("token " + std::to_string(pieces_.size()) + " has length " + std::to_string(len) +
             " (max_token_length " + std::to_string(max_len) + ", " + std::to_string(data.size() - off) +
             " bytes left)");
      pieces_.emplace_back(data.data() + off, static_cast<std::size_t>(len));
      scores_.push_back(score);
      off += static_cast<std::size_t>(len);
    }
    if (pieces_.size() < 259)
      fail("only " + std::to_string(pieces_.size()) + " tokens (needs <unk>, <s>, </s> and 256 byte tokens)");
    for (std::size_t i = 0; i < pieces_.size(); ++i)
      lookup_.emplace(pieces_[i], static_cast<int32_t>(i)); // first id wins on duplicates
  }

  std::vector<int32_t> encode(std::string_view text, bool add_bos) const override {
    std::vector<int32_t> tokens;
    tokens.reserve(text.size() + 2);
    if (add_bos)
      tokens.push_back(1);
    if (!text.empty()) {
      auto it = lookup_.find(" ");
      if (it != lookup_.end())
        tokens.push_back(it->second);
    }
    std::size_t i = 0;
    while (i < text.size()) {
      // One UTF-8 character: a lead byte plus up to 3 continuation bytes.
      std::size_t j = i + 1;
      while (j < text.size() && j - i < 4 && (static_cast<unsigned char>(text[j]) & 0xC0) == 0x80)
        ++j;
      auto it = lookup_.find(std::string(text.substr(i, j - i)));
      if (it != lookup_.end()) {
        tokens.push_back(it->second);
      } else {
        for (std::size_t k = i; k < j; ++k)
          tokens.push_back(static_cast<int32_t>(static_cast<unsigned char>(text[k])) + 3);
      }
      i = j;
    }
    merge(tokens, add_bos ? 1 : 0);
    return tokens;
  }

  std::string token_bytes(int32_t id, int32_t prev) const override {
    if (id < 0 || id >= static_cast<int32_t>(pieces_.size()))
      throw Error(errc::token_out_of_range, "token id " + std::to_string(id) + " is outside the vocabulary of " +
                                              std::to_string(pieces_.size()));
    std::string_view piece = pieces_[static_cast<std::size_t>(id)];
    if (id == 1 || id == 2)
      return {}; // <s>, </s> carry no text
    // The dummy-prefix space goes at the start of a text (after BOS too).
    if ((prev == 1 || prev == -1) && !piece.empty() && piece[0] == ' ')
      piece.remove_prefix(1);
    // Byte tokens look like "<0x0A>".
    if (piece.size() == 6 && piece[0] == '<' && piece[1] == '0' && piece[2] == 'x' && piece[5] == '>') {
      auto hex = [](char c) -> int {
        return c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
      };
      const int hi = hex(piece[3]), lo = hex(piece[4]);
      if (hi >= 0 && lo >= 0)
        return std::string(1, static_cast<char>(hi * 16 + lo));
    }
    return std::string(piece);
  }

  int64_t vocab_size() const override { return static_cast<int64_t>(pieces_.size()); }
  int32_t bos_id() const override { return 1; }
  std::string kind() const override { return "llama2c"; }

private:
  // llama2.c's merge loop, in O(n log n): repeatedly merge the adjacent pair
  // whose concatenation is a piece with the highest score (the leftmost pair on
  // ties). Symbols form a linked list; candidate pairs wait in a heap ordered by
  // (score, leftmost), and a candidate whose symbols changed since it was queued
  // is dropped when it comes up. The leftmost live pair is the one whose left
  // symbol started first in the text, since merging keeps the order.
  void merge(std::vector<int32_t>& tokens, std::size_t first) const {
    const std::size_t n = tokens.size();
    if (n < first + 2)
      return;
    std::vector<int64_t> prev(n), next(n);
    std::vector<uint32_t> version(n, 0);
    for (std::size_t i = 0; i < n; ++i) {
      prev[i] = static_cast<int64_t>(i) - 1;
      next[i] = i + 1 < n ? static_cast<int64_t>(i + 1) : -1;
    }
    struct Cand {
      float score;
      int64_t left, right;
      uint32_t left_version, right_version;
      int32_t id;
      bool operator<(const Cand& o) const { // std::priority_queue pops the largest
        return score != o.score ? score < o.score : left > o.left;
      }
    };
    std::priority_queue<Cand> q;
    std::string buf;
    const auto push = [&](int64_t l) {
      if (l < static_cast<int64_t>(first))
        return;
      const int64_t r = next[static_cast<std::size_t>(l)];
      if (r < 0)
        return;
      buf = pieces_[static_cast<std::size_t>(tokens[static_cast<std::size_t>(l)])];
      buf += pieces_[static_cast<std::size_t>(tokens[static_cast<std::size_t>(r)])];
      auto it = lookup_.find(buf);
      if (it == lookup_.end())
        return;
      q.push({scores_[static_cast<std::size_t>(it->second)], l, r, version[static_cast<std::size_t>(l)],
              version[static_cast<std::size_t>(r)], it->second});
    };
    for (std::size_t i = first; i + 1 < n; ++i)
      push(static_cast<int64_t>(i));
    std::vector<bool> alive(n, true);
    while (!q.empty()) {
      const Cand c = q.top();
      q.pop();
      const auto l = static_cast<std::size_t>(c.left), r = static_cast<std::size_t>(c.right);
      if (!alive[l] || !alive[r] || next[l] != c.right || version[l] != c.left_version ||
          version[r] != c.right_version)
        continue; // stale: one of its symbols was merged since
      tokens[l] = c.id;
      ++version[l];
      alive[r] = false;
      next[l] = next[r];
      if (next[r] >= 0)
        prev[static_cast<std::size_t>(next[r])] = c.left;
      push(prev[l]);
      push(c.left);
    }
    std::size_t w = 0;
    for (std::size_t i = 0; i < n; ++i)
      if (alive[i])
        tokens[w++] = tokens[i];
    tokens.resize(w);
  }

  std::vector<std::string> pieces_;
  std::vector<float> scores_;
  std::unordered_map<std::string, int32_t> lookup_;
};

} // namespace

std::unique_ptr<Tokenizer> make_llama2c_tokenizer(const std::string& path, const std::string& data) {
  return std::make_unique<Llama2cTokenizer>(path, data);
}

} // namespace strata::model::detail
