// kvstore Server: the binary protocol (protocol.h) over TCP in front of a Store, on the
// event-driven ConnectionFront (keel/core/conn_front.h). Connections waiting for their next
// request sit in one epoll set and hold no thread; the I/O thread reads each whole frame without
// blocking (a PUT's value straight into its Blob, no intermediate buffer), then a worker (at most
// max_workers at once) answers it with one sendmsg() gathering the header, keys and the stored
// values in place. A connection carries pipelined requests answered in order; a worker keeps
// serving while whole frames are already waiting.
//
// Bounded: a frame must arrive whole within io_timeout_ms of its first byte (a trickling client
// is closed), idle connections close after idle_timeout_ms, at max_connections (or
// max_connections_per_client from one peer IP) a new connection displaces the longest-waiting
// idle one, taken from the client holding the most; only when every connection is being served
// does the new one get an ERROR frame (ResourceExhausted) at once and is closed, as does a
// request arriving while max_workers are busy. Frame sizes are bounded (FrameLimits), and so are
// max_inflight_bytes of request values being received at once across all connections (a PUT
// beyond it is drained and answered ResourceExhausted). A frame that breaks the format gets an
// ERROR frame and its connection is closed; nothing is stored from it.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "keel/core/conn_front.h"
#include "keel/core/metrics.h"
#include "keel/core/socket.h"
#include "keel/core/status.h"
#include "keel/kvstore/protocol.h"
#include "keel/kvstore/store.h"

namespace keel::kvstore {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 7400;              // 0: any free port (see port())
  int max_connections = 4096;   // open connections; idle ones hold no thread (see above)
  int max_connections_per_client = 0;  // per peer IP; 0 = only max_connections
  int max_workers = 256;        // requests served at once
  int idle_timeout_ms = 300000; // a connection with no request for this long is closed
  int io_timeout_ms = 10000;    // a whole frame from its first byte; writing a reply
  int64_t max_inflight_bytes = 1ll << 30;
  FrameLimits limits;
};

struct ServerStats {
  int64_t connections_open = 0;
  int64_t connections_total = 0;
  int64_t connections_busy = 0;     // being served now (a request, or a worker waiting briefly for the next)
  int64_t connections_rejected = 0;  // refused: every connection or every worker busy
  int64_t connections_shed = 0;      // idle connections displaced by newer ones at a cap
  int64_t frame_timeouts = 0;        // frames not complete within io_timeout_ms (closed)
  int64_t frames_rejected = 0;  // protocol errors (connection closed)
  int64_t requests = 0;
  int64_t bytes_in = 0;
  int64_t bytes_out = 0;
};

class Server {
 public:
  // Listens and starts accepting. IOError when the address cannot be bound.
  static Result<std::unique_ptr<Server>> Start(Store& store, const ServerOptions& options,
                                               MetricsRegistry* metrics = nullptr);
  ~Server();  // Stop()
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  int port() const { return port_; }
  // Stops accepting, shuts every connection down and joins every thread.
  void Stop();
  ServerStats Stats() const;

 private:
  Server(Store& store, const ServerOptions& options);
  class Session;
  // Serves one frame whose header and keys were read (worker thread). False closes.
  // `value` is a PUT's value (null for other ops, or when `refused_memory`: no room was left).
  bool HandleFrame(int fd, const FrameHeader& req, const std::string& keys, std::shared_ptr<Blob> value,
                   bool refused_memory, const std::string& remote);
  // Validation shared by the I/O thread and the worker: OK, or the reason to reject the frame.
  Status CheckFrame(const uint8_t* header, const FrameHeader& req, const std::string& keys) const;
  std::string RejectBytes(const FrameHeader& req, const Status& s, const std::string& remote);

  Store& store_;
  ServerOptions options_;
  int port_ = 0;
  std::unique_ptr<ConnectionFront> front_;
  std::atomic<int64_t> inflight_bytes_{0};
  std::atomic<int64_t> bad_frames_{0}, requests_{0}, bytes_in_{0}, bytes_out_{0};
  HistogramFamily* latency_ = nullptr;
};

}  // namespace keel::kvstore
