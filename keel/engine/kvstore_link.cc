#include "keel/engine/kvstore_link.h"

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>
#include <sys/uio.h>

#include <chrono>
#include <cstring>

#include "keel/core/log.h"

namespace keel::engine {
namespace {

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string_view KeyBytes(const Hash128& key) {
  return {reinterpret_cast<const char*>(&key), sizeof(Hash128)};  // lo then hi, little-endian
}

}  // namespace

Hash128 ChunkTag(const Hash128& key, const std::vector<std::pair<const uint8_t*, size_t>>& pieces,
                 std::string_view tag_key) {
  if (tag_key.empty()) {
    Hasher128 h;
    h.update(KeyBytes(key));
    for (const auto& [data, size] : pieces) h.update(data, size);
    return h.digest();
  }
  // HMAC-SHA256 through OpenSSL 3's EVP_MAC, fetched once (a provider lookup per chunk would
  // only repeat it); a failure (no HMAC in the provider) gives an all-zero tag, which no value
  // carries by chance, so every value is refused, not accepted.
  static EVP_MAC* const hmac = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
  Hash128 tag;
  unsigned char mac[EVP_MAX_MD_SIZE];
  size_t mac_len = 0;
  EVP_MAC_CTX* ctx = hmac != nullptr ? EVP_MAC_CTX_new(hmac) : nullptr;
  char digest[] = "SHA256";
  const OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string("digest", digest, 0), OSSL_PARAM_construct_end()};
  bool ok = ctx != nullptr &&
            EVP_MAC_init(ctx, reinterpret_cast<const unsigned char*>(tag_key.data()), tag_key.size(), params) == 1 &&
            EVP_MAC_update(ctx, reinterpret_cast<const unsigned char*>(&key), sizeof(key)) == 1;
  for (const auto& [data, size] : pieces) ok = ok && EVP_MAC_update(ctx, data, size) == 1;
  ok = ok && EVP_MAC_final(ctx, mac, &mac_len, sizeof(mac)) == 1 && mac_len >= sizeof(tag);
  if (ok) std::memcpy(&tag, mac, sizeof(tag));
  EVP_MAC_CTX_free(ctx);
  return tag;
}

std::optional<std::string_view> CheckChunkTag(const Hash128& key, std::string_view value, std::string_view tag_key) {
  if (value.size() <= kChunkTagBytes) return std::nullopt;
  const std::string_view blocks = value.substr(0, value.size() - kChunkTagBytes);
  const Hash128 tag = ChunkTag(key, {{reinterpret_cast<const uint8_t*>(blocks.data()), blocks.size()}}, tag_key);
  if (tag == Hash128{}) return std::nullopt;
  if (CRYPTO_memcmp(&tag, value.data() + blocks.size(), kChunkTagBytes) != 0) return std::nullopt;
  return blocks;
}

Result<std::unique_ptr<KvStoreLink>> KvStoreLink::Create(const KvStoreLinkOptions& options, const KvCache& cache) {
  KEEL_ASSIGN_OR_RETURN(auto host_port, kvstore::ParseHostPort(options.address));
  std::unique_ptr<KvStoreLink> link(new KvStoreLink(options, cache));
  link->host_ = host_port.first;
  link->port_ = host_port.second;
  if (link->options_.max_pinned_blocks <= 0) {
    link->options_.max_pinned_blocks = static_cast<int>(std::max<int64_t>(1, cache.TotalBlocks() / 4));
  }
  KvStoreLink* self = link.get();
  link->publisher_ = std::thread([self] { self->PublishLoop(); });
  return link;
}

KvStoreLink::~KvStoreLink() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (publisher_.joinable()) publisher_.join();
}

bool KvStoreLink::Healthy() const { return NowNs() >= retry_at_ns_.load(std::memory_order_relaxed); }

void KvStoreLink::MarkFailed() {
  failures_.fetch_add(1, std::memory_order_relaxed);
  retry_at_ns_.store(NowNs() + static_cast<int64_t>(options_.retry_after_ms) * 1000000, std::memory_order_relaxed);
}

std::shared_ptr<const FetchedPrefix> KvStoreLink::Fetch(const std::vector<int>& prompt) {
  auto out = std::make_shared<FetchedPrefix>();
  const int bt = cache_.block_tokens();
  // As KvCache::BeginSequence: the last prompt token is always computed.
  const int shareable = prompt.empty() ? 0 : static_cast<int>(prompt.size() - 1) / bt;
  if (shareable == 0 || !Healthy()) return out;
  std::vector<Hash128> keys = cache_.ChunkKeys(prompt.data(), shareable * bt);
  int first = 0;
  while (first < shareable && cache_.HasChunk(keys[first])) ++first;
  out->first_chunk = first;
  if (first == shareable) return out;
  lookups_.fetch_add(1, std::memory_order_relaxed);

  std::unique_ptr<kvstore::Client> client;
  {
    std::lock_guard<std::mutex> lock(pool_mu_);
    if (!pool_.empty()) {
      client = std::move(pool_.back());
      pool_.pop_back();
    }
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(options_.lookup_timeout_ms);
  auto left_ms = [&] {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    return static_cast<int>(std::max<int64_t>(1, left.count()));
  };
  Status st;
  if (!client) {
    kvstore::ClientOptions co;
    co.connect_timeout_ms = options_.lookup_timeout_ms;
    Result<std::unique_ptr<kvstore::Client>> c = kvstore::Client::Connect(host_, port_, co);
    if (c.ok()) client = std::move(*c);
    else st = c.status();
  }
  if (client) {
    std::vector<std::string_view> key_views;
    key_views.reserve(keys.size() - first);
    for (int i = first; i < shareable; ++i) key_views.push_back(KeyBytes(keys[i]));
    client->set_timeout_ms(left_ms());
    Result<int> n = client->LongestPrefix(key_views);
    if (n.ok() && *n > 0) {
      key_views.resize(*n);
      client->set_timeout_ms(left_ms());
      Result<std::vector<kvstore::BlobPtr>> values = client->GetMany(key_views);
      if (values.ok()) {
        // Keep the leading run that arrived whole, is not oversized and belongs to its key
        // (AdoptChunks validates each block fully); an entry evicted between PREFIX and MGET
        // ends the run.
        for (size_t i = 0; i < values->size(); ++i) {
          kvstore::BlobPtr& v = (*values)[i];
          if (v == nullptr) break;
          if (v->size() <= kChunkTagBytes || v->size() > cache_.ChunkValueBytes() + kChunkTagBytes) {
            rejected_chunks_.fetch_add(1, std::memory_order_relaxed);
            Log().warn("kvstore: a fetched chunk of {} bytes is refused (a stored chunk is {}..{} bytes); the prompt "
                       "is computed from there", v->size(), kChunkTagBytes + 1, cache_.ChunkValueBytes() + kChunkTagBytes);
            break;
          }
          std::optional<std::string_view> blocks = CheckChunkTag(keys[first + i], v->view(), options_.tag_key);
          if (!blocks) {
            rejected_chunks_.fetch_add(1, std::memory_order_relaxed);
            Log().warn("kvstore: the fetched value of chunk {} ({} bytes) does not carry its key's tag (another key's "
                       "value, or damaged); the prompt is computed from there", first + static_cast<int>(i), v->size());
            break;
          }
          fetched_bytes_.fetch_add(static_cast<int64_t>(v->size()), std::memory_order_relaxed);
          out->chunks.push_back(*blocks);
          out->values.push_back(std::move(v));
        }
        fetched_chunks_.fetch_add(static_cast<int64_t>(out->values.size()), std::memory_order_relaxed);
      } else {
        st = values.status();
      }
    } else if (!n.ok()) {
      st = n.status();
    }
  }
  if (!st.ok()) {
    MarkFailed();
    Log().warn("kvstore link: lookup failed, computing the prompt instead: {}", st.ToString());
    out->values.clear();
    out->chunks.clear();
  }
  if (client && client->connected()) {
    std::lock_guard<std::mutex> lock(pool_mu_);
    pool_.push_back(std::move(client));
  }
  return out;
}

void KvStoreLink::Publish(KvCache& cache, SeqId seq, int first_chunk, int last_chunk) {
  if (last_chunk <= first_chunk) return;
  if (!Healthy() || pinned_ + (last_chunk - first_chunk) > options_.max_pinned_blocks) {
    dropped_jobs_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  Job job;
  job.chunks = cache.PinChunks(seq, first_chunk, last_chunk);
  if (job.chunks.empty()) return;
  pinned_ += static_cast<int>(job.chunks.size());
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back(std::move(job));
  }
  cv_.notify_one();
}

void KvStoreLink::ReleaseFinished(KvCache& cache) {
  std::vector<int32_t> done;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (finished_.empty()) return;
    done.swap(finished_);
  }
  for (int32_t b : done) cache.Unpin(b);
  pinned_ -= static_cast<int>(done.size());
}

void KvStoreLink::Flush() {
  std::unique_lock<std::mutex> lock(mu_);
  idle_cv_.wait(lock, [&] { return jobs_.empty() && !busy_; });
}

Status KvStoreLink::PublishJob(kvstore::Client& client, const Job& job) {
  std::vector<std::string_view> keys;
  keys.reserve(job.chunks.size());
  for (const auto& [key, block] : job.chunks) keys.push_back(KeyBytes(key));
  KEEL_ASSIGN_OR_RETURN(std::vector<bool> present, client.Exists(keys));
  std::vector<kvstore::Client::PutItem> items;
  std::vector<Hash128> tags;
  tags.reserve(job.chunks.size());  // the items point into it: no reallocation
  int64_t bytes = 0;
  for (size_t i = 0; i < job.chunks.size(); ++i) {
    if (present[i]) {
      skipped_existing_.fetch_add(1, std::memory_order_relaxed);
      continue;
    }
    kvstore::Client::PutItem item;
    item.key = keys[i];
    const std::vector<std::pair<const uint8_t*, size_t>> pieces = cache_.ChunkPieces(job.chunks[i].second);
    for (const auto& [data, size] : pieces) {
      item.pieces.push_back({const_cast<uint8_t*>(data), size});
      bytes += static_cast<int64_t>(size);
    }
    tags.push_back(ChunkTag(job.chunks[i].first, pieces, options_.tag_key));
    item.pieces.push_back({&tags.back(), kChunkTagBytes});
    bytes += static_cast<int64_t>(kChunkTagBytes);
    items.push_back(std::move(item));
  }
  if (items.empty()) return Status::Ok();
  KEEL_RETURN_IF_ERROR(client.PutMany(items, options_.ttl_ms));
  published_chunks_.fetch_add(static_cast<int64_t>(items.size()), std::memory_order_relaxed);
  published_bytes_.fetch_add(bytes, std::memory_order_relaxed);
  return Status::Ok();
}

void KvStoreLink::PublishLoop() {
  std::unique_ptr<kvstore::Client> client;
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
    if (jobs_.empty()) return;
    Job job = std::move(jobs_.front());
    jobs_.pop_front();
    busy_ = true;
    lock.unlock();
    Status st;
    if (!Healthy()) {
      st = Status::Unavailable("store marked down");
      dropped_jobs_.fetch_add(1, std::memory_order_relaxed);
    } else {
      if (!client || !client->connected()) {
        kvstore::ClientOptions co;
        co.connect_timeout_ms = std::min(options_.publish_timeout_ms, 1000);
        co.timeout_ms = options_.publish_timeout_ms;
        Result<std::unique_ptr<kvstore::Client>> c = kvstore::Client::Connect(host_, port_, co);
        if (c.ok()) client = std::move(*c);
        else st = c.status();
      }
      if (st.ok()) st = PublishJob(*client, job);
      if (!st.ok()) {
        MarkFailed();
        Log().warn("kvstore link: publishing {} chunks failed: {}", job.chunks.size(), st.ToString());
      }
    }
    lock.lock();
    for (const auto& [key, block] : job.chunks) finished_.push_back(block);
    busy_ = false;
    idle_cv_.notify_all();
  }
}

KvStoreLinkStats KvStoreLink::Stats() const {
  KvStoreLinkStats s;
  s.lookups = lookups_.load();
  s.fetched_chunks = fetched_chunks_.load();
  s.fetched_bytes = fetched_bytes_.load();
  s.adopted_tokens = adopted_tokens_.load();
  s.rejected_chunks = rejected_chunks_.load();
  s.published_chunks = published_chunks_.load();
  s.published_bytes = published_bytes_.load();
  s.skipped_existing = skipped_existing_.load();
  s.dropped_jobs = dropped_jobs_.load();
  s.failures = failures_.load();
  return s;
}

void KvStoreLink::RegisterMetrics(MetricsRegistry& registry) {
  struct Field {
    const char* name;
    const char* help;
    const std::atomic<int64_t>* value;
  };
  const Field fields[] = {
      {"keel_kvstore_link_lookups_total", "Prompts looked up in the shared KV store.", &lookups_},
      {"keel_kvstore_link_fetched_chunks_total", "KV chunks fetched from the shared store.", &fetched_chunks_},
      {"keel_kvstore_link_fetched_bytes_total", "KV bytes fetched from the shared store.", &fetched_bytes_},
      {"keel_kvstore_link_hit_tokens_total", "Prompt tokens served from the shared store instead of computed.",
       &adopted_tokens_},
      {"keel_kvstore_link_published_chunks_total", "KV chunks sent to the shared store.", &published_chunks_},
      {"keel_kvstore_link_published_bytes_total", "KV bytes sent to the shared store.", &published_bytes_},
      {"keel_kvstore_link_skipped_existing_total", "Chunks not sent because the store had them.", &skipped_existing_},
      {"keel_kvstore_link_dropped_jobs_total", "Publish jobs dropped (too many pinned blocks or store down).",
       &dropped_jobs_},
      {"keel_kvstore_link_failures_total", "Lookups or publishes that failed (store down, timeout, bad reply).",
       &failures_},
      {"keel_kvstore_link_rejected_chunks_total",
       "Fetched KV chunks refused (wrong size, tag not of their key, or corrupt for the codec); their tokens were "
       "computed.",
       &rejected_chunks_},
  };
  for (const Field& f : fields) {
    const std::atomic<int64_t>* v = f.value;
    registry.AddCounter(f.name, f.help).Get().SetCallback([v] { return static_cast<double>(v->load()); });
  }
}

}  // namespace keel::engine
