// keel generate | serve | bench | inspect | convert | make-model: the engine's commands.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "apps/cli.h"
#include "keel/core/log.h"
#include "keel/engine/convert.h"
#include "keel/engine/engine.h"
#include "keel/engine/hilo_levels.h"  // engine-hilo
#include "keel/engine/server.h"
#include "keel/engine/throughput.h"
#include "keel/kv/registry.h"
#include "keel/moe/offload.h"

namespace keel::cli {
namespace {

using namespace keel::engine;

struct KvCodecArgs {
  std::string codec = "raw";
  std::string bellows;  // calibration file for --kv-codec bellows
  std::map<std::string, std::string> Params() const {
    std::map<std::string, std::string> p;
    if (!bellows.empty()) p["bellows"] = bellows;
    return p;
  }
  // --bellows with another codec would be read by nothing, unless a HiLO state may switch the
  // engine to bellows at run time (`switchable`).
  Status CheckBellows(bool switchable) const {
    if (bellows.empty() || switchable || kv::CodecFamilyName(codec) == "bellows") return Status::Ok();
    return Status::InvalidArgument("--bellows is the calibration of --kv-codec bellows; with --kv-codec " + codec +
                                   " nothing would read it");
  }
};

void AddKvCodecFlags(CLI::App* cmd, KvCodecArgs& a) {
  cmd->add_option("--kv-codec", a.codec, "KV cache codec: " + kv::KnownCodecs())->capture_default_str();
  cmd->add_option("--bellows", a.bellows,
                  "BellowsKV calibration file for --kv-codec bellows (written by `keel bellows calibrate` for this model)")
      ->check(CLI::ExistingFile);
}

// Offloaded MoE decoding (keel/moe), shared by generate, serve and bench: off unless --moe-slots.
struct MoeArgs {
  int slots = 0;
  std::string policy = "psr";
  moe::OffloadOptions o;
  double link_gbps = 0, link_latency_us = 0, jitter_us = 0;
  bool reorder = false;
  uint64_t seed = 0;
  CLI::App* cmd = nullptr;  // to tell which options were given
};

// The options that mean something only with --moe-slots.
constexpr const char* kMoeOffloadOptions[] = {"--moe-policy", "--moe-bonus", "--moe-lookahead", "--moe-decay",
                                              "--moe-source", "--moe-link-gbps", "--moe-link-latency-us",
                                              "--moe-copy-jitter-us", "--moe-copy-reorder", "--moe-copy-seed"};

void AddMoeFlags(CLI::App* cmd, MoeArgs& a) {
  a.cmd = cmd;
  cmd->add_option("--moe-slots", a.slots,
                  "offload MoE experts: resident expert slots per layer (top_k..n_experts; 0 = every expert in memory)")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  cmd->add_option("--moe-policy", a.policy,
                  "with --moe-slots: lru (exact routing, on-demand copies), prefetch (exact, + next-layer router "
                  "prefetch), psr (deterministic logical-cache routing bonus), resident-bias (timing-dependent; "
                  "for comparison only)")->capture_default_str();
  cmd->add_option("--moe-bonus", a.o.bonus, "psr: router-logit bonus of cached experts")->capture_default_str();
  cmd->add_option("--moe-lookahead", a.o.lookahead, "psr: predicted experts entering the next layer's cache (0..top_k; 0 = no lookahead)")
      ->capture_default_str();
  cmd->add_option("--moe-decay", a.o.decay, "psr: moving-average decay of router choices, in (0, 1)")->capture_default_str();
  cmd->add_option("--moe-source", a.o.source,
                  "slow tier: dram (the mapped model) or file-direct (O_DIRECT reads of the model file)")->capture_default_str();
  // Bounded so a modelled copy stays under an hour (beyond, the time would not fit the clock).
  cmd->add_option("--moe-link-gbps", a.link_gbps, "copy link bandwidth in GB/s standing in for PCIe (0 = unpaced; else >= 1e-6)")
      ->capture_default_str()->check(CLI::Validator(
          [](std::string& v) -> std::string {
            double g = 0;
            if (!CLI::detail::lexical_cast(v, g) || !(g == 0 || (g >= 1e-6 && g <= 1e6))) return "must be 0 or in [1e-6, 1e6]";
            return "";
          },
          "0 or 1e-6..1e6"));
  cmd->add_option("--moe-link-latency-us", a.link_latency_us, "copy link latency per copy, microseconds (at most 1e9)")
      ->capture_default_str()->check(CLI::Range(0.0, 1e9));
  cmd->add_option("--moe-copy-jitter-us", a.jitter_us, "fault injection: extra random delay per copy, up to this many microseconds (at most 1e9)")
      ->capture_default_str()->check(CLI::Range(0.0, 1e9));
  cmd->add_flag("--moe-copy-reorder", a.reorder, "fault injection: start queued copies in random order");
  cmd->add_option("--moe-copy-seed", a.seed, "seed of the injected delays and reorderings")->capture_default_str();
}

// Sets o.feed_forward to build the offloaded runtime when --moe-slots is given.
Status ApplyMoeFlags(const MoeArgs& a, EngineOptions& o) {
  if (a.slots == 0) {
    for (const char* name : kMoeOffloadOptions) {
      if (a.cmd != nullptr && a.cmd->count(name) > 0) {
        return Status::InvalidArgument(std::string(name) + " configures offloaded MoE decoding, which is off without --moe-slots");
      }
    }
    return Status::Ok();
  }
  moe::OffloadOptions opt = a.o;
  KEEL_ASSIGN_OR_RETURN(opt.policy, moe::ParsePolicy(a.policy));
  opt.slots = a.slots;
  opt.copy.bandwidth_bytes_per_s = a.link_gbps * 1e9;
  opt.copy.latency_s = a.link_latency_us * 1e-6;
  opt.copy.jitter_s = a.jitter_us * 1e-6;
  opt.copy.reorder = a.reorder;
  opt.copy.seed = a.seed;
  o.feed_forward = [opt](const Model& m) -> Result<std::unique_ptr<FeedForwardStack>> {
    KEEL_ASSIGN_OR_RETURN(std::unique_ptr<moe::OffloadedMoe> s, moe::OffloadedMoe::Create(m, opt));
    return std::unique_ptr<FeedForwardStack>(std::move(s));
  };
  return Status::Ok();
}

// --kvstore and its flags: the link's options, and the file holding the tag key (read at run).
struct KvStoreLinkArgs {
  KvStoreLinkOptions o;
  std::string key_file;
};

struct GenerateArgs {
  std::string model, tokenizer, prompt;
  KvCodecArgs kv;
  float temperature = 1.0f, top_p = 1.0f;
  int top_k = 0, max_tokens = 256;
  uint64_t seed = 0;
  bool seed_set = false;
  std::vector<std::string> stop;
  bool print_ids = false;
  int logprobs = -1;
  KvStoreLinkArgs kvstore;
  MoeArgs moe;
};

// The engine options generate and serve share: model, tokenizer, KV codec, offloaded MoE, kvstore
// link. `switchable`: a HiLO level may switch the codec at run time (CheckBellows).
Status CommonEngineOptions(const std::string& model, const std::string& tokenizer, const KvCodecArgs& kv,
                           const MoeArgs& moe, const KvStoreLinkArgs& kvstore, bool switchable, EngineOptions* opt) {
  KEEL_RETURN_IF_ERROR(kv.CheckBellows(switchable));
  KEEL_RETURN_IF_ERROR(ApplyMoeFlags(moe, *opt));
  opt->model_path = model;
  opt->tokenizer_path = tokenizer;
  opt->kv_codec = kv.codec;
  opt->kv.codec_params = kv.Params();
  opt->kvstore = kvstore.o;
  if (!kvstore.key_file.empty()) {
    if (kvstore.o.address.empty()) return Status::InvalidArgument("--kvstore-key-file needs --kvstore");
    KEEL_ASSIGN_OR_RETURN(opt->kvstore.tag_key, ReadSecretFile(kvstore.key_file, "kvstore key"));
  }
  return Status::Ok();
}

int RunGenerate(const GenerateArgs& a) {
  EngineOptions opt;
  if (Status s = CommonEngineOptions(a.model, a.tokenizer, a.kv, a.moe, a.kvstore, false, &opt); !s.ok()) return Fail(s);
  auto engine = Engine::Open(opt);
  if (!engine.ok()) return Fail(engine.status());
  Engine& e = **engine;
  GenerationParams p;
  p.sampling.temperature = a.temperature;
  p.sampling.top_k = a.top_k;
  p.sampling.top_p = a.top_p;
  p.sampling.seed = a.seed_set ? a.seed : static_cast<uint64_t>(std::random_device{}());
  p.stop = a.stop;
  p.logprobs = a.logprobs;
  const int prompt_len = static_cast<int>(e.tokenizer().Encode(a.prompt, true).size());
  // Like llama2.c, clamp the length to what the context can hold.
  p.max_tokens = std::min(a.max_tokens, e.model().config.max_seq_len - prompt_len);
  if (p.max_tokens < 1) {
    return Fail(Status::InvalidArgument("prompt has " + std::to_string(prompt_len) +
                                        " tokens, which fills the model's context of " +
                                        std::to_string(e.model().config.max_seq_len)));
  }
  std::vector<int> ids;
  std::vector<TokenLogprob> logprobs;
  auto t0 = std::chrono::steady_clock::now();
  auto done = e.Generate(a.prompt, p, [](const std::string& text) {
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fflush(stdout);
  }, &ids, &logprobs);
  std::fputc('\n', stdout);
  std::fflush(stdout);  // before anything on stderr, so a merged output keeps its order
  if (!done.ok()) return Fail(done.status());
  if (KvStoreLink* link = e.kvstore_link()) link->Flush();  // publish before exiting
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (a.print_ids) {
    std::string s;
    for (int id : ids) s += std::to_string(id) + " ";
    std::fprintf(stderr, "ids: %s\n", s.c_str());
  }
  // One line per generated token: id, log-probability, then the alternatives as id:logprob.
  // %.9g prints every float exactly, so two runs' lines compare bit for bit.
  for (const TokenLogprob& lp : logprobs) {
    std::string line = fmt::format("logprob: {} {:.9g}", lp.token, lp.logprob);
    for (const auto& [id, v] : lp.top) line += fmt::format(" {}:{:.9g}", id, v);
    std::fprintf(stderr, "%s\n", line.c_str());
  }
  Log().info("{} prompt + {} generated tokens in {:.3f} s ({:.1f} tok/s), finish_reason={}", prompt_len,
             done->completion_tokens, secs, done->completion_tokens / std::max(secs, 1e-9),
             FinishReasonName(done->finish_reason));
  if (const auto* off = dynamic_cast<const moe::OffloadedMoe*>(&e.feed_forward())) {
    const moe::OffloadStats st = off->stats();
    Log().info("experts ({}, {} slots/layer): hit ratio {:.3f}, {} demand + {} prefetch copies ({:.1f} MiB), stalled {:.3f} s",
               moe::PolicyName(off->options().policy), off->options().slots, st.hit_ratio(), st.demand_copies,
               st.prefetch_copies, st.bytes / 1048576.0, st.stall_s);
  }
  return 0;
}

struct ServeArgs {
  std::string model, tokenizer, host = "127.0.0.1", name;
  KvCodecArgs kv;
  int port = 8080, max_queue = 64, max_running = 32, max_batch_tokens = 512;
  size_t kv_mb = 256;
  bool prefix_cache = true;
  double drain = 10;
  KvStoreLinkArgs kvstore;
  MoeArgs moe;
  HiloFlags hilo;              // engine-hilo
  int hilo_drain_ms = 1000;    // engine-hilo
};

// ---- engine-hilo (begin): `keel serve` follows HiLO (keel/engine/hilo_levels.h, docs/engine.md)
void AddEngineHiloFlags(CLI::App* cmd, ServeArgs& a) {
  auto* url = cmd->add_option("--hilo", a.hilo.url, "follow the HiLO controller at this URL (http://host:port): apply its state's engine level, report load");
  auto* cat = cmd->add_option("--hilo-catalog", a.hilo.catalog, "without a controller: a HiLO state catalog to pin one state of (with --hilo-state)")
      ->check(CLI::ExistingFile);
  url->excludes(cat);
  cmd->add_option("--hilo-state", a.hilo.state, "the HiLO state to pin (required with --hilo-catalog; with --hilo it freezes the state)");
  cmd->add_option("--hilo-instance", a.hilo.instance, "this instance's name in HiLO load reports (default engine-<pid>)");
  cmd->add_option("--hilo-switch-drain-ms", a.hilo_drain_ms, "on a KV codec switch, let running sequences finish this long before preempting them")
      ->capture_default_str()->check(CLI::Range(0, 600000));
}

// Stops the link before the HiloLevels it calls back into goes (declared after it).
struct StopHiloLink {
  hilo::ServiceLink* link = nullptr;
  ~StopHiloLink() {
    if (link != nullptr) link->Stop();
  }
};
// ---- engine-hilo (end)

int RunServe(const ServeArgs& a) {
  EngineOptions opt;
  const bool switchable = !a.hilo.url.empty() || !a.hilo.catalog.empty();
  if (Status s = CommonEngineOptions(a.model, a.tokenizer, a.kv, a.moe, a.kvstore, switchable, &opt); !s.ok()) {
    return Fail(s);
  }
  opt.kv.budget_bytes = a.kv_mb << 20;
  opt.kv.prefix_sharing = a.prefix_cache;
  opt.scheduler.max_queue = a.max_queue;
  opt.scheduler.max_running = a.max_running;
  opt.scheduler.max_batch_tokens = a.max_batch_tokens;
  auto metrics = MakeEngineMetrics();
  auto engine = Engine::Open(opt, ObserverFor(metrics));
  if (!engine.ok()) return Fail(engine.status());
  Engine& e = **engine;
  e.feed_forward().RegisterMetrics(metrics->registry);
  ServerOptions so;
  so.host = a.host;
  so.port = a.port;
  so.model_name = a.name;
  so.drain_seconds = a.drain;
  const auto& c = e.model().config;
  // Before the scheduler runs: a HiLO level may switch the cache once it does.  // engine-hilo
  Log().info("model {} ({} layers, dim {}, context {}, {} parameters), KV codec {}, KV budget {} blocks of {} tokens, "
             "prefix cache {}",
             e.model().source, c.n_layers, c.dim, c.max_seq_len, c.ParameterCount(), e.cache().codec().spec(),
             e.cache().Stats().blocks_total, e.cache().block_tokens(), e.cache().prefix_sharing() ? "on" : "off");
  auto hilo_link = OpenHiloLink(a.hilo, a.max_running, &metrics->registry);  // engine-hilo
  if (!hilo_link.ok()) return Fail(hilo_link.status());  // engine-hilo
  std::unique_ptr<HiloLevels> hilo_levels;  // engine-hilo
  if (*hilo_link) {  // engine-hilo
    auto levels = HiloLevels::Create(**hilo_link, e, {std::chrono::milliseconds(a.hilo_drain_ms)});  // engine-hilo
    if (!levels.ok()) return Fail(levels.status());  // engine-hilo
    hilo_levels = std::move(*levels);  // engine-hilo
    so.hilo = hilo_levels.get();  // engine-hilo
  }  // engine-hilo
  StopHiloLink stop_hilo;  // engine-hilo
  Server server(e.scheduler(), e.tokenizer(), so, metrics);
  if (Status s = server.Start(); !s.ok()) return Fail(s);
  if (*hilo_link) {  // engine-hilo
    if (Status s = (*hilo_link)->Start(); !s.ok()) return Fail(s);  // engine-hilo
    stop_hilo.link = hilo_link->get();  // engine-hilo
  }  // engine-hilo
  Log().info("serving \"{}\" on http://{}:{}", server.model_name(), a.host, server.port());
  if (Status s = RunServerUntilSignal(server); !s.ok()) return Fail(s);
  Log().info("stopped");
  return 0;
}

void AddKvStoreLinkFlags(CLI::App* cmd, KvStoreLinkArgs& a) {
  cmd->add_option("--kvstore", a.o.address, "share prefix KV through a `keel kvstore` at host:port");
  cmd->add_option("--kvstore-timeout-ms", a.o.lookup_timeout_ms, "deadline for one prompt's store lookup")
      ->capture_default_str()->check(CLI::Range(1, 600000));
  cmd->add_option("--kvstore-key-file", a.key_file,
                  "file whose first line (16..256 printable bytes) keys the chunk tags (HMAC-SHA256), the same on "
                  "every instance: values written by anyone without it are refused")
      ->check(CLI::ExistingFile);
}

struct BenchArgs {
  std::string model;
  KvCodecArgs kv;
  int prompt = 64, decode = 64, repeats = 3;
  std::vector<int> concurrency = {1, 16};
};

int RunBench(const BenchArgs& a) {
  if (Status s = a.kv.CheckBellows(false); !s.ok()) return Fail(s);
  auto m = LoadModel(a.model);
  if (!m.ok()) return Fail(m.status());
  ThroughputOptions o;
  o.prompt_tokens = a.prompt;
  o.decode_tokens = a.decode;
  o.concurrency = a.concurrency;
  o.kv_codec = a.kv.codec;
  o.kv_codec_params = a.kv.Params();
  o.repeats = a.repeats;
  auto rep = MeasureThroughput(*m, o);
  if (!rep.ok()) return Fail(rep.status());
  std::string title = m->source + " (" + std::to_string(m->config.ParameterCount()) + " parameters, " +
                      std::to_string(a.prompt) + " prompt + " + std::to_string(a.decode) + " decode tokens, KV " + a.kv.codec + ")";
  std::fputs(rep->Table(title).c_str(), stdout);
  return 0;
}

int RunInspect(const std::string& path) {
  auto m = LoadModel(path);
  if (!m.ok()) return Fail(m.status());
  std::fputs(DescribeModel(*m).c_str(), stdout);
  return 0;
}

struct ConvertArgs {
  std::string model, tokenizer, out, dtype = "f32";
};

Result<DType> ParseDType(const std::string& s) {
  if (s == "f32" || s == "F32") return DType::kF32;
  if (s == "f16" || s == "F16") return DType::kF16;
  if (s == "bf16" || s == "BF16") return DType::kBF16;
  return Status::InvalidArgument("unknown dtype '" + s + "' (f32, f16, bf16)");
}

int RunConvert(const ConvertArgs& a) {
  auto m = LoadModel(a.model);
  if (!m.ok()) return Fail(m.status());
  auto dt = ParseDType(a.dtype);
  if (!dt.ok()) return Fail(dt.status());
  auto tok = TokenizerFor(a.model, a.tokenizer);
  if (!tok.ok()) return Fail(tok.status());
  if (Status s = ConvertToSafetensors(*m, *tok, a.out, *dt); !s.ok()) return Fail(s);
  Log().info("wrote {} (config.json, model.safetensors, tokenizer.bin)", a.out);
  return 0;
}


int RunMakeModel(RandomModelOptions mk, const std::string& dtype) {
  auto dt = ParseDType(dtype);
  if (!dt.ok()) return Fail(dt.status());
  mk.dtype = *dt;
  if (Status s = MakeRandomModel(mk); !s.ok()) return Fail(s);
  auto cfg = RandomModelConfig(mk);
  if (cfg.ok() && cfg->moe.enabled()) {
    Log().info("wrote {} ({} parameters, {} active per token)", mk.out_dir, cfg->ParameterCount(),
               cfg->ActiveParameterCount());
  } else {
    Log().info("wrote {} ({} parameters)", mk.out_dir, cfg.ok() ? cfg->ParameterCount() : 0);
  }
  return 0;
}

}  // namespace

void AddEngineCommands(CLI::App& app, Commands& out) {
  auto gen_args = std::make_shared<GenerateArgs>();
  GenerateArgs& gen = *gen_args;
  auto* generate = app.add_subcommand("generate", "Generate text from a prompt (text on stdout, logs on stderr)");
  generate->add_option("--model,-m", gen.model, "llama2.c .bin checkpoint or Hugging Face model directory")->required();
  generate->add_option("--tokenizer,-z", gen.tokenizer, "llama2.c tokenizer.bin (default: found beside the model)");
  generate->add_option("--prompt,-i", gen.prompt, "prompt text (default: empty, generation starts from BOS)");
  generate->add_option("--temperature,-t", gen.temperature, "0 = greedy")->capture_default_str()->check(CLI::Range(0.0f, 100.0f));
  generate->add_option("--top-p,-p", gen.top_p, "nucleus sampling threshold")->capture_default_str()->check(CLI::Range(0.0f, 1.0f));
  generate->add_option("--top-k", gen.top_k, "0 = off")->capture_default_str()->check(CLI::NonNegativeNumber);
  generate->add_option("--max-tokens,-n", gen.max_tokens, "tokens to generate at most (clamped to the context)")
      ->capture_default_str()->check(CLI::PositiveNumber);
  generate->add_option("--seed,-s", gen.seed, "random seed (default: random)")->each([gen_args](const std::string&) { gen_args->seed_set = true; });
  generate->add_option("--stop", gen.stop, "stop sequence (repeatable)");
  AddKvCodecFlags(generate, gen.kv);
  generate->add_flag("--print-ids", gen.print_ids, "print generated token ids on stderr");
  generate->add_option("--logprobs", gen.logprobs,
                       "print each generated token's log-probability and this many most likely alternatives on stderr")
      ->check(CLI::Range(0, kMaxTopLogprobs));
  AddKvStoreLinkFlags(generate, gen.kvstore);
  AddMoeFlags(generate, gen.moe);

  out.push_back({generate, [gen_args] { return RunGenerate(*gen_args); }, true});

  auto serve_ptr = std::make_shared<ServeArgs>();
  ServeArgs& serve_args = *serve_ptr;
  auto* serve = app.add_subcommand("serve", "Serve an OpenAI-compatible API (/v1/completions, /v1/chat/completions)");
  serve->add_option("--model,-m", serve_args.model, "llama2.c .bin checkpoint or Hugging Face model directory")->required();
  serve->add_option("--tokenizer,-z", serve_args.tokenizer, "llama2.c tokenizer.bin (default: found beside the model)");
  serve->add_option("--host", serve_args.host, "address to bind")->capture_default_str();
  serve->add_option("--port", serve_args.port, "port to bind (0 = any free port)")->capture_default_str()->check(CLI::Range(0, 65535));
  serve->add_option("--model-name", serve_args.name, "name clients use in \"model\" (default: model file stem)");
  AddKvCodecFlags(serve, serve_args.kv);
  serve->add_option("--kv-memory-mb", serve_args.kv_mb, "KV cache budget in MiB")->capture_default_str()->check(CLI::Range(1, 1 << 20));
  serve->add_flag("--prefix-cache,!--no-prefix-cache", serve_args.prefix_cache,
                  "reuse the KV blocks of a prompt prefix seen before (default on; off: every prompt is prefilled, "
                  "e.g. to measure traffic whose prompts do not repeat; not with --kvstore)");
  serve->add_option("--max-queue", serve_args.max_queue, "requests waiting for a batch slot before 429 (every request waits there, so at least 1)")->capture_default_str()->check(CLI::Range(1, 100000));
  serve->add_option("--max-running", serve_args.max_running, "sequences batched per step")->capture_default_str()->check(CLI::Range(1, 4096));
  serve->add_option("--max-batch-tokens", serve_args.max_batch_tokens, "tokens per forward step")->capture_default_str()->check(CLI::Range(1, 1 << 20));
  serve->add_option("--drain-seconds", serve_args.drain, "on SIGTERM, let streams finish this long")->capture_default_str();
  AddKvStoreLinkFlags(serve, serve_args.kvstore);
  AddMoeFlags(serve, serve_args.moe);
  AddEngineHiloFlags(serve, serve_args);  // engine-hilo
  out.push_back({serve, [serve_ptr] { return RunServe(*serve_ptr); }, true});

  auto bench_ptr = std::make_shared<BenchArgs>();
  BenchArgs& bench_args = *bench_ptr;
  auto* bench = app.add_subcommand("bench", "Measure prefill/decode tokens/s next to a memory-bandwidth roofline");
  bench->add_option("--model,-m", bench_args.model, "model to measure")->required();
  bench->add_option("--prompt-tokens", bench_args.prompt, "prompt length per sequence")->capture_default_str()->check(CLI::PositiveNumber);
  bench->add_option("--decode-tokens", bench_args.decode, "generated tokens per sequence")->capture_default_str()->check(CLI::PositiveNumber);
  bench->add_option("--concurrency", bench_args.concurrency, "sequences decoded together (list)")->capture_default_str()->delimiter(',');
  bench->add_option("--repeats", bench_args.repeats, "best of N runs")->capture_default_str()->check(CLI::PositiveNumber);
  AddKvCodecFlags(bench, bench_args.kv);

  out.push_back({bench, [bench_ptr] { return RunBench(*bench_ptr); }, true});

  auto inspect_path = std::make_shared<std::string>();
  auto* inspect = app.add_subcommand("inspect", "Print a model's header, tensor list and checksum");
  inspect->add_option("model", *inspect_path, "llama2.c .bin or Hugging Face model directory")->required();

  out.push_back({inspect, [inspect_path] { return RunInspect(*inspect_path); }});

  auto conv_ptr = std::make_shared<ConvertArgs>();
  ConvertArgs& conv = *conv_ptr;
  auto* convert = app.add_subcommand("convert", "Convert a llama2.c checkpoint to Hugging Face safetensors + config.json");
  convert->add_option("--model,-m", conv.model, "model to convert")->required();
  convert->add_option("--tokenizer,-z", conv.tokenizer, "llama2.c tokenizer (default: found beside the model)");
  convert->add_option("--out,-o", conv.out, "output directory")->required();
  convert->add_option("--dtype", conv.dtype, "f32, f16 or bf16")->capture_default_str();

  out.push_back({convert, [conv_ptr] { return RunConvert(*conv_ptr); }});

  auto mk_ptr = std::make_shared<RandomModelOptions>();
  RandomModelOptions& mk = *mk_ptr;
  auto mk_dtype = std::make_shared<std::string>("f32");
  auto* make_model = app.add_subcommand("make-model", "Write a seeded random-weight model (safetensors + config.json + tokenizer.bin)");
  make_model->add_option("--arch", mk.arch, "llama, qwen2, or MoE: mixtral, olmoe, qwen2_moe")->capture_default_str()->check(CLI::IsMember({"llama", "qwen2", "mixtral", "olmoe", "qwen2_moe"}));
  make_model->add_option("--layers", mk.layers, "transformer layers")->capture_default_str();
  make_model->add_option("--dim", mk.dim, "hidden size")->capture_default_str();
  make_model->add_option("--heads", mk.heads, "attention heads")->capture_default_str();
  make_model->add_option("--kv-heads", mk.kv_heads, "K/V heads (0 = heads)")->capture_default_str();
  make_model->add_option("--hidden", mk.hidden, "FFN size (0 = 8*dim/3 rounded up to 32)")->capture_default_str();
  make_model->add_option("--vocab", mk.vocab, "vocabulary size (>= 259)")->capture_default_str();
  make_model->add_option("--context", mk.max_seq_len, "context length")->capture_default_str();
  make_model->add_option("--seed", mk.seed, "weight seed")->capture_default_str();
  make_model->add_option("--dtype", *mk_dtype, "f32, f16 or bf16")->capture_default_str();
  make_model->add_flag("--tie-embeddings", mk.tie_embeddings, "share the embedding as the classifier");
  make_model->add_option("--experts", mk.experts, "MoE: routed experts per layer (0 = 8)")->capture_default_str()->check(CLI::NonNegativeNumber);
  make_model->add_option("--top-k", mk.top_k, "MoE: experts per token (0 = 2)")->capture_default_str()->check(CLI::NonNegativeNumber);
  make_model->add_option("--expert-hidden", mk.expert_hidden, "MoE: each expert's FFN size (0 = as --hidden)")->capture_default_str()->check(CLI::NonNegativeNumber);
  make_model->add_option("--shared-hidden", mk.shared_hidden, "qwen2_moe: shared expert's FFN size (0 = 4 * expert hidden)")->capture_default_str()->check(CLI::NonNegativeNumber);
  make_model->add_flag("--norm-topk", mk.norm_topk, "olmoe/qwen2_moe: renormalise the top-k routing weights (norm_topk_prob; Mixtral always does)");
  make_model->add_option("--out", mk.out_dir, "output directory")->required();
  out.push_back({make_model, [mk_ptr, mk_dtype] { return RunMakeModel(*mk_ptr, *mk_dtype); }});
}

}  // namespace keel::cli
