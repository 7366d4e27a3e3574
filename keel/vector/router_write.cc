// Router writes: split by shard, number with the shard's next version, send to every replica,
// acknowledge on a majority; replicas that missed writes are caught up from a peer's log.
#include <algorithm>
#include <optional>
#include <unordered_set>

#include <fmt/format.h>

#include "keel/core/json_reader.h"
#include "keel/core/log.h"
#include "keel/vector/records.h"
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
  bool held_already = false;  // it held the version from another write (kFailed)
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

// What a write or log answer says: its "version" (200 and 409 both carry it) and whether a 200
// applied nothing because the replica already held that version ("duplicate").
struct WriteAnswer {
  std::optional<uint64_t> version;
  bool duplicate = false;
};

WriteAnswer ParseWriteAnswer(const std::string& body) {
  WriteAnswer out;
  auto j = SmallJson(body);
  if (!j) return out;
  if (auto v = j->find("version"); v != j->end() && v->is_number_unsigned()) out.version = v->get<uint64_t>();
  if (auto d = j->find("duplicate"); d != j->end() && d->is_boolean()) out.duplicate = d->get<bool>();
  return out;
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
    const std::string where = fmt::format("items[{}]", i);
    KEEL_RETURN_IF_ERROR(CheckVector(it.text, o.text_dim, "text", where));
    if (!it.image.empty()) KEEL_RETURN_IF_ERROR(CheckVector(it.image, o.image_dim, "image", where));
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
    const WriteAnswer parsed = ParseWriteAnswer(reply->body);
    const std::optional<uint64_t> answered = parsed.version;
    if (reply->status == 200 && answered && *answered >= v && parsed.duplicate) {
      // It already held version v: another write of that number (one a minority applied before
      // this router started, or one the replica made up). Its content may differ: not counted.
      r.Observe(*answered);
      Log().warn("vector router: shard {}: {} already held version {} (it is at {}): a write this router did not "
                 "send; it may now differ from its peers and is not counted for this write",
                 shard.id, r.info.id, v, *answered);
      return {ReplicaWrite::kFailed, 409,
              fmt::format("already held version {} from another write (at {}); not counted", v, *answered), true};
    }
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
  const int n = static_cast<int>(shard.replicas.size());
  std::vector<ReplicaWrite> got;
  std::string failed;
  bool all_rejected = true;
  uint64_t v = 0;
  for (int attempt = 0;; ++attempt) {
    shard.UpdateVersions();
    v = shard.head() + 1;
    shard.issued.store(v);  // used from here on, whatever the replicas answer
    const std::string body = Dump(json{{field, part}, {"version", v}});
    got.assign(static_cast<size_t>(n), ReplicaWrite{});
    router.calls->RunAll(n, [&](int i) { got[static_cast<size_t>(i)] = WriteReplica(router, shard, i, path, body, v); });
    shard.UpdateVersions();
    int held_already = 0;
    out.applied.clear();
    failed.clear();
    all_rejected = true;
    for (int i = 0; i < n; ++i) {
      const ReplicaWrite& w = got[static_cast<size_t>(i)];
      const std::string& id = shard.replicas[static_cast<size_t>(i)]->info.id;
      held_already += w.held_already ? 1 : 0;
      if (w.kind == ReplicaWrite::kApplied) {
        out.applied.push_back(id);
        continue;
      }
      all_rejected = all_rejected && w.kind == ReplicaWrite::kRejected;
      failed += fmt::format("{}{}: {}", failed.empty() ? "" : "; ", id, w.message);
    }
    // A majority already held v: another router wrote it since this one last read the versions
    // (a majority's word is what `committed` trusts). Nothing of this write was applied, so it
    // goes again under the next version.
    if (out.applied.empty() && held_already >= shard.majority() && attempt < 2) continue;
    break;
  }
  out.version = v;
  if (static_cast<int>(out.applied.size()) >= shard.majority()) {
    out.committed = true;
    if (!failed.empty()) Log().warn("vector router: shard {} version {}: {}", shard.id, v, failed);
    return out;
  }
  if (out.applied.empty() && all_rejected) {
    // Nobody applied it, so the version is not used.
    shard.issued.store(v - 1);
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
    top = shard.head();
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

namespace {

struct LogRecordSpan {
  uint64_t version;
  std::string_view payload;
  size_t end;  // offset just past the record in its stream
};

// The records of a GET /v1/log stream that lie in (after, target], in order. Corruption when the
// stream is damaged or its versions do not run after+1, after+2, ...
Result<std::vector<LogRecordSpan>> LogRecordsUpTo(std::string_view stream, uint64_t after, uint64_t target) {
  std::vector<LogRecordSpan> out;
  std::string_view in = stream;
  while (!in.empty()) {
    const size_t at = stream.size() - in.size();
    LogRecordSpan r{};
    KEEL_RETURN_IF_ERROR(NextLogRecord(&in, at, &r.version, &r.payload));
    if (r.version != after + 1 + out.size()) {
      return Status::Corruption(fmt::format("log record at offset {} is version {}, expected {}", at, r.version,
                                            after + 1 + out.size()));
    }
    if (r.version > target) break;
    r.end = stream.size() - in.size();
    out.push_back(r);
  }
  return out;
}

}  // namespace

Result<HttpReply> Router::Impl::FetchLog(ReplicaState& peer, uint64_t after) {
  const std::string target = fmt::format("/v1/log?after={}&max_bytes={}", after, options.log_batch_bytes);
  KEEL_ASSIGN_OR_RETURN(HttpReply log, peer.client->Call("GET", target, "", "", DeadlineIn(options.write_timeout_ms)));
  if (log.status != 200) {
    return Status::Unavailable(fmt::format("{}: GET {}: HTTP {}: {}", peer.info.id, target, log.status, ErrorMessage(log.body)));
  }
  return log;
}

Result<uint64_t> Router::Impl::CopyLog(ShardState& shard, const std::vector<int>& peers, ReplicaState& to, uint64_t after,
                                       uint64_t target) {
  // Where two peers are ahead, a record is copied only when both hold it byte for byte: one
  // compromised peer cannot hand its honest peers a write of its own.
  const size_t sources = peers.size() >= 2 ? 2 : 1;
  std::vector<std::pair<std::string, std::string>> got;  // (peer id, stream)
  std::string why;
  for (int j : peers) {
    if (got.size() == sources) break;
    ReplicaState& peer = *shard.replicas[static_cast<size_t>(j)];
    Result<HttpReply> log = FetchLog(peer, after);
    if (!log.ok()) {
      why += (why.empty() ? "" : "; ") + log.status().message();
      continue;
    }
    got.emplace_back(peer.info.id, std::move(log->body));
  }
  if (got.size() < sources) {
    return Status::Unavailable(fmt::format("{} of the {} peers ahead needed answered: {}", got.size(), sources, why));
  }
  KEEL_ASSIGN_OR_RETURN(std::vector<LogRecordSpan> first, LogRecordsUpTo(got[0].second, after, target));
  size_t agreed = first.size();
  if (sources == 2) {
    KEEL_ASSIGN_OR_RETURN(std::vector<LogRecordSpan> second, LogRecordsUpTo(got[1].second, after, target));
    agreed = 0;
    while (agreed < first.size() && agreed < second.size() && first[agreed].payload == second[agreed].payload) ++agreed;
    if (agreed == 0 && !first.empty() && !second.empty()) {
      return Status::Unavailable(fmt::format("{} and {} hold different writes as version {}: not copied", got[0].first,
                                             got[1].first, after + 1));
    }
  }
  if (agreed == 0) return after;
  const std::string_view bytes = std::string_view(got[0].second).substr(0, first[agreed - 1].end);
  KEEL_ASSIGN_OR_RETURN(HttpReply put, to.client->Call("POST", "/v1/log", std::string(bytes), "application/octet-stream",
                                                       DeadlineIn(options.write_timeout_ms)));
  const std::optional<uint64_t> v = ParseWriteAnswer(put.body).version;
  if (put.status != 200 || !v) {
    return Status::Unavailable(fmt::format("{}: POST /v1/log: HTTP {}: {}", to.info.id, put.status, ErrorMessage(put.body)));
  }
  to.Observe(*v);
  return *v;
}

Status Router::Impl::CatchUp(ShardState& shard, int i, uint64_t from, uint64_t target) {
  ReplicaState& to = *shard.replicas[static_cast<size_t>(i)];
  std::string why = "no peer is known to be ahead";
  uint64_t at = from;
  while (at < target) {
    std::vector<int> peers;  // known to be past `at`, most advanced first
    for (int j = 0; j < static_cast<int>(shard.replicas.size()); ++j) {
      const ReplicaState& p = *shard.replicas[static_cast<size_t>(j)];
      if (j != i && p.known.load() && p.version.load() > at) peers.push_back(j);
    }
    std::stable_sort(peers.begin(), peers.end(), [&](int a, int b) {
      return shard.replicas[static_cast<size_t>(a)]->version.load() > shard.replicas[static_cast<size_t>(b)]->version.load();
    });
    if (peers.empty()) break;
    Result<uint64_t> next = CopyLog(shard, peers, to, at, target);
    if (!next.ok()) {
      why = next.status().message();
      break;
    }
    if (*next <= at) {
      why = fmt::format("the peers had nothing after version {}", at);
      break;
    }
    at = *next;
  }
  if (at >= target) {
    catch_ups->Get().Inc();
    Log().info("vector router: shard {}: {} caught up from version {} to {}", shard.id, to.info.id, from, at);
    return Status::Ok();
  }
  return Status::Unavailable(fmt::format("{} at version {} cannot reach version {}: {}", to.info.id, at, target, why));
}

}  // namespace keel::vector
