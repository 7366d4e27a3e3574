#include "keel/kvstore/service.h"

#include "keel/core/http_metrics.h"
#include "keel/core/log.h"

namespace keel::kvstore {

Result<std::unique_ptr<Service>> Service::Start(const ServiceOptions& options) {
  std::unique_ptr<Service> s(new Service());
  s->redis_flush_limit_ = options.redis_flush_limit;
  KEEL_ASSIGN_OR_RETURN(s->store_, Store::Open(options.store));
  s->store_->RegisterMetrics(s->metrics_);
  KEEL_ASSIGN_OR_RETURN(s->server_, Server::Start(*s->store_, options.server, &s->metrics_));
  if (options.http_port >= 0) {
    Service* self = s.get();
    HandleHealthAndMetrics(s->router_, s->metrics_);
    s->router_.Handle("GET", "/v1/stats", [self](const HttpRequest&, HttpResponder& r) {
      r.Send(200, "application/json", self->store_->StatsJson());
    });
    HttpServerOptions h;
    h.host = options.http_host;
    h.port = options.http_port;
    h.max_connections = 32;
    h.max_body_bytes = 4096;
    s->http_ = std::make_unique<HttpServer>(h, [self](const HttpRequest& q, HttpResponder& r) { self->router_(q, r); });
    KEEL_RETURN_IF_ERROR(s->http_->Start());
  }
  return s;
}

Service::~Service() { Stop(); }

void Service::Stop() {
  if (stopped_) return;
  stopped_ = true;
  if (http_) http_->Stop();
  if (server_) server_->Stop();
  if (!store_) return;
  if (const int64_t skipped = store_->FlushForShutdown(redis_flush_limit_); skipped > 0) {
    Log().error("kvstore: Redis did not take the write-behind within {} ms; {} queued writes never reached it "
                "(other instances may serve those keys' older Redis copies)",
                redis_flush_limit_.count(), skipped);
  }
}

}  // namespace keel::kvstore
