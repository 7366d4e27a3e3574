// Token counting in the gateway's data path. A Keel model's own tokenizer counts exactly;
// for vendor models without a local tokenizer (no tiktoken rank files ship in Debian) a
// documented estimator is used, and the vendor's reported usage replaces the estimate in the
// ledger when it arrives.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "keel/core/status.h"
#include "keel/gateway/chat.h"

namespace keel::gateway {

class TokenCounter {
 public:
  virtual ~TokenCounter() = default;
  virtual int64_t Count(std::string_view text) const = 0;
  virtual const char* name() const = 0;  // "estimator" or "keel-tokenizer"
};

// The estimator: text is split into runs of letters, digits, whitespace and other bytes.
// A letter run costs ceil(len/4) tokens (at least 1), a digit run ceil(len/3) (BPE vocabularies
// of the cl100k/o200k family split numbers into groups of up to three digits), a whitespace run
// is free when a word follows (the space is part of the next token) and 1 otherwise, every other
// ASCII byte costs 1, and every non-ASCII code point costs 1. On English prose this lands within
// about ±15 % of cl100k counts; it is an estimate, reconciled by the vendor's usage.
std::unique_ptr<TokenCounter> MakeEstimator();

// Exact counts with a llama2.c tokenizer.bin (the tokenizer `keel serve` uses).
Result<std::unique_ptr<TokenCounter>> MakeKeelTokenizerCounter(const std::string& path, int vocab_size);

// Input tokens of a whole request: system prompt, every message (content, tool calls, tool
// results), tool definitions, plus a fixed overhead of 3 tokens per message and 3 for the reply
// priming (the chat-template framing tokens that OpenAI documents for its chat models).
int64_t CountRequestTokens(const TokenCounter& counter, const ChatRequest& request);

}  // namespace keel::gateway
