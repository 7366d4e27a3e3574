// The API routes besides chat: embeddings, model lists (OpenAI, Anthropic and Gemini shapes)
// and token counting (Anthropic's count_tokens, Gemini's countTokens). Each reuses the chat
// chain's filters it needs, so auth, policy and budgets behave the same everywhere.
#include <algorithm>

#include <nlohmann/json.hpp>

#include "keel/core/json_reader.h"
#include "keel/gateway/gateway_internal.h"
#include "keel/gateway/vendors/gemini/gemini_front.h"
#include "keel/gateway/policy.h"
#include "keel/gateway/translate.h"

namespace keel::gateway {
namespace {

using nlohmann::json;

// Virtual models carry no creation date; Anthropic's shape requires one (RFC 3339).
constexpr const char* kEpoch = "1970-01-01T00:00:00Z";

json OpenAIModel(const std::string& name) {
  return {{"id", name}, {"object", "model"}, {"created", 0}, {"owned_by", "keel-gateway"}};
}
json AnthropicModel(const std::string& name) {
  return {{"type", "model"}, {"id", name}, {"display_name", name}, {"created_at", kEpoch}};
}
json GeminiModel(const std::string& name) {
  return {{"name", "models/" + name},
          {"version", "1"},
          {"displayName", name},
          {"description", "keel gateway virtual model"},
          {"supportedGenerationMethods", json::array({"generateContent", "streamGenerateContent", "countTokens"})}};
}

std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

}  // namespace

bool Gateway::Impl::ModelExists(const std::string& name) const {
  return models.count(name) > 0 || hilo_routes.count(name) > 0;
}

std::vector<std::string> Gateway::Impl::ModelNames() const {
  std::vector<std::string> names;
  names.reserve(models.size() + hilo_routes.size());
  for (const auto& [name, vm] : models) names.push_back(name);
  for (const auto& [name, routes] : hilo_routes) names.push_back(name);
  std::sort(names.begin(), names.end());  // one sorted list, as before (config rejects overlaps)
  return names;
}

Task<void> Gateway::Impl::HandleModels(Exchange& x, std::string_view id) {
  if (const bool go = co_await Authenticate(x); !go) co_return;
  const KeyDecision& decision = *x.auth.decision;
  const bool anthropic = x.front.format() == WireFormat::kAnthropicMessages;
  std::string body;
  if (!id.empty()) {
    const std::string name(id);
    if (!ModelExists(name) || !ModelAllowed(decision.policy, name)) {
      const GatewayError e{404, ErrorKind::kNotFound, "model \"" + name + "\" does not exist"};
      co_await Fail(x, e);
      co_return;
    }
    body = Dump(anthropic ? AnthropicModel(name) : OpenAIModel(name));
  } else {
    json data = json::array();
    for (const std::string& name : ModelNames()) {
      if (ModelAllowed(decision.policy, name)) data.push_back(anthropic ? AnthropicModel(name) : OpenAIModel(name));
    }
    json list;
    if (anthropic) {
      // One page holds every model: has_more false, and the ids a client pages from.
      const json first = data.empty() ? json(nullptr) : data.front()["id"];
      const json last = data.empty() ? json(nullptr) : data.back()["id"];
      list = {{"data", std::move(data)}, {"has_more", false}, {"first_id", first}, {"last_id", last}};
    } else {
      list = {{"object", "list"}, {"data", std::move(data)}};
    }
    body = Dump(list);
  }
  requests->WithLabels({x.route, "200"}).Inc();
  co_await x.resp.Send(200, "application/json", std::move(body), x.headers);
}

Task<void> Gateway::Impl::HandleGeminiModels(Exchange& x, std::string_view id) {
  if (const bool go = co_await Authenticate(x); !go) co_return;
  const KeyDecision& decision = *x.auth.decision;
  std::string body;
  if (!id.empty()) {
    const std::string name(id);
    if (!ModelExists(name) || !ModelAllowed(decision.policy, name)) {
      const GatewayError e{404, ErrorKind::kNotFound, "models/" + name + " is not found"};
      co_await Fail(x, e);
      co_return;
    }
    body = Dump(GeminiModel(name));
  } else {
    json list = json::array();
    for (const std::string& name : ModelNames()) {
      if (ModelAllowed(decision.policy, name)) list.push_back(GeminiModel(name));
    }
    body = Dump(json{{"models", std::move(list)}});
  }
  requests->WithLabels({x.route, "200"}).Inc();
  co_await x.resp.Send(200, "application/json", std::move(body), x.headers);
}

Task<void> Gateway::Impl::HandleCountTokens(Exchange& x) {
  if (const bool go = co_await Authenticate(x); !go) co_return;
  const bool gemini = x.front.format() == WireFormat::kGemini;
  Result<ChatRequest> parsed = Status::InvalidArgument("request body: unread");
  if (gemini) {
    parsed = ParseGeminiCountTokensRequest(x.http.body, x.path_model);
  } else {
    // count_tokens takes a messages request without max_tokens; the parser requires one.
    JsonReadError why = JsonReadError::kNone;
    Result<json> object = ParseUntrustedJson(x.http.body, JsonLimits{.max_depth = 128, .require_object = true}, &why);
    if (object.ok()) {
      if (!object->contains("max_tokens")) (*object)["max_tokens"] = 1;
      parsed = FrontFor(WireFormat::kAnthropicMessages).Parse(Dump(*object), "", false);
    } else {
      parsed = Status::InvalidArgument("request body: " + object.status().message());
    }
  }
  if (!parsed.ok()) {
    const GatewayError e{400, ErrorKind::kInvalidRequest, parsed.status().message()};
    co_await Fail(x, e);
    co_return;
  }
  x.request = std::move(parsed).value();
  x.client_model = x.request.model;
  if (const bool go = co_await ApplyPolicy(x); !go) co_return;
  if (hilo) ApplyHilo(x);  // a tiered name routes here as it does for chat
  if (const bool go = co_await Route(x); !go) co_return;
  const int64_t n = CountRequestTokens(*x.counter, x.request);
  std::string answer = gemini ? BuildGeminiCountTokensResponse(n) : Dump(json{{"input_tokens", n}});
  requests->WithLabels({x.route, "200"}).Inc();
  co_await x.resp.Send(200, "application/json", std::move(answer), x.headers);
}

Task<void> Gateway::Impl::HandleEmbeddings(Exchange& x) {
  if (const bool go = co_await Authenticate(x); !go) co_return;
  const KeyDecision& decision = *x.auth.decision;
  JsonReadError why = JsonReadError::kNone;
  Result<json> parsed = ParseUntrustedJson(x.http.body, JsonLimits{.require_object = true}, &why);
  if (!parsed.ok()) {
    const bool limit = why == JsonReadError::kTooDeep || why == JsonReadError::kTooManyValues ||
                       why == JsonReadError::kNumberOutOfRange;
    const GatewayError e{400, ErrorKind::kInvalidRequest,
                         limit ? "request body: " + parsed.status().message() : "request body is not a JSON object"};
    co_await Fail(x, e);
    co_return;
  }
  json body = std::move(parsed).value();
  if (!body.contains("model") || !body["model"].is_string()) {
    const GatewayError e{400, ErrorKind::kInvalidRequest, "model: expected a string"};
    co_await Fail(x, e);
    co_return;
  }
  if (!body.contains("input") || !(body["input"].is_string() || body["input"].is_array())) {
    const GatewayError e{400, ErrorKind::kInvalidRequest, "input: expected a string or an array"};
    co_await Fail(x, e);
    co_return;
  }
  x.client_model = body["model"].get<std::string>();
  // The deny rules read the text to be embedded, as they read a chat's prompt.
  if (body["input"].is_string()) {
    x.request.prompt = body["input"].get<std::string>();
  } else {
    for (const json& item : body["input"]) {
      if (!item.is_string()) continue;  // pre-tokenized input carries no text to match
      x.request.prompt += item.get<std::string>();
      x.request.prompt += '\n';
    }
  }
  if (const bool go = co_await ApplyPolicy(x); !go) co_return;
  if (hilo) ApplyHilo(x);  // a tiered name routes here as it does for chat
  if (const bool go = co_await Route(x); !go) co_return;
  int64_t input_tokens = 0;
  if (body["input"].is_string()) {
    input_tokens = x.counter->Count(body["input"].get<std::string>());
  } else {
    for (const json& item : body["input"]) {
      if (item.is_string()) input_tokens += x.counter->Count(item.get<std::string>());
      else if (item.is_array()) input_tokens += static_cast<int64_t>(item.size());  // pre-tokenized input
    }
  }
  const double reserve_cost = CostOf(decision.prices, x.vm->targets.front().model, input_tokens, 0);
  if (const bool reserved = co_await ReserveBudget(x, input_tokens, reserve_cost); !reserved) co_return;
  GatewayError last_error{400, ErrorKind::kInvalidRequest,
                          "no upstream of model \"" + x.model + "\" serves embeddings"};
  for (const RouteTarget& target : x.vm->targets) {
    Upstream& up = upstreams.at(target.upstream);
    body["model"] = target.model;
    auto request = up.vendor->BuildEmbeddings(up.config, body.dump());
    if (!request.ok()) continue;  // this vendor has no embeddings endpoint
    auto got = co_await up.client->FetchWhile(std::move(request).value(), [&x] { return !x.resp.ClientGone(); });
    if (!got.ok() && got.status().code() == StatusCode::kCancelled) {
      upstream_requests->WithLabels({up.config.name, "abandoned"}).Inc();
      Settle(x, target, input_tokens, 0, "499");
      co_return;
    }
    if (!got.ok()) {
      last_error = {504, ErrorKind::kTimeout, "upstream " + up.config.name + ": " + got.status().message()};
      continue;
    }
    if (got->status != 200) {
      last_error = ClientFacingError(up, got->status, got->body, got->headers);
      if (Retryable(got->status)) continue;
      break;
    }
    // Upstream answers are larger than requests (thousands of vectors) but still bounded.
    Result<json> answer_or =
        ParseUntrustedJson(got->body, JsonLimits{.max_values = size_t{16} << 20, .require_object = true});
    if (!answer_or.ok()) {
      last_error = {502, ErrorKind::kBadGateway, "upstream " + up.config.name + " sent an unreadable answer"};
      continue;
    }
    json answer = std::move(answer_or).value();
    int64_t in = input_tokens;
    if (answer.contains("usage") && answer["usage"].is_object() && answer["usage"].contains("prompt_tokens") &&
        answer["usage"]["prompt_tokens"].is_number_integer()) {
      in = answer["usage"]["prompt_tokens"].get<int64_t>();
    }
    answer["model"] = x.vm->name;  // the name the client asked for, as for chat
    Settle(x, target, in, 0);
    std::string answer_body = answer.dump();
    co_await x.resp.Send(200, "application/json", std::move(answer_body), x.headers);
    co_return;
  }
  governance->Release(x.reservation);
  co_await Fail(x, last_error);
}

}  // namespace keel::gateway
