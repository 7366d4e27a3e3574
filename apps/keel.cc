// keel: the command-line front end. Each subcommand is a thin layer over a library call.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <unistd.h>

#include <cmath>
#include <csignal>
#include <cstdlib>
#include <chrono>  // hilo
#include <cstdio>
#include <iostream>
#include <map>

#include "keel/answer/server.h"  // answer
#include "keel/core/cpu.h"
#include "keel/core/json_writer.h"  // answer-index
#include "keel/core/log.h"
#include "keel/core/mapped_file.h"  // hilo
#include "keel/core/signal.h"
#include "keel/engine/bellows_calibration.h"
#include "keel/engine/convert.h"
#include "keel/engine/engine.h"
#include "keel/engine/hilo_levels.h"  // engine-hilo
#include "keel/engine/server.h"
#include "keel/engine/throughput.h"
#include "keel/gateway/fake_vendor.h"  // fake-vendor
#include "keel/gateway/gateway.h"
#include "keel/gateway/policy_service.h"  // gateway-policy
#include "keel/hilo/fingerprint.h"  // hilo
#include "keel/hilo/server.h"  // hilo
#include "keel/hilo/validate/validate.h"  // hilo
#include "keel/hilo/validate/replay_live.h"  // hilo-replay
#include "keel/core/http_client.h"  // hilo
#include <nlohmann/json.hpp>  // hilo
#include "keel/kv/bellows/calibration.h"
#include "keel/kv/registry.h"
#include "keel/kvstore/service.h"
#include "keel/moe/offload.h"
#include "keel/vector/router.h"
#include "keel/vector/service.h"
#include "keel/vector/texmex.h"  // answer-index

namespace {

using namespace keel;
using namespace keel::engine;

int Fail(const Status& s) {
  Log().error("{}", s.ToString());
  return s.code() == StatusCode::kInvalidArgument ? 2 : 1;
}

// --kv-codec and the codec parameters beside it, shared by generate, serve and bench.
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
  KvStoreLinkOptions kvstore;
  MoeArgs moe;
};

int RunGenerate(const GenerateArgs& a) {
  if (Status s = a.kv.CheckBellows(false); !s.ok()) return Fail(s);
  EngineOptions opt;
  if (Status s = ApplyMoeFlags(a.moe, opt); !s.ok()) return Fail(s);
  opt.model_path = a.model;
  opt.tokenizer_path = a.tokenizer;
  opt.kv_codec = a.kv.codec;
  opt.kv.codec_params = a.kv.Params();
  opt.kvstore = a.kvstore;
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
  KvStoreLinkOptions kvstore;
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
  if (Status s = a.kv.CheckBellows(!a.hilo.url.empty() || !a.hilo.catalog.empty()); !s.ok()) return Fail(s);
  EngineOptions opt;
  if (Status s = ApplyMoeFlags(a.moe, opt); !s.ok()) return Fail(s);
  opt.model_path = a.model;
  opt.tokenizer_path = a.tokenizer;
  opt.kv_codec = a.kv.codec;
  opt.kv.codec_params = a.kv.Params();
  opt.kv.budget_bytes = a.kv_mb << 20;
  opt.kv.prefix_sharing = a.prefix_cache;
  opt.scheduler.max_queue = a.max_queue;
  opt.scheduler.max_running = a.max_running;
  opt.scheduler.max_batch_tokens = a.max_batch_tokens;
  opt.kvstore = a.kvstore;
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

struct KvstoreArgs {
  kvstore::ServiceOptions service;
  int64_t dram_mb = 1024, ssd_mb = 8192, max_value_mb = 64;
  std::string eviction;
};

int RunKvstore(KvstoreArgs a) {
  a.service.store.dram_bytes = a.dram_mb << 20;
  a.service.store.ssd_bytes = a.ssd_mb << 20;
  a.service.store.max_value_bytes = static_cast<uint64_t>(a.max_value_mb) << 20;
  a.service.server.limits.max_value_bytes = a.service.store.max_value_bytes;
  if (!a.eviction.empty()) {
    auto kind = kvstore::ParseEvictionKind(a.eviction);
    if (!kind.ok()) return Fail(kind.status());
    a.service.store.eviction = *kind;
  }
  auto service = kvstore::Service::Start(a.service);
  if (!service.ok()) return Fail(service.status());
  const auto& st = a.service.store;
  Log().info("kvstore on {}:{} (DRAM {} MiB{}{}), {}", a.service.server.host, (*service)->port(), a.dram_mb,
             st.ssd_dir.empty() ? "" : ", SSD " + st.ssd_dir, st.redis_url.empty() ? "" : ", Redis " + st.redis_url,
             (*service)->http_port() < 0
                 ? std::string("no HTTP side port")
                 : fmt::format("metrics on http://{}:{}/metrics", a.service.http_host, (*service)->http_port()));
  auto sig = WaitForTerminationSignal();
  if (!sig.ok()) return Fail(sig.status());
  Log().info("received {}; stopping", SignalName(*sig));
  (*service)->Stop();
  return 0;
}

struct VectorArgs {
  vector::ServiceOptions service;
  std::string index = "hnsw", placement = "coloc";
  int64_t dram_mb = 256, ssd_mb = 1024, cold_mb = 1024, max_body_mb = 64;
  std::string adversary = "honest";
  int64_t adversary_delay_ms = 200;
  std::string keygen_out;
  vector::HiloLinkFlags hilo;  // vector-hilo
};

int RunVectorKeygen(const std::string& prefix) {
  auto key = vector::trust::SigningKey::Generate();
  if (!key.ok()) return Fail(key.status());
  if (Status s = key->Save(prefix + ".key", prefix + ".pub"); !s.ok()) return Fail(s);
  Log().info("wrote {}.key (private, 0600) and {}.pub", prefix, prefix);
  return 0;
}

// ---- vector-hilo (begin): `keel vector` and `keel vector-router` follow HiLO (keel/vector/hilo_link.h)
void AddVectorHiloFlags(CLI::App* cmd, vector::HiloLinkFlags& f) {
  auto* url = cmd->add_option("--hilo", f.url, "follow the HiLO controller at this URL (http://host:port): apply its state's vector level, report load");
  auto* cat = cmd->add_option("--hilo-catalog", f.catalog, "without a controller: a HiLO state catalog to pin one state of (with --hilo-state)")
      ->check(CLI::ExistingFile);
  url->excludes(cat);
  cmd->add_option("--hilo-state", f.state, "the HiLO state to pin (required with --hilo-catalog; with --hilo it freezes the state)");
  cmd->add_option("--hilo-instance", f.instance, "this instance's name in HiLO load reports (default vector-<pid>)");
}
void AddVectorReplicaHiloFlags(CLI::App* cmd, vector::HiloLinkFlags& f) {
  AddVectorHiloFlags(cmd, f);
  cmd->add_flag("--hilo-no-meter{false}", f.meter,
                "behind a vector-router: follow the state but meter no searches (the router reports the tier's load)");
}
// ---- vector-hilo (end)

int RunVector(VectorArgs a) {
  auto& sh = a.service.shard;
  if (sh.dir.empty()) return Fail(Status::InvalidArgument("vector: --dir is required"));
  auto& adv = a.service.identity.adversary;
  auto mode = vector::trust::ParseAdversaryMode(a.adversary);
  if (!mode.ok()) return Fail(mode.status());
  adv.mode = *mode;
  adv.delay = std::chrono::milliseconds(a.adversary_delay_ms);
  if (adv.mode != vector::trust::AdversaryMode::kHonest) {
    Log().warn("vector replica {}: adversary mode {} (tampers with its answers; tests and benchmarks only)",
               a.service.identity.replica, a.adversary);
  }
  auto kind = vector::ParseIndexKind(a.index);
  if (!kind.ok()) return Fail(kind.status());
  sh.index.kind = *kind;
  sh.tiers.dram_bytes = a.dram_mb << 20;
  sh.tiers.ssd_bytes = a.ssd_mb << 20;
  sh.tiers.cold_bytes = a.cold_mb << 20;
  a.service.max_body_bytes = static_cast<size_t>(a.max_body_mb) << 20;
  // With one tier there is nothing to place.
  const bool tiered = !sh.tiers.ssd_dir.empty() || !sh.tiers.cold_dir.empty() || !sh.tiers.redis_url.empty();
  if (a.placement != "off" && tiered) {
    auto policy = vector::coloc::ParsePlacementPolicy(a.placement);
    if (!policy.ok()) return Fail(policy.status());
    a.service.placer = true;
    a.service.placer_options.policy = *policy;
  }
  auto hilo_link = vector::OpenHiloLink(a.hilo, a.service.max_active_requests);  // vector-hilo
  if (!hilo_link.ok()) return Fail(hilo_link.status());  // vector-hilo
  a.service.hilo = *hilo_link;  // vector-hilo
  a.service.hilo_meter = a.hilo.meter;  // vector-hilo
  auto service = vector::Service::Start(a.service);
  if (!service.ok()) return Fail(service.status());
  const auto& id = a.service.identity;
  Log().info("vector shard {} ({} items, index version {}, {}, text {}d, image {}d) on http://{}:{} (placement {}); "
             "shard {}/{} replica {} zone {}, replies {}",
             sh.dir, (*service)->shard().Stats().items, (*service)->shard().version(), a.index, sh.text_dim, sh.image_dim,
             a.service.host, (*service)->port(), a.service.placer ? a.placement : "off", id.shard, id.shards, id.replica,
             id.zone, id.signing_key_path.empty() ? "unsigned" : "signed");
  auto sig = WaitForTerminationSignal();
  if (!sig.ok()) return Fail(sig.status());
  Log().info("received {}; stopping (snapshot)", SignalName(*sig));
  if (Status s = (*service)->Stop(); !s.ok()) return Fail(s);
  if (a.service.hilo) a.service.hilo->Stop();  // vector-hilo
  return 0;
}

void AddKvStoreLinkFlags(CLI::App* cmd, KvStoreLinkOptions& o) {
  cmd->add_option("--kvstore", o.address, "share prefix KV through a `keel kvstore` at host:port");
  cmd->add_option("--kvstore-timeout-ms", o.lookup_timeout_ms, "deadline for one prompt's store lookup")
      ->capture_default_str()->check(CLI::Range(1, 600000));
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

// ---- gateway-policy (begin): the gateway's governance service on a local socket
struct GatewayPolicyArgs {
  gateway::PolicyServiceOptions service;
  std::string admin_key_file;
};

int RunGatewayPolicy(GatewayPolicyArgs a) {
  auto admin_key = gateway::LoadAdminKey(a.admin_key_file);
  if (!admin_key.ok()) return Fail(admin_key.status());
  a.service.admin_key = std::move(admin_key).value();
  const gateway::PolicyStoreOptions st = a.service.store;
  auto service = gateway::PolicyService::Start(std::move(a.service));
  if (!service.ok()) return Fail(service.status());
  Log().info("gateway-policy on unix:{} (db {}, spend {}, decision TTL {} ms)", (*service)->socket_path(), st.db_path,
             st.redis_url.empty() ? "from the ledger" : "in Redis " + st.redis_url, st.decision_ttl_ms);
  auto sig = WaitForTerminationSignal();
  if (!sig.ok()) return Fail(sig.status());
  Log().info("received {}; stopping", SignalName(*sig));
  (*service)->Stop();
  return 0;
}
// ---- gateway-policy (end)

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

// ---- hilo
struct HiloArgs {
  std::string catalog;
  std::string admin_token_file;
  hilo::ControllerServerOptions o;
  hilo::ServicePolicyOptions baseline;  // --policy per-service: every service's thresholds
};

// --fingerprint when given, else the running executable's (every service is this binary).
Status ResolveFingerprint(HiloArgs& a) {
  if (!a.o.fingerprint.empty()) return Status::Ok();
  KEEL_ASSIGN_OR_RETURN(a.o.fingerprint, hilo::ExecutableFingerprint());
  return Status::Ok();
}

// The admin token: the file's first line, 16..256 printable bytes (so a short guessable one is refused).
Result<std::string> ReadAdminToken(const std::string& path) {
  KEEL_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(path, 64 << 10));
  const size_t nl = text.find_first_of("\r\n");
  if (nl != std::string::npos) text.resize(nl);
  if (text.size() < 16 || text.size() > 256) return Status::InvalidArgument(path + ": admin token must be 16..256 bytes on the first line");
  for (unsigned char c : text) {
    if (c < 0x21 || c > 0x7e) return Status::InvalidArgument(path + ": admin token must be printable ASCII without spaces");
  }
  return text;
}


int64_t UnixSecondsNow() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

int RunHiloServe(HiloArgs a) {
  if (Status s = ResolveFingerprint(a); !s.ok()) return Fail(s);
  if (!a.admin_token_file.empty()) {
    auto token = ReadAdminToken(a.admin_token_file);
    if (!token.ok()) return Fail(token.status());
    a.o.admin_token = std::move(*token);
  }
  auto c = hilo::ReadCatalogFile(a.catalog);
  if (!c.ok()) return Fail(c.status());
  a.o.per_service.fill(a.baseline);
  auto server = hilo::ControllerServer::Create(std::move(*c), a.o);
  if (!server.ok()) return Fail(server.status());
  if (Status s = (*server)->Start(); !s.ok()) return Fail(s);
  auto sig = WaitForTerminationSignal();
  if (!sig.ok()) return Fail(sig.status());
  Log().info("received {}; stopping", SignalName(*sig));
  (*server)->Stop();
  return 0;
}

// Prints every state and whether the controller could act on it; exit 0 only when CheckUsable passes.
int RunHiloCheck(HiloArgs a) {
  if (Status s = ResolveFingerprint(a); !s.ok()) return Fail(s);
  auto c = hilo::ReadCatalogFile(a.catalog);
  if (!c.ok()) return Fail(c.status());
  const int64_t now = UnixSecondsNow();
  std::printf("%s: %zu states, safe state '%s', operating limit %.3g quality points\n", a.catalog.c_str(),
              c->states.size(), c->safe_state.c_str(), c->max_quality_drop);
  std::printf("  binaries: '%s' (running: '%s')%s\n", c->binaries.c_str(), a.o.fingerprint.c_str(),
              c->binaries == a.o.fingerprint && !c->binaries.empty() ? "" : "  <- mismatch");
  for (size_t i = 0; i < c->states.size(); ++i) {
    const hilo::State& s = c->states[i];
    std::string why = "validated, fresh";
    if (!s.figures) {
      why = "NOT VALIDATED (no figures)";
    } else if (now - s.figures->validated_at > a.o.max_age_s) {
      why = fmt::format("STALE: validated {} s ago (limit {} s)", now - s.figures->validated_at, a.o.max_age_s);
    }
    std::printf("  [%zu] %-16s %s", i, s.name.c_str(), why.c_str());
    if (s.figures) {
      std::printf("  quality %.3g, capacity answer %.4g vector %.4g engine %.4g gateway %.4g req/s", s.figures->quality,
                  s.figures->Capacity(hilo::Service::kAnswer), s.figures->Capacity(hilo::Service::kVector),
                  s.figures->Capacity(hilo::Service::kEngine), s.figures->Capacity(hilo::Service::kGateway));
      // What --objective expected-quality can do with the state (docs/hilo.md, "Controller rules").
      const double full = hilo::QualityCapacity(c->states[0]);
      std::printf("; quality x capacity %.3gx full's", full > 0 ? hilo::QualityCapacity(s) / full : 0.0);
      if (s.figures->HasGoodput()) {
        const double full_g = hilo::QualityGoodput(c->states[0]);
        std::printf("; overloaded at %.4g req/s it served %.4g (quality x goodput %.3gx full's)", s.figures->offered,
                    s.figures->goodput, full_g > 0 ? hilo::QualityGoodput(s) / full_g : 0.0);
      }
      std::printf("%s", hilo::ExpectedQualityCanPick(*c, static_cast<int>(i)) ? ""
                                                                        : " (expected-quality never picks it: shedding in a better state serves more)");
    }
    std::printf("\n");
  }
  Status s = hilo::CheckUsable(*c, a.o.fingerprint, now, a.o.max_age_s);
  // The hilo library knows no codecs; the binary that checks does.
  for (size_t i = 0; i < c->states.size() && s.ok(); ++i) {
    if (!kv::IsLosslessCodec(c->states[i].engine.kv_codec).has_value()) {
      s = Status::InvalidArgument(fmt::format("state '{}': engine.kv_codec '{}' is not a KV codec (known: {})",
                                              c->states[i].name, c->states[i].engine.kv_codec, kv::KnownCodecs()));
    }
  }
  std::printf("%s\n", s.ok() ? "usable" : s.message().c_str());
  return s.ok() ? 0 : 1;
}

struct HiloValidateArgs {
  std::string catalog;
  std::string out;
  std::string admin_token_file;
  std::string corpus;
  std::string vectors;
  int queries = 100;
  hilo::ValidateOptions o;
};

// $KEEL_SHARED/<rel> when `path` is empty; InvalidArgument naming `flag` when neither is set.
Result<std::string> SharedDefault(const std::string& path, const char* rel, const char* flag) {
  if (!path.empty()) return path;
  const char* shared = std::getenv("KEEL_SHARED");
  if (shared == nullptr || *shared == '\0') return Status::InvalidArgument(std::string(flag) + " is required (or set KEEL_SHARED)");
  return std::string(shared) + "/" + rel;
}

// The evaluation set `keel hilo validate` and `keel hilo replay` send: the first `queries` SIFT
// queries with their questions from the corpus (defaults under $KEEL_SHARED).
Result<std::vector<answer::EvalQuery>> LoadHiloEvalSet(const std::string& corpus, const std::string& vectors,
                                                       int queries) {
  KEEL_ASSIGN_OR_RETURN(std::string corpus_path, SharedDefault(corpus, "data/text/val.txt", "--corpus"));
  KEEL_ASSIGN_OR_RETURN(std::string vectors_dir, SharedDefault(vectors, "data/vectors", "--vectors"));
  KEEL_ASSIGN_OR_RETURN(answer::Corpus c, answer::Corpus::Load(corpus_path));
  KEEL_ASSIGN_OR_RETURN(std::vector<answer::EvalQuery> eval, answer::LoadEvalSet(vectors_dir, c));
  if (queries >= 0 && static_cast<size_t>(queries) < eval.size()) eval.resize(static_cast<size_t>(queries));
  return eval;
}

int RunHiloValidate(HiloValidateArgs a) {
  auto cat = hilo::ReadCatalogFile(a.catalog);
  if (!cat.ok()) return Fail(cat.status());
  auto token = ReadAdminToken(a.admin_token_file);
  if (!token.ok()) return Fail(token.status());
  a.o.admin_token = std::move(*token);
  auto eval = LoadHiloEvalSet(a.corpus, a.vectors, a.queries);
  if (!eval.ok()) return Fail(eval.status());
  a.o.eval = std::move(*eval);
  // The fingerprint of the binaries the product runs: the controller's (GET /health).
  auto ep = ParseHttpUrl(a.o.controller_url);
  if (!ep.ok()) return Fail(ep.status());
  HttpClient controller(*ep);
  auto health = controller.Call("GET", "/health", "", "", DeadlineIn(10000));
  if (!health.ok()) return Fail(health.status());
  auto hj = nlohmann::json::parse(health->body, nullptr, false);
  const std::string fingerprint = hj.is_object() ? hj.value("binaries", std::string()) : std::string();
  if (fingerprint.empty()) return Fail(Status::InvalidArgument("the controller's /health reports no binaries fingerprint"));

  const auto started = std::chrono::steady_clock::now();
  auto measured = hilo::MeasureStates(*cat, a.o);
  if (!measured.ok()) return Fail(measured.status());
  std::vector<std::string> notes;
  auto out = hilo::ApplyFigures(std::move(*cat), *measured, fingerprint, UnixSecondsNow(), &notes);
  if (!out.ok()) return Fail(out.status());
  if (Status s = WriteFileAtomic(a.out, hilo::WriteCatalog(*out)); !s.ok()) return Fail(s);
  std::printf("%-16s %8s %8s %9s %12s %20s  %-10s %s\n", "state", "quality", "recall", "agreement", "capacity/s",
              "goodput/s (offered)", "saturated", a.o.rounds > 1 ? "rounds (spread: max/min - 1)" : "");
  for (const hilo::StateMeasurement& m : *measured) {
    std::string rounds;
    if (m.round_capacities.size() > 1) {
      const auto [lo, hi] = std::minmax_element(m.round_capacities.begin(), m.round_capacities.end());
      for (double c : m.round_capacities) rounds += fmt::format("{}{:.4g}", rounds.empty() ? "" : " ", c);
      if (*lo > 0) rounds += fmt::format(" ({:.1f} %)", 100.0 * (*hi / *lo - 1));
    }
    const std::string goodput = m.offered > 0 ? fmt::format("{:.4g} ({:.4g})", m.goodput, m.offered) : "-";
    std::printf("%-16s %8.2f %8.3f %9.3f %12.4g %20s  %-10s %s\n", m.state.c_str(), m.quality.quality, m.quality.recall,
                m.quality.agreement, m.capacity, goodput.c_str(), m.bottleneck.empty() ? "(max rate)" : m.bottleneck.c_str(), rounds.c_str());
  }
  std::printf("recorded per-service capacity (req/s; estimated from utilisation, at least the product's):\n");
  for (const hilo::State& st : out->states) {
    std::printf("  %-16s", st.name.c_str());
    for (hilo::Service svc : hilo::kAllServices) {
      std::printf(" %s %.4g", std::string(hilo::ServiceName(svc)).c_str(), st.figures->Capacity(svc));
    }
    std::printf("\n");
  }
  for (const std::string& n : notes) std::printf("adjusted: %s\n", n.c_str());
  std::printf("wrote %s (binaries %s) in %.0f s\n", a.out.c_str(), fingerprint.c_str(),
              std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
  return 0;
}
// ---- hilo (end)

// ---- answer-index (begin): `keel answer index` loads the corpus's vectors into the vector service
struct AnswerIndexArgs {
  std::string vector_url;
  std::string bvecs;
  int64_t limit = -1;
  int batch = 1000;
};

// Upserts record i of the .bvecs file as vector id i (the id the answer service maps to document
// i mod documents), in batches; versionless writes, so a re-run overwrites the same ids.
int RunAnswerIndex(const AnswerIndexArgs& a) {
  auto ep = ParseHttpUrl(a.vector_url);
  if (!ep.ok()) return Fail(ep.status());
  auto set = vector::ReadBvecs(a.bvecs, a.limit);
  if (!set.ok()) return Fail(set.status());
  HttpClient client(*ep);
  const auto started = std::chrono::steady_clock::now();
  for (int64_t first = 0; first < set->count; first += a.batch) {
    const int64_t end = std::min<int64_t>(set->count, first + a.batch);
    std::string body = "{\"items\":[";
    for (int64_t i = first; i < end; ++i) {
      if (i > first) body += ',';
      body += "{\"id\":" + std::to_string(i) + ",\"text\":[";
      for (int d = 0; d < set->dim; ++d) {
        if (d > 0) body += ',';
        AppendJsonNumber(static_cast<double>(set->values[static_cast<size_t>(i * set->dim + d)]), &body);
      }
      body += "]}";
    }
    body += "]}";
    auto r = client.Call("POST", "/v1/upsert", body, "application/json", DeadlineIn(120000));
    if (!r.ok()) return Fail(r.status());
    if (r->status != 200) {
      return Fail(Status::InvalidArgument(fmt::format("{}: upsert of ids {}..{}: HTTP {}: {}", a.vector_url, first, end - 1,
                                                      r->status, r->body.substr(0, 300))));
    }
    Log().info("answer index: {} of {} vectors", end, set->count);
  }
  std::printf("indexed %lld vectors (dim %d) from %s into %s in %.1f s\n", static_cast<long long>(set->count), set->dim,
              a.bvecs.c_str(), a.vector_url.c_str(),
              std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
  return 0;
}
// ---- answer-index (end)

// ---- answer (begin): `keel answer serve`, the retrieval-augmented answer endpoint (docs/answer.md)
struct AnswerArgs {
  answer::AnswerServerOptions o;
  std::string corpus;
  answer::AnswerHiloFlags hilo;
  std::string gateway_key_file;
};

int RunAnswer(AnswerArgs a) {
  if (a.corpus.empty()) {
    const char* shared = std::getenv("KEEL_SHARED");
    if (shared == nullptr || *shared == '\0') {
      return Fail(Status::InvalidArgument("answer: --corpus is required (or set KEEL_SHARED for its data/text/val.txt)"));
    }
    a.corpus = std::string(shared) + "/data/text/val.txt";
  }
  auto corpus = answer::Corpus::Load(a.corpus);
  if (!corpus.ok()) return Fail(corpus.status());
  if (!a.gateway_key_file.empty()) {
    auto key = ReadSmallFile(a.gateway_key_file, 64 << 10);
    if (!key.ok()) return Fail(key.status());
    a.o.gateway_api_key = key->substr(0, key->find_first_of("\r\n"));
    if (a.o.gateway_api_key.empty() || a.o.gateway_api_key.size() > 1024) {
      return Fail(Status::InvalidArgument(a.gateway_key_file + ": expected a key of 1..1024 bytes on the first line"));
    }
  }
  // Room for the vector of a large --dim (about 12 bytes a number) and the rest of the body.
  a.o.max_body_bytes = std::max(a.o.max_body_bytes, static_cast<size_t>(a.o.limits.dim) * 32 + (size_t{64} << 10));
  auto link = answer::OpenAnswerLink(a.hilo, a.o.max_inflight);
  if (!link.ok()) return Fail(link.status());
  auto server = answer::AnswerServer::Start(*corpus, a.o, link->get());
  if (!server.ok()) {
    if (*link) (*link)->Stop();
    return Fail(server.status());
  }
  Log().info("answer: corpus {} ({} documents), {}", a.corpus, corpus->size(),
             *link ? "following HiLO" : "built-in full level (retrieval on, 3 documents)");
  auto sig = WaitForTerminationSignal();
  if (!sig.ok()) return Fail(sig.status());
  Log().info("received {}; stopping", SignalName(*sig));
  (*server)->Stop();
  if (*link) (*link)->Stop();
  return 0;
}
// ---- answer (end)

// ---- hilo-replay (begin): `keel hilo replay` replays a surge trace live (keel/hilo/validate/replay_live.h)
struct HiloReplayArgs {
  std::string write_references;  // the references run: write the full state's answers here
  std::string references;        // the surge run: read them from here
  std::string trace;
  std::string trace_csv;
  std::string out_csv;
  std::string label;
  std::string corpus;
  std::string vectors;
  int queries = 100;
  uint64_t trace_seed = 1;
  hilo::LiveOptions o;
};

int RunHiloReplay(HiloReplayArgs a) {
  auto eval = LoadHiloEvalSet(a.corpus, a.vectors, a.queries);
  if (!eval.ok()) return Fail(eval.status());

  if (!a.write_references.empty()) {
    // The product should be pinned to its full state: check every answer ran in the catalog's
    // first state when the controller is known.
    std::string full;
    if (!a.o.controller_url.empty()) {
      auto ep = ParseHttpUrl(a.o.controller_url);
      if (!ep.ok()) return Fail(ep.status());
      HttpClient controller(*ep);
      auto cr = controller.Call("GET", "/v1/catalog", "", "", DeadlineIn(10000));
      if (!cr.ok()) return Fail(cr.status());
      auto cat = hilo::ParseCatalog(cr->body);
      if (!cat.ok()) return Fail(cat.status());
      full = cat->states.front().name;
    }
    double fq = 0;
    auto text = hilo::WriteReferences(a.o.answer_url, *eval, a.o.replay, full, 3, &fq);
    if (!text.ok()) return Fail(text.status());
    if (Status s = WriteFileAtomic(a.write_references, *text); !s.ok()) return Fail(s);
    std::printf("{\"references\":\"%s\",\"queries\":%zu,\"full_quality\":%.4f}\n", a.write_references.c_str(),
                eval->size(), fq);
    return 0;
  }

  if (a.references.empty()) return Fail(Status::InvalidArgument("--references F is required (write it with --write-references F)"));
  if (a.trace.empty() == a.trace_csv.empty()) return Fail(Status::InvalidArgument("give exactly one of --trace NAME and --trace-csv F"));
  if (!a.trace.empty()) {
    std::vector<hilo::Trace> all = hilo::SurgeTraces(a.trace_seed);
    all.push_back(hilo::Surge3x());
    std::string names;
    for (hilo::Trace& t : all) {
      names += (names.empty() ? "" : ", ") + t.name;
      if (t.name == a.trace) a.o.trace = std::move(t);
    }
    if (a.o.trace.name.empty()) return Fail(Status::InvalidArgument("--trace: unknown trace '" + a.trace + "' (one of " + names + ")"));
  } else {
    auto text = ReadFileToString(a.trace_csv);
    if (!text.ok()) return Fail(text.status());
    auto t = hilo::ParseCsvTrace(*text, a.trace_csv, a.o.baseline_rate);
    if (!t.ok()) return Fail(t.status());
    a.o.trace = std::move(*t);
  }
  auto ref_text = ReadFileToString(a.references);
  if (!ref_text.ok()) return Fail(ref_text.status());
  auto refs = hilo::ParseReferences(*ref_text, eval->size());
  if (!refs.ok()) return Fail(Status::InvalidArgument(a.references + ": " + refs.status().message()));
  a.o.eval = std::move(*eval);
  a.o.references = std::move(*refs);
  Log().info("replay: trace {} (peak {:.2f}x, {:.0f} s) at {} req/s x multiplier, time scale {} ({:.0f} s real), full quality {:.2f}",
             a.o.trace.name, a.o.trace.Peak(), a.o.trace.duration_s, a.o.baseline_rate, a.o.time_scale,
             a.o.trace.duration_s * a.o.time_scale, hilo::FullQuality(a.o.eval, a.o.references));
  auto r = hilo::RunLiveReplay(a.o);
  if (!r.ok()) return Fail(r.status());
  if (!a.out_csv.empty()) {
    if (Status s = WriteFileAtomic(a.out_csv, hilo::WriteLiveCsv(*r, a.o.window_s)); !s.ok()) return Fail(s);
  }
  std::printf("%s\n", hilo::WriteLiveSummaryJson(*r, a.label).c_str());
  return 0;
}
// ---- hilo-replay (end)

}  // namespace

// CLI11's Range and NonNegativeNumber compare, and NaN fails no comparison; 1e309 becomes inf.
// Every floating-point option of every subcommand must be a finite number.
void RequireFiniteFloats(CLI::App* app) {
  const CLI::Validator finite(
      [](std::string& text) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(text.c_str(), &end);
        if (end == text.c_str() || *end != '\0') return {};  // not a number: the option's own parser says so
        return std::isfinite(v) ? std::string() : "must be a finite number, not " + text;
      },
      "FINITE");
  for (CLI::Option* opt : app->get_options()) {
    if (opt->get_type_name() == "FLOAT") opt->check(finite);
  }
  for (CLI::App* sub : app->get_subcommands([](CLI::App*) { return true; })) RequireFiniteFloats(sub);
}

int main(int argc, char** argv) {
  // A peer that closed its socket must be an EPIPE error where the write happens, not the
  // process's death: Keel's own sockets send with MSG_NOSIGNAL, but libraries (hiredis) write().
  std::signal(SIGPIPE, SIG_IGN);
  CLI::App app{"keel: LLM and retrieval services under tight resources"};
  app.require_subcommand(1);
  app.fallthrough();  // --log-level may follow the subcommand too
  std::string log_level = "info";
  app.add_option("--log-level", log_level, "trace|debug|info|warn|error|off")
      ->capture_default_str()
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "off"}));
  std::string cpu_isa = "auto";
  app.add_option("--cpu-isa", cpu_isa,
                 "kernel level: auto (best this CPU has), avx2 or avx512 (KEEL_CPU_ISA sets the same; results may "
                 "differ in the last bits between levels)")
      ->capture_default_str();

  GenerateArgs gen;
  auto* generate = app.add_subcommand("generate", "Generate text from a prompt (text on stdout, logs on stderr)");
  generate->add_option("--model,-m", gen.model, "llama2.c .bin checkpoint or Hugging Face model directory")->required();
  generate->add_option("--tokenizer,-z", gen.tokenizer, "llama2.c tokenizer.bin (default: found beside the model)");
  generate->add_option("--prompt,-i", gen.prompt, "prompt text (default: empty, generation starts from BOS)");
  generate->add_option("--temperature,-t", gen.temperature, "0 = greedy")->capture_default_str()->check(CLI::Range(0.0f, 100.0f));
  generate->add_option("--top-p,-p", gen.top_p, "nucleus sampling threshold")->capture_default_str()->check(CLI::Range(0.0f, 1.0f));
  generate->add_option("--top-k", gen.top_k, "0 = off")->capture_default_str()->check(CLI::NonNegativeNumber);
  generate->add_option("--max-tokens,-n", gen.max_tokens, "tokens to generate at most (clamped to the context)")
      ->capture_default_str()->check(CLI::PositiveNumber);
  generate->add_option("--seed,-s", gen.seed, "random seed (default: random)")->each([&](const std::string&) { gen.seed_set = true; });
  generate->add_option("--stop", gen.stop, "stop sequence (repeatable)");
  AddKvCodecFlags(generate, gen.kv);
  generate->add_flag("--print-ids", gen.print_ids, "print generated token ids on stderr");
  generate->add_option("--logprobs", gen.logprobs,
                       "print each generated token's log-probability and this many most likely alternatives on stderr")
      ->check(CLI::Range(0, kMaxTopLogprobs));
  AddKvStoreLinkFlags(generate, gen.kvstore);
  AddMoeFlags(generate, gen.moe);

  ServeArgs serve_args;
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

  KvstoreArgs kv;
  auto* kvs = app.add_subcommand("kvstore", "Serve a shared KV cache (DRAM -> SSD -> Redis) to engine instances");
  kvs->add_option("--host", kv.service.server.host, "address to bind")->capture_default_str();
  kvs->add_option("--port", kv.service.server.port, "binary protocol port (0 = any free port)")->capture_default_str()->check(CLI::Range(0, 65535));
  kvs->add_option("--http-port", kv.service.http_port, "HTTP port for /metrics, /healthz, /v1/stats (-1 = off)")->capture_default_str()->check(CLI::Range(-1, 65535));
  kvs->add_option("--dram-mb", kv.dram_mb, "DRAM tier capacity in MiB")->capture_default_str()->check(CLI::Range(1, 1 << 24));
  kvs->add_option("--eviction", kv.eviction, "DRAM eviction policy: arc, s3fifo, lru (default: arc)");
  kvs->add_option("--ssd-dir", kv.service.store.ssd_dir, "directory for the SSD tier's segment files (default: no SSD tier)");
  kvs->add_option("--ssd-mb", kv.ssd_mb, "SSD tier capacity in MiB")->capture_default_str()->check(CLI::Range(1, 1 << 30));
  kvs->add_option("--redis", kv.service.store.redis_url, "Redis tier: host:port, redis://host:port or redis+cluster://host:port");
  kvs->add_option("--ttl-ms", kv.service.store.default_ttl_ms, "default TTL of stored chunks (0 = none; at most 100 years)")->capture_default_str()->check(CLI::Range(int64_t{0}, kvstore::Store::kMaxTtlMs));
  // At most the server's bound on value bytes being received at once (1 GiB): a larger value
  // could never be taken.
  kvs->add_option("--max-value-mb", kv.max_value_mb, "largest value accepted, MiB (at most 1024)")->capture_default_str()->check(CLI::Range(1, 1024));
  kvs->add_option("--max-connections", kv.service.server.max_connections, "open client connections")->capture_default_str()->check(CLI::Range(1, 100000));

  VectorArgs vec;
  auto* vecs = app.add_subcommand("vector", "Serve a vector shard (FAISS text index, image vectors, tiered storage) over HTTP/JSON; "
                                            "in a cluster, one signed replica of one shard behind `keel vector-router`");
  vecs->add_option("--dir", vec.service.shard.dir, "snapshot and write-ahead log directory (required to serve)");
  vecs->add_option("--host", vec.service.host, "address to bind")->capture_default_str();
  vecs->add_option("--port", vec.service.port, "port to bind (0 = any free port)")->capture_default_str()->check(CLI::Range(0, 65535));
  vecs->add_option("--text-dim", vec.service.shard.text_dim, "text vector dimension")->capture_default_str()->check(CLI::Range(1, 65536));
  vecs->add_option("--image-dim", vec.service.shard.image_dim, "image vector dimension")->capture_default_str()->check(CLI::Range(1, 65536));
  vecs->add_option("--index", vec.index, "text index: hnsw, ivf-flat, ivf-pq")->capture_default_str();
  vecs->add_option("--ef", vec.service.shard.index.hnsw_ef_search, "HNSW efSearch default")->capture_default_str()->check(CLI::Range(1, 65536));
  vecs->add_option("--nprobe", vec.service.shard.index.ivf_nprobe, "IVF probes default")->capture_default_str()->check(CLI::Range(1, 1 << 20));
  vecs->add_option("--dram-mb", vec.dram_mb, "DRAM tier capacity in MiB (0 = unbounded when it is the only tier)")->capture_default_str()->check(CLI::Range(0, 1 << 24));
  vecs->add_option("--ssd-dir", vec.service.shard.tiers.ssd_dir, "SSD tier directory (default: no SSD tier)");
  vecs->add_option("--ssd-mb", vec.ssd_mb, "SSD tier capacity in MiB")->capture_default_str()->check(CLI::Range(0, 1 << 30));
  vecs->add_option("--cold-dir", vec.service.shard.tiers.cold_dir, "compressed cold tier directory (default: none)");
  vecs->add_option("--cold-mb", vec.cold_mb, "cold tier capacity in MiB")->capture_default_str()->check(CLI::Range(0, 1 << 30));
  vecs->add_option("--redis", vec.service.shard.tiers.redis_url, "remote tier: Redis host:port (default: none)");
  vecs->add_option("--placement", vec.placement, "background placement: coloc, frequency, off")->capture_default_str()
      ->check(CLI::IsMember({"coloc", "frequency", "off"}));
  vecs->add_option("--max-body-mb", vec.max_body_mb, "largest request body, MiB")->capture_default_str()->check(CLI::Range(1, 4095));
  vecs->add_option("--max-json-values", vec.service.max_json_values,
                   "most JSON values (numbers, strings, keys, arrays, objects) in one request body; "
                   "a 10k-item batch of 128+128 floats is ~2.6M")
      ->capture_default_str()->check(CLI::Range(size_t{1}, size_t{1} << 32));
  vecs->add_option("--max-connections", vec.service.max_connections,
                   "open connections (idle ones hold no thread; at the cap the longest-waiting idle one is closed)")
      ->capture_default_str()->check(CLI::Range(1, 100000));
  auto& vid = vec.service.identity;
  vecs->add_option("--shard-id", vid.shard, "this shard's id in the cluster (< --shards)")->capture_default_str();
  vecs->add_option("--shards", vid.shards, "shards in the cluster (ids are owned by id % shards)")->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  vecs->add_option("--replica-id", vid.replica, "replica id, as the router's config names it (signed into every answer)")->capture_default_str();
  vecs->add_option("--zone", vid.zone, "failure domain label (signed into every answer)")->capture_default_str();
  vecs->add_option("--signing-key", vid.signing_key_path,
                   "Ed25519 private key (PEM from `keel vector keygen`, mode 0600): sign search answers; without it answers "
                   "carry no \"trust\" object")
      ->check(CLI::ExistingFile);
  vecs->add_option("--hnsw-seed", vec.service.shard.index.hnsw_seed,
                   "seed of HNSW's level generator (12345 is FAISS's default); give replicas different seeds so their "
                   "graphs differ")
      ->capture_default_str();
  vecs->add_option("--adversary", vec.adversary,
                   "TESTS AND BENCHMARKS ONLY: tamper with answers before signing them: honest, drop (the best hits), "
                   "inject (made-up ids of this shard), reorder, stale (older index version), slow (answer late)")
      ->capture_default_str()->check(CLI::IsMember({"honest", "drop", "inject", "reorder", "stale", "slow"}));
  vecs->add_option("--adversary-seed", vid.adversary.seed, "adversary seed (replicas with the same mode and seed collude)")
      ->capture_default_str();
  vecs->add_option("--adversary-strength", vid.adversary.strength, "hits dropped or injected; versions behind for stale")
      ->capture_default_str()->check(CLI::Range(1, 1000));
  vecs->add_option("--adversary-fraction", vid.adversary.fraction, "fraction of queries tampered with (chosen by query digest)")
      ->capture_default_str()->check(CLI::Range(0.0, 1.0));
  vecs->add_option("--adversary-delay-ms", vec.adversary_delay_ms, "delay of --adversary slow")
      ->capture_default_str()->check(CLI::Range(int64_t{0}, int64_t{600000}));
  auto* vec_keygen = vecs->add_subcommand("keygen", "Write a replica signing key pair: PREFIX.key (private, 0600) and PREFIX.pub");
  vec_keygen->add_option("--out", vec.keygen_out, "path prefix of the two files (refused if PREFIX.key exists)")->required();
  AddVectorReplicaHiloFlags(vecs, vec.hilo);  // vector-hilo

  // ---- vector-router (begin)
  std::string vr_config, vr_host;
  int vr_port = -1;
  auto* vrs = app.add_subcommand("vector-router", "Serve S vector shards x R replicas behind one endpoint, verifying replica answers (TrustANN)");
  vrs->add_option("--config,-c", vr_config, "cluster config (JSON: shards, replicas, zones, public keys, trust options)")->required()->check(CLI::ExistingFile);
  vrs->add_option("--host", vr_host, "address to bind (overrides the config; default 127.0.0.1)");
  vrs->add_option("--port", vr_port, "port to bind, 0 = any free port (overrides the config; default 7403)")->check(CLI::Range(0, 65535));
  vector::HiloLinkFlags vr_hilo;  // vector-hilo
  AddVectorHiloFlags(vrs, vr_hilo);  // vector-hilo
  // ---- vector-router (end)

  // ---- gateway (begin)
  std::string gw_config, gw_host;
  int gw_port = -1;
  auto* gws = app.add_subcommand("gateway", "Serve the LLM gateway (OpenAI/Anthropic fronts, vendor adapters, budgets, policy)");
  gws->add_option("--config,-c", gw_config, "gateway config (JSON; see docs/gateway.md)")->required()->check(CLI::ExistingFile);
  gws->add_option("--host", gw_host, "address to bind (overrides the config)");
  gws->add_option("--port", gw_port, "port to bind, 0 = any free port (overrides the config)")->check(CLI::Range(0, 65535));
  // ---- gateway (end)

  // ---- gateway-policy (begin)
  GatewayPolicyArgs gwp;
  auto* gwps = app.add_subcommand("gateway-policy", "Serve the gateway's keys, budgets, policies and usage ledger on a local socket");
  gwps->add_option("--socket", gwp.service.socket_path, "Unix socket to listen on (mode 0600)")->capture_default_str();
  gwps->add_option("--db", gwp.service.store.db_path, "SQLite database (created if missing)")->capture_default_str();
  gwps->add_option("--admin-key-file", gwp.admin_key_file, "file holding the admin key (default: env KEEL_GATEWAY_ADMIN_KEY)");
  gwps->add_option("--redis-url", gwp.service.store.redis_url, "keep budget spend in Redis (host:port) to share it across instances");
  gwps->add_option("--decision-ttl-ms", gwp.service.store.decision_ttl_ms, "how long the gateway may cache a key decision")
      ->capture_default_str()->check(CLI::Range(int64_t{0}, int64_t{86400000}));
  // ---- gateway-policy (end)

  // ---- fake-vendor (begin): local fakes of the OpenAI / Anthropic / Gemini APIs (see keel/gateway/fake_vendor.h)
  keel::gateway::FakeVendorOptions fvo;
  std::string fv_kind = "openai";
  auto* fvs = app.add_subcommand("fake-vendor", "Serve a fake OpenAI, Anthropic or Gemini API (vendor wire formats, deterministic answers) for tests and benchmarks");
  fvs->add_option("--kind", fv_kind, "openai, anthropic or gemini")->capture_default_str()->check(CLI::IsMember({"openai", "anthropic", "gemini"}));
  fvs->add_option("--host", fvo.host, "address to bind")->capture_default_str();
  fvs->add_option("--port", fvo.port, "port to bind (0 = any free port)")->capture_default_str()->check(CLI::Range(0, 65535));
  fvs->add_option("--ttft-ms", fvo.ttft_ms, "delay before the first token (at most an hour)")->capture_default_str()->check(CLI::Range(0.0, 3.6e6));
  fvs->add_option("--tokens-per-second", fvo.tokens_per_second, "pacing of later tokens (0 = no pacing)")->capture_default_str()->check(CLI::NonNegativeNumber);
  fvs->add_option("--reply-tokens", fvo.reply_tokens, "words in a full answer")->capture_default_str()->check(CLI::Range(0, 1 << 20));
  fvs->add_option("--api-key", fvo.api_key, "the only key accepted (default: any non-empty key)");
  fvs->add_option("--embedding-dims", fvo.embedding_dims, "OpenAI embedding size without \"dimensions\"")->capture_default_str()->check(CLI::Range(1, 65536));
  fvs->add_option("--slow-ms", fvo.slow_ms, "wait of models named *slow* (at most an hour)")->capture_default_str()->check(CLI::Range(0.0, 3.6e6));
  fvs->add_option("--max-connections", fvo.max_connections, "open connections (idle ones hold no thread; at the cap the oldest idle one is closed)")->capture_default_str()->check(CLI::Range(1, 100000));
  // ---- fake-vendor (end)

  BenchArgs bench_args;
  auto* bench = app.add_subcommand("bench", "Measure prefill/decode tokens/s next to a memory-bandwidth roofline");
  bench->add_option("--model,-m", bench_args.model, "model to measure")->required();
  bench->add_option("--prompt-tokens", bench_args.prompt, "prompt length per sequence")->capture_default_str()->check(CLI::PositiveNumber);
  bench->add_option("--decode-tokens", bench_args.decode, "generated tokens per sequence")->capture_default_str()->check(CLI::PositiveNumber);
  bench->add_option("--concurrency", bench_args.concurrency, "sequences decoded together (list)")->capture_default_str()->delimiter(',');
  bench->add_option("--repeats", bench_args.repeats, "best of N runs")->capture_default_str()->check(CLI::PositiveNumber);
  AddKvCodecFlags(bench, bench_args.kv);

  std::string inspect_path;
  auto* inspect = app.add_subcommand("inspect", "Print a model's header, tensor list and checksum");
  inspect->add_option("model", inspect_path, "llama2.c .bin or Hugging Face model directory")->required();

  ConvertArgs conv;
  auto* convert = app.add_subcommand("convert", "Convert a llama2.c checkpoint to Hugging Face safetensors + config.json");
  convert->add_option("--model,-m", conv.model, "model to convert")->required();
  convert->add_option("--tokenizer,-z", conv.tokenizer, "llama2.c tokenizer (default: found beside the model)");
  convert->add_option("--out,-o", conv.out, "output directory")->required();
  convert->add_option("--dtype", conv.dtype, "f32, f16 or bf16")->capture_default_str();

  RandomModelOptions mk;
  std::string mk_dtype = "f32";
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
  make_model->add_option("--dtype", mk_dtype, "f32, f16 or bf16")->capture_default_str();
  make_model->add_flag("--tie-embeddings", mk.tie_embeddings, "share the embedding as the classifier");
  make_model->add_option("--experts", mk.experts, "MoE: routed experts per layer (0 = 8)")->capture_default_str()->check(CLI::NonNegativeNumber);
  make_model->add_option("--top-k", mk.top_k, "MoE: experts per token (0 = 2)")->capture_default_str()->check(CLI::NonNegativeNumber);
  make_model->add_option("--expert-hidden", mk.expert_hidden, "MoE: each expert's FFN size (0 = as --hidden)")->capture_default_str()->check(CLI::NonNegativeNumber);
  make_model->add_option("--shared-hidden", mk.shared_hidden, "qwen2_moe: shared expert's FFN size (0 = 4 * expert hidden)")->capture_default_str()->check(CLI::NonNegativeNumber);
  make_model->add_flag("--norm-topk", mk.norm_topk, "olmoe/qwen2_moe: renormalise the top-k routing weights (norm_topk_prob; Mixtral always does)");
  make_model->add_option("--out", mk.out_dir, "output directory")->required();

  BellowsArgs bw;
  std::string bw_inspect;
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
  bw_ins->add_option("file", bw_inspect, "calibration file (.bkv)")->required();

  // ---- hilo (begin)
  HiloArgs hl;
  auto* hilo_cmd = app.add_subcommand("hilo", "HiLO: one controller puts the whole product in one validated state (docs/hilo.md)");
  hilo_cmd->require_subcommand(1);
  auto* hl_serve = hilo_cmd->add_subcommand("serve", "Serve the controller: POST /v1/report, long-poll GET /v1/state, /v1/catalog, /v1/services, POST /v1/pin, /metrics");
  auto* hl_check = hilo_cmd->add_subcommand("check", "Parse a catalog and say, state by state, whether the controller may use it (exit 0/1)");
  for (auto* sub : {hl_serve, hl_check}) {
    sub->add_option("--catalog", hl.catalog, "state catalog (JSON; see docs/hilo.md)")->required()->check(CLI::ExistingFile);
    sub->add_option("--fingerprint", hl.o.fingerprint, "fingerprint the catalog's \"binaries\" must equal (default: this executable's, as `keel hilo fingerprint` prints)");
    sub->add_option("--max-age-s", hl.o.max_age_s, "figures validated longer ago than this are stale")->capture_default_str()->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
  }
  hl_serve->add_option("--host", hl.o.host, "address to bind")->capture_default_str();
  hl_serve->add_option("--port", hl.o.port, "port to bind (0 = any free port)")->required()->check(CLI::Range(0, 65535));
  hl_serve->add_option("--decide-interval-ms", hl.o.decide_interval_ms, "run a decision this often")->capture_default_str()->check(CLI::Range(10, 60000));
  {
    // The controller's prediction and hysteresis (docs/hilo.md, "Controller rules"); ranges are
    // checked together at start (Controller::Create), so a bad mix fails naming the option.
    hilo::ControllerOptions& co = hl.o.controller;
    hl_serve->add_option_function<std::string>("--objective", [&co](const std::string& v) { co.objective = *hilo::ParseObjective(v); }, "what the target maximises: cover (the best state whose capacity covers every service's predicted demand, else the lowest) or expected-quality (the best quality x fraction of the predicted demand served: stays in a better state and sheds when degrading would cost more quality than shedding)")->check(CLI::IsMember({"cover", "expected-quality"}))->default_str("cover");
    hl_serve->add_option("--headroom", co.headroom, "predicted demand x this must fit a state's capacity (1..10)")->capture_default_str();
    hl_serve->add_option("--recover-margin", co.recover_margin, "recover only to a state with predicted demand (before headroom) <= this x its capacity, (0, 1]")->capture_default_str();
    hl_serve->add_option("--recover-dwell-s", co.recover_dwell_s, "... held continuously this long, seconds")->capture_default_str();
    hl_serve->add_option("--min-dwell-s", co.min_dwell_s, "no change more often than this, except to degrade, seconds")->capture_default_str();
    hl_serve->add_option("--lookahead-s", co.lookahead_s, "predict this far ahead, seconds")->capture_default_str();
    hl_serve->add_option("--level-tau-s", co.level_tau_s, "demand smoothing time constant, seconds (0 = none)")->capture_default_str();
    hl_serve->add_option("--trend-tau-s", co.trend_tau_s, "trend smoothing time constant, seconds (0 = no trend)")->capture_default_str();
    hl_serve->add_option("--trend-damping-s", co.trend_damping_s, "the trend decays as exp(-t / this), seconds (0 = undamped)")->capture_default_str();
    hl_serve->add_option("--recent-rate-guard", co.recent_rate_guard, "true: a service's predicted demand is at least its reported rate over the newest 500 ms, so a fast onset degrades before the smoothed rate catches up; false: the smoothed prediction alone")->capture_default_str();
    hl_serve->add_option("--recent-noise-z", co.recent_noise_z, "... a lower bound on it: this many Poisson standard deviations below the measured count, 0..10")->capture_default_str();
    hl_serve->add_option("--report-timeout-s", co.report_timeout_s, "a service instance's report counts this long, seconds")->capture_default_str();
    hl_serve->add_option("--stale-fallback-s", co.stale_fallback_s, "a silent service sends the product to the safe state after this, seconds")->capture_default_str();
    // The per-service baseline's thresholds, the same for every service (docs/hilo.md, "Baseline, live").
    hilo::ServicePolicyOptions& bo = hl.baseline;
    hl_serve->add_option("--baseline-queue-ms", bo.baseline.degrade_queue_ms, "--policy per-service: a service steps cheaper when its queueing-delay estimate is over this (DAGOR's 20)")->capture_default_str();
    hl_serve->add_option("--baseline-recover-queue-ms", bo.baseline.recover_queue_ms, "--policy per-service: ... and is calm below this (<= --baseline-queue-ms)")->capture_default_str();
    hl_serve->add_option("--baseline-utilisation", bo.utilisation_threshold, "--policy per-service: ... or when its utilisation is at least this, [0, 1]; 0 = not used (DAGOR's queueing signal alone)")->capture_default_str();
  }
  hl_serve->add_flag("--allow-unvalidated", hl.o.allow_unvalidated, "development only: start despite a stale or foreign catalog (states still need figures)");
  hl_serve->add_option("--admin-token-file", hl.admin_token_file, "enables POST /v1/pin for clients presenting this token (first line, 16..256 printable bytes)")->check(CLI::ExistingFile);
  hl_serve->add_option("--pin", hl.o.pin, "start pinned to this state (the controller ignores load until unpinned); pinned, with --allow-unvalidated, a catalog without figures is accepted (what keel hilo validate measures)");
  hl_serve->add_option_function<std::string>("--policy", [&hl](const std::string& v) { hl.o.policy = v == "per-service" ? hilo::StatePolicy::kPerService : hilo::StatePolicy::kHilo; }, "hilo: one product state for every service (default). per-service: the evaluation's baseline (DAGOR-like): each service is answered its own level, stepped cheaper on its own overload (queueing estimate > --baseline-queue-ms, utilisation >= --baseline-utilisation) and back after 10 s calm; hosted here only for convenience, each level depends on that service's own reports alone (docs/hilo.md, \"Baseline, live\")")->check(CLI::IsMember({"hilo", "per-service"}))->default_str("hilo");
  HiloValidateArgs hv;
  auto* hl_val = hilo_cmd->add_subcommand("validate", "Measure every state's quality and capacity through the running product and write them into the catalog (docs/hilo.md)");
  hl_val->add_option("--catalog", hv.catalog, "state catalog to measure (the controller's; figures may be absent)")->required()->check(CLI::ExistingFile);
  hl_val->add_option("--out", hv.out, "where to write the validated catalog")->required();
  hl_val->add_option("--controller", hv.o.controller_url, "the controller (keel hilo serve, started with --admin-token-file and --allow-unvalidated)")->required();
  hl_val->add_option("--admin-token-file", hv.admin_token_file, "the controller's admin token (to pin each state)")->required()->check(CLI::ExistingFile);
  hl_val->add_option("--answer", hv.o.answer_url, "the product's entry: keel answer serve")->required();
  hl_val->add_option("--corpus", hv.corpus, "corpus the answer service serves (default $KEEL_SHARED/data/text/val.txt)");
  hl_val->add_option("--vectors", hv.vectors, "directory of bigann10k_query.bvecs and bigann10k_groundtruth.ivecs (default $KEEL_SHARED/data/vectors)");
  hl_val->add_option("--queries", hv.queries, "evaluation queries used (the first N of the set)")->capture_default_str()->check(CLI::Range(1, 100000));
  hl_val->add_option("--model", hv.o.replay.model, "model asked for (\"\" = the answer service's default)");
  hl_val->add_option("--max-tokens", hv.o.replay.max_tokens, "max_tokens of every request")->capture_default_str()->check(CLI::Range(1, 1 << 20));
  hl_val->add_option("--slo-ms", hv.o.slo_ms, "a ramp step passes while the product's p99 stays under this")->capture_default_str()->check(CLI::PositiveNumber);
  hl_val->add_option("--max-error-fraction", hv.o.max_error_fraction, "...and at most this fraction of answers is not 200")->capture_default_str()->check(CLI::Range(0.0, 0.99));
  hl_val->add_option("--start-rate", hv.o.start_rate, "first ramp step, req/s")->capture_default_str()->check(CLI::PositiveNumber);
  hl_val->add_option("--growth", hv.o.growth, "rate multiplier per ramp step")->capture_default_str()->check(CLI::Range(1.01, 10.0));
  hl_val->add_option("--max-rate", hv.o.max_rate, "stop ramping at this rate")->capture_default_str()->check(CLI::PositiveNumber);
  hl_val->add_option("--step-s", hv.o.step_s, "seconds per ramp step")->capture_default_str()->check(CLI::Range(1.0, 3600.0));
  hl_val->add_option("--refine-steps", hv.o.refine_steps, "bisections between the last passing and first failing rate")->capture_default_str()->check(CLI::Range(0, 10));
  hl_val->add_option("--rounds", hv.o.rounds, "capacity ramps per state, in rounds over all states; the figure is picked by --round-figure (capacity on a shared machine moves between runs)")->capture_default_str()->check(CLI::Range(1, 20));
  hl_val->add_option_function<std::string>("--round-figure", [&hv](const std::string& v) { hv.o.round_figure = v == "lowest" ? hilo::RoundFigure::kLowest : hilo::RoundFigure::kLowerMedian; }, "which round's capacity is recorded: median (the lower median: one stalled or lucky round does not move it; with 2 rounds the lower) or lowest")->check(CLI::IsMember({"median", "lowest"}))->default_str("median");
  hl_val->add_option("--later-round-start", hv.o.later_round_start, "later rounds start their ramp at this fraction of the state's first capacity")->capture_default_str()->check(CLI::Range(0.01, 1.0));
  hl_val->add_option("--overload-factor", hv.o.overload_factor, "after each ramp, offer this x the capacity once and record the goodput (200 answers within --slo-ms per second), which --objective expected-quality weighs an overloaded state by; 0 = not measured")->capture_default_str()->check(CLI::Validator([](std::string& v) -> std::string {
        double x = -1;
        try { x = std::stod(v); } catch (...) {}
        return hilo::OverloadFactorValid(x) ? "" : "--overload-factor: expected 0 or a number in (1, 10], got '" + v + "'";
      }, "0 or (1, 10]"));
  hl_val->add_option("--apply-timeout-ms", hv.o.apply_timeout_ms, "wait this long for every service to apply a pinned state")->capture_default_str()->check(CLI::Range(100, 600000));
  auto* hl_fp = hilo_cmd->add_subcommand("fingerprint", "Print this executable's fingerprint (what a validated catalog's \"binaries\" must equal)");
  // ---- hilo (end)
  // ---- hilo-replay (begin)
  HiloReplayArgs hr;
  auto* hl_rep = hilo_cmd->add_subcommand("replay", "Replay a surge trace live through the product, scored against the full state's answers (references)");
  hl_rep->add_option("--answer", hr.o.answer_url, "the product's entry: keel answer serve")->required();
  hl_rep->add_option("--controller", hr.o.controller_url, "the controller: sample GET /v1/state and /v1/services each tick (and check references ran in the full state)");
  hl_rep->add_option("--write-references", hr.write_references, "references run: ask every query once (product pinned to full) and write the answers here");
  hl_rep->add_option("--references", hr.references, "surge run: the full state's answers (from --write-references)");
  hl_rep->add_option("--trace", hr.trace, "step, ramp, spike, double_peak, sawtooth, slow_swell, flash_crowd, plateau_jitter, diurnal_bump or surge_3x");
  hl_rep->add_option("--trace-csv", hr.trace_csv, "a t_s,rate CSV trace instead (rates / --baseline-rate are the multipliers)")->check(CLI::ExistingFile);
  hl_rep->add_option("--trace-seed", hr.trace_seed, "seed of plateau_jitter's noise")->capture_default_str();
  hl_rep->add_option("--baseline-rate", hr.o.baseline_rate, "real req/s at the trace's 1x (kept at any --time-scale)")->capture_default_str()->check(CLI::Range(0.001, 1e5));
  hl_rep->add_option("--time-scale", hr.o.time_scale, "real seconds per trace second (< 1 replays the shape faster at the same rates)")->capture_default_str()->check(CLI::Range(0.001, 100.0));
  hl_rep->add_option("--window-s", hr.o.window_s, "quality window, trace seconds")->capture_default_str()->check(CLI::Range(0.01, 3600.0));
  hl_rep->add_option("--warmup-s", hr.o.warmup_s, "real seconds of unscored load before the trace: 0.1x up to 1x over the first third, then 1x (no jump from zero for the controller's trend or a cold engine)")->capture_default_str()->check(CLI::Range(0.0, 3600.0));
  hl_rep->add_option("--slo-ms", hr.o.slo_ms, "an answer slower than this scores 0 and counts as an SLO violation")->capture_default_str()->check(CLI::PositiveNumber);
  hl_rep->add_option("--workers", hr.o.workers, "concurrent requests at most (more arrivals are dropped at the client and counted failed)")->capture_default_str()->check(CLI::Range(1, 4096));
  hl_rep->add_option("--seed", hr.o.seed, "Poisson arrivals seed")->capture_default_str();
  hl_rep->add_option("--out-csv", hr.out_csv, "per-window CSV (t_s, arrived, mean_quality, p99_ms, state, per-service levels)");
  hl_rep->add_option("--label", hr.label, "added to the JSON summary (e.g. the policy)");
  hl_rep->add_option("--corpus", hr.corpus, "corpus the answer service serves (default $KEEL_SHARED/data/text/val.txt)");
  hl_rep->add_option("--vectors", hr.vectors, "directory of the SIFT query set and truth (default $KEEL_SHARED/data/vectors)");
  hl_rep->add_option("--queries", hr.queries, "evaluation queries (the first N); requests cycle through them")->capture_default_str()->check(CLI::Range(1, 100000));
  hl_rep->add_option("--model", hr.o.replay.model, "model asked for (\"\" = the answer service's default)");
  hl_rep->add_option("--max-tokens", hr.o.replay.max_tokens, "max_tokens of every request")->capture_default_str()->check(CLI::Range(1, 1 << 20));
  // ---- hilo-replay (end)

  // ---- answer (begin)
  AnswerArgs ans;
  auto* ans_cmd = app.add_subcommand("answer", "Retrieval-augmented answers (OpenAI chat): search `keel vector`, prompt with the documents, ask `keel gateway` (docs/answer.md)");
  ans_cmd->require_subcommand(1);
  auto* ans_serve = ans_cmd->add_subcommand("serve", "Serve POST /v1/chat/completions (plus \"keel_retrieval\":{\"vector\":[...]}), GET /v1/models (the gateway's), /healthz, /metrics");
  ans_serve->add_option("--host", ans.o.host, "address to bind")->capture_default_str();
  ans_serve->add_option("--port", ans.o.port, "port to bind (0 = any free port)")->required()->check(CLI::Range(0, 65535));
  ans_serve->add_option("--vector", ans.o.vector_url, "the vector service or its router (http://host:port)")->required();
  ans_serve->add_option("--gateway", ans.o.gateway_url, "`keel gateway`, or an engine (`keel serve`): same OpenAI chat API (http://host:port)")->required();
  ans_serve->add_option("--gateway-key-file", ans.gateway_key_file, "API key for the gateway (first line) when a request brings no Authorization or x-api-key of its own (those are forwarded)")->check(CLI::ExistingFile);
  ans_serve->add_option("--model", ans.o.default_model, "model asked of the gateway when a request names none (default: none; such requests get 400)");
  ans_serve->add_option("--corpus", ans.corpus, "documents separated by blank lines; vector id i is document i mod count (default: $KEEL_SHARED/data/text/val.txt)")->check(CLI::ExistingFile);
  ans_serve->add_option("--dim", ans.o.limits.dim, "length of keel_retrieval.vector: the vector service's text dim")->capture_default_str()->check(CLI::Range(1, 65536));
  ans_serve->add_option("--context-bytes", ans.o.context_bytes, "bytes of document text in the prompt, shared by its documents (the default fits 256-token models)")->capture_default_str()->check(CLI::Range(0, 1 << 20));
  ans_serve->add_option("--history-bytes", ans.o.history_bytes, "bytes of earlier user/assistant turns in the prompt, newest whole turns first (0: none; 256-token models have no room)")->capture_default_str()->check(CLI::Range(0, 1 << 20));
  ans_serve->add_option("--max-inflight", ans.o.max_inflight, "requests served at once; beyond: 429 with Retry-After")->capture_default_str()->check(CLI::Range(1, 100000));
  ans_serve->add_option("--vector-timeout-ms", ans.o.vector_timeout_ms, "deadline of one search")->capture_default_str()->check(CLI::Range(1, 600000));
  ans_serve->add_option("--gateway-timeout-ms", ans.o.gateway_timeout_ms, "deadline of one generation")->capture_default_str()->check(CLI::Range(1, 3600000));
  auto* ans_url = ans_serve->add_option("--hilo", ans.hilo.url, "follow the HiLO controller at this URL: apply its state's answer level (retrieval, context_docs), report load");
  auto* ans_cat = ans_serve->add_option("--hilo-catalog", ans.hilo.catalog, "without a controller: a HiLO state catalog to pin one state of (with --hilo-state)")->check(CLI::ExistingFile);
  ans_url->excludes(ans_cat);
  ans_serve->add_option("--hilo-state", ans.hilo.state, "the HiLO state to pin (required with --hilo-catalog; with --hilo it freezes the state). Neither --hilo nor --hilo-catalog: retrieval on, 3 documents");
  ans_serve->add_option("--hilo-instance", ans.hilo.instance, "this instance's name in HiLO load reports (default answer-<pid>)");
  // ---- answer (end)
  // ---- answer-index (begin)
  AnswerIndexArgs aidx;
  auto* ans_index = ans_cmd->add_subcommand("index", "Load the corpus's vectors (.bvecs; record i = vector id i) into a keel vector service or router");
  ans_index->add_option("--vector", aidx.vector_url, "the vector service or router (http://host:port)")->required();
  ans_index->add_option("--bvecs", aidx.bvecs, "vectors to load, e.g. $KEEL_SHARED/data/vectors/bigann10k_base.bvecs")->required()->check(CLI::ExistingFile);
  ans_index->add_option("--limit", aidx.limit, "load only the first N records (-1 = all)")->capture_default_str();
  ans_index->add_option("--batch", aidx.batch, "vectors per upsert request")->capture_default_str()->check(CLI::Range(1, 100000));
  // ---- answer-index (end)

  RequireFiniteFloats(&app);
  CLI11_PARSE(app, argc, argv);
  SetLogLevel(log_level);
  if (cpu_isa != "auto" || app.count("--cpu-isa") > 0) {
    if (Status s = cpu::SetActiveIsa(cpu_isa); !s.ok()) {
      Log().error("--cpu-isa: {}", s.message());
      return 2;
    }
  }
  // The engine's commands say which kernels run (a benchmark without it is hard to read).
  if (generate->parsed() || serve->parsed() || bench->parsed()) {
    Log().info("{}", cpu::Describe());
  } else {
    Log().debug("{}", cpu::Describe());
  }
  if (bw_cal->parsed()) return RunBellowsCalibrate(bw);
  if (bw_ins->parsed()) return RunBellowsInspect(bw_inspect);
  if (hl_serve->parsed()) return RunHiloServe(std::move(hl));  // hilo
  if (ans_serve->parsed()) return RunAnswer(std::move(ans));  // answer
  if (ans_index->parsed()) return RunAnswerIndex(aidx);  // answer-index
  if (hl_check->parsed()) return RunHiloCheck(std::move(hl));  // hilo
  if (hl_val->parsed()) return RunHiloValidate(std::move(hv));  // hilo
  if (hl_rep->parsed()) return RunHiloReplay(std::move(hr));  // hilo-replay
  if (hl_fp->parsed()) {  // hilo
    auto fp = hilo::ExecutableFingerprint();
    if (!fp.ok()) return Fail(fp.status());
    std::printf("%s\n", fp->c_str());
    return 0;
  }
  if (generate->parsed()) return RunGenerate(gen);
  if (serve->parsed()) return RunServe(serve_args);
  if (kvs->parsed()) return RunKvstore(kv);
  if (vec_keygen->parsed()) return RunVectorKeygen(vec.keygen_out);
  if (vecs->parsed()) return RunVector(vec);
  if (vrs->parsed()) return vector::RunVectorRouterMain(vr_config, vr_host, vr_port, vr_hilo);  // vector-hilo
  if (gws->parsed()) return keel::gateway::RunGatewayMain(gw_config, gw_host, gw_port);
  if (gwps->parsed()) return RunGatewayPolicy(gwp);  // gateway-policy
  if (fvs->parsed()) {  // fake-vendor
    fvo.kind = keel::gateway::ParseFakeVendorKind(fv_kind).value();
    return keel::gateway::RunFakeVendorMain(fvo);
  }
  if (bench->parsed()) return RunBench(bench_args);
  if (inspect->parsed()) return RunInspect(inspect_path);
  if (convert->parsed()) return RunConvert(conv);
  if (make_model->parsed()) {
    auto dt = ParseDType(mk_dtype);
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
  return 0;
}
