// A fetched KV chunk is used only for the key it was stored under: KvStoreLink checks each
// value's tag (XXH3-128 of key and block bytes) against the key it asked for. Here a real
// `keel kvstore` service (in process, on loopback) holds values written by hand: correctly
// tagged ones, another key's value, an untagged value of the right size, a damaged one.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "keel/engine/kv_cache.h"
#include "keel/engine/kvstore_link.h"
#include "keel/engine/transformer.h"
#include "keel/kvstore/client.h"
#include "keel/kvstore/service.h"
#include "tests/engine/test_util.h"

namespace keel::engine {
namespace {

std::string_view KeyView(const Hash128& key) { return {reinterpret_cast<const char*>(&key), sizeof(key)}; }

class ChunkTagTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto m = LoadLlama2c(test::ModelsDir() + "/aidreams260K.bin");
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    model_ = std::make_unique<Model>(std::move(m).value());
    KvCacheOptions co;
    co.budget_bytes = 1 << 20;
    auto c = KvCache::Create(*model_, "raw", co);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    cache_ = std::move(c).value();

    kvstore::ServiceOptions so;
    so.store.dram_bytes = 16 << 20;
    so.server.port = 0;
    so.http_port = -1;
    auto svc = kvstore::Service::Start(so);
    ASSERT_TRUE(svc.ok()) << svc.status().ToString();
    service_ = std::move(svc).value();
    auto client = kvstore::Client::Connect("127.0.0.1", service_->port());
    ASSERT_TRUE(client.ok()) << client.status().ToString();
    client_ = std::move(client).value();

    KvStoreLinkOptions lo;
    lo.address = "127.0.0.1:" + std::to_string(service_->port());
    lo.lookup_timeout_ms = 5000;
    auto link = KvStoreLink::Create(lo, *cache_);
    ASSERT_TRUE(link.ok()) << link.status().ToString();
    link_ = std::move(link).value();

    // Three shareable chunks (the last prompt token is always computed).
    for (int i = 0; i < 3 * 16 + 1; ++i) prompt_.push_back(i == 0 ? 1 : 3 + (i * 37) % 500);
    keys_ = cache_->ChunkKeys(prompt_.data(), 3 * 16);
    ASSERT_EQ(keys_.size(), 3u);
  }

  // Block bytes of the size a raw chunk has, distinct per chunk.
  std::string Blocks(int chunk) const {
    std::string b(cache_->ChunkValueBytes(), '\0');
    for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<char>((i * 7 + chunk * 13) & 0x3f);
    return b;
  }
  static std::string Tagged(const Hash128& key, const std::string& blocks, const std::string& tag_key = "") {
    const Hash128 tag = ChunkTag(key, {{reinterpret_cast<const uint8_t*>(blocks.data()), blocks.size()}}, tag_key);
    return blocks + std::string(reinterpret_cast<const char*>(&tag), sizeof(tag));
  }
  void Put(int chunk, const std::string& value) {
    ASSERT_TRUE(client_->Put(KeyView(keys_[chunk]), value).ok());
  }

  std::unique_ptr<Model> model_;
  std::unique_ptr<KvCache> cache_;
  std::unique_ptr<kvstore::Service> service_;
  std::unique_ptr<kvstore::Client> client_;
  std::unique_ptr<KvStoreLink> link_;
  std::vector<int> prompt_;
  std::vector<Hash128> keys_;
};

TEST_F(ChunkTagTest, ValuesTaggedForTheirKeysAreFetchedWithoutTheTag) {
  for (int c = 0; c < 3; ++c) Put(c, Tagged(keys_[c], Blocks(c)));
  auto f = link_->Fetch(prompt_);
  ASSERT_EQ(f->chunks.size(), 3u);
  ASSERT_EQ(f->values.size(), 3u);
  for (int c = 0; c < 3; ++c) EXPECT_EQ(f->chunks[c], Blocks(c)) << "chunk " << c;
  EXPECT_EQ(link_->Stats().rejected_chunks, 0);
}

TEST_F(ChunkTagTest, AnotherKeysValueOfTheRightShapeIsRefusedAndEndsTheRun) {
  Put(0, Tagged(keys_[0], Blocks(0)));
  Put(1, Tagged(keys_[2], Blocks(2)));  // chunk 2's value, stored under chunk 1's key
  Put(2, Tagged(keys_[2], Blocks(2)));
  auto f = link_->Fetch(prompt_);
  ASSERT_EQ(f->chunks.size(), 1u) << "only the run before the mixed-up value is used";
  EXPECT_EQ(f->chunks[0], Blocks(0));
  EXPECT_EQ(link_->Stats().rejected_chunks, 1);
  // The cache would have taken it: same size, finite raw elements. The tag is what refuses it.
  ASSERT_EQ(Blocks(2).size(), cache_->ChunkValueBytes());
}

TEST_F(ChunkTagTest, UntaggedDamagedOrTruncatedValuesAreRefused) {
  Put(0, Blocks(0));  // the format before tags: right size for the cache, no tag
  EXPECT_TRUE(link_->Fetch(prompt_)->chunks.empty());
  EXPECT_EQ(link_->Stats().rejected_chunks, 1);

  std::string damaged = Tagged(keys_[0], Blocks(0));
  damaged[100] ^= 0x01;  // one bit of the blocks
  Put(0, damaged);
  EXPECT_TRUE(link_->Fetch(prompt_)->chunks.empty());
  EXPECT_EQ(link_->Stats().rejected_chunks, 2);

  std::string bad_tag = Tagged(keys_[0], Blocks(0));
  bad_tag.back() ^= 0x80;  // one bit of the tag
  Put(0, bad_tag);
  EXPECT_TRUE(link_->Fetch(prompt_)->chunks.empty());
  EXPECT_EQ(link_->Stats().rejected_chunks, 3);

  Put(0, std::string(kChunkTagBytes, '\0'));  // a tag and no blocks
  EXPECT_TRUE(link_->Fetch(prompt_)->chunks.empty());
  EXPECT_EQ(link_->Stats().rejected_chunks, 4);

  Put(0, Tagged(keys_[0], Blocks(0) + "x"));  // one byte more than a chunk can hold
  EXPECT_TRUE(link_->Fetch(prompt_)->chunks.empty());
  EXPECT_EQ(link_->Stats().rejected_chunks, 5);

  Put(0, Tagged(keys_[0], Blocks(0)));  // and a good value is used again
  auto f = link_->Fetch(prompt_);
  ASSERT_EQ(f->chunks.size(), 1u);
  EXPECT_EQ(f->chunks[0], Blocks(0));
  EXPECT_EQ(link_->Stats().rejected_chunks, 5);
}

// With a tag key (--kvstore-key-file), only values tagged under that key are used: an unkeyed
// tag, or one made with another key, is what a writer without the key can produce.
TEST_F(ChunkTagTest, AKeyedLinkUsesOnlyValuesTaggedWithItsKey) {
  const std::string secret = "0123456789abcdef-tag-key", other = "0123456789abcdef-another";
  KvStoreLinkOptions lo;
  lo.address = "127.0.0.1:" + std::to_string(service_->port());
  lo.lookup_timeout_ms = 5000;
  lo.tag_key = secret;
  auto keyed = KvStoreLink::Create(lo, *cache_);
  ASSERT_TRUE(keyed.ok()) << keyed.status().ToString();
  auto tagged = [&](int c, const std::string& k) { return Tagged(keys_[c], Blocks(c), k); };
  Put(0, tagged(0, secret));
  Put(1, tagged(1, ""));     // unkeyed: anyone can compute it
  Put(2, tagged(2, other));  // keyed, with another key
  auto f = (*keyed)->Fetch(prompt_);
  ASSERT_EQ(f->chunks.size(), 1u);
  EXPECT_EQ(f->chunks[0], Blocks(0));
  EXPECT_EQ((*keyed)->Stats().rejected_chunks, 1);
  Put(1, tagged(1, secret));
  EXPECT_EQ((*keyed)->Fetch(prompt_)->chunks.size(), 2u) << "chunk 2 is still another key's";
  Put(2, tagged(2, secret));
  EXPECT_EQ((*keyed)->Fetch(prompt_)->chunks.size(), 3u);
  // The unkeyed link refuses keyed values in turn, and the two tags differ.
  EXPECT_TRUE(link_->Fetch(prompt_)->chunks.empty());
  EXPECT_NE(tagged(0, secret), tagged(0, "")) << "the key changes the tag";
  EXPECT_NE(tagged(0, secret), tagged(0, other));
}

TEST_F(ChunkTagTest, CheckChunkTagNeedsTheKeyItWasMadeFor) {
  const std::string v = Tagged(keys_[1], Blocks(1));
  auto ok = CheckChunkTag(keys_[1], v);
  ASSERT_TRUE(ok.has_value());
  EXPECT_EQ(*ok, Blocks(1));
  EXPECT_FALSE(CheckChunkTag(keys_[0], v).has_value());
  EXPECT_FALSE(CheckChunkTag(keys_[1], std::string_view(v).substr(0, kChunkTagBytes)).has_value());
  EXPECT_FALSE(CheckChunkTag(keys_[1], "").has_value());
}

}  // namespace
}  // namespace keel::engine
