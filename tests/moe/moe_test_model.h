// Test helpers for keel/moe: MoE models to copy experts from. Besides en-moe8x and make-model's
// models (through engine::LoadModel), the tests write raw Mixtral-named files with shapes no
// loader would accept (odd widths, so tensors sit at unaligned offsets and need slot padding) and
// take their expert views straight from the safetensors file: all an ExpertSource reads is
// layers[l].moe.experts[e] and the mapped weight file.
#pragma once

#include <sys/vfs.h>
#include <linux/magic.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "keel/core/aligned.h"
#include "keel/engine/model.h"
#include "keel/engine/safetensors.h"
#include "keel/moe/expert_source.h"
#include "tests/engine/test_util.h"

namespace keel::moe::test {

inline bool OnTmpfs(const std::string& path) {
  struct statfs fs {};
  return ::statfs(path.c_str(), &fs) == 0 && (fs.f_type == TMPFS_MAGIC || fs.f_type == RAMFS_MAGIC);
}

// A scratch directory on a disk file system (O_DIRECT must mean real I/O): the system temp dir
// unless it is tmpfs, then /var/tmp. path() is empty when neither is on disk.
class DiskTempDir {
 public:
  DiskTempDir() {
    std::string base = std::filesystem::temp_directory_path().string();
    if (OnTmpfs(base)) base = "/var/tmp";
    if (OnTmpfs(base)) return;
    std::string tmpl = base + "/keel-moe-XXXXXX";
    if (::mkdtemp(tmpl.data()) != nullptr) path_ = tmpl;
  }
  explicit DiskTempDir(const std::string& base) {  // a scratch dir under `base`, whatever it is
    std::string tmpl = base + "/keel-moe-XXXXXX";
    if (::mkdtemp(tmpl.data()) != nullptr) path_ = tmpl;
  }
  ~DiskTempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  DiskTempDir(const DiskTempDir&) = delete;
  DiskTempDir& operator=(const DiskTempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

inline std::string ExpertName(int layer, int expert, int w) {
  return "model.layers." + std::to_string(layer) + ".block_sparse_moe.experts." +
         std::to_string(expert) + ".w" + std::to_string(w) + ".weight";
}

// Expert views of a Mixtral-named safetensors file: layers[l].moe.experts[e] for every expert in
// it, the map kept alive in storage and listed in weight_files (so Model::Locate works).
inline Result<engine::Model> MoeViewsFromSafetensors(const std::string& path) {
  KEEL_ASSIGN_OR_RETURN(engine::SafetensorsFile f, engine::SafetensorsFile::Open(path));
  engine::Model m;
  m.source = path;
  m.format = "safetensors";
  m.storage.push_back(f.file());
  m.weight_files.push_back(engine::WeightFile{path, f.file()->data(), f.file()->size()});
  for (int l = 0;; ++l) {
    if (f.Find(ExpertName(l, 0, 1)) == nullptr) break;
    engine::LayerWeights lw;
    for (int e = 0; f.Find(ExpertName(l, e, 1)) != nullptr; ++e) {
      engine::ExpertWeights x;
      engine::TensorView* views[3] = {&x.w1, &x.w2, &x.w3};
      for (int w = 1; w <= 3; ++w) {
        const engine::SafetensorsTensor* t = f.Find(ExpertName(l, e, w));
        if (t == nullptr || t->shape.size() != 2) {
          return Status::Corruption(path + ": " + ExpertName(l, e, w) + " missing or not 2-D");
        }
        *views[w - 1] = engine::TensorView{t->data, t->dtype, t->shape[0], t->shape[1]};
      }
      lw.moe.experts.push_back(x);
    }
    m.layers.push_back(std::move(lw));
  }
  m.config.n_layers = int(m.layers.size());
  m.config.moe.n_experts = m.layers.empty() ? 0 : int(m.layers[0].moe.experts.size());
  return m;
}

// Writes a seeded random Mixtral-named MoE safetensors file: a leading tensor of odd size (so
// expert tensors start at offsets that are not block aligned), then every expert, the last one
// ending the file mid-block. Returns the path.
inline Result<std::string> WriteTinyMoe(const std::string& dir, int layers, int experts, int dim,
                                        int hidden, DType dtype, uint64_t seed) {
  std::vector<engine::TensorSpec> specs;
  specs.push_back({"model.embed_tokens.weight", dtype, {7, dim}});
  for (int l = 0; l < layers; ++l) {
    for (int e = 0; e < experts; ++e) {
      specs.push_back({ExpertName(l, e, 1), dtype, {hidden, dim}});
      specs.push_back({ExpertName(l, e, 2), dtype, {dim, hidden}});
      specs.push_back({ExpertName(l, e, 3), dtype, {hidden, dim}});
    }
  }
  std::mt19937_64 rng(seed);
  std::vector<std::string> bytes;
  std::vector<engine::TensorData> tensors;
  for (const auto& s : specs) {
    std::string b(s.bytes(), '\0');
    for (char& c : b) c = char(rng());
    bytes.push_back(std::move(b));
  }
  for (size_t i = 0; i < specs.size(); ++i) tensors.push_back({specs[i], bytes[i]});
  const std::string path = dir + "/model.safetensors";
  KEEL_RETURN_IF_ERROR(engine::WriteSafetensors(path, tensors));
  return path;
}

// A 4096-aligned slot (as the runtime's slot arena gives), filled with `fill`.
struct Slot {
  explicit Slot(size_t n, uint8_t fill = 0xA5)
      : bytes(n), p(static_cast<uint8_t*>(std::aligned_alloc(4096, RoundUp(n, 4096)))) {
    std::memset(p, fill, n);
  }
  ~Slot() { std::free(p); }
  Slot(const Slot&) = delete;
  Slot& operator=(const Slot&) = delete;
  size_t bytes;
  uint8_t* p;
};

// Empty when the slot holds exactly `want`'s bytes through ViewsIn, else what differs.
inline std::string SlotMismatch(const Slot& slot, const engine::ExpertWeights& want) {
  const ExpertLayout layout = LayoutOf(want);
  const engine::ExpertWeights got = ViewsIn(slot.p, want, layout);
  const engine::TensorView* g[3] = {&got.w1, &got.w2, &got.w3};
  const engine::TensorView* w[3] = {&want.w1, &want.w2, &want.w3};
  for (int i = 0; i < 3; ++i) {
    if (g[i]->dtype != w[i]->dtype || g[i]->rows != w[i]->rows || g[i]->cols != w[i]->cols) {
      return "w" + std::to_string(i + 1) + " shape/dtype";
    }
    if (std::memcmp(g[i]->data, w[i]->data, w[i]->bytes()) != 0) {
      return "w" + std::to_string(i + 1) + " bytes";
    }
  }
  return "";
}

}  // namespace keel::moe::test
