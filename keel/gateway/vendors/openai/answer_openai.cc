// Non-streamed OpenAI answers without a JSON DOM: the fast readers of upstream answers (they
// decline to the DOM reader in translate_openai.cc for anything not plainly of the common shape)
// and the client answer writers, which write the JSON text directly, byte for byte what dumping
// the equivalent nlohmann::json (keys sorted, as its std::map holds them) would give.
#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>

#include "keel/gateway/stream.h"
#include "keel/gateway/translate_internal.h"
#include "keel/gateway/vendors/openai/openai.h"
#include "keel/gateway/vendors/openai/openai_answer.h"

namespace keel::gateway {

using namespace internal;  // NOLINT: the helpers are this file's vocabulary

namespace {

// A validating pull scanner over a strict subset of JSON: every text it accepts is JSON that
// ParseUntrustedJson(kUpstreamJsonLimits) accepts with the same strings and numbers. Anything
// else makes a call return false, and the reader declines. The subset: no BOM; numbers whose
// value is plainly finite (nlohmann refuses overflowing ones); nesting at most kMaxDepth (below
// the DOM's limit); values counted as CheckJsonLimits counts them.
class Scanner {
 public:
  enum class Num { kInt, kOther };  // kInt: an integer nlohmann reads as one, value in *v

  explicit Scanner(std::string_view t) : t_(t) {}

  // The next byte after whitespace, 0 at the end.
  char Peek() {
    Ws();
    return i_ < t_.size() ? t_[i_] : 0;
  }
  bool Eat(char c) {
    if (Peek() != c) return false;
    ++i_;
    return true;
  }
  bool AtEnd() { return Peek() == 0 && i_ == t_.size(); }

  // '{' or '['.
  bool Open(char c) {
    if (Peek() != c || depth_ == kMaxDepth || !Count()) return false;
    ++i_;
    in_object_[depth_++] = c == '{';
    return true;
  }
  // '}' or ']' of the innermost container.
  bool Close() {
    if (depth_ == 0 || !Eat(in_object_[depth_ - 1] ? '}' : ']')) return false;
    --depth_;
    return true;
  }
  // "key" ':' (a key counts as a value, as CheckJsonLimits counts it).
  bool Key(std::string* key) { return Peek() == '"' && String(key) && Eat(':'); }

  bool String(std::string* out) {
    if (Peek() != '"' || !Count()) return false;
    out->clear();
    size_t run = ++i_;
    const size_t n = t_.size();
    while (i_ < n) {
      const unsigned char c = static_cast<unsigned char>(t_[i_]);
      if (c == '"') {
        out->append(t_.data() + run, i_ - run);
        ++i_;
        return true;
      }
      if (c < 0x20) return false;
      if (c >= 0x80) {
        const size_t len = Utf8SequenceLength(t_, i_);
        if (len == 0) return false;
        i_ += len;
        continue;
      }
      if (c != '\\') {
        ++i_;
        continue;
      }
      out->append(t_.data() + run, i_ - run);
      if (i_ + 1 >= n) return false;
      switch (t_[i_ + 1]) {
        case '"': out->push_back('"'); break;
        case '\\': out->push_back('\\'); break;
        case '/': out->push_back('/'); break;
        case 'b': out->push_back('\b'); break;
        case 'f': out->push_back('\f'); break;
        case 'n': out->push_back('\n'); break;
        case 'r': out->push_back('\r'); break;
        case 't': out->push_back('\t'); break;
        case 'u':
          if (!Unicode(out)) return false;
          run = i_;
          continue;
        default: return false;
      }
      i_ += 2;
      run = i_;
    }
    return false;
  }

  // A number. kInt for an integer of at most 18 digits (nlohmann's integer types hold it
  // exactly); kOther for a finite non-integer. Longer integers return false (nlohmann turns
  // them into unsigned, wrapped or float values: the DOM reader decides).
  bool Number(Num* kind, int64_t* v) {
    Ws();
    if (!Count()) return false;
    const size_t n = t_.size();
    const bool neg = i_ < n && t_[i_] == '-';
    size_t j = i_ + neg;
    const size_t digits_at = j;
    int64_t x = 0;
    while (j < n && t_[j] >= '0' && t_[j] <= '9') {
      if (j - digits_at < 18) x = x * 10 + (t_[j] - '0');
      ++j;
    }
    const size_t digits = j - digits_at;
    if (digits == 0 || (digits > 1 && t_[digits_at] == '0')) return false;
    bool integer = true;
    if (j < n && t_[j] == '.') {
      integer = false;
      const size_t frac_at = ++j;
      while (j < n && t_[j] >= '0' && t_[j] <= '9') ++j;
      if (j == frac_at) return false;
    }
    int64_t exp = 0;
    if (j < n && (t_[j] == 'e' || t_[j] == 'E')) {
      integer = false;
      ++j;
      const bool exp_neg = j < n && t_[j] == '-';
      if (j < n && (t_[j] == '-' || t_[j] == '+')) ++j;
      const size_t exp_at = j;
      while (j < n && t_[j] >= '0' && t_[j] <= '9') {
        if (j - exp_at < 6) exp = exp * 10 + (t_[j] - '0');
        ++j;
      }
      if (j == exp_at || (!exp_neg && j - exp_at > 5)) return false;
      if (exp_neg) exp = 0;  // small values underflow to 0 or a subnormal: finite either way
    }
    // The value is below 10^(digits + exp): finite while that stays well under DBL_MAX.
    if (static_cast<int64_t>(digits) + exp > 300) return false;
    if (integer && digits > 18) return false;
    i_ = j;
    *kind = integer ? Num::kInt : Num::kOther;
    *v = neg ? -x : x;
    return true;
  }

  // Any value, validated and dropped.
  bool Skip() {
    const int base = depth_;
    for (;;) {
      const char c = Peek();
      if (c == '{' || c == '[') {
        if (!Open(c)) return false;
        if (Eat(c == '{' ? '}' : ']')) {
          --depth_;
        } else {
          if (c == '{' && !Key(&scratch_)) return false;
          continue;
        }
      } else if (!Scalar(c)) {
        return false;
      }
      for (;;) {  // after a value: a comma, or the ends of containers
        if (depth_ == base) return true;
        if (Eat(',')) {
          if (in_object_[depth_ - 1] && !Key(&scratch_)) return false;
          break;
        }
        if (!Close()) return false;
      }
    }
  }

 private:
  static constexpr int kMaxDepth = 64;  // kUpstreamJsonLimits allows deeper: the DOM reader decides

  void Ws() {
    while (i_ < t_.size() && (t_[i_] == ' ' || t_[i_] == '\n' || t_[i_] == '\r' || t_[i_] == '\t')) ++i_;
  }
  bool Count() { return ++values_ <= kUpstreamJsonLimits.max_values; }

  bool Scalar(char c) {
    if (c == '"') return String(&scratch_);
    if (c == '-' || (c >= '0' && c <= '9')) {
      Num kind;
      int64_t v;
      return Number(&kind, &v);
    }
    for (std::string_view lit : {std::string_view("null"), std::string_view("true"), std::string_view("false")}) {
      if (t_.substr(i_, lit.size()) == lit) {
        i_ += lit.size();
        return Count();
      }
    }
    return false;
  }

  // At "\u": the escape (a surrogate pair when it is one, as nlohmann requires) as UTF-8.
  bool Unicode(std::string* out) {
    uint32_t cp;
    if (!Hex4(i_ + 2, &cp)) return false;
    i_ += 6;
    if (cp >= 0xDC00 && cp <= 0xDFFF) return false;
    if (cp >= 0xD800 && cp <= 0xDBFF) {
      uint32_t lo;
      if (i_ + 1 >= t_.size() || t_[i_] != '\\' || t_[i_ + 1] != 'u' || !Hex4(i_ + 2, &lo) || lo < 0xDC00 ||
          lo > 0xDFFF) {
        return false;
      }
      i_ += 6;
      cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
    }
    if (cp < 0x80) {
      out->push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
      out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else {
      out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
    return true;
  }
  bool Hex4(size_t at, uint32_t* cp) const {
    if (at + 4 > t_.size()) return false;
    *cp = 0;
    for (size_t k = at; k < at + 4; ++k) {
      const char h = t_[k];
      const int d = h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10 : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
      if (d < 0) return false;
      *cp = *cp * 16 + static_cast<uint32_t>(d);
    }
    return true;
  }

  std::string_view t_;
  size_t i_ = 0;
  int depth_ = 0;
  size_t values_ = 0;
  bool in_object_[kMaxDepth];
  std::string scratch_;  // skipped strings and keys
};

// Members of one object, read once each: a repeated key among them declines (a DOM keeps the
// last; declining leaves that rule to the DOM reader).
class Seen {
 public:
  bool First(unsigned bit) {
    if (bits_ & bit) return false;
    bits_ |= bit;
    return true;
  }
  bool Has(unsigned bit) const { return bits_ & bit; }

 private:
  unsigned bits_ = 0;
};

// A member the DOM reader reads with ReadString and ignores when it has another type.
bool StringOrIgnore(Scanner& s, std::string* out) { return s.Peek() == '"' ? s.String(out) : s.Skip(); }

// An integer member the DOM reader takes only when is_number_integer().
bool IntOrIgnore(Scanner& s, int64_t* out) {
  const char c = s.Peek();
  if (c != '-' && (c < '0' || c > '9')) return s.Skip();
  Scanner::Num kind;
  int64_t v;
  if (!s.Number(&kind, &v)) return false;
  if (kind == Scanner::Num::kInt) *out = v;
  return true;
}

// ReadUsage: an object's prompt_tokens / completion_tokens; anything else is ignored.
bool ReadUsage(Scanner& s, Usage* usage) {
  if (s.Peek() != '{') return s.Skip();
  s.Open('{');
  if (s.Close()) return true;
  Seen seen;
  std::string key;
  do {
    if (!s.Key(&key)) return false;
    if (key == "prompt_tokens") {
      if (!seen.First(1) || !IntOrIgnore(s, &usage->input_tokens)) return false;
    } else if (key == "completion_tokens") {
      if (!seen.First(2) || !IntOrIgnore(s, &usage->output_tokens)) return false;
    } else if (!s.Skip()) {
      return false;
    }
  } while (s.Eat(','));
  return s.Close();
}

// choices[0].message: content a string or null, tool_calls absent or null.
bool ReadMessage(Scanner& s, std::string* content) {
  if (!s.Open('{')) return false;
  if (s.Close()) return true;
  Seen seen;
  std::string key;
  do {
    if (!s.Key(&key)) return false;
    if (key == "content") {
      if (!seen.First(1)) return false;
      const char c = s.Peek();
      if (c == '"' ? !s.String(content) : c != 'n' || !s.Skip()) return false;
    } else if (key == "tool_calls") {
      if (!seen.First(2) || s.Peek() != 'n' || !s.Skip()) return false;
    } else if (!s.Skip()) {
      return false;
    }
  } while (s.Eat(','));
  return s.Close();
}

// choices[0]: chat's message, completions' text, and finish_reason.
bool ReadChoice(Scanner& s, bool chat, ChatResponse* out) {
  if (!s.Open('{')) return false;
  Seen seen;
  std::string key, finish;
  if (!s.Close()) {
    do {
      if (!s.Key(&key)) return false;
      if (key == "finish_reason") {
        if (!seen.First(1) || !StringOrIgnore(s, &finish)) return false;
      } else if (chat && key == "message") {
        if (!seen.First(2) || !ReadMessage(s, &out->content)) return false;
      } else if (!chat && key == "text") {
        if (!seen.First(2)) return false;
        const char c = s.Peek();
        if (c == '"' ? !s.String(&out->content) : c != 'n' || !s.Skip()) return false;
      } else if (!s.Skip()) {
        return false;
      }
    } while (s.Eat(','));
    if (!s.Close()) return false;
  }
  if (chat && !seen.Has(2)) return false;  // the DOM reader refuses an answer without a message
  out->finish = ParseOpenAIFinishReason(finish);
  return true;
}

// choices: a non-empty array whose first element is read; the rest are validated and dropped.
bool ReadChoices(Scanner& s, bool chat, ChatResponse* out) {
  if (!s.Open('[') || s.Peek() != '{' || !ReadChoice(s, chat, out)) return false;
  while (s.Eat(',')) {
    if (!s.Skip()) return false;
  }
  return s.Close();
}

bool ReadAnswer(std::string_view body, bool chat, ChatResponse* out) {
  Scanner s(body);
  if (!s.Open('{')) return false;
  Seen seen;
  std::string key;
  if (!s.Close()) {
    do {
      if (!s.Key(&key)) return false;
      bool ok;
      if (key == "id") ok = seen.First(1) && StringOrIgnore(s, &out->id);
      else if (key == "model") ok = seen.First(2) && StringOrIgnore(s, &out->model);
      else if (key == "created") ok = seen.First(4) && IntOrIgnore(s, &out->created);
      else if (key == "choices") ok = seen.First(8) && ReadChoices(s, chat, out);
      else if (key == "usage") ok = seen.First(16) && ReadUsage(s, &out->usage);
      else if (key == "error") ok = s.Peek() == 'n' && s.Skip();  // an error member: the DOM reader words it
      else ok = s.Skip();
      if (!ok) return false;
    } while (s.Eat(','));
    if (!s.Close()) return false;
  }
  return seen.Has(8) && s.AtEnd();
}

// ---- writers

void AppendFinish(FinishReason finish, std::string* out) {
  const char* name = OpenAIFinishReasonName(finish);
  if (*name) AppendJsonString(name, out);
  else *out += "null";
}

// ,"usage":{...} unless neither count is known (WriteUsage's rule).
void AppendUsage(const Usage& usage, std::string* out) {
  if (usage.input_tokens < 0 && usage.output_tokens < 0) return;
  const int64_t in = std::max<int64_t>(usage.input_tokens, 0);
  const int64_t o = std::max<int64_t>(usage.output_tokens, 0);
  *out += ",\"usage\":{\"completion_tokens\":";
  AppendJsonNumber(o, out);
  *out += ",\"prompt_tokens\":";
  AppendJsonNumber(in, out);
  *out += ",\"total_tokens\":";
  AppendJsonNumber(in + o, out);
  *out += '}';
}

// ,"created":..,"id":..,"model":..,"object":.. and the usage: the members after "choices".
void AppendTail(const ChatResponse& response, const char* id_prefix, const std::string& model, const char* object,
                std::string* out) {
  *out += ",\"created\":";
  AppendJsonNumber(response.created ? response.created : NowSeconds(), out);
  *out += ",\"id\":";
  AppendJsonString(PrefixedId(response.id, id_prefix), out);
  *out += ",\"model\":";
  AppendJsonString(model, out);
  *out += ",\"object\":\"";
  *out += object;
  *out += '"';
  AppendUsage(response.usage, out);
  *out += '}';
}

size_t StringsSize(const ChatResponse& response, const std::string& model) {
  size_t n = response.content.size() + response.id.size() + model.size();
  for (const ToolCall& c : response.tool_calls) n += c.id.size() + c.name.size() + c.arguments_json.size() + 64;
  return n + n / 8;  // room for escapes
}

}  // namespace

namespace internal {

bool ReadOpenAIChatResponseFast(std::string_view body, ChatResponse* out) { return ReadAnswer(body, true, out); }
bool ReadOpenAICompletionsResponseFast(std::string_view body, ChatResponse* out) {
  return ReadAnswer(body, false, out);
}

void AppendOpenAIToolCalls(const std::vector<ToolCall>& calls, std::string* out) {
  *out += '[';
  for (size_t i = 0; i < calls.size(); ++i) {
    const ToolCall& c = calls[i];
    *out += i ? ",{\"function\":{\"arguments\":" : "{\"function\":{\"arguments\":";
    AppendJsonString(c.arguments_json.empty() ? std::string_view("{}") : std::string_view(c.arguments_json), out);
    *out += ",\"name\":";
    AppendJsonString(c.name, out);
    *out += "},\"id\":";
    AppendJsonString(c.id, out);
    *out += ",\"type\":\"function\"}";
  }
  *out += ']';
}

}  // namespace internal

Result<ChatResponse> ParseOpenAIChatResponse(std::string_view body) {
  ChatResponse out;
  if (ReadOpenAIChatResponseFast(body, &out)) return out;
  return ParseOpenAIChatResponseDom(body);
}

Result<ChatResponse> ParseOpenAICompletionsResponse(std::string_view body) {
  ChatResponse out;
  if (ReadOpenAICompletionsResponseFast(body, &out)) return out;
  return ParseOpenAICompletionsResponseDom(body);
}

std::string BuildOpenAIChatResponse(const ChatResponse& response, const std::string& model) {
  std::string out;
  out.reserve(256 + StringsSize(response, model));
  out += "{\"choices\":[{\"finish_reason\":";
  AppendFinish(response.finish, &out);
  out += ",\"index\":0,\"logprobs\":null,\"message\":{\"content\":";
  if (!response.tool_calls.empty() && response.content.empty()) out += "null";
  else AppendJsonString(response.content, &out);
  out += ",\"role\":\"assistant\"";
  if (!response.tool_calls.empty()) {
    out += ",\"tool_calls\":";
    AppendOpenAIToolCalls(response.tool_calls, &out);
  }
  out += "}}]";
  AppendTail(response, "chatcmpl-", model, "chat.completion", &out);
  return out;
}

std::string BuildOpenAICompletionsResponse(const ChatResponse& response, const std::string& model) {
  std::string out;
  out.reserve(256 + StringsSize(response, model));
  out += "{\"choices\":[{\"finish_reason\":";
  AppendFinish(response.finish, &out);
  out += ",\"index\":0,\"logprobs\":null,\"text\":";
  AppendJsonString(response.content, &out);
  out += "}]";
  AppendTail(response, "cmpl-", model, "text_completion", &out);
  return out;
}

}  // namespace keel::gateway
