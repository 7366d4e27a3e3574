// llama2.c checkpoint loader (legacy "version 0" format; see shared/data/README.md).
#include <cstring>
#include <string>

#include "keel/core/mapped_file.h"
#include "keel/engine/model.h"

namespace keel::engine {

namespace {

// Walks the mapped weights in file order, handing out views and naming the offset on failure.
class Cursor {
 public:
  Cursor(const MappedFile& f, size_t offset) : f_(f), off_(offset) {}
  Result<TensorView> Take(const char* name, int64_t rows, int64_t cols) {
    size_t bytes = static_cast<size_t>(rows) * static_cast<size_t>(cols) * 4;
    if (off_ > f_.size() || f_.size() - off_ < bytes) {
      return Status::Corruption(f_.path() + ": truncated at offset " + std::to_string(f_.size()) +
                                " while reading " + name + " (needs bytes " + std::to_string(off_) +
                                ".." + std::to_string(off_ + bytes) + ")");
    }
    TensorView v{f_.data() + off_, DType::kF32, rows, cols};
    off_ += bytes;
    return v;
  }
  size_t offset() const { return off_; }

 private:
  const MappedFile& f_;
  size_t off_;
};

}  // namespace

Result<Model> LoadLlama2c(const std::string& path) {
  KEEL_ASSIGN_OR_RETURN(std::shared_ptr<MappedFile> file, MappedFile::Open(path));
  if (file->size() < 28) {
    return Status::Corruption(path + ": truncated at offset " + std::to_string(file->size()) +
                              ": a llama2.c header needs 28 bytes");
  }
  int32_t h[7];
  std::memcpy(h, file->data(), sizeof(h));
  Model m;
  ModelConfig& c = m.config;
  c.arch = "llama";
  c.dim = h[0];
  c.hidden_dim = h[1];
  c.n_layers = h[2];
  c.n_heads = h[3];
  c.n_kv_heads = h[4];
  c.tied_embeddings = h[5] > 0;
  c.vocab_size = h[5] < 0 ? -h[5] : h[5];
  c.max_seq_len = h[6];
  c.rope_style = RopeStyle::kInterleaved;
  if (h[5] == INT32_MIN) c.vocab_size = 0;
  if (Status s = c.Validate(); !s.ok()) {
    return Status::Corruption(path + ": bad header at offset 0: " + s.message());
  }

  const int64_t d = c.dim, hd = c.hidden_dim, kv = c.kv_dim(), L = c.n_layers, V = c.vocab_size;
  Cursor cur(*file, 28);
  KEEL_ASSIGN_OR_RETURN(m.embedding, cur.Take("token_embedding", V, d));
  KEEL_ASSIGN_OR_RETURN(TensorView rms_att, cur.Take("rms_att", L, d));
  KEEL_ASSIGN_OR_RETURN(TensorView wq, cur.Take("wq", L * d, d));
  KEEL_ASSIGN_OR_RETURN(TensorView wk, cur.Take("wk", L * kv, d));
  KEEL_ASSIGN_OR_RETURN(TensorView wv, cur.Take("wv", L * kv, d));
  KEEL_ASSIGN_OR_RETURN(TensorView wo, cur.Take("wo", L * d, d));
  KEEL_ASSIGN_OR_RETURN(TensorView rms_ffn, cur.Take("rms_ffn", L, d));
  KEEL_ASSIGN_OR_RETURN(TensorView w1, cur.Take("w1", L * hd, d));
  KEEL_ASSIGN_OR_RETURN(TensorView w2, cur.Take("w2", L * d, hd));
  KEEL_ASSIGN_OR_RETURN(TensorView w3, cur.Take("w3", L * hd, d));
  KEEL_ASSIGN_OR_RETURN(TensorView rms_final, cur.Take("rms_final", 1, d));
  const int64_t half = c.head_dim() / 2;
  KEEL_ASSIGN_OR_RETURN(TensorView freq_re, cur.Take("freq_cis_real", c.max_seq_len, half));
  KEEL_ASSIGN_OR_RETURN(TensorView freq_im, cur.Take("freq_cis_imag", c.max_seq_len, half));
  (void)freq_re;
  (void)freq_im;
  if (c.tied_embeddings) {
    m.classifier = m.embedding;
  } else {
    KEEL_ASSIGN_OR_RETURN(m.classifier, cur.Take("wcls", V, d));
  }
  if (cur.offset() != file->size()) {
    return Status::Corruption(path + ": " + std::to_string(file->size() - cur.offset()) +
                              " unexpected trailing bytes at offset " + std::to_string(cur.offset()) +
                              " (header says dim=" + std::to_string(c.dim) + ", layers=" +
                              std::to_string(c.n_layers) + ", vocab=" + std::to_string(h[5]) + ")");
  }

  auto slice = [](const TensorView& all, int64_t layer, int64_t rows) {
    TensorView v = all;
    v.data = static_cast<const uint8_t*>(all.data) + layer * rows * all.cols * 4;
    v.rows = rows;
    return v;
  };
  m.layers.resize(L);
  for (int64_t l = 0; l < L; ++l) {
    LayerWeights& w = m.layers[l];
    w.attn_norm = static_cast<const float*>(rms_att.data) + l * d;
    w.ffn_norm = static_cast<const float*>(rms_ffn.data) + l * d;
    w.wq = slice(wq, l, d);
    w.wk = slice(wk, l, kv);
    w.wv = slice(wv, l, kv);
    w.wo = slice(wo, l, d);
    w.w1 = slice(w1, l, hd);
    w.w2 = slice(w2, l, d);
    w.w3 = slice(w3, l, hd);
  }
  m.final_norm = static_cast<const float*>(rms_final.data);
  m.source = path;
  m.format = "llama2c";
  m.checksum = Xxh3_128(file->data(), file->size());
  m.storage.push_back(file);
  m.weight_files.push_back(WeightFile{path, file->data(), file->size()});
  return m;
}

}  // namespace keel::engine
