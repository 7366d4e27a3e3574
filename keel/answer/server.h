// AnswerServer: what `keel answer serve` runs -- the retrieval-augmented answer endpoint of
// issue 23, the product HiLO degrades (docs/answer.md).
//
//   POST /v1/chat/completions   an OpenAI chat body plus "keel_retrieval" (keel/answer/request.h)
//       1. search: POST {vector_url}/v1/search {"kind":"text","text":[...],"k":10} (a `keel vector`
//          service or the router: same API) -- only when the state's answer level has retrieval
//          on AND the request carries keel_retrieval.vector;
//       2. prompt: the documents of the first level.context_docs hits (vector id i stands for
//          document i mod corpus size), the newest earlier turns within history_bytes, and the
//          last user message (BuildPrompt);
//       3. generate: POST {gateway_url}/v1/chat/completions {"model","messages":[{"role":"user",
//          "content":prompt}],"max_tokens","temperature"} (`keel gateway`, or an engine: same API);
//       4. answer: the generator's chat completion with one more member,
//          "keel":{"retrieved":[all k ids, in order],"docs":[document indices put in the prompt],
//                  "state":name,"retrieval":bool,"context_docs":n,"search_ms":x,"generate_ms":y};
//          with "stream": true, the gateway is asked to stream too and its chunks are relayed
//          as they arrive (keel/answer/sse.h, SseRelay), "keel" on the chunk with the
//          finish_reason; errors before the gateway's stream opens are JSON with their status,
//          later ones an OpenAI error event in the stream, with no [DONE].
//   GET /v1/models, GET /v1/models/{id}   the gateway's answer for the client's key, passed on
//       (the models a chat request may name); its errors map as for a chat request.
//   GET /healthz, GET /metrics (keel_answer_requests_total{route,code}, keel_answer_inflight,
//       keel_answer_search_seconds, keel_answer_generate_seconds)
//
// HiLO: with a ServiceLink, each request reads link->Current().answer once at its start and
// applies it (retrieval on/off, context_docs); the link's LoadMeter sees Arrive, then Shed or
// Started ... Finish. Without a link the server applies kBuiltinLevel (retrieval on,
// context_docs 3) and meters nothing.
//
// Bounds and errors (OpenAI's error body, OpenAIErrorBody):
//   - more than max_inflight requests at once: 429 with Retry-After: 1, counted as Shed;
//   - body over max_body_bytes: 413; bad input: 400 naming the member (ParseAnswerRequest);
//   - vector service unreachable or timed out: 503 "vector service at host:port unreachable: ...";
//     it answered non-200 or a body that is not a search answer: 502 "vector service ... answered
//     <status>: <its message>";
//   - gateway unreachable: 503 naming it; gateway 400/401/403/404/413/429: passed through with
//     its status and message (prefixed "gateway: "), since they are about the client's request or
//     key; other non-200 or a malformed answer: 502 naming it.
// Keys: the client's Authorization and x-api-key headers go to the gateway (never to the vector
// service); without them, options.gateway_api_key.
// Upstream calls go through keel::HttpClient, which retries once on a pooled connection the peer
// closed; a chat completion at temperature 0 is safe to repeat.
//
// Thread safety: Start/Stop from the owner; requests are served concurrently.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "keel/answer/corpus.h"
#include "keel/answer/request.h"
#include "keel/core/http_client.h"
#include "keel/core/http_server.h"
#include "keel/core/metrics.h"
#include "keel/hilo/catalog.h"
#include "keel/hilo/service_link.h"

namespace keel::answer {

// The level applied without a HiLO link: full retrieval, three documents.
inline constexpr hilo::AnswerLevel kBuiltinLevel{true, 3};
inline constexpr const char* kBuiltinStateName = "builtin-full";

struct AnswerServerOptions {
  std::string host = "127.0.0.1";
  int port = 0;                     // 0 = any free port
  std::string vector_url;           // "http://host:port" of `keel vector` or its router
  std::string gateway_url;          // "http://host:port" of `keel gateway` (or an engine)
  std::string default_model;        // asked of the gateway when the request names no model
  int k = 10;                       // hits asked of the vector service (recall@10 needs 10)
  // Bytes of document text in the prompt, shared by the documents (BuildPrompt). The default
  // fits the 256-token models of shared/data (tok354: about one token per byte) with a question
  // of <= 80 bytes, 8 documents and 16 new tokens (docs/answer.md, "Prompt"); raise it for a
  // model with a longer context.
  size_t context_bytes = 100;
  // Bytes of earlier conversation turns in the prompt (BuildPrompt: the newest whole turns that
  // fit). 0, the default, sends none: the 256-token models have no room for them.
  size_t history_bytes = 0;
  int max_inflight = 16;            // requests served at once; beyond: 429 (Shed)
  size_t max_body_bytes = 256 << 10;  // 413 beyond; at least dim x 16 + 4096 (Start refuses less)
  RequestLimits limits;             // limits.dim must be the vector service's dim; max_json_values
                                    // is raised to dim + 10000 when that is larger
  // Sent to the gateway as "Authorization: Bearer <key>" when the client sent neither
  // Authorization nor x-api-key (those are forwarded as they are, so the gateway's budgets and
  // policies apply to the client's key). "" = none.
  std::string gateway_api_key;
  int vector_timeout_ms = 2000;
  int gateway_timeout_ms = 120000;
};

class AnswerServer {
 public:
  // `corpus` must outlive the server; `link` (may be null: kBuiltinLevel) too, and its owner
  // starts and stops it. InvalidArgument for a bad URL or option, IOError when the address
  // cannot be bound.
  static Result<std::unique_ptr<AnswerServer>> Start(const Corpus& corpus, AnswerServerOptions options,
                                                     hilo::ServiceLink* link = nullptr);
  ~AnswerServer();  // Stop()
  AnswerServer(const AnswerServer&) = delete;
  AnswerServer& operator=(const AnswerServer&) = delete;

  void Stop();  // drains requests in progress; idempotent
  int port() const { return http_ ? http_->port() : 0; }
  MetricsRegistry& metrics() { return metrics_; }
  // Searches sent to the vector service so far (tests: a no-retrieval state sends none).
  uint64_t searches() const { return searches_.load(); }

 private:
  AnswerServer(const Corpus& corpus, AnswerServerOptions options, hilo::ServiceLink* link);
  void HandleChat(const HttpRequest& req, HttpResponder& res);
  // GET /v1/models and /v1/models/{id}: the gateway's answer for the client's key (`path` as asked).
  void HandleModels(const HttpRequest& req, const std::string& path, HttpResponder& res);
  void Serve(const HttpRequest& req, HttpResponder& res, const hilo::AnswerLevel& level, const std::string& state);
  struct Failure {
    int status = 0;
    std::string message;
    HttpHeaderList extra;
  };
  using ojson = nlohmann::ordered_json;
  std::optional<Failure> Search(const std::vector<float>& vector, std::vector<uint64_t>* retrieved, double* ms);
  std::optional<Failure> Generate(const HttpRequest& req, const AnswerRequest& q, const std::string& prompt,
                                  ojson* answer, double* ms);
  // stream: true. nullopt once the answer was streamed (or the client went away meanwhile);
  // a Failure when nothing was sent yet.
  std::optional<Failure> GenerateStream(const HttpRequest& req, const AnswerRequest& q, const std::string& prompt,
                                        HttpResponder& res, const std::function<ojson(double generate_ms)>& keel_member);
  std::string GenerationBody(const AnswerRequest& q, const std::string& prompt, bool stream) const;
  HttpHeaderList GatewayKeys(const HttpRequest& req) const;
  std::string GatewayName() const;  // "gateway at host:port", for messages
  Failure GatewayUnreachable(const Status& why) const;  // 503 naming the gateway
  static void SendFailure(HttpResponder& res, const Failure& f);  // OpenAI's error body
  std::optional<Failure> GatewayRefusal(int status, const std::string& body) const;  // nullopt for 200
  std::optional<Failure> ParseCompletion(const std::string& body, ojson* answer) const;

  const Corpus& corpus_;
  AnswerServerOptions opt_;
  hilo::ServiceLink* link_;
  std::unique_ptr<HttpClient> vector_;
  std::unique_ptr<HttpClient> gateway_;
  MetricsRegistry metrics_;
  CounterFamily* requests_ = nullptr;
  Gauge* inflight_gauge_ = nullptr;
  Histogram* search_seconds_ = nullptr;
  Histogram* generate_seconds_ = nullptr;
  Counter* broken_streams_ = nullptr;
  std::atomic<int> inflight_{0};
  std::atomic<uint64_t> searches_{0};
  std::unique_ptr<HttpServer> http_;
};

// The HiLO flags of `keel answer serve` (apps/keel.cc), as the other services have them.
// --hilo, --hilo-catalog, --hilo-state, --hilo-instance (keel/hilo/service_link.h).
using AnswerHiloFlags = hilo::LinkSource;

// A started link for the answer service, or nullptr when no flag asks for one (the server then
// applies kBuiltinLevel). `workers`: requests served at once (max_inflight). InvalidArgument for
// --hilo with --hilo-catalog, --hilo-catalog without --hilo-state, --hilo-state or
// --hilo-instance alone, a catalog that does not parse (naming the file) or lacks the state;
// Unavailable when the controller cannot be reached before the timeout.
Result<std::unique_ptr<hilo::ServiceLink>> OpenAnswerLink(const AnswerHiloFlags& flags, int workers);

}  // namespace keel::answer
