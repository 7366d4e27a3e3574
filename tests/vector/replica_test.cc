// A vector shard as a cluster replica (issue 21): the index version (writes applied) and its
// persistence, versioned writes (duplicates, gaps), the replication log (GET/POST /v1/log),
// signed search answers, the test adversary, the HNSW seed and `keel vector keygen`. In-process
// Services on port 0 over real HTTP, real files.
#include <faiss/IndexHNSW.h>
#include <faiss/impl/io.h>
#include <faiss/index_io.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "keel/core/hash.h"
#include "keel/vector/index.h"
#include "keel/vector/records.h"
#include "keel/vector/service.h"
#include "keel/vector/trust/signed_reply.h"
#include "keel/vector/wal.h"
#include "keel/vector/wire.h"
#include "tests/core/http_test_client.h"
#include "tests/engine/test_util.h"

namespace keel::vector {
namespace {

using json = nlohmann::json;
using test::HttpTestClient;
using test::HttpTestResponse;
using test::TempDir;

constexpr int kDim = 8;

std::vector<float> TextOf(uint64_t id) {
  std::vector<float> v(kDim);
  for (int d = 0; d < kDim; ++d) v[d] = static_cast<float>((id * 31 + d * 7) % 97) / 4.0f;
  return v;
}

json ItemJson(uint64_t id) {
  json image = json::array();
  for (int d = 0; d < kDim; ++d) image.push_back(static_cast<double>((id * 17 + d * 3) % 89) / 8.0);
  return {{"id", id}, {"text", TextOf(id)}, {"image", image}};
}

json Items(uint64_t begin, uint64_t end) {
  json items = json::array();
  for (uint64_t i = begin; i < end; ++i) items.push_back(ItemJson(i));
  return {{"items", items}};
}

ServiceOptions Options(const std::string& dir) {
  ServiceOptions o;
  o.shard.dir = dir;
  o.shard.text_dim = kDim;
  o.shard.image_dim = kDim;
  o.shard.max_k = 100;
  o.shard.index.hnsw_ef_search = 256;  // small shards: the graph walk sees every item (exact answers)
  o.port = 0;
  return o;
}

std::unique_ptr<Service> Start(const ServiceOptions& o) {
  auto s = Service::Start(o);
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return s.ok() ? std::move(*s) : nullptr;
}

HttpTestResponse Post(Service& s, const std::string& path, const std::string& body) {
  HttpTestClient http(s.port());
  return http.Request("POST", path, body);
}
HttpTestResponse Get(Service& s, const std::string& path) {
  HttpTestClient http(s.port());
  return http.Request("GET", path);
}
json Json(const HttpTestResponse& r) { return json::parse(r.body, nullptr, false); }

uint64_t StatsVersion(Service& s) { return Json(Get(s, "/v1/stats"))["index_version"].get<uint64_t>(); }

// The records of a replication stream, decoded.
struct StreamRecord {
  uint64_t version;
  DecodedRecord record;
};
std::vector<StreamRecord> Records(std::string_view stream) {
  std::vector<StreamRecord> out;
  size_t at = 0;
  while (!stream.empty()) {
    uint64_t v = 0;
    std::string_view payload;
    const size_t before = stream.size();
    Status s = NextLogRecord(&stream, at, &v, &payload);
    EXPECT_TRUE(s.ok()) << s.ToString();
    if (!s.ok()) break;
    at += before - stream.size();
    auto rec = DecodeRecord(payload);
    EXPECT_TRUE(rec.ok()) << rec.status().ToString();
    out.push_back({v, rec.ok() ? std::move(*rec) : DecodedRecord{}});
  }
  return out;
}

json Query(uint64_t id, int k) { return {{"kind", "text"}, {"text", TextOf(id)}, {"k", k}}; }

// --- index version ---------------------------------------------------------------------------

TEST(ReplicaVersionTest, EveryAcceptedWriteIsOneVersionAndRejectedOnesNone) {
  TempDir dir("keel-replica");
  auto s = Start(Options(dir.path()));
  ASSERT_TRUE(s);
  EXPECT_EQ(StatsVersion(*s), 0u);
  auto r = Post(*s, "/v1/upsert", Items(0, 10).dump());
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(Json(r)["version"], 1);
  EXPECT_EQ(Json(r)["upserted"], 10);
  r = Post(*s, "/v1/delete", R"({"ids":[3, 999]})");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(Json(r)["version"], 2);
  r = Post(*s, "/v1/upsert", R"({"items":[]})");  // an empty write is a write
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(Json(r)["version"], 3);
  // Refused writes consume nothing, and still say where the replica is.
  r = Post(*s, "/v1/upsert", R"({"items":[{"id":1,"text":[1,2]}]})");
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(Json(r)["version"], 3);
  r = Post(*s, "/v1/upsert", R"({"items":[], "version":"4"})");
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(Json(r)["error"]["message"].get<std::string>().find("version"), std::string::npos);
  r = Post(*s, "/v1/delete", R"({"ids":[1], "version":-4})");
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(StatsVersion(*s), 3u);
  EXPECT_EQ(s->shard().version(), 3u);
  // Searches say which version they read.
  r = Post(*s, "/v1/search", Query(5, 3).dump());
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(Json(r)["index_version"], 3);
  EXPECT_NE(s->metrics().Render().find("keel_vector_index_version 3"), std::string::npos);
}

TEST(ReplicaVersionTest, VersionSurvivesRestartsByLogReplayAndBySnapshot) {
  TempDir dir("keel-replica");
  ServiceOptions o = Options(dir.path());
  o.snapshot_on_stop = false;
  {
    auto s = Start(o);
    ASSERT_TRUE(s);
    for (uint64_t b = 0; b < 50; b += 10) ASSERT_EQ(Post(*s, "/v1/upsert", Items(b, b + 10).dump()).status, 200);
    ASSERT_EQ(Post(*s, "/v1/delete", R"({"ids":[1,2]})").status, 200);
  }
  {
    auto s = Start(o);  // log replay only
    ASSERT_TRUE(s);
    EXPECT_EQ(StatsVersion(*s), 6u);
    ASSERT_EQ(Post(*s, "/v1/snapshot", "").status, 200);
    json st = Json(Get(*s, "/v1/stats"));
    EXPECT_EQ(st["log_start_version"], 6);
    EXPECT_EQ(st["wal_bytes"], Wal::kHeaderBytes);  // the epoch marker
    ASSERT_EQ(Post(*s, "/v1/upsert", Items(50, 60).dump()).status, 200);
  }
  {
    auto s = Start(o);  // snapshot (6) + one replayed record
    ASSERT_TRUE(s);
    json st = Json(Get(*s, "/v1/stats"));
    EXPECT_EQ(st["index_version"], 7);
    EXPECT_EQ(st["log_start_version"], 6);
    EXPECT_EQ(st["items"], 58);
  }
}

// A crash after the snapshot replaced the old one but before the log was emptied leaves records
// the snapshot already holds; a restart must not count them twice.
TEST(ReplicaVersionTest, LogRecordsTheSnapshotHoldsAreNotCountedTwice) {
  TempDir dir("keel-replica");
  ShardOptions o = Options(dir.path()).shard;
  const std::string wal = dir.file("wal.log"), kept = dir.file("wal.before-snapshot");
  {
    auto shard = Shard::Open(o);
    ASSERT_TRUE(shard.ok());
    std::vector<Item> items(3);
    for (int i = 0; i < 3; ++i) items[i] = Item{static_cast<uint64_t>(i), TextOf(i), {}, {}};
    for (int i = 0; i < 3; ++i) ASSERT_TRUE((*shard)->Upsert(std::span(&items[i], 1)).ok());
    std::filesystem::copy_file(wal, kept);
    ASSERT_TRUE((*shard)->Snapshot().ok());
    EXPECT_EQ((*shard)->version(), 3u);
  }
  std::filesystem::copy_file(kept, wal, std::filesystem::copy_options::overwrite_existing);  // the "crash"
  auto shard = Shard::Open(o);
  ASSERT_TRUE(shard.ok()) << shard.status().ToString();
  EXPECT_EQ((*shard)->version(), 3u);
  EXPECT_EQ((*shard)->Stats().items, 3);
  Item more{7, TextOf(7), {}, {}};
  ASSERT_TRUE((*shard)->Upsert(std::span(&more, 1)).ok());
  shard->reset();
  shard = Shard::Open(o);  // stale records first, then current ones
  ASSERT_TRUE(shard.ok()) << shard.status().ToString();
  EXPECT_EQ((*shard)->version(), 4u);
  EXPECT_EQ((*shard)->Stats().items, 4);
}

// Rewrites a format-2 snapshot as format 1 (the 72-byte header of Keel before issue 21).
void DowngradeSnapshot(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_GE(all.size(), 88u);
  uint32_t version = 0;
  std::memcpy(&version, all.data() + 8, 4);
  ASSERT_EQ(version, 2u);
  version = 1;
  std::string head = all.substr(0, 8 + 56);
  std::memcpy(head.data() + 8, &version, 4);
  const uint64_t self = Xxh3_64(head.data(), head.size());
  head.append(reinterpret_cast<const char*>(&self), 8);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << head << all.substr(88);
}

TEST(ReplicaVersionTest, AnOldFormatSnapshotLoadsAsVersionZeroPlusItsLog) {
  TempDir dir("keel-replica");
  ShardOptions o = Options(dir.path()).shard;
  std::vector<Item> items(20);
  for (int i = 0; i < 20; ++i) items[i] = Item{static_cast<uint64_t>(i), TextOf(i), {}, {}};
  {
    auto shard = Shard::Open(o);
    ASSERT_TRUE(shard.ok());
    ASSERT_TRUE((*shard)->Upsert(std::span(items).subspan(0, 10)).ok());
    ASSERT_TRUE((*shard)->Upsert(std::span(items).subspan(10, 5)).ok());
    ASSERT_TRUE((*shard)->Snapshot().ok());
  }
  DowngradeSnapshot(dir.file("shard.snap"));
  {
    // A log as old Keel wrote it: epoch tag 0.
    std::filesystem::remove(dir.file("wal.log"));
    auto wal = Wal::Open(dir.file("wal.log"), true, [](std::string_view) { return Status::Ok(); });
    ASSERT_TRUE(wal.ok());
    ASSERT_TRUE((*wal)->Append(EncodeUpsert(std::span(items).subspan(15, 5))).ok());
    const uint64_t gone = 0;
    ASSERT_TRUE((*wal)->Append(EncodeDelete(std::span(&gone, 1))).ok());
  }
  auto shard = Shard::Open(o);
  ASSERT_TRUE(shard.ok()) << shard.status().ToString();
  EXPECT_EQ((*shard)->version(), 2u);
  EXPECT_EQ((*shard)->Stats().items, 19);
  // Snapshotting it again writes the new format, which keeps the version.
  ASSERT_TRUE((*shard)->Snapshot().ok());
  shard->reset();
  shard = Shard::Open(o);
  ASSERT_TRUE(shard.ok());
  EXPECT_EQ((*shard)->version(), 2u);
}

// --- versioned writes ------------------------------------------------------------------------

TEST(ReplicaWriteTest, NextVersionAppliesOlderIsADuplicateLaterIsAGap) {
  TempDir dir("keel-replica");
  auto s = Start(Options(dir.path()));
  ASSERT_TRUE(s);
  json w = Items(0, 5);
  w["version"] = 1;
  auto r = Post(*s, "/v1/upsert", w.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(Json(r), (json{{"upserted", 5}, {"version", 1}}));
  // The same write again (a router's retry): acknowledged, nothing re-applied.
  w["items"] = Items(100, 101)["items"];
  r = Post(*s, "/v1/upsert", w.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(Json(r), (json{{"version", 1}, {"duplicate", true}}));
  EXPECT_EQ(s->shard().Stats().items, 5);
  // A gap: this replica missed version 2.
  w["version"] = 3;
  r = Post(*s, "/v1/upsert", w.dump());
  ASSERT_EQ(r.status, 409) << r.body;
  EXPECT_EQ(Json(r)["version"], 1);
  EXPECT_EQ(Json(r)["error"]["code"], 409);
  EXPECT_EQ(Json(r)["error"]["message"], "stale: replica at version 1, write is version 3");
  r = Post(*s, "/v1/delete", R"({"ids":[0], "version":7})");
  EXPECT_EQ(r.status, 409) << r.body;
  EXPECT_EQ(s->shard().Stats().items, 5);
  // Deletes follow the same rule.
  r = Post(*s, "/v1/delete", R"({"ids":[0], "version":2})");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(Json(r), (json{{"deleted", 1}, {"version", 2}}));
  r = Post(*s, "/v1/delete", R"({"ids":[1], "version":2})");
  EXPECT_EQ(Json(r), (json{{"version", 2}, {"duplicate", true}}));
  r = Post(*s, "/v1/delete", R"({"ids":[1], "version":0})");
  EXPECT_EQ(Json(r)["duplicate"], true);
  EXPECT_EQ(s->shard().Stats().items, 4);
  // Unversioned writes (a standalone shard) take the next version.
  r = Post(*s, "/v1/upsert", Items(5, 6).dump());
  EXPECT_EQ(Json(r)["version"], 3);
  EXPECT_EQ(StatsVersion(*s), 3u);
}

// --- replication log -------------------------------------------------------------------------

// Six writes: versions 1..6 (upserts of 0..49 in fives, deletes between).
void SixWrites(Service& s) {
  ASSERT_EQ(Post(s, "/v1/upsert", Items(0, 20).dump()).status, 200);
  ASSERT_EQ(Post(s, "/v1/upsert", Items(20, 30).dump()).status, 200);
  ASSERT_EQ(Post(s, "/v1/delete", R"({"ids":[4, 5]})").status, 200);
  ASSERT_EQ(Post(s, "/v1/upsert", Items(30, 45).dump()).status, 200);
  ASSERT_EQ(Post(s, "/v1/delete", R"({"ids":[31]})").status, 200);
  ASSERT_EQ(Post(s, "/v1/upsert", Items(45, 50).dump()).status, 200);
}

std::vector<json> Answers(Service& s) {
  std::vector<json> out;
  for (uint64_t q : {0, 4, 17, 31, 44, 49}) {
    auto r = Post(s, "/v1/search", Query(q, 10).dump());
    EXPECT_EQ(r.status, 200) << r.body;
    out.push_back(Json(r)["hits"]);
  }
  return out;
}

TEST(ReplicaLogTest, GetAfterVReturnsExactlyTheLaterWrites) {
  TempDir dir("keel-replica");
  auto s = Start(Options(dir.path()));
  ASSERT_TRUE(s);
  SixWrites(*s);
  auto r = Get(*s, "/v1/log?after=3");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.Header("Content-Type"), "application/octet-stream");
  EXPECT_EQ(r.Header("X-Keel-Log-Version"), "6");
  auto recs = Records(r.body);
  ASSERT_EQ(recs.size(), 3u);
  EXPECT_EQ(recs[0].version, 4u);
  ASSERT_EQ(recs[0].record.type, RecordType::kUpsert);
  EXPECT_EQ(recs[0].record.items.size(), 15u);
  EXPECT_EQ(recs[0].record.items[0].id, 30u);
  EXPECT_EQ(recs[0].record.items[0].text, TextOf(30));
  EXPECT_EQ(recs[1].version, 5u);
  ASSERT_EQ(recs[1].record.type, RecordType::kDelete);
  EXPECT_EQ(recs[1].record.ids, std::vector<uint64_t>{31});
  EXPECT_EQ(recs[2].version, 6u);
  // max_bytes bounds the answer, but one record always comes.
  r = Get(*s, "/v1/log?after=0&max_bytes=1");
  ASSERT_EQ(r.status, 200);
  recs = Records(r.body);
  ASSERT_EQ(recs.size(), 1u);
  EXPECT_EQ(recs[0].version, 1u);
  EXPECT_EQ(Records(Get(*s, "/v1/log?after=0").body).size(), 6u);
  // Nothing after the current version.
  r = Get(*s, "/v1/log?after=6");
  EXPECT_EQ(r.status, 200);
  EXPECT_TRUE(r.body.empty());
  EXPECT_EQ(Get(*s, "/v1/log").status, 400);
  EXPECT_EQ(Get(*s, "/v1/log?after=x").status, 400);
  EXPECT_EQ(Get(*s, "/v1/log?after=1&max_bytes=0").status, 400);
}

TEST(ReplicaLogTest, APeersLogReproducesTheSameAnswersAndVersion) {
  TempDir a_dir("keel-replica"), b_dir("keel-replica");
  auto a = Start(Options(a_dir.path()));
  auto b = Start(Options(b_dir.path()));
  ASSERT_TRUE(a && b);
  SixWrites(*a);
  const std::string log = Get(*a, "/v1/log?after=0").body;
  // Part of it first (a replica that had caught up to 2), then all of it: the first two skip.
  std::string first_two;
  {
    std::string_view in = log;
    uint64_t v;
    std::string_view p;
    ASSERT_TRUE(NextLogRecord(&in, 0, &v, &p).ok());
    ASSERT_TRUE(NextLogRecord(&in, 0, &v, &p).ok());
    first_two = log.substr(0, log.size() - in.size());
  }
  auto r = Post(*b, "/v1/log", first_two);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(Json(r)["version"], 2);
  EXPECT_EQ(Json(r)["applied"], 2);
  r = Post(*b, "/v1/log", log);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(Json(r), (json{{"version", 6}, {"applied", 4}, {"skipped", 2}}));
  EXPECT_EQ(StatsVersion(*b), 6u);
  EXPECT_EQ(b->shard().Stats().items, a->shard().Stats().items);
  EXPECT_EQ(Answers(*b), Answers(*a));
  // The caught-up replica serves the same log in turn, and takes the next versioned write.
  EXPECT_EQ(Get(*b, "/v1/log?after=0").body, log);
  json w = Items(60, 61);
  w["version"] = 7;
  EXPECT_EQ(Post(*b, "/v1/upsert", w.dump()).status, 200);
}

TEST(ReplicaLogTest, AStreamStartingPastTheNextVersionIsAGap) {
  TempDir a_dir("keel-replica"), b_dir("keel-replica");
  auto a = Start(Options(a_dir.path()));
  auto b = Start(Options(b_dir.path()));
  ASSERT_TRUE(a && b);
  SixWrites(*a);
  auto r = Post(*b, "/v1/log", Get(*a, "/v1/log?after=2").body);
  ASSERT_EQ(r.status, 409) << r.body;
  EXPECT_EQ(Json(r)["version"], 0);
  EXPECT_EQ(Json(r)["applied"], 0);
  EXPECT_EQ(Json(r)["error"]["message"], "stale: replica at version 0, write is version 3");
  EXPECT_EQ(b->shard().Stats().items, 0);
}

TEST(ReplicaLogTest, VersionsASnapshotDroppedAre410) {
  TempDir dir("keel-replica");
  auto s = Start(Options(dir.path()));
  ASSERT_TRUE(s);
  SixWrites(*s);
  ASSERT_EQ(Post(*s, "/v1/snapshot", "").status, 200);
  ASSERT_EQ(Post(*s, "/v1/upsert", Items(70, 72).dump()).status, 200);
  auto r = Get(*s, "/v1/log?after=2");
  ASSERT_EQ(r.status, 410) << r.body;
  EXPECT_EQ(Json(r)["error"]["message"], "log starts after version 6");
  EXPECT_EQ(Json(r)["error"]["code"], 410);
  r = Get(*s, "/v1/log?after=6");
  ASSERT_EQ(r.status, 200);
  auto recs = Records(r.body);
  ASSERT_EQ(recs.size(), 1u);
  EXPECT_EQ(recs[0].version, 7u);
  EXPECT_EQ(Json(Get(*s, "/v1/stats"))["log_start_version"], 6);
}

TEST(ReplicaLogTest, CorruptOrTruncatedStreamsAre400AndNothingAfterTheBadRecordApplies) {
  TempDir a_dir("keel-replica");
  auto a = Start(Options(a_dir.path()));
  ASSERT_TRUE(a);
  SixWrites(*a);
  const std::string log = Get(*a, "/v1/log?after=0").body;
  // Offsets of each record in the stream.
  std::vector<size_t> at;
  {
    std::string_view in = log;
    while (!in.empty()) {
      at.push_back(log.size() - in.size());
      uint64_t v;
      std::string_view p;
      ASSERT_TRUE(NextLogRecord(&in, 0, &v, &p).ok());
    }
  }
  ASSERT_EQ(at.size(), 6u);
  struct Case {
    const char* what;
    std::string body;
    uint64_t version_after;  // records before the bad one apply
  };
  std::string flipped = log;
  // A mantissa bit of the first text value of version 3's first item (type, count, id, length
  // come before it): the record still decodes, only the checksum tells.
  flipped[at[2] + 16 + 1 + 4 + 8 + 4 + 2] ^= 0x40;
  // Well framed, valid checksum, but a payload that does not decode (version 2).
  std::string garbage = log.substr(0, at[1]);
  AppendLogRecord(2, "\x07junk", &garbage);
  // Well framed, valid checksum, but the payload claims 2^32 - 1 items in 5 bytes (version 2).
  std::string huge_count = log.substr(0, at[1]);
  AppendLogRecord(2, std::string("\x01\xff\xff\xff\xff", 5), &huge_count);
  // Well framed and decodable, but the items have the wrong dimension for this shard.
  std::string wrong_dim = log.substr(0, at[1]);
  Item bad{900, {1.0f, 2.0f}, {}, {}};
  AppendLogRecord(2, EncodeUpsert(std::span(&bad, 1)), &wrong_dim);
  wrong_dim += log.substr(at[2]);
  const std::vector<Case> cases = {
      {"checksum mismatch", flipped, 2},
      {"cut inside a payload", log.substr(0, at[4] + 20), 4},
      {"cut inside a header", log.substr(0, at[3] + 5), 3},
      {"undecodable payload", garbage, 1},
      {"an item count past its bytes", huge_count, 1},
      {"wrong dimension", wrong_dim, 1},
      {"not a stream at all", "hello", 0},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    TempDir b_dir("keel-replica");
    auto b = Start(Options(b_dir.path()));
    ASSERT_TRUE(b);
    auto r = Post(*b, "/v1/log", c.body);
    EXPECT_EQ(r.status, 400) << r.body;
    EXPECT_EQ(Json(r)["version"], c.version_after);
    EXPECT_EQ(Json(r)["applied"], c.version_after);
    EXPECT_NE(Json(r)["error"]["message"].get<std::string>().find("byte "), std::string::npos) << r.body;
    EXPECT_EQ(b->shard().version(), c.version_after);
    // Nothing of the bad record or after it: the log holds exactly the good prefix.
    EXPECT_EQ(Records(Get(*b, "/v1/log?after=0").body).size(), c.version_after);
  }
}

// --- signed answers --------------------------------------------------------------------------

struct Signer {
  std::shared_ptr<const trust::SigningKey> key;
  trust::TrustStore store;
};

Signer MakeSigner(const ReplicaIdentity& id) {
  auto key = trust::SigningKey::Generate();
  EXPECT_TRUE(key.ok());
  Signer s;
  s.key = std::make_shared<const trust::SigningKey>(std::move(*key));
  EXPECT_TRUE(s.store.AddPem(id.replica, id.shard, id.zone, s.key->PublicKeyPem()).ok());
  return s;
}

ServiceOptions ReplicaOptions(const std::string& dir, const std::string& replica, const Signer& signer) {
  ServiceOptions o = Options(dir);
  o.identity.shard = 1;
  o.identity.shards = 3;
  o.identity.replica = replica;
  o.identity.zone = "zone-" + replica;
  o.identity.signing_key = signer.key;
  return o;
}

SearchRequest TextRequest(uint64_t id, int k, bool include_vectors = false) {
  SearchRequest r;
  r.kind = QueryKind::kText;
  r.text_query = TextOf(id);
  r.k = k;
  r.include_vectors = include_vectors;
  return r;
}
json RequestJson(const SearchRequest& r, const std::string& nonce) {
  json j = {{"kind", "text"}, {"text", r.text_query}, {"k", r.k}, {"include_vectors", r.include_vectors}};
  if (!nonce.empty()) j["nonce"] = nonce;
  return j;
}

// Loads shard 1's items of [0, 300) (ids = 1 mod 3).
void LoadShardOne(Service& s) {
  json items = json::array();
  for (uint64_t id = 1; id < 300; id += 3) items.push_back(ItemJson(id));
  ASSERT_EQ(Post(s, "/v1/upsert", json{{"items", items}}.dump()).status, 200);
}

struct Answer {
  json raw;
  trust::ReplyBody body;
  std::string signature;
  trust::ReplyFault fault = trust::ReplyFault::kNone;
};

Answer AskSigned(Service& s, const Signer& signer, const SearchRequest& r, const std::string& nonce) {
  Answer a;
  auto res = Post(s, "/v1/search", RequestJson(r, nonce).dump());
  EXPECT_EQ(res.status, 200) << res.body;
  a.raw = Json(res);
  Status parsed = wire::ParseSignedReply(a.raw, 1000, &a.body, &a.signature);
  EXPECT_TRUE(parsed.ok()) << parsed.ToString() << " " << res.body;
  a.fault = signer.store.Verify(a.body, a.signature, 1, trust::DigestQuery(r, nonce));
  return a;
}

std::vector<uint64_t> Ids(const std::vector<trust::SignedHit>& hits) {
  std::vector<uint64_t> out;
  for (const auto& h : hits) out.push_back(h.id);
  return out;
}

TEST(ReplicaTrustTest, SignedAnswersVerifyAndCoverTheQueryAndTheHits) {
  TempDir dir("keel-replica");
  ReplicaIdentity id;
  id.shard = 1;
  id.replica = "s1-a";
  id.zone = "zone-s1-a";
  Signer signer = MakeSigner(id);
  auto s = Start(ReplicaOptions(dir.path(), "s1-a", signer));
  ASSERT_TRUE(s);
  LoadShardOne(*s);
  const SearchRequest r = TextRequest(31, 5, /*include_vectors=*/true);
  Answer a = AskSigned(*s, signer, r, "nonce-1");
  EXPECT_EQ(a.fault, trust::ReplyFault::kNone);
  const json& t = a.raw["trust"];
  EXPECT_EQ(t["shard"], 1);
  EXPECT_EQ(t["replica"], "s1-a");
  EXPECT_EQ(t["zone"], "zone-s1-a");
  EXPECT_EQ(t["index_version"], 1);
  EXPECT_EQ(t["query_digest"], trust::DigestQuery(r, "nonce-1").Hex());
  ASSERT_EQ(a.body.hits.size(), 5u);
  EXPECT_EQ(a.body.hits[0].id, 31u);
  EXPECT_NE(a.body.hits[0].vector_digest, 0u);  // the vectors are covered
  // A nonce-less request is signed with the empty nonce.
  Answer plain = AskSigned(*s, signer, r, "");
  EXPECT_EQ(plain.fault, trust::ReplyFault::kNone);
  // Another query's digest does not verify (a replayed answer), nor do edited hits.
  EXPECT_EQ(signer.store.Verify(a.body, a.signature, 1, trust::DigestQuery(r, "nonce-2")), trust::ReplyFault::kReplay);
  trust::ReplyBody edited = a.body;
  edited.hits[1].text_distance += 0.5f;
  EXPECT_EQ(signer.store.Verify(edited, a.signature, 1, trust::DigestQuery(r, "nonce-1")), trust::ReplyFault::kBadSignature);
  edited = a.body;
  edited.hits[2].vector_digest ^= 1;
  EXPECT_EQ(signer.store.Verify(edited, a.signature, 1, trust::DigestQuery(r, "nonce-1")), trust::ReplyFault::kBadSignature);
  // The same request spelled differently (key order, number forms) has the same digest.
  std::string text = "[";
  for (size_t i = 0; i < r.text_query.size(); ++i) text += (i ? "," : "") + std::to_string(r.text_query[i]) + "0";
  text += "]";
  auto res = Post(*s, "/v1/search", R"({"nonce":"nonce-1","include_vectors":true,"k":5,"kind":"text","text":)" + text + "}");
  ASSERT_EQ(res.status, 200) << res.body;
  EXPECT_EQ(Json(res)["trust"]["query_digest"], t["query_digest"]);
}

TEST(ReplicaTrustTest, BadNoncesAre400AndUnsignedReplicasSendNoTrust) {
  TempDir dir("keel-replica");
  auto s = Start(Options(dir.path()));
  ASSERT_TRUE(s);
  LoadShardOne(*s);
  json q = Query(31, 3);
  for (const json& bad : {json(""), json(std::string(trust::kMaxNonceBytes + 1, 'n')), json("tab\there"), json("\xc3\xa9"),
                          json(7), json::array()}) {
    q["nonce"] = bad;
    auto r = Post(*s, "/v1/search", q.dump());
    EXPECT_EQ(r.status, 400) << bad.dump() << " " << r.body;
    EXPECT_NE(r.body.find("nonce"), std::string::npos) << r.body;
  }
  q["nonce"] = std::string(trust::kMaxNonceBytes, '~');
  auto r = Post(*s, "/v1/search", q.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_FALSE(Json(r).contains("trust"));
  EXPECT_EQ(Json(r)["hits"].size(), 3u);
}

TEST(ReplicaTrustTest, IdentityAndAdversaryOptionsAreChecked) {
  TempDir dir("keel-replica");
  ServiceOptions o = Options(dir.path());
  o.identity.shard = 3;
  o.identity.shards = 3;
  EXPECT_EQ(Service::Start(o).status().code(), StatusCode::kInvalidArgument);
  o.identity.shard = 0;
  o.identity.zone = "";
  EXPECT_EQ(Service::Start(o).status().code(), StatusCode::kInvalidArgument);
  o.identity.zone = "z";
  o.identity.adversary.fraction = 2;
  EXPECT_EQ(Service::Start(o).status().code(), StatusCode::kInvalidArgument);
  o.identity.adversary.fraction = 1;
  o.identity.signing_key_path = dir.file("missing.key");
  EXPECT_FALSE(Service::Start(o).ok());
  o.identity.signing_key_path.clear();
  auto s = Start(o);
  ASSERT_TRUE(s);
  json st = Json(Get(*s, "/v1/stats"));
  EXPECT_EQ(st["shard"], 0);
  EXPECT_EQ(st["shards"], 3);
  EXPECT_EQ(st["replica"], "r0");
  EXPECT_EQ(st["zone"], "z");
  EXPECT_EQ(st["index_version"], 0);
  EXPECT_EQ(st["log_start_version"], 0);
}

// An honest replica and a tampering one, same data and seed, asked the same query.
class AdversaryTest : public ::testing::Test {
 protected:
  void StartPair(trust::AdversaryMode mode, uint64_t seed = 7, double fraction = 1.0) {
    id_.shard = 1;
    id_.shards = 3;
    id_.replica = "honest";
    id_.zone = "zone-honest";
    honest_signer_ = MakeSigner(id_);
    honest_ = Start(ReplicaOptions(honest_dir_.path(), "honest", honest_signer_));
    ASSERT_TRUE(honest_);
    LoadShardOne(*honest_);
    bad_ = StartAdversary(bad_dir_.path(), "bad", mode, seed, &bad_signer_, fraction);
    ASSERT_TRUE(bad_);
  }
  std::unique_ptr<Service> StartAdversary(const std::string& dir, const std::string& name, trust::AdversaryMode mode,
                                          uint64_t seed, Signer* signer, double fraction = 1.0) {
    ReplicaIdentity id = id_;
    id.replica = name;
    id.zone = "zone-" + name;
    *signer = MakeSigner(id);
    ServiceOptions o = ReplicaOptions(dir, name, *signer);
    o.identity.adversary.mode = mode;
    o.identity.adversary.seed = seed;
    o.identity.adversary.strength = 2;
    o.identity.adversary.delay = std::chrono::milliseconds(300);
    o.identity.adversary.fraction = fraction;
    auto s = Start(o);
    if (s) LoadShardOne(*s);
    return s;
  }

  ReplicaIdentity id_;
  TempDir honest_dir_{"keel-replica"}, bad_dir_{"keel-replica"};
  Signer honest_signer_, bad_signer_;
  std::unique_ptr<Service> honest_, bad_;
};

TEST_F(AdversaryTest, DropRemovesTheBestHitsAndRefillsFromBelowK) {
  StartPair(trust::AdversaryMode::kDrop);
  const SearchRequest r = TextRequest(31, 5);
  Answer h = AskSigned(*honest_, honest_signer_, TextRequest(31, 7), "n");  // k + strength
  Answer b = AskSigned(*bad_, bad_signer_, r, "n");
  EXPECT_EQ(b.fault, trust::ReplyFault::kNone);  // validly signed: only the verifier can tell
  ASSERT_EQ(h.body.hits.size(), 7u);
  EXPECT_EQ(b.body.hits, std::vector<trust::SignedHit>(h.body.hits.begin() + 2, h.body.hits.end()));
  EXPECT_EQ(b.raw["hits"].size(), 5u);
  EXPECT_EQ(b.raw["hits"][0]["id"], h.body.hits[2].id);
}

TEST_F(AdversaryTest, InjectReplacesHitsWithMadeUpIdsOfThisShard) {
  StartPair(trust::AdversaryMode::kInject);
  const SearchRequest r = TextRequest(31, 6, /*include_vectors=*/true);
  Answer h = AskSigned(*honest_, honest_signer_, r, "n");
  Answer b = AskSigned(*bad_, bad_signer_, r, "n");
  EXPECT_EQ(b.fault, trust::ReplyFault::kNone);
  ASSERT_EQ(b.body.hits.size(), 6u);
  ASSERT_EQ(h.body.hits.size(), 6u);
  int injected = 0;
  for (size_t i = 0; i < 6; ++i) {
    EXPECT_EQ(b.body.hits[i].text_distance, h.body.hits[i].text_distance);  // the replaced hit's score
    if (b.body.hits[i].id == h.body.hits[i].id) {
      EXPECT_EQ(b.raw["hits"][i]["text"], h.raw["hits"][i]["text"]);  // real hits keep their vectors
      continue;
    }
    ++injected;
    EXPECT_GE(b.body.hits[i].id, uint64_t{1} << 62);
    EXPECT_EQ(trust::ShardOf(b.body.hits[i].id, 3), 1u);
    EXPECT_FALSE(b.raw["hits"][i].contains("text"));  // an injected id has no vectors
    EXPECT_EQ(b.body.hits[i].vector_digest, 0u);
  }
  EXPECT_EQ(injected, 2);
  EXPECT_NE(b.body.hits[0].id, h.body.hits[0].id);  // the best rank is always hit

  // A colluder (same mode and seed, its own key) returns the identical tampered list; another
  // seed does not.
  TempDir twin_dir("keel-replica"), other_dir("keel-replica");
  Signer twin_signer, other_signer;
  auto twin = StartAdversary(twin_dir.path(), "twin", trust::AdversaryMode::kInject, 7, &twin_signer);
  auto other = StartAdversary(other_dir.path(), "other", trust::AdversaryMode::kInject, 8, &other_signer);
  ASSERT_TRUE(twin && other);
  Answer t = AskSigned(*twin, twin_signer, r, "n");
  Answer o = AskSigned(*other, other_signer, r, "n");
  EXPECT_EQ(t.fault, trust::ReplyFault::kNone);
  EXPECT_EQ(t.body.hits, b.body.hits);
  EXPECT_NE(Ids(o.body.hits), Ids(b.body.hits));
}

TEST_F(AdversaryTest, ReorderReversesTheIdsUnderSortedScores) {
  StartPair(trust::AdversaryMode::kReorder);
  const SearchRequest r = TextRequest(31, 5);
  Answer h = AskSigned(*honest_, honest_signer_, r, "n");
  Answer b = AskSigned(*bad_, bad_signer_, r, "n");
  EXPECT_EQ(b.fault, trust::ReplyFault::kNone);
  ASSERT_EQ(b.body.hits.size(), 5u);
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(b.body.hits[i].id, h.body.hits[4 - i].id);
    EXPECT_EQ(b.body.hits[i].text_distance, h.body.hits[i].text_distance);
  }
  EXPECT_EQ(b.raw["hits"][0]["id"], h.body.hits[4].id);
}

TEST_F(AdversaryTest, StaleReportsAnOlderIndexVersion) {
  StartPair(trust::AdversaryMode::kStale);
  for (int i = 0; i < 3; ++i) {
    ASSERT_EQ(Post(*honest_, "/v1/upsert", Items(1000 + i, 1001 + i).dump()).status, 200);
    ASSERT_EQ(Post(*bad_, "/v1/upsert", Items(1000 + i, 1001 + i).dump()).status, 200);
  }
  const SearchRequest r = TextRequest(31, 5);
  Answer h = AskSigned(*honest_, honest_signer_, r, "n");
  Answer b = AskSigned(*bad_, bad_signer_, r, "n");
  EXPECT_EQ(b.fault, trust::ReplyFault::kNone);
  EXPECT_EQ(h.body.index_version, 4u);
  EXPECT_EQ(b.body.index_version, 2u);
  EXPECT_EQ(b.raw["index_version"], 2);
  EXPECT_EQ(b.body.hits, h.body.hits);
}

TEST_F(AdversaryTest, SlowAnswersHonestlyAfterTheDelay) {
  StartPair(trust::AdversaryMode::kSlow);
  const SearchRequest r = TextRequest(31, 5);
  Answer h = AskSigned(*honest_, honest_signer_, r, "n");
  const auto t0 = std::chrono::steady_clock::now();
  Answer b = AskSigned(*bad_, bad_signer_, r, "n");
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(300));  // sleeps at least that
  EXPECT_EQ(b.fault, trust::ReplyFault::kNone);
  EXPECT_EQ(b.body.hits, h.body.hits);
}

TEST_F(AdversaryTest, FractionZeroTampersWithNothing) {
  StartPair(trust::AdversaryMode::kInject, 7, /*fraction=*/0);
  for (uint64_t q : {1, 31, 100}) {
    const SearchRequest r = TextRequest(q, 5);
    EXPECT_EQ(AskSigned(*bad_, bad_signer_, r, "n").body.hits, AskSigned(*honest_, honest_signer_, r, "n").body.hits);
  }
}

// --- HNSW seed -------------------------------------------------------------------------------

// The HNSW levels inside what TextIndex::Save wrote.
std::vector<int> Levels(const TextIndex& index) {
  auto saved = index.Save();
  EXPECT_TRUE(saved.ok());
  std::string_view b = *saved;
  b.remove_prefix(8 + 16);  // magic, kind, dim, trained, lists
  uint64_t n = 0, len = 0;
  std::memcpy(&n, b.data(), 8);
  b.remove_prefix(8 + n);
  std::memcpy(&len, b.data(), 8);
  b.remove_prefix(8);
  faiss::VectorIOReader r;
  r.data.assign(b.begin(), b.end());
  std::unique_ptr<faiss::Index> ix(faiss::read_index(&r));
  auto* h = dynamic_cast<faiss::IndexHNSW*>(ix.get());
  EXPECT_NE(h, nullptr);
  return h ? h->hnsw.levels : std::vector<int>{};
}

TEST(HnswSeedTest, TheSeedDecidesTheLevelsAndTheDefaultIsFaisss) {
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(0, 1);
  std::vector<float> x(2000 * kDim);
  for (float& v : x) v = u(rng);
  auto build = [&](int64_t seed) {
    IndexOptions o;
    o.hnsw_seed = seed;
    auto ix = TextIndex::Create(o, kDim);
    EXPECT_TRUE(ix.ok());
    EXPECT_TRUE((*ix)->Add(x.data(), 2000).ok());
    return Levels(**ix);
  };
  faiss::IndexHNSWFlat plain(kDim, IndexOptions{}.hnsw_m);  // FAISS's own generator
  plain.add(2000, x.data());
  EXPECT_EQ(build(IndexOptions{}.hnsw_seed), plain.hnsw.levels);
  EXPECT_EQ(build(99), build(99));
  EXPECT_NE(build(99), plain.hnsw.levels);
}

// --- keygen ----------------------------------------------------------------------------------

TEST(ReplicaKeygenTest, TheCliWritesAPrivateKeyOnlyItsOwnerCanRead) {
  TempDir dir("keel-replica");
  const std::string prefix = dir.file("s0-a");
  const std::string cmd = std::string(KEEL_BINARY) + " vector keygen --out " + prefix + " 2>/dev/null";
  int status = std::system(cmd.c_str());
  ASSERT_TRUE(WIFEXITED(status));
  ASSERT_EQ(WEXITSTATUS(status), 0);
  struct stat st {};
  ASSERT_EQ(::stat((prefix + ".key").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  ASSERT_TRUE(std::filesystem::exists(prefix + ".pub"));
  // The pair signs and verifies through a replica and a trust store.
  trust::TrustStore store;
  ASSERT_TRUE(store.AddFile("s0-a", 0, "a", prefix + ".pub").ok());
  ServiceOptions o = Options(dir.file("shard"));
  o.identity.replica = "s0-a";
  o.identity.zone = "a";
  o.identity.signing_key_path = prefix + ".key";
  auto s = Start(o);
  ASSERT_TRUE(s);
  ASSERT_EQ(Post(*s, "/v1/upsert", Items(0, 20).dump()).status, 200);
  const SearchRequest r = TextRequest(3, 4);
  auto res = Post(*s, "/v1/search", RequestJson(r, "k").dump());
  ASSERT_EQ(res.status, 200);
  trust::ReplyBody body;
  std::string sig;
  ASSERT_TRUE(wire::ParseSignedReply(Json(res), 100, &body, &sig).ok());
  EXPECT_EQ(store.Verify(body, sig, 0, trust::DigestQuery(r, "k")), trust::ReplyFault::kNone);
  // A second keygen never overwrites the key.
  status = std::system(cmd.c_str());
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_NE(WEXITSTATUS(status), 0);
}

}  // namespace
}  // namespace keel::vector
