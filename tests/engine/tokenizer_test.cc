#include "keel/engine/tokenizer.h"

#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <string>
#include <unordered_map>
#include <vector>

#include "keel/core/mapped_file.h"
#include "test_util.h"

namespace keel::engine {
namespace {

Tokenizer LoadAidreams() {
  auto t = Tokenizer::Load(test::ModelsDir() + "/aidreams_tok512.bin", 512);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return std::move(t).value();
}

TEST(Tokenizer, LoadsAidreamsVocabulary) {
  Tokenizer t = LoadAidreams();
  EXPECT_EQ(t.vocab_size(), 512);
  EXPECT_EQ(t.max_token_length(), 10);
  EXPECT_EQ(t.piece(1), "\n<s>\n");
  EXPECT_EQ(t.piece(2), "\n</s>\n");
  EXPECT_EQ(t.piece(3), "<0x00>");
  EXPECT_EQ(t.piece(3 + 'A'), "<0x41>");
}

TEST(Tokenizer, EmptyTextIsJustBos) {
  Tokenizer t = LoadAidreams();
  EXPECT_EQ(t.Encode("", true), std::vector<int>{Tokenizer::kBos});
  EXPECT_TRUE(t.Encode("", false).empty());
  EXPECT_EQ(t.Encode("", true, true), (std::vector<int>{Tokenizer::kBos, Tokenizer::kEos}));
}

TEST(Tokenizer, DummyPrefixAndRoundTrip) {
  Tokenizer t = LoadAidreams();
  const std::string text = "Echoes of vectors unfold, a gentle hum of precision.";
  std::vector<int> ids = t.Encode(text, true);
  ASSERT_GT(ids.size(), 2u);
  EXPECT_EQ(ids[0], Tokenizer::kBos);
  // The dummy prefix space is merged into the first piece, and dropped again after BOS.
  EXPECT_EQ(t.piece(ids[1])[0], ' ');
  std::vector<int> body(ids.begin() + 1, ids.end());
  EXPECT_EQ(t.DecodeAll(body), text);
  // Merges shrink the sequence well below one token per byte.
  EXPECT_LT(body.size(), text.size() / 2);
}

TEST(Tokenizer, MergesPickHighestScoringPairFirst) {
  Tokenizer t = LoadAidreams();
  // Every adjacent pair left after encoding must not be a vocabulary piece (BPE ran to the end).
  std::vector<int> ids = t.Encode("as I sense the nodes, a gentle hum", false);
  for (size_t i = 0; i + 1 < ids.size(); ++i) {
    std::string merged = t.piece(ids[i]) + t.piece(ids[i + 1]);
    for (int id = 0; id < t.vocab_size(); ++id) ASSERT_NE(t.piece(id), merged) << "unmerged pair at " << i;
  }
}

// llama2.c's encoder as it was here before the heap: one piece per UTF-8 code point (byte
// fallback otherwise) after BOS and the dummy-prefix space, then rescan every pair and merge the
// best (highest score, leftmost on ties) until none merges. O(n^2), kept only as the reference.
std::vector<int> ReferenceEncode(const Tokenizer& t, std::string_view text, bool bos) {
  std::unordered_map<std::string, int> ids;
  for (int id = t.vocab_size() - 1; id >= 0; --id) ids[t.piece(id)] = id;  // first wins
  std::vector<int> tokens;
  if (bos) tokens.push_back(Tokenizer::kBos);
  auto push = [&](std::string_view s) {
    auto it = ids.find(std::string(s));
    if (it != ids.end()) {
      tokens.push_back(it->second);
      return;
    }
    for (unsigned char c : s) tokens.push_back(c + 3 < t.vocab_size() ? c + 3 : Tokenizer::kUnk);
  };
  if (!text.empty()) push(" ");
  for (size_t i = 0; i < text.size();) {
    size_t j = i + 1;
    while (j < text.size() && (static_cast<unsigned char>(text[j]) & 0xC0) == 0x80 && j - i < 4) ++j;
    push(text.substr(i, j - i));
    i = j;
  }
  for (;;) {
    float best_score = -1e10f;
    int best_id = -1;
    size_t best_idx = 0;
    for (size_t k = 0; k + 1 < tokens.size(); ++k) {
      auto it = ids.find(t.piece(tokens[k]) + t.piece(tokens[k + 1]));
      if (it != ids.end() && t.score(it->second) > best_score) {
        best_score = t.score(it->second);
        best_id = it->second;
        best_idx = k;
      }
    }
    if (best_id < 0) return tokens;
    tokens[best_idx] = best_id;
    tokens.erase(tokens.begin() + static_cast<std::ptrdiff_t>(best_idx) + 1);
  }
}

// The heap-ordered merges (O(n log n): a 1 MiB prompt no longer takes hours) give the quadratic
// encoder's tokens exactly, on held-out text and on random bytes, with both vocabularies that
// merge (aidreams_tok512 and stories' tok512).
TEST(Tokenizer, HeapOrderedMergesEqualTheQuadraticReference) {
  auto text = ReadFileToString(test::SharedDir() + "/data/text/val.txt");
  ASSERT_TRUE(text.ok()) << text.status().ToString();
  for (const std::string file : {"aidreams_tok512.bin", "tok512.bin"}) {
    auto t = Tokenizer::Load(test::ModelsDir() + "/" + file, 512);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    uint64_t x = 12345;
    auto next = [&x] { return x = x * 6364136223846793005ULL + 1442695040888963407ULL; };
    int merged = 0;
    for (int round = 0; round < 60; ++round) {
      std::string sample;
      if (round % 3 == 2) {
        for (int i = 0; i < 200; ++i) sample.push_back(static_cast<char>(next() >> 56));
      } else {
        const size_t len = 50 + (next() >> 40) % 600;
        sample = text->substr((next() >> 20) % (text->size() - len), len);
      }
      const std::vector<int> ids = t->Encode(sample, round % 2 == 0);
      ASSERT_EQ(ids, ReferenceEncode(*t, sample, round % 2 == 0)) << file << " round " << round;
      merged += ids.size() < sample.size() ? 1 : 0;
    }
    EXPECT_GT(merged, 30) << file << ": the samples must exercise merges";
  }
}

TEST(Tokenizer, UnknownCharactersFallBackToBytes) {
  Tokenizer t = LoadAidreams();
  const std::string text = "\xE2\x98\x83";  // U+2603 SNOWMAN, not in a 512-piece vocabulary
  std::vector<int> ids = t.Encode(text, false);
  // dummy prefix + 3 byte pieces
  ASSERT_EQ(ids.size(), 4u);
  EXPECT_EQ(ids[1], 0xE2 + 3);
  EXPECT_EQ(ids[2], 0x98 + 3);
  EXPECT_EQ(ids[3], 0x83 + 3);
  std::string decoded;
  for (size_t i = 1; i < ids.size(); ++i) decoded += t.Decode(ids[i - 1], ids[i]);
  EXPECT_EQ(decoded, text);
}

TEST(Tokenizer, MissingFileIsNotFound) {
  auto t = Tokenizer::Load("/nonexistent/tok.bin", 512);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kNotFound);
}

TEST(Tokenizer, TruncatedFileNamesFileAndOffset) {
  auto bytes = ReadFileToString(test::ModelsDir() + "/aidreams_tok512.bin");
  ASSERT_TRUE(bytes.ok());
  test::TempDir dir;
  for (size_t cut : {size_t{0}, size_t{3}, size_t{100}, bytes->size() - 1}) {
    std::string path = dir.file("tok" + std::to_string(cut) + ".bin");
    std::ofstream(path, std::ios::binary).write(bytes->data(), static_cast<std::streamsize>(cut));
    auto t = Tokenizer::Load(path, 512);
    ASSERT_FALSE(t.ok()) << "cut at " << cut;
    EXPECT_EQ(t.status().code(), StatusCode::kCorruption);
    EXPECT_NE(t.status().message().find(path), std::string::npos);
    EXPECT_NE(t.status().message().find("offset"), std::string::npos);
  }
}

TEST(Tokenizer, HostileLengthIsRejected) {
  test::TempDir dir;
  std::string path = dir.file("bad.bin");
  std::string bytes(4 + 8, '\0');
  int32_t max_len = 10, len = 1 << 30;
  float score = 0;
  std::memcpy(bytes.data(), &max_len, 4);
  std::memcpy(bytes.data() + 4, &score, 4);
  std::memcpy(bytes.data() + 8, &len, 4);
  ASSERT_TRUE(WriteFileAtomic(path, bytes).ok());
  auto t = Tokenizer::Load(path, 3);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("offset 8"), std::string::npos) << t.status().ToString();
}

// A tokenizer with more pieces than the model's vocabulary belongs to another model: its extra
// pieces used to be ignored and the text encoded to ids the model never learned.
TEST(Tokenizer, MorePiecesThanTheVocabularyIsRefused) {
  auto t = Tokenizer::Load(test::ModelsDir() + "/aidreams_tok512.bin", 354);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(t.status().message().find("bytes after the 354 tokens"), std::string::npos) << t.status().message();
  EXPECT_TRUE(Tokenizer::Load(test::ModelsDir() + "/aidreams_tok512.bin", 512).ok());
}

TEST(Tokenizer, WriteThenLoadRoundTrips) {
  test::TempDir dir;
  std::vector<std::string> pieces = {"<unk>", "\n<s>\n", "\n</s>\n", "a", "b", "ab"};
  std::vector<float> scores = {0, 0, 0, -1, -2, 5};
  ASSERT_TRUE(Tokenizer::Write(dir.file("t.bin"), pieces, scores).ok());
  auto t = Tokenizer::Load(dir.file("t.bin"), 6);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->piece(5), "ab");
  EXPECT_FLOAT_EQ(t->score(5), 5.0f);
}

}  // namespace
}  // namespace keel::engine
