// Two `keel serve` instances and one `keel kvstore`, as separate processes on loopback: a long
// prompt on instance A, then the same prefix with a different suffix on instance B. B must
// compute only the suffix (its metrics say so) and answer exactly what an instance without any
// store answers. With the store gone, B keeps serving by recomputing.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "tests/core/http_test_client.h"
#include "tests/engine/test_util.h"
#include "tests/kvstore/redis_process.h"

namespace keel::kvstore {
namespace {

class Process {
 public:
  Process(const std::string& args, int port) : port_(port) {
    const std::string cmd = std::string("exec ") + KEEL_BINARY + " " + args + " 2>/dev/null";
    pid_ = ::fork();
    if (pid_ == 0) {
      ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
    for (int i = 0; i < 300 && !test::PortAccepts(port_); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ~Process() { Kill(); }
  bool up() const { return test::PortAccepts(port_); }
  void Kill() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
      pid_ = -1;
    }
  }

 private:
  int port_;
  pid_t pid_ = -1;
};

double Metric(int port, const std::string& name) {
  test::HttpTestClient http(port);
  auto res = http.Request("GET", "/metrics");
  size_t pos = res.body.find("\n" + name + " ");
  if (pos == std::string::npos) return -1;
  return std::stod(res.body.substr(pos + name.size() + 2));
}

nlohmann::json Complete(int port, const std::string& prompt) {
  test::HttpTestClient http(port);
  nlohmann::json req = {{"model", "aidreams260K"}, {"prompt", prompt}, {"max_tokens", 16}, {"temperature", 0}};
  auto res = http.Request("POST", "/v1/completions", req.dump());
  EXPECT_EQ(res.status, 200) << res.body;
  return res.status == 200 ? nlohmann::json::parse(res.body) : nlohmann::json{};
}

// Per KV codec: raw f32 chunks have a fixed size; zipfusion chunks are compacted blocks of
// varying size that the receiving instance validates before adopting; bellows chunks are one
// latent per token for all layers, tied to a calibration file (made here by the CLI).
class SharedPrefix : public ::testing::TestWithParam<std::string> {
 protected:
  static std::string CodecArgs(const std::string& codec) {
    if (codec != "bellows") return " --kv-codec " + codec;
    static test::TempDir dir("keel-bellows");
    const std::string file = dir.file("aidreams.bkv");
    if (::access(file.c_str(), F_OK) != 0) {
      const std::string data = test::SharedDir() + "/data";
      const std::string cmd = std::string(KEEL_BINARY) + " bellows calibrate -m " + test::ModelsDir() +
                              "/aidreams260K.bin --text " + data + "/text/train.txt --ratio 8 --tokens 2048 --out " +
                              file + " --log-level warn 2>/dev/null";
      EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
    }
    return " --kv-codec bellows --bellows " + file;
  }
};

TEST_P(SharedPrefix, InstanceBReusesInstanceAsPrefixAndMatchesARunWithoutAStore) {
  const std::string model = test::ModelsDir() + "/aidreams260K.bin" + CodecArgs(GetParam());
  const int store_port = test::FreeLoopbackPort();
  const int a_port = test::FreeLoopbackPort(), b_port = test::FreeLoopbackPort(), c_port = test::FreeLoopbackPort();
  Process store("kvstore --port " + std::to_string(store_port) + " --http-port -1 --dram-mb 64", store_port);
  ASSERT_TRUE(store.up());
  const std::string link = " --kvstore 127.0.0.1:" + std::to_string(store_port) + " --kvstore-timeout-ms 2000";
  Process a("serve -m " + model + " --port " + std::to_string(a_port) + link, a_port);
  Process b("serve -m " + model + " --port " + std::to_string(b_port) + link, b_port);
  Process c("serve -m " + model + " --port " + std::to_string(c_port), c_port);  // no store
  ASSERT_TRUE(a.up() && b.up() && c.up());

  const std::string prefix =
      "Once upon a time there was a little girl named Lily who loved to play in the park with her dog Max. "
      "Every morning they ran to the big tree by the pond.";
  nlohmann::json ra = Complete(a_port, prefix + " One day Lily found a red ball");
  ASSERT_FALSE(ra.is_null());
  // A publishes asynchronously after its prefill.
  for (int i = 0; i < 200 && Metric(a_port, "keel_kvstore_link_published_chunks_total") <= 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const double published = Metric(a_port, "keel_kvstore_link_published_chunks_total");
  ASSERT_GT(published, 0);

  const std::string prompt_b = prefix + " Then a big storm came and";
  nlohmann::json rb = Complete(b_port, prompt_b);
  nlohmann::json rc = Complete(c_port, prompt_b);
  ASSERT_FALSE(rb.is_null());
  ASSERT_FALSE(rc.is_null());
  EXPECT_EQ(rb["choices"][0]["text"], rc["choices"][0]["text"]) << "reused KV must give the same output";
  const int prompt_tokens = rb["usage"]["prompt_tokens"].get<int>();
  const double hit = Metric(b_port, "keel_kvstore_link_hit_tokens_total");
  const double computed = Metric(b_port, "keel_prompt_tokens_computed_total");
  EXPECT_GT(hit, 0);
  EXPECT_EQ(hit + computed, prompt_tokens) << "every prompt token is either fetched or computed";
  EXPECT_LT(computed, prompt_tokens / 2) << "B computes only the suffix (and the partial last chunk)";

  // The store goes away: B falls back to recomputing and keeps answering correctly.
  store.Kill();
  const std::string prompt_d = prefix + " The dog barked at a cat and";
  nlohmann::json rd = Complete(b_port, prompt_d);
  nlohmann::json rd_ref = Complete(c_port, prompt_d);
  ASSERT_FALSE(rd.is_null());
  EXPECT_EQ(rd["choices"][0]["text"], rd_ref["choices"][0]["text"]);
  EXPECT_GE(Metric(b_port, "keel_kvstore_link_failures_total"), 0);
}

// Instances sharing a tag key (--kvstore-key-file) reuse each other's chunks; one with another
// key refuses them (counted), computes the prompt and answers the same.
TEST(SharedPrefixKeyed, OnlyInstancesWithTheSameKeyUseEachOthersChunks) {
  test::TempDir dir("keel-kvkey");
  auto write_key = [&](const std::string& name, const std::string& key) {
    const std::string path = dir.file(name);
    FILE* f = std::fopen(path.c_str(), "w");
    std::fputs((key + "\n").c_str(), f);
    std::fclose(f);
    return path;
  };
  const std::string key = write_key("a.key", "kvstore-key-0123456789-shared"),
                    other = write_key("b.key", "kvstore-key-0123456789-other!"),
                    short_key = write_key("c.key", "short");
  const std::string model = test::ModelsDir() + "/aidreams260K.bin";
  const int store_port = test::FreeLoopbackPort();
  const int a_port = test::FreeLoopbackPort(), b_port = test::FreeLoopbackPort(), d_port = test::FreeLoopbackPort();
  Process store("kvstore --port " + std::to_string(store_port) + " --http-port -1 --dram-mb 64", store_port);
  ASSERT_TRUE(store.up());
  const std::string link = " --kvstore 127.0.0.1:" + std::to_string(store_port) + " --kvstore-timeout-ms 2000";
  Process a("serve -m " + model + " --port " + std::to_string(a_port) + link + " --kvstore-key-file " + key, a_port);
  Process b("serve -m " + model + " --port " + std::to_string(b_port) + link + " --kvstore-key-file " + key, b_port);
  Process d("serve -m " + model + " --port " + std::to_string(d_port) + link + " --kvstore-key-file " + other, d_port);
  ASSERT_TRUE(a.up() && b.up() && d.up());
  // A key too short to be a secret is refused at start.
  const std::string bad = std::string(KEEL_BINARY) + " serve -m " + model + " --port 0" + link +
                          " --kvstore-key-file " + short_key + " 2>/dev/null";
  EXPECT_NE(std::system(bad.c_str()), 0);

  const std::string prefix =
      "Once upon a time there was a little girl named Lily who loved to play in the park with her dog Max. "
      "Every morning they ran to the big tree by the pond.";
  ASSERT_FALSE(Complete(a_port, prefix + " One day Lily found a red ball").is_null());
  for (int i = 0; i < 200 && Metric(a_port, "keel_kvstore_link_published_chunks_total") <= 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_GT(Metric(a_port, "keel_kvstore_link_published_chunks_total"), 0);

  const std::string prompt = prefix + " Then a big storm came and";
  nlohmann::json rb = Complete(b_port, prompt);
  nlohmann::json rd = Complete(d_port, prompt);
  ASSERT_FALSE(rb.is_null());
  ASSERT_FALSE(rd.is_null());
  EXPECT_GT(Metric(b_port, "keel_kvstore_link_hit_tokens_total"), 0) << "same key: B reuses A's prefix";
  EXPECT_EQ(Metric(d_port, "keel_kvstore_link_hit_tokens_total"), 0) << "another key: D uses none of it";
  EXPECT_GT(Metric(d_port, "keel_kvstore_link_rejected_chunks_total"), 0);
  EXPECT_EQ(rb["choices"][0]["text"], rd["choices"][0]["text"]);
}

INSTANTIATE_TEST_SUITE_P(Codecs, SharedPrefix, ::testing::Values("raw", "zipfusion", "bellows"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace keel::kvstore
