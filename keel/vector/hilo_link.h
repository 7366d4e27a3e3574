// HiLO in the vector tier (docs/hilo.md, docs/vector.md "HiLO levels"): how one product state's
// vector level (keel/hilo/catalog.h VectorLevel) applies to a search in `keel vector` and
// `keel vector-router`, and how those commands get their keel::hilo::ServiceLink.
//
// A replica applies nprobe, k and rerank to each search it serves; a router applies fanout only
// (its replicas have links of their own, so it forwards nothing of the level). Both read the
// link's Current() once per search, so a new state applies from the next search on.
// Stateless functions; thread-safe.
#pragma once

#include <memory>
#include <string>

#include "keel/core/status.h"
#include "keel/hilo/catalog.h"
#include "keel/hilo/service_link.h"
#include "keel/vector/shard.h"

namespace keel::vector {

// Clamps one search to `level`. A request may ask for less than the level, never more:
//  - nprobe and ef: the level's nprobe (ef for HNSW: the one knob is the index's search width);
//    a request's own non-zero nprobe/ef below it is kept. ef is capped at 2^16 (the shard's bound).
//  - k: at most level.k. The answer service asks k = 10, so a level with k < 10 returns fewer hits
//    and lowers recall@10 by construction.
//  - rerank: level.rerank false -> 0 (the ANN's k candidates only: no exact rerank beyond k);
//    true -> the request's own (-1 = the shard's ShardOptions::rerank).
// Image lookups (kind image) are id lookups with no ANN step: left as they are.
void ApplyVectorLevel(const hilo::VectorLevel& level, SearchRequest* request);

// Replicas a plain-mode router asks per shard under `level`: level.fanout, at most `replicas`
// (and at least 1). Trust mode ignores the level's fanout (see docs/vector.md).
int PlainFanout(const hilo::VectorLevel& level, int replicas);

// The command-line flags of `keel vector` and `keel vector-router` (apps/keel.cc).
// The flags every service shares (keel/hilo/service_link.h), plus --hilo-no-meter.
struct HiloLinkFlags : hilo::LinkSource {
  bool meter = true;  // --hilo-no-meter clears it: a replica behind a router (ServiceOptions::hilo_meter)
};

// A started link for a vector service or router, or nullptr when no flag asks for one.
// `workers`: requests the process serves at once (its HTTP handler threads; the meter's
// utilisation divides by it). InvalidArgument for conflicting or missing flags (--hilo with
// --hilo-catalog, --hilo-catalog without --hilo-state, --hilo-state, --hilo-instance or
// --hilo-no-meter alone),
// for a catalog that does not parse (naming the file) and for a state it lacks; Unavailable when
// the controller cannot be reached before the timeout.
Result<std::shared_ptr<hilo::ServiceLink>> OpenHiloLink(const HiloLinkFlags& flags, int workers);

}  // namespace keel::vector
