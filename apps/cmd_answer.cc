// keel answer serve | index: the retrieval-augmented answer product.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "apps/cli.h"
#include "keel/answer/server.h"
#include "keel/core/http_client.h"
#include "keel/core/json_writer.h"  // answer-index
#include "keel/core/log.h"
#include "keel/core/mapped_file.h"
#include "keel/vector/texmex.h"  // answer-index

namespace keel::cli {
namespace {

// ---- answer-index (begin): `keel answer index` loads the corpus's vectors into the vector service
struct AnswerIndexArgs {
  std::string vector_url;
  std::string bvecs;
  int64_t limit = -1;
  int batch = 1000;
};

// Upserts record i of the .bvecs file as vector id i (the id the answer service maps to document
// i mod documents), in batches; versionless writes, so a re-run overwrites the same ids.
int RunAnswerIndex(const AnswerIndexArgs& a) {
  auto ep = ParseHttpUrl(a.vector_url);
  if (!ep.ok()) return Fail(ep.status());
  auto set = vector::ReadBvecs(a.bvecs, a.limit);
  if (!set.ok()) return Fail(set.status());
  HttpClient client(*ep);
  const auto started = std::chrono::steady_clock::now();
  for (int64_t first = 0; first < set->count; first += a.batch) {
    const int64_t end = std::min<int64_t>(set->count, first + a.batch);
    std::string body = "{\"items\":[";
    for (int64_t i = first; i < end; ++i) {
      if (i > first) body += ',';
      body += "{\"id\":" + std::to_string(i) + ",\"text\":[";
      for (int d = 0; d < set->dim; ++d) {
        if (d > 0) body += ',';
        AppendJsonNumber(static_cast<double>(set->values[static_cast<size_t>(i * set->dim + d)]), &body);
      }
      body += "]}";
    }
    body += "]}";
    auto r = client.Call("POST", "/v1/upsert", body, "application/json", DeadlineIn(120000));
    if (!r.ok()) return Fail(r.status());
    if (r->status != 200) {
      return Fail(Status::InvalidArgument(fmt::format("{}: upsert of ids {}..{}: HTTP {}: {}", a.vector_url, first, end - 1,
                                                      r->status, r->body.substr(0, 300))));
    }
    Log().info("answer index: {} of {} vectors", end, set->count);
  }
  std::printf("indexed %lld vectors (dim %d) from %s into %s in %.1f s\n", static_cast<long long>(set->count), set->dim,
              a.bvecs.c_str(), a.vector_url.c_str(),
              std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
  return 0;
}
// ---- answer-index (end)

// ---- answer (begin): `keel answer serve`, the retrieval-augmented answer endpoint (docs/answer.md)
struct AnswerArgs {
  answer::AnswerServerOptions o;
  std::string corpus;
  answer::AnswerHiloFlags hilo;
  std::string gateway_key_file;
};

int RunAnswer(AnswerArgs a) {
  if (a.corpus.empty()) {
    const char* shared = std::getenv("KEEL_SHARED");
    if (shared == nullptr || *shared == '\0') {
      return Fail(Status::InvalidArgument("answer: --corpus is required (or set KEEL_SHARED for its data/text/val.txt)"));
    }
    a.corpus = std::string(shared) + "/data/text/val.txt";
  }
  auto corpus = answer::Corpus::Load(a.corpus);
  if (!corpus.ok()) return Fail(corpus.status());
  if (!a.gateway_key_file.empty()) {
    auto key = ReadSmallFile(a.gateway_key_file, 64 << 10);
    if (!key.ok()) return Fail(key.status());
    a.o.gateway_api_key = key->substr(0, key->find_first_of("\r\n"));
    if (a.o.gateway_api_key.empty() || a.o.gateway_api_key.size() > 1024) {
      return Fail(Status::InvalidArgument(a.gateway_key_file + ": expected a key of 1..1024 bytes on the first line"));
    }
  }
  // Room for the vector of a large --dim (about 12 bytes a number) and the rest of the body.
  a.o.max_body_bytes = std::max(a.o.max_body_bytes, static_cast<size_t>(a.o.limits.dim) * 32 + (size_t{64} << 10));
  auto link = answer::OpenAnswerLink(a.hilo, a.o.max_inflight);
  if (!link.ok()) return Fail(link.status());
  auto server = answer::AnswerServer::Start(*corpus, a.o, link->get());
  if (!server.ok()) {
    if (*link) (*link)->Stop();
    return Fail(server.status());
  }
  Log().info("answer: corpus {} ({} documents), {}", a.corpus, corpus->size(),
             *link ? "following HiLO" : "built-in full level (retrieval on, 3 documents)");
  return StopOnSignal([&] {
    (*server)->Stop();
    if (*link) (*link)->Stop();
    return Status::Ok();
  });
}
// ---- answer (end)

}  // namespace

void AddAnswerCommands(CLI::App& app, Commands& out) {
  auto ans_ptr = std::make_shared<AnswerArgs>();
  AnswerArgs& ans = *ans_ptr;
  auto* ans_cmd = app.add_subcommand("answer", "Retrieval-augmented answers (OpenAI chat): search `keel vector`, prompt with the documents, ask `keel gateway` (docs/answer.md)");
  ans_cmd->require_subcommand(1);
  auto* ans_serve = ans_cmd->add_subcommand("serve", "Serve POST /v1/chat/completions (plus \"keel_retrieval\":{\"vector\":[...]}), GET /v1/models (the gateway's), /healthz, /metrics");
  ans_serve->add_option("--host", ans.o.host, "address to bind")->capture_default_str();
  ans_serve->add_option("--port", ans.o.port, "port to bind (0 = any free port)")->required()->check(CLI::Range(0, 65535));
  ans_serve->add_option("--vector", ans.o.vector_url, "the vector service or its router (http://host:port)")->required();
  ans_serve->add_option("--gateway", ans.o.gateway_url, "`keel gateway`, or an engine (`keel serve`): same OpenAI chat API (http://host:port)")->required();
  ans_serve->add_option("--gateway-key-file", ans.gateway_key_file, "API key for the gateway (first line) when a request brings no Authorization or x-api-key of its own (those are forwarded)")->check(CLI::ExistingFile);
  ans_serve->add_option("--model", ans.o.default_model, "model asked of the gateway when a request names none (default: none; such requests get 400)");
  ans_serve->add_option("--corpus", ans.corpus, "documents separated by blank lines; vector id i is document i mod count (default: $KEEL_SHARED/data/text/val.txt)")->check(CLI::ExistingFile);
  ans_serve->add_option("--dim", ans.o.limits.dim, "length of keel_retrieval.vector: the vector service's text dim")->capture_default_str()->check(CLI::Range(1, 65536));
  ans_serve->add_option("--context-bytes", ans.o.context_bytes, "bytes of document text in the prompt, shared by its documents (the default fits 256-token models)")->capture_default_str()->check(CLI::Range(0, 1 << 20));
  ans_serve->add_option("--history-bytes", ans.o.history_bytes, "bytes of earlier user/assistant turns in the prompt, newest whole turns first (0: none; 256-token models have no room)")->capture_default_str()->check(CLI::Range(0, 1 << 20));
  ans_serve->add_option("--max-inflight", ans.o.max_inflight, "requests served at once; beyond: 429 with Retry-After")->capture_default_str()->check(CLI::Range(1, 100000));
  ans_serve->add_option("--vector-timeout-ms", ans.o.vector_timeout_ms, "deadline of one search")->capture_default_str()->check(CLI::Range(1, 600000));
  ans_serve->add_option("--gateway-timeout-ms", ans.o.gateway_timeout_ms, "deadline of one generation")->capture_default_str()->check(CLI::Range(1, 3600000));
  auto* ans_url = ans_serve->add_option("--hilo", ans.hilo.url, "follow the HiLO controller at this URL: apply its state's answer level (retrieval, context_docs), report load");
  auto* ans_cat = ans_serve->add_option("--hilo-catalog", ans.hilo.catalog, "without a controller: a HiLO state catalog to pin one state of (with --hilo-state)")->check(CLI::ExistingFile);
  ans_url->excludes(ans_cat);
  ans_serve->add_option("--hilo-state", ans.hilo.state, "the HiLO state to pin (required with --hilo-catalog; with --hilo it freezes the state). Neither --hilo nor --hilo-catalog: retrieval on, 3 documents");
  ans_serve->add_option("--hilo-instance", ans.hilo.instance, "this instance's name in HiLO load reports (default answer-<pid>)");
  // ---- answer (end)
  // ---- answer-index (begin)
  auto aidx_ptr = std::make_shared<AnswerIndexArgs>();
  AnswerIndexArgs& aidx = *aidx_ptr;
  auto* ans_index = ans_cmd->add_subcommand("index", "Load the corpus's vectors (.bvecs; record i = vector id i) into a keel vector service or router");
  ans_index->add_option("--vector", aidx.vector_url, "the vector service or router (http://host:port)")->required();
  ans_index->add_option("--bvecs", aidx.bvecs, "vectors to load, e.g. $KEEL_SHARED/data/vectors/bigann10k_base.bvecs")->required()->check(CLI::ExistingFile);
  ans_index->add_option("--limit", aidx.limit, "load only the first N records (-1 = all)")->capture_default_str();
  ans_index->add_option("--batch", aidx.batch, "vectors per upsert request")->capture_default_str()->check(CLI::Range(1, 100000));
  // ---- answer-index (end)
  out.push_back({ans_serve, [ans_ptr] { return RunAnswer(*ans_ptr); }});  // answer
  out.push_back({ans_index, [aidx_ptr] { return RunAnswerIndex(*aidx_ptr); }});  // answer-index
}

}  // namespace keel::cli
