#include "keel/hilo/catalog.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include <nlohmann/json.hpp>

#include "keel/core/json_reader.h"
#include "keel/core/mapped_file.h"
#include "keel/hilo/json_fields.h"

namespace keel::hilo {

using internal::kMaxInt;
using internal::ObjectReader;
using nlohmann::json;

namespace {

constexpr const char* kFormat = "keel-hilo-catalog";
constexpr int64_t kVersion = 1;
// Generous for any real deployment, small enough that a typo (an extra zero) is caught.
constexpr int64_t kMaxKnob = 1 << 20;
constexpr double kMaxCapacity = 1e9;
constexpr int64_t kMaxUnixSeconds = int64_t{1} << 40;

std::string StatePath(size_t i) { return "states[" + std::to_string(i) + "]"; }

Status ReadAnswer(const json& v, const std::string& path, AnswerLevel* out) {
  KEEL_ASSIGN_OR_RETURN(ObjectReader r, ObjectReader::Open(v, path));
  KEEL_RETURN_IF_ERROR(r.Bool("retrieval", &out->retrieval));
  KEEL_RETURN_IF_ERROR(r.Int("context_docs", 0, kMaxKnob, &out->context_docs));
  if (out->retrieval && out->context_docs < 1) {
    return Status::InvalidArgument(r.PathOf("context_docs") + ": must be at least 1 when retrieval is on");
  }
  if (!out->retrieval && out->context_docs != 0) {
    return Status::InvalidArgument(r.PathOf("context_docs") + ": must be 0 when retrieval is off");
  }
  return r.NoUnknown();
}

Status ReadVector(const json& v, const std::string& path, VectorLevel* out) {
  KEEL_ASSIGN_OR_RETURN(ObjectReader r, ObjectReader::Open(v, path));
  KEEL_RETURN_IF_ERROR(r.Int("nprobe", 1, kMaxKnob, &out->nprobe));
  KEEL_RETURN_IF_ERROR(r.Int("k", 1, kMaxKnob, &out->k));
  KEEL_RETURN_IF_ERROR(r.Bool("rerank", &out->rerank));
  KEEL_RETURN_IF_ERROR(r.Int("fanout", 1, kMaxKnob, &out->fanout));
  return r.NoUnknown();
}

Status ReadEngine(const json& v, const std::string& path, EngineLevel* out) {
  KEEL_ASSIGN_OR_RETURN(ObjectReader r, ObjectReader::Open(v, path));
  KEEL_RETURN_IF_ERROR(r.Name("kv_codec", false, &out->kv_codec));
  KEEL_RETURN_IF_ERROR(r.Bool("lossless", &out->lossless));
  KEEL_RETURN_IF_ERROR(r.Int("max_context", 1, kMaxKnob, &out->max_context));
  KEEL_RETURN_IF_ERROR(r.Int("max_new_tokens", 1, kMaxKnob, &out->max_new_tokens));
  return r.NoUnknown();
}

Status ReadGateway(const json& v, const std::string& path, GatewayLevel* out) {
  KEEL_ASSIGN_OR_RETURN(ObjectReader r, ObjectReader::Open(v, path));
  KEEL_RETURN_IF_ERROR(r.Name("model", false, &out->model));
  KEEL_RETURN_IF_ERROR(r.Int("max_tokens_clamp", 1, kMaxKnob, &out->max_tokens_clamp));
  return r.NoUnknown();
}

Status ReadLevels(const json& v, const std::string& path, State* out) {
  KEEL_ASSIGN_OR_RETURN(ObjectReader r, ObjectReader::Open(v, path));
  for (Service s : kAllServices) {
    const std::string name(ServiceName(s));
    const json* level = r.Member(name.c_str());
    if (!level) return Status::InvalidArgument(r.PathOf(name.c_str()) + ": missing (every state sets every service)");
    const std::string p = r.PathOf(name.c_str());
    switch (s) {
      case Service::kAnswer: KEEL_RETURN_IF_ERROR(ReadAnswer(*level, p, &out->answer)); break;
      case Service::kVector: KEEL_RETURN_IF_ERROR(ReadVector(*level, p, &out->vector)); break;
      case Service::kEngine: KEEL_RETURN_IF_ERROR(ReadEngine(*level, p, &out->engine)); break;
      case Service::kGateway: KEEL_RETURN_IF_ERROR(ReadGateway(*level, p, &out->gateway)); break;
    }
  }
  return r.NoUnknown();
}

Status ReadFigures(const json& v, const std::string& path, Figures* out) {
  KEEL_ASSIGN_OR_RETURN(ObjectReader r, ObjectReader::Open(v, path));
  KEEL_RETURN_IF_ERROR(r.Number("quality", 0, 100, &out->quality));
  const json* cap = r.Member("capacity");
  if (!cap) return Status::InvalidArgument(r.PathOf("capacity") + ": missing");
  KEEL_ASSIGN_OR_RETURN(ObjectReader c, ObjectReader::Open(*cap, r.PathOf("capacity")));
  for (Service s : kAllServices) {
    const std::string name(ServiceName(s));
    double x = 0;
    KEEL_RETURN_IF_ERROR(c.Number(name.c_str(), 0, kMaxCapacity, &x));
    if (x <= 0) return Status::InvalidArgument(c.PathOf(name.c_str()) + ": expected a positive number");
    out->capacity[static_cast<int>(s)] = x;
  }
  KEEL_RETURN_IF_ERROR(c.NoUnknown());
  KEEL_RETURN_IF_ERROR(r.Int("validated_at", 0, kMaxUnixSeconds, &out->validated_at));
  if (const json* ov = r.Member("overload")) {
    KEEL_ASSIGN_OR_RETURN(ObjectReader o, ObjectReader::Open(*ov, r.PathOf("overload")));
    KEEL_RETURN_IF_ERROR(o.Number("offered", 0, kMaxCapacity, &out->offered));
    KEEL_RETURN_IF_ERROR(o.Number("goodput", 0, kMaxCapacity, &out->goodput));
    if (out->offered <= 0) return Status::InvalidArgument(o.PathOf("offered") + ": expected a positive number");
    if (out->goodput > out->offered) {
      return Status::InvalidArgument(o.PathOf("goodput") + ": more than was offered");
    }
    KEEL_RETURN_IF_ERROR(o.NoUnknown());
  }
  return r.NoUnknown();
}

Status ReadState(const json& v, const std::string& path, State* out) {
  KEEL_ASSIGN_OR_RETURN(ObjectReader r, ObjectReader::Open(v, path));
  KEEL_RETURN_IF_ERROR(r.Name("name", false, &out->name));
  const json* levels = r.Member("levels");
  if (!levels) return Status::InvalidArgument(r.PathOf("levels") + ": missing");
  KEEL_RETURN_IF_ERROR(ReadLevels(*levels, r.PathOf("levels"), out));
  if (const json* f = r.Member("figures")) {
    Figures figures;
    KEEL_RETURN_IF_ERROR(ReadFigures(*f, r.PathOf("figures"), &figures));
    out->figures = figures;
  }
  return r.NoUnknown();
}

std::string Fmt(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}

// The ordering rules between validated states (unvalidated ones are skipped: CheckUsable refuses
// them anyway, and a catalog is written before validate has measured every state).
Status CheckFigures(const Catalog& c) {
  int prev = -1;
  for (size_t i = 0; i < c.states.size(); ++i) {
    const auto& f = c.states[i].figures;
    if (!f) continue;
    if (prev >= 0) {
      const Figures& p = *c.states[prev].figures;
      const std::string here = StatePath(i) + ".figures";
      if (f->quality > p.quality) {
        return Status::InvalidArgument(here + ".quality: " + Fmt(f->quality) + " is above " + StatePath(prev) +
                                       "'s " + Fmt(p.quality) + " (quality must not rise down the list)");
      }
      for (Service s : kAllServices) {
        if (f->Capacity(s) < p.Capacity(s)) {
          return Status::InvalidArgument(here + ".capacity." + std::string(ServiceName(s)) + ": " +
                                         Fmt(f->Capacity(s)) + " is below " + StatePath(prev) + "'s " +
                                         Fmt(p.Capacity(s)) + " (a cheaper state must not have less capacity)");
        }
      }
    }
    prev = static_cast<int>(i);
  }
  const int safe = c.SafeIndex();
  if (!c.states[safe].figures) return Status::Ok();
  for (size_t i = 0; i < c.states.size(); ++i) {
    if (!c.states[i].figures) continue;
    for (Service s : kAllServices) {
      if (c.states[i].figures->Capacity(s) > c.states[safe].figures->Capacity(s)) {
        return Status::InvalidArgument("safe_state: '" + c.safe_state + "' has less " + std::string(ServiceName(s)) +
                                       " capacity than " + StatePath(i) + " '" + c.states[i].name +
                                       "' (the safe state's capacity must be the largest)");
      }
    }
  }
  return Status::Ok();
}

}  // namespace

std::string_view ServiceName(Service s) {
  switch (s) {
    case Service::kAnswer: return "answer";
    case Service::kVector: return "vector";
    case Service::kEngine: return "engine";
    case Service::kGateway: return "gateway";
  }
  return "unknown";
}

double Figures::Bottleneck() const { return *std::min_element(capacity.begin(), capacity.end()); }

bool SameLevel(const State& a, const State& b, Service s) {
  switch (s) {
    case Service::kAnswer:
      return a.answer.retrieval == b.answer.retrieval && a.answer.context_docs == b.answer.context_docs;
    case Service::kVector:
      return a.vector.nprobe == b.vector.nprobe && a.vector.k == b.vector.k && a.vector.rerank == b.vector.rerank &&
             a.vector.fanout == b.vector.fanout;
    case Service::kEngine:
      return a.engine.kv_codec == b.engine.kv_codec && a.engine.lossless == b.engine.lossless &&
             a.engine.max_context == b.engine.max_context && a.engine.max_new_tokens == b.engine.max_new_tokens;
    case Service::kGateway:
      return a.gateway.model == b.gateway.model && a.gateway.max_tokens_clamp == b.gateway.max_tokens_clamp;
  }
  return false;
}

std::optional<Service> ServiceFromName(std::string_view name) {
  for (Service s : kAllServices) {
    if (ServiceName(s) == name) return s;
  }
  return std::nullopt;
}

int Catalog::IndexOf(std::string_view name) const {
  for (size_t i = 0; i < states.size(); ++i) {
    if (states[i].name == name) return static_cast<int>(i);
  }
  return -1;
}

namespace {

std::string StateCountError(size_t n) {
  return "states: expected " + std::to_string(kMinStates) + " to " + std::to_string(kMaxStates) + " states, got " +
         std::to_string(n);
}

// The rules across members (the reader checks each member's own range).
Status CheckCatalogRules(const Catalog& c) {
  const size_t n = c.states.size();
  if (n < kMinStates || n > kMaxStates) return Status::InvalidArgument(StateCountError(n));
  for (size_t i = 0; i < n; ++i) {
    const State& s = c.states[i];
    if (!internal::IsValidName(s.name)) return Status::InvalidArgument(StatePath(i) + ".name: invalid name");
    if (c.IndexOf(s.name) != static_cast<int>(i)) {
      return Status::InvalidArgument(StatePath(i) + ".name: '" + s.name + "' names an earlier state too");
    }
  }
  if (c.SafeIndex() < 0) return Status::InvalidArgument("safe_state: '" + c.safe_state + "' is not a state");
  if (!(c.max_quality_drop > 0 && c.max_quality_drop <= 100)) {
    return Status::InvalidArgument("max_quality_drop: expected a number above 0 and at most 100");
  }
  return CheckFigures(c);
}

}  // namespace

// A catalog built in code goes through the same reader by a round trip, so one set of range
// rules exists (NaN is written as null and refused as missing).
Status ValidateCatalog(const Catalog& c) { return ParseCatalog(WriteCatalog(c)).status(); }

Result<Catalog> ParseCatalog(std::string_view text) {
  if (text.size() > kMaxCatalogBytes) {
    return Status::InvalidArgument("catalog: larger than " + std::to_string(kMaxCatalogBytes) + " bytes");
  }
  JsonLimits limits;
  limits.max_depth = 6;  // document > states > state > levels|figures > service|capacity
  limits.max_values = 10000;
  limits.require_object = true;
  limits.reject_duplicate_keys = true;
  Result<json> doc = ParseUntrustedJson(text, limits);
  if (!doc.ok()) return Status::InvalidArgument("catalog: " + doc.status().message());

  KEEL_ASSIGN_OR_RETURN(ObjectReader r, ObjectReader::Open(*doc, ""));
  std::string format;
  KEEL_RETURN_IF_ERROR(r.String("format", 64, &format));
  if (format != kFormat) return Status::InvalidArgument(std::string("format: expected \"") + kFormat + "\"");
  int64_t version = 0;
  KEEL_RETURN_IF_ERROR(r.Int("version", kVersion, kVersion, &version));
  Catalog c;
  KEEL_RETURN_IF_ERROR(r.Number("max_quality_drop", 0, 100, &c.max_quality_drop));
  KEEL_RETURN_IF_ERROR(r.Name("safe_state", false, &c.safe_state));
  if (r.Member("binaries")) KEEL_RETURN_IF_ERROR(r.String("binaries", 256, &c.binaries));
  const json* states = r.Member("states");
  if (!states || !states->is_array()) return Status::InvalidArgument("states: expected an array");
  if (states->size() > kMaxStates) return Status::InvalidArgument(StateCountError(states->size()));
  for (size_t i = 0; i < states->size(); ++i) {
    State s;
    KEEL_RETURN_IF_ERROR(ReadState((*states)[i], StatePath(i), &s));
    c.states.push_back(std::move(s));
  }
  KEEL_RETURN_IF_ERROR(r.NoUnknown());
  KEEL_RETURN_IF_ERROR(CheckCatalogRules(c));
  return c;
}

namespace {
nlohmann::ordered_json LevelsJson(const State& s) {
  nlohmann::ordered_json l;
  l["answer"] = {{"retrieval", s.answer.retrieval}, {"context_docs", s.answer.context_docs}};
  l["vector"] = {{"nprobe", s.vector.nprobe}, {"k", s.vector.k}, {"rerank", s.vector.rerank}, {"fanout", s.vector.fanout}};
  l["engine"] = {{"kv_codec", s.engine.kv_codec}, {"lossless", s.engine.lossless},
                 {"max_context", s.engine.max_context}, {"max_new_tokens", s.engine.max_new_tokens}};
  l["gateway"] = {{"model", s.gateway.model}, {"max_tokens_clamp", s.gateway.max_tokens_clamp}};
  return l;
}
}  // namespace

Result<Catalog> ReadCatalogFile(const std::string& path) {
  KEEL_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(path, kMaxCatalogBytes));
  auto c = ParseCatalog(text);
  if (!c.ok()) return Status::InvalidArgument(path + ": " + c.status().message());
  return c;
}

std::string WriteLevels(const State& s) {
  return LevelsJson(s).dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
}

std::string WriteCatalog(const Catalog& c) {
  using ojson = nlohmann::ordered_json;
  ojson doc;
  doc["format"] = kFormat;
  doc["version"] = kVersion;
  doc["max_quality_drop"] = c.max_quality_drop;
  doc["safe_state"] = c.safe_state;
  if (!c.binaries.empty()) doc["binaries"] = c.binaries;
  doc["states"] = ojson::array();
  for (const State& s : c.states) {
    ojson st;
    st["name"] = s.name;
    st["levels"] = LevelsJson(s);
    if (s.figures) {
      ojson cap = ojson::object();
      for (Service sv : kAllServices) cap[std::string(ServiceName(sv))] = s.figures->Capacity(sv);
      st["figures"] = {{"quality", s.figures->quality}, {"capacity", cap}, {"validated_at", s.figures->validated_at}};
      if (s.figures->HasGoodput()) {
        st["figures"]["overload"] = {{"offered", s.figures->offered}, {"goodput", s.figures->goodput}};
      }
    }
    doc["states"].push_back(std::move(st));
  }
  return doc.dump(2, ' ', false, ojson::error_handler_t::replace) + "\n";
}

Status CheckUsable(const Catalog& c, std::string_view running_fingerprint, int64_t now, int64_t max_age_s) {
  const std::string prefix = "catalog not usable: ";
  for (size_t i = 0; i < c.states.size(); ++i) {
    if (!c.states[i].figures) {
      return Status::InvalidArgument(prefix + "state '" + c.states[i].name + "' (" + StatePath(i) +
                                     ") is not validated; run keel hilo validate");
    }
  }
  if (c.binaries.empty()) return Status::InvalidArgument(prefix + "no binaries fingerprint; run keel hilo validate");
  if (c.binaries != running_fingerprint) {
    return Status::InvalidArgument(prefix + "stale: validated with binaries '" + c.binaries +
                                   "', running '" + std::string(running_fingerprint) + "'; run keel hilo validate");
  }
  for (size_t i = 0; i < c.states.size(); ++i) {
    const int64_t age = now - c.states[i].figures->validated_at;
    // A validation time ahead of this clock (past the skew two machines may have) is a
    // hand-edited catalog or a clock gone wrong: its age would never grow.
    constexpr int64_t kMaxClockSkewS = 300;
    if (age < -kMaxClockSkewS) {
      return Status::InvalidArgument(prefix + "state '" + c.states[i].name + "' was validated " + std::to_string(-age) +
                                     " s in the future (validated_at " + std::to_string(c.states[i].figures->validated_at) +
                                     "); run keel hilo validate");
    }
    if (age > max_age_s) {
      return Status::InvalidArgument(prefix + "state '" + c.states[i].name + "' was validated " +
                                     std::to_string(age) + " s ago, more than the " + std::to_string(max_age_s) +
                                     " s allowed; run keel hilo validate");
    }
  }
  return Status::Ok();
}

}  // namespace keel::hilo
