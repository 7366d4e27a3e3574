// RouterOptions from the cluster config JSON, and their validation.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "keel/core/json_reader.h"
#include "keel/vector/router.h"

namespace keel::vector {

namespace {

using json = nlohmann::json;

constexpr size_t kMaxConfigBytes = size_t{16} << 20;

std::string Join(const std::string& where, const std::string& key) { return where.empty() ? key : where + "." + key; }

// Every key of `obj` must be one of `known`: a misspelt option must not fall back to a default.
Status CheckKeys(const json& obj, const std::string& where, std::initializer_list<const char*> known) {
  for (auto it = obj.begin(); it != obj.end(); ++it) {
    if (std::none_of(known.begin(), known.end(), [&](const char* k) { return it.key() == k; })) {
      return Status::InvalidArgument(fmt::format("{}: unknown key", Join(where, it.key())));
    }
  }
  return Status::Ok();
}

Status GetObject(const json& parent, const std::string& where, const char* key, const json** out) {
  *out = nullptr;
  auto it = parent.find(key);
  if (it == parent.end() || it->is_null()) return Status::Ok();
  if (!it->is_object()) return Status::InvalidArgument(fmt::format("{}: must be an object", Join(where, key)));
  *out = &*it;
  return Status::Ok();
}

// An optional integer in [lo, hi]; absent leaves *out unchanged.
template <typename T>
Status GetInt(const json& obj, const std::string& where, const char* key, int64_t lo, int64_t hi, T* out) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return Status::Ok();
  const bool in_range = it->is_number_integer() && !(it->is_number_unsigned() && it->get<uint64_t>() > static_cast<uint64_t>(hi)) &&
                        it->get<int64_t>() >= lo && it->get<int64_t>() <= hi;
  if (!in_range) return Status::InvalidArgument(fmt::format("{}: must be an integer in [{}, {}]", Join(where, key), lo, hi));
  *out = static_cast<T>(it->get<int64_t>());
  return Status::Ok();
}

Status GetDouble(const json& obj, const std::string& where, const char* key, double* out) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return Status::Ok();
  if (!it->is_number()) return Status::InvalidArgument(fmt::format("{}: must be a number", Join(where, key)));
  *out = it->get<double>();
  return Status::Ok();
}

Status GetString(const json& obj, const std::string& where, const char* key, bool required, std::string* out) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) {
    return required ? Status::InvalidArgument(fmt::format("{}: is missing", Join(where, key))) : Status::Ok();
  }
  if (!it->is_string()) return Status::InvalidArgument(fmt::format("{}: must be a string", Join(where, key)));
  *out = it->get<std::string>();
  return Status::Ok();
}

Status ParseTrust(const json& t, trust::VerifierOptions* o) {
  KEEL_RETURN_IF_ERROR(CheckKeys(t, "trust", {"quorum", "min_zones", "threshold", "overlap_weight", "fanout", "depth", "deadline_ms", "hedge_ms"}));
  KEEL_RETURN_IF_ERROR(GetInt(t, "trust", "quorum", 1, 64, &o->quorum));
  KEEL_RETURN_IF_ERROR(GetInt(t, "trust", "min_zones", 1, 64, &o->min_zones));
  KEEL_RETURN_IF_ERROR(GetDouble(t, "trust", "threshold", &o->threshold));
  KEEL_RETURN_IF_ERROR(GetDouble(t, "trust", "overlap_weight", &o->overlap_weight));
  KEEL_RETURN_IF_ERROR(GetInt(t, "trust", "fanout", 0, 1024, &o->fanout));
  KEEL_RETURN_IF_ERROR(GetDouble(t, "trust", "depth", &o->depth));
  int64_t deadline_ms = o->deadline.count();
  KEEL_RETURN_IF_ERROR(GetInt(t, "trust", "deadline_ms", 1, 600000, &deadline_ms));
  o->deadline = std::chrono::milliseconds(deadline_ms);
  int64_t hedge_ms = o->hedge.count();
  KEEL_RETURN_IF_ERROR(GetInt(t, "trust", "hedge_ms", 0, 600000, &hedge_ms));
  o->hedge = std::chrono::milliseconds(hedge_ms);
  return Status::Ok();
}

Status ParseReplica(const json& r, const std::string& where, const std::string& base_dir, RouterReplica* out) {
  if (!r.is_object()) return Status::InvalidArgument(where + ": must be an object");
  KEEL_RETURN_IF_ERROR(CheckKeys(r, where, {"id", "url", "zone", "public_key"}));
  KEEL_RETURN_IF_ERROR(GetString(r, where, "id", true, &out->id));
  KEEL_RETURN_IF_ERROR(GetString(r, where, "url", true, &out->url));
  KEEL_RETURN_IF_ERROR(GetString(r, where, "zone", true, &out->zone));
  KEEL_RETURN_IF_ERROR(GetString(r, where, "public_key", false, &out->public_key));
  if (!out->public_key.empty() && std::filesystem::path(out->public_key).is_relative() && !base_dir.empty()) {
    out->public_key = (std::filesystem::path(base_dir) / out->public_key).string();
  }
  return Status::Ok();
}

Status ParseShards(const json& shards, const std::string& base_dir, std::vector<RouterShard>* out) {
  if (!shards.is_array() || shards.empty()) return Status::InvalidArgument("shards: must be a non-empty array");
  out->resize(shards.size());
  for (size_t s = 0; s < shards.size(); ++s) {
    const std::string where = fmt::format("shards[{}]", s);
    const json& sh = shards[s];
    if (!sh.is_object()) return Status::InvalidArgument(where + ": must be an object");
    KEEL_RETURN_IF_ERROR(CheckKeys(sh, where, {"id", "replicas"}));
    if (!sh.contains("id")) return Status::InvalidArgument(where + ".id: is missing");
    KEEL_RETURN_IF_ERROR(GetInt(sh, where, "id", 0, 1 << 20, &(*out)[s].id));
    auto reps = sh.find("replicas");
    if (reps == sh.end() || !reps->is_array() || reps->empty()) {
      return Status::InvalidArgument(where + ".replicas: must be a non-empty array");
    }
    (*out)[s].replicas.resize(reps->size());
    for (size_t r = 0; r < reps->size(); ++r) {
      KEEL_RETURN_IF_ERROR(ParseReplica((*reps)[r], fmt::format("{}.replicas[{}]", where, r), base_dir, &(*out)[s].replicas[r]));
    }
  }
  return Status::Ok();
}

Status ParseTop(const json& j, const std::string& base_dir, RouterOptions* o) {
  KEEL_RETURN_IF_ERROR(CheckKeys(j, "", {"host", "port", "text_dim", "image_dim", "max_k", "mode", "trust", "plain", "shards"}));
  KEEL_RETURN_IF_ERROR(GetString(j, "", "host", false, &o->host));
  KEEL_RETURN_IF_ERROR(GetInt(j, "", "port", 0, 65535, &o->port));
  KEEL_RETURN_IF_ERROR(GetInt(j, "", "text_dim", 1, 65536, &o->text_dim));
  KEEL_RETURN_IF_ERROR(GetInt(j, "", "image_dim", 1, 65536, &o->image_dim));
  KEEL_RETURN_IF_ERROR(GetInt(j, "", "max_k", 1, 1 << 20, &o->max_k));
  std::string mode = "trust";
  KEEL_RETURN_IF_ERROR(GetString(j, "", "mode", false, &mode));
  if (mode != "trust" && mode != "plain") return Status::InvalidArgument("mode: must be \"trust\" or \"plain\", got \"" + mode + "\"");
  o->mode = mode == "trust" ? RouterMode::kTrust : RouterMode::kPlain;
  const json* t = nullptr;
  KEEL_RETURN_IF_ERROR(GetObject(j, "", "trust", &t));
  if (t) KEEL_RETURN_IF_ERROR(ParseTrust(*t, &o->trust));
  const json* p = nullptr;
  KEEL_RETURN_IF_ERROR(GetObject(j, "", "plain", &p));
  if (p) {
    KEEL_RETURN_IF_ERROR(CheckKeys(*p, "plain", {"fanout"}));
    KEEL_RETURN_IF_ERROR(GetInt(*p, "plain", "fanout", 0, 1024, &o->plain_fanout));
  }
  auto shards = j.find("shards");
  if (shards == j.end()) return Status::InvalidArgument("shards: is missing");
  return ParseShards(*shards, base_dir, &o->shards);
}

}  // namespace

Status RouterOptions::Validate() const {
  if (text_dim < 1 || image_dim < 1) return Status::InvalidArgument("text_dim and image_dim must be >= 1");
  if (max_k < 1) return Status::InvalidArgument("max_k must be >= 1");
  KEEL_RETURN_IF_ERROR(trust.Validate());
  if (plain_fanout < 0) return Status::InvalidArgument("plain.fanout must be >= 0");
  if (write_timeout_ms < 1 || stats_timeout_ms < 1 || sync_interval_ms < 0) {
    return Status::InvalidArgument("write_timeout_ms and stats_timeout_ms must be >= 1, sync_interval_ms >= 0");
  }
  if (shards.empty()) return Status::InvalidArgument("shards: must be a non-empty array");
  std::set<std::string> ids;
  for (size_t s = 0; s < shards.size(); ++s) {
    if (shards[s].id != s) {
      return Status::InvalidArgument(fmt::format("shards[{}].id: shard ids must be 0..{} in order, got {}", s, shards.size() - 1, shards[s].id));
    }
    for (size_t r = 0; r < shards[s].replicas.size(); ++r) {
      const RouterReplica& rep = shards[s].replicas[r];
      const std::string where = fmt::format("shards[{}].replicas[{}]", s, r);
      if (rep.id.empty() || rep.id.size() > trust::kMaxLabelBytes) {
        return Status::InvalidArgument(fmt::format("{}.id: must have 1..{} bytes", where, trust::kMaxLabelBytes));
      }
      if (!ids.insert(rep.id).second) return Status::InvalidArgument(fmt::format("{}.id: \"{}\" is used twice", where, rep.id));
      if (rep.zone.empty() || rep.zone.size() > trust::kMaxLabelBytes) {
        return Status::InvalidArgument(fmt::format("{}.zone: must have 1..{} bytes", where, trust::kMaxLabelBytes));
      }
      if (auto url = ParseHttpUrl(rep.url); !url.ok()) return Status::InvalidArgument(where + ".url: " + url.status().message());
      if (mode == RouterMode::kTrust && rep.public_key.empty()) {
        return Status::InvalidArgument(where + ".public_key: is missing (required in mode trust)");
      }
    }
    if (mode == RouterMode::kTrust) {
      // A shard that cannot meet the quorum would answer unverified forever.
      std::set<std::string> zones;
      for (const RouterReplica& rep : shards[s].replicas) zones.insert(rep.zone);
      if (static_cast<int>(shards[s].replicas.size()) < trust.quorum || static_cast<int>(zones.size()) < trust.min_zones) {
        return Status::InvalidArgument(fmt::format(
            "shards[{}]: {} replicas in {} zones can never give a verified answer (trust.quorum {}, trust.min_zones {})",
            s, shards[s].replicas.size(), zones.size(), trust.quorum, trust.min_zones));
      }
    }
  }
  return Status::Ok();
}

Result<RouterOptions> ParseRouterConfig(std::string_view text, const std::string& base_dir) {
  const JsonLimits limits{
      .max_depth = 8, .max_values = size_t{1} << 20, .require_object = true, .reject_duplicate_keys = true};
  auto j = ParseUntrustedJson(text, limits);
  if (!j.ok()) return Status::InvalidArgument("not a JSON object: " + j.status().message());
  RouterOptions o;
  KEEL_RETURN_IF_ERROR(ParseTop(*j, base_dir, &o));
  // Shards may be listed in any order; Validate wants them by id.
  std::sort(o.shards.begin(), o.shards.end(), [](const RouterShard& a, const RouterShard& b) { return a.id < b.id; });
  KEEL_RETURN_IF_ERROR(o.Validate());
  return o;
}

Result<RouterOptions> LoadRouterConfig(const std::string& path) {
  std::error_code ec;
  const auto size = std::filesystem::file_size(path, ec);
  if (ec) return Status::NotFound(fmt::format("router config {}: {}", path, ec.message()));
  if (size > kMaxConfigBytes) return Status::InvalidArgument(fmt::format("router config {}: larger than {} bytes", path, kMaxConfigBytes));
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  if (!in.good() && !in.eof()) return Status::IOError(fmt::format("router config {}: cannot read", path));
  auto o = ParseRouterConfig(text.str(), std::filesystem::path(path).parent_path().string());
  if (!o.ok()) return Status::InvalidArgument(fmt::format("router config {}: {}", path, o.status().message()));
  return o;
}

}  // namespace keel::vector
