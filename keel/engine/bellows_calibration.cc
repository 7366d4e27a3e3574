#include "keel/engine/bellows_calibration.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "keel/engine/kv_cache.h"
#include "keel/engine/transformer.h"
#include "keel/kv/rope.h"

namespace keel::engine {

namespace kb = kv::bellows;

namespace {

// Windows of `window` tokens, each BOS + the next documents' tokens, until `total` tokens.
Result<std::vector<std::vector<int>>> CalibrationWindows(const std::string& path, const Tokenizer& tok, int window,
                                                         int64_t total) {
  // Read a line at a time, and only as far as `total` tokens: a text may be large. A FIFO or a
  // device (/dev/zero: one endless line) is refused, and so is a line or paragraph past the bounds.
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) {
    if (!std::filesystem::exists(path, ec)) return Status::NotFound("calibration text " + path + ": no such file");
    return Status::InvalidArgument("calibration text " + path + ": not a regular file");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::NotFound("calibration text " + path + ": cannot open");
  constexpr size_t kMaxLineBytes = size_t{1} << 20, kMaxParagraphBytes = size_t{64} << 20;
  std::vector<char> buf(kMaxLineBytes + 1);
  std::vector<std::vector<int>> windows;
  std::vector<int> cur{Tokenizer::kBos};
  int64_t have = 0;
  std::string line, doc;
  auto flush = [&]() {
    if (doc.empty()) return;
    std::vector<int> ids = tok.Encode(doc, false);
    doc.clear();
    for (int id : ids) {
      cur.push_back(id);
      if (static_cast<int>(cur.size()) == window) {
        have += window;
        windows.push_back(std::move(cur));
        cur.assign(1, Tokenizer::kBos);
        if (have >= total) return;
      }
    }
  };
  while (have < total && in.getline(buf.data(), static_cast<std::streamsize>(buf.size()))) {
    line.assign(buf.data(), static_cast<size_t>(std::max<std::streamsize>(in.gcount() - (in.eof() ? 0 : 1), 0)));
    if (line.empty()) {
      flush();
      continue;
    }
    if (!doc.empty()) doc += '\n';
    doc += line;
    if (doc.size() > kMaxParagraphBytes) {
      return Status::InvalidArgument("calibration text " + path + ": a paragraph longer than " +
                                     std::to_string(kMaxParagraphBytes) + " bytes (paragraphs end at a blank line)");
    }
  }
  if (in.fail() && !in.eof()) {
    return Status::InvalidArgument("calibration text " + path + ": a line longer than " +
                                   std::to_string(kMaxLineBytes) + " bytes");
  }
  if (have < total) flush();
  if (windows.empty()) {
    return Status::InvalidArgument("calibration text " + path + " holds fewer than one window of " +
                                   std::to_string(window) + " tokens");
  }
  return windows;
}

// Layer 0's pre-RoPE K (interleaved pairs) and V for every token id, computed with the forward
// pass's own functions, so the values equal what it computes at run time bit for bit.
std::vector<float> LayerZeroTable(const Model& model) {
  const ModelConfig& c = model.config;
  const int dim = c.dim, kvd = c.kv_dim(), hd = c.head_dim(), chunk = 256;
  const LayerWeights& w = model.layers[0];
  std::vector<float> table(static_cast<size_t>(c.vocab_size) * 2 * kvd);
  std::vector<float> x(static_cast<size_t>(chunk) * dim), xn(x.size()), k(static_cast<size_t>(chunk) * kvd),
      v(k.size()), tmp(hd);
  const size_t row = DTypeSize(model.embedding.dtype) * dim;
  for (int t0 = 0; t0 < c.vocab_size; t0 += chunk) {
    const int m = std::min(chunk, c.vocab_size - t0);
    for (int i = 0; i < m; ++i) {
      ConvertToF32(model.embedding.dtype, static_cast<const uint8_t*>(model.embedding.data) + row * (t0 + i),
                   &x[static_cast<size_t>(i) * dim], dim);
      RmsNorm(&x[static_cast<size_t>(i) * dim], w.attn_norm, dim, c.rms_eps, &xn[static_cast<size_t>(i) * dim]);
    }
    MatMul(w.wk, xn.data(), m, k.data());
    MatMul(w.wv, xn.data(), m, v.data());
    for (int i = 0; i < m; ++i) {
      float* kr = &k[static_cast<size_t>(i) * kvd];
      float* vr = &v[static_cast<size_t>(i) * kvd];
      for (int j = 0; j < kvd; ++j) {
        if (w.bk) kr[j] += w.bk[j];
        if (w.bv) vr[j] += w.bv[j];
      }
      if (c.rope_style == RopeStyle::kHalf) {
        for (int h = 0; h < c.n_kv_heads; ++h) kv::ToInterleavedPairs(kr + h * hd, hd, tmp.data());
      }
      float* out = &table[static_cast<size_t>(t0 + i) * 2 * kvd];
      std::copy(kr, kr + kvd, out);
      std::copy(vr, vr + kvd, out + kvd);
    }
  }
  return table;
}

std::vector<float> WidenToF32(const TensorView& t) {
  std::vector<float> out(static_cast<size_t>(t.rows * t.cols));
  ConvertToF32(t.dtype, t.data, out.data(), out.size());
  return out;
}

}  // namespace

Result<kb::SolveOptions> BellowsSolveOptions(const Model& model, int layers, const BellowsCalibrationOptions& o) {
  const int kvd = model.config.kv_dim();
  const int full = layers * 2 * kvd;  // raw K/V elements per token of the group
  kb::SolveOptions so;
  so.ridge = o.ridge;
  so.objective = o.objective;
  so.equalize_blocks = o.equalize_blocks;
  const int given = (o.rank > 0) + (o.rank_k > 0 || o.rank_v > 0) + (o.ratio > 0);
  if (given != 1) {
    return Status::InvalidArgument("bellows calibration: give exactly one of --rank, --rank-k/--rank-v, --ratio");
  }
  if (o.ratio > 0) {
    const int rank = std::max(1, static_cast<int>(std::lround(full / o.ratio)));
    if (o.k_fraction > 0 && o.k_fraction < 1) {
      so.rank_k = std::clamp(static_cast<int>(std::lround(rank * o.k_fraction)), 1, std::max(1, rank - 1));
      so.rank_v = std::max(1, rank - so.rank_k);
    } else {
      so.rank = rank;
    }
  } else if (o.rank > 0) {
    so.rank = o.rank;
  } else {
    if (o.rank_k <= 0 || o.rank_v <= 0) {
      return Status::InvalidArgument("bellows calibration: --rank-k and --rank-v go together (both > 0)");
    }
    so.rank_k = o.rank_k;
    so.rank_v = o.rank_v;
  }
  return so;
}

namespace {

// One layer's group from a PCA of its input: z = (x - x_mean) C, x ~ x_mean + z R, and
// K/V = x~ Wk^T (+bias) / x~ Wv^T, so k_mean = Wk x_mean + bk and rk = R Wk^T (rows of R through
// the same MatMul the forward pass uses).
Result<kb::CalibrationGroup> InputPcaGroup(const Model& model, int layer, const std::vector<float>& x, int64_t rows,
                                           int rank) {
  const ModelConfig& c = model.config;
  const int dim = c.dim, kvd = c.kv_dim(), hd = c.head_dim();
  KEEL_ASSIGN_OR_RETURN(kb::InputPca pca, kb::SolveInputPca(x, rows, dim, rank));
  const LayerWeights& w = model.layers[layer];
  kb::CalibrationGroup g;
  g.first_layer = layer;
  g.n_layers = 1;
  g.rank = rank;
  g.k_begin = g.v_begin = 0;
  g.k_end = g.v_end = rank;
  g.x_mean = pca.x_mean;
  g.compress = pca.compress;
  kb::LayerRestore lr;
  lr.k_mean.resize(kvd);
  lr.v_mean.resize(kvd);
  MatMul(w.wk, pca.x_mean.data(), 1, lr.k_mean.data());
  MatMul(w.wv, pca.x_mean.data(), 1, lr.v_mean.data());
  lr.rk.resize(static_cast<size_t>(rank) * kvd);
  lr.rv.resize(lr.rk.size());
  MatMul(w.wk, pca.restore.data(), rank, lr.rk.data());
  MatMul(w.wv, pca.restore.data(), rank, lr.rv.data());
  for (int j = 0; j < kvd; ++j) {
    if (w.bk) lr.k_mean[j] += w.bk[j];
    if (w.bv) lr.v_mean[j] += w.bv[j];
  }
  if (c.rope_style == RopeStyle::kHalf) {
    std::vector<float> tmp(hd);
    for (int h = 0; h < c.n_kv_heads; ++h) {
      kv::ToInterleavedPairs(&lr.k_mean[h * hd], hd, tmp.data());
      for (int r = 0; r < rank; ++r) kv::ToInterleavedPairs(&lr.rk[static_cast<size_t>(r) * kvd + h * hd], hd, tmp.data());
    }
  }
  lr.errors.k_rel = lr.errors.v_rel = lr.errors.k_weighted_rel = lr.errors.v_weighted_rel = pca.rel_err;
  g.layers.push_back(std::move(lr));
  return g;
}

}  // namespace

Result<kb::Calibration> CalibrateBellows(const Model& model, const Tokenizer& tokenizer,
                                         const BellowsCalibrationOptions& o, const CalibrationProgress& progress) {
  const ModelConfig& c = model.config;
  if (o.input_pca && (o.group_size > 1 || o.token_table || o.rank_k > 0 || o.rank_v > 0)) {
    return Status::InvalidArgument("bellows calibration: --input-pca is per layer with one rank (--rank or --ratio), "
                                   "without --group-size, --token-table or split ranks");
  }
  const int gs = o.input_pca ? 1 : o.group_size == 0 ? c.n_layers : o.group_size;
  if (gs < 1 || gs > c.n_layers) {
    return Status::InvalidArgument("bellows calibration: --group-size " + std::to_string(o.group_size) +
                                   " outside 1.." + std::to_string(c.n_layers) + " (the model's layers)");
  }
  if (c.head_dim() % 2 != 0) return Status::InvalidArgument("bellows calibration: head_dim must be even (RoPE pairs)");
  const int window = o.window == 0 ? c.max_seq_len : o.window;
  if (window < 2 || window > c.max_seq_len) {
    return Status::InvalidArgument("bellows calibration: --window " + std::to_string(window) + " outside 2.." +
                                   std::to_string(c.max_seq_len));
  }
  if (o.tokens < window) return Status::InvalidArgument("bellows calibration: --tokens must be at least one window");
  const int n_groups = (c.n_layers + gs - 1) / gs;
  std::vector<kb::SolveOptions> solve(n_groups);
  for (int g = 0; g < n_groups; ++g) {
    KEEL_ASSIGN_OR_RETURN(solve[g], BellowsSolveOptions(model, std::min(gs, c.n_layers - g * gs), o));
  }
  KEEL_ASSIGN_OR_RETURN(std::vector<std::vector<int>> windows,
                        CalibrationWindows(o.text_path, tokenizer, window, o.tokens));

  // Statistics per group, streamed window by window.
  std::vector<kb::GroupStats> stats;
  for (int g = 0; g < n_groups; ++g) {
    kb::GroupDims d;
    d.first_layer = g * gs;
    d.n_layers = std::min(gs, c.n_layers - g * gs);
    d.dim = c.dim;
    d.n_heads = c.n_heads;
    d.n_kv_heads = c.n_kv_heads;
    d.head_dim = c.head_dim();
    KEEL_ASSIGN_OR_RETURN(kb::GroupStats s, kb::GroupStats::Create(d));
    stats.push_back(std::move(s));
  }
  KvCacheOptions ko;
  ko.prefix_sharing = false;
  ko.budget_bytes = static_cast<size_t>(window + 32) * c.n_layers * c.kv_dim() * 2 * sizeof(float) * 2;
  KEEL_ASSIGN_OR_RETURN(std::unique_ptr<KvCache> cache, KvCache::Create(model, "raw:f32", ko));
  Transformer tf(model);
  struct Trace {
    std::vector<float> x, q, k, v;
  };
  std::vector<Trace> traces(c.n_layers);
  tf.SetLayerObserver([&](const LayerTrace& t) {
    Trace& tr = traces[t.layer];
    tr.x.assign(t.x, t.x + static_cast<size_t>(t.n_rows) * c.dim);
    tr.q.assign(t.q_pre, t.q_pre + static_cast<size_t>(t.n_rows) * c.dim);
    tr.k.assign(t.k_pre, t.k_pre + static_cast<size_t>(t.n_rows) * c.kv_dim());
    tr.v.assign(t.v, t.v + static_cast<size_t>(t.n_rows) * c.kv_dim());
  });
  std::vector<float> logits, zeros;
  std::vector<std::vector<float>> inputs(o.input_pca ? c.n_layers : 0);  // input_pca: every layer's x
  for (size_t w = 0; w < windows.size(); ++w) {
    const std::vector<int>& ids = windows[w];
    const SeqId seq = static_cast<SeqId>(w);
    KEEL_ASSIGN_OR_RETURN(int reused, cache->BeginSequence(seq, {}));
    (void)reused;
    KEEL_RETURN_IF_ERROR(cache->Reserve(seq, static_cast<int>(ids.size())));
    std::vector<BatchToken> batch(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) batch[i] = BatchToken{seq, ids[i], static_cast<int>(i), false};
    KEEL_RETURN_IF_ERROR(tf.Forward(batch, *cache, logits));
    cache->Release(seq);
    for (int l = 0; l < static_cast<int>(inputs.size()); ++l) {
      inputs[l].insert(inputs[l].end(), traces[l].x.begin(), traces[l].x.end());
    }
    for (int g = 0; g < n_groups && !o.input_pca; ++g) {
      kb::GroupSamples gsamp;
      gsamp.dims = stats[g].dims();
      gsamp.n_rows = static_cast<int64_t>(ids.size());
      for (int i = 0; i < gsamp.dims.n_layers; ++i) {
        const int layer = gsamp.dims.first_layer + i;
        const Trace& tr = traces[layer];
        if (layer == 0 && o.token_table) {
          // Layer 0 comes from the table: its targets are constant (zero), so the solver spends
          // no rank on them, while its input still informs the latent of the later layers.
          zeros.assign(tr.k.size(), 0.0f);
          gsamp.layers.push_back(kb::LayerSamples{tr.x, zeros, zeros, tr.q, {}});
        } else {
          gsamp.layers.push_back(kb::LayerSamples{tr.x, tr.k, tr.v, tr.q, {}});
        }
      }
      KEEL_RETURN_IF_ERROR(stats[g].Add(gsamp));
    }
    if (progress) progress("capture", static_cast<double>(w + 1) / windows.size());
  }

  kb::Calibration cal;
  cal.model_checksum = model.checksum;
  cal.dim = c.dim;
  cal.n_layers = c.n_layers;
  cal.n_heads = c.n_heads;
  cal.n_kv_heads = c.n_kv_heads;
  cal.head_dim = c.head_dim();
  cal.rope_theta = c.rope_theta;
  cal.group_size = gs;
  const int64_t n_tokens = static_cast<int64_t>(windows.size()) * window;
  for (int g = 0; g < n_groups && o.input_pca; ++g) {
    const int rank = solve[g].rank;
    if (rank > c.dim) {
      return Status::InvalidArgument("bellows calibration: --input-pca rank " + std::to_string(rank) +
                                     " above the layer input width " + std::to_string(c.dim));
    }
    KEEL_ASSIGN_OR_RETURN(kb::CalibrationGroup gm, InputPcaGroup(model, g, inputs[g], static_cast<int64_t>(
                                                                     inputs[g].size() / c.dim), rank));
    if (progress) progress("solve layer " + std::to_string(g + 1) + "/" + std::to_string(n_groups), 1.0);
    cal.groups.push_back(std::move(gm));
  }
  for (int g = 0; g < n_groups && !o.input_pca; ++g) {
    std::vector<std::vector<float>> wo_f32;
    std::vector<std::span<const float>> wo;
    for (int i = 0; i < stats[g].dims().n_layers; ++i) {
      wo_f32.push_back(WidenToF32(model.layers[stats[g].dims().first_layer + i].wo));
    }
    for (const auto& m : wo_f32) wo.emplace_back(m);
    const std::string stage = "solve group " + std::to_string(g + 1) + "/" + std::to_string(n_groups);
    KEEL_ASSIGN_OR_RETURN(kb::GroupMatrices gm,
                          kb::SolveGroup(stats[g], wo, solve[g], [&](std::string_view, double f) {
                            if (progress) progress(stage, f);
                          }));
    cal.groups.push_back(std::move(gm));
  }
  if (o.token_table) {
    cal.vocab = c.vocab_size;
    cal.token_kv = LayerZeroTable(model);
  }
  std::ostringstream method;
  const kb::SolveOptions& s0 = solve[0];
  method << (o.input_pca ? "baseline: PCA of each layer's input, restored through Wk/Wv; " : "")
         << "BellowsKV reduced-rank ridge regression; objective="
         << (o.objective == kb::Objective::kPlain ? "plain" : "attention-aware")
         << (o.equalize_blocks ? " (equalized blocks)" : "") << "; group_size=" << gs << "; latent="
         << (s0.rank > 0 ? "joint rank " + std::to_string(s0.rank)
                         : "split k " + std::to_string(s0.rank_k) + " + v " + std::to_string(s0.rank_v))
         << " (first group); ridge=" << o.ridge << "; calibration tokens=" << n_tokens << " from " << o.text_path
         << " in windows of " << window << (o.token_table ? "; layer 0 from a token table" : "");
  cal.method = method.str();
  return cal;
}

}  // namespace keel::engine
