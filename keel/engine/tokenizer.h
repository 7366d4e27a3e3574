// Tokenizer: llama2.c's tokenizer.bin format (SentencePiece-style BPE with byte fallback).
// Encoding follows llama2.c's run.c exactly: optional BOS, a dummy-prefix space when the text
// is non-empty, one piece per UTF-8 code point (byte fallback <0xXX> = id byte+3 otherwise),
// then repeated merges of the adjacent pair whose merged piece has the highest score.
// Immutable after loading; safe to use from any thread.
#pragma once

#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "keel/core/status.h"

namespace keel::engine {

class Tokenizer {
 public:
  static constexpr int kUnk = 0;
  static constexpr int kBos = 1;
  static constexpr int kEos = 2;

  // Reads `path` holding `vocab_size` tokens. Corruption names the file and offset where it
  // is truncated or a length is impossible.
  static Result<Tokenizer> Load(const std::string& path, int vocab_size);

  std::vector<int> Encode(std::string_view text, bool bos, bool eos = false) const;
  // The bytes token `token` stands for when it follows `prev` (llama2.c rules: a leading space
  // is dropped after BOS; <0xXX> pieces give the raw byte).
  std::string Decode(int prev, int token) const;
  // Decodes a whole sequence (as if preceded by BOS).
  std::string DecodeAll(const std::vector<int>& tokens) const;

  int vocab_size() const { return static_cast<int>(pieces_.size()); }
  const std::string& piece(int id) const { return pieces_[id]; }
  float score(int id) const { return scores_[id]; }
  int max_token_length() const { return max_token_length_; }
  const std::string& path() const { return path_; }

  // Writes a tokenizer in llama2.c format (used by convert and make-model).
  static Status Write(const std::string& path, const std::vector<std::string>& pieces,
                      const std::vector<float>& scores);

 private:
  int Lookup(std::string_view piece) const;
  void MergePairs(std::vector<int>* tokens) const;
  std::string path_;
  std::vector<std::string> pieces_;
  std::vector<float> scores_;
  std::unordered_map<std::string, int> ids_;
  int max_token_length_ = 0;
};

}  // namespace keel::engine
