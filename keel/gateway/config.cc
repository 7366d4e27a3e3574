// The gateway's JSON config (documented in docs/gateway.md).
#include <cstdlib>
#include <filesystem>
#include <set>

#include <nlohmann/json.hpp>

#include "keel/core/http_client.h"
#include "keel/core/json_reader.h"
#include "keel/core/mapped_file.h"
#include "keel/gateway/gateway.h"
#include "keel/gateway/vendor.h"

namespace keel::gateway {
namespace {

using nlohmann::json;

Status Expect(bool ok, const std::string& field, const char* what) {
  if (ok) return Status::Ok();
  return Status::InvalidArgument("gateway config: " + field + ": expected " + what);
}

template <typename T>
Status ReadNumber(const json& obj, const char* key, const std::string& where, T* out, double min, double max) {
  if (!obj.contains(key)) return Status::Ok();
  const json& v = obj[key];
  const std::string field = where + key;
  if (!v.is_number()) return Expect(false, field, "a number");
  const double d = v.get<double>();
  if (!(d >= min && d <= max)) {
    return Status::InvalidArgument("gateway config: " + field + ": " + std::to_string(d) + " is outside [" +
                                   std::to_string(min) + ", " + std::to_string(max) + "]");
  }
  *out = static_cast<T>(d);
  return Status::Ok();
}

Status ReadString(const json& obj, const char* key, const std::string& where, std::string* out, bool required) {
  if (!obj.contains(key)) {
    if (required) return Status::InvalidArgument("gateway config: " + where + key + ": missing");
    return Status::Ok();
  }
  if (!obj[key].is_string()) return Expect(false, where + key, "a string");
  *out = obj[key].get<std::string>();
  if (required && out->empty()) return Status::InvalidArgument("gateway config: " + where + key + ": empty");
  return Status::Ok();
}

// HiLO names (instance, state) end up in metric labels and load reports: 1..64 of [A-Za-z0-9_.:-],
// the rule keel/hilo applies.
bool IsHiloName(std::string_view s) {
  if (s.empty() || s.size() > 64) return false;
  for (char ch : s) {
    const bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '_' ||
                    ch == '.' || ch == ':' || ch == '-';
    if (!ok) return false;
  }
  return true;
}

// The "hilo" member (docs/gateway.md "HiLO"). Strict, unlike the older members: an operator's typo
// in a degradation setting would otherwise go unnoticed until the surge it is for.
Result<HiloGatewayConfig> ParseHiloConfig(const json& h, const std::set<std::string>& model_names) {
  KEEL_RETURN_IF_ERROR(Expect(h.is_object(), "hilo", "an object"));
  for (const auto& [key, value] : h.items()) {
    if (key != "controller" && key != "catalog" && key != "state" && key != "instance" && key != "tiers") {
      return Status::InvalidArgument("gateway config: hilo." + key.substr(0, 64) +
                                     ": unknown member (controller, catalog, state, instance, tiers)");
    }
  }
  HiloGatewayConfig c;
  KEEL_RETURN_IF_ERROR(ReadString(h, "controller", "hilo.", &c.controller, false));
  KEEL_RETURN_IF_ERROR(ReadString(h, "catalog", "hilo.", &c.catalog_path, false));
  KEEL_RETURN_IF_ERROR(ReadString(h, "state", "hilo.", &c.state, false));
  KEEL_RETURN_IF_ERROR(ReadString(h, "instance", "hilo.", &c.instance, false));
  if (c.controller.empty() == c.catalog_path.empty()) {
    return Status::InvalidArgument(
        "gateway config: hilo: give either \"controller\" (follow a controller) or \"catalog\" and \"state\" "
        "(pinned to one state)");
  }
  if (!c.controller.empty()) {
    auto endpoint = ParseHttpUrl(c.controller);
    if (!endpoint.ok()) return Status::InvalidArgument("gateway config: hilo.controller: " + endpoint.status().message());
  } else if (!h.contains("state")) {
    return Status::InvalidArgument("gateway config: hilo.state: missing (a gateway pinned to a catalog needs its state)");
  }
  if (h.contains("state") && !IsHiloName(c.state)) {
    return Status::InvalidArgument("gateway config: hilo.state: expected a state name (1..64 of [A-Za-z0-9_.:-])");
  }
  if (h.contains("instance") && !IsHiloName(c.instance)) {
    return Status::InvalidArgument("gateway config: hilo.instance: expected 1..64 of [A-Za-z0-9_.:-]");
  }
  if (h.contains("tiers")) {
    const json& tiers = h["tiers"];
    KEEL_RETURN_IF_ERROR(Expect(tiers.is_object(), "hilo.tiers", "an object {virtual model: {tier: model}}"));
    for (const auto& [name, map] : tiers.items()) {
      const std::string where = "hilo.tiers." + name.substr(0, 64);
      KEEL_RETURN_IF_ERROR(Expect(!name.empty(), where, "a non-empty model name"));
      if (model_names.count(name)) {
        // Every request for it would be re-tiered: the model itself could never be reached.
        return Status::InvalidArgument("gateway config: " + where + ": \"" + name +
                                       "\" is also in models; a tiered name must not be");
      }
      KEEL_RETURN_IF_ERROR(Expect(map.is_object() && !map.empty(), where, "a non-empty object {tier: model}"));
      auto& out = c.tiers[name];
      for (const auto& [tier, model] : map.items()) {
        const std::string tw = where + "." + tier.substr(0, 64);
        if (!IsHiloName(tier)) return Status::InvalidArgument("gateway config: " + tw + ": not a tier name");
        KEEL_RETURN_IF_ERROR(Expect(model.is_string(), tw, "a model name"));
        const std::string target = model.get<std::string>();
        if (!model_names.count(target)) {
          return Status::InvalidArgument("gateway config: " + tw + ": no model named \"" + target.substr(0, 128) + "\"");
        }
        out[tier] = target;
      }
    }
  }
  return c;
}

}  // namespace

Result<GatewayConfig> ParseGatewayConfig(std::string_view text) {
  // An operator's file, but read with the same bounds as any JSON (a config is a few KiB).
  JsonReadError why = JsonReadError::kNone;
  Result<json> parsed =
      ParseUntrustedJson(text, JsonLimits{.require_object = true, .reject_duplicate_keys = true}, &why);
  if (why == JsonReadError::kMalformed || why == JsonReadError::kNotObject) {
    return Status::InvalidArgument("gateway config: not a JSON object (" + parsed.status().message() + ")");
  }
  if (!parsed.ok()) return Status::InvalidArgument("gateway config: " + parsed.status().message());
  json root = std::move(parsed).value();
  GatewayConfig c;
  if (root.contains("listen")) {
    const json& l = root["listen"];
    KEEL_RETURN_IF_ERROR(Expect(l.is_object(), "listen", "an object"));
    KEEL_RETURN_IF_ERROR(ReadString(l, "host", "listen.", &c.host, false));
    KEEL_RETURN_IF_ERROR(ReadNumber(l, "port", "listen.", &c.port, 0, 65535));
    KEEL_RETURN_IF_ERROR(ReadNumber(l, "threads", "listen.", &c.threads, 1, 256));
    KEEL_RETURN_IF_ERROR(ReadString(l, "tls_cert", "listen.", &c.tls_cert_file, false));
    KEEL_RETURN_IF_ERROR(ReadString(l, "tls_key", "listen.", &c.tls_key_file, false));
    KEEL_RETURN_IF_ERROR(ReadNumber(l, "max_body_bytes", "listen.", &c.max_body_bytes, 1024, 1 << 30));
    KEEL_RETURN_IF_ERROR(ReadNumber(l, "client_timeout_s", "listen.", &c.client_timeout_seconds, 0.01, 3600));
    if (c.tls_cert_file.empty() != c.tls_key_file.empty()) {
      return Status::InvalidArgument("gateway config: listen.tls_cert and listen.tls_key go together");
    }
  }
  if (root.contains("policy")) {
    const json& p = root["policy"];
    KEEL_RETURN_IF_ERROR(Expect(p.is_object(), "policy", "an object"));
    KEEL_RETURN_IF_ERROR(ReadString(p, "socket", "policy.", &c.policy_socket, false));
    KEEL_RETURN_IF_ERROR(ReadNumber(p, "timeout_s", "policy.", &c.policy_timeout_seconds, 0.001, 60));
    KEEL_RETURN_IF_ERROR(ReadNumber(p, "usage_flush_s", "policy.", &c.usage_flush_seconds, 0.001, 60));
  }
  KEEL_RETURN_IF_ERROR(ReadNumber(root, "default_max_tokens", "", &c.default_max_tokens, 1, 1e7));

  KEEL_RETURN_IF_ERROR(Expect(root.contains("upstreams") && root["upstreams"].is_array(), "upstreams", "an array"));
  std::set<std::string> upstream_names;
  for (size_t i = 0; i < root["upstreams"].size(); ++i) {
    const json& u = root["upstreams"][i];
    const std::string where = "upstreams[" + std::to_string(i) + "].";
    KEEL_RETURN_IF_ERROR(Expect(u.is_object(), where, "an object"));
    UpstreamConfig up;
    KEEL_RETURN_IF_ERROR(ReadString(u, "name", where, &up.name, true));
    std::string format = "openai";
    KEEL_RETURN_IF_ERROR(ReadString(u, "format", where, &format, false));
    auto vendor = FindVendor(format);
    if (!vendor.ok()) return Status::InvalidArgument("gateway config: " + where + "format: " + vendor.status().message());
    up.vendor = format;
    up.format = (*vendor)->format();
    KEEL_RETURN_IF_ERROR(ReadString(u, "base_url", where, &up.base_url, true));
    while (!up.base_url.empty() && up.base_url.back() == '/') up.base_url.pop_back();
    if (up.base_url.rfind("http://", 0) != 0 && up.base_url.rfind("https://", 0) != 0) {
      return Status::InvalidArgument("gateway config: " + where + "base_url: must start with http:// or https://");
    }
    KEEL_RETURN_IF_ERROR(ReadString(u, "api_key", where, &up.api_key, false));
    std::string env;
    KEEL_RETURN_IF_ERROR(ReadString(u, "api_key_env", where, &env, false));
    if (!env.empty()) {
      const char* v = std::getenv(env.c_str());
      if (v == nullptr || *v == '\0') {
        return Status::InvalidArgument("gateway config: " + where + "api_key_env: $" + env + " is not set");
      }
      up.api_key = v;
    }
    KEEL_RETURN_IF_ERROR(ReadNumber(u, "timeout_s", where, &up.timeout_seconds, 0.01, 3600));
    if (!upstream_names.insert(up.name).second) {
      return Status::InvalidArgument("gateway config: " + where + "name: duplicate upstream \"" + up.name + "\"");
    }
    c.upstreams.push_back(std::move(up));
  }

  KEEL_RETURN_IF_ERROR(Expect(root.contains("models") && root["models"].is_array(), "models", "an array"));
  std::set<std::string> model_names;
  for (size_t i = 0; i < root["models"].size(); ++i) {
    const json& m = root["models"][i];
    const std::string where = "models[" + std::to_string(i) + "].";
    KEEL_RETURN_IF_ERROR(Expect(m.is_object(), where, "an object"));
    VirtualModel vm;
    KEEL_RETURN_IF_ERROR(ReadString(m, "name", where, &vm.name, true));
    KEEL_RETURN_IF_ERROR(Expect(m.contains("targets") && m["targets"].is_array() && !m["targets"].empty(),
                                where + "targets", "a non-empty array"));
    for (size_t j = 0; j < m["targets"].size(); ++j) {
      const json& t = m["targets"][j];
      const std::string tw = where + "targets[" + std::to_string(j) + "].";
      KEEL_RETURN_IF_ERROR(Expect(t.is_object(), tw, "an object"));
      RouteTarget rt;
      KEEL_RETURN_IF_ERROR(ReadString(t, "upstream", tw, &rt.upstream, true));
      KEEL_RETURN_IF_ERROR(ReadString(t, "model", tw, &rt.model, true));
      if (!upstream_names.count(rt.upstream)) {
        return Status::InvalidArgument("gateway config: " + tw + "upstream: no upstream named \"" + rt.upstream + "\"");
      }
      vm.targets.push_back(std::move(rt));
    }
    if (m.contains("tokenizer")) {
      const json& t = m["tokenizer"];
      KEEL_RETURN_IF_ERROR(Expect(t.is_object(), where + "tokenizer", "an object {path, vocab_size}"));
      KEEL_RETURN_IF_ERROR(ReadString(t, "path", where + "tokenizer.", &vm.tokenizer_path, true));
      KEEL_RETURN_IF_ERROR(ReadNumber(t, "vocab_size", where + "tokenizer.", &vm.tokenizer_vocab, 1, 1 << 22));
      if (vm.tokenizer_vocab == 0) {
        return Status::InvalidArgument("gateway config: " + where + "tokenizer.vocab_size: missing");
      }
    }
    if (!model_names.insert(vm.name).second) {
      return Status::InvalidArgument("gateway config: " + where + "name: duplicate model \"" + vm.name + "\"");
    }
    c.models.push_back(std::move(vm));
  }
  if (root.contains("hilo")) {
    auto hilo = ParseHiloConfig(root["hilo"], model_names);
    if (!hilo.ok()) return hilo.status();
    c.hilo = std::move(hilo).value();
  }
  return c;
}

Result<GatewayConfig> LoadGatewayConfig(const std::string& path) {
  constexpr size_t kMaxConfigBytes = 16 << 20;
  // A config is a few KiB; a FIFO, /dev/zero or a huge file is refused, not read forever.
  Result<std::string> text = ReadSmallFile(path, kMaxConfigBytes);
  if (!text.ok()) return Status(text.status().code(), "gateway config: " + text.status().message());
  auto c = ParseGatewayConfig(*text);
  if (!c.ok()) return Status::InvalidArgument(path + ": " + c.status().message());
  // Files the config names are found beside it, whatever the working directory (as cluster.json's
  // public keys are): the same file then starts the same gateway from anywhere.
  const std::filesystem::path dir = std::filesystem::path(path).parent_path();
  auto beside_config = [&dir](std::string* file) {
    if (!file->empty() && std::filesystem::path(*file).is_relative()) *file = (dir / *file).lexically_normal().string();
  };
  beside_config(&c->tls_cert_file);
  beside_config(&c->tls_key_file);
  for (VirtualModel& m : c->models) beside_config(&m.tokenizer_path);
  if (c->hilo) beside_config(&c->hilo->catalog_path);
  return c;
}

}  // namespace keel::gateway
