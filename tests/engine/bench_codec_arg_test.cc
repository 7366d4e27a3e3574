// The codec arguments of the bellows benchmarks (bench/bellows/codec_arg.h):
// [label=]spec[@name=value,...], and their parameters reaching KvCacheOptions::codec_params.
#include "bench/bellows/codec_arg.h"

#include <gtest/gtest.h>

namespace keel::bench {
namespace {

TEST(BenchCodecArg, SpecAlone) {
  Result<CodecArg> a = ParseCodecArg("kivi:2");
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(a->spec, "kivi:2");
  EXPECT_EQ(a->label, "kivi:2");
  EXPECT_TRUE(a->params.empty());
}

TEST(BenchCodecArg, LabelAndParams) {
  Result<CodecArg> a = ParseCodecArg("plain14x=bellows@bellows=/tmp/p.bkv,window=16");
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(a->label, "plain14x");
  EXPECT_EQ(a->spec, "bellows");
  ASSERT_EQ(a->params.size(), 2u);
  EXPECT_EQ(a->params.at("bellows"), "/tmp/p.bkv");
  EXPECT_EQ(a->params.at("window"), "16");
}

TEST(BenchCodecArg, ParamsWithoutLabelKeepTheWholeArgumentAsLabel) {
  Result<CodecArg> a = ParseCodecArg("bellows:4x@bellows=/tmp/x=y.bkv");
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(a->spec, "bellows:4x");
  EXPECT_EQ(a->label, "bellows:4x@bellows=/tmp/x=y.bkv");
  EXPECT_EQ(a->params.at("bellows"), "/tmp/x=y.bkv");  // '=' in a value belongs to the value
}

TEST(BenchCodecArg, Malformed) {
  for (const char* bad : {"", "=raw:bf16", "x=", "bellows@", "bellows@file", "bellows@=v", "b@a=1,a=2"}) {
    Result<CodecArg> a = ParseCodecArg(bad);
    EXPECT_FALSE(a.ok()) << "'" << bad << "' parsed as spec '" << (a.ok() ? a->spec : "") << "'";
    if (!a.ok()) EXPECT_EQ(a.status().code(), StatusCode::kInvalidArgument);
  }
}

TEST(BenchCodecArg, ParamsReachTheCacheOptions) {
  Result<CodecArg> a = ParseCodecArg("bellows@bellows=/tmp/p.bkv");
  ASSERT_TRUE(a.ok());
  engine::KvCacheOptions o;
  ASSERT_TRUE(ApplyCodecParams(*a, o).ok());
  ASSERT_EQ(o.codec_params.size(), 1u);
  EXPECT_EQ(o.codec_params.at("bellows"), "/tmp/p.bkv");
}

// Options without a codec_params field (the engine before it had one): parameters are an error,
// never silently dropped; no parameters is fine.
struct OptionsWithoutParams {
  int block_tokens = 16;
};

TEST(BenchCodecArg, ParamsWithoutAPlaceToGoAreAnError) {
  OptionsWithoutParams o;
  Result<CodecArg> with = ParseCodecArg("bellows@bellows=/tmp/p.bkv");
  Result<CodecArg> without = ParseCodecArg("raw:bf16");
  ASSERT_TRUE(with.ok() && without.ok());
  EXPECT_FALSE(ApplyCodecParams(*with, o).ok());
  EXPECT_TRUE(ApplyCodecParams(*without, o).ok());
}

}  // namespace
}  // namespace keel::bench
