#include "keel/core/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <mutex>

namespace keel {

spdlog::logger& Log() {
  static std::shared_ptr<spdlog::logger> logger = [] {
    auto l = spdlog::stderr_color_mt("keel");
    l->set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ %v");
    return l;
  }();
  return *logger;
}

void SetLogLevel(std::string_view level) {
  auto lvl = spdlog::level::from_str(std::string(level));
  if (lvl == spdlog::level::off && level != "off") lvl = spdlog::level::info;
  Log().set_level(lvl);
}

}  // namespace keel
