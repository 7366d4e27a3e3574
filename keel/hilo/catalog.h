// The state catalog: the few product states HiLO may put the whole product in, ordered from full
// quality (index 0) down, each giving every service a level, with the figures `keel hilo validate`
// measured for it (quality, and each service's capacity in that state). The format is JSON; see
// docs/hilo.md for a full example. Plain values; thread-compatible.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/status.h"

namespace keel::hilo {

// The services a product state sets a level for. Every state gives every one of them a level.
enum class Service { kAnswer = 0, kVector = 1, kEngine = 2, kGateway = 3 };
inline constexpr int kNumServices = 4;
inline constexpr std::array<Service, kNumServices> kAllServices = {Service::kAnswer, Service::kVector,
                                                                   Service::kEngine, Service::kGateway};
// "answer", "vector", "engine", "gateway".
std::string_view ServiceName(Service s);
// The service named `name`, or nullopt.
std::optional<Service> ServiceFromName(std::string_view name);

struct AnswerLevel {
  bool retrieval = true;     // search the vector service at all
  int64_t context_docs = 0;  // documents put into the prompt; >= 1 with retrieval, 0 without
};
struct VectorLevel {
  int64_t nprobe = 1;  // IVF lists probed (ef for HNSW)
  int64_t k = 10;      // results asked of each shard
  bool rerank = false;
  int64_t fanout = 1;  // shards/replicas queried per request
};
struct EngineLevel {
  std::string kv_codec;  // a registered codec name ("raw", "zipfusion", "bellows")
  bool lossless = true;
  int64_t max_context = 1;
  int64_t max_new_tokens = 1;
};
struct GatewayLevel {
  std::string model;  // the model tier the gateway routes to
  int64_t max_tokens_clamp = 1;
};

// What `keel hilo validate` measured for one state.
struct Figures {
  double quality = 0;                             // product quality, 0..100 (docs/hilo.md)
  std::array<double, kNumServices> capacity{};    // req/s each service sustains within its SLO
  int64_t validated_at = 0;                       // unix seconds (UTC) of the measurement
  // What the product answered when validate offered it more than its capacity (its overload
  // step): `goodput` req/s of 200 answers within the SLO at `offered` req/s. Both 0 when not
  // measured; the controller then counts on an overloaded state serving its capacity, which it
  // may not (shedding costs CPU) or may exceed (the capacity allows only 1 % refused).
  double offered = 0;
  double goodput = 0;
  double Capacity(Service s) const { return capacity[static_cast<int>(s)]; }
  double Bottleneck() const;  // the least of the services' capacities
  bool HasGoodput() const { return offered > 0; }
};

struct State {
  std::string name;
  AnswerLevel answer;
  VectorLevel vector;
  EngineLevel engine;
  GatewayLevel gateway;
  std::optional<Figures> figures;  // absent: not validated
};

// Whether states `a` and `b` give service `s` the same level (every knob equal): a request that
// service handles at either is handled the same way.
bool SameLevel(const State& a, const State& b, Service s);

struct Catalog {
  std::vector<State> states;  // 4..6, index 0 = full quality
  std::string safe_state;     // where services and the controller fall back when blind
  double max_quality_drop = 0;  // the operating limit L, quality points (0..100 scale)
  std::string binaries;       // fingerprint of the binaries the figures were measured with; "" = none

  // Index of the state named `name`, or -1.
  int IndexOf(std::string_view name) const;
  int SafeIndex() const { return IndexOf(safe_state); }
};

inline constexpr int kMinStates = 4;
inline constexpr int kMaxStates = 6;
inline constexpr size_t kMaxCatalogBytes = 1 << 20;

// Parses and validates catalog JSON (any text: sizes, depth and value counts are bounded). On
// failure InvalidArgument naming the path of the offending member, e.g.
// "states[2].levels.vector.nprobe: expected a positive integer". Unknown members are errors.
Result<Catalog> ParseCatalog(std::string_view text);

// The rules ParseCatalog applies, for catalogs built in code: 4..6 states with distinct valid
// names, safe_state names one, 0 < max_quality_drop <= 100, levels in range; among validated
// states, quality does not rise and no service's capacity falls down the list, and the safe
// state's capacity is the largest of all validated states for every service.
Status ValidateCatalog(const Catalog& c);

// Reads and parses a catalog file: the file's errors (NotFound/IOError), InvalidArgument naming the
// path when it is larger than kMaxCatalogBytes or does not parse ("<path>: states[2]...: ...").
Result<Catalog> ReadCatalogFile(const std::string& path);

// Writes `c` as catalog JSON (2-space indented) that ParseCatalog reads back to an equal catalog.
std::string WriteCatalog(const Catalog& c);
// One state's levels as a JSON object, exactly as WriteCatalog writes its "levels" member
// ({"answer":{...},"vector":{...},"engine":{...},"gateway":{...}}), on one line.
std::string WriteLevels(const State& s);

// Whether the controller may act on `c`: every state validated, with `running_fingerprint` equal
// to c.binaries, and no state's validated_at older than `max_age_s` before `now` (unix seconds).
// Otherwise InvalidArgument (core has no FailedPrecondition yet) whose message starts
// "catalog not usable: " and names the reason and the state.
Status CheckUsable(const Catalog& c, std::string_view running_fingerprint, int64_t now, int64_t max_age_s);

}  // namespace keel::hilo
