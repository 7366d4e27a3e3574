#include "keel/gateway/policy.h"

#include "keel/core/json_writer.h"

#include <openssl/evp.h>
#include <openssl/rand.h>
#include <sys/random.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <nlohmann/json.hpp>

#include <fmt/format.h>

namespace keel::gateway {

using json = nlohmann::json;

namespace {

std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

Status Bad(std::string_view field, std::string_view why) {
  return Status::InvalidArgument(fmt::format("{}: {}", field, why));
}

}  // namespace


namespace {

Result<json> ParseObject(std::string_view text, std::string_view what) {
  Result<json> j = ParseUntrustedJson(text, kPolicyJsonLimits);
  if (!j.ok()) return Bad(what, j.status().message());
  return j;
}

std::string Path(std::string_view parent, std::string_view field) {
  return parent.empty() ? std::string(field) : fmt::format("{}.{}", parent, field);
}

// Field readers: absent (or null) leaves *out untouched unless `required`.
Status ReadString(const json& o, std::string_view parent, const char* field, bool required, std::string* out) {
  auto it = o.find(field);
  if (it == o.end() || it->is_null()) return required ? Bad(Path(parent, field), "required") : Status::Ok();
  if (!it->is_string()) return Bad(Path(parent, field), "must be a string");
  const auto& s = it->get_ref<const std::string&>();
  if (s.size() > kMaxJsonString) return Bad(Path(parent, field), fmt::format("longer than {} bytes", kMaxJsonString));
  *out = s;
  return Status::Ok();
}

Status ReadInt(const json& o, std::string_view parent, const char* field, bool required, int64_t min, int64_t* out) {
  auto it = o.find(field);
  if (it == o.end() || it->is_null()) return required ? Bad(Path(parent, field), "required") : Status::Ok();
  if (!it->is_number_integer()) return Bad(Path(parent, field), "must be an integer");
  if (it->is_number_unsigned() && it->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return Bad(Path(parent, field), "out of range");
  }
  int64_t v = it->get<int64_t>();
  if (v < min) return Bad(Path(parent, field), fmt::format("must be >= {}", min));
  *out = v;
  return Status::Ok();
}

Status ReadNumber(const json& o, std::string_view parent, const char* field, bool required, double min, double* out) {
  auto it = o.find(field);
  if (it == o.end() || it->is_null()) return required ? Bad(Path(parent, field), "required") : Status::Ok();
  if (!it->is_number()) return Bad(Path(parent, field), "must be a number");
  double v = it->get<double>();
  if (!std::isfinite(v)) return Bad(Path(parent, field), "must be finite");
  if (v < min) return Bad(Path(parent, field), fmt::format("must be >= {}", min));
  *out = v;
  return Status::Ok();
}

Status ReadBool(const json& o, std::string_view parent, const char* field, bool* out) {
  auto it = o.find(field);
  if (it == o.end() || it->is_null()) return Status::Ok();
  if (!it->is_boolean()) return Bad(Path(parent, field), "must be true or false");
  *out = it->get<bool>();
  return Status::Ok();
}

Status RejectUnknown(const json& o, std::string_view parent, std::initializer_list<std::string_view> known) {
  for (auto it = o.begin(); it != o.end(); ++it) {
    bool ok = false;
    for (std::string_view k : known) ok = ok || it.key() == k;
    if (!ok) return Bad(Path(parent, it.key()), "unknown field");
  }
  return Status::Ok();
}

json PolicyObject(const PolicyRules& p) {
  json deny = json::array();
  for (const DenyRule& d : p.deny) deny.push_back({{"model", d.model_glob}, {"contains", d.contains}, {"message", d.message}});
  return {{"allowed_models", p.allowed_models}, {"max_tokens", p.max_tokens}, {"rewrites", p.rewrites}, {"deny", deny}};
}

Result<PolicyRules> PolicyFromObject(const json& o, std::string_view parent, bool strict) {
  if (!o.is_object()) return Bad(parent.empty() ? "policy" : parent, "must be an object");
  if (strict) KEEL_RETURN_IF_ERROR(RejectUnknown(o, parent, {"allowed_models", "max_tokens", "rewrites", "deny"}));
  PolicyRules p;
  if (auto it = o.find("allowed_models"); it != o.end() && !it->is_null()) {
    const std::string path = Path(parent, "allowed_models");
    if (!it->is_array()) return Bad(path, "must be an array of strings");
    if (it->size() > kMaxPolicyEntries) return Bad(path, fmt::format("more than {} entries", kMaxPolicyEntries));
    for (size_t i = 0; i < it->size(); ++i) {
      const json& m = (*it)[i];
      if (!m.is_string() || m.get_ref<const std::string&>().empty() || m.get_ref<const std::string&>().size() > 256) {
        return Bad(fmt::format("{}[{}]", path, i), "must be a non-empty string of at most 256 bytes");
      }
      p.allowed_models.push_back(m.get<std::string>());
    }
  }
  KEEL_RETURN_IF_ERROR(ReadInt(o, parent, "max_tokens", false, -1, &p.max_tokens));
  if (auto it = o.find("rewrites"); it != o.end() && !it->is_null()) {
    const std::string path = Path(parent, "rewrites");
    if (!it->is_object()) return Bad(path, "must be an object {\"from\": \"to\"}");
    if (it->size() > kMaxPolicyEntries) return Bad(path, fmt::format("more than {} entries", kMaxPolicyEntries));
    for (auto r = it->begin(); r != it->end(); ++r) {
      if (!r->is_string() || r->get_ref<const std::string&>().empty() || r.key().empty()) {
        return Bad(Path(path, r.key()), "must map a model name to a non-empty model name");
      }
      p.rewrites[r.key()] = r->get<std::string>();
    }
  }
  if (auto it = o.find("deny"); it != o.end() && !it->is_null()) {
    const std::string path = Path(parent, "deny");
    if (!it->is_array()) return Bad(path, "must be an array of objects");
    if (it->size() > kMaxPolicyEntries) return Bad(path, fmt::format("more than {} entries", kMaxPolicyEntries));
    for (size_t i = 0; i < it->size(); ++i) {
      const std::string at = fmt::format("{}[{}]", path, i);
      const json& d = (*it)[i];
      if (!d.is_object()) return Bad(at, "must be an object");
      if (strict) KEEL_RETURN_IF_ERROR(RejectUnknown(d, at, {"model", "contains", "message"}));
      DenyRule rule;
      KEEL_RETURN_IF_ERROR(ReadString(d, at, "model", false, &rule.model_glob));
      KEEL_RETURN_IF_ERROR(ReadString(d, at, "contains", false, &rule.contains));
      KEEL_RETURN_IF_ERROR(ReadString(d, at, "message", false, &rule.message));
      p.deny.push_back(std::move(rule));
    }
  }
  return p;
}

void FillRandom(unsigned char* out, size_t n) {
  if (RAND_bytes(out, static_cast<int>(n)) == 1) return;
  size_t got = 0;  // OpenSSL's pool failed: ask the kernel directly
  while (got < n) {
    ssize_t r = ::getrandom(out + got, n - got, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) std::abort();  // never hand out a key that is not random
    got += static_cast<size_t>(r);
  }
}

}  // namespace

std::string HashApiKey(std::string_view api_key) {
  // Fetched once: EVP_sha256() makes OpenSSL 3 look the implementation up in its provider
  // tables on every digest, a few microseconds per request on the gateway's hot path.
  static EVP_MD* const sha256 = EVP_MD_fetch(nullptr, "SHA256", nullptr);
  if (sha256 == nullptr) std::abort();
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (EVP_Digest(api_key.data(), api_key.size(), digest, &len, sha256, nullptr) != 1) std::abort();
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out(len * 2, '0');
  for (unsigned int i = 0; i < len; ++i) {
    out[2 * i] = kHex[digest[i] >> 4];
    out[2 * i + 1] = kHex[digest[i] & 15];
  }
  return out;
}

std::string NewApiKey() {
  static constexpr char kB64Url[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
  unsigned char raw[33] = {0};  // 32 random bytes, one zero pad byte for the last group
  FillRandom(raw, 32);
  std::string out = "sk-keel-";
  for (int i = 0; i < 33; i += 3) {
    uint32_t v = (uint32_t{raw[i]} << 16) | (uint32_t{raw[i + 1]} << 8) | raw[i + 2];
    for (int k = 3; k >= 0; --k) out += kB64Url[(v >> (6 * k)) & 63];
  }
  out.resize(8 + 43);  // 256 bits = 42 full characters + 4 bits in the 43rd
  return out;
}

bool IsKeyHash(std::string_view text) {
  if (text.size() != 64) return false;
  for (char c : text) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

std::string ToJson(const PolicyRules& rules) { return Dump(PolicyObject(rules)); }

Result<PolicyRules> PolicyRulesFromJson(std::string_view text) {
  KEEL_ASSIGN_OR_RETURN(json o, ParseObject(text, "policy"));
  return PolicyFromObject(o, "", /*strict=*/true);
}

std::string ToJson(const KeyDecision& d) {
  json budgets = json::array();
  for (const BudgetState& b : d.budgets) {
    budgets.push_back({{"budget_id", b.budget_id}, {"scope", b.scope}, {"subject", b.subject}, {"window", b.window},
                       {"limit_tokens", b.limit_tokens}, {"limit_cost", b.limit_cost}, {"spent_tokens", b.spent_tokens},
                       {"spent_cost", b.spent_cost}, {"window_end_unix", b.window_end_unix}});
  }
  json prices = json::object();
  for (const auto& [model, p] : d.prices) {
    prices[model] = {{"input_per_mtok", p.input_per_mtok}, {"output_per_mtok", p.output_per_mtok}};
  }
  json j = {{"known", d.known},   {"revoked", d.revoked},  {"key_id", d.key_id},
            {"principal", d.principal}, {"team", d.team}, {"policy", PolicyObject(d.policy)},
            {"budgets", budgets}, {"prices", prices},     {"ttl_ms", d.ttl_ms}};
  return Dump(j);
}

Result<KeyDecision> KeyDecisionFromJson(std::string_view text) {
  KEEL_ASSIGN_OR_RETURN(json o, ParseObject(text, "decision"));
  KeyDecision d;
  if (!o.contains("known")) return Bad("known", "required");
  KEEL_RETURN_IF_ERROR(ReadBool(o, "", "known", &d.known));
  KEEL_RETURN_IF_ERROR(ReadBool(o, "", "revoked", &d.revoked));
  KEEL_RETURN_IF_ERROR(ReadString(o, "", "key_id", false, &d.key_id));
  KEEL_RETURN_IF_ERROR(ReadString(o, "", "principal", false, &d.principal));
  KEEL_RETURN_IF_ERROR(ReadString(o, "", "team", false, &d.team));
  KEEL_RETURN_IF_ERROR(ReadInt(o, "", "ttl_ms", false, 0, &d.ttl_ms));
  if (auto it = o.find("policy"); it != o.end() && !it->is_null()) {
    KEEL_ASSIGN_OR_RETURN(d.policy, PolicyFromObject(*it, "policy", /*strict=*/false));
  }
  if (auto it = o.find("budgets"); it != o.end() && !it->is_null()) {
    if (!it->is_array()) return Bad("budgets", "must be an array");
    for (size_t i = 0; i < it->size(); ++i) {
      const std::string at = fmt::format("budgets[{}]", i);
      const json& b = (*it)[i];
      if (!b.is_object()) return Bad(at, "must be an object");
      BudgetState s;
      KEEL_RETURN_IF_ERROR(ReadString(b, at, "budget_id", true, &s.budget_id));
      KEEL_RETURN_IF_ERROR(ReadString(b, at, "scope", true, &s.scope));
      if (s.scope != "key" && s.scope != "team") return Bad(Path(at, "scope"), "must be \"key\" or \"team\"");
      KEEL_RETURN_IF_ERROR(ReadString(b, at, "subject", true, &s.subject));
      KEEL_RETURN_IF_ERROR(ReadString(b, at, "window", true, &s.window));
      if (s.window != "daily" && s.window != "monthly") return Bad(Path(at, "window"), "must be \"daily\" or \"monthly\"");
      KEEL_RETURN_IF_ERROR(ReadInt(b, at, "limit_tokens", false, -1, &s.limit_tokens));
      KEEL_RETURN_IF_ERROR(ReadNumber(b, at, "limit_cost", false, -1, &s.limit_cost));
      KEEL_RETURN_IF_ERROR(ReadInt(b, at, "spent_tokens", false, 0, &s.spent_tokens));
      KEEL_RETURN_IF_ERROR(ReadNumber(b, at, "spent_cost", false, 0, &s.spent_cost));
      KEEL_RETURN_IF_ERROR(ReadInt(b, at, "window_end_unix", false, 0, &s.window_end_unix));
      d.budgets.push_back(std::move(s));
    }
  }
  if (auto it = o.find("prices"); it != o.end() && !it->is_null()) {
    if (!it->is_object()) return Bad("prices", "must be an object {model: {input_per_mtok, output_per_mtok}}");
    for (auto p = it->begin(); p != it->end(); ++p) {
      const std::string at = Path("prices", p.key());
      if (!p->is_object()) return Bad(at, "must be an object");
      Price price;
      KEEL_RETURN_IF_ERROR(ReadNumber(*p, at, "input_per_mtok", true, 0, &price.input_per_mtok));
      KEEL_RETURN_IF_ERROR(ReadNumber(*p, at, "output_per_mtok", true, 0, &price.output_per_mtok));
      d.prices[p.key()] = price;
    }
  }
  return d;
}

std::string UsageBatchToJson(const std::vector<UsageRecord>& records) {
  // Written directly: the gateway sends a batch every usage_flush_s from its io thread, and a DOM
  // per record made each flush a pause of ~6 µs per record for the requests waiting behind it.
  std::string out;
  out.reserve(32 + records.size() * 160);
  out += "{\"records\":[";
  for (size_t i = 0; i < records.size(); ++i) {
    const UsageRecord& r = records[i];
    if (i > 0) out += ',';
    out += "{\"cost\":";
    AppendJsonNumber(r.cost, &out);
    out += ",\"input_tokens\":";
    AppendJsonNumber(r.input_tokens, &out);
    out += ",\"key_id\":";
    AppendJsonString(r.key_id, &out);
    out += ",\"model\":";
    AppendJsonString(r.model, &out);
    out += ",\"output_tokens\":";
    AppendJsonNumber(r.output_tokens, &out);
    out += ",\"request_id\":";
    AppendJsonString(r.request_id, &out);
    out += ",\"team\":";
    AppendJsonString(r.team, &out);
    out += ",\"unix_ms\":";
    AppendJsonNumber(r.unix_ms, &out);
    out += '}';
  }
  out += "]}";
  return out;
}

Result<std::vector<UsageRecord>> UsageBatchFromJson(std::string_view text) {
  KEEL_ASSIGN_OR_RETURN(json o, ParseObject(text, "usage"));
  auto it = o.find("records");
  if (it == o.end()) return Bad("records", "required");
  if (!it->is_array()) return Bad("records", "must be an array");
  if (it->size() > kMaxUsageBatch) return Bad("records", fmt::format("more than {} records in one batch", kMaxUsageBatch));
  std::vector<UsageRecord> out;
  out.reserve(it->size());
  for (size_t i = 0; i < it->size(); ++i) {
    const std::string at = fmt::format("records[{}]", i);
    const json& r = (*it)[i];
    if (!r.is_object()) return Bad(at, "must be an object");
    UsageRecord u;
    KEEL_RETURN_IF_ERROR(ReadString(r, at, "request_id", true, &u.request_id));
    if (u.request_id.empty() || u.request_id.size() > 256) return Bad(Path(at, "request_id"), "must have 1..256 bytes");
    KEEL_RETURN_IF_ERROR(ReadString(r, at, "key_id", true, &u.key_id));
    if (u.key_id.empty()) return Bad(Path(at, "key_id"), "must not be empty");
    KEEL_RETURN_IF_ERROR(ReadString(r, at, "team", false, &u.team));
    KEEL_RETURN_IF_ERROR(ReadString(r, at, "model", true, &u.model));
    KEEL_RETURN_IF_ERROR(ReadInt(r, at, "input_tokens", true, 0, &u.input_tokens));
    KEEL_RETURN_IF_ERROR(ReadInt(r, at, "output_tokens", true, 0, &u.output_tokens));
    // Bounds that keep sums far from overflow: 2^40 tokens and $1e9 per request.
    if (u.input_tokens > (int64_t{1} << 40) || u.output_tokens > (int64_t{1} << 40)) {
      return Bad(at, "token counts above 2^40");
    }
    KEEL_RETURN_IF_ERROR(ReadNumber(r, at, "cost", false, 0, &u.cost));
    if (u.cost > 1e9) return Bad(Path(at, "cost"), "above 1e9");
    KEEL_RETURN_IF_ERROR(ReadInt(r, at, "unix_ms", false, 0, &u.unix_ms));
    out.push_back(std::move(u));
  }
  return out;
}

double CostOf(const std::map<std::string, Price>& prices, const std::string& model, int64_t input_tokens,
              int64_t output_tokens) {
  auto it = prices.find(model);
  if (it == prices.end()) return 0;
  return (static_cast<double>(input_tokens) * it->second.input_per_mtok +
          static_cast<double>(output_tokens) * it->second.output_per_mtok) / 1e6;
}

bool GlobMatch(std::string_view pattern, std::string_view text) {
  // Greedy match with one backtrack point (the last '*'): linear-ish, no recursion.
  size_t p = 0, t = 0, star = std::string_view::npos, mark = 0;
  while (t < text.size()) {
    if (p < pattern.size() && (pattern[p] == '?' || pattern[p] == text[t])) {
      ++p;
      ++t;
    } else if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      mark = t;
    } else if (star != std::string_view::npos) {
      p = star + 1;
      t = ++mark;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

}  // namespace keel::gateway
