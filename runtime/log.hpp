#pragma once
// One leveled, timestamped logger for every strata process (spdlog underneath):
// `--log-level trace|debug|info|warn|error|off` and `--log-format text|json`.
// Text lines: `2026-11-30T20:57:02.123Z info  coordinator: node joined ...`;
// JSON lines: {"ts":"...","level":"info","process":"coordinator","msg":"..."}.
// Lines go to stderr; stdout stays for results (ready lines, ids, text).

#include <string>
#include <string_view>

namespace strata::runtime {
class Args;
}

namespace strata::log {

enum class level : int { trace = 0, debug = 1, info = 2, warn = 3, error = 4, off = 6 };

/// Sets the level, the format and the process name shown in every line.
void configure(level lv, bool json, std::string process);
/// Adds --log-level and --log-format to a command's options.
void add_options(runtime::Args& a);
/// Configures from those options (throws runtime::UsageError for bad values).
void configure_from(const runtime::Args& a, std::string process);

bool enabled(level lv);
void write(level lv, std::string_view msg);
inline void debug(std::string_view m) { write(level::debug, m); }
inline void info(std::string_view m) { write(level::info, m); }
inline void warn(std::string_view m) { write(level::warn, m); }
inline void error(std::string_view m) { write(level::error, m); }

} // namespace strata::log
