#include "train/config.h"

#include <cstdio>
#include <fstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace gradsum::train {
namespace {

using ::testing::HasSubstr;

TEST(ConfigTest, DefaultsAreValid) {
  TrainConfig c;
  EXPECT_EQ(c.model().vocab(), 256);
  EXPECT_EQ(c.backend(), TrainConfig::thread);
  EXPECT_TRUE(ValidateConfig(c).ok()) << ValidateConfig(c);
}

TEST(ConfigTest, ParsesTextproto) {
  absl::StatusOr<TrainConfig> c = ParseConfigText(R"pb(
    model { dim: 32 experts: 4 top_k: 1 norm_topk_prob: false }
    world: 4
    ep: 2
    grad_acc: 3
    sharding: "replicated"
    optim { lr: 0.5 }
  )pb");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->model().dim(), 32);
  EXPECT_EQ(c->model().experts(), 4);
  EXPECT_FALSE(c->model().norm_topk_prob());
  EXPECT_EQ(c->model().layers(), 2);  // default kept
  EXPECT_EQ(c->world(), 4);
  EXPECT_EQ(c->grad_acc(), 3);
  EXPECT_EQ(c->sharding(), TrainConfig::replicated);
  EXPECT_DOUBLE_EQ(c->optim().lr(), 0.5);
}

// The choices read as bare words or, as config files written before they were enums
// have them, quoted; comments, tabs and nested messages around them do not matter.
TEST(ConfigTest, EnumFieldsReadBareOrQuotedWords) {
  absl::StatusOr<TrainConfig> c = ParseConfigText(
      "# a run\n"
      "backend: mpi  # trailing comment\n"
      "model { dim: 16 }\n"
      "\tsharding: \"replicated\" reduce_dtype: 'bf16'\n"
      "compute_dtype:bf16 ce_mode: \"square\"; data { path: \"sample\" }\n");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->backend(), TrainConfig::mpi);
  EXPECT_EQ(c->sharding(), TrainConfig::replicated);
  EXPECT_EQ(c->reduce_dtype(), TrainConfig::bf16);
  EXPECT_EQ(c->compute_dtype(), TrainConfig::bf16);
  EXPECT_EQ(c->ce_mode(), TrainConfig::square);
  EXPECT_EQ(c->model().dim(), 16);
  EXPECT_EQ(c->data().path(), "sample");  // a string field keeps its quotes' content
}

// An unknown word, bare or quoted, names the field, the word, the allowed words and where;
// a syntax error after an unquoted word keeps the parser's line and column.
TEST(ConfigTest, UnknownEnumWordNamesTheAllowedWords) {
  for (const char* text : {"world: 2\n  sharding: zero\n", "world: 2\n  sharding: \"zero\"\n"}) {
    absl::StatusOr<TrainConfig> c = ParseConfigText(text);
    ASSERT_FALSE(c.ok()) << text;
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(c.status().message(),
                HasSubstr("line 2:13: sharding=zero: must be fsdp or replicated"));
  }
  absl::StatusOr<TrainConfig> c = ParseConfigText("sharding: \"fsdp\"\n\tworld: x\n");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("line 2:16"));  // the tab counts to column 8
}

TEST(ConfigTest, UnknownFieldIsInvalidArgumentWithLine) {
  absl::StatusOr<TrainConfig> c = ParseConfigText("world: 2\nwrold: 4\n");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("line 2"));
  EXPECT_THAT(c.status().message(), HasSubstr("wrold"));
}

TEST(ConfigTest, MissingFileIsNotFound) {
  absl::StatusOr<TrainConfig> c = LoadConfigFile("/nonexistent/run.textproto");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(c.status().message(), HasSubstr("/nonexistent/run.textproto"));
}

TEST(ConfigTest, LoadsFile) {
  const std::string path = ::testing::TempDir() + "/run.textproto";
  std::ofstream(path) << "steps: 7 model { layers: 3 }\n";
  absl::StatusOr<TrainConfig> c = LoadConfigFile(path);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->steps(), 7);
  EXPECT_EQ(c->model().layers(), 3);
  std::ofstream(path) << "steps: seven\n";
  c = LoadConfigFile(path);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr(path));
}

TEST(ConfigTest, OverridesSetNestedFieldsOfEveryType) {
  TrainConfig c;
  ASSERT_TRUE(ApplyOverrides({{"world", "8"},
                              {"model.dim", "16"},
                              {"model.norm_topk_prob", "false"},
                              {"model.router_scale", "2.5"},
                              {"optim.lr", "1e-4"},
                              {"seed", "18446744073709551615"},
                              {"data.path", "/tmp/x.txt"},
                              {"backend", "mpi"},
                              {"data.corpus_documents", "123"}},
                             &c)
                  .ok());
  EXPECT_EQ(c.world(), 8);
  EXPECT_EQ(c.model().dim(), 16);
  EXPECT_FALSE(c.model().norm_topk_prob());
  EXPECT_FLOAT_EQ(c.model().router_scale(), 2.5f);
  EXPECT_DOUBLE_EQ(c.optim().lr(), 1e-4);
  EXPECT_EQ(c.seed(), 18446744073709551615ull);
  EXPECT_EQ(c.data().path(), "/tmp/x.txt");
  EXPECT_EQ(c.backend(), TrainConfig::mpi);
  EXPECT_EQ(c.data().corpus_documents(), 123);
}

TEST(ConfigTest, BadOverridesNameThePathAndValue) {
  struct Case {
    FieldOverride o;
    const char* expect;
  };
  for (const Case& k :
       {Case{{"model.dim", "abc"}, "model.dim=abc"},
        Case{{"world", "99999999999"}, "world=99999999999"},
        Case{{"resume", "maybe"}, "resume=maybe"}, Case{{"optim.lr", "fast"}, "optim.lr=fast"},
        Case{{"seed", "-1"}, "seed=-1"}, Case{{"model.dimm", "3"}, "model.dimm"},
        Case{{"model", "3"}, "names a message"}, Case{{"world.x", "3"}, "world.x"},
        // An enum field names the allowed words; the words are exact (lowercase).
        Case{{"backend", "gloo"}, "backend=gloo: must be thread, mpi or nccl"},
        Case{{"sharding", "zero1"}, "sharding=zero1: must be fsdp or replicated"},
        Case{{"sharding", "FSDP"}, "sharding=FSDP: must be fsdp or replicated"},
        Case{{"ce_mode", "mean"}, "ce_mode=mean: must be token, sample or square"},
        Case{{"reduce_dtype", "f16"}, "reduce_dtype=f16: must be f32 or bf16"},
        Case{{"compute_dtype", "1"}, "compute_dtype=1: must be f32 or bf16"}}) {
    TrainConfig c;
    absl::Status s = ApplyOverrides({k.o}, &c);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << k.o.path;
    EXPECT_THAT(s.message(), HasSubstr(k.expect));
  }
}

// Each bad config fails validation with InvalidArgument naming the field and value.
TEST(ConfigTest, ValidationNamesFieldAndValue) {
  struct Case {
    std::vector<FieldOverride> overrides;
    const char* expect;
  };
  const Case cases[] = {
      {{{"world", "3"}}, "ep=2"},  // world % ep
      {{{"world", "4"}, {"ep", "4"}, {"model.experts", "6"}}, "ep=4: must divide model.experts=6"},
      {{{"model.top_k", "9"}}, "model.top_k=9"},
      {{{"model.vocab", "300"}}, "model.vocab=300"},
      {{{"model.dim", "0"}}, "model.dim=0"},
      {{{"model.layers", "-1"}}, "model.layers=-1"},
      {{{"model.experts", "0"}}, "model.experts=0"},
      {{{"model.top_k", "0"}}, "model.top_k=0"},
      {{{"model.expert_dim", "0"}}, "model.expert_dim=0"},
      {{{"world", "0"}}, "world=0"},
      {{{"ep", "0"}}, "ep=0"},
      {{{"grad_acc", "0"}}, "grad_acc=0"},
      {{{"steps", "-2"}}, "steps=-2"},
      {{{"data.micro_batch", "0"}}, "data.micro_batch=0"},
      {{{"data.seq_len", "1"}}, "data.seq_len=1"},
      {{{"data.max_doc_len", "500"}}, "data.max_doc_len=500"},
      {{{"data.min_doc_len", "1"}}, "data.min_doc_len=1"},
      {{{"data.min_doc_len", "50"}, {"data.max_doc_len", "40"}}, "data.max_doc_len=40"},
      {{{"data.corpus_documents", "0"}}, "data.corpus_documents=0"},
      {{{"model.router_scale", "0"}}, "model.router_scale=0"},
      {{{"model.init_std", "-1"}}, "model.init_std=-1"},
      {{{"optim.lr", "0"}}, "optim.lr=0"},
      {{{"optim.lr", "nan"}}, "optim.lr=nan"},
      {{{"optim.beta1", "1"}}, "optim.beta1=1"},
      {{{"optim.beta2", "-0.1"}}, "optim.beta2=-0.1"},
      {{{"optim.eps", "0"}}, "optim.eps=0"},
      {{{"optim.weight_decay", "-1"}}, "optim.weight_decay=-1"},
      {{{"optim.grad_clip", "-1"}}, "optim.grad_clip=-1"},
      {{{"optim.warmup_steps", "-1"}}, "optim.warmup_steps=-1"},
      {{{"alpha_b", "-0.5"}}, "alpha_b=-0.5"},
      {{{"alpha_z", "inf"}}, "alpha_z=inf"},
      {{{"checkpoint_every", "-1"}}, "checkpoint_every=-1"},
      {{{"checkpoint_every", "5"}}, "checkpoint_every=5: needs checkpoint_dir"},
      {{{"resume", "true"}}, "resume=true: needs checkpoint_dir"},
      {{{"parity_tolerance", "0"}}, "parity_tolerance=0"},
      {{{"timeout_s", "0"}}, "timeout_s=0"},
      {{{"layers_per_unit", "0"}}, "layers_per_unit=0"},
      {{{"bucket_cap_mb", "0"}}, "bucket_cap_mb=0"},
      {{{"first_bucket_mb", "-1"}}, "first_bucket_mb=-1"},
      {{{"reproducible", "true"}, {"backend", "nccl"}},
       "reproducible=true: is implemented for the CPU backends (thread, mpi) only, not "
       "backend=nccl"},
      {{{"reproducible", "true"}, {"reduce_dtype", "bf16"}}, "reproducible=true: reduces"},
  };
  for (const Case& k : cases) {
    TrainConfig c;
    ASSERT_TRUE(ApplyOverrides(k.overrides, &c).ok()) << k.expect;
    absl::Status s = ValidateConfig(c);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << k.expect << ": " << s;
    EXPECT_THAT(s.message(), HasSubstr(k.expect));
  }
}

TEST(ConfigTest, ShortTextListsDefaultsAndRoundTrips) {
  TrainConfig c;
  ASSERT_TRUE(ApplyOverrides({{"model.dim", "48"}, {"sharding", "replicated"}}, &c).ok());
  const std::string text = ConfigToShortText(c);
  EXPECT_THAT(text, HasSubstr("dim: 48"));
  EXPECT_THAT(text, HasSubstr("experts: 8"));  // a default, written out
  EXPECT_EQ(text.find('\n'), std::string::npos);
  absl::StatusOr<TrainConfig> back = ParseConfigText(text);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->model().dim(), 48);
  EXPECT_EQ(back->sharding(), TrainConfig::replicated);
  EXPECT_EQ(back->model().experts(), 8);
}


TEST(ConfigTest, ConfigMustBeARegularFile) {
  for (const std::string& path : {::testing::TempDir(), std::string("/dev/zero")}) {
    absl::StatusOr<TrainConfig> c = LoadConfigFile(path);
    EXPECT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition) << path;
    EXPECT_THAT(c.status().message(), HasSubstr("--config=" + path + ": not a regular file"));
  }
}

TEST(ConfigTest, FieldsListEveryValueAndResolvedConfigSetsThem) {
  TrainConfig c;
  c.mutable_optim()->set_lr(0.5);
  const std::vector<FieldOverride> fields = ConfigFields(c);
  auto value = [&](const std::string& path) {
    for (const FieldOverride& f : fields) {
      if (f.path == path) return f.value;
    }
    return std::string("<missing>");
  };
  EXPECT_EQ(value("optim.lr"), "0.5");
  EXPECT_EQ(value("model.experts"), "8");       // a default
  EXPECT_EQ(value("backend"), "thread");   // as textproto: the enum value's name
  EXPECT_EQ(value("data.path"), "\"\"");
  const TrainConfig resolved = ResolvedConfig(c);
  EXPECT_TRUE(resolved.has_backend());
  EXPECT_TRUE(resolved.data().has_path());
  EXPECT_EQ(ConfigToShortText(resolved), ConfigToShortText(c));
}

}  // namespace
}  // namespace gradsum::train
