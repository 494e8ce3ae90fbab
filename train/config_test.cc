#include "train/config.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace gradsum::train {
namespace {

using ::testing::HasSubstr;

TEST(ConfigTest, DefaultsAreValid) {
  TrainConfig c;
  EXPECT_EQ(c.model().vocab(), 256);
  EXPECT_EQ(c.comm().backend(), TrainConfig::thread);
  EXPECT_TRUE(ValidateConfig(c).ok()) << ValidateConfig(c);
}

// The GPU backend runs what the CPU ones do of HSDP, MTP and full recomputation (the NCCL
// shard groups, CudaOps); context parallelism it still refuses (no CUDA ring kernel).
TEST(ConfigTest, TheNcclBackendTakesHsdpMtpAndFullRecomputation) {
  TrainConfig c;
  ASSERT_TRUE(ApplyOverrides({{"comm.backend", "nccl"},
                              {"parallelism.world", "4"},
                              {"parallelism.sharding", "hsdp"},
                              {"parallelism.shard_group", "2"},
                              {"parallelism.recompute", "full"},
                              {"model.mtp_depth", "1"}},
                             &c)
                  .ok());
  EXPECT_TRUE(ValidateConfig(c).ok()) << ValidateConfig(c);
}

TEST(ConfigTest, ParsesTextproto) {
  absl::StatusOr<TrainConfig> c = ParseConfigText(R"pb(
    model { dim: 32 experts: 4 top_k: 1 norm_topk_prob: false }
    parallelism { world: 4 ep: 2 grad_acc: 3 sharding: replicated }
    optim { lr: 0.5 }
  )pb");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->model().dim(), 32);
  EXPECT_EQ(c->model().experts(), 4);
  EXPECT_FALSE(c->model().norm_topk_prob());
  EXPECT_EQ(c->model().layers(), 2);  // default kept
  EXPECT_EQ(c->parallelism().world(), 4);
  EXPECT_EQ(c->parallelism().grad_acc(), 3);
  EXPECT_EQ(c->parallelism().sharding(), TrainConfig::replicated);
  EXPECT_DOUBLE_EQ(c->optim().lr(), 0.5);
}

// The choices read as bare words or, as config files written before they were enums
// have them, quoted; comments, tabs and nested messages around them do not matter.
TEST(ConfigTest, EnumFieldsReadBareOrQuotedWords) {
  absl::StatusOr<TrainConfig> c = ParseConfigText(
      "# a run\n"
      "comm { backend: mpi }  # trailing comment\n"
      "model { dim: 16 }\n"
      "\tparallelism { sharding: \"replicated\" } precision { reduce_dtype: 'bf16'\n"
      "compute_dtype:bf16 } loss { ce_mode: \"square\" }; data { path: \"sample\" }\n");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->comm().backend(), TrainConfig::mpi);
  EXPECT_EQ(c->parallelism().sharding(), TrainConfig::replicated);
  EXPECT_EQ(c->precision().reduce_dtype(), TrainConfig::bf16);
  EXPECT_EQ(c->precision().compute_dtype(), TrainConfig::bf16);
  EXPECT_EQ(c->loss().ce_mode(), TrainConfig::square);
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
                HasSubstr("line 2:13: sharding=zero: must be fsdp, replicated or hsdp"));
  }
  absl::StatusOr<TrainConfig> c = ParseConfigText("sharding: \"fsdp\"\n\tworld: x\n");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("line 2:16"));  // the tab counts to column 8
}

// A file in the layout before config sections (every old top-level field set, enums bare
// and quoted) gives the same config as the same settings written in sections.
TEST(ConfigTest, TopLevelFieldsOfTheOldLayoutReadIntoTheirSections) {
  absl::StatusOr<TrainConfig> old = ParseConfigText(R"pb(
    model { dim: 32 }
    world: 4
    ep: 4
    grad_acc: 3
    steps: 9
    backend: "mpi"
    sharding: replicated
    reduce_dtype: "bf16"
    compute_dtype: bf16
    seed: 7
    alpha_b: 0.5
    alpha_z: 0.25
    dump_dir: "/d"
    metrics: "/m.jsonl"
    checkpoint_dir: "/c"
    checkpoint_every: 3
    resume: true
    parity_check: true
    parity_tolerance: 0.001
    timeout_s: 30
    ce_mode: 'square'
    nccl_skip_agreement: true
    layers_per_unit: 2
    reshard_after_forward: false
    reduce_every_micro_batch: false
    bucket_cap_mb: 4
    first_bucket_mb: 0.5
    export_path: "/e.safetensors"
    init_from: "/i.safetensors"
    reproducible: true
  )pb");
  ASSERT_TRUE(old.ok()) << old.status();
  absl::StatusOr<TrainConfig> sections = ParseConfigText(R"pb(
    model { dim: 32 seed: 7 }
    optim { steps: 9 }
    loss { ce_mode: square alpha_b: 0.5 alpha_z: 0.25 }
    precision { compute_dtype: bf16 reduce_dtype: bf16 reproducible: true }
    parallelism {
      world: 4
      ep: 4
      grad_acc: 3
      sharding: replicated
      layers_per_unit: 2
      reshard_after_forward: false
      reduce_every_micro_batch: false
    }
    comm {
      backend: mpi
      timeout_s: 30
      nccl_skip_agreement: true
      bucket_cap_mb: 4
      first_bucket_mb: 0.5
    }
    checkpoint {
      dir: "/c"
      every: 3
      resume: true
      export_path: "/e.safetensors"
      init_from: "/i.safetensors"
    }
    log { metrics: "/m.jsonl" }
    debug { dump_dir: "/d" parity_check: true parity_tolerance: 0.001 }
  )pb");
  ASSERT_TRUE(sections.ok()) << sections.status();
  EXPECT_EQ(ConfigToShortText(*old), ConfigToShortText(*sections));
  EXPECT_EQ(old->parallelism().world(), 4);
  EXPECT_EQ(old->comm().backend(), TrainConfig::mpi);
  // Every field of the old layout has a place: a config with all of them set differs from
  // the defaults in each (so none was dropped on the way).
  const std::vector<FieldOverride> got = ConfigFields(*old);
  const std::vector<FieldOverride> defaults = ConfigFields(TrainConfig());
  ASSERT_EQ(got.size(), defaults.size());
  int changed = 0;
  for (size_t i = 0; i < got.size(); ++i) changed += got[i].value != defaults[i].value;
  EXPECT_EQ(changed, 29 + 1);  // the 29 old top-level fields and model.dim
}

// The config a checkpoint's commit marker holds, as the binary before config sections wrote
// it (ConfigToShortText of that layout): it still parses, to the same settings.
TEST(ConfigTest, MarkerConfigOfTheOldLayoutParses) {
  const char* old_marker_config =
      "model { vocab: 256 dim: 32 layers: 2 experts: 8 top_k: 2 expert_dim: 32 "
      "norm_topk_prob: true router_scale: 1 init_std: 0.1 } data { path: \"\" seq_len: 128 "
      "micro_batch: 4 corpus_seed: 20261202 min_doc_len: 8 max_doc_len: 96 corpus_documents: "
      "1048576 } optim { lr: 0.01 beta1: 0.9 beta2: 0.95 eps: 1e-08 weight_decay: 0 "
      "grad_clip: 1 warmup_steps: 10 } world: 4 ep: 2 grad_acc: 1 steps: 3 backend: thread "
      "sharding: fsdp reduce_dtype: f32 compute_dtype: f32 seed: 1 alpha_b: 0.001 alpha_z: "
      "0.001 dump_dir: \"\" metrics: \"\" checkpoint_dir: \"/tmp/ckpt\" checkpoint_every: 0 "
      "resume: false parity_check: false parity_tolerance: 1e-05 timeout_s: 120 ce_mode: "
      "token nccl_skip_agreement: false layers_per_unit: 1 reshard_after_forward: true "
      "reduce_every_micro_batch: true bucket_cap_mb: 25 first_bucket_mb: 1 export_path: \"\" "
      "init_from: \"\" reproducible: false";
  absl::StatusOr<TrainConfig> c = ParseConfigText(old_marker_config);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->parallelism().world(), 4);
  EXPECT_EQ(c->parallelism().grad_acc(), 1);
  EXPECT_EQ(c->optim().steps(), 3);
  EXPECT_EQ(c->checkpoint().dir(), "/tmp/ckpt");
  EXPECT_EQ(c->data().micro_batch(), 4);
  TrainConfig want;
  ASSERT_TRUE(ApplyOverrides({{"model.dim", "32"},
                              {"model.expert_dim", "32"},
                              {"data.micro_batch", "4"},
                              {"parallelism.world", "4"},
                              {"parallelism.grad_acc", "1"},
                              {"optim.steps", "3"},
                              {"checkpoint.dir", "/tmp/ckpt"}},
                             &want)
                  .ok());
  EXPECT_EQ(ConfigToShortText(*c), ConfigToShortText(want));
}

TEST(ConfigTest, BothSpellingsOfAFieldMustAgree) {
  absl::StatusOr<TrainConfig> c = ParseConfigText("world: 4\nparallelism { world: 2 }\n");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("world=4 and parallelism.world=2"));
  c = ParseConfigText("sharding: \"replicated\" parallelism { sharding: fsdp }");
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("sharding=replicated and parallelism.sharding=fsdp"));
  c = ParseConfigText("checkpoint_dir: \"/a\" checkpoint { dir: \"/b\" }");
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("checkpoint_dir=\"/a\" and checkpoint.dir=\"/b\""));
  // The same value twice is one setting.
  c = ParseConfigText("steps: 5 optim { steps: 5 lr: 0.1 }");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->optim().steps(), 5);
  EXPECT_DOUBLE_EQ(c->optim().lr(), 0.1);
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
  EXPECT_EQ(c->optim().steps(), 7);  // a file in the layout before sections
  EXPECT_EQ(c->model().layers(), 3);
  std::ofstream(path) << "steps: seven\n";
  c = LoadConfigFile(path);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr(path));
}

TEST(ConfigTest, OverridesSetNestedFieldsOfEveryType) {
  TrainConfig c;
  ASSERT_TRUE(ApplyOverrides({{"parallelism.world", "8"},
                              {"model.dim", "16"},
                              {"model.norm_topk_prob", "false"},
                              {"model.router_scale", "2.5"},
                              {"optim.lr", "1e-4"},
                              {"model.seed", "18446744073709551615"},
                              {"data.path", "/tmp/x.txt"},
                              {"comm.backend", "mpi"},
                              {"data.corpus_documents", "123"}},
                             &c)
                  .ok());
  EXPECT_EQ(c.parallelism().world(), 8);
  EXPECT_EQ(c.model().dim(), 16);
  EXPECT_FALSE(c.model().norm_topk_prob());
  EXPECT_FLOAT_EQ(c.model().router_scale(), 2.5f);
  EXPECT_DOUBLE_EQ(c.optim().lr(), 1e-4);
  EXPECT_EQ(c.model().seed(), 18446744073709551615ull);
  EXPECT_EQ(c.data().path(), "/tmp/x.txt");
  EXPECT_EQ(c.comm().backend(), TrainConfig::mpi);
  EXPECT_EQ(c.data().corpus_documents(), 123);
}

TEST(ConfigTest, BadOverridesNameThePathAndValue) {
  struct Case {
    FieldOverride o;
    const char* expect;
  };
  for (const Case& k :
       {Case{{"model.dim", "abc"}, "model.dim=abc"},
        Case{{"parallelism.world", "99999999999"}, "parallelism.world=99999999999"},
        Case{{"checkpoint.resume", "maybe"}, "checkpoint.resume=maybe"},
        Case{{"optim.lr", "fast"}, "optim.lr=fast"}, Case{{"model.seed", "-1"}, "model.seed=-1"},
        Case{{"model.dimm", "3"}, "model.dimm"}, Case{{"model", "3"}, "names a message"},
        Case{{"parallelism.world.x", "3"}, "parallelism.world.x"},
        // Overrides take the sections' paths only (the old top-level names are for files).
        Case{{"world", "3"}, "override 'world': no such config field"},
        // An enum field names the allowed words; the words are exact (lowercase).
        Case{{"comm.backend", "gloo"}, "comm.backend=gloo: must be thread, mpi or nccl"},
        Case{{"parallelism.sharding", "zero1"},
             "parallelism.sharding=zero1: must be fsdp, replicated or hsdp"},
        Case{{"parallelism.sharding", "FSDP"},
             "parallelism.sharding=FSDP: must be fsdp, replicated or hsdp"},
        Case{{"loss.ce_mode", "mean"}, "loss.ce_mode=mean: must be token, sample or square"},
        Case{{"precision.reduce_dtype", "f16"}, "precision.reduce_dtype=f16: must be f32 or bf16"},
        Case{{"precision.compute_dtype", "1"}, "precision.compute_dtype=1: must be f32 or bf16"}}) {
    TrainConfig c;
    absl::Status s = ApplyOverrides({k.o}, &c);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << k.o.path;
    EXPECT_THAT(s.message(), HasSubstr(k.expect));
  }
}

// model.vocab must be 256 for the embedded corpora only: a data.path file is held to the
// vocabulary when it is read (data/corpus.h CheckCorpusVocab).
TEST(ConfigTest, AnotherVocabNeedsAFile) {
  TrainConfig c;
  c.mutable_model()->set_vocab(50304);
  EXPECT_THAT(ValidateConfig(c).message(), HasSubstr("model.vocab=50304"));
  c.mutable_data()->set_path("tokens.bin");
  EXPECT_TRUE(ValidateConfig(c).ok()) << ValidateConfig(c);
}

// Each bad config fails validation with InvalidArgument naming the field and value.
TEST(ConfigTest, ValidationNamesFieldAndValue) {
  struct Case {
    std::vector<FieldOverride> overrides;
    const char* expect;
  };
  const Case cases[] = {
      {{{"parallelism.world", "3"}}, "parallelism.ep=2: must divide parallelism.world=3"},
      {{{"parallelism.world", "4"}, {"parallelism.ep", "4"}, {"model.experts", "6"}},
       "parallelism.ep=4: must divide model.experts=6"},
      {{{"model.top_k", "9"}}, "model.top_k=9"},
      {{{"model.vocab", "300"}}, "model.vocab=300"},
      {{{"model.dim", "0"}}, "model.dim=0"},
      {{{"model.layers", "-1"}}, "model.layers=-1"},
      {{{"model.experts", "0"}}, "model.experts=0"},
      {{{"model.top_k", "0"}}, "model.top_k=0"},
      {{{"model.expert_dim", "0"}}, "model.expert_dim=0"},
      {{{"parallelism.world", "0"}}, "parallelism.world=0"},
      {{{"parallelism.ep", "0"}}, "parallelism.ep=0"},
      {{{"parallelism.grad_acc", "0"}}, "parallelism.grad_acc=0"},
      {{{"optim.steps", "-2"}}, "optim.steps=-2"},
      {{{"data.micro_batch", "0"}}, "data.micro_batch=0"},
      {{{"data.seq_len", "1"}}, "data.seq_len=1"},
      {{{"data.max_doc_len", "500"}}, "data.max_doc_len=500"},
      {{{"data.min_doc_len", "1"}}, "data.min_doc_len=1"},
      {{{"data.min_doc_len", "50"}, {"data.max_doc_len", "40"}}, "data.max_doc_len=40"},
      {{{"data.corpus_documents", "0"}}, "data.corpus_documents=0"},
      {{{"data.eod_token", "-2"}}, "data.eod_token=-2"},
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
      {{{"optim.lr_decay", "cosine"}, {"optim.min_lr", "0.5"}},
       "optim.min_lr=0.5: must be in [0, optim.lr=0.01]"},
      {{{"checkpoint.keep", "-1"}}, "checkpoint.keep=-1: must be >= 0"},
      {{{"log.every", "0"}}, "log.every=0: must be >= 1"},
      {{{"log.peak_tflops", "-1"}}, "log.peak_tflops=-1: must be finite and >= 0"},
      {{{"log.peak_tflops", "inf"}}, "log.peak_tflops=inf: must be finite and >= 0"},
      {{{"log.eval_every", "-1"}}, "log.eval_every=-1: must be >= 0"},
      {{{"log.eval_micro_batches", "0"}}, "log.eval_micro_batches=0: must be >= 1"},
      {{{"log.eval_every", "5"}, {"data.path", "/tmp/x.txt"}},
       "log.eval_every=5: with data.path=/tmp/x.txt needs data.eval_path"},
      {{{"checkpoint.keep", "2"}}, "checkpoint.keep=2: needs checkpoint.dir"},
      {{{"checkpoint.save_on_signal", "true"}},
       "checkpoint.save_on_signal=true: needs checkpoint.dir"},
      {{{"loss.alpha_b", "-0.5"}}, "loss.alpha_b=-0.5"},
      {{{"loss.alpha_z", "inf"}}, "loss.alpha_z=inf"},
      {{{"loss.label_smoothing", "-0.1"}}, "loss.label_smoothing=-0.1"},
      {{{"loss.label_smoothing", "1"}}, "loss.label_smoothing=1"},
      {{{"loss.label_smoothing", "nan"}}, "loss.label_smoothing=nan"},
      {{{"loss.logit_softcap", "-30"}}, "loss.logit_softcap=-30"},
      {{{"loss.logit_softcap", "inf"}}, "loss.logit_softcap=inf"},
      {{{"loss.alpha_lse", "-1e-4"}}, "loss.alpha_lse=-0.0001"},
      {{{"loss.alpha_lse", "nan"}}, "loss.alpha_lse=nan"},
      {{{"checkpoint.every", "-1"}}, "checkpoint.every=-1"},
      {{{"checkpoint.every", "5"}}, "checkpoint.every=5: needs checkpoint.dir"},
      {{{"checkpoint.resume", "true"}}, "checkpoint.resume=true: needs checkpoint.dir"},
      {{{"checkpoint.resume", "true"}, {"checkpoint.dir", "/c"}, {"checkpoint.init_from", "x"}},
       "checkpoint.init_from=x: cannot be combined with checkpoint.resume"},
      {{{"checkpoint.resume", "true"}, {"checkpoint.dir", "/c"}, {"checkpoint.overwrite", "true"}},
       "checkpoint.overwrite=true: cannot be combined with checkpoint.resume"},
      {{{"checkpoint.overwrite", "true"}}, "checkpoint.overwrite=true: needs checkpoint.dir"},
      {{{"debug.parity_tolerance", "0"}}, "debug.parity_tolerance=0"},
      {{{"comm.timeout_s", "0"}}, "comm.timeout_s=0"},
      {{{"parallelism.layers_per_unit", "0"}}, "parallelism.layers_per_unit=0"},
      {{{"comm.bucket_cap_mb", "0"}}, "comm.bucket_cap_mb=0"},
      {{{"comm.first_bucket_mb", "-1"}}, "comm.first_bucket_mb=-1"},
      {{{"precision.reproducible", "true"}, {"comm.backend", "nccl"}},
       "precision.reproducible=true: is implemented for the CPU backends (thread, mpi) only, "
       "not comm.backend=nccl"},
      {{{"precision.reproducible", "true"}, {"precision.reduce_dtype", "bf16"}},
       "precision.reproducible=true: reduces"},
      // Attention (§10) and sequence parallelism (§12).
      {{{"parallelism.sp", "0"}}, "parallelism.sp=0"},
      {{{"parallelism.sp", "4"}}, "parallelism.sp=4: must divide parallelism.world=2"},
      {{{"parallelism.sp", "2"}, {"data.seq_len", "127"}, {"data.max_doc_len", "96"}},
       "parallelism.sp=2: must divide data.seq_len=127"},
      // Context parallelism (§16).
      {{{"parallelism.cp", "0"}}, "parallelism.cp=0"},
      {{{"parallelism.cp", "2"}, {"parallelism.sp", "2"}},
       "parallelism.cp=2: times parallelism.sp=2 must divide parallelism.world=2"},
      {{{"parallelism.cp", "2"}, {"data.seq_len", "126"}, {"data.max_doc_len", "96"}},
       "parallelism.cp=2: needs data.seq_len=126 to be a multiple of 2 cp"},
      {{{"parallelism.world", "8"},
        {"parallelism.cp", "2"},
        {"parallelism.sp", "4"},
        {"data.seq_len", "100"},
        {"data.max_doc_len", "96"}},
       "parallelism.cp=2: needs data.seq_len=100 to be a multiple of 2 cp (each of cp ranks "
       "holds two of 2 cp chunks) and seq_len / cp a multiple of parallelism.sp=4"},
      {{{"parallelism.cp", "2"}, {"comm.backend", "nccl"}},
       "parallelism.cp=2: is implemented for the CPU backends (thread, mpi) only"},
      {{{"model.attention", "causal"}, {"model.heads", "0"}}, "model.heads=0"},
      {{{"model.attention", "causal"}, {"model.kv_heads", "3"}},
       "model.kv_heads=3: must divide model.heads=4"},
      {{{"model.attention", "causal"}, {"model.heads", "3"}, {"model.kv_heads", "1"}},
       "model.heads=3: must divide model.dim=128 into an even head_dim"},
      {{{"model.attention", "causal"},
        {"model.heads", "2"},
        {"model.kv_heads", "2"},
        {"parallelism.world", "4"},
        {"parallelism.sp", "4"}},
       "parallelism.sp=4: must divide model.heads=2"},
      {{{"model.attention", "causal"}, {"model.rope_theta", "1"}}, "model.rope_theta=1"},
      {{{"precision.repro_block", "-1"}}, "precision.repro_block=-1"},
      // Multi-token prediction (§15.1).
      {{{"model.mtp_depth", "-1"}}, "model.mtp_depth=-1: must be >= 0"},
      {{{"model.mtp_depth", "16"},
        {"loss.mtp_scale", "1"},
        {"data.seq_len", "16"},
        {"data.max_doc_len", "16"},
        {"data.min_doc_len", "2"}},
       "model.mtp_depth=16: must be < data.seq_len=16"},
      {{{"model.mtp_depth", "2"}, {"loss.mtp_scale", "0"}},
       "loss.mtp_scale=0: must be in (0, model.mtp_depth=2]"},
      {{{"model.mtp_depth", "1"}, {"loss.mtp_scale", "1.5"}},
       "loss.mtp_scale=1.5: must be in (0, model.mtp_depth=1]"},
      {{{"model.mtp_depth", "1"}, {"loss.mtp_scale", "nan"}}, "loss.mtp_scale=nan"},
      {{{"model.mtp_depth", "1"}, {"loss.expert_bias_speed", "0.01"}},
       "model.mtp_depth=1: cannot be combined with loss.expert_bias_speed=0.01"},
      // The learning-rate schedule's ends (optim/lr_schedule.h).
      {{{"optim.lr_decay", "cosine"}, {"optim.min_lr", "0.02"}, {"optim.lr", "0.01"}},
       "optim.min_lr=0.02: must be in [0, optim.lr=0.01]"},
      {{{"optim.lr_decay", "cosine"}, {"optim.min_lr", "-1"}}, "optim.min_lr=-1"},
      {{{"optim.lr_decay", "cosine"}, {"optim.min_lr", "nan"}}, "optim.min_lr=nan"},
      {{{"optim.lr_decay", "linear"}, {"optim.decay_steps", "-3"}}, "optim.decay_steps=-3"},
      {{{"optim.lr_decay", "linear"}, {"optim.warmup_steps", "10"}, {"optim.steps", "10"}},
       "optim.lr_decay=linear: its end (optim.steps=10) must be after optim.warmup_steps=10"},
      {{{"optim.lr_decay", "cosine"}, {"optim.warmup_steps", "10"}, {"optim.decay_steps", "5"}},
       "optim.lr_decay=cosine: its end (optim.decay_steps=5)"},
      {{{"precision.repro_block", "48"}}, "precision.repro_block=48: must be 0 or divide the 128"},
      // HSDP (SEMANTICS.md §7): shard groups dividing the world, each holding whole EP
      // groups; the size only with sharding=hsdp.
      {{{"parallelism.sharding", "hsdp"},
        {"parallelism.world", "6"},
        {"parallelism.ep", "1"},
        {"parallelism.shard_group", "4"}},
       "parallelism.shard_group=4: must divide parallelism.world=6"},
      {{{"parallelism.sharding", "hsdp"},
        {"parallelism.world", "8"},
        {"parallelism.ep", "4"},
        {"parallelism.shard_group", "2"}},
       "parallelism.shard_group=2: must be a multiple of parallelism.ep=4"},
      {{{"parallelism.sharding", "hsdp"}, {"parallelism.shard_group", "-2"}},
       "parallelism.shard_group=-2: must be >= 0"},
      {{{"parallelism.shard_group", "2"}},
       "parallelism.shard_group=2: is for sharding=hsdp only (sharding=fsdp)"},
      {{{"parallelism.sharding", "replicated"}, {"parallelism.shard_group", "1"}},
       "parallelism.shard_group=1: is for sharding=hsdp only (sharding=replicated)"},
  };
  for (const Case& k : cases) {
    TrainConfig c;
    ASSERT_TRUE(ApplyOverrides(k.overrides, &c).ok()) << k.expect;
    absl::Status s = ValidateConfig(c);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << k.expect << ": " << s;
    EXPECT_THAT(s.message(), HasSubstr(k.expect));
  }
}

// Issue 50 item 4: a float value that passes its sign check but not the fp32 computation that
// uses it is refused at start-up naming the field, not steps later with a NaN or an infinite
// expert bias. The largest values each computation holds are accepted.
TEST(ConfigTest, FloatValuesBeyondTheirFp32UseAreRefusedByName) {
  struct Case {
    std::vector<FieldOverride> overrides;
    const char* expect;
  };
  const Case cases[] = {
      {{{"loss.logit_softcap", "1e300"}}, "loss.logit_softcap=1e+300: must be at most 1e+30"},
      {{{"loss.logit_softcap", "3e38"}}, "loss.logit_softcap=3e+38: must be at most 1e+30"},
      {{{"loss.expert_bias_speed", "1e39"}}, "loss.expert_bias_speed=1e+39: times optim.steps="},
      {{{"loss.expert_bias_speed", "3e38"}}, "loss.expert_bias_speed=3e+38: times optim.steps="},
      {{{"loss.expert_bias_speed", "1e36"}, {"optim.steps", "1000"}},
       "loss.expert_bias_speed=1e+36: times optim.steps=1000 must be at most"},
      {{{"loss.expert_bias_speed", "1e-50"}},
       "loss.expert_bias_speed=1e-50: must be 0 (off) or at least"},
      {{{"loss.alpha_b", "1e39"}}, "loss.alpha_b=1e+39: must be at most 3.40282e+38"},
      {{{"loss.alpha_z", "1e300"}}, "loss.alpha_z=1e+300: must be at most 3.40282e+38"},
      {{{"loss.alpha_lse", "1e39"}}, "loss.alpha_lse=1e+39: must be at most 3.40282e+38"},
      {{{"optim.lr", "1e39"}}, "optim.lr=1e+39: must be at most 3.40282e+38"},
      {{{"optim.eps", "1e39"}}, "optim.eps=1e+39: must be at most 3.40282e+38"},
      {{{"optim.lr", "1e20"}, {"optim.weight_decay", "1e20"}},
       "optim.weight_decay=1e+20: times optim.lr=1e+20 must be at most 2"},
      {{{"optim.lr", "1"}, {"optim.weight_decay", "3"}},
       "optim.weight_decay=3: times optim.lr=1 must be at most 2"},
  };
  for (const Case& k : cases) {
    TrainConfig c;
    ASSERT_TRUE(ApplyOverrides(k.overrides, &c).ok()) << k.expect;
    absl::Status s = ValidateConfig(c);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << k.expect << ": " << s;
    EXPECT_THAT(s.message(), HasSubstr(k.expect));
  }
  for (const std::vector<FieldOverride>& fine : std::vector<std::vector<FieldOverride>>{
           {{"loss.logit_softcap", "1e30"}},
           {{"loss.expert_bias_speed", "1e38"}, {"optim.steps", "1"}},
           {{"loss.expert_bias_speed", "1e-30"}},
           {{"loss.alpha_b", "3e38"}, {"loss.alpha_lse", "3e38"}},
           {{"optim.lr", "3e38"}},
           {{"optim.lr", "1"}, {"optim.weight_decay", "2"}}}) {
    TrainConfig c;
    ASSERT_TRUE(ApplyOverrides(fine, &c).ok());
    EXPECT_TRUE(ValidateConfig(c).ok()) << fine[0].path << ": " << ValidateConfig(c);
  }
}

// Issue 50 item 5: a value the chosen configuration would ignore is refused by name (a
// default is not: resolved configs hold every field), and so is an MTP depth the documents
// are too short to train.
TEST(ConfigTest, ValuesTheConfigWouldIgnoreAreRefusedByName) {
  struct Case {
    std::vector<FieldOverride> overrides;
    const char* expect;
  };
  const Case cases[] = {
      {{{"model.attention", "none"}, {"model.heads", "3"}, {"model.kv_heads", "2"}},
       "model.heads=3: is not used with model.attention=none"},
      {{{"model.attention", "none"}, {"model.kv_heads", "2"}},
       "model.kv_heads=2: is not used with model.attention=none"},
      {{{"model.attention", "none"}, {"model.rope_theta", "nan"}},
       "model.rope_theta=nan: is not used with model.attention=none"},
      {{{"data.eval_path", "/tmp/held_out.txt"}, {"log.eval_every", "2"}},
       "data.eval_path=/tmp/held_out.txt: is read only with data.path (--data)"},
      {{{"data.eval_path", "/tmp/held_out.txt"}, {"data.path", "/tmp/train.txt"}},
       "data.eval_path=/tmp/held_out.txt: is read only with log.eval_every > 0"},
      {{{"loss.mtp_scale", "0.3"}}, "loss.mtp_scale=0.3: is not used with model.mtp_depth=0"},
      {{{"log.eval_micro_batches", "4"}},
       "log.eval_micro_batches=4: is not used with log.eval_every=0"},
      {{{"optim.min_lr", "0.001"}}, "optim.min_lr=0.001: is not used with optim.lr_decay=constant"},
      {{{"optim.decay_steps", "100"}},
       "optim.decay_steps=100: is not used with optim.lr_decay=constant"},
      {{{"model.mtp_depth", "23"}, {"data.max_doc_len", "24"}},
       "model.mtp_depth=23: must be at most data.max_doc_len - 2 = 22"},
      {{{"model.mtp_depth", "2"}, {"data.max_doc_len", "3"}, {"data.min_doc_len", "2"}},
       "model.mtp_depth=2: must be at most data.max_doc_len - 2 = 1"},
  };
  for (const Case& k : cases) {
    TrainConfig c;
    ASSERT_TRUE(ApplyOverrides(k.overrides, &c).ok()) << k.expect;
    absl::Status s = ValidateConfig(c);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << k.expect << ": " << s;
    EXPECT_THAT(s.message(), HasSubstr(k.expect));
  }
  // The defaults of the unused fields, as a resolved config (a checkpoint's) holds them, and
  // the deepest depth that has labels.
  TrainConfig none;
  ASSERT_TRUE(ApplyOverrides({{"model.attention", "none"}}, &none).ok());
  EXPECT_TRUE(ValidateConfig(ResolvedConfig(none)).ok()) << ValidateConfig(ResolvedConfig(none));
  TrainConfig deep;
  ASSERT_TRUE(ApplyOverrides({{"model.mtp_depth", "22"}, {"data.max_doc_len", "24"}}, &deep).ok());
  EXPECT_TRUE(ValidateConfig(deep).ok()) << ValidateConfig(deep);
  TrainConfig eval;
  ASSERT_TRUE(ApplyOverrides({{"data.path", "/tmp/train.txt"},
                              {"data.eval_path", "/tmp/held_out.txt"},
                              {"log.eval_every", "2"}},
                             &eval)
                  .ok());
  EXPECT_TRUE(ValidateConfig(eval).ok()) << ValidateConfig(eval);
}

// Without CP a sequence is not cut into 2 cp chunks: any seq_len the SP group divides is
// valid, odd ones included (issue 50, item 6: every odd seq_len was refused, blamed on
// parallelism.cp=1).
// The schedule's end: decay_steps when set, else the run's steps; the rest as the fields say.
TEST(ConfigTest, TheLrScheduleEndsAtDecayStepsOrTheRunsSteps) {
  OptimConfig o;
  o.set_lr_decay(OptimConfig::cosine);
  o.set_lr(0.5);
  o.set_min_lr(0.25);
  o.set_warmup_steps(3);
  o.set_steps(100);
  optim::LrSchedule s = ToLrSchedule(o);
  EXPECT_EQ(s.decay, optim::LrDecay::kCosine);
  EXPECT_EQ(s.lr, 0.5);
  EXPECT_EQ(s.min_lr, 0.25);
  EXPECT_EQ(s.warmup_steps, 3);
  EXPECT_EQ(s.decay_end, 100);
  o.set_decay_steps(40);
  o.set_lr_decay(OptimConfig::linear);
  s = ToLrSchedule(o);
  EXPECT_EQ(s.decay, optim::LrDecay::kLinear);
  EXPECT_EQ(s.decay_end, 40);
  EXPECT_EQ(ToLrSchedule(OptimConfig()).decay, optim::LrDecay::kConstant);
  TrainConfig fine;
  fine.mutable_optim()->set_lr_decay(OptimConfig::cosine);
  fine.mutable_optim()->set_min_lr(fine.optim().lr());
  fine.mutable_optim()->set_warmup_steps(0);
  fine.mutable_optim()->set_steps(1);
  EXPECT_TRUE(ValidateConfig(fine).ok()) << ValidateConfig(fine);
}

// The banner's settings line: exactly the fields away from their defaults, as their flags,
// in config.proto's order; a switch flag bare, a string with a space quoted.
TEST(ConfigTest, NonDefaultFlagsNameExactlyTheChangedSettings) {
  TrainConfig c;
  EXPECT_EQ(NonDefaultFlags(c), "");
  EXPECT_EQ(NonDefaultFlags(ResolvedConfig(c)), "");  // defaults written out are no change
  ASSERT_TRUE(ApplyOverrides({{"parallelism.world", "4"},
                              {"parallelism.sp", "2"},
                              {"parallelism.sharding", "hsdp"},
                              {"model.dim", "64"},
                              {"checkpoint.resume", "true"},
                              {"data.path", "my corpus.txt"},
                              {"optim.lr", "0.01"}},  // the default value, given explicitly
                             &c)
                  .ok());
  EXPECT_EQ(NonDefaultFlags(c),
            "--dim=64 --data='my corpus.txt' --world=4 --sharding=hsdp --sp=2 --resume");
}

TEST(ConfigTest, OddSeqLenIsValidWithoutCp) {
  for (const auto& [seq_len, sp] : std::vector<std::pair<int, int>>{{33, 1}, {99, 1}, {3, 1}}) {
    TrainConfig c;
    ASSERT_TRUE(ApplyOverrides({{"data.seq_len", absl::StrCat(seq_len)},
                                {"data.max_doc_len", absl::StrCat(std::min(seq_len, 24))},
                                {"data.min_doc_len", "2"},
                                {"parallelism.sp", absl::StrCat(sp)}},
                               &c)
                    .ok());
    EXPECT_TRUE(ValidateConfig(c).ok()) << seq_len << ": " << ValidateConfig(c);
  }
  // With CP the chunks must still divide it, and that is CP's message.
  TrainConfig cp;
  ASSERT_TRUE(ApplyOverrides({{"data.seq_len", "33"},
                              {"data.max_doc_len", "24"},
                              {"parallelism.cp", "2"},
                              {"parallelism.ep", "1"}},
                             &cp)
                  .ok());
  EXPECT_THAT(ValidateConfig(cp).message(),
              HasSubstr("parallelism.cp=2: needs data.seq_len=33 to be a multiple of 2 cp"));
}

// A sequence too short to train is the sequence length's fault, not CP's.
TEST(ConfigTest, SeqLenOneIsBlamedOnSeqLen) {
  TrainConfig c;
  ASSERT_TRUE(ApplyOverrides({{"data.seq_len", "1"}}, &c).ok());
  const absl::Status s = ValidateConfig(c);
  EXPECT_THAT(s.message(), HasSubstr("data.seq_len=1: must be >= 2"));
  EXPECT_THAT(s.message(), ::testing::Not(HasSubstr("parallelism.cp")));
}

// Reproducible mode's default row block is fixed by the sequence length (issue 50, item 1):
// the largest divisor of seq_len up to seq_len / 4, whatever the mesh.
TEST(ReproBlockTest, TheDefaultIsFixedByTheSequenceLength) {
  for (const auto& [seq_len, block] : std::vector<std::pair<int64_t, int64_t>>{
           {128, 32}, {32, 8}, {4096, 1024}, {33, 3}, {100, 25}, {7, 1}, {8, 2}, {3, 1}}) {
    EXPECT_EQ(DefaultReproBlock(seq_len), block) << seq_len;
  }
  for (int sp : {1, 2, 4}) {
    for (int cp : {1, 2}) {
      TrainConfig c;
      ASSERT_TRUE(ApplyOverrides({{"precision.reproducible", "true"},
                                  {"parallelism.sp", absl::StrCat(sp)},
                                  {"parallelism.cp", absl::StrCat(cp)}},
                                 &c)
                      .ok());
      EXPECT_EQ(ReproBlock(c), 32) << "sp " << sp << " cp " << cp;
    }
  }
  TrainConfig explicit_block;
  ASSERT_TRUE(ApplyOverrides({{"precision.repro_block", "8"}}, &explicit_block).ok());
  EXPECT_EQ(ReproBlock(explicit_block), 8);
}

// A mesh whose pieces the block does not tile is refused, naming a block that does; an
// explicit block that straddles the zigzag chunks too (it would put tokens elsewhere in
// their block than at cp = 1).
TEST(ReproBlockTest, AMeshTheBlockDoesNotTileIsRefusedNamingOneThatDoes) {
  TrainConfig deep;
  ASSERT_TRUE(ApplyOverrides({{"precision.reproducible", "true"},
                              {"parallelism.world", "16"},
                              {"parallelism.ep", "1"},
                              {"parallelism.sp", "4"},
                              {"parallelism.cp", "4"}},
                             &deep)
                  .ok());
  EXPECT_THAT(ValidateConfig(deep).message(),
              HasSubstr("precision.repro_block=32: (the default, the largest divisor of "
                        "data.seq_len=128 up to seq_len / 4) must divide the 8 tokens of each "
                        "contiguous piece of a sequence a rank holds at parallelism.sp=4 "
                        "parallelism.cp=4"));
  EXPECT_THAT(ValidateConfig(deep).message(), HasSubstr("pass --repro_block=8"));
  TrainConfig straddle;
  ASSERT_TRUE(ApplyOverrides({{"precision.reproducible", "true"},
                              {"precision.repro_block", "64"},
                              {"parallelism.ep", "1"},
                              {"parallelism.cp", "2"}},
                             &straddle)
                  .ok());
  EXPECT_THAT(ValidateConfig(straddle).message(),
              HasSubstr("precision.repro_block=64: (data.seq_len=128) must divide the 32 tokens"));
  // Without --reproducible the block is not used for bits, and the old rule stands.
  straddle.mutable_precision()->set_reproducible(false);
  EXPECT_TRUE(ValidateConfig(straddle).ok()) << ValidateConfig(straddle);
}

// HSDP configs that are valid: a shard group of whole EP groups dividing the world, and 0
// (the ranks of one host, resolved when the mesh is built).
TEST(ConfigTest, HsdpShardGroupsThatFitAreValid) {
  for (const auto& [world, ep, n] : std::vector<std::tuple<int, int, int>>{
           {4, 2, 2}, {4, 1, 2}, {8, 2, 4}, {4, 2, 4}, {6, 1, 3}, {4, 2, 0}}) {
    TrainConfig c;
    ASSERT_TRUE(ApplyOverrides({{"parallelism.sharding", "hsdp"},
                                {"parallelism.world", absl::StrCat(world)},
                                {"parallelism.ep", absl::StrCat(ep)},
                                {"parallelism.shard_group", absl::StrCat(n)}},
                               &c)
                    .ok());
    EXPECT_TRUE(ValidateConfig(c).ok())
        << world << " " << ep << " " << n << ": " << ValidateConfig(c);
  }
}

TEST(ConfigTest, ShortTextListsDefaultsAndRoundTrips) {
  TrainConfig c;
  ASSERT_TRUE(
      ApplyOverrides({{"model.dim", "48"}, {"parallelism.sharding", "replicated"}}, &c).ok());
  const std::string text = ConfigToShortText(c);
  EXPECT_THAT(text, HasSubstr("dim: 48"));
  EXPECT_THAT(text, HasSubstr("experts: 8"));  // a default, written out
  EXPECT_EQ(text.find('\n'), std::string::npos);
  absl::StatusOr<TrainConfig> back = ParseConfigText(text);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->model().dim(), 48);
  EXPECT_EQ(back->parallelism().sharding(), TrainConfig::replicated);
  EXPECT_EQ(back->model().experts(), 8);
}

// Checked by stat(2) before any open: a FIFO is refused, not opened (which would wait for a
// writer; if it ever did, Bazel's timeout ends this test).
TEST(ConfigTest, ConfigMustBeARegularFile) {
  const std::string fifo = ::testing::TempDir() + "/config_fifo";
  ::unlink(fifo.c_str());
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  for (const auto& [path, kind] :
       {std::pair<std::string, std::string>{::testing::TempDir(), "a directory"},
        {"/dev/zero", "a character device"},
        {fifo, "a FIFO (named pipe)"}}) {
    absl::StatusOr<TrainConfig> c = LoadConfigFile(path);
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << path;
    EXPECT_THAT(c.status().message(),
                HasSubstr("--config=" + path + ": is " + kind + "; --config takes a regular file"));
  }
  absl::StatusOr<TrainConfig> missing = LoadConfigFile("/nonexistent.textproto");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("--config=/nonexistent.textproto"));
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
  EXPECT_EQ(value("model.experts"), "8");      // a default
  EXPECT_EQ(value("comm.backend"), "thread");  // as textproto: the enum value's name
  EXPECT_EQ(value("data.path"), "\"\"");
  const TrainConfig resolved = ResolvedConfig(c);
  EXPECT_TRUE(resolved.comm().has_backend());
  EXPECT_TRUE(resolved.data().has_path());
  EXPECT_EQ(ConfigToShortText(resolved), ConfigToShortText(c));
}

}  // namespace
}  // namespace gradsum::train
