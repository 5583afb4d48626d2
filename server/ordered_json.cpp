#include "server/ordered_json.hpp"

#include <string>
#include <unordered_map>
#include <vector>

namespace strata::server {

namespace {

using ojson = nlohmann::ordered_json;
// ordered_json's object is a vector of pairs: appended to directly, a key is
// not searched for; a map per open object finds repeated keys.
using Slots = std::vector<std::pair<const std::string, ojson>>;

struct Builder : nlohmann::json_sax<ojson> {
  ojson root;
  std::vector<ojson*> open;                                    // the containers being filled, innermost last
  std::vector<std::unordered_map<std::string, std::size_t>> at; // per open object: key -> slot
  std::string name; // the key of the value that comes next

  bool put(ojson v) {
    if (open.empty()) {
      root = std::move(v);
      return true;
    }
    ojson* top = open.back();
    if (top->is_array()) {
      top->get_ref<ojson::array_t&>().push_back(std::move(v));
      return true;
    }
    auto& slots = static_cast<Slots&>(top->get_ref<ojson::object_t&>());
    auto [it, fresh] = at.back().try_emplace(name, slots.size());
    if (fresh)
      slots.emplace_back(name, std::move(v));
    else
      slots[it->second].second = std::move(v);
    return true;
  }
  // The container just put (the last slot of its parent, or the root).
  ojson* last() {
    if (open.empty())
      return &root;
    ojson* top = open.back();
    if (top->is_array())
      return &top->get_ref<ojson::array_t&>().back();
    auto& slots = static_cast<Slots&>(top->get_ref<ojson::object_t&>());
    return &slots[at.back().at(name)].second;
  }

  bool null() override { return put(nullptr); }
  bool boolean(bool v) override { return put(v); }
  bool number_integer(number_integer_t v) override { return put(v); }
  bool number_unsigned(number_unsigned_t v) override { return put(v); }
  bool number_float(number_float_t v, const string_t&) override { return put(v); }
  bool string(string_t& v) override { return put(std::move(v)); }
  bool binary(binary_t& v) override { return put(ojson::binary(std::move(v))); }
  bool start_object(std::size_t) override {
    put(ojson::object());
    open.push_back(last());
    at.emplace_back();
    return true;
  }
  bool key(string_t& k) override {
    name = std::move(k);
    return true;
  }
  bool end_object() override {
    open.pop_back();
    at.pop_back();
    return true;
  }
  bool start_array(std::size_t) override {
    put(ojson::array());
    open.push_back(last());
    return true;
  }
  bool end_array() override {
    open.pop_back();
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override { return false; }
};

} // namespace

ojson parse_ordered(std::string_view text) {
  Builder b;
  if (!ojson::sax_parse(text.begin(), text.end(), &b, nlohmann::detail::input_format_t::json, true, false))
    return ojson(ojson::value_t::discarded);
  return std::move(b.root);
}

} // namespace strata::server
