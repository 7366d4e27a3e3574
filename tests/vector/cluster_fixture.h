// A cluster for router and trust tests: 2 shards x 3 replicas (zones a, b, c unless a test's
// Customize hook changes them), each a keel::vector::Service on a loopback port with its own
// Ed25519 key and HNSW seed, 2,000 seeded 16-dim items, and a Router started from a config file.
#pragma once

#include "keel/vector/router.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <thread>

#include "keel/vector/service.h"
#include "keel/vector/trust/signed_reply.h"
#include "tests/core/http_test_client.h"
#include "tests/engine/test_util.h"

namespace keel::vector::cluster_test {

using json = nlohmann::json;
using test::HttpTestClient;
using test::HttpTestResponse;

constexpr int kDim = 16;
constexpr int kShards = 2;
constexpr int kReplicas = 3;
constexpr uint64_t kItems = 2000;
inline constexpr const char* kZones[kReplicas] = {"a", "b", "c"};

inline std::vector<float> RandomVector(std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> v(kDim);
  for (float& x : v) x = u(rng);
  return v;
}

// Item i's vectors, the same in every test (seeded by id).
inline std::vector<float> TextOf(uint64_t id) {
  std::mt19937 rng(static_cast<uint32_t>(id * 2 + 1));
  return RandomVector(rng);
}
inline std::vector<float> ImageOf(uint64_t id) {
  std::mt19937 rng(static_cast<uint32_t>(id * 2 + 2));
  return RandomVector(rng);
}

inline json Batch(uint64_t begin, uint64_t end) {
  json items = json::array();
  for (uint64_t id = begin; id < end; ++id) items.push_back({{"id", id}, {"text", TextOf(id)}, {"image", ImageOf(id)}});
  return {{"items", items}};
}

inline float L2(const std::vector<float>& a, const std::vector<float>& b) {
  float d = 0;
  for (size_t i = 0; i < a.size(); ++i) d += (a[i] - b[i]) * (a[i] - b[i]);
  return d;
}

// Exact nearest ids by (distance, id) over `ids`.
inline std::vector<uint64_t> Nearest(const std::vector<float>& q, int k, const std::set<uint64_t>& ids) {
  std::vector<std::pair<float, uint64_t>> all;
  for (uint64_t id : ids) all.emplace_back(L2(TextOf(id), q), id);
  std::sort(all.begin(), all.end());
  std::vector<uint64_t> out;
  for (int i = 0; i < k && i < static_cast<int>(all.size()); ++i) out.push_back(all[static_cast<size_t>(i)].second);
  return out;
}

inline std::vector<uint64_t> Ids(const json& answer) {
  std::vector<uint64_t> ids;
  if (!answer.is_object() || !answer.contains("hits")) return ids;
  for (const auto& h : answer["hits"]) ids.push_back(h.value("id", uint64_t{0}));
  return ids;
}

inline std::string ReplicaId(int shard, int r) { return "s" + std::to_string(shard) + "-" + kZones[r]; }

// The value of one sample in a Prometheus text page, -1 when absent.
inline double MetricValue(const std::string& page, const std::string& sample) {
  const size_t at = page.find("\n" + sample + " ");
  if (at == std::string::npos) return -1;
  return std::stod(page.substr(at + sample.size() + 2));
}

class RouterTest : public ::testing::Test {
 protected:
  using Customize = std::function<void(int shard, int replica, ServiceOptions&)>;

  void StartCluster(const Customize& customize = {}) {
    std::filesystem::create_directories(dir_.file("keys"));
    for (int s = 0; s < kShards; ++s) {
      for (int r = 0; r < kReplicas; ++r) {
        const std::string id = ReplicaId(s, r);
        auto key = trust::SigningKey::Generate();
        ASSERT_TRUE(key.ok()) << key.status().ToString();
        ASSERT_TRUE(key->Save(dir_.file("keys/" + id + ".key"), dir_.file("keys/" + id + ".pub")).ok());
        ServiceOptions& o = options_[s][r];
        o.shard.dir = dir_.file(id);
        o.shard.text_dim = kDim;
        o.shard.image_dim = kDim;
        o.shard.max_k = 100;
        o.shard.index.hnsw_seed = 100 + s * kReplicas + r;  // independent graphs, as in a real cluster
        o.port = 0;
        o.identity.shard = static_cast<uint32_t>(s);
        o.identity.shards = kShards;
        o.identity.replica = id;
        o.identity.zone = kZones[r];
        o.identity.signing_key = std::make_shared<const trust::SigningKey>(std::move(key).value());
        if (customize) customize(s, r, o);
        StartReplica(s, r);
      }
    }
  }

  // (Re)starts a replica on its directory and, after the first start, on the same port.
  void StartReplica(int s, int r) {
    auto svc = Service::Start(options_[s][r]);
    ASSERT_TRUE(svc.ok()) << svc.status().ToString();
    replicas_[s][r] = std::move(svc).value();
    options_[s][r].port = replicas_[s][r]->port();
  }
  void StopReplica(int s, int r) {
    ASSERT_TRUE(replicas_[s][r]);
    replicas_[s][r]->Stop();
    replicas_[s][r].reset();
  }

  json Config(const std::string& mode) {
    json shards = json::array();
    for (int s = 0; s < kShards; ++s) {
      json reps = json::array();
      for (int r = 0; r < kReplicas; ++r) {
        json rep = {{"id", ReplicaId(s, r)}, {"url", "http://127.0.0.1:" + std::to_string(options_[s][r].port)},
                    {"zone", options_[s][r].identity.zone}};
        if (mode == "trust") rep["public_key"] = "keys/" + ReplicaId(s, r) + ".pub";
        reps.push_back(rep);
      }
      shards.push_back({{"id", s}, {"replicas", reps}});
    }
    return {{"text_dim", kDim}, {"image_dim", kDim}, {"max_k", 100}, {"mode", mode}, {"shards", shards}};
  }

  void StartRouter(const json& config, int sync_interval_ms = 100) {
    const std::string path = dir_.file("cluster.json");
    std::ofstream(path) << config.dump(2);
    auto o = LoadRouterConfig(path);
    ASSERT_TRUE(o.ok()) << o.status().ToString();
    o->port = 0;
    o->sync_interval_ms = sync_interval_ms;
    auto router = Router::Start(*o);
    ASSERT_TRUE(router.ok()) << router.status().ToString();
    router_ = std::move(router).value();
  }

  HttpTestResponse Call(int port, const std::string& method, const std::string& path, const std::string& body = "") {
    HttpTestClient http(port);
    return http.Request(method, path, body);
  }
  HttpTestResponse Post(const std::string& path, const json& body) { return Call(router_->port(), "POST", path, body.dump()); }

  json Search(const json& query) {
    HttpTestResponse res = Post("/v1/search", query);
    EXPECT_EQ(res.status, 200) << res.body;
    return json::parse(res.body, nullptr, false);
  }

  // Writes items 0..1999 through the router in 4 batches: every shard at version 4.
  void LoadAll() {
    for (uint64_t b = 0; b < kItems; b += 500) {
      HttpTestResponse res = Post("/v1/upsert", Batch(b, b + 500));
      ASSERT_EQ(res.status, 200) << res.body;
    }
    for (uint64_t id = 0; id < kItems; ++id) written_.insert(id);
  }

  uint64_t ReplicaVersion(int s, int r) {
    HttpTestResponse res = Call(options_[s][r].port, "GET", "/v1/stats");
    if (res.status != 200) return 0;
    return json::parse(res.body, nullptr, false).value("index_version", uint64_t{0});
  }

  // Polls `done` up to 30 s (a bound so a broken loop fails instead of hanging).
  static bool Eventually(const std::function<bool()>& done) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (std::chrono::steady_clock::now() < until) {
      if (done()) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return done();
  }

  void TearDown() override {
    if (router_) router_->Stop();
    for (auto& shard : replicas_) {
      for (auto& r : shard) {
        if (r) r->Stop();
      }
    }
  }

  test::TempDir dir_{"keel-router"};
  ServiceOptions options_[kShards][kReplicas];
  std::unique_ptr<Service> replicas_[kShards][kReplicas];
  std::unique_ptr<Router> router_;
  std::set<uint64_t> written_;
};

}  // namespace keel::vector::cluster_test
