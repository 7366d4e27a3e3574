// Router writes: split by shard, number with the shard's next version, send to every replica,
// acknowledge on a majority; replicas that missed writes are caught up from a peer's log.
#include <algorithm>
#include <optional>
#include <unordered_set>

#include <fmt/format.h>

#include "keel/core/json_reader.h"
#include "keel/core/log.h"
#include "keel/vector/router_impl.h"
#include "keel/vector/wire.h"

namespace keel::vector {

namespace {

using json = nlohmann::json;

std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// How one replica took one write.
struct ReplicaWrite {
  enum Kind { kApplied, kRejected, kFailed } kind = kFailed;
  int status = 0;  // the replica's HTTP status when it answered
  std::string message;
};

// How one shard took its part of a write.
struct ShardWrite {
  uint32_t shard = 0;
  uint64_t version = 0;
  bool committed = false;
  int status = 200;  // when not committed: 503, or the 4xx every replica rejected it with
  std::string message;
  std::vector<std::string> applied;
};

// A replica's answers are small objects; anything else is not worth parsing further.
std::optional<json> SmallJson(const std::string& body) {
  auto j = ParseUntrustedJson(body, JsonLimits{.max_depth = 4, .max_values = 256, .require_object = true});
  if (!j.ok()) return std::nullopt;
  return std::move(j).value();
}

// The "version" of a write or log answer (200 and 409 both carry it).
std::optional<uint64_t> AnsweredVersion(const std::string& body) {
  auto j = SmallJson(body);
  if (!j) return std::nullopt;
  auto v = j->find("version");
  if (v == j->end() || !v->is_number_unsigned()) return std::nullopt;
  return v->get<uint64_t>();
}

std::string ErrorMessage(const std::string& body) {
  if (auto j = SmallJson(body)) {
    auto e = j->find("error");
    if (e != j->end() && e->is_object() && e->contains("message") && (*e)["message"].is_string()) return (*e)["message"];
  }
  return body.substr(0, 200);
}

// What the shard would refuse, refused before any shard sees the batch: a batch half applied
// because one shard disliked its half is worse than one refused whole.
Status ValidateItems(const std::vector<Item>& items, const RouterOptions& o) {
  std::unordered_set<uint64_t> ids;
  for (size_t i = 0; i < items.size(); ++i) {
    const Item& it = items[i];
    if (static_cast<int>(it.text.size()) != o.text_dim) {
      return Status::InvalidArgument(fmt::format("items[{}].text has {} values, expected {}", i, it.text.size(), o.text_dim));
    }
    if (!it.image.empty() && static_cast<int>(it.image.size()) != o.image_dim) {
      return Status::InvalidArgument(fmt::format("items[{}].image has {} values, expected {}", i, it.image.size(), o.image_dim));
    }
    if (!ids.insert(it.id).second) return Status::InvalidArgument(fmt::format("items[{}].id {} appears twice in the batch", i, it.id));
  }
  return Status::Ok();
}

ReplicaWrite WriteReplica(Router::Impl& router, ShardState& shard, int i, const char* path, const std::string& body, uint64_t v) {
  ReplicaState& r = *shard.replicas[static_cast<size_t>(i)];
  // At most twice behind: a catch-up races only writes of this shard, which wait for us.
  for (int attempt = 0; attempt < 3; ++attempt) {
    auto reply = r.client->Call("POST", path, body, "application/json", DeadlineIn(router.options.write_timeout_ms));
    if (!reply.ok()) {
      r.Unreachable(reply.status().message());
      return {ReplicaWrite::kFailed, 0, reply.status().message()};
    }
    const std::optional<uint64_t> answered = AnsweredVersion(reply->body);
    if (reply->status == 200 && answered && *answered >= v) {
      r.Observe(*answered);
      return {ReplicaWrite::kApplied, 200, ""};
    }
    if (reply->status == 409 && answered && *answered + 1 < v) {
      r.Observe(*answered);
      if (Status s = router.CatchUp(shard, i, *answered, v - 1); !s.ok()) return {ReplicaWrite::kFailed, 409, s.message()};
      continue;
    }
    if (reply->status >= 400 && reply->status < 500 && reply->status != 409) {
      return {ReplicaWrite::kRejected, reply->status, ErrorMessage(reply->body)};
    }
    return {ReplicaWrite::kFailed, reply->status, fmt::format("HTTP {}: {}", reply->status, ErrorMessage(reply->body))};
  }
  return {ReplicaWrite::kFailed, 409, "still behind after catching up twice"};
}

ShardWrite WriteShard(Router::Impl& router, ShardState& shard, const char* path, const char* field, json part) {
  ShardWrite out;
  out.shard = shard.id;
  std::lock_guard lock(shard.write_mu);
  if (!shard.learned.load()) router.SyncShard(shard, /*catch_up=*/false);
  if (!shard.learned.load()) {
    out.status = 503;
    out.message = fmt::format("shard {}: fewer than a majority of its replicas told their version", shard.id);
    return out;
  }
  shard.UpdateVersions();
  const uint64_t v = shard.issued.load() + 1;
  const std::string body = Dump(json{{field, std::move(part)}, {"version", v}});
  const int n = static_cast<int>(shard.replicas.size());
  std::vector<ReplicaWrite> got(static_cast<size_t>(n));
  router.calls->RunAll(n, [&](int i) { got[static_cast<size_t>(i)] = WriteReplica(router, shard, i, path, body, v); });
  shard.UpdateVersions();
  std::string failed;
  bool all_rejected = true;
  for (int i = 0; i < n; ++i) {
    const ReplicaWrite& w = got[static_cast<size_t>(i)];
    const std::string& id = shard.replicas[static_cast<size_t>(i)]->info.id;
    if (w.kind == ReplicaWrite::kApplied) {
      out.applied.push_back(id);
      continue;
    }
    all_rejected = all_rejected && w.kind == ReplicaWrite::kRejected;
    failed += fmt::format("{}{}: {}", failed.empty() ? "" : "; ", id, w.message);
  }
  out.version = v;
  if (static_cast<int>(out.applied.size()) >= shard.majority()) {
    out.committed = true;
    if (!failed.empty()) Log().warn("vector router: shard {} version {}: {}", shard.id, v, failed);
    return out;
  }
  if (out.applied.empty() && all_rejected) {
    // Nobody applied it, so the version is not used.
    out.version = 0;
    out.status = got[0].status;
    out.message = fmt::format("shard {}: {}", shard.id, failed);
    return out;
  }
  out.status = 503;
  out.message = fmt::format("shard {}: version {} applied by {} of {} replicas, a majority is {}: {}", shard.id, v,
                            out.applied.size(), n, shard.majority(), failed);
  return out;
}

// Writes every shard's part (shards without one are not written) and answers.
void WriteParts(Router::Impl& router, const char* path, const char* field, std::vector<json> parts, const char* count_name,
                size_t count, HttpResponder& res) {
  std::vector<size_t> touched;
  for (size_t s = 0; s < parts.size(); ++s) {
    if (!parts[s].empty()) touched.push_back(s);
  }
  std::vector<ShardWrite> done(touched.size());
  router.shard_tasks->RunAll(static_cast<int>(touched.size()), [&](int t) {
    const size_t s = touched[static_cast<size_t>(t)];
    done[static_cast<size_t>(t)] = WriteShard(router, *router.shards[s], path, field, std::move(parts[s]));
  });
  json shards = json::array();
  int status = 200;
  std::string message;
  for (const ShardWrite& w : done) {
    shards.push_back({{"shard", w.shard}, {"version", w.version}, {"committed", w.committed}, {"applied", w.applied}});
    if (w.committed) continue;
    // Any shard unavailable makes the write unavailable; else every failure is the replicas' 4xx.
    status = (status == 200 || w.status == 503) ? w.status : status;
    message += (message.empty() ? "" : "; ") + w.message;
  }
  if (status != 200) return SendRouterError(res, status, message, {{"shards", std::move(shards)}});
  res.Send(200, "application/json", Dump({{count_name, count}, {"shards", std::move(shards)}}));
}

}  // namespace

void Router::Impl::HandleUpsert(const HttpRequest& req, HttpResponder& res) {
  auto body = wire::ParseBody(req.body, options.max_json_values);
  if (!body.ok()) return SendRouterError(res, 400, body.status().message());
  std::vector<Item> items;
  if (Status s = wire::ParseItems(*body, &items); !s.ok()) return SendRouterError(res, 400, s.message());
  if (Status s = ValidateItems(items, options); !s.ok()) return SendRouterError(res, 400, s.message());
  const auto n = static_cast<uint32_t>(shards.size());
  std::vector<json> parts(n, json::array());
  const json& given = body->at("items");
  for (size_t i = 0; i < items.size(); ++i) parts[trust::ShardOf(items[i].id, n)].push_back(given[i]);
  WriteParts(*this, "/v1/upsert", "items", std::move(parts), "upserted", items.size(), res);
}

void Router::Impl::HandleDelete(const HttpRequest& req, HttpResponder& res) {
  auto body = wire::ParseBody(req.body, options.max_json_values);
  if (!body.ok()) return SendRouterError(res, 400, body.status().message());
  std::vector<uint64_t> ids;
  if (Status s = wire::ParseIds(*body, &ids); !s.ok()) return SendRouterError(res, 400, s.message());
  const auto n = static_cast<uint32_t>(shards.size());
  std::vector<json> parts(n, json::array());
  for (uint64_t id : ids) parts[trust::ShardOf(id, n)].push_back(id);
  WriteParts(*this, "/v1/delete", "ids", std::move(parts), "deleted", ids.size(), res);
}

void Router::Impl::ReadStats(ShardState& shard, int i) {
  ReplicaState& r = *shard.replicas[static_cast<size_t>(i)];
  auto reply = r.client->Call("GET", "/v1/stats", "", "", DeadlineIn(options.stats_timeout_ms));
  if (!reply.ok()) return r.Unreachable(reply.status().message());
  if (reply->status != 200) return r.Unreachable(fmt::format("GET /v1/stats: HTTP {}", reply->status));
  auto j = ParseUntrustedJson(reply->body, JsonLimits{.max_depth = 8, .max_values = 1 << 16, .require_object = true});
  if (!j.ok()) return r.Unreachable("GET /v1/stats: " + j.status().message());
  auto v = j->find("index_version");
  if (v == j->end() || !v->is_number_unsigned()) return r.Unreachable("GET /v1/stats: no index_version (not a replica?)");
  r.Observe(v->get<uint64_t>());
}

void Router::Impl::SyncShard(ShardState& shard, bool catch_up) {
  const int n = static_cast<int>(shard.replicas.size());
  calls->RunAll(n, [&](int i) { ReadStats(shard, i); });
  shard.UpdateVersions();
  if (!catch_up) return;
  std::vector<int> behind;
  uint64_t top = 0;
  {
    // A write in progress catches its own replicas up; copying the same versions beside it
    // would only be done twice (the replica skips what it holds).
    std::unique_lock writing(shard.write_mu, std::try_to_lock);
    if (!writing.owns_lock()) return;
    top = shard.issued.load();
    for (int i = 0; i < n; ++i) {
      const ReplicaState& r = *shard.replicas[static_cast<size_t>(i)];
      if (r.reachable.load() && r.known.load() && r.version.load() < top) behind.push_back(i);
    }
  }
  calls->RunAll(static_cast<int>(behind.size()), [&](int t) {
    const int i = behind[static_cast<size_t>(t)];
    Status s = CatchUp(shard, i, shard.replicas[static_cast<size_t>(i)]->version.load(), top);
    if (!s.ok()) Log().warn("vector router: shard {}: {}", shard.id, s.message());
  });
  shard.UpdateVersions();
}

Result<uint64_t> Router::Impl::CopyLog(ReplicaState& peer, ReplicaState& to, uint64_t after) {
  const std::string target = fmt::format("/v1/log?after={}&max_bytes={}", after, options.log_batch_bytes);
  KEEL_ASSIGN_OR_RETURN(HttpReply log, peer.client->Call("GET", target, "", "", DeadlineIn(options.write_timeout_ms)));
  if (log.status != 200) {
    return Status::Unavailable(fmt::format("{}: GET {}: HTTP {}: {}", peer.info.id, target, log.status, ErrorMessage(log.body)));
  }
  if (log.body.empty()) return after;
  KEEL_ASSIGN_OR_RETURN(HttpReply put, to.client->Call("POST", "/v1/log", log.body, "application/octet-stream",
                                                       DeadlineIn(options.write_timeout_ms)));
  const std::optional<uint64_t> v = AnsweredVersion(put.body);
  if (put.status != 200 || !v) {
    return Status::Unavailable(fmt::format("{}: POST /v1/log: HTTP {}: {}", to.info.id, put.status, ErrorMessage(put.body)));
  }
  to.Observe(*v);
  return *v;
}

Status Router::Impl::CatchUp(ShardState& shard, int i, uint64_t from, uint64_t target) {
  ReplicaState& to = *shard.replicas[static_cast<size_t>(i)];
  std::vector<int> peers;  // known to be ahead, most advanced first
  for (int j = 0; j < static_cast<int>(shard.replicas.size()); ++j) {
    const ReplicaState& p = *shard.replicas[static_cast<size_t>(j)];
    if (j != i && p.known.load() && p.version.load() > from) peers.push_back(j);
  }
  std::sort(peers.begin(), peers.end(), [&](int a, int b) {
    return shard.replicas[static_cast<size_t>(a)]->version.load() > shard.replicas[static_cast<size_t>(b)]->version.load();
  });
  std::string why = peers.empty() ? "no peer is known to be ahead" : "";
  uint64_t at = from;
  for (int j : peers) {
    ReplicaState& peer = *shard.replicas[static_cast<size_t>(j)];
    while (at < target) {
      Result<uint64_t> next = CopyLog(peer, to, at);
      if (!next.ok()) {
        why = next.status().message();
        break;
      }
      if (*next <= at) {
        why = fmt::format("{} had nothing after version {}", peer.info.id, at);
        break;
      }
      at = *next;
    }
    if (at >= target) {
      catch_ups->Get().Inc();
      Log().info("vector router: shard {}: {} caught up from version {} to {} through {}", shard.id, to.info.id, from, at, peer.info.id);
      return Status::Ok();
    }
  }
  return Status::Unavailable(fmt::format("{} at version {} cannot reach version {}: {}", to.info.id, at, target, why));
}

}  // namespace keel::vector
