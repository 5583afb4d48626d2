#include "runtime/log.hpp"

#include "runtime/args.hpp"

#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <ctime>
#include <memory>
#include <mutex>

namespace strata::log {

namespace {

std::string& process_name() {
  static std::string name = "strata";
  return name;
}

// "2026-11-30T20:57:02.123Z" (UTC).
void timestamp(std::chrono::system_clock::time_point t, spdlog::memory_buf_t& out) {
  const auto secs = std::chrono::system_clock::to_time_t(t);
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(t.time_since_epoch()).count() % 1000;
  std::tm tm{};
  ::gmtime_r(&secs, &tm);
  char buf[32];
  const auto n = std::snprintf(buf, sizeof buf, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900, tm.tm_mon + 1,
                               tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, static_cast<int>(ms));
  out.append(buf, buf + n);
}

void append(spdlog::memory_buf_t& out, std::string_view s) { out.append(s.data(), s.data() + s.size()); }

void json_escaped(spdlog::memory_buf_t& out, std::string_view s) {
  for (unsigned char c : s) {
    switch (c) {
      case '"': append(out, "\\\""); break;
      case '\\': append(out, "\\\\"); break;
      case '\n': append(out, "\\n"); break;
      case '\r': append(out, "\\r"); break;
      case '\t': append(out, "\\t"); break;
      default:
        if (c < 0x20) {
          char u[8];
          std::snprintf(u, sizeof u, "\\u%04x", c);
          append(out, u);
        } else {
          out.push_back(static_cast<char>(c));
        }
    }
  }
}

std::string_view level_name(spdlog::level::level_enum l) {
  switch (l) {
    case spdlog::level::trace: return "trace";
    case spdlog::level::debug: return "debug";
    case spdlog::level::info: return "info";
    case spdlog::level::warn: return "warn";
    case spdlog::level::err: return "error";
    case spdlog::level::critical: return "critical";
    default: return "off";
  }
}

class Formatter final : public spdlog::formatter {
public:
  explicit Formatter(bool json) : json_(json) {}
  void format(const spdlog::details::log_msg& m, spdlog::memory_buf_t& out) override {
    const std::string_view msg(m.payload.data(), m.payload.size());
    if (json_) {
      append(out, "{\"ts\":\"");
      timestamp(m.time, out);
      append(out, "\",\"level\":\"");
      append(out, level_name(m.level));
      append(out, "\",\"process\":\"");
      json_escaped(out, process_name());
      append(out, "\",\"msg\":\"");
      json_escaped(out, msg);
      append(out, "\"}\n");
    } else {
      timestamp(m.time, out);
      out.push_back(' ');
      const auto l = level_name(m.level);
      append(out, l);
      for (std::size_t i = l.size(); i < 6; ++i)
        out.push_back(' ');
      append(out, process_name());
      append(out, ": ");
      append(out, msg);
      out.push_back('\n');
    }
  }
  std::unique_ptr<spdlog::formatter> clone() const override { return std::make_unique<Formatter>(json_); }

private:
  bool json_;
};

std::shared_ptr<spdlog::logger> make(bool json) {
  auto sink = std::make_shared<spdlog::sinks::stderr_sink_mt>();
  auto lg = std::make_shared<spdlog::logger>("strata", sink);
  lg->set_formatter(std::make_unique<Formatter>(json));
  lg->flush_on(spdlog::level::trace); // every line reaches stderr at once (tests and operators read it live)
  lg->set_level(spdlog::level::info);
  return lg;
}

std::shared_ptr<spdlog::logger>& logger() {
  static auto* lg = new std::shared_ptr<spdlog::logger>(make(false)); // never destroyed: used until _Exit
  return *lg;
}

} // namespace

void configure(level lv, bool json, std::string process) {
  process_name() = std::move(process);
  auto lg = make(json);
  lg->set_level(static_cast<spdlog::level::level_enum>(lv));
  logger() = lg;
}

void add_options(runtime::Args& a) {
  a.option("log-level", "LEVEL", "trace, debug, info (default), warn, error or off")
    .option("log-format", "text|json", "log lines as text (default) or one JSON object per line");
}

void configure_from(const runtime::Args& a, std::string process) {
  const std::string l = a.str("log-level", "info"), f = a.str("log-format", "text");
  level lv;
  if (l == "trace")
    lv = level::trace;
  else if (l == "debug")
    lv = level::debug;
  else if (l == "info")
    lv = level::info;
  else if (l == "warn")
    lv = level::warn;
  else if (l == "error")
    lv = level::error;
  else if (l == "off")
    lv = level::off;
  else
    throw runtime::UsageError("--log-level must be trace, debug, info, warn, error or off, not '" + l + "'");
  if (f != "text" && f != "json")
    throw runtime::UsageError("--log-format must be text or json, not '" + f + "'");
  configure(lv, f == "json", std::move(process));
}

bool enabled(level lv) {
  return logger()->should_log(static_cast<spdlog::level::level_enum>(lv));
}

void write(level lv, std::string_view msg) {
  logger()->log(static_cast<spdlog::level::level_enum>(lv), "{}", msg);
}

} // namespace strata::log
