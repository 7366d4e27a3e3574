#include "keel/engine/tokenizer.h"

#include <cstdio>
#include <cstring>
#include <queue>

#include "keel/core/mapped_file.h"

namespace keel::engine {

Result<Tokenizer> Tokenizer::Load(const std::string& path, int vocab_size) {
  if (vocab_size <= 0) return Status::InvalidArgument(path + ": vocab_size must be positive");
  KEEL_ASSIGN_OR_RETURN(std::string bytes, ReadFileToString(path));
  const size_t size = bytes.size();
  size_t off = 0;
  auto truncated = [&](const char* what, int id) {
    return Status::Corruption(path + ": truncated at offset " + std::to_string(size) + " reading " + what +
                              " of token " + std::to_string(id) + " (of " + std::to_string(vocab_size) +
                              " expected)");
  };
  Tokenizer t;
  t.path_ = path;
  if (size < 4) return truncated("max_token_length", -1);
  int32_t max_len;
  std::memcpy(&max_len, bytes.data(), 4);
  off = 4;
  if (max_len <= 0 || max_len > 4096) {
    return Status::Corruption(path + ": bad max_token_length " + std::to_string(max_len) + " at offset 0");
  }
  t.max_token_length_ = max_len;
  t.pieces_.reserve(vocab_size);
  t.scores_.reserve(vocab_size);
  for (int id = 0; id < vocab_size; ++id) {
    if (size - off < 8) return truncated("score and length", id);
    float score;
    int32_t len;
    std::memcpy(&score, bytes.data() + off, 4);
    std::memcpy(&len, bytes.data() + off + 4, 4);
    if (len < 0 || len > 4096) {
      return Status::Corruption(path + ": impossible piece length " + std::to_string(len) + " at offset " +
                                std::to_string(off + 4) + " (token " + std::to_string(id) + ")");
    }
    off += 8;
    if (size - off < static_cast<size_t>(len)) return truncated("piece bytes", id);
    t.pieces_.emplace_back(bytes.data() + off, static_cast<size_t>(len));
    t.scores_.push_back(score);
    off += len;
  }
  // More entries than the model's vocabulary: a tokenizer of another model (it would encode to
  // ids the model never learned, and decode its ids as the wrong pieces).
  if (off != size) {
    return Status::InvalidArgument(path + ": " + std::to_string(size - off) + " bytes after the " +
                                   std::to_string(vocab_size) +
                                   " tokens of the model's vocabulary: a tokenizer for a larger vocabulary");
  }
  for (int id = 0; id < vocab_size; ++id) t.ids_.emplace(t.pieces_[id], id);  // first wins
  return t;
}

int Tokenizer::Lookup(std::string_view piece) const {
  auto it = ids_.find(std::string(piece));
  return it == ids_.end() ? -1 : it->second;
}

// Greedy merges, as llama2.c does them: always the adjacent pair whose merged piece scores
// highest, the leftmost on ties, until no pair merges. llama2.c rescans every pair after each
// merge, O(n^2) in the text: a 1 MiB prompt took hours before any length check could refuse it.
// Here the candidate pairs sit in a heap over a linked list, O(n log n) for the same merges: a
// popped pair is used only if both of its tokens are still there and unchanged.
void Tokenizer::MergePairs(std::vector<int>* tokens) const {
  std::vector<int>& tok = *tokens;
  const int n = static_cast<int>(tok.size());
  if (n < 2) return;
  std::vector<int> prev(n), next(n);
  for (int i = 0; i < n; ++i) {
    prev[i] = i - 1;
    next[i] = i + 1 < n ? i + 1 : -1;
  }
  struct Candidate {
    float score;
    int left, right, left_token, right_token, merged;
    bool operator<(const Candidate& o) const {  // the heap's top: highest score, then leftmost
      return score != o.score ? score < o.score : left > o.left;
    }
  };
  std::priority_queue<Candidate> heap;
  std::string buf;
  auto offer = [&](int left, int right) {
    if (right < 0) return;
    buf.assign(pieces_[tok[left]]);
    buf.append(pieces_[tok[right]]);
    const int id = Lookup(buf);
    if (id >= 0 && scores_[id] > -1e10f) heap.push({scores_[id], left, right, tok[left], tok[right], id});
  };
  for (int i = 0; i + 1 < n; ++i) offer(i, i + 1);
  std::vector<bool> alive(n, true);
  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    if (!alive[c.left] || !alive[c.right] || next[c.left] != c.right || tok[c.left] != c.left_token ||
        tok[c.right] != c.right_token) {
      continue;  // one side merged since this pair was offered
    }
    tok[c.left] = c.merged;
    alive[c.right] = false;
    next[c.left] = next[c.right];
    if (next[c.right] >= 0) prev[next[c.right]] = c.left;
    if (prev[c.left] >= 0) offer(prev[c.left], c.left);
    offer(c.left, next[c.left]);
  }
  size_t out = 0;
  for (int i = 0; i < n; ++i) {
    if (alive[i]) tok[out++] = tok[i];
  }
  tok.resize(out);
}

std::vector<int> Tokenizer::Encode(std::string_view text, bool bos, bool eos) const {
  std::vector<int> tokens;
  tokens.reserve(text.size() + 3);
  if (bos) tokens.push_back(kBos);
  auto push_bytes = [&](std::string_view s) {
    int id = Lookup(s);
    if (id >= 0) {
      tokens.push_back(id);
      return;
    }
    for (unsigned char c : s) {
      int b = c + 3;  // byte fallback: <0x00> is id 3
      tokens.push_back(b < vocab_size() ? b : kUnk);
    }
  };
  if (!text.empty()) push_bytes(" ");  // SentencePiece's dummy prefix
  // One piece per UTF-8 code point (at most 4 bytes), as llama2.c groups them.
  size_t i = 0;
  while (i < text.size()) {
    size_t j = i + 1;
    while (j < text.size() && (static_cast<unsigned char>(text[j]) & 0xC0) == 0x80 && j - i < 4) ++j;
    push_bytes(text.substr(i, j - i));
    i = j;
  }
  MergePairs(&tokens);  // BOS included, as llama2.c merges it
  if (eos) tokens.push_back(kEos);
  return tokens;
}

std::string Tokenizer::Decode(int prev, int token) const {
  if (token < 0 || token >= vocab_size()) return {};
  std::string_view piece = pieces_[token];
  if (prev == kBos && !piece.empty() && piece[0] == ' ') piece.remove_prefix(1);
  unsigned int byte;
  if (piece.size() == 6 && piece.substr(0, 3) == "<0x" && piece[5] == '>' &&
      std::sscanf(std::string(piece).c_str(), "<0x%02X>", &byte) == 1) {
    return std::string(1, static_cast<char>(byte));
  }
  return std::string(piece);
}

std::string Tokenizer::DecodeAll(const std::vector<int>& tokens) const {
  std::string out;
  int prev = kBos;
  for (int t : tokens) {
    out += Decode(prev, t);
    prev = t;
  }
  return out;
}

Status Tokenizer::Write(const std::string& path, const std::vector<std::string>& pieces,
                        const std::vector<float>& scores) {
  if (pieces.size() != scores.size()) return Status::InvalidArgument("tokenizer: pieces and scores differ in length");
  int32_t max_len = 1;
  for (const auto& p : pieces) max_len = std::max<int32_t>(max_len, static_cast<int32_t>(p.size()));
  std::string out;
  out.append(reinterpret_cast<const char*>(&max_len), 4);
  for (size_t i = 0; i < pieces.size(); ++i) {
    int32_t len = static_cast<int32_t>(pieces[i].size());
    out.append(reinterpret_cast<const char*>(&scores[i]), 4);
    out.append(reinterpret_cast<const char*>(&len), 4);
    out.append(pieces[i]);
  }
  return WriteFileAtomic(path, out);
}

}  // namespace keel::engine
