// `keel gateway`: one place for access, budgets and policy in front of several model vendors.
//
// Data path (this file): parse the client's format, authorise from a cached KeyDecision, apply
// the team's policy, count input tokens, reserve against the cached budgets, forward to the
// virtual model's targets in order (falling back on 429, 5xx, timeouts and connection errors
// before anything was streamed), translate the answer back — streamed chunk by chunk — count
// output tokens, settle. Nothing on this path waits on the policy service except the first
// request of a key that is not cached (or whose decision expired); decisions are refreshed in
// the background at half their TTL and usage goes back in batches.
//
// Policy service down: unknown keys fail closed (503), known keys are served from the cached
// (stale) decision; both are logged and counted in keel_gateway_policy_unavailable_total.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "keel/core/status.h"
#include "keel/gateway/chat.h"

namespace keel::hilo {
class ServiceLink;
}

namespace keel::gateway {

struct UpstreamConfig {
  std::string name;
  std::string vendor;                            // adapter name (vendor.h); "" = the one for `format`
  WireFormat format = WireFormat::kOpenAIChat;  // "openai" (also `keel serve`), "anthropic", "gemini"
  std::string base_url;                          // http://127.0.0.1:9001 (no trailing path)
  std::string api_key;                           // sent to the vendor; from the config or api_key_env
  double timeout_seconds = 60;                   // until response headers / between stream bytes
};

struct RouteTarget {
  std::string upstream;  // UpstreamConfig::name
  std::string model;     // the vendor's model name
};

struct VirtualModel {
  std::string name;                  // what clients ask for
  std::vector<RouteTarget> targets;  // tried in order
  std::string tokenizer_path;        // llama2.c tokenizer.bin for Keel models; "" = estimator
  int tokenizer_vocab = 0;
};

// HiLO (docs/gateway.md "HiLO"): the gateway follows the product state and applies its gateway
// level (keel/hilo/catalog.h GatewayLevel) per request: the model tier and the max_tokens clamp.
struct HiloGatewayConfig {
  std::string controller;    // "http://host:port": follow this controller (its catalog); or
  std::string catalog_path;  // a catalog file, pinned to `state`, with no controller
  std::string state;         // the pinned state; with a controller optional (pinned while set)
  std::string instance;      // in load reports; "" = "gateway-<pid>"
  // Tiered virtual model -> tier name -> the virtual model (in `models`) serving that tier, e.g.
  // "answer" -> {"large": "answer-large", "small": "answer-small"}.
  std::map<std::string, std::map<std::string, std::string>> tiers;
};

struct GatewayConfig {
  std::string host = "127.0.0.1";
  int port = 8080;
  int threads = 1;                      // io threads sharing one io_context (see docs/gateway.md)
  std::string tls_cert_file, tls_key_file;
  size_t max_body_bytes = 4 << 20;
  double client_timeout_seconds = 30;   // a client must send its request within this
  std::string policy_socket = "/tmp/keel-gateway-policy.sock";
  double policy_timeout_seconds = 0.5;
  double usage_flush_seconds = 0.1;     // how often settled usage goes to the policy service
  int64_t default_max_tokens = 4096;    // for upstreams that require max_tokens (Anthropic)
  std::vector<UpstreamConfig> upstreams;
  std::vector<VirtualModel> models;
  std::optional<HiloGatewayConfig> hilo;  // absent: no HiLO, nothing clamped or re-tiered
};

// Reads the JSON config (format in docs/gateway.md). InvalidArgument names the field; api keys
// may come from the environment ("api_key_env"). LoadGatewayConfig resolves relative file paths
// (listen.tls_cert/tls_key, models[].tokenizer.path, hilo.catalog) against the config's directory.
Result<GatewayConfig> LoadGatewayConfig(const std::string& path);
Result<GatewayConfig> ParseGatewayConfig(std::string_view json);

class Gateway {
 public:
  static Result<std::unique_ptr<Gateway>> Start(GatewayConfig config);
  ~Gateway();  // Stop()
  int port() const;
  // The HiLO link (null without a "hilo" config member): Pin() it to freeze a state, meter() for
  // the load it reports. Valid while the gateway lives.
  hilo::ServiceLink* hilo_link();
  // Stops accepting, drains requests in progress, flushes usage once more.
  void Stop();

 private:
  struct Impl;
  explicit Gateway(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The CLI: runs until SIGINT/SIGTERM.
int RunGatewayMain(const std::string& config_path, const std::string& host_override, int port_override);

}  // namespace keel::gateway
