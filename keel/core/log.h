// Logging: spdlog to stderr, so stdout stays clean for command output (keel generate prints only
// the generated text). Never log secrets or request bodies.
#pragma once

#include <spdlog/spdlog.h>

#include <string_view>

namespace keel {

// Sets the global level from "trace|debug|info|warn|error|off"; unknown names keep "info".
void SetLogLevel(std::string_view level);
// The shared stderr logger ("keel").
spdlog::logger& Log();

}  // namespace keel
