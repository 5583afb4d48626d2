#include "model/text/tokenizer_hf_parts.hpp"

#include "model/base/error.hpp"

#include <algorithm>
#include <climits>
#include <queue>

namespace strata::model::detail {

using nlohmann::json;

void HfVocab::load(const json& j, const std::string& path) {
  const json& model = j["model"];
  if (!model.contains("vocab") || !model["vocab"].is_object())
    throw Error(errc::bad_format, "tokenizer '" + path + "': model.vocab is missing");
  int64_t max_id = -1;
  for (auto& [tok, id] : model["vocab"].items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX)
      throw Error(errc::bad_format, "tokenizer '" + path + "': vocab entry '" + tok + "' has a bad id");
    vocab[tok] = id.get<int32_t>();
    max_id = std::max<int64_t>(max_id, id.get<int64_t>());
  }
  if (model.contains("merges") && model["merges"].is_array()) {
    int32_t rank = 0;
    for (auto& m : model["merges"]) {
      std::string a, b;
      if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
        a = m[0].get<std::string>();
        b = m[1].get<std::string>();
      } else if (m.is_string()) {
        const auto s = m.get<std::string>();
        const auto sp = s.find(' ', 1);
        if (sp == std::string::npos)
          throw Error(errc::bad_format, "tokenizer '" + path + "': merge '" + s + "' has no space");
        a = s.substr(0, sp);
        b = s.substr(sp + 1);
      } else {
        throw Error(errc::bad_format, "tokenizer '" + path + "': a merge is neither a pair nor a string");
      }
      ranks.emplace(a + '\x01' + b, rank++);
    }
  }
  if (j.contains("added_tokens") && j["added_tokens"].is_array()) {
    for (auto& t : j["added_tokens"]) {
      const auto content = t.value("content", std::string{});
      const auto id = t.value("id", -1);
      if (content.empty() || id < 0)
        throw Error(errc::bad_format, "tokenizer '" + path + "': an added token lacks content or id");
      added.emplace_back(content, id);
      if (t.value("special", false))
        special_ids.insert(id);
      added_by_id[id] = content;
      added_ids.emplace(content, id); // the first one, as a scan in file order would find
      max_id = std::max<int64_t>(max_id, id);
    }
  }
  std::stable_sort(added.begin(), added.end(), [](auto& x, auto& y) { return x.first.size() > y.first.size(); });
  for (std::size_t k = 0; k < added.size(); ++k)
    added_by_first[static_cast<unsigned char>(added[k].first[0])].push_back(static_cast<uint32_t>(k));
  id_to_token.resize(static_cast<std::size_t>(max_id + 1));
  for (auto& [tok, id] : vocab)
    id_to_token[static_cast<std::size_t>(id)] = tok;
  // TemplateProcessing (alone or in a Sequence) whose "single" starts with a special token: BOS.
  const auto bos_of = [&](const json& p) {
    if (!p.is_object() || p.value("type", std::string{}) != "TemplateProcessing" || !p.contains("single") ||
        !p["single"].is_array() || p["single"].empty())
      return;
    const json& first = p["single"][0];
    if (first.is_object() && first.contains("SpecialToken") && first["SpecialToken"].contains("id"))
      bos = id_of(first["SpecialToken"]["id"].get<std::string>());
  };
  if (j.contains("post_processor") && j["post_processor"].is_object()) {
    const json& pp = j["post_processor"];
    if (pp.value("type", std::string{}) == "Sequence" && pp.contains("processors"))
      for (auto& p : pp["processors"])
        bos_of(p);
    else
      bos_of(pp);
  }
}

int32_t HfVocab::id_of(const std::string& token) const {
  if (auto it = added_ids.find(token); it != added_ids.end())
    return it->second;
  auto it = vocab.find(token);
  return it == vocab.end() ? -1 : it->second;
}

void HfVocab::split_added(std::string_view text, std::vector<int32_t>& ids,
                          const std::function<void(std::string_view, int)>& plain, const SpecialText& special) const {
  // One pass: at each offset, the added tokens that start with its byte, longest
  // first; the earliest match wins, and the longest one at that offset.
  std::size_t start = 0;
  int segment = 0;
  for (std::size_t pos = 0; pos < text.size();) {
    const auto& candidates = added_by_first[static_cast<unsigned char>(text[pos])];
    const std::pair<std::string, int32_t>* hit = nullptr;
    for (uint32_t k : candidates)
      if (text.compare(pos, added[k].first.size(), added[k].first) == 0 &&
          (!special_ids.count(added[k].second) || special.allows(pos, added[k].first.size()))) {
        hit = &added[k];
        break;
      }
    if (!hit) {
      ++pos;
      continue;
    }
    if (pos > start)
      plain(text.substr(start, pos - start), segment++);
    ids.push_back(hit->second);
    ++segment;
    pos += hit->first.size();
    start = pos;
  }
  if (start < text.size())
    plain(text.substr(start), segment);
}

std::vector<int32_t> HfTokenizerBase::encode_with(std::string_view text, bool add_bos, const SpecialText& special) const {
  check_utf8(text);
  std::vector<int32_t> ids;
  if (add_bos && v_.bos >= 0)
    ids.push_back(v_.bos);
  v_.split_added(text, ids, [&](std::string_view plain, int segment) { encode_segment(plain, segment, ids); }, special);
  return ids;
}

std::vector<std::pair<std::size_t, std::size_t>> HfVocab::find_special(std::string_view text) const {
  std::vector<std::pair<std::size_t, std::size_t>> out;
  if (special_ids.empty())
    return out;
  for (std::size_t pos = 0; pos < text.size();) {
    const std::pair<std::string, int32_t>* hit = nullptr;
    for (uint32_t k : added_by_first[static_cast<unsigned char>(text[pos])])
      if (text.compare(pos, added[k].first.size(), added[k].first) == 0) {
        hit = &added[k];
        break;
      }
    if (!hit) {
      ++pos;
      continue;
    }
    if (special_ids.count(hit->second))
      out.emplace_back(pos, hit->first.size());
    pos += hit->first.size();
  }
  return out;
}

void HfVocab::merge(std::vector<std::string>& sym) const {
  const std::size_t n = sym.size();
  if (n < 2)
    return;
  std::vector<int> prev(n), nxt(n);
  std::vector<bool> alive(n, true);
  for (std::size_t i = 0; i < n; ++i) {
    prev[i] = static_cast<int>(i) - 1;
    nxt[i] = i + 1 < n ? static_cast<int>(i + 1) : -1;
  }
  struct Cand {
    int32_t rank;
    int left;
    std::size_t left_len, right_len; // the symbols' sizes when queued (stale check)
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : left > o.left; }
  };
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> q;
  std::string key;
  const auto push = [&](int l) {
    const int r = nxt[static_cast<std::size_t>(l)];
    if (l < 0 || r < 0)
      return;
    key = sym[static_cast<std::size_t>(l)];
    key += '\x01';
    key += sym[static_cast<std::size_t>(r)];
    auto it = ranks.find(key);
    if (it != ranks.end())
      q.push({it->second, l, sym[static_cast<std::size_t>(l)].size(), sym[static_cast<std::size_t>(r)].size()});
  };
  for (std::size_t i = 0; i + 1 < n; ++i)
    push(static_cast<int>(i));
  while (!q.empty()) {
    const Cand c = q.top();
    q.pop();
    const auto l = static_cast<std::size_t>(c.left);
    if (!alive[l] || nxt[l] < 0)
      continue;
    const auto r = static_cast<std::size_t>(nxt[l]);
    if (sym[l].size() != c.left_len || sym[r].size() != c.right_len)
      continue; // one side changed since this pair was queued
    sym[l] += sym[r];
    alive[r] = false;
    nxt[l] = nxt[r];
    if (nxt[r] >= 0)
      prev[static_cast<std::size_t>(nxt[r])] = static_cast<int>(l);
    if (prev[l] >= 0)
      push(prev[l]);
    push(static_cast<int>(l));
  }
  std::vector<std::string> out;
  for (int i = 0; i >= 0; i = nxt[static_cast<std::size_t>(i)])
    out.push_back(std::move(sym[static_cast<std::size_t>(i)]));
  sym.swap(out);
}

} // namespace strata::model::detail
