#include "keel/answer/sse.h"

#include <cstdint>
#include <ctime>

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

}  // namespace keel::answer
