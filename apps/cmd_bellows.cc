// keel bellows calibrate | inspect: BellowsKV calibration files.
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <string>

#include <CLI/CLI.hpp>

#include "apps/cli.h"
#include "keel/core/log.h"
#include "keel/engine/bellows_calibration.h"
#include "keel/engine/engine.h"
#include "keel/kv/bellows/calibration.h"

namespace keel::cli {
namespace {

using namespace keel::engine;

// ---- bellows
struct BellowsArgs {
  std::string model, tokenizer, out, objective = "attention";
  BellowsCalibrationOptions o;
};

// One progress line per stage on a pipe, a redrawn bar on a terminal.
CalibrationProgress ProgressBar() {
  const bool tty = isatty(fileno(stderr));
  return [tty, last = std::string(), shown = -1](const std::string& stage, double f) mutable {
    const int pct = static_cast<int>(f * 100);
    if (stage == last && (pct == shown || (!tty && pct < shown + 10 && pct < 100))) return;
    if (stage != last && tty && !last.empty()) std::fputc('\n', stderr);
    last = stage;
    shown = pct;
    const int filled = pct * 30 / 100;
    std::fprintf(stderr, "%s%-16s [%s%s] %3d%%%s", tty ? "\r" : "", stage.c_str(), std::string(filled, '#').c_str(),
                 std::string(30 - filled, '.').c_str(), pct, tty ? "" : "\n");
    if (tty && pct >= 100) std::fputc('\n', stderr);
    std::fflush(stderr);
  };
}

int RunBellowsCalibrate(BellowsArgs a) {
  auto m = LoadModel(a.model);
  if (!m.ok()) return Fail(m.status());
  auto tok_path = TokenizerFor(a.model, a.tokenizer);
  if (!tok_path.ok()) return Fail(tok_path.status());
  auto tok = Tokenizer::Load(*tok_path, m->config.vocab_size);
  if (!tok.ok()) return Fail(tok.status());
  a.o.objective = a.objective == "plain" ? kv::bellows::Objective::kPlain : kv::bellows::Objective::kAttentionAware;
  auto cal = CalibrateBellows(*m, *tok, a.o, ProgressBar());
  if (!cal.ok()) return Fail(cal.status());
  if (Status s = kv::bellows::WriteCalibration(a.out, *cal); !s.ok()) return Fail(s);
  Log().info("wrote {}: {}", a.out, cal->method);
  for (const auto& g : cal->groups) {
    for (int i = 0; i < g.n_layers; ++i) {
      const auto& e = g.layers[i].errors;
      Log().info("layer {}: relative error K {:.4f} V {:.4f} (weighted K {:.4f} V {:.4f})", g.first_layer + i, e.k_rel,
                 e.v_rel, e.k_weighted_rel, e.v_weighted_rel);
    }
  }
  return 0;
}

int RunBellowsInspect(const std::string& path) {
  auto cal = kv::bellows::ReadCalibration(path);
  if (!cal.ok()) return Fail(cal.status());
  const auto& c = *cal;
  std::printf("%s\n  model checksum %s; dim %d, %d layers, %d heads, %d KV heads of %d, RoPE theta %g\n", path.c_str(),
              c.model_checksum.hex().c_str(), c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.rope_theta);
  std::printf("  method: %s\n  fingerprint %s\n", c.method.c_str(), kv::bellows::CalibrationFingerprint(c).c_str());
  for (const auto& g : c.groups) {
    const double raw = 2.0 * g.n_layers * c.kv_dim();
    std::printf("  group layers %d..%d: latent %d (K [%d,%d), V [%d,%d)), %.2fx vs raw K/V at equal width\n",
                g.first_layer, g.first_layer + g.n_layers - 1, g.rank, g.k_begin, g.k_end, g.v_begin, g.v_end,
                raw / g.rank);
    for (int i = 0; i < g.n_layers; ++i) {
      const auto& e = g.layers[i].errors;
      std::printf("    layer %d: relative error K %.4f V %.4f (weighted K %.4f V %.4f)\n", g.first_layer + i, e.k_rel,
                  e.v_rel, e.k_weighted_rel, e.v_weighted_rel);
    }
  }
  return 0;
}
// ---- bellows (end)

}  // namespace

void AddBellowsCommands(CLI::App& app, Commands& out) {
  auto bw_ptr = std::make_shared<BellowsArgs>();
  BellowsArgs& bw = *bw_ptr;
  auto bw_inspect = std::make_shared<std::string>();
  auto* bellows = app.add_subcommand("bellows", "BellowsKV: calibrate the shared-latent KV codec for a model, inspect a calibration");
  bellows->require_subcommand(1);
  auto* bw_cal = bellows->add_subcommand("calibrate", "Run the model over calibration text and solve the compress/restore matrices of every layer group");
  bw_cal->add_option("--model,-m", bw.model, "llama2.c .bin checkpoint or Hugging Face model directory")->required();
  bw_cal->add_option("--tokenizer,-z", bw.tokenizer, "llama2.c tokenizer.bin (default: found beside the model)");
  bw_cal->add_option("--text", bw.o.text_path, "calibration text (documents separated by blank lines), e.g. data/text/train.txt")->required()->check(CLI::ExistingFile);
  bw_cal->add_option("--out,-o", bw.out, "calibration file to write (.bkv)")->required();
  bw_cal->add_option("--group-size", bw.o.group_size, "adjacent layers sharing one latent (0 = all layers)")->capture_default_str()->check(CLI::NonNegativeNumber);
  bw_cal->add_option("--ratio", bw.o.ratio, "latent size from a compression target vs raw bf16 K/V of the group, e.g. 14")->check(CLI::PositiveNumber);
  bw_cal->add_option("--rank", bw.o.rank, "joint K/V latent size per group")->check(CLI::PositiveNumber);
  bw_cal->add_option("--rank-k", bw.o.rank_k, "split latent: the part restoring K")->check(CLI::PositiveNumber);
  bw_cal->add_option("--rank-v", bw.o.rank_v, "split latent: the part restoring V")->check(CLI::PositiveNumber);
  bw_cal->add_option("--k-fraction", bw.o.k_fraction, "with --ratio: split the latent, this fraction restoring K (0 = joint latent)")->capture_default_str()->check(CLI::Range(0.0, 0.99));
  bw_cal->add_option("--objective", bw.objective, "plain (K/V squared error) or attention (K error weighted by query energy, V error by the output projection)")->capture_default_str()->check(CLI::IsMember({"plain", "attention"}));
  bw_cal->add_flag("--token-table", bw.o.token_table, "layer 0 exactly from a per-token table (its input is the token's embedding): one 16-bit token id per token instead of latent width for layer 0");
  bw_cal->add_flag("--input-pca", bw.o.input_pca, "baseline: per layer, a PCA of the layer input restored through Wk/Wv (store the input instead of K/V)");
  bw_cal->add_flag("--equalize", bw.o.equalize_blocks, "weigh every layer's K and V block equally (a sum of relative errors)");
  bw_cal->add_option("--ridge", bw.o.ridge, "ridge term, relative to the mean variance of the inputs")->capture_default_str()->check(CLI::NonNegativeNumber);
  bw_cal->add_option("--tokens", bw.o.tokens, "calibration tokens to run")->capture_default_str()->check(CLI::PositiveNumber);
  bw_cal->add_option("--window", bw.o.window, "tokens per forward window (0 = the model's context)")->capture_default_str()->check(CLI::NonNegativeNumber);
  auto* bw_ins = bellows->add_subcommand("inspect", "Print a calibration file's model, groups, latent sizes and calibration errors");
  bw_ins->add_option("file", *bw_inspect, "calibration file (.bkv)")->required();
  out.push_back({bw_cal, [bw_ptr] { return RunBellowsCalibrate(*bw_ptr); }});
  out.push_back({bw_ins, [bw_inspect] { return RunBellowsInspect(*bw_inspect); }});
}

}  // namespace keel::cli
