// The spec against SEMANTICS.md §10 written out by hand: names, shapes, stages, the
// parameters each stage reads, and the initialisation's distribution.
#include "model/moe_lm_spec.h"

#include <cmath>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace gradsum::model {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

MoeLmConfig Small() {
  MoeLmConfig c;
  c.vocab = 11;
  c.dim = 4;
  c.layers = 2;
  c.experts = 3;
  c.top_k = 2;
  c.expert_dim = 5;
  return c;
}

TEST(MoeLmSpecTest, ParametersInForwardOrderWithTheSemanticsNames) {
  absl::StatusOr<MoeLmSpec> spec = MoeLmSpec::Create(Small());
  ASSERT_TRUE(spec.ok()) << spec.status();
  std::vector<std::string> names;
  for (const ParamDef& p : spec->params()) names.push_back(p.name);
  ASSERT_EQ(names.size(), 1 + 2 * (2 + 3 * 3) + 2);
  EXPECT_EQ(names[0], "emb");
  EXPECT_EQ(names[1], "layers.0.norm");
  EXPECT_EQ(names[2], "layers.0.router");
  EXPECT_EQ(names[3], "layers.0.experts.0.wg");
  EXPECT_EQ(names[4], "layers.0.experts.0.wu");
  EXPECT_EQ(names[5], "layers.0.experts.0.wd");
  EXPECT_EQ(names[6], "layers.0.experts.1.wg");
  EXPECT_EQ(names[12], "layers.1.norm");
  EXPECT_EQ(names[names.size() - 2], "final_norm");
  EXPECT_EQ(names.back(), "out");
  const std::vector<ParamDef>& p = spec->params();
  EXPECT_THAT(p[0].shape, ElementsAre(11, 4));
  EXPECT_THAT(p[2].shape, ElementsAre(4, 3));
  EXPECT_THAT(p[3].shape, ElementsAre(4, 5));
  EXPECT_THAT(p[5].shape, ElementsAre(5, 4));
  EXPECT_THAT(p.back().shape, ElementsAre(4, 11));
  // The index accessors name the same parameters.
  EXPECT_EQ(p[spec->norm(1)].name, "layers.1.norm");
  EXPECT_EQ(p[spec->router(1)].name, "layers.1.router");
  EXPECT_EQ(p[spec->expert_param(1, 2, ExpertMatrix::kUp)].name, "layers.1.experts.2.wu");
  EXPECT_EQ(p[spec->final_norm()].name, "final_norm");
  EXPECT_EQ(p[spec->out()].name, "out");
  EXPECT_EQ(p[spec->expert_param(1, 2, ExpertMatrix::kDown)].expert, 2);
  EXPECT_EQ(p[spec->router(1)].expert, -1);
}

TEST(MoeLmSpecTest, StagesAndWhoReadsWhat) {
  absl::StatusOr<MoeLmSpec> spec = MoeLmSpec::Create(Small());
  ASSERT_TRUE(spec.ok());
  const std::vector<StageDef>& s = spec->stages();
  ASSERT_EQ(s.size(), 4u);
  EXPECT_EQ(s[0].kind, StageKind::kEmbedding);
  EXPECT_FALSE(s[0].backward_reads_params);
  EXPECT_EQ(s[1].kind, StageKind::kLayer);
  EXPECT_EQ(s[2].layer, 1);
  EXPECT_EQ(s[3].kind, StageKind::kHead);
  EXPECT_EQ(spec->StageOf(spec->emb()), 0);
  EXPECT_EQ(spec->StageOf(spec->router(1)), 2);
  EXPECT_EQ(spec->StageOf(spec->expert_param(0, 1, ExpertMatrix::kGate)), 1);
  EXPECT_EQ(spec->StageOf(spec->out()), 3);
}

TEST(MoeLmSpecTest, InitialisationIsSeededAndScaled) {
  MoeLmConfig c = Small();
  c.vocab = 64;
  c.dim = 32;
  c.init_std = 0.25f;
  absl::StatusOr<MoeLmSpec> spec = MoeLmSpec::Create(c);
  ASSERT_TRUE(spec.ok());
  NamedParams a = spec->InitialParameters(3), b = spec->InitialParameters(3);
  NamedParams other = spec->InitialParameters(4);
  EXPECT_EQ(a, b);
  EXPECT_NE(a.at("out"), other.at("out"));
  for (float g : a.at("final_norm")) EXPECT_EQ(g, 1.0f);
  auto stddev = [](const std::vector<float>& v) {
    double s = 0, s2 = 0;
    for (float x : v) {
      s += x;
      s2 += double{x} * x;
    }
    const double mean = s / v.size();
    return std::sqrt(s2 / v.size() - mean * mean);
  };
  // 2048 draws each: the sample deviation is within a few percent of the target.
  EXPECT_NEAR(stddev(a.at("emb")), 1.0, 0.08);
  EXPECT_NEAR(stddev(a.at("out")), 0.25, 0.02);
}

TEST(MoeLmSpecTest, BadSizesNameTheField) {
  MoeLmConfig c = Small();
  c.top_k = 4;
  absl::StatusOr<MoeLmSpec> spec = MoeLmSpec::Create(c);
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(spec.status().message(), HasSubstr("model.top_k=4"));
  c = Small();
  c.dim = 0;
  spec = MoeLmSpec::Create(c);
  EXPECT_THAT(spec.status().message(), HasSubstr("model.dim=0"));
}

// MTP (SEMANTICS.md §15.1): per depth, the block's four parameters and a layer's after `out`
// (the main model's initial values unchanged), a kMtp stage per depth before the head, its
// layer indexed after the main layers; and the config's MTP errors named.
TEST(MoeLmSpecTest, MtpDepthsAfterTheMainModel) {
  MoeLmConfig c = Small();
  c.mtp_depth = 2;
  absl::StatusOr<MoeLmSpec> spec = MoeLmSpec::Create(c);
  ASSERT_TRUE(spec.ok()) << spec.status();
  const std::vector<ParamDef>& p = spec->params();
  const size_t main = 1 + 2 * (2 + 3 * 3) + 2, depth = 4 + 2 + 3 * 3;
  ASSERT_EQ(p.size(), main + 2 * depth);
  EXPECT_EQ(p[main - 1].name, "out");
  EXPECT_EQ(p[main].name, "mtp.1.hnorm");
  EXPECT_EQ(p[main + 1].name, "mtp.1.enorm");
  EXPECT_EQ(p[main + 2].name, "mtp.1.proj_h");
  EXPECT_EQ(p[main + 3].name, "mtp.1.proj_e");
  EXPECT_EQ(p[main + 4].name, "mtp.1.norm");
  EXPECT_EQ(p[main + 5].name, "mtp.1.router");
  EXPECT_EQ(p[main + 6].name, "mtp.1.experts.0.wg");
  EXPECT_EQ(p.back().name, "mtp.2.experts.2.wd");
  EXPECT_THAT(p[main + 2].shape, ElementsAre(4, 4));
  EXPECT_EQ(p[spec->mtp_proj_e(2)].name, "mtp.2.proj_e");
  EXPECT_EQ(spec->mtp_layer(2), 3);
  EXPECT_EQ(spec->moe_layers(), 4);
  EXPECT_EQ(p[spec->router(3)].name, "mtp.2.router");
  EXPECT_EQ(p[spec->expert_param(3, 1, ExpertMatrix::kUp)].layer, 3);
  EXPECT_EQ(p[spec->final_norm()].name, "final_norm");
  EXPECT_EQ(p[spec->out()].name, "out");
  const std::vector<StageDef>& s = spec->stages();
  ASSERT_EQ(s.size(), 1 + 2 + 2 + 1u);
  EXPECT_EQ(s[3].kind, StageKind::kMtp);
  EXPECT_EQ(s[3].layer, 2);
  EXPECT_EQ(s[4].layer, 3);
  EXPECT_EQ(s[5].kind, StageKind::kHead);
  EXPECT_EQ(spec->StageOf(spec->mtp_hnorm(1)), 3);
  EXPECT_EQ(spec->StageOf(spec->out()), 5);
  EXPECT_EQ(spec->StageOf(spec->emb()), 0);
  // The main model's initial values do not move.
  absl::StatusOr<MoeLmSpec> off = MoeLmSpec::Create(Small());
  ASSERT_TRUE(off.ok());
  const NamedParams a = off->InitialParameters(7), b = spec->InitialParameters(7);
  for (const auto& [name, values] : a) EXPECT_EQ(b.at(name), values) << name;
  for (const auto& [field, bad] : {std::pair<const char*, MoeLmConfig>{"mtp_depth=-1",
                                                                       [] {
                                                                         MoeLmConfig x = Small();
                                                                         x.mtp_depth = -1;
                                                                         return x;
                                                                       }()},
                                   {"mtp_scale=3",
                                    [] {
                                      MoeLmConfig x = Small();
                                      x.mtp_depth = 2;
                                      x.mtp_scale = 3;
                                      return x;
                                    }()},
                                   {"expert_bias_speed", [] {
                                      MoeLmConfig x = Small();
                                      x.mtp_depth = 1;
                                      x.expert_bias_speed = 0.01;
                                      return x;
                                    }()}}) {
    absl::StatusOr<MoeLmSpec> r = MoeLmSpec::Create(bad);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_THAT(r.status().message(), HasSubstr(field));
  }
}

}  // namespace
}  // namespace gradsum::model
