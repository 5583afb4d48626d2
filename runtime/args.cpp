#include "runtime/args.hpp"

#include <charconv>
#include <cmath>
#include <fstream>
#include <sstream>

namespace strata::runtime {

Args& Args::option(const std::string& name, const std::string& value_name, const std::string& help) {
  opts_[name] = Opt{value_name, help};
  order_.emplace_back(name, Opt{value_name, help});
  return *this;
}

void Args::set_value(const std::string& name, const std::string& value, bool has_value, bool from_file,
                     const std::string& where) {
  auto it = opts_.find(name);
  if (it == opts_.end())
    throw UsageError(where + "unknown option '--" + name + "'");
  if (values_.count(name)) {
    if (from_file)
      return; // the command line wins
    throw UsageError("option '--" + name + "' given twice");
  }
  if (it->second.value_name.empty()) {
    if (has_value && !(from_file && (value == "true" || value == "1")))
      throw UsageError(where + "option '--" + name + "' takes no value");
    values_[name] = "1";
  } else {
    values_[name] = value;
  }
}

void Args::read_config_file(const std::string& path) {
  std::ifstream in(path);
  if (!in)
    throw UsageError("cannot read config file '" + path + "'");
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    ++n;
    const auto first = line.find_first_not_of(" \t\r");
    if (first == std::string::npos || line[first] == '#' || line[first] == ';' || line[first] == '[')
      continue;
    const auto eq = line.find('=');
    const std::string where = path + ":" + std::to_string(n) + ": ";
    if (eq == std::string::npos)
      throw UsageError(where + "expected 'name = value'");
    auto trim = [](std::string x) {
      const auto b = x.find_first_not_of(" \t\r");
      const auto e = x.find_last_not_of(" \t\r");
      return b == std::string::npos ? std::string{} : x.substr(b, e - b + 1);
    };
    const std::string name = trim(line.substr(0, eq));
    std::string value = trim(line.substr(eq + 1));
    if (value.size() >= 2 && value.front() == '"' && value.back() == '"')
      value = value.substr(1, value.size() - 2);
    set_value(name, value, true, true, where);
  }
}

void Args::parse(int argc, char** argv, int first, const std::string& positional_name) {
  std::string config_file;
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
    if (name == "config") {
      if (!inline_value) {
        if (i + 1 >= argc)
          throw UsageError("option '--config' needs a value (FILE)");
        value = argv[++i];
      }
      config_file = value;
      continue;
    }
    auto it = opts_.find(name);
    if (it != opts_.end() && !it->second.value_name.empty() && !inline_value) {
      if (i + 1 >= argc)
        throw UsageError("option '--" + name + "' needs a value (" + it->second.value_name + ")");
      value = argv[++i];
      inline_value = true;
    } else if (it != opts_.end() && it->second.value_name.empty() && inline_value) {
      throw UsageError("option '--" + name + "' takes no value");
    }
    set_value(name, value, inline_value, false, "");
  }
  if (!config_file.empty())
    read_config_file(config_file);
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
  os << "  --config FILE             read options from an INI-style file (name = value)\n";
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
