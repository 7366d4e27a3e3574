#include "keel/answer/replay.h"

#include <nlohmann/json.hpp>

#include "keel/answer/quality.h"
#include "keel/core/json_reader.h"
#include "keel/core/json_writer.h"

namespace keel::answer {

ReplayedAnswer AskOne(HttpClient& answer, const EvalQuery& q, const ReplayOptions& o) {
  JsonLimits limits;
  limits.max_depth = 16;
  limits.max_values = 200000;
  limits.require_object = true;
  std::string body = "{";
  if (!o.model.empty()) {
    body += "\"model\":";
    AppendJsonString(o.model, &body);
    body += ',';
  }
  body += "\"messages\":[{\"role\":\"user\",\"content\":";
  AppendJsonString(q.question, &body);
  body += "}],\"max_tokens\":";
  AppendJsonNumber(o.max_tokens, &body);
  body += ",\"temperature\":0,\"keel_retrieval\":{\"vector\":[";
  for (size_t i = 0; i < q.vector.size(); ++i) {
    if (i > 0) body += ',';
    AppendJsonNumber(static_cast<double>(q.vector[i]), &body);
  }
  body += "]}}";
  ReplayedAnswer a;
  auto reply = answer.Call("POST", "/v1/chat/completions", body, "application/json", DeadlineIn(o.timeout_ms));
  if (!reply.ok()) {
    a.error = reply.status().message();
    return a;
  }
  a.status = reply->status;
  auto j = ParseUntrustedJson(reply->body, limits);
  if (!j.ok()) {
    a.error = "malformed answer: " + j.status().message();
    if (a.status == 200) a.status = 0;
    return a;
  }
  if (a.status != 200) {
    auto e = j->find("error");
    if (e != j->end() && e->is_object()) a.error = e->value("message", std::string());
    return a;
  }
  try {
    a.content = j->at("choices").at(0).at("message").value("content", std::string());
    const auto& k = j->at("keel");
    a.retrieved = k.at("retrieved").get<std::vector<uint64_t>>();
    a.state = k.value("state", std::string());
  } catch (const nlohmann::json::exception& e) {
    a.status = 0;
    a.error = std::string("answer without choices or keel: ") + e.what();
  }
  return a;
}

std::vector<ReplayedAnswer> Replay(HttpClient& answer, std::span<const EvalQuery> queries, const ReplayOptions& o) {
  std::vector<ReplayedAnswer> out;
  out.reserve(queries.size());
  for (const EvalQuery& q : queries) out.push_back(AskOne(answer, q, o));
  return out;
}

StateQuality Score(std::span<const EvalQuery> queries, std::span<const ReplayedAnswer> reference,
                   std::span<const ReplayedAnswer> answers) {
  StateQuality s;
  if (queries.size() != reference.size() || queries.size() != answers.size()) return s;
  double q_sum = 0, r_sum = 0, a_sum = 0;
  for (size_t i = 0; i < queries.size(); ++i) {
    if (reference[i].status != 200) {
      ++s.skipped;
      continue;
    }
    ++s.requests;
    if (answers[i].status != 200) continue;
    ++s.served;
    const double r = RecallAt10(answers[i].retrieved, queries[i].truth);
    const double a = WordF1(answers[i].content, reference[i].content);
    r_sum += r;
    a_sum += a;
    q_sum += RequestQuality(r, a);
  }
  if (s.requests > 0) s.quality = q_sum / static_cast<double>(s.requests);
  if (s.served > 0) {
    s.recall = r_sum / static_cast<double>(s.served);
    s.agreement = a_sum / static_cast<double>(s.served);
  }
  return s;
}

}  // namespace keel::answer
