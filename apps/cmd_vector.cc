// keel vector (+ keygen) | vector-router: a vector shard replica and the router in front of replicas.
#include <chrono>
#include <memory>
#include <string>

#include <CLI/CLI.hpp>

#include "apps/cli.h"
#include "keel/core/log.h"
#include "keel/vector/router.h"
#include "keel/vector/service.h"

namespace keel::cli {
namespace {

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
// `applies`: which of the state's vector level this command applies.
void AddVectorHiloFlags(CLI::App* cmd, vector::HiloLinkFlags& f, const std::string& applies) {
  auto* url = cmd->add_option("--hilo", f.url, "follow the HiLO controller at this URL (http://host:port): apply its state's " + applies + ", report load");
  auto* cat = cmd->add_option("--hilo-catalog", f.catalog, "without a controller: a HiLO state catalog to pin one state of (with --hilo-state)")
      ->check(CLI::ExistingFile);
  url->excludes(cat);
  cmd->add_option("--hilo-state", f.state, "the HiLO state to pin (required with --hilo-catalog; with --hilo it freezes the state)");
  cmd->add_option("--hilo-instance", f.instance, "this instance's name in HiLO load reports (default vector-<pid>)");
}
void AddVectorReplicaHiloFlags(CLI::App* cmd, vector::HiloLinkFlags& f) {
  AddVectorHiloFlags(cmd, f, "vector level (nprobe/ef, k, rerank)");
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
  } else {
    sh.query_log_window = 0;  // only the placer reads the query log
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
  return StopOnSignal(
      [&] {
        KEEL_RETURN_IF_ERROR((*service)->Stop());
        if (a.service.hilo) a.service.hilo->Stop();  // vector-hilo
        return Status::Ok();
      },
      "stopping (snapshot)");
}

struct VectorRouterArgs {
  std::string config, host;
  int port = -1;
  vector::HiloLinkFlags hilo;  // vector-hilo
};

}  // namespace

void AddVectorCommands(CLI::App& app, Commands& out) {
  auto vec_ptr = std::make_shared<VectorArgs>();
  VectorArgs& vec = *vec_ptr;
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

  out.push_back({vec_keygen, [vec_ptr] { return RunVectorKeygen(vec_ptr->keygen_out); }});
  out.push_back({vecs, [vec_ptr] { return RunVector(*vec_ptr); }});

  // ---- vector-router (begin)
  auto vr = std::make_shared<VectorRouterArgs>();
  auto* vrs = app.add_subcommand("vector-router", "Serve S vector shards x R replicas behind one endpoint, verifying replica answers (TrustANN)");
  vrs->add_option("--config,-c", vr->config, "cluster config (JSON: shards, replicas, zones, public keys, trust options)")->required()->check(CLI::ExistingFile);
  vrs->add_option("--host", vr->host, "address to bind (overrides the config; default 127.0.0.1)");
  vrs->add_option("--port", vr->port, "port to bind, 0 = any free port (overrides the config; default 7403)")->check(CLI::Range(0, 65535));
  AddVectorHiloFlags(vrs, vr->hilo, "vector fan-out (replicas asked per search, plain mode)");  // vector-hilo
  out.push_back({vrs, [vr] { return vector::RunVectorRouterMain(vr->config, vr->host, vr->port, vr->hilo); }});  // vector-hilo
  // ---- vector-router (end)
}

}  // namespace keel::cli
