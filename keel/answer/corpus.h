// The corpus `keel answer` retrieves from, and its evaluation set (docs/answer.md, "Corpus").
//
// Corpus: the documents of a text file separated by blank lines (one or more lines holding only
// whitespace), e.g. $KEEL_SHARED/data/text/val.txt (4,134 documents). There is no text-embedding
// model that matches SIFT, so the vectors stand in for documents: vector id i (of the 10,000 SIFT
// base vectors in bigann10k_base.bvecs) stands for document i mod number_of_documents, and the
// client sends the query's embedding itself.
//
// Evaluation set: the 100 SIFT queries of bigann10k_query.bvecs with their exact ground truth
// (bigann10k_groundtruth.ivecs, first 10 ids kept). Query q asks about the document of its true
// nearest neighbour: question(q) = Question(document(truth[q][0] mod docs)), so a state that
// retrieves well puts the document the question came from into the prompt. Deterministic.
//
// Thread safety: a loaded Corpus is immutable and may be shared.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/status.h"

namespace keel::answer {

inline constexpr size_t kMaxCorpusBytes = size_t{256} << 20;  // a larger file is refused
inline constexpr size_t kMaxQuestionBytes = 80;               // Question() cuts here

class Corpus {
 public:
  // Splits `text` into documents (see above). Lines keep their bytes (a trailing '\r' is
  // dropped); a document's lines are joined with '\n'. InvalidArgument when there is none.
  static Result<Corpus> Parse(std::string_view text);
  // Reads and parses `path`: IOError naming it when unreadable, InvalidArgument naming it when
  // larger than kMaxCorpusBytes or without documents.
  static Result<Corpus> Load(const std::string& path);

  size_t size() const { return docs_.size(); }
  const std::string& doc(size_t i) const { return docs_[i]; }
  // The document vector id `id` stands for: id mod size().
  size_t DocFor(uint64_t id) const { return static_cast<size_t>(id % docs_.size()); }

 private:
  std::vector<std::string> docs_;
};

// The question asked about a document: its first sentence (whitespace runs collapsed to one
// space, up to and including the first '.', '?' or '!' followed by a space or the end), cut to at
// most kMaxQuestionBytes at a word boundary (at a byte boundary when one word is longer).
std::string Question(std::string_view doc);

struct EvalQuery {
  int query = 0;                // index in the query file
  std::vector<float> vector;    // 128 floats (SIFT components 0..255)
  std::vector<int32_t> truth;   // the first 10 ground-truth base ids, nearest first
  size_t doc = 0;               // truth[0] mod corpus.size()
  std::string question;         // Question(corpus.doc(doc))
};

// Loads the evaluation set from `vectors_dir` (bigann10k_query.bvecs and
// bigann10k_groundtruth.ivecs). Errors from the readers name the file; InvalidArgument when the
// two files do not hold the same number of records or the truth has fewer than 10 ids.
Result<std::vector<EvalQuery>> LoadEvalSet(const std::string& vectors_dir, const Corpus& corpus);

}  // namespace keel::answer
