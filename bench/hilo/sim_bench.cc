// HiLO vs the per-service baseline in the discrete-event simulation (keel/hilo/sim.h), on the nine
// surge traces and the 3x one (keel/hilo/trace.h), at --scale times the catalog's capacities and
// the baseline arrival rate. Prints one Markdown table per trace and a summary against the
// catalog's operating limit L: the goal is HiLO's worst window drop <= 0.85 L while the baseline's
// exceeds L. The default catalog's figures are assumed, not measured (bench/hilo/README.md).
//
//   sim_bench [--catalog bench/hilo/example_catalog.json] [--scale 100] [--baseline-rate 55]
//             [--seed 1] [--trace NAME] [--csv FILE] [--csv-dir DIR] [--time-scale 1]
//             [--window-s 1] [--slo-ms 1000] [--servers 8|service=N,...] [--jsonl FILE] [--live-loop]
//             [--baseline-queue-ms 20] [--baseline-recover-queue-ms 5] [--no-recent-rate-guard]
//             [--entry-max-in-flight 0] [--batch-slowdown 0|service=X,...] [--capacity-utilisation 0.9]
//             [--objective cover|expected-quality] [--speed-sd 0] [--speed-tau-s 10] [--speed-run-sd 0]
//             [--speed-seed 1]
// --time-scale, --window-s (trace seconds) and --slo-ms mirror `keel hilo replay`'s flags, so a
// simulation can be set up exactly like a live run (bench/hilo/sim_vs_live.sh): a time scale below 1
// replays the trace's shape faster at the same rates, while the controller's dwells stay in real
// seconds. --servers sets every service's workers at scale 1 (N), or some of them
// (answer=64,engine=32: the others keep 8), e.g. the live product's engine slots. --jsonl appends one summary line per
// trace and policy, in the fields of the live replay's summary. --live-loop runs the control loop
// as the live product does (reports and decisions every 250 ms, arrival rates over 2 s) instead
// of the default 500 ms reports over 500 ms, and its baseline runs the live per-service rule
// (ServicePolicy) on the modelled reports instead of the sim's queueing-delay rule.
// --csv-dir writes DIR/sim_<trace>_<policy>.csv per trace and policy (per-window t_s, arrived,
// mean_quality, state index: the cheapest level applied), the simulation's half of the plots
// (bench/hilo/plot.sh draws them beside the live replay's CSVs). --baseline-queue-ms and
// --baseline-recover-queue-ms set the baseline's thresholds, as `keel hilo serve` does live.
// --no-recent-rate-guard turns the controller's onset guard off (`--recent-rate-guard false` live).
// --entry-max-in-flight N sheds a request that arrives while N (x scale) are in the product, as the
// live answer service does beyond its --max-inflight (0, the default: no such bound).
// --batch-slowdown engine=0.23 models a service as a continuous-batching one (SimOptions::
// batch_slowdown: each request in service slows by this per other request in the batch; 0, the
// default, is independent workers), as --servers takes values. --capacity-utilisation sets how
// busy a service is at its catalog capacity (SimOptions::capacity_utilisation): the catalog's
// capacity over the throughput it saturates at. --objective sets the controller's
// (ControllerOptions::objective; `keel hilo serve --objective` live). --speed-sd, --speed-tau-s,
// --speed-run-sd and --speed-seed model the shared machine's speed drift (SimOptions::speed_sd;
// 0, the default, is a constant speed); bench/hilo/sim_vs_live.sh averages several speed seeds.
#include <algorithm>
#include <array>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "keel/hilo/catalog.h"
#include "keel/hilo/sim.h"
#include "keel/hilo/trace.h"
#include "keel/hilo/validate/replay_live.h"

namespace keel::hilo {
namespace {

struct Args {
  std::string catalog = "bench/hilo/example_catalog.json";
  double scale = 100;
  double baseline_rate = 55;
  uint64_t seed = 1;
  std::string trace;  // "" = all
  std::string csv;
  std::string csv_dir;  // "" = no per-window CSVs
  double time_scale = 1;  // real seconds per trace second
  double window_s = 1;    // trace seconds
  double slo_ms = 1000;
  std::array<int, kNumServices> servers = {8, 8, 8, 8};
  bool live_loop = false;
  int entry_max_in_flight = 0;
  std::array<double, kNumServices> batch_slowdown = {0, 0, 0, 0};
  double capacity_utilisation = SimOptions().capacity_utilisation;
  double speed_sd = 0;                         // SimOptions::speed_sd: the machine's speed drift
  double speed_tau_s = SimOptions().speed_tau_s;
  double speed_run_sd = 0;
  uint64_t speed_seed = 1;
  bool recent_rate_guard = true;
  Objective objective = Objective::kCover;
  std::string jsonl;  // "" = no JSON summary
  BaselineOptions baseline;  // --baseline-queue-ms, --baseline-recover-queue-ms
};

// "N" sets every service's workers; "engine=32,answer=64" sets those named. False when malformed.
// "V" (every service) or "service=V[,service=V...]" (the others keep theirs), each V read by
// `number`.
template <typename T, typename Number>
bool ParsePerService(std::string_view spec, Number number, std::array<T, kNumServices>* out) {
  T n{};
  if (spec.find('=') == std::string_view::npos) {
    if (!number(spec, &n)) return false;
    out->fill(n);
    return true;
  }
  while (!spec.empty()) {
    const size_t comma = spec.find(',');
    const std::string_view item = spec.substr(0, comma);
    spec = comma == std::string_view::npos ? std::string_view() : spec.substr(comma + 1);
    const size_t eq = item.find('=');
    if (eq == std::string_view::npos) return false;
    const std::optional<Service> svc = ServiceFromName(item.substr(0, eq));
    if (!svc || !number(item.substr(eq + 1), &n)) return false;
    (*out)[static_cast<size_t>(*svc)] = n;
  }
  return true;
}

bool ParseServers(std::string_view spec, std::array<int, kNumServices>* out) {
  return ParsePerService(spec, [](std::string_view v, int* n) {
    if (v.empty() || v.size() > 4 || v.find_first_not_of("0123456789") != std::string_view::npos) return false;
    *n = std::atoi(std::string(v).c_str());
    return *n >= 1 && *n <= 4096;
  }, out);
}

bool ParseSlowdowns(std::string_view spec, std::array<double, kNumServices>* out) {
  return ParsePerService(spec, [](std::string_view v, double* x) {
    if (v.empty() || v.size() > 16 || v.find_first_not_of("0123456789.") != std::string_view::npos) return false;
    char* end = nullptr;
    const std::string text(v);
    *x = std::strtod(text.c_str(), &end);
    return end == text.c_str() + text.size() && *x >= 0 && *x <= 1;
  }, out);
}

// The trace compressed (or stretched) in time: the same multipliers, time_scale real s per trace s.
Trace Rescaled(const Trace& t, double time_scale) {
  Trace out = t;
  out.duration_s *= time_scale;
  for (auto& p : out.points) p.first *= time_scale;
  return out;
}

// One summary line written by the live replay's own writer (WriteLiveSummaryJson), so
// sim_vs_live.sh reads both alike. "ok" is what the live replay counts: served within the SLO.
void AppendJsonl(FILE* f, const Trace& t, const SimResult& r, const Catalog& c, double limit) {
  LiveResult lr;
  lr.trace = t.name;
  lr.peak = t.Peak();
  lr.full_quality = r.full_quality;
  lr.limit = limit;
  for (const State& s : c.states) lr.state_names.push_back(s.name);
  lr.summary.arrived = r.arrived;
  lr.summary.ok = r.served - r.slo_violations;
  lr.summary.shed = r.shed;
  lr.summary.failed = r.failed;
  lr.summary.slo_violations = r.slo_violations;
  lr.summary.max_drop = r.max_drop;
  lr.summary.mean_drop = r.mean_drop;
  lr.time_in_state_s = r.time_in_state_s;
  lr.transitions = r.transitions;
  const std::string line = WriteLiveSummaryJson(lr, r.policy == "baseline" ? "per-service" : r.policy) + "\n";
  std::fwrite(line.data(), 1, line.size(), f);
}

// One row per simulated window; the same leading columns as `keel hilo replay --out-csv`, with t_s
// in trace seconds (the simulated time divided by the time scale), as the replay writes it.
bool WriteWindowsCsv(const std::string& path, const SimResult& r, double time_scale) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) return false;
  // The first four columns are what plot.sh reads; the levels follow live.sh's names.
  f << "t_s,arrived,mean_quality,state_index,answer_level,vector_level,engine_level,gateway_level\n";
  char line[160];
  for (const SimWindow& w : r.windows) {
    std::snprintf(line, sizeof line, "%.3f,%lld,%.4f,%d,%d,%d,%d,%d\n", w.t_s / time_scale, static_cast<long long>(w.arrived),
                  w.mean_quality, w.state, w.levels[0], w.levels[1], w.levels[2], w.levels[3]);
    f << line;
  }
  return static_cast<bool>(f);
}

bool ReadFile(const std::string& path, std::string& out) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return false;
  std::stringstream ss;
  ss << f.rdbuf();
  out = ss.str();
  return true;
}

void PrintTrace(const Catalog& c, const Trace& t, const SimResult* r, double limit) {
  std::printf("\n### %s (peak %.2fx, %.0f s)\n\n", t.name.c_str(), t.Peak(), t.duration_s);
  std::printf("| policy | max drop | mean drop | within 0.85 L / over L | arrived | shed | failed | SLO violations | transitions |");
  for (const State& s : c.states) std::printf(" s in %s |", s.name.c_str());
  std::printf("\n|---|---|---|---|---|---|---|---|---|");
  for (size_t i = 0; i < c.states.size(); ++i) std::printf("---|");
  std::printf("\n");
  for (int p = 0; p < 2; ++p) {
    const SimResult& x = r[p];
    const char* verdict = p == 0 ? (x.max_drop <= 0.85 * limit ? "yes (<= 0.85 L)" : "no (> 0.85 L)")
                                 : (x.max_drop > limit ? "yes (> L)" : "no (<= L)");
    std::printf("| %s | %.3f | %.3f | %s | %lld | %lld | %lld | %lld | %lld |", x.policy.c_str(), x.max_drop,
                x.mean_drop, verdict, static_cast<long long>(x.arrived), static_cast<long long>(x.shed),
                static_cast<long long>(x.failed), static_cast<long long>(x.slo_violations),
                static_cast<long long>(x.transitions));
    for (double s : x.time_in_state_s) std::printf(" %.1f |", s);
    std::printf("\n");
  }
}

int Main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    auto val = [&](const char* flag) -> const char* {
      if (std::strcmp(argv[i], flag) != 0 || i + 1 >= argc) return nullptr;
      return argv[++i];
    };
    if (const char* v = val("--catalog")) a.catalog = v;
    else if (const char* v = val("--scale")) a.scale = std::atof(v);
    else if (const char* v = val("--baseline-rate")) a.baseline_rate = std::atof(v);
    else if (const char* v = val("--seed")) a.seed = std::strtoull(v, nullptr, 10);
    else if (const char* v = val("--trace")) a.trace = v;
    else if (const char* v = val("--csv")) a.csv = v;
    else if (const char* v = val("--csv-dir")) a.csv_dir = v;
    else if (const char* v = val("--time-scale")) a.time_scale = std::atof(v);
    else if (const char* v = val("--window-s")) a.window_s = std::atof(v);
    else if (const char* v = val("--slo-ms")) a.slo_ms = std::atof(v);
    else if (const char* v = val("--servers")) {
      if (!ParseServers(v, &a.servers)) {
        std::fprintf(stderr, "--servers: expected N or service=N[,service=N...] (services answer, vector, engine, gateway; N 1..4096), got '%s'\n", v);
        return 2;
      }
    }
    else if (const char* v = val("--jsonl")) a.jsonl = v;
    else if (const char* v = val("--baseline-queue-ms")) a.baseline.degrade_queue_ms = std::atof(v);
    else if (const char* v = val("--baseline-recover-queue-ms")) a.baseline.recover_queue_ms = std::atof(v);
    else if (const char* v = val("--batch-slowdown")) {
      if (!ParseSlowdowns(v, &a.batch_slowdown)) {
        std::fprintf(stderr, "--batch-slowdown: expected X or service=X[,service=X...] (services answer, vector, engine, gateway; X in [0, 1]), got '%s'\n", v);
        return 2;
      }
    }
    else if (const char* v = val("--capacity-utilisation")) a.capacity_utilisation = std::atof(v);
    else if (const char* v = val("--speed-sd")) a.speed_sd = std::atof(v);
    else if (const char* v = val("--speed-tau-s")) a.speed_tau_s = std::atof(v);
    else if (const char* v = val("--speed-run-sd")) a.speed_run_sd = std::atof(v);
    else if (const char* v = val("--speed-seed")) a.speed_seed = std::strtoull(v, nullptr, 10);
    else if (const char* v = val("--entry-max-in-flight")) {
      char* end = nullptr;
      const long n = std::strtol(v, &end, 10);
      if (end == v || *end != '\0' || n < 0 || n > (1 << 24)) {
        std::fprintf(stderr, "--entry-max-in-flight: expected an integer in [0, 16777216], got '%s'\n", v);
        return 2;
      }
      a.entry_max_in_flight = static_cast<int>(n);
    }
    else if (const char* v = val("--objective")) {
      Result<Objective> obj = ParseObjective(v);
      if (!obj.ok()) {
        std::fprintf(stderr, "--objective: %s\n", obj.status().message().c_str());
        return 2;
      }
      a.objective = *obj;
    }
    else if (std::strcmp(argv[i], "--live-loop") == 0) a.live_loop = true;
    else if (std::strcmp(argv[i], "--no-recent-rate-guard") == 0) a.recent_rate_guard = false;
    else {
      std::fprintf(stderr, "unknown or incomplete argument %s\n", argv[i]);
      return 2;
    }
  }
  std::string text;
  if (!ReadFile(a.catalog, text)) {
    std::fprintf(stderr, "cannot read %s\n", a.catalog.c_str());
    return 1;
  }
  Result<Catalog> cat = ParseCatalog(text);
  if (!cat.ok()) {
    std::fprintf(stderr, "%s: %s\n", a.catalog.c_str(), cat.status().ToString().c_str());
    return 1;
  }
  std::vector<Trace> traces = SurgeTraces(a.seed);
  traces.push_back(Surge3x());
  if (!a.csv.empty()) {
    std::string csv;
    if (!ReadFile(a.csv, csv)) {
      std::fprintf(stderr, "cannot read %s\n", a.csv.c_str());
      return 1;
    }
    Result<Trace> t = ParseCsvTrace(csv, a.csv, 0);
    if (!t.ok()) {
      std::fprintf(stderr, "%s\n", t.status().ToString().c_str());
      return 1;
    }
    traces.push_back(std::move(t).value());
  }
  if (!(a.time_scale > 0 && a.time_scale <= 100) || !(a.window_s > 0) || !(a.slo_ms > 0) || !(a.scale > 0) ||
      !(a.baseline_rate > 0)) {
    std::fprintf(stderr, "--time-scale (0, 100], --window-s, --slo-ms, --scale, --baseline-rate > 0\n");
    return 2;
  }
  if (Status s = CheckBaselineOptions(a.baseline); !s.ok()) {
    std::fprintf(stderr, "--baseline-queue-ms and --baseline-recover-queue-ms: %s\n", s.message().c_str());
    return 2;
  }
  for (Trace& t : traces) t = Rescaled(t, a.time_scale);
  FILE* jsonl = nullptr;
  if (!a.jsonl.empty() && !(jsonl = std::fopen(a.jsonl.c_str(), "a"))) {
    std::fprintf(stderr, "cannot write %s\n", a.jsonl.c_str());
    return 1;
  }
  SimOptions o;
  o.window_s = a.window_s * a.time_scale;
  o.slo_ms = a.slo_ms;
  o.timeout_ms = std::max(o.timeout_ms, a.slo_ms);
  o.servers = a.servers;
  o.entry_max_in_flight = a.entry_max_in_flight;
  o.batch_slowdown = a.batch_slowdown;
  o.capacity_utilisation = a.capacity_utilisation;
  o.speed_sd = a.speed_sd;
  o.speed_tau_s = a.speed_tau_s;
  o.speed_run_sd = a.speed_run_sd;
  o.speed_seed = a.speed_seed;
  if (a.live_loop) {  // ServiceLinkOptions' and ControllerServerOptions' defaults
    o.report_interval_s = 0.25;
    o.decide_interval_s = 0.25;
    o.rate_window_s = 2;
    o.live_baseline = true;
  }
  o.baseline = a.baseline;
  o.controller.recent_rate_guard = a.recent_rate_guard;
  o.controller.objective = a.objective;
  o.scale = a.scale;
  o.baseline_rate = a.baseline_rate;
  o.seed = a.seed;
  const double limit = cat->max_quality_drop;
  std::printf("HiLO simulation: catalog %s, scale %gx, baseline %g req/s x scale, seed %llu, L = %g\n", a.catalog.c_str(),
              a.scale, a.baseline_rate, static_cast<unsigned long long>(a.seed), limit);
  if (o.speed_drifts()) {
    std::printf("Machine speed drifts: sd %g (log), correlation time %g s, per-run sd %g, speed seed %llu.\n", a.speed_sd,
                a.speed_tau_s, a.speed_run_sd, static_cast<unsigned long long>(a.speed_seed));
  }
  std::printf("Drops are quality points per %g s window vs state %s (%g); time in state is the cheapest level applied.\n",
              o.window_s, cat->states[0].name.c_str(), cat->states[0].figures->quality);
  struct Row {
    std::string name;
    double peak, hilo, base;
    long long hilo_shed, base_shed;
  };
  std::vector<Row> rows;
  const auto t0 = std::chrono::steady_clock::now();
  for (const Trace& t : traces) {
    if (!a.trace.empty() && t.name != a.trace) continue;
    SimResult r[2];
    const Policy pol[2] = {Policy::kHilo, Policy::kBaseline};
    for (int p = 0; p < 2; ++p) {
      Result<SimResult> x = Simulate(*cat, t, pol[p], o);
      if (!x.ok()) {
        std::fprintf(stderr, "%s: %s\n", t.name.c_str(), x.status().ToString().c_str());
        return 1;
      }
      r[p] = std::move(x).value();
      if (!a.csv_dir.empty()) {
        std::string file = t.name;  // a --csv trace is named by its path: keep the name a file name
        for (char& ch : file) {
          if (!std::isalnum(static_cast<unsigned char>(ch)) && ch != '_' && ch != '-' && ch != '.') ch = '_';
        }
        const std::string path = a.csv_dir + "/sim_" + file + "_" + r[p].policy + ".csv";
        if (!WriteWindowsCsv(path, r[p], a.time_scale)) {
          std::fprintf(stderr, "cannot write %s\n", path.c_str());
          return 1;
        }
      }
    }
    PrintTrace(*cat, t, r, limit);
    if (jsonl) {
      for (const SimResult& x : r) AppendJsonl(jsonl, t, x, *cat, limit);
    }
    rows.push_back({t.name, t.Peak(), r[0].max_drop, r[1].max_drop, static_cast<long long>(r[0].shed),
                    static_cast<long long>(r[1].shed)});
  }
  std::printf("\n### Summary (L = %g, goal: HiLO <= %.3f, baseline > %g)\n\n", limit, 0.85 * limit, limit);
  std::printf("| trace | peak | HiLO max drop | baseline max drop | HiLO <= 0.85 L | baseline > L | HiLO shed | baseline shed |\n");
  std::printf("|---|---|---|---|---|---|---|---|\n");
  int hilo_ok = 0;
  int base_over = 0;
  for (const Row& w : rows) {
    const bool h = w.hilo <= 0.85 * limit;
    const bool b = w.base > limit;
    hilo_ok += h;
    base_over += b;
    std::printf("| %s | %.2fx | %.3f | %.3f | %s | %s | %lld | %lld |\n", w.name.c_str(), w.peak, w.hilo, w.base,
                h ? "yes" : "no", b ? "yes" : "no", w.hilo_shed, w.base_shed);
  }
  std::printf("\nHiLO within 0.85 L on %d of %zu traces; baseline over L on %d of %zu. Simulated in %.1f s.\n", hilo_ok,
              rows.size(), base_over, rows.size(),
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  if (jsonl) std::fclose(jsonl);
  return 0;
}

}  // namespace
}  // namespace keel::hilo

int main(int argc, char** argv) { return keel::hilo::Main(argc, argv); }
