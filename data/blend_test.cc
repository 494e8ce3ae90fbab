#include "data/blend.h"

#include <algorithm>
#include <cstdlib>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "data/blend_spec.h"
#include "data/megatron_writer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace gradsum::data {
namespace {

using ::testing::HasSubstr;

// Documents given as lengths; document i of source `tag` is [tag * 1000 + i, ...].
class TestSource : public DocumentSource {
 public:
  TestSource(int tag, std::vector<int64_t> lengths, uint64_t fingerprint = 7)
      : tag_(tag), lengths_(std::move(lengths)), fingerprint_(fingerprint) {}
  int64_t num_documents() const override { return static_cast<int64_t>(lengths_.size()); }
  int64_t DocumentLength(int64_t i) const override { return lengths_[i]; }
  std::vector<int32_t> Document(int64_t i) const override {
    return std::vector<int32_t>(lengths_[i], static_cast<int32_t>(tag_ * 1000 + i));
  }
  int64_t MinDocumentLength() const override {
    return *std::min_element(lengths_.begin(), lengths_.end());
  }
  int64_t MaxDocumentLength() const override {
    return *std::max_element(lengths_.begin(), lengths_.end());
  }
  std::string Describe() const override { return absl::StrCat("source ", tag_); }
  uint64_t ContentFingerprint() const override { return fingerprint_; }

 private:
  int tag_;
  std::vector<int64_t> lengths_;
  uint64_t fingerprint_;
};

std::shared_ptr<const DocumentSource> Source(int tag, int64_t n, int64_t len = 4) {
  return std::make_shared<TestSource>(tag, std::vector<int64_t>(n, len));
}

BlendOptions Options(std::vector<BlendEntry> entries, std::array<double, 3> split = {1, 0, 0},
                     SplitPart part = SplitPart::kTrain) {
  BlendOptions o;
  o.entries = std::move(entries);
  o.split = split;
  o.part = part;
  o.seed = 1234;
  o.token_options.max_len = 64;
  o.describe = "--data_path=test";
  return o;
}

TEST(ParseDataPathTest, OnePathOrWeightPathPairs) {
  auto one = ParseDataPath("web");
  ASSERT_TRUE(one.ok());
  ASSERT_EQ(one->size(), 1u);
  EXPECT_EQ((*one)[0].prefix, "web");
  EXPECT_EQ((*one)[0].weight, 1.0);
  auto two = ParseDataPath(" 0.7 web\t0.3  /data/code ");
  ASSERT_TRUE(two.ok());
  ASSERT_EQ(two->size(), 2u);
  EXPECT_EQ((*two)[1].prefix, "/data/code");
  EXPECT_EQ((*two)[1].weight, 0.3);
}

TEST(ParseDataPathTest, BadListsNameTheValue) {
  EXPECT_THAT(ParseDataPath("  ").status().message(), HasSubstr("names no dataset"));
  EXPECT_THAT(ParseDataPath("0.7 web 0.3").status().message(),
              HasSubstr("data.data_path=0.7 web 0.3: has 3 words"));
  EXPECT_THAT(ParseDataPath("web code").status().message(),
              HasSubstr("weight \"web\" (word 1) is not a number"));
  EXPECT_THAT(ParseDataPath("0.5 web 0 code").status().message(),
              HasSubstr("weight 0 of code must be positive"));
  EXPECT_THAT(ParseDataPath("0.5 web -1 code").status().message(),
              HasSubstr("weight -1 of code must be positive"));
  EXPECT_THAT(ParseDataPath("1 web inf code").status().message(), HasSubstr("is not a number"));
  EXPECT_THAT(ParseDataPath("1 web 2 web").status().message(), HasSubstr("web is given twice"));
  EXPECT_EQ(ParseDataPath("0.7 web 0.3", "--data_path").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ParseSplitTest, MegatronsSyntaxNormalised) {
  auto s = ParseSplit("969,30,1");
  ASSERT_TRUE(s.ok());
  EXPECT_DOUBLE_EQ((*s)[0], 0.969);
  EXPECT_DOUBLE_EQ((*s)[1], 0.030);
  EXPECT_DOUBLE_EQ((*s)[2], 0.001);
  s = ParseSplit("98, 2");
  ASSERT_TRUE(s.ok());
  EXPECT_DOUBLE_EQ((*s)[1], 0.02);
  EXPECT_EQ((*s)[2], 0.0);
  s = ParseSplit("1");
  ASSERT_TRUE(s.ok());
  EXPECT_EQ((*s)[0], 1.0);
}

TEST(ParseSplitTest, BadSplitsNameTheValue) {
  EXPECT_THAT(ParseSplit("a,1").status().message(),
              HasSubstr("data.split=a,1: part 1 \"a\" is not a number"));
  EXPECT_THAT(ParseSplit("90,-1,1").status().message(), HasSubstr("part 2 (-1) is negative"));
  EXPECT_THAT(ParseSplit("0,0,0").status().message(), HasSubstr("the parts sum to 0"));
  EXPECT_THAT(ParseSplit("").status().message(), HasSubstr("is not a number"));
  EXPECT_THAT(ParseSplit("1,2,3,4").status().message(), HasSubstr("more than 3 parts"));
  EXPECT_THAT(ParseSplit("0,1").status().message(), HasSubstr("the train part (the first) is 0"));
}

TEST(SplitRangeTest, RoundedCumulativeBoundaries) {
  const std::array<double, 3> s = *ParseSplit("969,30,1");
  using A = std::array<int64_t, 2>;
  EXPECT_EQ(SplitRange(1000, s, SplitPart::kTrain), (A{0, 969}));
  EXPECT_EQ(SplitRange(1000, s, SplitPart::kValid), (A{969, 999}));
  EXPECT_EQ(SplitRange(1000, s, SplitPart::kTest), (A{999, 1000}));
  // 10 documents: 9.69 -> 10, so validation and test are empty.
  EXPECT_EQ(SplitRange(10, s, SplitPart::kTrain), (A{0, 10}));
  EXPECT_EQ(SplitRange(10, s, SplitPart::kValid), (A{10, 10}));
  const std::array<double, 3> half = *ParseSplit("1,1");
  EXPECT_EQ(SplitRange(3, half, SplitPart::kTrain), (A{0, 2}));
  EXPECT_EQ(SplitRange(3, half, SplitPart::kValid), (A{2, 3}));
  EXPECT_EQ(SplitRange(3, half, SplitPart::kTest), (A{3, 3}));
}

// The header's definition of P, written out independently.
uint64_t RefMix(uint64_t z) {
  z = z + 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}
int64_t RefPermutation(uint64_t seed, int d, int64_t e, int64_t k, int64_t n) {
  int h = 1;
  while ((int64_t{1} << (2 * h)) < n) h++;
  uint64_t x = k;
  for (;;) {
    uint64_t l = x >> h, r = x & ((1ULL << h) - 1);
    for (uint64_t round = 0; round < 4; round++) {
      const uint64_t key = RefMix(RefMix(RefMix(RefMix(seed) ^ d) ^ e) ^ round);
      const uint64_t nr = l ^ (RefMix(r ^ key) % (1ULL << h));
      l = r;
      r = nr;
    }
    x = l * (1ULL << h) + r;
    if (x < static_cast<uint64_t>(n)) return static_cast<int64_t>(x);
  }
}

TEST(EpochPermutationTest, IsTheDocumentedPermutation) {
  for (int64_t n : {1, 2, 3, 5, 16, 17, 1000}) {
    for (int64_t e : {0, 1, 7}) {
      std::set<int64_t> seen;
      for (int64_t k = 0; k < n; ++k) {
        const int64_t p = EpochPermutation(42, 3, e, k, n);
        EXPECT_EQ(p, RefPermutation(42, 3, e, k, n)) << n << " " << e << " " << k;
        seen.insert(p);
      }
      EXPECT_EQ(static_cast<int64_t>(seen.size()), n);
      EXPECT_EQ(*seen.rbegin(), n - 1);
    }
  }
  int differ = 0;
  for (int64_t k = 0; k < 1000; ++k) {
    differ += EpochPermutation(42, 0, 0, k, 1000) != EpochPermutation(42, 0, 1, k, 1000);
  }
  EXPECT_GT(differ, 900);  // a fresh order each epoch
}

TEST(BlendedCorpusTest, GreedyRuleGivesTheWeightsShares) {
  auto blend =
      BlendedCorpus::Create(Options({{0.7, "web"}, {0.3, "code"}}), {Source(0, 50), Source(1, 20)});
  ASSERT_TRUE(blend.ok()) << blend.status();
  // The greedy rule written out: argmax w_d (i + 1) - c_d, lowest d on ties.
  int64_t c[2] = {0, 0};
  for (int64_t i = 0; i < 3 * 4096 + 17; ++i) {
    const double e0 = 0.7 * (i + 1) - c[0], e1 = 0.3 * (i + 1) - c[1];
    const int d = e1 > e0 ? 1 : 0;
    const std::pair<int, int64_t> s = (*blend)->Source(i);
    ASSERT_EQ(s.first, d) << "document " << i;
    const int64_t n = d == 0 ? 50 : 20;
    EXPECT_EQ(s.second, RefPermutation(1234, d, c[d] / n, c[d] % n, n));
    EXPECT_EQ((*blend)->Document(i)[0], d * 1000 + s.second);
    ++c[d];
  }
  // Each count within one document of its share: 0.7 x 12305 = 8613.5.
  EXPECT_NEAR(c[0], 0.7 * 12305, 1);
  EXPECT_NEAR(c[1], 0.3 * 12305, 1);
  // Random access (backwards, across chunks) gives the same documents.
  for (int64_t i = 3 * 4096 + 16; i >= 0; i -= 1013) {
    auto again = BlendedCorpus::Create(Options({{0.7, "web"}, {0.3, "code"}}),
                                       {Source(0, 50), Source(1, 20)});
    EXPECT_EQ((*again)->Source(i), (*blend)->Source(i));
  }
}

TEST(BlendedCorpusTest, EachEpochTakesEveryDocumentOnceInANewOrder) {
  auto blend = BlendedCorpus::Create(Options({{1, "web"}}), {Source(0, 10)});
  ASSERT_TRUE(blend.ok());
  std::vector<int64_t> first, second;
  for (int64_t i = 0; i < 10; ++i) first.push_back((*blend)->Source(i).second);
  for (int64_t i = 10; i < 20; ++i) second.push_back((*blend)->Source(i).second);
  EXPECT_NE(first, second);
  std::sort(first.begin(), first.end());
  std::sort(second.begin(), second.end());
  for (int64_t i = 0; i < 10; ++i) {
    EXPECT_EQ(first[i], i);
    EXPECT_EQ(second[i], i);
  }
  EXPECT_EQ((*blend)->num_documents(), kBlendDocuments);
}

TEST(BlendedCorpusTest, PartsTakeTheirRangesAndAnEmptyHeldOutDatasetIsLeftOut) {
  const std::array<double, 3> split = *ParseSplit("8,2");
  auto train =
      BlendedCorpus::Create(Options({{1, "a"}, {1, "b"}}, split), {Source(0, 100), Source(1, 2)});
  ASSERT_TRUE(train.ok()) << train.status();
  auto valid = BlendedCorpus::Create(Options({{1, "a"}, {1, "b"}}, split, SplitPart::kValid),
                                     {Source(0, 100), Source(1, 2)});
  ASSERT_TRUE(valid.ok()) << valid.status();
  for (int64_t i = 0; i < 500; ++i) {
    const std::pair<int, int64_t> t = (*train)->Source(i);
    EXPECT_LT(t.second, t.first == 0 ? 80 : 2);
    const std::pair<int, int64_t> v = (*valid)->Source(i);
    EXPECT_EQ(v.first, 0);  // b's 2 documents round to 2 train, 0 held out
    EXPECT_GE(v.second, 80);
    EXPECT_LT(v.second, 100);
  }
  EXPECT_NE((*train)->ContentFingerprint(), (*valid)->ContentFingerprint());
}

TEST(BlendedCorpusTest, FingerprintFollowsWeightsSeedAndContent) {
  auto fp = [](double w, uint64_t seed, uint64_t content) {
    BlendOptions o = Options({{w, "a"}, {1, "b"}});
    o.seed = seed;
    auto b = BlendedCorpus::Create(
        o, {std::make_shared<TestSource>(0, std::vector<int64_t>(5, 3), content), Source(1, 5)});
    return (*b)->ContentFingerprint();
  };
  EXPECT_EQ(fp(1, 1, 1), fp(1, 1, 1));
  EXPECT_NE(fp(1, 1, 1), fp(2, 1, 1));
  EXPECT_NE(fp(1, 1, 1), fp(1, 2, 1));
  EXPECT_NE(fp(1, 1, 1), fp(1, 1, 2));
}

TEST(BlendedCorpusTest, BadDatasetsNameThemselves) {
  const std::array<double, 3> split = *ParseSplit("969,30,1");
  // One document rounds into the train part; the held-out parts are then empty everywhere.
  auto r = BlendedCorpus::Create(Options({{1, "tiny"}}, split, SplitPart::kValid), {Source(0, 1)});
  EXPECT_THAT(r.status().message(), HasSubstr("the validation part of --split holds no document"));
  r = BlendedCorpus::Create(Options({{1, "a"}}, *ParseSplit("1,3")), {Source(0, 1)});
  EXPECT_THAT(r.status().message(), HasSubstr("a has 1 documents, none of them in the train part"));
  r = BlendedCorpus::Create(Options({{1, "a"}}), {Source(0, 5, 1)});
  EXPECT_THAT(r.status().message(), HasSubstr("no document has 2 tokens"));
  r = BlendedCorpus::Create(Options({{1, "a"}}), {Source(0, 5, 65)});
  EXPECT_THAT(r.status().message(), HasSubstr("a document of 65 tokens > max_len 64"));
  auto missing = BlendedCorpus::Open(Options({{1, "/nonexistent/web"}}));
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("/nonexistent/web is no token file"));
}

TEST(BlendedCorpusTest, OpensMegatronFiles) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = tmp != nullptr ? tmp : "/tmp";
  for (const char* name : {"web", "code"}) {
    auto writer = MegatronWriter::Create(dir + "/" + name, TokenDType::kUint16);
    ASSERT_TRUE(writer.ok()) << writer.status();
    for (int d = 0; d < 30; ++d) {
      ASSERT_TRUE(writer->AddDocument({d, d + 1, name[0] == 'w' ? 500 : 900}).ok());
    }
    ASSERT_TRUE(writer->Finish().ok());
  }
  BlendOptions o = Options({{0.5, dir + "/web"}, {0.5, dir + "/code"}});
  auto blend = BlendedCorpus::Open(o);
  ASSERT_TRUE(blend.ok()) << blend.status();
  EXPECT_EQ((*blend)->MaxToken(), 900);
  const std::pair<int, int64_t> s = (*blend)->Source(1);
  EXPECT_EQ(s.first, 1);
  EXPECT_EQ((*blend)->Document(1), (std::vector<int32_t>{static_cast<int32_t>(s.second),
                                                         static_cast<int32_t>(s.second + 1), 900}));
}

}  // namespace
}  // namespace gradsum::data
