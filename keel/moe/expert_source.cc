#include "keel/moe/expert_source.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "keel/core/aligned.h"

namespace keel::moe {
namespace {

using engine::ExpertWeights;
using engine::Model;
using engine::TensorView;

constexpr size_t kDirectAlign = 4096;  // covers 512- and 4096-byte logical blocks

bool SameShape(const TensorView& a, const TensorView& b) {
  return a.dtype == b.dtype && a.rows == b.rows && a.cols == b.cols;
}

std::string Where(int layer, int expert) {
  return "layer " + std::to_string(layer) + " expert " + std::to_string(expert);
}

// The one layout every expert shares, or why there is none. Fixed slot sizes depend on it.
Result<ExpertWeights> CommonShape(const Model& m, const std::string& source) {
  if (m.layers.empty() || m.layers[0].moe.experts.empty()) {
    return Status::InvalidArgument(source + " expert source: " + m.source +
                                   " is a dense model (no experts)");
  }
  const ExpertWeights like = m.layers[0].moe.experts[0];
  for (size_t l = 0; l < m.layers.size(); ++l) {
    const auto& experts = m.layers[l].moe.experts;
    if (experts.empty()) {
      return Status::InvalidArgument(source + " expert source: " + m.source + ": layer " +
                                     std::to_string(l) + " has no experts");
    }
    for (size_t e = 0; e < experts.size(); ++e) {
      const ExpertWeights& x = experts[e];
      if (x.w1.empty() || x.w2.empty() || x.w3.empty()) {
        return Status::InvalidArgument(source + " expert source: " + m.source + ": " +
                                       Where(int(l), int(e)) + " lacks w1, w2 or w3");
      }
      if (!SameShape(x.w1, like.w1) || !SameShape(x.w2, like.w2) || !SameShape(x.w3, like.w3)) {
        return Status::InvalidArgument(source + " expert source: " + m.source + ": " +
                                       Where(int(l), int(e)) +
                                       " differs in shape or dtype from layer 0 expert 0 "
                                       "(one slot size must fit every expert)");
      }
    }
  }
  return like;
}

// Range check shared by both sources; `counts[l]` is layer l's number of experts.
Status CheckIndex(const std::string& source, const std::vector<int>& counts, int layer,
                  int expert) {
  if (layer < 0 || layer >= int(counts.size())) {
    return Status::InvalidArgument(source + " expert source: layer " + std::to_string(layer) +
                                   " out of range [0, " + std::to_string(counts.size()) + ")");
  }
  if (expert < 0 || expert >= counts[layer]) {
    return Status::InvalidArgument(source + " expert source: expert " + std::to_string(expert) +
                                   " out of range [0, " + std::to_string(counts[layer]) +
                                   ") in layer " + std::to_string(layer));
  }
  return Status::Ok();
}

class DramSource final : public ExpertSource {
 public:
  DramSource(const Model& m, const ExpertWeights& like)
      : storage_(m.storage), layout_(LayoutOf(like)) {
    for (const auto& layer : m.layers) {
      experts_.push_back(layer.moe.experts);
      counts_.push_back(int(layer.moe.experts.size()));
    }
  }
  std::string name() const override { return "dram"; }
  Status Read(int layer, int expert, uint8_t* dst) override {
    KEEL_RETURN_IF_ERROR(CheckIndex(name(), counts_, layer, expert));
    const ExpertWeights& x = experts_[layer][expert];
    std::memcpy(dst + layout_.w1_off, x.w1.data, x.w1.bytes());
    std::memcpy(dst + layout_.w2_off, x.w2.data, x.w2.bytes());
    std::memcpy(dst + layout_.w3_off, x.w3.data, x.w3.bytes());
    return Status::Ok();
  }

 private:
  std::vector<std::shared_ptr<const void>> storage_;  // keeps the views' memory alive
  ExpertLayout layout_;
  std::vector<std::vector<ExpertWeights>> experts_;
  std::vector<int> counts_;
};

// An aligned scratch buffer per thread: copy threads read concurrently, and each read needs a
// buffer O_DIRECT accepts. It only grows (to the largest tensor's superset range).
uint8_t* BounceBuffer(size_t n) {
  struct Buffer {
    uint8_t* p = nullptr;
    size_t cap = 0;
    ~Buffer() { std::free(p); }
  };
  thread_local Buffer buf;
  if (buf.cap < n) {
    std::free(buf.p);
    buf.cap = RoundUp(n, kDirectAlign);
    buf.p = static_cast<uint8_t*>(std::aligned_alloc(kDirectAlign, buf.cap));
    if (buf.p == nullptr) buf.cap = 0;
  }
  return buf.p;
}

struct DirectFile {
  std::string path;
  int fd = -1;
};

// Where one tensor's bytes are in a file and where they go in the slot.
struct Extent {
  int file = 0;
  uint64_t offset = 0;
  size_t bytes = 0;
  size_t dst_offset = 0;
};

Status RefuseDirect(const std::string& path, const std::string& why) {
  return Status::InvalidArgument("file-direct expert source: " + path + ": " + why +
                                 "; keep the weights on a disk file system or use the dram source");
}

// Opens `path` for O_DIRECT reads and reads its first block, so that a file system that will not
// do direct I/O fails here, by name, rather than on the first copy.
Result<int> OpenDirect(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
  if (fd < 0) {
    int err = errno;
    if (err == EINVAL) return RefuseDirect(path, "the file system refuses O_DIRECT (EINVAL)");
    return Status::IOError("file-direct expert source: open " + path + ": " + std::strerror(err));
  }
  struct statfs fs {};
  if (::fstatfs(fd, &fs) == 0 && (fs.f_type == TMPFS_MAGIC || fs.f_type == RAMFS_MAGIC)) {
    ::close(fd);
    return RefuseDirect(path, "is on tmpfs/ramfs, where O_DIRECT is a memory copy, not disk I/O "
                              "(older kernels refuse it with EINVAL)");
  }
  uint8_t* probe = BounceBuffer(kDirectAlign);
  if (probe == nullptr) {
    ::close(fd);
    return Status::ResourceExhausted("file-direct expert source: no memory for a bounce buffer");
  }
  if (::pread(fd, probe, kDirectAlign, 0) < 0) {
    int err = errno;
    ::close(fd);
    if (err == EINVAL) return RefuseDirect(path, "the file system refuses O_DIRECT reads (EINVAL)");
    return Status::IOError("file-direct expert source: pread " + path + " at offset 0: " +
                           std::strerror(err));
  }
  return fd;
}

class DirectFileSource final : public ExpertSource {
 public:
  ~DirectFileSource() override {
    for (const DirectFile& f : files_) ::close(f.fd);
  }
  std::string name() const override { return "file-direct"; }

  static Result<std::unique_ptr<ExpertSource>> Create(const Model& m, const ExpertWeights& like) {
    std::unique_ptr<DirectFileSource> s(new DirectFileSource);
    const ExpertLayout layout = LayoutOf(like);
    std::vector<const engine::WeightFile*> opened;  // parallel to files_
    for (size_t l = 0; l < m.layers.size(); ++l) {
      const auto& experts = m.layers[l].moe.experts;
      s->counts_.push_back(int(experts.size()));
      s->extents_.emplace_back();
      for (size_t e = 0; e < experts.size(); ++e) {
        const TensorView* views[3] = {&experts[e].w1, &experts[e].w2, &experts[e].w3};
        const size_t dst[3] = {layout.w1_off, layout.w2_off, layout.w3_off};
        std::array<Extent, 3> ext;
        for (int t = 0; t < 3; ++t) {
          auto where = m.Locate(*views[t]);
          if (!where.ok()) {
            return Status::InvalidArgument("file-direct expert source: " + Where(int(l), int(e)) +
                                           " w" + std::to_string(t + 1) + ": " +
                                           where.status().message());
          }
          const auto [file, offset] = *where;
          size_t idx = 0;
          while (idx < opened.size() && opened[idx] != file) ++idx;
          if (idx == opened.size()) {
            KEEL_ASSIGN_OR_RETURN(int fd, OpenDirect(file->path));
            opened.push_back(file);
            s->files_.push_back(DirectFile{file->path, fd});
          }
          ext[t] = Extent{int(idx), offset, views[t]->bytes(), dst[t]};
        }
        s->extents_.back().push_back(ext);
      }
    }
    return std::unique_ptr<ExpertSource>(std::move(s));
  }

  Status Read(int layer, int expert, uint8_t* dst) override {
    KEEL_RETURN_IF_ERROR(CheckIndex(name(), counts_, layer, expert));
    for (const Extent& e : extents_[layer][expert]) KEEL_RETURN_IF_ERROR(ReadExtent(e, dst));
    return Status::Ok();
  }

 private:
  DirectFileSource() = default;

  // Reads the aligned superset [begin, end) of the tensor and copies the tensor's bytes out.
  Status ReadExtent(const Extent& e, uint8_t* dst) const {
    const DirectFile& f = files_[e.file];
    const uint64_t begin = e.offset & ~uint64_t(kDirectAlign - 1);
    const uint64_t end = RoundUp(e.offset + e.bytes, kDirectAlign);
    const size_t need = size_t(e.offset + e.bytes - begin);  // the superset may pass EOF
    uint8_t* buf = BounceBuffer(size_t(end - begin));
    if (buf == nullptr) {
      return Status::ResourceExhausted("file-direct expert source: no memory for a bounce buffer");
    }
    size_t got = 0;
    while (got < need) {
      ssize_t n = ::pread(f.fd, buf + got, size_t(end - begin) - got, off_t(begin + got));
      if (n < 0) {
        const int err = errno;
        if (err == EINTR) continue;
        return Status::IOError("file-direct expert source: pread " + f.path + " at offset " +
                               std::to_string(begin + got) + ": " + std::strerror(err));
      }
      got += size_t(n);
      // A direct read returns whole blocks until end of file: anything else is the end.
      if (got < need && (n == 0 || size_t(n) % kDirectAlign != 0)) {
        return Status::Corruption("file-direct expert source: " + f.path +
                                  ": short read: file ends at offset " +
                                  std::to_string(begin + got) + ", tensor ends at " +
                                  std::to_string(e.offset + e.bytes));
      }
    }
    std::memcpy(dst + e.dst_offset, buf + (e.offset - begin), e.bytes);
    return Status::Ok();
  }

  std::vector<DirectFile> files_;
  std::vector<std::vector<std::array<Extent, 3>>> extents_;  // [layer][expert] -> w1, w2, w3
  std::vector<int> counts_;
};

}  // namespace

ExpertLayout LayoutOf(const ExpertWeights& like) {
  ExpertLayout l;
  l.w1_off = 0;
  l.w2_off = RoundUp(l.w1_off + like.w1.bytes(), 64);
  l.w3_off = RoundUp(l.w2_off + like.w2.bytes(), 64);
  l.bytes = RoundUp(l.w3_off + like.w3.bytes(), 64);
  return l;
}

ExpertWeights ViewsIn(const uint8_t* slot, const ExpertWeights& like, const ExpertLayout& layout) {
  ExpertWeights v = like;
  v.w1.data = slot + layout.w1_off;
  v.w2.data = slot + layout.w2_off;
  v.w3.data = slot + layout.w3_off;
  return v;
}

Result<std::unique_ptr<ExpertSource>> MakeDramSource(const Model& m) {
  KEEL_ASSIGN_OR_RETURN(ExpertWeights like, CommonShape(m, "dram"));
  return std::unique_ptr<ExpertSource>(new DramSource(m, like));
}

Result<std::unique_ptr<ExpertSource>> MakeDirectFileSource(const Model& m) {
  KEEL_ASSIGN_OR_RETURN(ExpertWeights like, CommonShape(m, "file-direct"));
  return DirectFileSource::Create(m, like);
}

}  // namespace keel::moe
