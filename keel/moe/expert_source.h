// The slow tier of offloaded MoE decoding: where expert weights live when they are not in a
// resident slot. An ExpertSource copies one expert's w1, w2, w3 bytes into a slot; compute then
// reads the slot through ViewsIn. Two tiers: "dram" (memcpy from the model's mapped weights, the
// host-DRAM tier of a GPU system) and "file-direct" (O_DIRECT reads from the weight files: real
// I/O that bypasses the page cache). Sources are immutable after creation and Read is safe to
// call from any number of threads at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "keel/core/status.h"
#include "keel/engine/model.h"

namespace keel::moe {

// Byte layout of one expert copy in a slot: w1, w2, w3 bytes back to back, each at a 64-byte
// aligned offset (so kernels' row loads start cache-line aligned, as in the mapped file).
struct ExpertLayout {
  size_t w1_off = 0, w2_off = 0, w3_off = 0;
  size_t bytes = 0;  // the slot size needed: w3's end rounded up to 64
};
ExpertLayout LayoutOf(const engine::ExpertWeights& like);

// Views into a slot holding a copy: same dtypes and shapes as `like`, data pointing into `slot`.
// The views are valid while the slot's bytes are (the caller owns the slot).
engine::ExpertWeights ViewsIn(const uint8_t* slot, const engine::ExpertWeights& like,
                              const ExpertLayout& layout);

class ExpertSource {
 public:
  virtual ~ExpertSource() = default;
  virtual std::string name() const = 0;  // "dram" or "file-direct"
  // Copies expert (layer, expert)'s w1, w2, w3 bytes into dst per LayoutOf; dst is 4096-aligned
  // and LayoutOf(...).bytes long (the padding between tensors is left as it was). Thread-safe.
  // InvalidArgument for a layer or expert out of range; IOError/Corruption when the bytes could
  // not be read (dst may then hold part of the copy; it never silently holds zeros as data).
  virtual Status Read(int layer, int expert, uint8_t* dst) = 0;
};

// Both factories need a MoE model whose experts all have the same shapes and dtypes (one slot
// size for every expert): InvalidArgument for a dense model or mixed shapes. A source keeps the
// model's weight storage alive itself, so it may outlive the Model object.

// memcpy from the model's mapped (or in-memory) weights.
Result<std::unique_ptr<ExpertSource>> MakeDramSource(const engine::Model& m);

// pread with O_DIRECT from the model's weight files (Model::Locate gives file and offset): each
// tensor's 4096-aligned superset range is read into a per-thread aligned bounce buffer and the
// tensor's bytes are copied out. Opens every weight file at creation and reads its first block,
// so these fail there, naming the file: a tensor not in a mapped file (widened or in-memory),
// a file on tmpfs/ramfs (O_DIRECT there is a memory copy, not I/O; older kernels refuse it with
// EINVAL), and a file system that refuses O_DIRECT (EINVAL). Short reads and I/O errors in Read
// are errors naming the file and offset.
Result<std::unique_ptr<ExpertSource>> MakeDirectFileSource(const engine::Model& m);

}  // namespace keel::moe
