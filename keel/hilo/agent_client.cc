#include "keel/hilo/agent_client.h"

#include <chrono>
#include <memory>

#include <nlohmann/json.hpp>

#include "keel/core/json_reader.h"
#include "keel/core/log.h"
#include "keel/hilo/json_fields.h"

namespace keel::hilo {
namespace {

int64_t SystemNowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

struct StateReply {
  int64_t version = 0;
  std::string state;
  std::string epoch;  // the controller instance; empty from a controller that sends none
};

// Reads the two members the agent needs from GET /v1/state's answer; the rest is for people.
Result<StateReply> ParseStateReply(std::string_view body) {
  JsonLimits limits;
  limits.max_depth = 8;
  limits.max_values = 4096;
  limits.require_object = true;
  KEEL_ASSIGN_OR_RETURN(nlohmann::json doc, ParseUntrustedJson(body, limits));
  StateReply out;
  const auto v = doc.find("version");
  const auto s = doc.find("state");
  if (v == doc.end() || !v->is_number_integer() || v->get<int64_t>() < 0) {
    return Status::InvalidArgument("state reply: version: expected a non-negative integer");
  }
  if (s == doc.end() || !s->is_string() || !internal::IsValidName(s->get<std::string>())) {
    return Status::InvalidArgument("state reply: state: expected a state name");
  }
  out.version = v->get<int64_t>();
  out.state = s->get<std::string>();
  if (const auto e = doc.find("epoch"); e != doc.end() && !e->is_null()) {
    if (!e->is_string() || e->get<std::string>().size() > 64) {
      return Status::InvalidArgument("state reply: epoch: expected a string of at most 64 bytes");
    }
    out.epoch = e->get<std::string>();
  }
  return out;
}

}  // namespace

ControllerCall HttpControllerCall(const HttpEndpoint& endpoint, HttpClientOptions options) {
  auto client = std::make_shared<HttpClient>(endpoint, options);
  return [client](std::string_view method, std::string_view target, std::string_view body,
                  std::string_view content_type, Deadline deadline) -> Result<ControllerReply> {
    KEEL_ASSIGN_OR_RETURN(HttpReply r, client->Call(method, target, body, content_type, deadline));
    return ControllerReply{r.status, std::move(r.body)};
  };
}

Result<ControllerCall> HttpControllerCallForUrl(std::string_view url, HttpClientOptions options) {
  KEEL_ASSIGN_OR_RETURN(HttpEndpoint endpoint, ParseHttpUrl(url));
  return HttpControllerCall(endpoint, options);
}

Result<std::unique_ptr<AgentClient>> AgentClient::Create(Catalog catalog, ControllerCall call,
                                                         AgentClientOptions options) {
  if (!call) return Status::InvalidArgument("agent client: no controller call");
  if (options.wait_ms < 0 || options.slack_ms < 1 || options.retry_ms < 1 || options.report_timeout_ms < 1) {
    return Status::InvalidArgument("agent client: wait_ms >= 0 and slack_ms, retry_ms, report_timeout_ms >= 1");
  }
  if (!options.service.empty() && !ServiceFromName(options.service)) {
    return Status::InvalidArgument("agent client: service '" + options.service.substr(0, 64) +
                                   "' is not one of answer, vector, engine, gateway");
  }
  if (!options.clock) options.clock = SystemNowMs;
  KEEL_ASSIGN_OR_RETURN(StateAgent agent, StateAgent::Create(std::move(catalog), options.agent));
  return std::unique_ptr<AgentClient>(new AgentClient(std::move(agent), std::move(call), std::move(options)));
}

AgentClient::~AgentClient() { Stop(); }

Status AgentClient::Start() {
  std::lock_guard<std::mutex> lock(mu_);
  if (thread_.joinable() || stopping_) return Status::Internal("agent client already started");
  thread_ = std::thread([this] { Loop(); });
  return Status::Ok();
}

void AgentClient::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  stop_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

StateAgent::View AgentClient::Current(int64_t now_ms) const {
  std::lock_guard<std::mutex> lock(mu_);
  return agent_.Current(now_ms);
}

int64_t AgentClient::version() const {
  std::lock_guard<std::mutex> lock(mu_);
  return agent_.version();
}

Status AgentClient::PollOnce() {
  int64_t known = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    known = agent_.version();
  }
  std::string target = "/v1/state?version=" + std::to_string(known) + "&wait_ms=" + std::to_string(opt_.wait_ms);
  if (!opt_.service.empty()) target += "&service=" + opt_.service;  // a checked name: nothing to escape
  KEEL_ASSIGN_OR_RETURN(ControllerReply reply, call_("GET", target, "", "", DeadlineIn(opt_.wait_ms + opt_.slack_ms)));
  if (reply.status != 200) {
    return Status::Unavailable("controller answered " + std::to_string(reply.status) + " to GET /v1/state");
  }
  KEEL_ASSIGN_OR_RETURN(StateReply s, ParseStateReply(reply.body));
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!s.epoch.empty() && s.epoch != epoch_) {
      // A restarted controller may number below the old one (its clock stepped back): without
      // this its versions were ignored, and the service sat in its safe state until they passed.
      if (!epoch_.empty()) Log().info("hilo agent: a new controller instance (epoch {}); taking its versions", s.epoch);
      agent_.ForgetVersion();
      epoch_ = s.epoch;
    }
    auto taken = agent_.Push(s.version, s.state, opt_.clock());
    if (!taken.ok()) return taken.status();
    if (*taken) Log().info("hilo agent: state '{}' (version {})", s.state, s.version);
  }
  // Outside mu_: the callback reads Current(). Also on a same-version heartbeat, which can end a
  // hold or a fallback (the agent follows the pushed state again).
  if (opt_.on_push) opt_.on_push();
  return Status::Ok();
}

void AgentClient::Loop() {
  bool failing = false;
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    const int64_t version_before = agent_.version();
    const auto started = std::chrono::steady_clock::now();
    lock.unlock();
    Status s = PollOnce();
    lock.lock();
    if (s.ok()) {
      ++polls_ok_;
      if (failing) Log().info("hilo agent: controller reachable again");
      failing = false;
      // A poll that came back early with nothing new (a controller out of waiting slots, or one
      // whose versions went back) must not turn into a tight loop against it.
      if (agent_.version() == version_before &&
          std::chrono::steady_clock::now() - started < std::chrono::milliseconds(opt_.retry_ms)) {
        stop_cv_.wait_for(lock, std::chrono::milliseconds(opt_.retry_ms), [this] { return stopping_; });
      }
      continue;
    }
    ++poll_errors_;
    // One line per failure streak: a lost controller must not flood the log every retry_ms.
    if (!failing) Log().warn("hilo agent: polling the controller failed (holding the last state): {}", s.message());
    failing = true;
    stop_cv_.wait_for(lock, std::chrono::milliseconds(opt_.retry_ms), [this] { return stopping_; });
  }
}

Status AgentClient::Report(const LoadReport& r) {
  auto reply = call_("POST", "/v1/report", WriteLoadReport(r), "application/json", DeadlineIn(opt_.report_timeout_ms));
  Status s;
  if (!reply.ok()) {
    s = reply.status();
  } else if (reply->status == 400 || reply->status == 409) {  // 409: binaries the catalog does not cover
    s = Status::InvalidArgument("controller refused the report: " + reply->body);
  } else if (reply->status != 200) {
    s = Status::Unavailable("controller answered " + std::to_string(reply->status) + " to POST /v1/report");
  }
  if (!s.ok()) {
    if (!report_failing_.exchange(true)) Log().warn("hilo agent: report failed: {}", s.message());
  } else if (report_failing_.exchange(false)) {
    Log().info("hilo agent: reports accepted again");
  }
  return s;
}

}  // namespace keel::hilo
