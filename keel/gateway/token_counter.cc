#include "keel/gateway/token_counter.h"

#include "keel/engine/tokenizer.h"

namespace keel::gateway {
namespace {

bool IsLetter(unsigned char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
bool IsDigit(unsigned char c) { return c >= '0' && c <= '9'; }
bool IsSpace(unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

class Estimator final : public TokenCounter {
 public:
  int64_t Count(std::string_view text) const override {
    int64_t tokens = 0;
    size_t i = 0;
    const size_t n = text.size();
    while (i < n) {
      const auto c = static_cast<unsigned char>(text[i]);
      size_t j = i + 1;
      if (IsLetter(c)) {
        while (j < n && IsLetter(static_cast<unsigned char>(text[j]))) ++j;
        tokens += static_cast<int64_t>((j - i + 3) / 4);
      } else if (IsDigit(c)) {
        while (j < n && IsDigit(static_cast<unsigned char>(text[j]))) ++j;
        tokens += static_cast<int64_t>((j - i + 2) / 3);
      } else if (IsSpace(c)) {
        while (j < n && IsSpace(static_cast<unsigned char>(text[j]))) ++j;
        // A single space before a word belongs to that word's token.
        if (j == n || !(IsLetter(static_cast<unsigned char>(text[j])) && j - i == 1)) tokens += 1;
      } else if (c < 0x80) {
        tokens += 1;
      } else {
        // One token per code point: skip continuation bytes.
        while (j < n && (static_cast<unsigned char>(text[j]) & 0xC0) == 0x80) ++j;
        tokens += 1;
      }
      i = j;
    }
    return tokens;
  }
  const char* name() const override { return "estimator"; }
};

class KeelTokenizerCounter final : public TokenCounter {
 public:
  explicit KeelTokenizerCounter(engine::Tokenizer tokenizer) : tokenizer_(std::move(tokenizer)) {}
  int64_t Count(std::string_view text) const override {
    if (text.empty()) return 0;
    return static_cast<int64_t>(tokenizer_.Encode(text, /*bos=*/false).size());
  }
  const char* name() const override { return "keel-tokenizer"; }

 private:
  engine::Tokenizer tokenizer_;
};

}  // namespace

std::unique_ptr<TokenCounter> MakeEstimator() { return std::make_unique<Estimator>(); }

Result<std::unique_ptr<TokenCounter>> MakeKeelTokenizerCounter(const std::string& path, int vocab_size) {
  auto tok = engine::Tokenizer::Load(path, vocab_size);
  if (!tok.ok()) return tok.status();
  return std::unique_ptr<TokenCounter>(std::make_unique<KeelTokenizerCounter>(std::move(tok).value()));
}

int64_t CountRequestTokens(const TokenCounter& counter, const ChatRequest& request) {
  constexpr int64_t kPerMessage = 3;
  constexpr int64_t kReplyPriming = 3;
  int64_t total = kReplyPriming;
  if (!request.system.empty()) total += kPerMessage + counter.Count(request.system);
  if (!request.prompt.empty()) total += counter.Count(request.prompt);
  for (const Message& m : request.messages) {
    total += kPerMessage + counter.Count(m.content);
    for (const ToolCall& call : m.tool_calls) total += counter.Count(call.name) + counter.Count(call.arguments_json);
  }
  for (const Tool& t : request.tools) {
    total += counter.Count(t.name) + counter.Count(t.description) + counter.Count(t.parameters_json);
  }
  return total;
}

}  // namespace keel::gateway
