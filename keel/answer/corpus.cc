#include "keel/answer/corpus.h"

#include <fstream>

#include "keel/answer/quality.h"
#include "keel/vector/texmex.h"

namespace keel::answer {
namespace {

bool Blank(std::string_view line) {
  for (char c : line) {
    if (c != ' ' && c != '\t' && c != '\r' && c != '\f' && c != '\v') return false;
  }
  return true;
}

}  // namespace

Result<Corpus> Corpus::Parse(std::string_view text) {
  Corpus c;
  std::string cur;
  size_t pos = 0;
  while (pos <= text.size()) {
    const size_t nl = text.find('\n', pos);
    std::string_view line = text.substr(pos, nl == std::string_view::npos ? std::string_view::npos : nl - pos);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (Blank(line)) {
      if (!cur.empty()) c.docs_.push_back(std::move(cur));
      cur.clear();
    } else {
      if (!cur.empty()) cur.push_back('\n');
      cur.append(line);
    }
    if (nl == std::string_view::npos) break;
    pos = nl + 1;
  }
  if (!cur.empty()) c.docs_.push_back(std::move(cur));
  if (c.docs_.empty()) return Status::InvalidArgument("corpus has no documents (documents are separated by blank lines)");
  return c;
}

Result<Corpus> Corpus::Load(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return Status::IOError("cannot read corpus " + path);
  const std::streamoff size = in.tellg();
  if (size < 0) return Status::IOError("cannot read corpus " + path);
  if (static_cast<size_t>(size) > kMaxCorpusBytes) {
    return Status::InvalidArgument("corpus " + path + " is larger than " + std::to_string(kMaxCorpusBytes) + " bytes");
  }
  std::string text(static_cast<size_t>(size), '\0');
  in.seekg(0);
  if (!in.read(text.data(), size)) return Status::IOError("cannot read corpus " + path);
  auto c = Parse(text);
  if (!c.ok()) return Status::InvalidArgument("corpus " + path + ": " + c.status().message());
  return c;
}

std::string Question(std::string_view doc) {
  std::string flat;
  for (char c : doc) {
    const bool space = c == ' ' || c == '\n' || c == '\t' || c == '\r';
    if (space) {
      if (!flat.empty() && flat.back() != ' ') flat.push_back(' ');
    } else {
      flat.push_back(c);
    }
  }
  while (!flat.empty() && flat.back() == ' ') flat.pop_back();
  for (size_t i = 0; i < flat.size(); ++i) {
    const char c = flat[i];
    if ((c == '.' || c == '?' || c == '!') && (i + 1 == flat.size() || flat[i + 1] == ' ')) {
      flat.resize(i + 1);
      break;
    }
  }
  if (flat.size() <= kMaxQuestionBytes) return flat;
  size_t cut = flat.rfind(' ', kMaxQuestionBytes);
  if (cut == std::string::npos || cut == 0) {
    cut = kMaxQuestionBytes;
    // Do not split a UTF-8 sequence: back up over continuation bytes.
    while (cut > 0 && (static_cast<unsigned char>(flat[cut]) & 0xC0) == 0x80) --cut;
  }
  flat.resize(cut);
  return flat;
}

Result<std::vector<EvalQuery>> LoadEvalSet(const std::string& vectors_dir, const Corpus& corpus) {
  KEEL_ASSIGN_OR_RETURN(vector::VectorSet queries, vector::ReadBvecs(vectors_dir + "/bigann10k_query.bvecs"));
  KEEL_ASSIGN_OR_RETURN(vector::IdSet truth, vector::ReadIvecs(vectors_dir + "/bigann10k_groundtruth.ivecs"));
  if (queries.count != truth.count) {
    return Status::InvalidArgument("eval set: " + std::to_string(queries.count) + " queries but " +
                                   std::to_string(truth.count) + " ground-truth records");
  }
  if (truth.dim < kRecallAt) {
    return Status::InvalidArgument("eval set: ground truth has " + std::to_string(truth.dim) + " ids per query, need " +
                                   std::to_string(kRecallAt));
  }
  std::vector<EvalQuery> out;
  out.reserve(static_cast<size_t>(queries.count));
  for (int64_t q = 0; q < queries.count; ++q) {
    EvalQuery e;
    e.query = static_cast<int>(q);
    const float* v = queries.values.data() + q * queries.dim;
    e.vector.assign(v, v + queries.dim);
    const int32_t* t = truth.values.data() + q * truth.dim;
    e.truth.assign(t, t + kRecallAt);
    if (e.truth[0] < 0) return Status::InvalidArgument("eval set: negative ground-truth id for query " + std::to_string(q));
    e.doc = corpus.DocFor(static_cast<uint64_t>(e.truth[0]));
    e.question = Question(corpus.doc(e.doc));
    out.push_back(std::move(e));
  }
  return out;
}

}  // namespace keel::answer
