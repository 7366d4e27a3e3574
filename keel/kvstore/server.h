// kvstore Server: the binary protocol (protocol.h) over TCP, one thread per connection with
// blocking I/O and deadlines (socket.h), in front of a Store.
//
// A connection carries pipelined requests answered in order. Values are read straight into a
// Blob (no intermediate buffer) and replies are written with one sendmsg() gathering the header,
// keys and the stored values in place (no copy into a send buffer).
//
// Bounded: at most max_connections (the next one gets an ERROR frame and is closed), frame
// sizes (FrameLimits), and max_inflight_bytes of request values being received at once across
// all connections (a PUT beyond it is drained and answered ResourceExhausted). A frame that
// breaks the format gets an ERROR frame and its connection is closed; nothing is stored from it.
#pragma once

#include <atomic>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "keel/core/metrics.h"
#include "keel/core/status.h"
#include "keel/kvstore/protocol.h"
#include "keel/kvstore/store.h"

namespace keel::kvstore {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 7400;              // 0: any free port (see port())
  int max_connections = 256;
  int idle_timeout_ms = 300000; // a connection with no request for this long is closed
  int io_timeout_ms = 10000;    // reading the rest of a frame / writing a reply
  int64_t max_inflight_bytes = 1ll << 30;
  FrameLimits limits;
};

struct ServerStats {
  int64_t connections_open = 0;
  int64_t connections_total = 0;
  int64_t connections_rejected = 0;
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
  // Stops accepting, shuts every connection down and joins their threads.
  void Stop();
  ServerStats Stats() const;

 private:
  Server(Store& store, const ServerOptions& options);
  struct Conn;
  void AcceptLoop();
  void Serve(Conn* c);
  void ReapDone();

  Store& store_;
  ServerOptions options_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;
  int port_ = 0;
  std::thread accept_thread_;
  mutable std::mutex mu_;
  std::list<Conn> conns_;
  bool stopping_ = false;
  std::atomic<int64_t> inflight_bytes_{0};
  std::atomic<int64_t> open_{0}, total_{0}, rejected_{0}, bad_frames_{0}, requests_{0}, bytes_in_{0}, bytes_out_{0};
  HistogramFamily* latency_ = nullptr;
};

}  // namespace keel::kvstore
