// BellowsKV calibration driver: runs a model over calibration text, captures what each layer
// group's codec needs (layer inputs, pre-RoPE K and Q, V: Transformer's LayerObserver) and solves
// every group (kv/bellows/solver.h). The result is written with kv::bellows::WriteCalibration and
// used through `--kv-codec bellows --bellows FILE`. `keel bellows calibrate` is this plus flags.
#pragma once

#include <functional>
#include <string>

#include "keel/core/status.h"
#include "keel/engine/model.h"
#include "keel/engine/tokenizer.h"
#include "keel/kv/bellows/calibration.h"
#include "keel/kv/bellows/solver.h"

namespace keel::engine {

struct BellowsCalibrationOptions {
  std::string text_path;         // calibration text (documents separated by blank lines)
  int64_t tokens = 131072;       // calibration tokens to run (the text is read until then)
  int window = 0;                // tokens per forward window (0: the model's context)
  int group_size = 0;            // layers per group (0: all layers in one group)
  // Latent size per group: rank (joint K/V latent), or rank_k + rank_v (split), or a target
  // compression `ratio` against raw bf16 K/V (rank = round(group layers * 2 * kv_dim / ratio)),
  // split by `k_fraction` when it is in (0, 1) (0: joint).
  int rank = 0, rank_k = 0, rank_v = 0;
  double ratio = 0.0;
  double k_fraction = 0.0;
  kv::bellows::Objective objective = kv::bellows::Objective::kAttentionAware;
  double ridge = 1e-6;
  bool equalize_blocks = false;
  // Layer 0 from a token table (kv::bellows::Calibration::token_kv): exact, costs one 16-bit
  // token id per token, and the latent serves the other layers only.
  bool token_table = false;
  // Baseline "store each layer's input": per layer (group size 1) a PCA of the layer input x
  // with `rank` components, restored through the layer's own Wk/Wv (lossless at rank = dim).
  // Written as an ordinary calibration, so the same codec runs it.
  bool input_pca = false;
};

// Progress of a long calibration: `stage` ("capture", "solve group i/n") and the fraction done.
using CalibrationProgress = std::function<void(const std::string& stage, double fraction)>;

// InvalidArgument for options that do not fit the model (ranks, group size, empty text), NotFound
// / IOError for the text file.
Result<kv::bellows::Calibration> CalibrateBellows(const Model& model, const Tokenizer& tokenizer,
                                                  const BellowsCalibrationOptions& options,
                                                  const CalibrationProgress& progress = {});

// The latent size per group the options ask for (joint rank, or rank_k/rank_v), for a group of
// `layers` layers; InvalidArgument when none or several are given or a rank is out of range.
Result<kv::bellows::SolveOptions> BellowsSolveOptions(const Model& model, int layers,
                                                      const BellowsCalibrationOptions& options);

}  // namespace keel::engine
