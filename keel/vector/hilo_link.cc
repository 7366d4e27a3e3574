#include "keel/vector/hilo_link.h"

#include <algorithm>

#include "keel/core/mapped_file.h"

namespace keel::vector {

namespace {

constexpr int kMaxEf = 1 << 16;  // the shard's bound on ef (wire.h)

// A request's own width is kept only when it asks for less than the level.
int Clamp(int asked, int64_t level, int most) {
  const int cap = static_cast<int>(std::clamp<int64_t>(level, 1, most));
  return asked > 0 ? std::min(asked, cap) : cap;
}

}  // namespace

void ApplyVectorLevel(const hilo::VectorLevel& level, SearchRequest* r) {
  if (r->kind == QueryKind::kImage) return;
  r->nprobe = Clamp(r->nprobe, level.nprobe, 1 << 20);
  r->ef = Clamp(r->ef, level.nprobe, kMaxEf);
  if (r->k > level.k) r->k = static_cast<int>(std::max<int64_t>(level.k, 1));
  if (!level.rerank) r->rerank = 0;
}

int PlainFanout(const hilo::VectorLevel& level, int replicas) {
  return static_cast<int>(std::clamp<int64_t>(level.fanout, 1, std::max(replicas, 1)));
}

Result<std::shared_ptr<hilo::ServiceLink>> OpenHiloLink(const HiloLinkFlags& f, int workers) {
  if (f.url.empty() && f.catalog.empty() && !f.meter) {
    return Status::InvalidArgument("--hilo-no-meter needs --hilo URL or --hilo-catalog FILE");
  }
  hilo::ServiceLinkOptions o;
  o.service = hilo::Service::kVector;
  o.workers = std::max(workers, 1);
  KEEL_ASSIGN_OR_RETURN(std::unique_ptr<hilo::ServiceLink> link, hilo::OpenServiceLink(f, std::move(o)));
  if (!link) return std::shared_ptr<hilo::ServiceLink>();
  KEEL_RETURN_IF_ERROR(link->Start());
  return std::shared_ptr<hilo::ServiceLink>(std::move(link));
}

}  // namespace keel::vector
