// libFuzzer target for what HiLO reads: a service's load report (the controller's POST
// /v1/report, from the network) and a state catalog (operators' files, and what `keel hilo
// validate` rewrites). Each header promises that what is written reads back equal, so an accepted
// text must reach a fixpoint: parse, write, parse, write gives the same text twice; a parsed
// catalog must pass ValidateCatalog (ParseCatalog applies its rules), and every state's levels
// (what the controller pushes to services) must be one line.
//
// Input: byte 0 picks report or catalog, the rest is the text. Crashes, sanitizer reports and
// broken invariants (abort with the offending text) are bugs.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "keel/hilo/catalog.h"
#include "keel/hilo/report.h"

namespace {

using namespace keel::hilo;

[[noreturn]] void Broken(const char* what, std::string_view text) {
  std::fprintf(stderr, "hilo_fuzz: %s\n--- text ---\n%.*s\n", what, static_cast<int>(text.size()), text.data());
  std::abort();
}

void Report(std::string_view text) {
  auto report = ParseLoadReport(text);
  if (!report.ok()) return;
  const std::string written = WriteLoadReport(*report);
  auto again = ParseLoadReport(written);
  if (!again.ok()) Broken("a written report does not parse", written);
  if (WriteLoadReport(*again) != written) Broken("a report does not survive writing and reading", written);
}

void ReadCatalog(std::string_view text) {
  auto catalog = ParseCatalog(text);
  if (!catalog.ok()) return;
  if (!ValidateCatalog(*catalog).ok()) Broken("a parsed catalog fails ValidateCatalog", text);
  const std::string written = WriteCatalog(*catalog);
  auto again = ParseCatalog(written);
  if (!again.ok()) Broken("a written catalog does not parse", written);
  if (WriteCatalog(*again) != written) Broken("a catalog does not survive writing and reading", written);
  for (const State& s : catalog->states) {
    if (WriteLevels(s).find('\n') != std::string::npos) Broken("a state's levels over several lines", written);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
  if (data[0] & 1) {
    ReadCatalog(text);
  } else {
    Report(text);
  }
  return 0;
}
