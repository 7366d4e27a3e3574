// keel kvstore: the shared KV cache service.
#include <memory>
#include <string>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "apps/cli.h"
#include "keel/core/log.h"
#include "keel/kvstore/service.h"

namespace keel::cli {
namespace {

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
  return StopOnSignal([&] {
    (*service)->Stop();
    return Status::Ok();
  });
}

}  // namespace

void AddKvstoreCommands(CLI::App& app, Commands& out) {
  auto kv_ptr = std::make_shared<KvstoreArgs>();
  KvstoreArgs& kv = *kv_ptr;
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
  out.push_back({kvs, [kv_ptr] { return RunKvstore(*kv_ptr); }});
}

}  // namespace keel::cli
