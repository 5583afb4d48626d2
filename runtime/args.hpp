#pragma once
// A small command-line parser for the strata subcommands: declared options,
// strict numbers, one-line errors (UsageError -> exit code 2).

#include <cstdint>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace strata::runtime {

/// Wrong or missing command-line arguments.
class UsageError : public std::runtime_error {
public:
  using std::runtime_error::runtime_error;
};

class Args {
public:
  /// `name` without dashes; `value_name` empty for a flag without value.
  Args& option(const std::string& name, const std::string& value_name, const std::string& help);
  /// Parses argv[first..]; positionals are allowed only when `positional_name` is set.
  /// `--config FILE` reads more options from an INI-style file (`name = value`
  /// lines, `#`/`;` comments, `[sections]` ignored, values may be quoted, a flag
  /// is `name = true`); the command line wins over the file; unknown names and
  /// malformed lines are errors naming the file and line.
  void parse(int argc, char** argv, int first, const std::string& positional_name = {});

  bool has(const std::string& name) const { return values_.count(name) != 0; }
  std::string str(const std::string& name, const std::string& dflt = {}) const;
  std::string required(const std::string& name) const;
  int64_t integer(const std::string& name, int64_t dflt, int64_t min, int64_t max) const;
  double number(const std::string& name, double dflt, double min, double max) const;
  const std::vector<std::string>& positionals() const { return positionals_; }
  bool help_requested() const { return help_; }
  /// The option table, for --help.
  std::string help_text() const;

private:
  void read_config_file(const std::string& path);
  void set_value(const std::string& name, const std::string& value, bool inline_value, bool from_file,
                 const std::string& where);
  struct Opt {
    std::string value_name, help;
  };
  std::vector<std::pair<std::string, Opt>> order_;
  std::map<std::string, Opt> opts_;
  std::map<std::string, std::string> values_;
  std::vector<std::string> positionals_;
  bool help_ = false;
};

/// "1,2,3" or "1 2 3" -> ids; throws UsageError naming the bad item.
std::vector<int32_t> parse_id_list(const std::string& text, const std::string& what);

} // namespace strata::runtime
