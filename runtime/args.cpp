#include "runtime/args.hpp"

#include <charconv>
#include <cmath>
#include <sstream>

namespace strata::runtime {

Args& Args::option(const std::string& name, const std::string& value_name, const std::string& help) {
  opts_[name] = Opt{value_name, help};
  order_.emplace_back(name, Opt{value_name, help});
  return *this;
}

void Args::parse(int argc, char** argv, int first, const std::string& positional_name) {
  for (int i = first; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      help_ = true;
      continue;
    }
    if (a.rfind("--", 0) != 0 || a.size() == 2) {
      if (positional_name.empty())
        throw UsageError("unexpected argument '" + a + "'");
      positionals_.push_back(a);
      continue;
    }
    std::string name = a.substr(2), value;
    bool inline_value = false;
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      inline_value = true;
    }
    auto it = opts_.find(name);
    if (it == opts_.end())
      throw UsageError("unknown option '--" + name + "'");
    if (values_.count(name))
      throw UsageError("option '--" + name + "' given twice");
    if (it->second.value_name.empty()) {
      if (inline_value)
        throw UsageError("option '--" + name + "' takes no value");
      values_[name] = "1";
    } else {
      if (!inline_value) {
        if (i + 1 >= argc)
          throw UsageError("option '--" + name + "' needs a value (" + it->second.value_name + ")");
        value = argv[++i];
      }
      values_[name] = value;
    }
  }
}

std::string Args::str(const std::string& name, const std::string& dflt) const {
  auto it = values_.find(name);
  return it == values_.end() ? dflt : it->second;
}

std::string Args::required(const std::string& name) const {
  auto it = values_.find(name);
  if (it == values_.end())
    throw UsageError("missing required option '--" + name + "'");
  return it->second;
}

int64_t Args::integer(const std::string& name, int64_t dflt, int64_t min, int64_t max) const {
  auto it = values_.find(name);
  if (it == values_.end())
    return dflt;
  const std::string& s = it->second;
  int64_t v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc{} || p != s.data() + s.size() || s.empty())
    throw UsageError("option '--" + name + "' expects an integer, got '" + s + "'");
  if (v < min || v > max)
    throw UsageError("option '--" + name + "' must be in " + std::to_string(min) + ".." + std::to_string(max) + ", got " + s);
  return v;
}

double Args::number(const std::string& name, double dflt, double min, double max) const {
  auto it = values_.find(name);
  if (it == values_.end())
    return dflt;
  const std::string& s = it->second;
  double v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc{} || p != s.data() + s.size() || s.empty() || !std::isfinite(v))
    throw UsageError("option '--" + name + "' expects a number, got '" + s + "'");
  if (v < min || v > max) {
    std::ostringstream os;
    os << "option '--" << name << "' must be in [" << min << ", " << max << "], got " << s;
    throw UsageError(os.str());
  }
  return v;
}

std::string Args::help_text() const {
  std::ostringstream os;
  for (auto& [name, o] : order_) {
    std::string left = "  --" + name + (o.value_name.empty() ? "" : " " + o.value_name);
    os << left;
    if (left.size() < 28)
      os << std::string(28 - left.size(), ' ');
    else
      os << "\n" << std::string(28, ' ');
    os << o.help << "\n";
  }
  os << "  --help                    this text\n";
  return os.str();
}

std::vector<int32_t> parse_id_list(const std::string& text, const std::string& what) {
  std::vector<int32_t> ids;
  std::string item;
  for (std::size_t i = 0; i <= text.size(); ++i) {
    if (i == text.size() || text[i] == ',' || text[i] == ' ' || text[i] == '\n' || text[i] == '\t') {
      if (!item.empty()) {
        int64_t v = 0;
        auto [p, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
        if (ec != std::errc{} || p != item.data() + item.size() || v < 0 || v > INT32_MAX)
          throw UsageError(what + ": '" + item + "' is not a token id");
        ids.push_back(static_cast<int32_t>(v));
        item.clear();
      } else if (i < text.size() && text[i] == ',') {
        throw UsageError(what + ": empty item in '" + text + "'");
      }
    } else {
      item += text[i];
    }
  }
  return ids;
}

} // namespace strata::runtime
