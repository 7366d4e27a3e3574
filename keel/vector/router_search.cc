// Router searches, as a sequence of small steps: parse -> plan (one request per shard, each with
// a fresh nonce) -> fan out (per shard: the verifier over signed replies, or the first valid
// reply) -> merge -> answer.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>
#include <unordered_map>

#include <fmt/format.h>

#include "keel/core/log.h"
#include "keel/vector/hilo_link.h"
#include "keel/vector/replica_reply.h"
#include "keel/vector/router_impl.h"
#include "keel/vector/wire.h"

namespace keel::vector {

namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

std::string_view KindName(QueryKind k) {
  switch (k) {
    case QueryKind::kText: return "text";
    case QueryKind::kMultimodal: return "multimodal";
    case QueryKind::kImage: return "image";
  }
  return "text";
}

// The body a replica parses back (wire::ParseSearchRequest) into exactly `r`, so that both sides
// compute the same DigestQuery: a float widens to a double exactly, the double prints in its
// shortest round-trip form and parses back to itself.
std::string ShardRequestBody(const SearchRequest& r, const std::string& nonce) {
  json j = {{"kind", KindName(r.kind)}, {"k", r.k}, {"ef", r.ef}, {"nprobe", r.nprobe},
            {"include_vectors", r.include_vectors}, {"nonce", nonce}};
  if (!r.text_query.empty()) j["text"] = r.text_query;
  if (!r.image_query.empty()) j["image"] = r.image_query;
  if (!r.ids.empty()) j["ids"] = r.ids;
  if (!r.filter.empty()) j["filter"] = r.filter;
  if (r.rerank >= 0) j["rerank"] = r.rerank;  // the client's own; a replica's HiLO level may lower it
  return j.dump();
}

// What a shard would refuse (keel/vector/shard.cc ValidateRequest), refused once here.
Status ValidateSearch(const SearchRequest& r, const RouterOptions& o) {
  if (r.kind == QueryKind::kImage) {
    return r.ids.empty() ? Status::InvalidArgument("an image lookup needs ids") : Status::Ok();
  }
  // As the replicas check it: a query every replica refuses would otherwise be an unverified 200.
  KEEL_RETURN_IF_ERROR(CheckVector(r.text_query, o.text_dim, "text", "query"));
  if (r.image_query.empty()) return Status::Ok();
  if (r.kind != QueryKind::kMultimodal) return Status::InvalidArgument("query: an image vector needs kind multimodal");
  return CheckVector(r.image_query, o.image_dim, "image", "query");
}

// One shard's part of a search. Owned by the calls in flight (they may outlive the search).
struct ShardQuery {
  ShardState* shard = nullptr;
  uint32_t shards = 1;
  SearchRequest request;  // as sent
  int want = 0;           // hits wanted from the shard: k, or its ids for a lookup
  std::string body;
  trust::QueryDigest digest;
  uint64_t min_version = 0;
  Clock::time_point deadline;
  int plain_fanout = 0;   // plain mode: replicas asked at first (0 = all)
};

// What one shard contributes to the answer.
struct ShardResult {
  uint32_t shard = 0;
  std::string status;  // verified | unverified | unchecked | unavailable
  std::string reason;
  bool complete = true;
  std::vector<std::string> replicas;
  uint64_t index_version = 0;
  std::vector<SearchHit> hits;
  int tiers_touched = 0;
};

std::vector<ShardQuery> Plan(Router::Impl& router, const SearchRequest& request, const hilo::State* state) {
  const auto n = static_cast<uint32_t>(router.shards.size());
  std::vector<std::vector<uint64_t>> ids(n);
  for (uint64_t id : request.ids) ids[trust::ShardOf(id, n)].push_back(id);
  std::vector<ShardQuery> plan;
  for (uint32_t s = 0; s < n; ++s) {
    ShardQuery q;
    q.shard = router.shards[s].get();
    q.shards = n;
    q.request = request;
    if (request.kind == QueryKind::kImage) {
      if (ids[s].empty()) continue;  // image lookups go only to the shards owning the ids
      q.request.ids = std::move(ids[s]);
      std::vector<uint64_t> distinct = q.request.ids;
      std::sort(distinct.begin(), distinct.end());
      q.want = static_cast<int>(std::unique(distinct.begin(), distinct.end()) - distinct.begin());
    } else {
      q.want = request.k;
      if (router.options.mode == RouterMode::kTrust) {
        q.request.k = std::min(router.options.max_k, router.verifier->HitsToAsk(request.k));
      }
    }
    const std::string nonce = trust::NewNonce();
    q.body = ShardRequestBody(q.request, nonce);
    q.digest = trust::DigestQuery(q.request, nonce);
    q.min_version = q.shard->committed.load();
    q.deadline = Clock::now() + router.options.trust.deadline;
    const int replicas = static_cast<int>(q.shard->replicas.size());
    q.plain_fanout = state != nullptr ? PlainFanout(state->vector, replicas) : router.options.plain_fanout;
    plan.push_back(std::move(q));
  }
  return plan;
}

CheckedAnswer AskReplica(Router::Impl& router, const ShardQuery& q, int i) {
  ReplicaState& r = *q.shard->replicas[static_cast<size_t>(i)];
  Result<HttpReply> reply = r.client->Call("POST", "/v1/search", q.body, "application/json", q.deadline);
  if (!reply.ok()) r.Unreachable(reply.status().message());
  ReplyExpectation e;
  e.request = &q.request;
  e.shard = q.shard->id;
  e.shards = q.shards;
  e.replica = r.info.id;
  e.digest = q.digest;
  e.min_version = q.min_version;
  e.store = router.options.mode == RouterMode::kTrust ? &router.store : nullptr;
  e.max_json_values = router.options.max_json_values;
  CheckedAnswer a = CheckReplicaAnswer(reply, e);
  router.replies->WithLabels({std::string(trust::ReplyFaultName(a.reply.fault))}).Inc();
  if (a.reply.fault != trust::ReplyFault::kNone) {
    Log().debug("vector router: shard {} replica {}: {}: {}", q.shard->id, r.info.id, trust::ReplyFaultName(a.reply.fault), a.reply.detail);
  }
  return a;
}

// The hits (with vectors) of the answers that came back, kept for the merge.
struct Answered {
  std::vector<SearchHit> hits;
  int tiers_touched = 0;
};
struct Pending {
  ShardQuery query;
  std::mutex mu;
  std::vector<std::optional<Answered>> answers;
};

// The verifier's view of one shard for one query: Ask runs the call on the router's call pool.
class ShardReplicaSet final : public trust::ReplicaSet {
 public:
  ShardReplicaSet(Router::Impl* router, std::shared_ptr<Pending> pending) : router_(router), pending_(std::move(pending)) {}
  int size() const override { return static_cast<int>(pending_->query.shard->replicas.size()); }
  const trust::ReplicaInfo& info(int i) const override { return pending_->query.shard->replicas[static_cast<size_t>(i)]->info; }
  void Ask(int i, std::function<void(trust::ReplicaReply)> done) override {
    router_->calls->Submit([router = router_, p = pending_, i, done = std::move(done)] {
      CheckedAnswer a = AskReplica(*router, p->query, i);
      {
        std::lock_guard lock(p->mu);
        p->answers[static_cast<size_t>(i)] = Answered{std::move(a.hits), a.tiers_touched};
      }
      done(std::move(a.reply));
    });
  }

 private:
  Router::Impl* router_;
  std::shared_ptr<Pending> pending_;
};

// The answer's hits with their vectors: `chosen` came from `source`'s reply (the consensus is
// drawn from the first group member's hits), so each is found there by id.
std::vector<SearchHit> WithVectors(const std::vector<trust::SignedHit>& chosen, const std::vector<SearchHit>& source) {
  std::unordered_map<uint64_t, const SearchHit*> by_id;
  for (const SearchHit& h : source) by_id.emplace(h.id, &h);
  std::vector<SearchHit> out;
  out.reserve(chosen.size());
  for (const trust::SignedHit& s : chosen) {
    auto it = by_id.find(s.id);
    SearchHit h = it != by_id.end() ? *it->second : SearchHit{};
    h.id = s.id;
    h.text_distance = s.text_distance;
    if (std::isfinite(h.image_distance)) h.image_distance = s.image_distance;  // +inf: no image vector
    out.push_back(std::move(h));
  }
  return out;
}

ShardResult AskVerified(Router::Impl& router, const ShardQuery& q) {
  auto pending = std::make_shared<Pending>();
  pending->query = q;
  pending->answers.resize(q.shard->replicas.size());
  ShardReplicaSet set(&router, pending);
  const trust::ShardAnswer ans = router.verifier->Verify(set, q.want, q.min_version);
  router.verdicts->WithLabels({std::string(trust::VerdictName(ans.verdict))}).Inc();
  if (ans.escalations > 0) router.escalations->Get().Inc(ans.escalations);
  ShardResult out;
  out.shard = q.shard->id;
  out.status = trust::VerdictName(ans.verdict);
  out.reason = ans.reason;
  out.complete = ans.verdict == trust::Verdict::kVerified && ans.complete;
  out.index_version = ans.index_version;
  for (int g : ans.group) out.replicas.push_back(q.shard->replicas[static_cast<size_t>(g)]->info.id);
  if (ans.group.empty()) return out;
  std::lock_guard lock(pending->mu);
  const std::optional<Answered>& source = pending->answers[static_cast<size_t>(ans.group[0])];
  out.hits = WithVectors(ans.hits, source ? source->hits : std::vector<SearchHit>{});
  out.tiers_touched = source ? source->tiers_touched : 0;
  return out;
}

// Plain mode: the first valid reply among `q.plain_fanout` replicas (rotating), unverified. When
// every replica asked failed (unreachable, refused, stale), the next ones are asked, as a
// load-balancing router retries elsewhere.
ShardResult AskFirst(Router::Impl& router, const ShardQuery& q) {
  struct First {
    std::mutex mu;
    std::condition_variable cv;
    int pending = 0;
    std::optional<std::pair<int, CheckedAnswer>> winner;
    std::string faults;
  };
  auto first = std::make_shared<First>();
  auto query = std::make_shared<ShardQuery>(q);
  const int n = static_cast<int>(q.shard->replicas.size());
  const int fanout = q.plain_fanout > 0 ? std::min(q.plain_fanout, n) : n;
  const int start = static_cast<int>(router.plain_rotation.fetch_add(1) % static_cast<uint64_t>(n));
  int asked = 0;
  auto ask_next = [&](int count) {  // called with first->mu held
    for (; count > 0 && asked < n; --count, ++asked) {
      const int i = (start + asked) % n;
      ++first->pending;
      router.calls->Submit([r = &router, query, first, i] {
        CheckedAnswer a = AskReplica(*r, *query, i);
        std::lock_guard lock(first->mu);
        if (a.reply.fault == trust::ReplyFault::kNone && !first->winner) {
          first->winner.emplace(i, std::move(a));
        } else if (a.reply.fault != trust::ReplyFault::kNone) {
          first->faults += fmt::format("{}{}: {}: {}", first->faults.empty() ? "" : "; ",
                                       query->shard->replicas[static_cast<size_t>(i)]->info.id,
                                       trust::ReplyFaultName(a.reply.fault), a.reply.detail);
        }
        --first->pending;
        first->cv.notify_all();
      });
    }
  };
  {
    std::unique_lock lock(first->mu);
    ask_next(fanout);
    while (!first->winner && asked < n && std::chrono::steady_clock::now() < q.deadline) {
      first->cv.wait_until(lock, q.deadline, [&] { return first->winner || first->pending == 0; });
      if (!first->winner && first->pending == 0) ask_next(fanout);
    }
  }
  ShardResult out;
  out.shard = q.shard->id;
  std::unique_lock lock(first->mu);
  // Every call gives up at q.deadline; the slack only covers the wake-up.
  first->cv.wait_until(lock, q.deadline + std::chrono::milliseconds(200), [&] { return first->winner || first->pending == 0; });
  if (!first->winner) {
    out.status = "unavailable";
    out.reason = first->faults.empty() ? "no reply before the deadline" : first->faults;
    return out;
  }
  const auto& [i, a] = *first->winner;
  out.status = "unchecked";
  out.replicas = {q.shard->replicas[static_cast<size_t>(i)]->info.id};
  out.index_version = a.reply.index_version;
  out.hits = a.hits;
  out.tiers_touched = a.tiers_touched;
  return out;
}

bool TextBefore(const SearchHit& a, const SearchHit& b) {
  return a.text_distance < b.text_distance || (a.text_distance == b.text_distance && a.id < b.id);
}

// As one shard holding everything would rank: the k nearest by text (each shard's top k holds
// its members of the global top k), re-ranked by image distance when the query has an image;
// image lookups in the order the ids were asked.
std::vector<SearchHit> Merge(const SearchRequest& r, std::vector<ShardResult>& results) {
  std::vector<SearchHit> all;
  for (ShardResult& s : results) {
    for (SearchHit& h : s.hits) all.push_back(std::move(h));
  }
  if (r.kind == QueryKind::kImage) {
    std::unordered_map<uint64_t, size_t> position;
    for (size_t i = 0; i < r.ids.size(); ++i) position.emplace(r.ids[i], i);
    std::stable_sort(all.begin(), all.end(), [&](const SearchHit& a, const SearchHit& b) { return position[a.id] < position[b.id]; });
    return all;
  }
  std::sort(all.begin(), all.end(), TextBefore);
  if (all.size() > static_cast<size_t>(r.k)) all.resize(static_cast<size_t>(r.k));
  if (!r.image_query.empty()) {
    // Items without an image vector (+inf, replica_reply.h) last, in text order, as a shard ranks.
    std::stable_sort(all.begin(), all.end(), [](const SearchHit& a, const SearchHit& b) {
      if (std::isinf(a.image_distance) && std::isinf(b.image_distance)) return TextBefore(a, b);
      return a.image_distance < b.image_distance || (a.image_distance == b.image_distance && a.id < b.id);
    });
    for (SearchHit& h : all) {
      if (std::isinf(h.image_distance)) h.image_distance = 0;  // as a shard writes it
    }
  }
  return all;
}

json ShardsJson(const std::vector<ShardResult>& results) {
  json out = json::array();
  for (const ShardResult& s : results) {
    json j = {{"shard", s.shard}, {"status", s.status}, {"replicas", s.replicas}, {"index_version", s.index_version}};
    if (!s.reason.empty()) j["reason"] = s.reason;
    if (s.status == "verified") j["complete"] = s.complete;
    out.push_back(std::move(j));
  }
  return out;
}

void Answer(Router::Impl& router, const SearchRequest& r, std::vector<ShardResult> results, Clock::time_point t0,
            const hilo::State* state, HttpResponder& res) {
  json shards = ShardsJson(results);
  bool verified = router.options.mode == RouterMode::kTrust;
  int tiers = 0;
  std::string unavailable;
  for (const ShardResult& s : results) {
    verified = verified && s.status == "verified";
    tiers = std::max(tiers, s.tiers_touched);
    if (s.status == "unavailable") unavailable += fmt::format("{}shard {}: {}", unavailable.empty() ? "" : "; ", s.shard, s.reason);
  }
  // Plain mode has no verdict to carry a missing shard, so a hole is an error, not an answer.
  if (!unavailable.empty()) return SendRouterError(res, 503, unavailable, {{"verified", false}, {"shards", std::move(shards)}});
  json hits = json::array();
  for (const SearchHit& h : Merge(r, results)) hits.push_back(wire::HitJson(h, r));
  const auto us = std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - t0).count();
  json out = {{"hits", std::move(hits)}, {"tiers_touched", tiers}, {"search_us", us}, {"verified", verified},
              {"shards", std::move(shards)}};
  router.search_seconds->Get().Observe(static_cast<double>(us) / 1e6);
  HttpHeaderList headers;
  if (state != nullptr) headers.emplace_back("x-keel-hilo-state", state->name);
  res.Send(200, "application/json", out.dump(-1, ' ', false, json::error_handler_t::replace), headers);
}

}  // namespace

void Router::Impl::HandleSearch(const HttpRequest& req, HttpResponder& res) {
  hilo::ServiceLink* link = options.hilo.get();
  if (link == nullptr) return Search(req, res, nullptr);
  hilo::LoadMeter& meter = link->meter();
  // The server's own 503s (every handler thread or connection busy) reach no handler: each is a
  // search shed for overload, metered when the next one arrives (as in service.cc).
  const int64_t rejected = http->connection_stats().rejected;
  int64_t seen = rejections_seen.load();
  while (rejected > seen) {
    if (rejections_seen.compare_exchange_weak(seen, rejected)) {
      for (int64_t i = seen; i < rejected; ++i) {
        meter.Arrive();
        meter.Shed();
      }
      break;
    }
  }
  meter.Arrive();
  meter.Started();  // no queue of its own: a handler thread is serving it
  const Clock::time_point t0 = Clock::now();
  Search(req, res, &link->Current());
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  meter.Finish(seconds, seconds);  // the handler thread waits for the replicas all along
}

void Router::Impl::Search(const HttpRequest& req, HttpResponder& res, const hilo::State* state) {
  const Clock::time_point t0 = Clock::now();
  auto body = wire::ParseBody(req.body, options.max_json_values);
  if (!body.ok()) return SendRouterError(res, 400, body.status().message());
  SearchRequest request;
  std::string client_nonce;  // checked as a replica would; the router sends its own per shard
  Status s = wire::ParseSearchRequest(*body, options.max_k, &request);
  if (s.ok()) s = wire::ParseNonce(*body, &client_nonce);
  if (s.ok()) s = ValidateSearch(request, options);
  if (!s.ok()) return SendRouterError(res, 400, s.message());
  std::vector<ShardQuery> plan = Plan(*this, request, state);
  std::vector<ShardResult> results(plan.size());
  shard_tasks->RunAll(static_cast<int>(plan.size()), [&](int i) {
    const ShardQuery& q = plan[static_cast<size_t>(i)];
    results[static_cast<size_t>(i)] = options.mode == RouterMode::kTrust ? AskVerified(*this, q) : AskFirst(*this, q);
  });
  Answer(*this, request, std::move(results), t0, state, res);
}

}  // namespace keel::vector
