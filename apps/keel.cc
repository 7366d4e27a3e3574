// keel: the command-line front end. Each subcommand is a thin layer over a library call; the
// commands live in apps/cmd_*.cc and register themselves through apps/cli.h.
#include <malloc.h>

#include <cmath>
#include <csignal>
#include <cstdlib>
#include <string>
#include <string_view>

#include <CLI/CLI.hpp>

#include "apps/cli.h"
#include "keel/core/cpu.h"
#include "keel/core/log.h"
#include "keel/core/mapped_file.h"
#include "keel/core/signal.h"

namespace keel::cli {

int Fail(const Status& s) {
  Log().error("{}", s.ToString());
  return s.code() == StatusCode::kInvalidArgument ? 2 : 1;
}

int StopOnSignal(const std::function<Status()>& stop, const char* what) {
  auto sig = WaitForTerminationSignal();
  if (!sig.ok()) return Fail(sig.status());
  Log().info("received {}; {}", SignalName(*sig), what);
  if (Status s = stop(); !s.ok()) return Fail(s);
  return 0;
}

Result<std::string> ReadSecretFile(const std::string& path, const char* what) {
  KEEL_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(path, 64 << 10));
  const size_t nl = text.find_first_of("\r\n");
  if (nl != std::string::npos) text.resize(nl);
  if (text.size() < 16 || text.size() > 256) {
    return Status::InvalidArgument(path + ": " + what + " must be 16..256 bytes on the first line");
  }
  for (unsigned char c : text) {
    if (c < 0x21 || c > 0x7e) return Status::InvalidArgument(path + ": " + what + " must be printable ASCII without spaces");
  }
  return text;
}

}  // namespace keel::cli

namespace {

// CLI11's Range and NonNegativeNumber compare, and NaN fails no comparison; 1e309 becomes inf.
// Every floating-point option of every subcommand must be a finite number.
void RequireFiniteFloats(CLI::App* app) {
  const CLI::Validator finite(
      [](std::string& text) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(text.c_str(), &end);
        if (end == text.c_str() || *end != '\0') return {};  // not a number: the option's own parser says so
        return std::isfinite(v) ? std::string() : "must be a finite number, not " + text;
      },
      "FINITE");
  for (CLI::Option* opt : app->get_options()) {
    if (opt->get_type_name() == "FLOAT") opt->check(finite);
  }
  for (CLI::App* sub : app->get_subcommands([](CLI::App*) { return true; })) RequireFiniteFloats(sub);
}

}  // namespace

int main(int argc, char** argv) {
  using namespace keel;
  // A peer that closed its socket must be an EPIPE error where the write happens, not the
  // process's death: Keel's own sockets send with MSG_NOSIGNAL, but libraries (hiredis) write().
  std::signal(SIGPIPE, SIG_IGN);
  // Servers read request bodies (up to tens of MiB) into memory, and a client may abandon one
  // half sent. glibc raises its mmap threshold to the largest block freed so far, so after the
  // first large body every later one came from the heap arenas and stayed with the process once
  // freed: 557 MiB (gateway) and 379 MiB (vector) after 1,000 abandoned 4 MiB uploads, 18 MiB
  // with a fixed threshold (docs/results.md). Blocks of 1 MiB and more get their own mappings,
  // returned to the system when freed. An operator's own setting (glibc's environment) wins.
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  if (std::getenv("MALLOC_MMAP_THRESHOLD_") == nullptr &&
      (tunables == nullptr || std::string_view(tunables).find("mmap_threshold") == std::string_view::npos)) {
    mallopt(M_MMAP_THRESHOLD, 1 << 20);
  }
  CLI::App app{"keel: LLM and retrieval services under tight resources"};
  app.require_subcommand(1);
  app.fallthrough();  // --log-level may follow the subcommand too
  std::string log_level = "info";
  app.add_option("--log-level", log_level, "trace|debug|info|warn|error|off")
      ->capture_default_str()
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "off"}));
  std::string cpu_isa = "auto";
  app.add_option("--cpu-isa", cpu_isa,
                 "kernel level: auto (best this CPU has), avx2 or avx512 (KEEL_CPU_ISA sets the same; results may "
                 "differ in the last bits between levels)")
      ->capture_default_str();

  cli::Commands commands;
  for (auto add : {cli::AddEngineCommands, cli::AddKvstoreCommands, cli::AddVectorCommands, cli::AddGatewayCommands,
                   cli::AddBellowsCommands, cli::AddHiloCommands, cli::AddAnswerCommands}) {
    add(app, commands);
  }

  RequireFiniteFloats(&app);
  CLI11_PARSE(app, argc, argv);
  SetLogLevel(log_level);
  if (cpu_isa != "auto" || app.count("--cpu-isa") > 0) {
    if (Status s = cpu::SetActiveIsa(cpu_isa); !s.ok()) {
      Log().error("--cpu-isa: {}", s.message());
      return 2;
    }
  }
  // The parsed command is the one none of whose own subcommands was parsed (`vector`, not
  // `vector keygen`).
  for (const cli::Command& c : commands) {
    if (!c.app->parsed() || !c.app->get_subcommands().empty()) continue;
    // The engine's commands say which kernels run (a benchmark without it is hard to read).
    if (c.logs_kernels) {
      Log().info("{}", cpu::Describe());
    } else {
      Log().debug("{}", cpu::Describe());
    }
    return c.run();
  }
  return 0;
}
