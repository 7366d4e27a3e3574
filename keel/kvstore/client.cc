#include "keel/kvstore/client.h"

#include <unistd.h>

#include <cstring>

#include "keel/core/hash.h"
#include "keel/core/socket.h"

namespace keel::kvstore {
namespace {

std::string KeyList(const std::vector<std::string_view>& keys) {
  std::string section;
  size_t n = 0;
  for (std::string_view k : keys) n += 2 + k.size();
  section.reserve(n);
  for (std::string_view k : keys) AppendKey(section, k);
  return section;
}

Status CheckKeys(const std::vector<std::string_view>& keys) {
  for (std::string_view k : keys) KEEL_RETURN_IF_ERROR(ValidateKey(k));
  return Status::Ok();
}

}  // namespace

Result<std::pair<std::string, int>> ParseHostPort(std::string_view address) {
  std::string_view a = address;
  if (a.substr(0, 10) == "kvstore://") a.remove_prefix(10);
  std::string host;
  std::string_view port;
  if (!a.empty() && a.front() == '[') {
    size_t close = a.find(']');
    if (close == std::string_view::npos || close + 1 >= a.size() || a[close + 1] != ':') {
      return Status::InvalidArgument("kvstore address '" + std::string(address) + "': expected [addr]:port");
    }
    host = std::string(a.substr(1, close - 1));
    port = a.substr(close + 2);
  } else {
    size_t colon = a.rfind(':');
    if (colon == std::string_view::npos || colon == 0) {
      return Status::InvalidArgument("kvstore address '" + std::string(address) + "': expected host:port");
    }
    host = std::string(a.substr(0, colon));
    port = a.substr(colon + 1);
  }
  int p = 0;
  for (char ch : port) {
    if (ch < '0' || ch > '9' || p > 65535) return Status::InvalidArgument("kvstore address '" + std::string(address) + "': bad port");
    p = p * 10 + (ch - '0');
  }
  if (port.empty() || p < 1 || p > 65535) {
    return Status::InvalidArgument("kvstore address '" + std::string(address) + "': port must be 1..65535");
  }
  return std::make_pair(host, p);
}

Result<std::unique_ptr<Client>> Client::Connect(const std::string& host, int port, const ClientOptions& options) {
  std::unique_ptr<Client> c(new Client(host, port, options));
  KEEL_RETURN_IF_ERROR(c->EnsureConnected());
  return c;
}

Client::~Client() { Disconnect(); }

void Client::Disconnect() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

Status Client::EnsureConnected() {
  if (fd_ >= 0) return Status::Ok();
  KEEL_ASSIGN_OR_RETURN(fd_, ConnectTcp(host_, port_, options_.connect_timeout_ms));
  return Status::Ok();
}

Status Client::Send(Op op, std::string_view key_section, uint32_t count, const iovec* value, int value_pieces,
                    uint64_t aux, uint32_t flags, Deadline deadline) {
  size_t value_size = 0;
  Hasher64 checksum;
  for (int i = 0; i < value_pieces; ++i) {
    value_size += value[i].iov_len;
    checksum.update(value[i].iov_base, value[i].iov_len);
  }
  if (value_size > options_.limits.max_value_bytes) {
    return Status::ResourceExhausted("kvstore: value of " + std::to_string(value_size) + " bytes exceeds the limit of " +
                                     std::to_string(options_.limits.max_value_bytes));
  }
  FrameHeader h;
  h.op = op;
  h.flags = flags;
  h.count = count;
  h.key_bytes = static_cast<uint32_t>(key_section.size());
  h.value_bytes = static_cast<uint32_t>(value_size);
  h.request_id = next_id_++;
  h.aux = aux;
  h.value_checksum = checksum.digest();
  uint8_t header[kHeaderBytes];
  EncodeHeader(h, key_section, header);
  std::vector<iovec> iov;
  iov.reserve(2 + static_cast<size_t>(value_pieces));
  iov.push_back({header, kHeaderBytes});
  iov.push_back({const_cast<char*>(key_section.data()), key_section.size()});
  for (int i = 0; i < value_pieces; ++i) iov.push_back(value[i]);
  Status s = WriteFullV(fd_, iov.data(), static_cast<int>(iov.size()), deadline);
  if (!s.ok()) return Fail(s);
  return Status::Ok();
}

Status Client::Fail(const Status& s) {
  Disconnect();
  return Status(s.code(), "kvstore " + host_ + ":" + std::to_string(port_) + ": " + s.message());
}

Result<Client::Reply> Client::Receive(Op expected, Deadline deadline, std::vector<BlobPtr>* mget_items) {
  uint8_t header[kHeaderBytes];
  Status s = ReadFull(fd_, header, kHeaderBytes, deadline);
  if (!s.ok()) return Fail(s);
  Result<FrameHeader> h = DecodeHeader(header, options_.limits);
  if (!h.ok()) return Fail(Status::Corruption(h.status().message()));
  std::string keys(h->key_bytes, '\0');
  s = ReadFull(fd_, keys.data(), keys.size(), deadline);
  if (!s.ok()) return Fail(s);
  s = CheckHeaderChecksum(header, keys, h->header_checksum);
  if (!s.ok()) return Fail(s);
  Reply r;
  r.h = *h;
  // An MGET reply's checksum covers its item table; each item is read straight into its own
  // Blob and checked against the table.
  const bool items = mget_items != nullptr && h->op == Op::kMget && h->status == 0;
  const size_t covered = items ? static_cast<size_t>(h->count) * kMgetItemBytes : h->value_bytes;
  if (covered > h->value_bytes) return Fail(Status::Corruption("MGET reply shorter than its table"));
  r.value = Blob::Allocate(covered);
  s = ReadFull(fd_, r.value->data(), covered, deadline);
  if (!s.ok()) return Fail(s);
  if (Xxh3_64(r.value->data(), covered) != h->value_checksum) {
    return Fail(Status::Corruption("reply value checksum mismatch"));
  }
  r.value->set_checksum(h->value_checksum);
  if (h->op == Op::kError) {
    // The server closes after an ERROR frame.
    return Fail(Status(StatusFromWire(h->status), std::string(r.value->view())));
  }
  if (h->op != expected) {
    return Fail(Status::Corruption(std::string("reply op ") + OpName(h->op) + " does not answer " + OpName(expected)));
  }
  if (h->status != 0) return Status(StatusFromWire(h->status), std::string(r.value->view()));
  if (items) {
    uint64_t left = h->value_bytes - covered;
    mget_items->assign(h->count, nullptr);
    for (uint32_t i = 0; i < h->count; ++i) {
      MgetItem item = DecodeMgetItem(r.value->data() + static_cast<size_t>(i) * kMgetItemBytes);
      if (item.status != 0) continue;
      if (item.length > left) return Fail(Status::Corruption("MGET item " + std::to_string(i) + " runs past the reply"));
      std::shared_ptr<Blob> b = Blob::Allocate(item.length);
      s = ReadFull(fd_, b->data(), item.length, deadline);
      if (!s.ok()) return Fail(s);
      if (Xxh3_64(b->data(), b->size()) != item.checksum) {
        return Fail(Status::Corruption("MGET item " + std::to_string(i) + " fails its checksum"));
      }
      b->set_checksum(item.checksum);
      (*mget_items)[i] = std::move(b);
      left -= item.length;
    }
    if (left != 0) return Fail(Status::Corruption("MGET reply has trailing bytes"));
  }
  return r;
}

Result<Client::Reply> Client::Call(Op op, std::string_view key_section, uint32_t count, const iovec* value,
                                   int value_pieces, uint64_t aux, uint32_t flags) {
  KEEL_RETURN_IF_ERROR(EnsureConnected());
  const Deadline deadline = DeadlineIn(options_.timeout_ms);
  KEEL_RETURN_IF_ERROR(Send(op, key_section, count, value, value_pieces, aux, flags, deadline));
  return Receive(op, deadline);
}

Status Client::Put(std::string_view key, const void* data, size_t size, int64_t ttl_ms, bool persist) {
  KEEL_RETURN_IF_ERROR(ValidateKey(key));
  if (ttl_ms < 0) return Status::InvalidArgument("kvstore: negative TTL");
  iovec piece{const_cast<void*>(data), size};
  return Call(Op::kPut, key, 0, &piece, 1, static_cast<uint64_t>(ttl_ms), persist ? kPersist : 0).status();
}

Status Client::PutMany(const std::vector<PutItem>& items, int64_t ttl_ms) {
  for (const PutItem& it : items) KEEL_RETURN_IF_ERROR(ValidateKey(it.key));
  if (ttl_ms < 0) return Status::InvalidArgument("kvstore: negative TTL");
  KEEL_RETURN_IF_ERROR(EnsureConnected());
  const Deadline deadline = DeadlineIn(options_.timeout_ms);
  // Replies are tiny, so the server never blocks writing them while we are still sending: the
  // socket buffers absorb them. Bound the window anyway so a very long batch cannot deadlock.
  constexpr size_t kWindow = 64;
  Status first;
  size_t sent = 0, received = 0;
  while (received < items.size()) {
    while (sent < items.size() && sent - received < kWindow) {
      const PutItem& it = items[sent];
      KEEL_RETURN_IF_ERROR(Send(Op::kPut, it.key, 0, it.pieces.data(), static_cast<int>(it.pieces.size()),
                                static_cast<uint64_t>(ttl_ms), 0, deadline));
      ++sent;
    }
    Result<Reply> r = Receive(Op::kPut, deadline);
    if (!r.ok()) {
      if (!connected()) return r.status();
      if (first.ok()) first = r.status();
    }
    ++received;
  }
  return first;
}

Result<BlobPtr> Client::Get(std::string_view key) {
  KEEL_RETURN_IF_ERROR(ValidateKey(key));
  KEEL_ASSIGN_OR_RETURN(Reply r, Call(Op::kGet, key, 0));
  return BlobPtr(std::move(r.value));
}

Status Client::Delete(std::string_view key) {
  KEEL_RETURN_IF_ERROR(ValidateKey(key));
  return Call(Op::kDel, key, 0).status();
}

Result<std::vector<bool>> Client::Exists(const std::vector<std::string_view>& keys) {
  KEEL_RETURN_IF_ERROR(CheckKeys(keys));
  KEEL_ASSIGN_OR_RETURN(Reply r, Call(Op::kExists, KeyList(keys), static_cast<uint32_t>(keys.size())));
  if (r.value->size() != keys.size()) {
    Disconnect();
    return Status::Corruption("kvstore: EXISTS reply has " + std::to_string(r.value->size()) + " entries for " +
                              std::to_string(keys.size()) + " keys");
  }
  std::vector<bool> out(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) out[i] = r.value->data()[i] != 0;
  return out;
}

Result<int> Client::LongestPrefix(const std::vector<std::string_view>& keys) {
  KEEL_RETURN_IF_ERROR(CheckKeys(keys));
  if (keys.empty()) return 0;
  KEEL_ASSIGN_OR_RETURN(Reply r, Call(Op::kPrefix, KeyList(keys), static_cast<uint32_t>(keys.size())));
  if (r.h.aux > keys.size()) {
    Disconnect();
    return Status::Corruption("kvstore: PREFIX reply claims more keys than asked");
  }
  return static_cast<int>(r.h.aux);
}

Result<std::vector<BlobPtr>> Client::GetMany(const std::vector<std::string_view>& keys) {
  KEEL_RETURN_IF_ERROR(CheckKeys(keys));
  if (keys.empty()) return std::vector<BlobPtr>{};
  KEEL_RETURN_IF_ERROR(EnsureConnected());
  const Deadline deadline = DeadlineIn(options_.timeout_ms);
  const std::string section = KeyList(keys);
  KEEL_RETURN_IF_ERROR(Send(Op::kMget, section, static_cast<uint32_t>(keys.size()), nullptr, 0, 0, 0, deadline));
  std::vector<BlobPtr> out;
  KEEL_ASSIGN_OR_RETURN(Reply r, Receive(Op::kMget, deadline, &out));
  if (r.h.count != keys.size()) {
    Disconnect();
    return Status::Corruption("kvstore: MGET reply has " + std::to_string(r.h.count) + " items for " +
                              std::to_string(keys.size()) + " keys");
  }
  return out;
}

Result<std::string> Client::Stats() {
  KEEL_ASSIGN_OR_RETURN(Reply r, Call(Op::kStats, {}, 0));
  return std::string(r.value->view());
}

Status Client::Ping() { return Call(Op::kPing, {}, 0).status(); }

}  // namespace keel::kvstore
