#include "keel/answer/sse.h"

#include <cstdint>
#include <ctime>

#include "keel/answer/request.h"
#include "keel/core/json_reader.h"

namespace keel::answer {
namespace {

using ojson = nlohmann::ordered_json;

void AppendEvent(const ojson& chunk, std::string* out) {
  out->append("data: ");
  // dump escapes line breaks, so one event is one data line.
  out->append(chunk.dump(-1, ' ', false, ojson::error_handler_t::replace));
  out->append("\n\n");
}

}  // namespace

std::string CompletionAsSse(const ojson& completion, bool include_usage) {
  ojson envelope = ojson::object();
  auto member = [&](const char* name, ojson fallback) {
    auto it = completion.find(name);
    return it != completion.end() && !it->is_null() ? *it : fallback;
  };
  envelope["id"] = member("id", "chatcmpl-keel-answer");
  envelope["object"] = "chat.completion.chunk";
  envelope["created"] = member("created", static_cast<int64_t>(std::time(nullptr)));
  envelope["model"] = member("model", "");
  if (auto fp = completion.find("system_fingerprint"); fp != completion.end()) envelope["system_fingerprint"] = *fp;

  auto chunk = [&](ojson choice) {
    ojson c = envelope;
    c["choices"] = ojson::array({std::move(choice)});
    if (include_usage) c["usage"] = nullptr;
    return c;
  };
  const ojson empty_choices = ojson::array();
  auto choices_it = completion.find("choices");
  const ojson& choices = choices_it != completion.end() && choices_it->is_array() ? *choices_it : empty_choices;
  auto keel_it = completion.find("keel");

  std::string out;
  for (size_t i = 0; i < choices.size(); ++i) {
    const ojson& choice = choices[i];
    const ojson index = choice.is_object() && choice.contains("index") ? choice["index"] : ojson(i);
    std::string content;
    if (choice.is_object()) {
      auto m = choice.find("message");
      if (m != choice.end() && m->is_object()) {
        auto c = m->find("content");
        if (c != m->end() && c->is_string()) content = c->get<std::string>();
      }
    }
    ojson finish = "stop";
    if (choice.is_object()) {
      auto f = choice.find("finish_reason");
      if (f != choice.end() && f->is_string()) finish = *f;
    }
    AppendEvent(chunk(ojson{{"index", index}, {"delta", {{"role", "assistant"}, {"content", ""}}},
                            {"logprobs", nullptr}, {"finish_reason", nullptr}}),
                &out);
    if (!content.empty()) {
      AppendEvent(chunk(ojson{{"index", index}, {"delta", {{"content", content}}}, {"logprobs", nullptr},
                              {"finish_reason", nullptr}}),
                  &out);
    }
    ojson last = chunk(ojson{{"index", index}, {"delta", ojson::object()}, {"logprobs", nullptr}, {"finish_reason", finish}});
    if (i + 1 == choices.size() && keel_it != completion.end()) last["keel"] = *keel_it;
    AppendEvent(last, &out);
  }
  if (include_usage) {
    ojson u = envelope;
    u["choices"] = ojson::array();
    auto usage = completion.find("usage");
    u["usage"] = usage != completion.end() ? *usage : ojson(nullptr);
    if (choices.empty() && keel_it != completion.end()) u["keel"] = *keel_it;
    AppendEvent(u, &out);
  }
  out.append("data: [DONE]\n\n");
  return out;
}

SseRelay::SseRelay(Write write, std::function<ojson()> keel_member, std::string upstream_name, size_t max_event_bytes)
    : write_(std::move(write)),
      keel_member_(std::move(keel_member)),
      upstream_name_(std::move(upstream_name)),
      max_event_bytes_(max_event_bytes) {}

bool SseRelay::Send(const ojson& chunk) {
  std::string out;
  AppendEvent(chunk, &out);
  if (!write_(out)) client_gone_ = true;
  return !client_gone_;
}

bool SseRelay::Fail(std::string_view why) {
  failed_ = true;
  failure_ = std::string(why);
  const std::string body = OpenAIErrorBody(502, upstream_name_ + ": " + std::string(why));
  std::string out = "data: " + body + "\n\n";
  if (!client_gone_ && !write_(out)) client_gone_ = true;
  return false;
}

bool SseRelay::Feed(std::string_view bytes) {
  if (failed_ || client_gone_) return false;
  if (done_) return true;  // read on to the end of the body, so the connection can be reused
  pending_.append(bytes);
  size_t pos = 0;
  while (!done_) {
    const size_t nl = pending_.find('\n', pos);
    if (nl == std::string::npos) break;
    std::string_view line(pending_.data() + pos, nl - pos);
    pos = nl + 1;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) {  // end of an event
      if (data_.empty()) continue;
      std::string data = std::move(data_);
      data_.clear();
      if (!Event(data)) return false;
      continue;
    }
    if (line.front() == ':') continue;  // a comment: keep-alive
    const size_t colon = line.find(':');
    const std::string_view field = line.substr(0, colon);
    if (field != "data") continue;
    std::string_view value = colon == std::string_view::npos ? std::string_view() : line.substr(colon + 1);
    if (!value.empty() && value.front() == ' ') value.remove_prefix(1);
    if (!data_.empty()) data_.push_back('\n');
    data_.append(value);
    if (data_.size() > max_event_bytes_) return Fail("sent an event over " + std::to_string(max_event_bytes_) + " bytes");
  }
  if (done_) {
    pending_.clear();
    return !client_gone_;
  }
  pending_.erase(0, pos);
  if (pending_.size() + data_.size() > max_event_bytes_) {
    return Fail("sent an event over " + std::to_string(max_event_bytes_) + " bytes");
  }
  return true;
}

bool SseRelay::Event(std::string_view data) {
  if (data == "[DONE]") {
    if (!keel_sent_) {
      ojson extra = last_envelope_.is_object() ? last_envelope_ : ojson::object();
      extra["object"] = "chat.completion.chunk";
      extra["choices"] = ojson::array();
      extra["keel"] = keel_member_();
      keel_sent_ = true;
      if (!Send(extra)) return false;
    }
    done_ = true;
    if (!write_("data: [DONE]\n\n")) client_gone_ = true;
    return !client_gone_;
  }
  auto chunk = ParseUntrustedOrderedJson(data, UpstreamJsonLimits());
  if (!chunk.ok()) return Fail("sent a stream event that is not a JSON object: " + chunk.status().message());
  for (const char* name : {"id", "created", "model", "system_fingerprint"}) {
    auto it = chunk->find(name);
    if (it != chunk->end()) last_envelope_[name] = *it;
  }
  // An upstream error event is the end of the answer: relayed as it is, then nothing more, and
  // no [DONE] (the OpenAI encoder sends one after it, which would make a cut answer look whole).
  // Any "error" but null or false counts, an object or not: the OpenAI SDKs raise on any truthy
  // one, so a client never reads what would follow it.
  if (auto err = chunk->find("error"); err != chunk->end() && !err->is_null() && *err != false) {
    failed_ = true;
    std::string message = "(no message)";
    if (err->is_string()) {
      message = err->get<std::string>();
    } else if (auto m = err->is_object() ? err->find("message") : err->end(); m != err->end() && m->is_string()) {
      message = m->get<std::string>();
    }
    failure_ = "sent an error event: " + message;
    Send(*chunk);
    return false;
  }
  if (!keel_sent_) {
    auto choices = chunk->find("choices");
    bool finished = false;
    if (choices != chunk->end() && choices->is_array()) {
      for (const auto& c : *choices) {
        auto f = c.is_object() ? c.find("finish_reason") : c.end();
        if (c.is_object() && f != c.end() && f->is_string()) finished = true;
      }
    }
    if (finished) {
      (*chunk)["keel"] = keel_member_();
      keel_sent_ = true;
    }
  }
  return Send(*chunk);
}

bool SseRelay::Finish(std::string_view upstream_error) {
  if (done_) return true;
  if (failed_ || client_gone_) return false;
  if (!upstream_error.empty()) return Fail(std::string("stream broke before [DONE]: ") + std::string(upstream_error));
  // An unterminated last event is dropped: without [DONE] the answer may be cut anywhere.
  return Fail("stream ended before [DONE]");
}

}  // namespace keel::answer
