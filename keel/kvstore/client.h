// kvstore Client: one TCP connection to a `keel kvstore` server, blocking calls with a deadline
// each (options.timeout_ms). Not thread-safe: one client per thread (or a pool).
//
// A call that fails at the transport (refused, timed out, closed, malformed reply) returns
// Unavailable or Corruption and drops the connection; the next call reconnects. Application
// results (NotFound, ResourceExhausted from the server) leave the connection open.
//
// Batched calls pipeline: PutMany writes every request before reading any reply, so N chunks
// cost one round trip, not N.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "keel/core/socket.h"
#include "keel/core/status.h"
#include "keel/kvstore/protocol.h"
#include "keel/kvstore/tier.h"

namespace keel::kvstore {

struct ClientOptions {
  int connect_timeout_ms = 500;
  int timeout_ms = 5000;  // per call, whole request and reply
  FrameLimits limits;
};

// "host:port" (IPv6 as "[addr]:port"); "kvstore://" prefix accepted.
Result<std::pair<std::string, int>> ParseHostPort(std::string_view address);

class Client {
 public:
  // Connects now, so a wrong address fails here with Unavailable.
  static Result<std::unique_ptr<Client>> Connect(const std::string& host, int port, const ClientOptions& options = {});
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // ttl_ms 0: the server's default. persist: reply only once the value is durable on SSD.
  Status Put(std::string_view key, const void* data, size_t size, int64_t ttl_ms = 0, bool persist = false);
  Status Put(std::string_view key, std::string_view value) { return Put(key, value.data(), value.size()); }
  // A value gathered from pieces (e.g. one KV block per layer), sent without joining them.
  struct PutItem {
    std::string_view key;
    std::vector<iovec> pieces;
  };
  // Pipelined PUTs; the first failure is returned (all replies are still read).
  Status PutMany(const std::vector<PutItem>& items, int64_t ttl_ms = 0);
  // NotFound when absent.
  Result<BlobPtr> Get(std::string_view key);
  Status Delete(std::string_view key);
  Result<std::vector<bool>> Exists(const std::vector<std::string_view>& keys);
  // How many leading keys of the chain are stored.
  Result<int> LongestPrefix(const std::vector<std::string_view>& keys);
  // One entry per key: the value, or nullptr when absent.
  Result<std::vector<BlobPtr>> GetMany(const std::vector<std::string_view>& keys);
  Result<std::string> Stats();  // JSON
  Status Ping();

  // Replaces the per-call timeout (e.g. the engine's lookup deadline).
  void set_timeout_ms(int ms) { options_.timeout_ms = ms; }
  bool connected() const { return fd_ >= 0; }

 private:
  Client(std::string host, int port, const ClientOptions& options)
      : host_(std::move(host)), port_(port), options_(options) {}
  Status EnsureConnected();
  void Disconnect();
  struct Reply {
    FrameHeader h;
    std::shared_ptr<Blob> value;
  };
  // Sends one request (header + keys + optional value) without waiting.
  Status Send(Op op, std::string_view key_section, uint32_t count, const iovec* value, int value_pieces,
              uint64_t aux, uint32_t flags, Deadline deadline);
  // Reads one reply; Corruption for a malformed frame, the server's error for an ERROR frame.
  // With mget_items, an MGET reply's values are read one Blob per key (nullptr when absent).
  Result<Reply> Receive(Op expected, Deadline deadline, std::vector<BlobPtr>* mget_items = nullptr);
  // Drops the connection and names the server in the error.
  Status Fail(const Status& s);
  Result<Reply> Call(Op op, std::string_view key_section, uint32_t count, const iovec* value = nullptr,
                     int value_pieces = 0, uint64_t aux = 0, uint32_t flags = 0);

  std::string host_;
  int port_;
  ClientOptions options_;
  int fd_ = -1;
  uint64_t next_id_ = 1;
};

}  // namespace keel::kvstore
