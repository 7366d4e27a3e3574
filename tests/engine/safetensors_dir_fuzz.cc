// libFuzzer target for Hugging Face model directories: LoadSafetensors (config.json parsing,
// ModelConfig::Validate, SafetensorsFile::Open, tensor binding; dense and MoE architectures)
// and DescribeModel. Built by CMake with clang when available; see the "Fuzzing" block in
// CMakeLists.txt.
//
// Input: the bytes up to the first '\0' are config.json, the rest is model.safetensors. Both are
// written into one scratch directory per process (created once, overwritten each run). When the
// safetensors header's length prefix does not match the JSON object that starts at byte 8, the
// input is loaded a second time with the prefix "resealed" to that object's length, so that
// mutations which grow or shrink the header still reach the per-tensor checks.
//
// Properties (any violation calls abort()):
//   1. A failed load is InvalidArgument or Corruption, its message starts with the file's path
//      (or the directory's, for a tensor missing from every file), and a Corruption in
//      model.safetensors names a byte offset.
//      KEEL_FUZZ_VERBOSE=1 prints each load error (to read what a corpus exercises).
//   2. A successful load has a valid config, every view the config implies (experts, routers,
//      shared experts included) with the config's shape and lying wholly inside a mapped weight
//      file, every widened vector readable to its last element, and DescribeModel reports the
//      config's arch and ParameterCount.
//   3. Nothing reads outside the file or the heap (the first and last byte of every view is read:
//      ASan/UBSan), nothing throws, and nothing allocates beyond what the input's size implies
//      (-rss_limit_mb in the CTest run).
// Seeds are tiny `keel make-model` models (tests/engine/fuzz_seeds/safetensors_dir): llama,
// qwen2, mixtral, olmoe, qwen2_moe; F32/F16/BF16; tied and untied; one layer, dim 16, 4 experts
// of width 8, top-2. Deeper inputs than libFuzzer's max_len (nesting 100k+) are covered by unit
// tests in safetensors_test.cc and convert_test.cc. Longer runs by hand:
//   build/safetensors_dir_fuzz -max_total_time=600 /tmp/stcorpus tests/engine/fuzz_seeds/safetensors_dir
#include <fcntl.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>

#include "keel/core/mapped_file.h"
#include "keel/engine/convert.h"
#include "keel/engine/model.h"

namespace ke = keel::engine;

namespace {

void Check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "safetensors_dir_fuzz: %s\n", what);
    std::abort();
  }
}

void RemoveScratch();

// The per-process scratch directory, created on first use and removed at exit.
const std::string& ScratchDir() {
  static const std::string dir = [] {
    const char* tmp = std::getenv("TMPDIR");
    std::string tmpl = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") +
                       "/keel_safetensors_dir_fuzz.XXXXXX";
    Check(::mkdtemp(tmpl.data()) != nullptr, "cannot create the scratch directory");
    return tmpl;
  }();
  static const bool registered = (std::atexit(RemoveScratch), true);
  (void)registered;
  return dir;
}

void RemoveScratch() {
  const std::string& dir = ScratchDir();
  std::remove((dir + "/config.json").c_str());
  std::remove((dir + "/model.safetensors").c_str());
  ::rmdir(dir.c_str());
}

void WriteFile(const std::string& path, std::string_view bytes) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  Check(fd >= 0, "cannot open a scratch file");
  Check(keel::WriteAllToFd(fd, path, bytes.data(), bytes.size()).ok(), "cannot write a scratch file");
  ::close(fd);
}

// Reads the first and last byte of `v` after checking it lies inside one mapped weight file.
void TouchView(const ke::Model& m, const ke::TensorView& v, int64_t rows, int64_t cols,
               const char* what) {
  if (v.empty() || v.rows != rows || v.cols != cols) {
    std::fprintf(stderr, "safetensors_dir_fuzz: %s is [%lld, %lld] (data %p), config implies [%lld, %lld]\n",
                 what, static_cast<long long>(v.rows), static_cast<long long>(v.cols), v.data,
                 static_cast<long long>(rows), static_cast<long long>(cols));
    std::abort();
  }
  const auto* p = static_cast<const uint8_t*>(v.data);
  const size_t n = v.bytes();
  bool inside = false;
  for (const ke::WeightFile& f : m.weight_files) {
    if (p >= f.base && p <= f.base + f.size && n <= static_cast<size_t>(f.base + f.size - p)) inside = true;
  }
  if (!inside) {
    std::fprintf(stderr, "safetensors_dir_fuzz: %s (%zu bytes) is not inside a mapped weight file\n", what, n);
    std::abort();
  }
  volatile uint8_t first = p[0], last = p[n - 1];
  (void)first;
  (void)last;
}

// Widened vectors are heap copies the Model owns: reading the last element lets ASan check the size.
void TouchF32(const float* p, int64_t n, const char* what) {
  if (p == nullptr) {
    std::fprintf(stderr, "safetensors_dir_fuzz: %s is missing\n", what);
    std::abort();
  }
  volatile float first = p[0], last = p[n - 1];
  (void)first;
  (void)last;
}

void TouchExpert(const ke::Model& m, const ke::ExpertWeights& e, int64_t dim, int64_t hidden) {
  TouchView(m, e.w1, hidden, dim, "expert w1 (gate)");
  TouchView(m, e.w2, dim, hidden, "expert w2 (down)");
  TouchView(m, e.w3, hidden, dim, "expert w3 (up)");
}

void CheckLoaded(const ke::Model& m) {
  const ke::ModelConfig& c = m.config;
  Check(c.Validate().ok(), "a loaded model's config does not validate");
  Check(static_cast<int>(m.layers.size()) == c.n_layers, "layers.size() != n_layers");
  Check(!m.weight_files.empty(), "no weight files");
  const int64_t d = c.dim, kv = c.kv_dim(), v = c.vocab_size;
  TouchView(m, m.embedding, v, d, "embedding");
  TouchView(m, m.classifier, v, d, "classifier");
  Check((m.classifier.data == m.embedding.data) == c.tied_embeddings, "tied_embeddings disagrees with the views");
  TouchF32(m.final_norm, d, "final norm");
  for (const ke::LayerWeights& l : m.layers) {
    TouchF32(l.attn_norm, d, "attn_norm");
    TouchF32(l.ffn_norm, d, "ffn_norm");
    TouchView(m, l.wq, d, d, "wq");
    TouchView(m, l.wk, kv, d, "wk");
    TouchView(m, l.wv, kv, d, "wv");
    TouchView(m, l.wo, d, d, "wo");
    if (c.qkv_bias) {
      TouchF32(l.bq, d, "bq");
      TouchF32(l.bk, kv, "bk");
      TouchF32(l.bv, kv, "bv");
    } else {
      Check(l.bq == nullptr && l.bk == nullptr && l.bv == nullptr, "biases without qkv_bias");
    }
    if (c.qk_norm) {
      TouchF32(l.q_norm, d, "q_norm");
      TouchF32(l.k_norm, kv, "k_norm");
    }
    if (!c.moe.enabled()) {
      TouchView(m, l.w1, c.hidden_dim, d, "w1");
      TouchView(m, l.w2, d, c.hidden_dim, "w2");
      TouchView(m, l.w3, c.hidden_dim, d, "w3");
      Check(l.moe.experts.empty(), "experts in a dense model");
      continue;
    }
    Check(l.w1.empty() && l.w2.empty() && l.w3.empty(), "dense FFN views in an MoE model");
    Check(static_cast<int>(l.moe.experts.size()) == c.moe.n_experts, "experts.size() != n_experts");
    TouchView(m, l.moe.router, c.moe.n_experts, d, "router");
    for (const ke::ExpertWeights& e : l.moe.experts) TouchExpert(m, e, d, c.moe.expert_hidden);
    if (c.moe.shared_hidden > 0) {
      TouchExpert(m, l.moe.shared, d, c.moe.shared_hidden);
      TouchView(m, l.moe.shared_gate, 1, d, "shared_expert_gate");
    } else {
      Check(l.moe.shared.w1.empty() && l.moe.shared_gate.empty(), "a shared expert without shared_hidden");
    }
  }
  const std::string text = ke::DescribeModel(m);
  Check(text.find("arch:           " + c.arch + "\n") != std::string::npos, "DescribeModel lacks the arch");
  Check(text.find("parameters:     " + std::to_string(c.ParameterCount()) + "\n") != std::string::npos,
        "DescribeModel's parameter count is not ParameterCount()");
}

void LoadOne(std::string_view config, std::string_view weights) {
  const std::string& dir = ScratchDir();
  WriteFile(dir + "/config.json", config);
  WriteFile(dir + "/model.safetensors", weights);
  auto m = ke::LoadSafetensors(dir);
  if (m.ok()) {
    CheckLoaded(*m);
    return;
  }
  const keel::Status& s = m.status();
  static const bool verbose = std::getenv("KEEL_FUZZ_VERBOSE") != nullptr;
  if (verbose) std::fprintf(stderr, "%s\n", s.ToString().c_str());
  Check(s.code() == keel::StatusCode::kInvalidArgument || s.code() == keel::StatusCode::kCorruption,
        "a load error that is neither InvalidArgument nor Corruption");
  // A file inside the directory, or the directory itself (a tensor missing from every file).
  Check(s.message().rfind(dir + "/", 0) == 0 || s.message().rfind(dir + ": ", 0) == 0,
        "a load error that does not name the file or directory");
  if (s.code() == keel::StatusCode::kCorruption &&
      s.message().rfind(dir + "/model.safetensors", 0) == 0) {
    Check(s.message().find("byte offset") != std::string::npos,
          "a Corruption in model.safetensors that does not name a byte offset");
  }
}

// The length of the JSON object starting at weights[8] (strings and escapes respected) plus the
// spaces after it (the writers' alignment padding), or 0 when there is none.
uint64_t HeaderObjectLength(std::string_view weights) {
  if (weights.size() <= 8 || weights[8] != '{') return 0;
  int depth = 0;
  bool in_string = false, escaped = false;
  for (size_t i = 8; i < weights.size(); ++i) {
    const char ch = weights[i];
    if (in_string) {
      if (escaped) escaped = false;
      else if (ch == '\\') escaped = true;
      else if (ch == '"') in_string = false;
    } else if (ch == '"') {
      in_string = true;
    } else if (ch == '{' || ch == '[') {
      ++depth;
    } else if ((ch == '}' || ch == ']') && --depth == 0) {
      size_t end = i + 1;
      while (end < weights.size() && weights[end] == ' ') ++end;
      return end - 8;
    }
  }
  return 0;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view input(reinterpret_cast<const char*>(data), size);
  const size_t nul = input.find('\0');
  const std::string_view config = input.substr(0, nul);
  std::string weights(nul == std::string_view::npos ? std::string_view() : input.substr(nul + 1));
  LoadOne(config, weights);

  const uint64_t header = HeaderObjectLength(weights);
  uint64_t stored = 0;
  if (weights.size() >= 8) std::memcpy(&stored, weights.data(), 8);  // little-endian hosts only
  if (header > 0 && header != stored) {
    std::memcpy(weights.data(), &header, 8);
    LoadOne(config, weights);
  }
  return 0;
}
