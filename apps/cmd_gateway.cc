// keel gateway | gateway-policy | fake-vendor: the LLM gateway, its governance service and vendor fakes.
#include <memory>
#include <string>

#include <CLI/CLI.hpp>

#include "apps/cli.h"
#include "keel/core/log.h"
#include "keel/gateway/fake_vendor.h"  // fake-vendor
#include "keel/gateway/gateway.h"
#include "keel/gateway/policy_service.h"  // gateway-policy

namespace keel::cli {
namespace {

struct GatewayArgs {
  std::string config, host;
  int port = -1;
};

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
  return StopOnSignal([&] {
    (*service)->Stop();
    return Status::Ok();
  });
}
// ---- gateway-policy (end)

// ---- fake-vendor: local fakes of the OpenAI / Anthropic / Gemini APIs (see keel/gateway/fake_vendor.h)
struct FakeVendorArgs {
  gateway::FakeVendorOptions o;
  std::string kind = "openai";
};

}  // namespace

void AddGatewayCommands(CLI::App& app, Commands& out) {
  auto gw = std::make_shared<GatewayArgs>();
  auto* gws = app.add_subcommand("gateway", "Serve the LLM gateway (OpenAI/Anthropic fronts, vendor adapters, budgets, policy)");
  gws->add_option("--config,-c", gw->config, "gateway config (JSON; see docs/gateway.md)")->required()->check(CLI::ExistingFile);
  gws->add_option("--host", gw->host, "address to bind (overrides the config)");
  gws->add_option("--port", gw->port, "port to bind, 0 = any free port (overrides the config)")->check(CLI::Range(0, 65535));
  out.push_back({gws, [gw] { return gateway::RunGatewayMain(gw->config, gw->host, gw->port); }});
  // ---- gateway (end)

  // ---- gateway-policy (begin)
  auto gwp_ptr = std::make_shared<GatewayPolicyArgs>();
  GatewayPolicyArgs& gwp = *gwp_ptr;
  auto* gwps = app.add_subcommand("gateway-policy", "Serve the gateway's keys, budgets, policies and usage ledger on a local socket");
  gwps->add_option("--socket", gwp.service.socket_path, "Unix socket to listen on (mode 0600)")->capture_default_str();
  gwps->add_option("--db", gwp.service.store.db_path, "SQLite database (created if missing)")->capture_default_str();
  gwps->add_option("--admin-key-file", gwp.admin_key_file, "file holding the admin key (default: env KEEL_GATEWAY_ADMIN_KEY)");
  gwps->add_option("--redis-url", gwp.service.store.redis_url, "keep budget spend in Redis (host:port) to share it across instances");
  gwps->add_option("--decision-ttl-ms", gwp.service.store.decision_ttl_ms, "how long the gateway may cache a key decision")
      ->capture_default_str()->check(CLI::Range(int64_t{0}, int64_t{86400000}));
  out.push_back({gwps, [gwp_ptr] { return RunGatewayPolicy(*gwp_ptr); }});  // gateway-policy
  // ---- gateway-policy (end)

  // ---- fake-vendor (begin): local fakes of the OpenAI / Anthropic / Gemini APIs (see keel/gateway/fake_vendor.h)
  auto fv = std::make_shared<FakeVendorArgs>();
  gateway::FakeVendorOptions& fvo = fv->o;
  auto* fvs = app.add_subcommand("fake-vendor", "Serve a fake OpenAI, Anthropic or Gemini API (vendor wire formats, deterministic answers) for tests and benchmarks");
  fvs->add_option("--kind", fv->kind, "openai, anthropic or gemini")->capture_default_str()->check(CLI::IsMember({"openai", "anthropic", "gemini"}));
  fvs->add_option("--host", fvo.host, "address to bind")->capture_default_str();
  fvs->add_option("--port", fvo.port, "port to bind (0 = any free port)")->capture_default_str()->check(CLI::Range(0, 65535));
  fvs->add_option("--ttft-ms", fvo.ttft_ms, "delay before the first token (at most an hour)")->capture_default_str()->check(CLI::Range(0.0, 3.6e6));
  fvs->add_option("--tokens-per-second", fvo.tokens_per_second, "pacing of later tokens (0 = no pacing)")->capture_default_str()->check(CLI::NonNegativeNumber);
  fvs->add_option("--reply-tokens", fvo.reply_tokens, "words in a full answer")->capture_default_str()->check(CLI::Range(0, 1 << 20));
  fvs->add_option("--api-key", fvo.api_key, "the only key accepted (default: any non-empty key)");
  fvs->add_option("--embedding-dims", fvo.embedding_dims, "OpenAI embedding size without \"dimensions\"")->capture_default_str()->check(CLI::Range(1, 65536));
  fvs->add_option("--slow-ms", fvo.slow_ms, "wait of models named *slow* (at most an hour)")->capture_default_str()->check(CLI::Range(0.0, 3.6e6));
  fvs->add_option("--max-connections", fvo.max_connections, "open connections (idle ones hold no thread; at the cap the oldest idle one is closed)")->capture_default_str()->check(CLI::Range(1, 100000));
  out.push_back({fvs, [fv] {  // fake-vendor
    fv->o.kind = gateway::ParseFakeVendorKind(fv->kind).value();
    return gateway::RunFakeVendorMain(fv->o);
  }});
  // ---- fake-vendor (end)
}

}  // namespace keel::cli
