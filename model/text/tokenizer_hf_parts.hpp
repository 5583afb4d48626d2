#pragma once
// Internal to model/: what the two tokenizer.json readers share (byte-level BPE
// in tokenizer_hf.cpp, SentencePiece-style BPE in tokenizer_hf_spm.cpp): the
// vocabulary, merge ranks and added tokens, splitting text at added tokens,
// a heap-driven BPE over symbols, and the BOS the post-processor adds.

#include "model/text/tokenizer.hpp"

#include <nlohmann/json.hpp>

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace strata::model::detail {

struct HfVocab {
  std::unordered_map<std::string, int32_t> vocab;
  std::unordered_map<std::string, int32_t> ranks; ///< "a\x01b" -> merge rank
  std::vector<std::pair<std::string, int32_t>> added; ///< longest first
  std::unordered_map<int32_t, std::string> added_by_id;
  std::unordered_map<std::string, int32_t> added_ids;
  std::unordered_set<int32_t> special_ids; ///< added tokens marked "special" (control tokens)
  std::vector<std::string> id_to_token;
  int32_t bos = -1; ///< the post-processor's leading special token, -1 when none
  std::array<std::vector<uint32_t>, 256> added_by_first; ///< indices into `added` by first byte

  /// Reads model.vocab, model.merges (pairs or "a b" strings), added_tokens and
  /// the post-processor's BOS. Throws Error(bad_format) naming `path`.
  void load(const nlohmann::json& j, const std::string& path);
  /// Calls plain(segment, index) for the text between added tokens and
  /// pushes added tokens' ids into `ids`, left to right (the earliest match;
  /// the longest at the same offset). A special added token is matched only
  /// where `special` allows it (else its text stays in the plain segment).
  void split_added(std::string_view text, std::vector<int32_t>& ids,
                   const std::function<void(std::string_view, int)>& plain, const SpecialText& special = {}) const;
  /// The special added tokens split_added() would match: (offset, length) each.
  std::vector<std::pair<std::size_t, std::size_t>> find_special(std::string_view text) const;
  /// Merges adjacent symbols by rank (lowest first, leftmost on ties) until
  /// no pair has a rank. O(n log n).
  void merge(std::vector<std::string>& symbols) const;
  int32_t id_of(const std::string& token) const;
};

/// What both tokenizer.json readers share as tokenizers: the vocabulary, and a
/// text split at added tokens (special ones where SpecialText allows) before each
/// plain segment is encoded by the reader's own model.
class HfTokenizerBase : public Tokenizer {
public:
  std::vector<int32_t> encode(std::string_view text, bool add_bos) const override { return encode_with(text, add_bos, {}); }
  std::vector<int32_t> encode_with(std::string_view text, bool add_bos, const SpecialText& special) const override;
  std::vector<std::pair<std::size_t, std::size_t>> find_special(std::string_view text) const override {
    return v_.find_special(text);
  }

protected:
  /// Appends the ids of one plain segment, the `segment`-th piece of the text
  /// between added tokens (0-based; added tokens count too).
  virtual void encode_segment(std::string_view plain, int segment, std::vector<int32_t>& ids) const = 0;
  HfVocab v_;
};

} // namespace strata::model::detail
