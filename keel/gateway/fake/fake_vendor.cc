// FakeVendor: the server, request routing to the vendor files, the reply plan, pacing and the
// test endpoints. The vendor wire formats live in fake_vendor_{openai,anthropic,gemini}.cc.
#include "keel/gateway/fake_vendor.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <thread>

#include "keel/core/log.h"
#include "keel/core/signal.h"
#include "keel/core/socket.h"
#include "keel/gateway/fake_vendor_internal.h"

namespace keel::gateway {

using fake::Json;

const char* FakeVendorKindName(FakeVendorKind kind) {
  switch (kind) {
    case FakeVendorKind::kOpenAI: return "openai";
    case FakeVendorKind::kAnthropic: return "anthropic";
    case FakeVendorKind::kGemini: return "gemini";
  }
  return "?";
}

Result<FakeVendorKind> ParseFakeVendorKind(std::string_view name) {
  if (name == "openai") return FakeVendorKind::kOpenAI;
  if (name == "anthropic") return FakeVendorKind::kAnthropic;
  if (name == "gemini") return FakeVendorKind::kGemini;
  return Status::InvalidArgument("unknown fake vendor kind '" + std::string(name) + "' (openai, anthropic, gemini)");
}

namespace fake {

std::string Dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

int64_t UnixNow() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

const Json* Member(const Json& obj, const char* name) {
  if (!obj.is_object()) return nullptr;
  auto it = obj.find(name);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}
const Json* StringMember(const Json& obj, const char* name) {
  const Json* m = Member(obj, name);
  return m && m->is_string() ? m : nullptr;
}
const Json* ArrayMember(const Json& obj, const char* name) {
  const Json* m = Member(obj, name);
  return m && m->is_array() ? m : nullptr;
}
const Json* ObjectMember(const Json& obj, const char* name) {
  const Json* m = Member(obj, name);
  return m && m->is_object() ? m : nullptr;
}

Switches ParseSwitches(std::string_view model) {
  std::string m(model);
  std::transform(m.begin(), m.end(), m.begin(), [](unsigned char c) { return std::tolower(c); });
  auto has = [&](std::string_view s) { return m.find(s) != std::string::npos; };
  Switches sw;
  if (has("error-429")) {
    sw.error_status = 429;
  } else if (has("error-500")) {
    sw.error_status = 500;
  } else if (has("error-503") || has("overloaded")) {
    sw.error_status = 503;
  }
  sw.garbage = has("garbage");
  sw.truncate = has("truncate");
  sw.slow = has("slow");
  sw.tools = has("tools");
  return sw;
}

std::string Plan::Text() const {
  std::string s;
  for (const auto& p : pieces) s += p;
  return s;
}

namespace {

int LocalPort(const sockaddr_storage& ss) {
  if (ss.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in&>(ss).sin_port);
  if (ss.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6&>(ss).sin6_port);
  return -1;
}

std::vector<std::string> SplitWords(std::string_view text, size_t max_words) {
  std::vector<std::string> words;
  size_t i = 0;
  while (i < text.size() && words.size() < max_words) {
    while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
    size_t j = i;
    while (j < text.size() && !std::isspace(static_cast<unsigned char>(text[j]))) ++j;
    if (j > i) words.emplace_back(text.substr(i, j - i));
    i = j;
  }
  return words;
}

// Shortens `pieces` so that they join to their first n bytes (empty pieces dropped).
void TrimPieces(std::vector<std::string>& pieces, size_t n) {
  size_t total = 0;
  for (size_t k = 0; k < pieces.size(); ++k) {
    if (total + pieces[k].size() >= n) {
      pieces[k].resize(n - total);
      pieces.resize(pieces[k].empty() ? k : k + 1);
      return;
    }
    total += pieces[k].size();
  }
}

}  // namespace

std::vector<std::string> ReplyWords(std::string_view last_user_text, size_t n) {
  std::vector<std::string> words = SplitWords(last_user_text, n);
  for (size_t i = words.size(); i < n; ++i) words.push_back("w" + std::to_string(i));
  return words;
}

// The pieces of the full answer, before max_tokens and stop sequences cut it.
std::vector<std::string> AnswerPieces(const Prompt& p, int reply_tokens) {
  const size_t n = reply_tokens > 0 ? static_cast<size_t>(reply_tokens) : 0;
  std::vector<std::string> words = ReplyWords(p.last_user_text, n);
  if (p.enum_answer) {
    const Json* values = ArrayMember(p.schema, "enum");
    if (values && !values->empty() && values->front().is_string()) return {values->front().get<std::string>()};
  }
  if (p.json_answer) return JsonPieces(Dump(SchemaInstance(p.schema, words)));
  std::vector<std::string> pieces;
  for (size_t i = 0; i < words.size(); ++i) pieces.push_back((i ? " " : "") + words[i]);
  return pieces;
}

Plan MakePlan(const Prompt& p, const Switches& sw, int reply_tokens) {
  Plan plan;
  plan.input_tokens = EstimateTokens(p.text_bytes);
  if (sw.tools && !p.tools.empty() && !p.tool_choice_none && !p.last_is_tool_result) {
    plan.finish = Finish::kToolCall;
    plan.tool_name = p.tools.front();
    plan.tool_arguments = R"({"x":1})";
    plan.tool_argument_pieces = {R"({"x":)", "1}"};
    plan.output_tokens = EstimateTokens(plan.tool_name.size() + plan.tool_arguments.size());
    return plan;
  }
  std::string text;
  for (std::string& piece : AnswerPieces(p, reply_tokens)) {
    if (p.max_tokens && static_cast<int64_t>(plan.pieces.size()) >= *p.max_tokens) {
      plan.finish = Finish::kLength;
      break;
    }
    const size_t before = text.size();
    text += piece;
    plan.pieces.push_back(std::move(piece));
    // Only a match that ends inside the new piece is new; the earliest one wins.
    size_t best = std::string::npos;
    for (const auto& s : p.stop) {
      if (s.empty()) continue;
      size_t from = before >= s.size() - 1 ? before - (s.size() - 1) : 0;
      size_t pos = text.find(s, from);
      if (pos < best) {
        best = pos;
        plan.stop_sequence = s;
      }
    }
    if (best != std::string::npos) {
      TrimPieces(plan.pieces, best);
      plan.finish = Finish::kStopSequence;
      break;
    }
  }
  plan.output_tokens = static_cast<int64_t>(plan.pieces.size());
  return plan;
}

// ---- Exchange ----------------------------------------------------------------------------------

Exchange::Exchange(FakeVendor::Impl& i, const HttpRequest& rq, HttpResponder& rs)
    : impl(i), req(rq), res(rs), arrival_(std::chrono::steady_clock::now()), start_(arrival_) {
  ++impl.active;
}

Exchange::~Exchange() {
  if (res.status() >= 400) ++impl.errors;
  --impl.active;
}

void Exchange::Cancel() {
  if (!cancelled_) ++impl.cancelled;
  cancelled_ = true;
}

bool Exchange::SleepMs(double ms) {
  auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(static_cast<int64_t>(ms * 1000));
  for (;;) {
    if (impl.stopping.load() || res.ClientGone()) {
      Cancel();
      return false;
    }
    auto now = std::chrono::steady_clock::now();
    if (now >= until) return true;
    std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(until - now, std::chrono::milliseconds(20)));
  }
}

bool Exchange::AwaitToken(size_t i) {
  const auto& o = impl.options;
  double due_ms = o.ttft_ms + (o.tokens_per_second > 0 ? 1000.0 * static_cast<double>(i) / o.tokens_per_second : 0);
  auto due = start_ + std::chrono::microseconds(static_cast<int64_t>(due_ms * 1000));
  auto now = std::chrono::steady_clock::now();
  if (due <= now) {
    if (cancelled_ || impl.stopping.load()) {
      Cancel();
      return false;
    }
    return true;
  }
  return SleepMs(std::chrono::duration<double, std::milli>(due - now).count());
}

bool Exchange::Send(int status, std::string_view content_type, std::string body, const HttpHeaderList& extra) {
  if (!res.Send(status, content_type, std::move(body), extra)) {
    Cancel();
    return false;
  }
  return true;
}

bool Exchange::Begin(std::string_view content_type, const HttpHeaderList& extra) {
  ++impl.streams;
  if (!res.BeginStream(200, content_type, extra)) {
    Cancel();
    return false;
  }
  return true;
}

bool Exchange::Write(std::string_view data) {
  if (cancelled_ || !res.WriteChunk(data)) {
    Cancel();
    return false;
  }
  return true;
}

void Exchange::Cut() {
  // HttpResponder cannot abort a response (a stream left open is ended cleanly for the
  // handler), so find this request's socket — local port ours, peer the request's remote — and
  // shut it down. The connection thread owns the fd and cannot close it while we run.
  const int port = impl.server ? impl.server->port() : 0;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd", ec)) {
    int fd = std::atoi(entry.path().filename().c_str());
    if (fd <= 2) continue;
    sockaddr_storage local{}, peer{};
    socklen_t ll = sizeof(local), pl = sizeof(peer);
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &ll) != 0) continue;
    if (::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &pl) != 0) continue;
    if (LocalPort(local) != port || PeerName(peer) != req.remote) continue;
    ::shutdown(fd, SHUT_RDWR);
    return;
  }
  Log().warn("fake-vendor: could not find the socket of {} to cut", req.remote);
}

}  // namespace fake

// ---- the server ----------------------------------------------------------------------------------

std::string FakeVendor::Impl::NewId(std::string_view prefix, size_t len) {
  static constexpr char kAlphabet[] = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
  uint64_t x = id_seed + 0x9E3779B97F4A7C15ull * (++id_counter);
  std::string id(prefix);
  for (size_t i = 0; i < len; ++i) {
    if (i % 8 == 0) {  // splitmix64 step
      x += 0x9E3779B97F4A7C15ull;
      uint64_t z = x;
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
      x = z ^ (z >> 31);
    }
    id += kAlphabet[(x >> ((i % 8) * 8)) % 62];
  }
  return id;
}

void FakeVendor::Impl::Record(const HttpRequest& req) {
  Json headers = Json::object();
  for (const auto& [name, value] : req.headers.fields()) {
    std::string key = name;
    std::transform(key.begin(), key.end(), key.begin(), [](unsigned char c) { return std::tolower(c); });
    if (!headers.contains(key)) headers[key] = value;
  }
  Json j = {{"method", req.method}, {"path", req.path}, {"query", req.query}, {"headers", std::move(headers)},
            {"body", req.body}};
  std::lock_guard<std::mutex> lock(last_mu);
  last_request = std::move(j);
}

void FakeVendor::Impl::Handle(const HttpRequest& req, HttpResponder& res) {
  if (req.path.rfind("/_fake/", 0) == 0) {
    if (req.path == "/_fake/stats") {
      Json j = {{"requests", requests.load()}, {"streams", streams.load()}, {"errors", errors.load()},
                {"cancelled", cancelled.load()}, {"output_tokens", output_tokens.load()}, {"active", active.load()}};
      res.Send(200, "application/json", fake::Dump(j));
    } else if (req.path == "/_fake/last_request") {
      std::lock_guard<std::mutex> lock(last_mu);
      if (last_request.is_null()) {
        res.Send(404, "application/json", R"({"error":"no request received yet"})");
      } else {
        res.Send(200, "application/json", fake::Dump(last_request));
      }
    } else {
      res.Send(404, "application/json", R"j({"error":"unknown /_fake/ endpoint (stats, last_request)"})j");
    }
    return;
  }
  ++requests;
  Record(req);
  fake::Exchange ex(*this, req, res);
  switch (options.kind) {
    case FakeVendorKind::kOpenAI: fake::ServeOpenAI(ex); break;
    case FakeVendorKind::kAnthropic: fake::ServeAnthropic(ex); break;
    case FakeVendorKind::kGemini: fake::ServeGemini(ex); break;
  }
}


FakeVendor::FakeVendor(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
FakeVendor::~FakeVendor() { Stop(); }

Result<std::unique_ptr<FakeVendor>> FakeVendor::Start(FakeVendorOptions options) {
  if (options.reply_tokens < 0) return Status::InvalidArgument("fake-vendor: reply_tokens must be >= 0");
  if (options.ttft_ms < 0 || options.tokens_per_second < 0 || options.slow_ms < 0) {
    return Status::InvalidArgument("fake-vendor: ttft_ms, tokens_per_second and slow_ms must be >= 0");
  }
  if (options.embedding_dims < 1) return Status::InvalidArgument("fake-vendor: embedding_dims must be >= 1");
  if (options.max_connections < 1) return Status::InvalidArgument("fake-vendor: max_connections must be >= 1");
  auto impl = std::make_unique<Impl>(options);
  impl->id_seed = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) ^
                  (static_cast<uint64_t>(::getpid()) << 32);
  HttpServerOptions so;
  so.host = options.host;
  so.port = options.port;
  so.max_connections = options.max_connections;
  so.max_active_requests = options.max_connections;  // every connection may be mid-stream (a sleeping handler)
  so.max_body_bytes = options.max_body_bytes;
  so.max_header_bytes = 64 << 10;
  so.drain_seconds = options.drain_seconds;
  so.backlog = std::max(128, options.max_connections);
  switch (options.kind) {
    case FakeVendorKind::kOpenAI:
      so.error_body = fake::OpenAIErrorBody;
      so.server_name = "cloudflare";
      break;
    case FakeVendorKind::kAnthropic:
      so.error_body = fake::AnthropicErrorBody;
      so.server_name = "cloudflare";
      break;
    case FakeVendorKind::kGemini:
      so.error_body = fake::GeminiErrorBody;
      so.server_name = "scaffolding on HTTPServer2";
      break;
  }
  Impl* raw = impl.get();
  impl->server = std::make_unique<HttpServer>(so, [raw](const HttpRequest& req, HttpResponder& res) {
    raw->Handle(req, res);
  });
  KEEL_RETURN_IF_ERROR(impl->server->Start());
  return std::unique_ptr<FakeVendor>(new FakeVendor(std::move(impl)));
}

int FakeVendor::port() const { return impl_->server->port(); }

std::string FakeVendor::url() const {
  const std::string& h = impl_->options.host;
  bool v6 = h.find(':') != std::string::npos;
  return "http://" + (v6 ? "[" + h + "]" : h) + ":" + std::to_string(port());
}

const FakeVendorOptions& FakeVendor::options() const { return impl_->options; }

FakeVendorStats FakeVendor::stats() const {
  FakeVendorStats s;
  s.requests = impl_->requests.load();
  s.streams = impl_->streams.load();
  s.errors = impl_->errors.load();
  s.cancelled = impl_->cancelled.load();
  s.output_tokens = impl_->output_tokens.load();
  s.active = impl_->active.load();
  return s;
}

void FakeVendor::Stop() {
  if (!impl_) return;
  impl_->stopping = true;
  impl_->server->Stop();
}

int RunFakeVendorMain(const FakeVendorOptions& options) {
  auto fv = FakeVendor::Start(options);
  if (!fv.ok()) {
    Log().error("{}", fv.status().ToString());
    return fv.status().code() == StatusCode::kInvalidArgument ? 2 : 1;
  }
  std::printf("fake-vendor %s listening on %s\n", FakeVendorKindName(options.kind), (*fv)->url().c_str());
  std::fflush(stdout);
  Log().info("fake-vendor {}: ttft {} ms, {} tokens/s, {} reply tokens, key {}", FakeVendorKindName(options.kind),
             options.ttft_ms, options.tokens_per_second, options.reply_tokens,
             options.api_key.empty() ? "any" : "required");
  auto sig = WaitForTerminationSignal();
  if (!sig.ok()) {
    Log().error("{}", sig.status().ToString());
    return 1;
  }
  Log().info("received {}; stopping", SignalName(*sig));
  (*fv)->Stop();
  FakeVendorStats s = (*fv)->stats();
  Log().info("fake-vendor served {} requests ({} streams, {} errors, {} cancelled, {} output tokens)", s.requests,
             s.streams, s.errors, s.cancelled, s.output_tokens);
  return 0;
}

}  // namespace keel::gateway
