// keel hilo serve | check | validate | fingerprint | replay: the HiLO controller and its evaluation.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "apps/cli.h"
#include "keel/answer/server.h"
#include "keel/core/http_client.h"
#include "keel/core/log.h"
#include "keel/core/mapped_file.h"
#include "keel/hilo/fingerprint.h"
#include "keel/hilo/server.h"
#include "keel/hilo/validate/replay_live.h"  // hilo-replay
#include "keel/hilo/validate/validate.h"
#include "keel/kv/registry.h"

namespace keel::cli {
namespace {

// ---- hilo
struct HiloArgs {
  std::string catalog;
  std::string admin_token_file;
  hilo::ControllerServerOptions o;
  hilo::ServicePolicyOptions baseline;  // --policy per-service: every service's thresholds
};

// --fingerprint when given, else the running executable's (every service is this binary).
Status ResolveFingerprint(HiloArgs& a) {
  if (!a.o.fingerprint.empty()) return Status::Ok();
  KEEL_ASSIGN_OR_RETURN(a.o.fingerprint, hilo::ExecutableFingerprint());
  return Status::Ok();
}



int64_t UnixSecondsNow() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

int RunHiloServe(HiloArgs a) {
  if (Status s = ResolveFingerprint(a); !s.ok()) return Fail(s);
  if (!a.admin_token_file.empty()) {
    auto token = ReadSecretFile(a.admin_token_file, "admin token");
    if (!token.ok()) return Fail(token.status());
    a.o.admin_token = std::move(*token);
  }
  auto c = hilo::ReadCatalogFile(a.catalog);
  if (!c.ok()) return Fail(c.status());
  a.o.per_service.fill(a.baseline);
  auto server = hilo::ControllerServer::Create(std::move(*c), a.o);
  if (!server.ok()) return Fail(server.status());
  if (Status s = (*server)->Start(); !s.ok()) return Fail(s);
  return StopOnSignal([&] {
    (*server)->Stop();
    return Status::Ok();
  });
}

// Prints every state and whether the controller could act on it; exit 0 only when CheckUsable passes.
int RunHiloCheck(HiloArgs a) {
  if (Status s = ResolveFingerprint(a); !s.ok()) return Fail(s);
  auto c = hilo::ReadCatalogFile(a.catalog);
  if (!c.ok()) return Fail(c.status());
  const int64_t now = UnixSecondsNow();
  std::printf("%s: %zu states, safe state '%s', operating limit %.3g quality points\n", a.catalog.c_str(),
              c->states.size(), c->safe_state.c_str(), c->max_quality_drop);
  std::printf("  binaries: '%s' (running: '%s')%s\n", c->binaries.c_str(), a.o.fingerprint.c_str(),
              c->binaries == a.o.fingerprint && !c->binaries.empty() ? "" : "  <- mismatch");
  for (size_t i = 0; i < c->states.size(); ++i) {
    const hilo::State& s = c->states[i];
    std::string why = "validated, fresh";
    if (!s.figures) {
      why = "NOT VALIDATED (no figures)";
    } else if (now - s.figures->validated_at > a.o.max_age_s) {
      why = fmt::format("STALE: validated {} s ago (limit {} s)", now - s.figures->validated_at, a.o.max_age_s);
    }
    std::printf("  [%zu] %-16s %s", i, s.name.c_str(), why.c_str());
    if (s.figures) {
      std::printf("  quality %.3g, capacity answer %.4g vector %.4g engine %.4g gateway %.4g req/s", s.figures->quality,
                  s.figures->Capacity(hilo::Service::kAnswer), s.figures->Capacity(hilo::Service::kVector),
                  s.figures->Capacity(hilo::Service::kEngine), s.figures->Capacity(hilo::Service::kGateway));
      // What --objective expected-quality can do with the state (docs/hilo.md, "Controller rules").
      const double full = hilo::QualityCapacity(c->states[0]);
      std::printf("; quality x capacity %.3gx full's", full > 0 ? hilo::QualityCapacity(s) / full : 0.0);
      if (s.figures->HasGoodput()) {
        const double full_g = hilo::QualityGoodput(c->states[0]);
        std::printf("; overloaded at %.4g req/s it served %.4g (quality x goodput %.3gx full's)", s.figures->offered,
                    s.figures->goodput, full_g > 0 ? hilo::QualityGoodput(s) / full_g : 0.0);
      }
      std::printf("%s", hilo::ExpectedQualityCanPick(*c, static_cast<int>(i)) ? ""
                                                                        : " (expected-quality never picks it: shedding in a better state serves more)");
    }
    std::printf("\n");
  }
  Status s = hilo::CheckUsable(*c, a.o.fingerprint, now, a.o.max_age_s);
  // The hilo library knows no codecs; the binary that checks does.
  for (size_t i = 0; i < c->states.size() && s.ok(); ++i) {
    if (!kv::IsLosslessCodec(c->states[i].engine.kv_codec).has_value()) {
      s = Status::InvalidArgument(fmt::format("state '{}': engine.kv_codec '{}' is not a KV codec (known: {})",
                                              c->states[i].name, c->states[i].engine.kv_codec, kv::KnownCodecs()));
    }
  }
  std::printf("%s\n", s.ok() ? "usable" : s.message().c_str());
  return s.ok() ? 0 : 1;
}

struct HiloValidateArgs {
  std::string catalog;
  std::string out;
  std::string admin_token_file;
  std::string corpus;
  std::string vectors;
  int queries = 100;
  hilo::ValidateOptions o;
};

// $KEEL_SHARED/<rel> when `path` is empty; InvalidArgument naming `flag` when neither is set.
Result<std::string> SharedDefault(const std::string& path, const char* rel, const char* flag) {
  if (!path.empty()) return path;
  const char* shared = std::getenv("KEEL_SHARED");
  if (shared == nullptr || *shared == '\0') return Status::InvalidArgument(std::string(flag) + " is required (or set KEEL_SHARED)");
  return std::string(shared) + "/" + rel;
}

// The evaluation set `keel hilo validate` and `keel hilo replay` send: the first `queries` SIFT
// queries with their questions from the corpus (defaults under $KEEL_SHARED).
Result<std::vector<answer::EvalQuery>> LoadHiloEvalSet(const std::string& corpus, const std::string& vectors,
                                                       int queries) {
  KEEL_ASSIGN_OR_RETURN(std::string corpus_path, SharedDefault(corpus, "data/text/val.txt", "--corpus"));
  KEEL_ASSIGN_OR_RETURN(std::string vectors_dir, SharedDefault(vectors, "data/vectors", "--vectors"));
  KEEL_ASSIGN_OR_RETURN(answer::Corpus c, answer::Corpus::Load(corpus_path));
  KEEL_ASSIGN_OR_RETURN(std::vector<answer::EvalQuery> eval, answer::LoadEvalSet(vectors_dir, c));
  if (queries >= 0 && static_cast<size_t>(queries) < eval.size()) eval.resize(static_cast<size_t>(queries));
  return eval;
}

int RunHiloValidate(HiloValidateArgs a) {
  auto cat = hilo::ReadCatalogFile(a.catalog);
  if (!cat.ok()) return Fail(cat.status());
  auto token = ReadSecretFile(a.admin_token_file, "admin token");
  if (!token.ok()) return Fail(token.status());
  a.o.admin_token = std::move(*token);
  auto eval = LoadHiloEvalSet(a.corpus, a.vectors, a.queries);
  if (!eval.ok()) return Fail(eval.status());
  a.o.eval = std::move(*eval);
  // The fingerprint of the binaries the product runs: the controller's (GET /health).
  auto ep = ParseHttpUrl(a.o.controller_url);
  if (!ep.ok()) return Fail(ep.status());
  HttpClient controller(*ep);
  auto health = controller.Call("GET", "/health", "", "", DeadlineIn(10000));
  if (!health.ok()) return Fail(health.status());
  auto hj = nlohmann::json::parse(health->body, nullptr, false);
  const std::string fingerprint = hj.is_object() ? hj.value("binaries", std::string()) : std::string();
  if (fingerprint.empty()) return Fail(Status::InvalidArgument("the controller's /health reports no binaries fingerprint"));

  const auto started = std::chrono::steady_clock::now();
  auto measured = hilo::MeasureStates(*cat, a.o);
  if (!measured.ok()) return Fail(measured.status());
  std::vector<std::string> notes;
  auto out = hilo::ApplyFigures(std::move(*cat), *measured, fingerprint, UnixSecondsNow(), &notes);
  if (!out.ok()) return Fail(out.status());
  if (Status s = WriteFileAtomic(a.out, hilo::WriteCatalog(*out)); !s.ok()) return Fail(s);
  std::printf("%-16s %8s %8s %9s %12s %20s  %-10s %s\n", "state", "quality", "recall", "agreement", "capacity/s",
              "goodput/s (offered)", "saturated", a.o.rounds > 1 ? "rounds (spread: max/min - 1)" : "");
  for (const hilo::StateMeasurement& m : *measured) {
    std::string rounds;
    if (m.round_capacities.size() > 1) {
      const auto [lo, hi] = std::minmax_element(m.round_capacities.begin(), m.round_capacities.end());
      for (double c : m.round_capacities) rounds += fmt::format("{}{:.4g}", rounds.empty() ? "" : " ", c);
      if (*lo > 0) rounds += fmt::format(" ({:.1f} %)", 100.0 * (*hi / *lo - 1));
    }
    const std::string goodput = m.offered > 0 ? fmt::format("{:.4g} ({:.4g})", m.goodput, m.offered) : "-";
    std::printf("%-16s %8.2f %8.3f %9.3f %12.4g %20s  %-10s %s\n", m.state.c_str(), m.quality.quality, m.quality.recall,
                m.quality.agreement, m.capacity, goodput.c_str(), m.bottleneck.empty() ? "(max rate)" : m.bottleneck.c_str(), rounds.c_str());
  }
  std::printf("recorded per-service capacity (req/s; estimated from utilisation, at least the product's):\n");
  for (const hilo::State& st : out->states) {
    std::printf("  %-16s", st.name.c_str());
    for (hilo::Service svc : hilo::kAllServices) {
      std::printf(" %s %.4g", std::string(hilo::ServiceName(svc)).c_str(), st.figures->Capacity(svc));
    }
    std::printf("\n");
  }
  for (const std::string& n : notes) std::printf("adjusted: %s\n", n.c_str());
  std::printf("wrote %s (binaries %s) in %.0f s\n", a.out.c_str(), fingerprint.c_str(),
              std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
  return 0;
}
// ---- hilo (end)

// ---- hilo-replay (begin): `keel hilo replay` replays a surge trace live (keel/hilo/validate/replay_live.h)
struct HiloReplayArgs {
  std::string write_references;  // the references run: write the full state's answers here
  std::string references;        // the surge run: read them from here
  std::string trace;
  std::string trace_csv;
  std::string out_csv;
  std::string label;
  std::string corpus;
  std::string vectors;
  int queries = 100;
  uint64_t trace_seed = 1;
  hilo::LiveOptions o;
};

int RunHiloReplay(HiloReplayArgs a) {
  auto eval = LoadHiloEvalSet(a.corpus, a.vectors, a.queries);
  if (!eval.ok()) return Fail(eval.status());

  if (!a.write_references.empty()) {
    // The product should be pinned to its full state: check every answer ran in the catalog's
    // first state when the controller is known.
    std::string full;
    if (!a.o.controller_url.empty()) {
      auto ep = ParseHttpUrl(a.o.controller_url);
      if (!ep.ok()) return Fail(ep.status());
      HttpClient controller(*ep);
      auto cr = controller.Call("GET", "/v1/catalog", "", "", DeadlineIn(10000));
      if (!cr.ok()) return Fail(cr.status());
      auto cat = hilo::ParseCatalog(cr->body);
      if (!cat.ok()) return Fail(cat.status());
      full = cat->states.front().name;
    }
    double fq = 0;
    auto text = hilo::WriteReferences(a.o.answer_url, *eval, a.o.replay, full, 3, &fq);
    if (!text.ok()) return Fail(text.status());
    if (Status s = WriteFileAtomic(a.write_references, *text); !s.ok()) return Fail(s);
    std::printf("{\"references\":\"%s\",\"queries\":%zu,\"full_quality\":%.4f}\n", a.write_references.c_str(),
                eval->size(), fq);
    return 0;
  }

  if (a.references.empty()) return Fail(Status::InvalidArgument("--references F is required (write it with --write-references F)"));
  if (a.trace.empty() == a.trace_csv.empty()) return Fail(Status::InvalidArgument("give exactly one of --trace NAME and --trace-csv F"));
  if (!a.trace.empty()) {
    std::vector<hilo::Trace> all = hilo::SurgeTraces(a.trace_seed);
    all.push_back(hilo::Surge3x());
    std::string names;
    for (hilo::Trace& t : all) {
      names += (names.empty() ? "" : ", ") + t.name;
      if (t.name == a.trace) a.o.trace = std::move(t);
    }
    if (a.o.trace.name.empty()) return Fail(Status::InvalidArgument("--trace: unknown trace '" + a.trace + "' (one of " + names + ")"));
  } else {
    auto text = ReadFileToString(a.trace_csv);
    if (!text.ok()) return Fail(text.status());
    auto t = hilo::ParseCsvTrace(*text, a.trace_csv, a.o.baseline_rate);
    if (!t.ok()) return Fail(t.status());
    a.o.trace = std::move(*t);
  }
  auto ref_text = ReadFileToString(a.references);
  if (!ref_text.ok()) return Fail(ref_text.status());
  auto refs = hilo::ParseReferences(*ref_text, eval->size());
  if (!refs.ok()) return Fail(Status::InvalidArgument(a.references + ": " + refs.status().message()));
  a.o.eval = std::move(*eval);
  a.o.references = std::move(*refs);
  Log().info("replay: trace {} (peak {:.2f}x, {:.0f} s) at {} req/s x multiplier, time scale {} ({:.0f} s real), full quality {:.2f}",
             a.o.trace.name, a.o.trace.Peak(), a.o.trace.duration_s, a.o.baseline_rate, a.o.time_scale,
             a.o.trace.duration_s * a.o.time_scale, hilo::FullQuality(a.o.eval, a.o.references));
  auto r = hilo::RunLiveReplay(a.o);
  if (!r.ok()) return Fail(r.status());
  if (!a.out_csv.empty()) {
    if (Status s = WriteFileAtomic(a.out_csv, hilo::WriteLiveCsv(*r, a.o.window_s)); !s.ok()) return Fail(s);
  }
  std::printf("%s\n", hilo::WriteLiveSummaryJson(*r, a.label).c_str());
  return 0;
}
// ---- hilo-replay (end)

int RunHiloFingerprint() {
  auto fp = hilo::ExecutableFingerprint();
  if (!fp.ok()) return Fail(fp.status());
  std::printf("%s\n", fp->c_str());
  return 0;
}

}  // namespace

void AddHiloCommands(CLI::App& app, Commands& out) {
  // ---- hilo (begin)
  auto hl_ptr = std::make_shared<HiloArgs>();
  HiloArgs& hl = *hl_ptr;
  auto* hilo_cmd = app.add_subcommand("hilo", "HiLO: one controller puts the whole product in one validated state (docs/hilo.md)");
  hilo_cmd->require_subcommand(1);
  auto* hl_serve = hilo_cmd->add_subcommand("serve", "Serve the controller: POST /v1/report, long-poll GET /v1/state, /v1/catalog, /v1/services, POST /v1/pin, /metrics");
  auto* hl_check = hilo_cmd->add_subcommand("check", "Parse a catalog and say, state by state, whether the controller may use it (exit 0 usable, 1 not usable, 2 unreadable)");
  for (auto* sub : {hl_serve, hl_check}) {
    sub->add_option("--catalog", hl.catalog, "state catalog (JSON; see docs/hilo.md)")->required()->check(CLI::ExistingFile);
    sub->add_option("--fingerprint", hl.o.fingerprint, "fingerprint the catalog's \"binaries\" must equal (default: this executable's, as `keel hilo fingerprint` prints)");
    sub->add_option("--max-age-s", hl.o.max_age_s, "figures validated longer ago than this are stale")->capture_default_str()->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
  }
  hl_serve->add_option("--host", hl.o.host, "address to bind")->capture_default_str();
  hl_serve->add_option("--port", hl.o.port, "port to bind (0 = any free port)")->required()->check(CLI::Range(0, 65535));
  hl_serve->add_option("--decide-interval-ms", hl.o.decide_interval_ms, "run a decision this often")->capture_default_str()->check(CLI::Range(10, 60000));
  {
    // The controller's prediction and hysteresis (docs/hilo.md, "Controller rules"); ranges are
    // checked together at start (Controller::Create), so a bad mix fails naming the option.
    hilo::ControllerOptions& co = hl.o.controller;
    hl_serve->add_option_function<std::string>("--objective", [hl_ptr](const std::string& v) { hl_ptr->o.controller.objective = *hilo::ParseObjective(v); }, "what the target maximises: cover (the best state whose capacity covers every service's predicted demand, else the lowest) or expected-quality (the best quality x fraction of the predicted demand served: stays in a better state and sheds when degrading would cost more quality than shedding)")->check(CLI::IsMember({"cover", "expected-quality"}))->default_str("cover");
    hl_serve->add_option("--headroom", co.headroom, "predicted demand x this must fit a state's capacity (1..10)")->capture_default_str();
    hl_serve->add_option("--recover-margin", co.recover_margin, "recover only to a state with predicted demand (before headroom) <= this x its capacity, (0, 1]")->capture_default_str();
    hl_serve->add_option("--recover-dwell-s", co.recover_dwell_s, "... held continuously this long, seconds")->capture_default_str();
    hl_serve->add_option("--min-dwell-s", co.min_dwell_s, "no change more often than this, except to degrade, seconds")->capture_default_str();
    hl_serve->add_option("--lookahead-s", co.lookahead_s, "predict this far ahead, seconds")->capture_default_str();
    hl_serve->add_option("--level-tau-s", co.level_tau_s, "demand smoothing time constant, seconds (0 = none)")->capture_default_str();
    hl_serve->add_option("--trend-tau-s", co.trend_tau_s, "trend smoothing time constant, seconds (0 = no trend)")->capture_default_str();
    hl_serve->add_option("--trend-damping-s", co.trend_damping_s, "the trend decays as exp(-t / this), seconds (0 = undamped)")->capture_default_str();
    hl_serve->add_option("--recent-rate-guard", co.recent_rate_guard, "true: a service's predicted demand is at least its reported rate over the newest 500 ms, so a fast onset degrades before the smoothed rate catches up; false: the smoothed prediction alone")->capture_default_str();
    hl_serve->add_option("--recent-noise-z", co.recent_noise_z, "... a lower bound on it: this many Poisson standard deviations below the measured count, 0..10")->capture_default_str();
    hl_serve->add_option("--report-timeout-s", co.report_timeout_s, "a service instance's report counts this long, seconds")->capture_default_str();
    hl_serve->add_option("--stale-fallback-s", co.stale_fallback_s, "a silent service sends the product to the safe state after this, seconds")->capture_default_str();
    // The per-service baseline's thresholds, the same for every service (docs/hilo.md, "Baseline, live").
    hilo::ServicePolicyOptions& bo = hl.baseline;
    hl_serve->add_option("--baseline-queue-ms", bo.baseline.degrade_queue_ms, "--policy per-service: a service steps cheaper when its queueing-delay estimate is over this (DAGOR's 20)")->capture_default_str();
    hl_serve->add_option("--baseline-recover-queue-ms", bo.baseline.recover_queue_ms, "--policy per-service: ... and is calm below this (<= --baseline-queue-ms)")->capture_default_str();
    hl_serve->add_option("--baseline-utilisation", bo.utilisation_threshold, "--policy per-service: ... or when its utilisation is at least this, [0, 1]; 0 = not used (DAGOR's queueing signal alone)")->capture_default_str();
  }
  hl_serve->add_flag("--allow-unvalidated", hl.o.allow_unvalidated, "development only: start despite a stale or foreign catalog (states still need figures)");
  hl_serve->add_option("--admin-token-file", hl.admin_token_file, "enables POST /v1/pin for clients presenting this token (first line, 16..256 printable bytes)")->check(CLI::ExistingFile);
  hl_serve->add_option("--pin", hl.o.pin, "start pinned to this state (the controller ignores load until unpinned); pinned, with --allow-unvalidated, a catalog without figures is accepted (what keel hilo validate measures)");
  hl_serve->add_option_function<std::string>("--policy", [hl_ptr](const std::string& v) { hl_ptr->o.policy = v == "per-service" ? hilo::StatePolicy::kPerService : hilo::StatePolicy::kHilo; }, "hilo: one product state for every service (default). per-service: the evaluation's baseline (DAGOR-like): each service is answered its own level, stepped cheaper on its own overload (queueing estimate > --baseline-queue-ms, utilisation >= --baseline-utilisation) and back after 10 s calm; hosted here only for convenience, each level depends on that service's own reports alone (docs/hilo.md, \"Baseline, live\")")->check(CLI::IsMember({"hilo", "per-service"}))->default_str("hilo");
  auto hv_ptr = std::make_shared<HiloValidateArgs>();
  HiloValidateArgs& hv = *hv_ptr;
  auto* hl_val = hilo_cmd->add_subcommand("validate", "Measure every state's quality and capacity through the running product and write them into the catalog (docs/hilo.md)");
  hl_val->add_option("--catalog", hv.catalog, "state catalog to measure (the controller's; figures may be absent)")->required()->check(CLI::ExistingFile);
  hl_val->add_option("--out", hv.out, "where to write the validated catalog")->required();
  hl_val->add_option("--controller", hv.o.controller_url, "the controller (keel hilo serve, started with --admin-token-file, --allow-unvalidated and --pin <the catalog's first state>)")->required();
  hl_val->add_option("--admin-token-file", hv.admin_token_file, "the controller's admin token (to pin each state)")->required()->check(CLI::ExistingFile);
  hl_val->add_option("--answer", hv.o.answer_url, "the product's entry: keel answer serve")->required();
  hl_val->add_option("--corpus", hv.corpus, "corpus the answer service serves (default $KEEL_SHARED/data/text/val.txt)");
  hl_val->add_option("--vectors", hv.vectors, "directory of bigann10k_query.bvecs and bigann10k_groundtruth.ivecs (default $KEEL_SHARED/data/vectors)");
  hl_val->add_option("--queries", hv.queries, "evaluation queries used (the first N of the set)")->capture_default_str()->check(CLI::Range(1, 100000));
  hl_val->add_option("--model", hv.o.replay.model, "model asked for (\"\" = the answer service's default)");
  hl_val->add_option("--max-tokens", hv.o.replay.max_tokens, "max_tokens of every request")->capture_default_str()->check(CLI::Range(1, 1 << 20));
  hl_val->add_option("--slo-ms", hv.o.slo_ms, "a ramp step passes while the product's p99 stays under this")->capture_default_str()->check(CLI::PositiveNumber);
  hl_val->add_option("--max-error-fraction", hv.o.max_error_fraction, "...and at most this fraction of answers is not 200")->capture_default_str()->check(CLI::Range(0.0, 0.99));
  hl_val->add_option("--start-rate", hv.o.start_rate, "first ramp step, req/s")->capture_default_str()->check(CLI::PositiveNumber);
  hl_val->add_option("--growth", hv.o.growth, "rate multiplier per ramp step")->capture_default_str()->check(CLI::Range(1.01, 10.0));
  hl_val->add_option("--max-rate", hv.o.max_rate, "stop ramping at this rate")->capture_default_str()->check(CLI::PositiveNumber);
  hl_val->add_option("--step-s", hv.o.step_s, "seconds per ramp step")->capture_default_str()->check(CLI::Range(1.0, 3600.0));
  hl_val->add_option("--refine-steps", hv.o.refine_steps, "bisections between the last passing and first failing rate")->capture_default_str()->check(CLI::Range(0, 10));
  hl_val->add_option("--rounds", hv.o.rounds, "capacity ramps per state, in rounds over all states; the figure is picked by --round-figure (capacity on a shared machine moves between runs)")->capture_default_str()->check(CLI::Range(1, 20));
  hl_val->add_option_function<std::string>("--round-figure", [hv_ptr](const std::string& v) { hv_ptr->o.round_figure = v == "lowest" ? hilo::RoundFigure::kLowest : hilo::RoundFigure::kLowerMedian; }, "which round's capacity is recorded: median (the lower median: one stalled or lucky round does not move it; with 2 rounds the lower) or lowest")->check(CLI::IsMember({"median", "lowest"}))->default_str("median");
  hl_val->add_option("--later-round-start", hv.o.later_round_start, "later rounds start their ramp at this fraction of the state's first capacity")->capture_default_str()->check(CLI::Range(0.01, 1.0));
  hl_val->add_option("--overload-factor", hv.o.overload_factor, "after each ramp, offer this x the capacity once and record the goodput (200 answers within --slo-ms per second), which --objective expected-quality weighs an overloaded state by; 0 = not measured")->capture_default_str()->check(CLI::Validator([](std::string& v) -> std::string {
        double x = -1;
        try { x = std::stod(v); } catch (...) {}
        return hilo::OverloadFactorValid(x) ? "" : "--overload-factor: expected 0 or a number in (1, 10], got '" + v + "'";
      }, "0 or (1, 10]"));
  hl_val->add_option("--apply-timeout-ms", hv.o.apply_timeout_ms, "wait this long for every service to apply a pinned state")->capture_default_str()->check(CLI::Range(100, 600000));
  auto* hl_fp = hilo_cmd->add_subcommand("fingerprint", "Print this executable's fingerprint (what a validated catalog's \"binaries\" must equal)");
  // ---- hilo (end)
  // ---- hilo-replay (begin)
  auto hr_ptr = std::make_shared<HiloReplayArgs>();
  HiloReplayArgs& hr = *hr_ptr;
  auto* hl_rep = hilo_cmd->add_subcommand("replay", "Replay a surge trace live through the product, scored against the full state's answers (references)");
  hl_rep->add_option("--answer", hr.o.answer_url, "the product's entry: keel answer serve")->required();
  hl_rep->add_option("--controller", hr.o.controller_url, "the controller: sample GET /v1/state and /v1/services each tick (and check references ran in the full state)");
  hl_rep->add_option("--write-references", hr.write_references, "references run: ask every query once (product pinned to full) and write the answers here");
  hl_rep->add_option("--references", hr.references, "surge run: the full state's answers (from --write-references)");
  hl_rep->add_option("--trace", hr.trace, "step, ramp, spike, double_peak, sawtooth, slow_swell, flash_crowd, plateau_jitter, diurnal_bump or surge_3x");
  hl_rep->add_option("--trace-csv", hr.trace_csv, "a t_s,rate CSV trace instead (rates / --baseline-rate are the multipliers)")->check(CLI::ExistingFile);
  hl_rep->add_option("--trace-seed", hr.trace_seed, "seed of plateau_jitter's noise")->capture_default_str();
  hl_rep->add_option("--baseline-rate", hr.o.baseline_rate, "real req/s at the trace's 1x (kept at any --time-scale)")->capture_default_str()->check(CLI::Range(0.001, 1e5));
  hl_rep->add_option("--time-scale", hr.o.time_scale, "real seconds per trace second (< 1 replays the shape faster at the same rates)")->capture_default_str()->check(CLI::Range(0.001, 100.0));
  hl_rep->add_option("--window-s", hr.o.window_s, "quality window, trace seconds")->capture_default_str()->check(CLI::Range(0.01, 3600.0));
  hl_rep->add_option("--warmup-s", hr.o.warmup_s, "real seconds of unscored load before the trace: 0.1x up to 1x over the first third, then 1x (no jump from zero for the controller's trend or a cold engine)")->capture_default_str()->check(CLI::Range(0.0, 3600.0));
  hl_rep->add_option("--slo-ms", hr.o.slo_ms, "an answer slower than this scores 0 and counts as an SLO violation")->capture_default_str()->check(CLI::PositiveNumber);
  hl_rep->add_option("--workers", hr.o.workers, "concurrent requests at most (more arrivals are dropped at the client and counted failed)")->capture_default_str()->check(CLI::Range(1, 4096));
  hl_rep->add_option("--seed", hr.o.seed, "Poisson arrivals seed")->capture_default_str();
  hl_rep->add_option("--out-csv", hr.out_csv, "per-window CSV (t_s, arrived, mean_quality, p99_ms, state, per-service levels)");
  hl_rep->add_option("--label", hr.label, "added to the JSON summary (e.g. the policy)");
  hl_rep->add_option("--corpus", hr.corpus, "corpus the answer service serves (default $KEEL_SHARED/data/text/val.txt)");
  hl_rep->add_option("--vectors", hr.vectors, "directory of the SIFT query set and truth (default $KEEL_SHARED/data/vectors)");
  hl_rep->add_option("--queries", hr.queries, "evaluation queries (the first N); requests cycle through them")->capture_default_str()->check(CLI::Range(1, 100000));
  hl_rep->add_option("--model", hr.o.replay.model, "model asked for (\"\" = the answer service's default)");
  hl_rep->add_option("--max-tokens", hr.o.replay.max_tokens, "max_tokens of every request")->capture_default_str()->check(CLI::Range(1, 1 << 20));
  // ---- hilo-replay (end)

  // ---- answer (begin)
  out.push_back({hl_serve, [hl_ptr] { return RunHiloServe(*hl_ptr); }});
  out.push_back({hl_check, [hl_ptr] { return RunHiloCheck(*hl_ptr); }});
  out.push_back({hl_val, [hv_ptr] { return RunHiloValidate(*hv_ptr); }});
  out.push_back({hl_rep, [hr_ptr] { return RunHiloReplay(*hr_ptr); }});  // hilo-replay
  out.push_back({hl_fp, [] { return RunHiloFingerprint(); }});
}

}  // namespace keel::cli
