// CountingResponder: wraps a handler's HttpResponder and counts the request in a
// {route, code} counter family the moment its status is written — before the client can see
// the answer — so a /metrics scrape that follows a response always includes it. Used by every
// server's dispatch (engine, vector service). HandleHealthAndMetrics: the two routes every
// service answers the same way.
#pragma once

#include <string>
#include <string_view>
#include <utility>

#include "keel/core/http_server.h"
#include "keel/core/metrics.h"

namespace keel {

class CountingResponder final : public HttpResponder {
 public:
  CountingResponder(HttpResponder& inner, CounterFamily& requests, std::string route)
      : inner_(inner), requests_(requests), route_(std::move(route)) {}

  bool Send(int status, std::string_view content_type, std::string body, const HttpHeaderList& extra) override {
    Count(status);
    return inner_.Send(status, content_type, std::move(body), extra);
  }
  bool BeginStream(int status, std::string_view content_type, const HttpHeaderList& extra) override {
    Count(status);
    return inner_.BeginStream(status, content_type, extra);
  }
  bool WriteChunk(std::string_view data) override { return inner_.WriteChunk(data); }
  bool EndStream() override { return inner_.EndStream(); }
  bool ClientGone() override { return inner_.ClientGone(); }
  int status() const override { return inner_.status(); }
  void Abandon() override {
    Count(kClientClosedRequest);
    inner_.Abandon();
  }
  // A handler that never answered is answered 500 by the HTTP layer; count that too.
  void CountIfSilent() { Count(500); }

 private:
  void Count(int status) {
    if (counted_ || inner_.status() != 0) return;
    counted_ = true;
    requests_.WithLabels({route_, std::to_string(status)}).Inc();
  }
  HttpResponder& inner_;
  CounterFamily& requests_;
  std::string route_;
  bool counted_ = false;
};

// GET /healthz -> {"status":"ok"}; GET /metrics -> `metrics` as Prometheus text. `metrics` must
// outlive the router.
inline void HandleHealthAndMetrics(HttpRouter& router, const MetricsRegistry& metrics) {
  router.Handle("GET", "/healthz", [](const HttpRequest&, HttpResponder& r) { r.Send(200, "application/json", R"({"status":"ok"})"); });
  router.Handle("GET", "/metrics", [&metrics](const HttpRequest&, HttpResponder& r) {
    r.Send(200, MetricsRegistry::kContentType, metrics.Render());
  });
}

}  // namespace keel
