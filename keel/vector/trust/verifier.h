// keel::vector::trust::Verifier — TrustANN's middleware: for one shard, ask replicas, keep the
// authentic replies, and greedily pick a group of at least `quorum` replies from at least
// `min_zones` failure domains whose pairwise similarity is at least `threshold`; when the replies
// fall short, ask fresh replicas until `deadline`; otherwise answer *unverified*, never silently.
//
// The verifier sees replicas only through ReplicaSet, a narrow interface (list replicas with their
// zone, ask one of them), so it runs above any replicated vector database: Keel's router is the
// first user; a Qdrant or Milvus adapter would implement Ask with that database's search call and
// authenticate each reply with its own means (see docs/trust.md).
//
// Similarity of two replies A and B (each a ranked list cut to the first k hits):
//   common  = ids in both whose scores agree (|a-b| <= 1e-6 * max(1, |a|)); an id whose scores
//             differ is counted as not common, since an honest replica computes exact distances
//             from the same vectors
//   overlap = |common| / max(|A|, |B|)                          (1 when both are empty)
//   rank    = fraction of concordant pairs among common ids (1 when fewer than 2 in common)
//   sim     = overlap_weight * overlap + (1 - overlap_weight) * rank
// The consensus answer of a group is every id that *every* member returned with agreeing scores,
// ordered by (text_distance, image_distance, id), cut to k: no id enters it unless each member
// vouched for it, so with fewer compromised replicas than the quorum an injected id never reaches
// a verified answer.
// A group whose consensus is shorter than its members' replies (someone left out hits the others
// vouch for) is kept only as a last resort: Verify first asks fresh replicas for a complete one.
// Thread-safe: Verify may run concurrently; each call owns its state.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "keel/core/status.h"
#include "keel/vector/trust/signed_reply.h"

namespace keel::vector::trust {

struct VerifierOptions {
  int quorum = 2;            // m: replies in an accepted group
  int min_zones = 2;         // z: distinct failure domains in it
  double threshold = 0.95;   // minimum pairwise similarity inside the group (docs/trust.md: calibration)
  double overlap_weight = 0.5;
  int fanout = 0;            // replicas asked at first; 0 = quorum. Escalation asks replicas not yet
                             // asked (zones not yet heard from first), as many as the quorum lacks
  double depth = 1.0;        // the ReplicaSet's user asks each replica for ceil(k * depth) hits:
                             // similarity reads the first k, the consensus all of them (cut to k), so
                             // honest replicas that differ only near rank k still give k hits
  std::chrono::milliseconds deadline{1000};  // from the start of Verify to the last escalation's answer
  // No decision this long after the last ask: escalate without waiting for the replies still out
  // (a hung replica costs a hedge, not the deadline). The delay adapts as TCP's retransmission
  // timer does (RFC 6298: smoothed reply time + 4 x its mean deviation, over authentic replies,
  // at least 2 ms); `hedge` is its upper bound and its value before any reply was seen.
  // 0 = escalate only when every reply is in.
  std::chrono::milliseconds hedge{100};
  Status Validate() const;   // InvalidArgument naming the field
};

struct ReplicaInfo {
  std::string id;
  std::string zone;
};

// An authentic reply (the ReplicaSet checked its signature), or why there is none.
struct ReplicaReply {
  ReplyFault fault = ReplyFault::kNone;
  std::string detail;               // for logs when fault != kNone
  uint64_t index_version = 0;
  std::vector<SignedHit> hits;      // ranked, as signed
};

// One shard's replicas, bound to one query.
class ReplicaSet {
 public:
  virtual ~ReplicaSet() = default;
  virtual int size() const = 0;
  virtual const ReplicaInfo& info(int replica) const = 0;
  // Starts asking replica `i`; `done` runs exactly once, on any thread, possibly before Ask
  // returns. It must run eventually (a timeout is a reply with fault kUnreachable). Verify returns
  // as soon as it can decide, so `done` may run after Verify returned and after this set is gone:
  // whatever the call needs must be owned by the call, not borrowed from the set.
  virtual void Ask(int replica, std::function<void(ReplicaReply)> done) = 0;
};

enum class Verdict { kVerified, kUnverified };
std::string_view VerdictName(Verdict v);  // "verified" | "unverified"

struct ShardAnswer {
  Verdict verdict = Verdict::kUnverified;
  std::string reason;                  // why unverified ("" when verified)
  std::vector<SignedHit> hits;         // consensus (verified) or best effort (unverified)
  // Verified and complete: the group agrees on min(k, its shortest reply) hits. A verified answer
  // may be incomplete (shorter) when no complete group formed before replicas or time ran out:
  // every hit in it is still vouched for by the whole group.
  bool complete = false;
  std::vector<int> group;              // replicas whose replies formed the answer, ascending
  uint64_t index_version = 0;
  double min_similarity = 0;           // inside the group
  int asked = 0, authentic = 0, escalations = 0;
  std::vector<std::pair<int, ReplyFault>> faults;  // discarded replies
};

// Pairwise similarity as documented above, on the first k hits of each.
double Similarity(const std::vector<SignedHit>& a, const std::vector<SignedHit>& b, int k, double overlap_weight);

class Verifier {
 public:
  explicit Verifier(VerifierOptions options) : options_(options) {}
  // Hits to ask each replica for when the answer wants k: ceil(k * depth).
  int HitsToAsk(int k) const;
  // `k`: hits wanted. `min_version`: replies with an older index version are stale (discarded).
  ShardAnswer Verify(ReplicaSet& replicas, int k, uint64_t min_version) const;
  const VerifierOptions& options() const { return options_; }

  // Greedy selection over authentic replies (exposed for tests and calibration): indices into
  // `replies` of the best group meeting quorum/zones/threshold, or empty when none does.
  struct Candidate {
    std::string zone;
    uint64_t index_version = 0;
    const std::vector<SignedHit>* hits = nullptr;
  };
  std::vector<int> SelectGroup(const std::vector<Candidate>& replies, int k, double* min_similarity) const;
  // Ids every member returned with agreeing scores, ordered, cut to k.
  static std::vector<SignedHit> Consensus(const std::vector<const std::vector<SignedHit>*>& members, int k);

 private:
  // A group from the authentic replies so far (replica indices parallel to the replies), with
  // `so_far`'s counters; nullopt while none meets quorum, zones and threshold.
  std::optional<ShardAnswer> TryAgreement(const ReplicaSet& replicas, const std::vector<int>& authentic_replica,
                                          const std::vector<ReplicaReply>& authentic, int k,
                                          const ShardAnswer& so_far) const;
  // The unverified answer: why no group formed, and the medoid of the authentic replies.
  ShardAnswer BestEffort(const ReplicaSet& replicas, ShardAnswer answer, const std::vector<int>& authentic_replica,
                         const std::vector<ReplicaReply>& authentic, int k, bool deadline_passed) const;
  std::chrono::steady_clock::duration HedgeDelay() const;
  void ObserveReplyTime(std::chrono::steady_clock::duration d) const;
  static constexpr int64_t kMinHedgeUs = 2000;

  VerifierOptions options_;
  mutable std::atomic<uint64_t> rotation_{0};  // spreads first asks over a shard's replicas
  mutable std::mutex hedge_mu_;                // the reply-time estimate behind HedgeDelay
  mutable bool have_rtt_ = false;
  mutable double srtt_us_ = 0, rttvar_us_ = 0;
};

}  // namespace keel::vector::trust
