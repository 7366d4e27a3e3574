#include "keel/vector/trust/verifier.h"

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <set>
#include <unordered_map>

namespace keel::vector::trust {

namespace {

bool ScoresAgree(float a, float b) { return std::fabs(a - b) <= 1e-6f * std::max(1.0f, std::fabs(a)); }

bool HitsAgree(const SignedHit& a, const SignedHit& b) {
  return a.id == b.id && ScoresAgree(a.text_distance, b.text_distance) &&
         ScoresAgree(a.image_distance, b.image_distance) && a.vector_digest == b.vector_digest;
}

// Inversions in v (pairs i < j with v[i] > v[j]), by merge sort.
uint64_t CountInversions(std::vector<int>& v, std::vector<int>& tmp, size_t lo, size_t hi) {
  if (hi - lo < 2) return 0;
  const size_t mid = (lo + hi) / 2;
  uint64_t n = CountInversions(v, tmp, lo, mid) + CountInversions(v, tmp, mid, hi);
  size_t i = lo, j = mid, o = lo;
  while (i < mid && j < hi) {
    if (v[j] < v[i]) {
      n += mid - i;
      tmp[o++] = v[j++];
    } else {
      tmp[o++] = v[i++];
    }
  }
  while (i < mid) tmp[o++] = v[i++];
  while (j < hi) tmp[o++] = v[j++];
  std::copy(tmp.begin() + static_cast<std::ptrdiff_t>(lo), tmp.begin() + static_cast<std::ptrdiff_t>(hi),
            v.begin() + static_cast<std::ptrdiff_t>(lo));
  return n;
}

bool HitLess(const SignedHit& a, const SignedHit& b) {
  if (a.text_distance != b.text_distance) return a.text_distance < b.text_distance;
  if (a.image_distance != b.image_distance) return a.image_distance < b.image_distance;
  return a.id < b.id;
}

}  // namespace

std::string_view VerdictName(Verdict v) { return v == Verdict::kVerified ? "verified" : "unverified"; }

Status VerifierOptions::Validate() const {
  if (quorum < 1 || quorum > 64) return Status::InvalidArgument("trust.quorum must be in [1, 64]");
  if (min_zones < 1 || min_zones > quorum) return Status::InvalidArgument("trust.min_zones must be in [1, quorum]");
  if (!(threshold >= 0 && threshold <= 1)) return Status::InvalidArgument("trust.threshold must be in [0, 1]");
  if (!(overlap_weight >= 0 && overlap_weight <= 1)) return Status::InvalidArgument("trust.overlap_weight must be in [0, 1]");
  if (fanout < 0 || fanout > 1024) return Status::InvalidArgument("trust.fanout must be in [0, 1024] (0 = quorum)");
  if (!(depth >= 1 && depth <= 16)) return Status::InvalidArgument("trust.depth must be in [1, 16]");
  if (hedge.count() < 0) return Status::InvalidArgument("trust.hedge_ms must be >= 0");
  if (deadline.count() <= 0 || deadline.count() > 600000) return Status::InvalidArgument("trust.deadline_ms must be in [1, 600000]");
  return Status::Ok();
}

int Verifier::HitsToAsk(int k) const {
  return static_cast<int>(std::ceil(static_cast<double>(k) * options_.depth - 1e-9));
}

double Similarity(const std::vector<SignedHit>& a, const std::vector<SignedHit>& b, int k, double overlap_weight) {
  const size_t na = std::min(a.size(), static_cast<size_t>(std::max(k, 0)));
  const size_t nb = std::min(b.size(), static_cast<size_t>(std::max(k, 0)));
  if (na == 0 && nb == 0) return 1.0;
  std::unordered_map<uint64_t, int> rank_b;
  rank_b.reserve(nb * 2);
  for (size_t j = 0; j < nb; ++j) rank_b.emplace(b[j].id, static_cast<int>(j));
  std::vector<int> ranks;  // B-ranks of the common ids, in A's order
  ranks.reserve(std::min(na, nb));
  for (size_t i = 0; i < na; ++i) {
    auto it = rank_b.find(a[i].id);
    if (it != rank_b.end() && HitsAgree(a[i], b[static_cast<size_t>(it->second)])) ranks.push_back(it->second);
  }
  const double overlap = static_cast<double>(ranks.size()) / static_cast<double>(std::max(na, nb));
  double rank = 1.0;
  if (ranks.size() >= 2) {
    std::vector<int> tmp(ranks.size());
    const double pairs = static_cast<double>(ranks.size()) * static_cast<double>(ranks.size() - 1) / 2;
    rank = 1.0 - static_cast<double>(CountInversions(ranks, tmp, 0, ranks.size())) / pairs;
  }
  return overlap_weight * overlap + (1 - overlap_weight) * rank;
}

std::vector<SignedHit> Verifier::Consensus(const std::vector<const std::vector<SignedHit>*>& members, int k) {
  std::vector<SignedHit> out;
  if (members.empty()) return out;
  std::vector<std::unordered_map<uint64_t, const SignedHit*>> by_id(members.size());
  for (size_t m = 1; m < members.size(); ++m) {
    by_id[m].reserve(members[m]->size() * 2);
    for (const SignedHit& h : *members[m]) by_id[m].emplace(h.id, &h);
  }
  std::set<uint64_t> seen;  // a member repeating an id must not count twice
  for (const SignedHit& h : *members[0]) {
    if (!seen.insert(h.id).second) continue;
    bool all = true;
    for (size_t m = 1; m < members.size() && all; ++m) {
      auto it = by_id[m].find(h.id);
      all = it != by_id[m].end() && HitsAgree(h, *it->second);
    }
    if (all) out.push_back(h);
  }
  std::sort(out.begin(), out.end(), HitLess);
  if (out.size() > static_cast<size_t>(std::max(k, 0))) out.resize(static_cast<size_t>(std::max(k, 0)));
  return out;
}

std::vector<int> Verifier::SelectGroup(const std::vector<Candidate>& replies, int k, double* min_similarity) const {
  const int n = static_cast<int>(replies.size());
  std::vector<double> sim(static_cast<size_t>(n * n), -1.0);
  for (int i = 0; i < n; ++i) {
    for (int j = i + 1; j < n; ++j) {
      // Replies from different index versions answer different databases: never one group.
      if (replies[i].index_version != replies[j].index_version) continue;
      const double s = Similarity(*replies[i].hits, *replies[j].hits, k, options_.overlap_weight);
      sim[static_cast<size_t>(i * n + j)] = sim[static_cast<size_t>(j * n + i)] = s;
    }
  }
  std::vector<int> best;
  double best_min = -1, best_mean = -1;
  for (int seed = 0; seed < n; ++seed) {
    std::vector<int> group{seed};
    std::set<std::string> zones{replies[seed].zone};
    double group_min = 1.0;
    bool failed = false;
    while (static_cast<int>(group.size()) < options_.quorum || static_cast<int>(zones.size()) < options_.min_zones) {
      const int zones_missing = options_.min_zones - static_cast<int>(zones.size());
      const int slots_left = options_.quorum - static_cast<int>(group.size());
      // Once the remaining slots are only enough for the missing zones, a member must bring a new zone.
      const bool need_new_zone = zones_missing > 0 && slots_left <= zones_missing;
      int pick = -1;
      double pick_min = -1;
      bool pick_new_zone = false;
      for (int c = 0; c < n; ++c) {
        if (std::find(group.begin(), group.end(), c) != group.end()) continue;
        const bool new_zone = zones.count(replies[c].zone) == 0;
        if (need_new_zone && !new_zone) continue;
        double m = 1.0;
        for (int g : group) m = std::min(m, sim[static_cast<size_t>(c * n + g)]);
        // Ties go to a new zone while zones are missing: colluders in one zone count once.
        if (m > pick_min || (m == pick_min && new_zone && zones_missing > 0 && !pick_new_zone)) {
          pick = c;
          pick_min = m;
          pick_new_zone = new_zone;
        }
      }
      if (pick < 0 || pick_min < options_.threshold) {
        failed = true;
        break;
      }
      group.push_back(pick);
      zones.insert(replies[pick].zone);
      group_min = std::min(group_min, pick_min);
    }
    if (failed) continue;
    double total = 0;
    int pairs = 0;
    for (size_t a = 0; a < group.size(); ++a) {
      for (size_t b = a + 1; b < group.size(); ++b) {
        total += sim[static_cast<size_t>(group[a] * n + group[b])];
        ++pairs;
      }
    }
    const double mean = pairs ? total / pairs : 1.0;
    if (group_min > best_min || (group_min == best_min && mean > best_mean)) {
      best = group;
      best_min = group_min;
      best_mean = mean;
    }
  }
  if (min_similarity) *min_similarity = best.empty() ? 0 : best_min;
  std::sort(best.begin(), best.end());
  return best;
}

// RFC 6298's retransmission timer, applied to replica replies: SRTT + 4 x RTTVAR, so a reply is
// overdue when it is much later than authentic replies have lately been; capped by options.hedge.
std::chrono::steady_clock::duration Verifier::HedgeDelay() const {
  if (options_.hedge.count() <= 0) return std::chrono::steady_clock::duration::zero();
  std::lock_guard lock(hedge_mu_);
  if (!have_rtt_) return options_.hedge;
  const double us = std::clamp(srtt_us_ + 4 * rttvar_us_, static_cast<double>(kMinHedgeUs),
                               static_cast<double>(std::chrono::duration_cast<std::chrono::microseconds>(options_.hedge).count()));
  return std::chrono::microseconds(static_cast<int64_t>(us));
}

void Verifier::ObserveReplyTime(std::chrono::steady_clock::duration d) const {
  const double r = static_cast<double>(std::chrono::duration_cast<std::chrono::microseconds>(d).count());
  std::lock_guard lock(hedge_mu_);
  if (!have_rtt_) {
    srtt_us_ = r;
    rttvar_us_ = r / 2;
    have_rtt_ = true;
    return;
  }
  rttvar_us_ = 0.75 * rttvar_us_ + 0.25 * std::fabs(srtt_us_ - r);
  srtt_us_ = 0.875 * srtt_us_ + 0.125 * r;
}

namespace {

// What one Verify call shares with the replies still in flight (they may outlive the call).
struct Collector {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::pair<int, ReplicaReply>> arrived;  // not yet taken
  std::vector<std::chrono::steady_clock::time_point> arrived_at;  // parallel to `arrived`
  int outstanding = 0;
};

// Ask order: round-robin over zones (so the first asks span zones), starting at replica `start`
// (rotated per query, so the load spreads over the shard's replicas).
std::vector<int> AskOrder(const ReplicaSet& replicas, int start) {
  const int n = replicas.size();
  std::vector<std::string> zone_order;
  std::vector<std::vector<int>> by_zone;
  for (int t = 0; t < n; ++t) {
    const int i = (start + t) % n;
    const std::string& z = replicas.info(i).zone;
    auto it = std::find(zone_order.begin(), zone_order.end(), z);
    if (it == zone_order.end()) {
      zone_order.push_back(z);
      by_zone.emplace_back();
      it = zone_order.end() - 1;
    }
    by_zone[static_cast<size_t>(it - zone_order.begin())].push_back(i);
  }
  std::vector<int> order;
  for (size_t round = 0; order.size() < static_cast<size_t>(n); ++round) {
    for (auto& members : by_zone) {
      if (round < members.size()) order.push_back(members[round]);
    }
  }
  return order;
}

}  // namespace

ShardAnswer Verifier::Verify(ReplicaSet& replicas, int k, uint64_t min_version) const {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point deadline = Clock::now() + options_.deadline;
  const int n = replicas.size();
  ShardAnswer answer;
  auto collector = std::make_shared<Collector>();

  const int start = n ? static_cast<int>(rotation_.fetch_add(1, std::memory_order_relaxed) % static_cast<uint64_t>(n)) : 0;
  const std::vector<int> order = AskOrder(replicas, start);
  std::vector<bool> asked(static_cast<size_t>(n), false);
  std::vector<Clock::time_point> asked_at(static_cast<size_t>(n));
  std::set<std::string> zones_heard;  // zones with an authentic reply
  size_t next = 0;
  auto ask = [&](int count) {
    // Zones not heard from first, then the rest in order.
    for (int pass = 0; pass < 2 && count > 0; ++pass) {
      for (size_t t = next; t < order.size() && count > 0; ++t) {
        const int i = order[t];
        if (asked[static_cast<size_t>(i)]) continue;
        if (pass == 0 && zones_heard.count(replicas.info(i).zone)) continue;
        asked[static_cast<size_t>(i)] = true;
        asked_at[static_cast<size_t>(i)] = Clock::now();
        ++answer.asked;
        --count;
        {
          std::lock_guard lock(collector->mu);
          ++collector->outstanding;
        }
        replicas.Ask(i, [collector, i](ReplicaReply reply) {
          std::lock_guard lock(collector->mu);
          collector->arrived.emplace_back(i, std::move(reply));
          collector->arrived_at.push_back(std::chrono::steady_clock::now());
          --collector->outstanding;
          collector->cv.notify_all();
        });
      }
    }
    while (next < order.size() && asked[static_cast<size_t>(order[next])]) ++next;
  };

  std::vector<int> authentic_replica;
  std::vector<ReplicaReply> authentic;
  std::optional<ShardAnswer> partial;  // a verified but incomplete consensus
  ask(options_.fanout > 0 ? options_.fanout : options_.quorum);
  Clock::time_point last_ask = Clock::now();
  bool deadline_passed = false;
  for (;;) {
    std::vector<std::pair<int, ReplicaReply>> batch;
    std::vector<Clock::time_point> batch_at;
    int outstanding = 0;
    const Clock::duration hedge = HedgeDelay();
    const Clock::time_point wake = hedge.count() > 0 ? std::min(deadline, last_ask + hedge) : deadline;
    {
      std::unique_lock lock(collector->mu);
      collector->cv.wait_until(lock, wake, [&] { return !collector->arrived.empty() || collector->outstanding == 0; });
      batch.swap(collector->arrived);
      batch_at.swap(collector->arrived_at);
      outstanding = collector->outstanding;
    }
    bool added = false;
    for (size_t b = 0; b < batch.size(); ++b) {
      auto& [i, reply] = batch[b];
      if (reply.fault == ReplyFault::kNone && reply.index_version < min_version) reply.fault = ReplyFault::kStale;
      if (reply.fault != ReplyFault::kNone) {
        answer.faults.emplace_back(i, reply.fault);
        continue;
      }
      ObserveReplyTime(batch_at[b] - asked_at[static_cast<size_t>(i)]);
      zones_heard.insert(replicas.info(i).zone);
      authentic_replica.push_back(i);
      authentic.push_back(std::move(reply));
      added = true;
    }
    if (added && static_cast<int>(authentic.size()) >= options_.quorum) {
      if (std::optional<ShardAnswer> found = TryAgreement(replicas, authentic_replica, authentic, k, answer)) {
        if (found->complete) return *std::move(found);
        partial = std::move(found);
      }
    }
    if (Clock::now() >= deadline) {
      deadline_passed = true;
      break;
    }
    const bool hedge_due = hedge.count() > 0 && Clock::now() >= last_ask + hedge;
    if (outstanding == 0 || hedge_due) {
      // Everything asked has answered, or a reply is overdue, and no group formed: ask fresh
      // replicas; with nobody left, wait for what is outstanding or give up.
      const int lacking = std::max(1, options_.quorum - static_cast<int>(authentic.size()));
      const int before = answer.asked;
      ask(lacking);
      last_ask = Clock::now();
      if (answer.asked == before) {
        if (outstanding == 0) break;  // nobody left to ask or to wait for
      } else {
        ++answer.escalations;
      }
    }
  }

  if (partial) {
    partial->asked = answer.asked;
    partial->escalations = answer.escalations;
    partial->faults = answer.faults;
    return *std::move(partial);
  }
  return BestEffort(replicas, std::move(answer), authentic_replica, authentic, k, deadline_passed);

}

std::optional<ShardAnswer> Verifier::TryAgreement(const ReplicaSet& replicas, const std::vector<int>& authentic_replica,
                                                  const std::vector<ReplicaReply>& authentic, int k,
                                                  const ShardAnswer& so_far) const {
  std::vector<Candidate> candidates;
  for (size_t a = 0; a < authentic.size(); ++a) {
    candidates.push_back({replicas.info(authentic_replica[a]).zone, authentic[a].index_version, &authentic[a].hits});
  }
  double min_sim = 0;
  std::vector<int> group = SelectGroup(candidates, k, &min_sim);
  if (group.empty()) return std::nullopt;
  ShardAnswer found = so_far;
  std::vector<const std::vector<SignedHit>*> members;
  size_t shortest = SIZE_MAX;
  for (int g : group) {
    members.push_back(&authentic[static_cast<size_t>(g)].hits);
    shortest = std::min(shortest, authentic[static_cast<size_t>(g)].hits.size());
    found.group.push_back(authentic_replica[static_cast<size_t>(g)]);
  }
  std::sort(found.group.begin(), found.group.end());  // replica indices, not arrival order
  found.verdict = Verdict::kVerified;
  found.hits = Consensus(members, k);
  found.index_version = authentic[static_cast<size_t>(group[0])].index_version;
  found.min_similarity = min_sim;
  found.authentic = static_cast<int>(authentic.size());
  // Complete: the members agree on as many hits as the shortest of them could give. An
  // incomplete consensus (a member left out hits the others vouch for) is kept as the answer of
  // last resort while fresh replicas may still complete it.
  found.complete = found.hits.size() >= std::min(shortest, static_cast<size_t>(std::max(k, 0)));
  return found;
}

ShardAnswer Verifier::BestEffort(const ReplicaSet& replicas, ShardAnswer answer, const std::vector<int>& authentic_replica,
                                 const std::vector<ReplicaReply>& authentic, int k, bool deadline_passed) const {
  answer.verdict = Verdict::kUnverified;
  answer.authentic = static_cast<int>(authentic.size());
  std::set<std::string> zones;
  for (int i : authentic_replica) zones.insert(replicas.info(i).zone);
  answer.reason = (deadline_passed ? "deadline passed: " : "") + std::to_string(authentic.size()) +
                  " authentic replies from " + std::to_string(zones.size()) + " zones (of " + std::to_string(answer.asked) +
                  " asked); no " + std::to_string(options_.quorum) + " of them from " +
                  std::to_string(options_.min_zones) + " zones agree to similarity " + std::to_string(options_.threshold);
  // Why the other replies did not count (stale, bad_signature, unreachable, ...): what an
  // operator needs to tell a slow cluster from an attacked one.
  if (!answer.faults.empty()) {
    std::string refused;
    for (const auto& [i, fault] : answer.faults) {
      refused += (refused.empty() ? "" : ", ") + replicas.info(i).id + " " + std::string(ReplyFaultName(fault));
    }
    answer.reason += "; refused: " + refused;
  }
  if (authentic.empty()) return answer;
  // The authentic reply closest to the others (their medoid).
  size_t medoid = 0;
  double best = -1;
  for (size_t a = 0; a < authentic.size(); ++a) {
    double total = 0;
    for (size_t b = 0; b < authentic.size(); ++b) {
      if (a != b) total += Similarity(authentic[a].hits, authentic[b].hits, k, options_.overlap_weight);
    }
    if (total > best) {
      best = total;
      medoid = a;
    }
  }
  answer.hits = authentic[medoid].hits;
  std::sort(answer.hits.begin(), answer.hits.end(), HitLess);
  if (answer.hits.size() > static_cast<size_t>(std::max(k, 0))) answer.hits.resize(static_cast<size_t>(std::max(k, 0)));
  answer.group = {authentic_replica[medoid]};
  answer.index_version = authentic[medoid].index_version;
  return answer;
}

}  // namespace keel::vector::trust
