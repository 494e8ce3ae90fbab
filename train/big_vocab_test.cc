// The trainer at a real vocabulary (issue 47 item 4): V = 32000 on a Megatron token file
// that this test writes, on small shapes. Step 1 matches the fp64 reference (the parity
// check) with expert and sequence parallelism; a checkpoint resumes onto another mesh and
// continues the uninterrupted run; --export and --init_from round-trip; the LM head's
// fused cross-entropy never holds the [T, V] logits; the vocabulary goes to 256k and is
// refused, naming the flag, where the data's ids do not fit.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/thread_pool.h"
#include "data/megatron_writer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "io/safetensors.h"
#include "train/metrics.pb.h"
#include "train/moe_lm.h"
#include "train/test_util.h"

namespace gradsum::train {
namespace {

using ::testing::HasSubstr;

constexpr int kVocab = 32000;

// A Megatron dataset at PREFIX of 400 documents of 3 to 20 ids drawn uniformly from
// [0, max_id], each document holding max_id once, so that the ids span the vocabulary and
// the largest is max_id. Written once per prefix.
std::string TokenFile(const std::string& name, int32_t max_id) {
  const std::string prefix = absl::StrCat(::testing::TempDir(), "/", name);
  if (std::filesystem::exists(prefix + ".idx")) return prefix;
  absl::StatusOr<data::MegatronWriter> writer =
      data::MegatronWriter::Create(prefix, data::MegatronDTypeForVocab(int64_t{max_id} + 1));
  EXPECT_TRUE(writer.ok()) << writer.status();
  std::mt19937 rng(47);
  std::uniform_int_distribution<int32_t> id(0, max_id), len(3, 20);
  for (int d = 0; d < 400; ++d) {
    std::vector<int32_t> doc(len(rng));
    for (int32_t& t : doc) t = id(rng);
    doc[d % doc.size()] = max_id;
    EXPECT_TRUE(writer->AddDocument(doc).ok());
  }
  EXPECT_TRUE(writer->Finish().ok());
  return prefix;
}

// V = 32000 on the token file, D = 16, L = 2, E = 4, K = 2, causal attention with 4 query
// and 2 kv heads, init_std 0.1; micro-batches of 2 sequences of 32 tokens.
TrainConfig BigVocabConfig(int world, int ep, int sp, int grad_acc) {
  TrainConfig c = TinyConfig(world, ep, grad_acc, TrainConfig::fsdp);
  c.mutable_parallelism()->set_sp(sp);
  DataConfig* d = c.mutable_data();
  d->clear_corpus();
  d->set_path(TokenFile("v32000", kVocab - 1));
  d->set_seq_len(32);
  d->set_max_doc_len(32);
  ModelConfig* m = c.mutable_model();
  m->set_vocab(kVocab);
  m->set_dim(16);
  m->set_expert_dim(16);
  m->set_attention(ModelConfig::causal);
  m->set_heads(4);
  m->set_kv_heads(2);
  m->set_rope_theta(100);
  m->clear_init_std();  // the default 0.1: logits of a real initialisation, CE near ln V
  return c;
}

// Every rank's records of `config` run in process, rank 0's returned (every rank must
// succeed).
std::vector<StepMetrics> TrainOrDie(const TrainConfig& config) {
  absl::StatusOr<std::vector<RankOutcome>> out = RunInProcess(config);
  EXPECT_TRUE(out.ok()) << out.status();
  if (!out.ok()) return {};
  for (const RankOutcome& r : *out) EXPECT_TRUE(r.status.ok()) << r.status;
  return (*out)[0].history;
}

// The parity check (the fp64 single-process reference, testing/reference_moe_lm.h, which
// holds the full [T, V] logits in fp64) passes within 1e-5 at V = 32000 with expert
// parallelism and with sequence parallelism, over every parameter, and the ranks agree.
TEST(BigVocabTest, StepOneMatchesTheReferenceAtV32000) {
  // (world, ep, sp, G)
  for (const auto& [W, P, S, G] :
       std::vector<std::tuple<int, int, int, int>>{{2, 2, 1, 1}, {2, 1, 2, 2}}) {
    TrainConfig config = BigVocabConfig(W, P, S, G);
    config.mutable_debug()->set_parity_check(true);
    const std::string what = absl::StrCat("world ", W, " ep ", P, " sp ", S, " G ", G);
    absl::StatusOr<std::vector<RankOutcome>> out = RunInProcess(config);
    ASSERT_TRUE(out.ok()) << what << ": " << out.status();
    const RankOutcome& r0 = (*out)[0];
    ASSERT_TRUE(r0.parity.has_value()) << what << ": " << r0.status;
    for (const RankOutcome& r : *out) {
      ASSERT_TRUE(r.status.ok()) << what << ": " << r.status << "\n" << r0.parity->ToString();
    }
    EXPECT_TRUE(r0.parity->ok) << what << "\n" << r0.parity->ToString();
    EXPECT_LE(r0.parity->worst, 1e-5) << what;
    std::printf("%s: parity worst %.3e\n", what.c_str(), r0.parity->worst);
    // emb; per layer attn_norm, wq, wk, wv, wo, norm, router, 4 experts x 3; final_norm; out.
    EXPECT_EQ(r0.parity->params.size(), 1 + 2 * (5 + 2 + 4 * 3) + 2u) << what;
    // The CE of random ids is near ln V at initialisation: the head ran at V = 32000.
    ASSERT_EQ(r0.history.size(), 1u);
    EXPECT_NEAR(r0.history[0].ce(), std::log(double{kVocab}), 1.0) << what;
    for (const RankOutcome& r : *out) {
      ASSERT_TRUE(r.first_step_grads.has_value()) << what;
      EXPECT_EQ(*r.first_step_grads, *r0.first_step_grads) << what;
      EXPECT_EQ(r.history[0].ce(), r0.history[0].ce()) << what;
    }
  }
}

double RelErr(double a, double b) { return std::abs(a - b) / std::abs(b); }

// A run checkpointed at step 2 on (world 2, ep 2, G 1) resumes on (world 2, sp 2, G 2),
// the same global batch of 4 sequences, and continues the uninterrupted run: its first
// step within 1e-5 relative, the next within 1e-3 (another mesh sums in another order).
// alpha_b = 0: the balancing loss is per micro-step, so another G is another objective.
TEST(BigVocabTest, ResumeOntoAnotherMeshContinuesTheRunAtV32000) {
  const std::string dir = ::testing::TempDir() + "/big_vocab_ckpt";
  std::filesystem::remove_all(dir);
  TrainConfig reference = BigVocabConfig(2, 2, 1, 1);
  reference.mutable_loss()->set_alpha_b(0);
  reference.mutable_optim()->set_steps(4);
  const std::vector<StepMetrics> want = TrainOrDie(reference);
  ASSERT_EQ(want.size(), 4u);

  TrainConfig first = reference;
  first.mutable_optim()->set_steps(2);
  first.mutable_checkpoint()->set_dir(dir);
  ASSERT_EQ(TrainOrDie(first).size(), 2u);
  TrainConfig second = BigVocabConfig(2, 1, 2, 2);
  second.mutable_loss()->set_alpha_b(0);
  second.mutable_optim()->set_steps(4);
  second.mutable_checkpoint()->set_dir(dir);
  second.mutable_checkpoint()->set_resume(true);
  const std::vector<StepMetrics> got = TrainOrDie(second);
  ASSERT_EQ(got.size(), 2u);
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(got[i].step(), static_cast<int64_t>(i + 3));
    const StepMetrics& w = want[i + 2];
    const double tol = i == 0 ? 1e-5 : 1e-3;
    EXPECT_LE(RelErr(got[i].loss(), w.loss()), tol)
        << "step " << w.step() << ": " << got[i].loss() << " vs " << w.loss();
    EXPECT_LE(RelErr(got[i].ce(), w.ce()), tol) << "step " << w.step();
    EXPECT_EQ(got[i].valid_tokens(), w.valid_tokens()) << "step " << w.step();
  }
}

// --export writes emb [V, D] and out [D, V] at V = 32000; --init_from on another mesh
// starts from exactly those values (its step-1 dump), and a model of another vocabulary
// refuses the file, naming the flag and the tensor.
TEST(BigVocabTest, ExportAndInitFromRoundTripAtV32000) {
  const std::string dir = ::testing::TempDir() + "/big_vocab_export";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/final.safetensors";
  TrainConfig config = BigVocabConfig(2, 2, 1, 1);
  config.mutable_optim()->set_steps(2);
  config.mutable_checkpoint()->set_export_path(path);
  TrainOrDie(config);
  absl::StatusOr<SafetensorsFile> exported = SafetensorsFile::Read(path);
  ASSERT_TRUE(exported.ok()) << exported.status();
  const auto shapes = MoeLmParamShapes(config.model());
  ASSERT_EQ(exported->num_tensors(), static_cast<int>(shapes.size()));
  for (const auto& [name, shape] : shapes) {
    auto a = exported->Get(name);
    ASSERT_TRUE(a.ok()) << name;
    EXPECT_EQ(a->shape(), shape) << name;
  }
  EXPECT_EQ(exported->Get("emb")->shape(), (std::vector<int64_t>{kVocab, 16}));
  EXPECT_EQ(exported->Get("out")->shape(), (std::vector<int64_t>{16, kVocab}));

  TrainConfig next = BigVocabConfig(2, 1, 2, 2);
  next.mutable_checkpoint()->set_init_from(path);
  next.mutable_debug()->set_dump_dir(dir + "/dump");
  TrainOrDie(next);
  absl::StatusOr<SafetensorsFile> dumped = SafetensorsFile::Read(dir + "/dump/weights.safetensors");
  ASSERT_TRUE(dumped.ok()) << dumped.status();
  for (const auto& [name, shape] : shapes) {
    auto a = exported->Get(name);
    auto b = dumped->Get(name);
    ASSERT_TRUE(b.ok()) << name;
    ASSERT_EQ(a->nbytes(), b->nbytes()) << name;
    EXPECT_EQ(0, std::memcmp(a->raw(), b->raw(), a->nbytes())) << name;
  }

  TrainConfig other = BigVocabConfig(1, 1, 1, 1);
  other.mutable_model()->set_vocab(kVocab + 1);
  other.mutable_checkpoint()->set_init_from(path);
  absl::StatusOr<std::vector<RankOutcome>> out = RunInProcess(other);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_FALSE((*out)[0].status.ok());
  EXPECT_THAT((*out)[0].status.message(), HasSubstr("--init_from=" + path));
  EXPECT_THAT((*out)[0].status.message(), HasSubstr("emb"));
}

// The head's working set against the full logits. One rank, T = 4 x 32 = 128 tokens per
// micro-batch at V = 32000: the automatic chunk (losses/cross_entropy.cc AutoChunkRows) is
// max(32, min(4 MiB / (4 V) = 32, T / 8 = 16)) = 32 rows, so the fused CE holds one
// [32, V] fp32 chunk, 9 bytes per chunk row and one fp32 row of V (plus one float per
// 1024 columns) per thread: 32 x 32000 x 4 + 32 x 9 + threads x (32000 + 32) x 4 bytes,
// exactly, about a quarter of the T x V x 4 = 16.4 MB of the full logits. The model's
// held activations (peak_activation_bytes, which do not count the call's scratch) plus
// that scratch stay below the full logits alone.
TEST(BigVocabTest, TheHeadNeverHoldsTheFullLogits) {
  TrainConfig config = BigVocabConfig(1, 1, 1, 1);
  config.mutable_data()->set_micro_batch(4);
  const std::vector<StepMetrics> h = TrainOrDie(config);
  ASSERT_EQ(h.size(), 1u);
  const int64_t T = 4 * 32, V = kVocab, chunk = 32;
  const int64_t threads = std::max(1, AvailableCores());  // build_model.cc: cores / world
  const int64_t want_scratch = chunk * V * 4 + chunk * 9 + threads * (V + (V + 1023) / 1024) * 4;
  const int64_t full_logits = T * V * 4;
  EXPECT_EQ(h[0].peak_head_scratch_bytes(), want_scratch);
  EXPECT_GT(h[0].peak_activation_bytes(), 0);
  EXPECT_LT(h[0].peak_activation_bytes() + h[0].peak_head_scratch_bytes(), full_logits)
      << "activations " << h[0].peak_activation_bytes() << ", head scratch "
      << h[0].peak_head_scratch_bytes() << ", full logits " << full_logits;
  std::printf(
      "V=%lld T=%lld: peak_activation_bytes %lld + peak_head_scratch_bytes %lld "
      "against full logits %lld\n",
      static_cast<long long>(V), static_cast<long long>(T),
      static_cast<long long>(h[0].peak_activation_bytes()),
      static_cast<long long>(h[0].peak_head_scratch_bytes()), static_cast<long long>(full_logits));

  // --reproducible: the head runs per row block of seq_len / 4 = 8 tokens (16 blocks), each
  // one 8-row chunk in one thread, at most `threads` blocks at once: threads x (8 V 4 + 8 x
  // 9 + (V + 32) 4) bytes. (Not counted here: each block's [D, V] head-gradient scratch,
  // which AccumulateRowBlocks keeps for all 16 blocks until it adds them in order.)
  config.mutable_precision()->set_reproducible(true);
  const std::vector<StepMetrics> r = TrainOrDie(config);
  ASSERT_EQ(r.size(), 1u);
  const int64_t block_scratch = 8 * V * 4 + 8 * 9 + (V + (V + 1023) / 1024) * 4;
  EXPECT_EQ(r[0].peak_head_scratch_bytes(), std::min<int64_t>(16, threads) * block_scratch);
  EXPECT_LT(r[0].peak_head_scratch_bytes(), full_logits);
}

// --vocab up to 256k (262144) trains on a token file whose largest id is 262143 (int32
// tokens); one id less of vocabulary, an embedded byte corpus at that vocabulary, and a
// vocabulary of 0 are refused before training, naming model.vocab and the value.
TEST(BigVocabTest, VocabularyOf256kTrainsAndBadVocabulariesAreNamed) {
  constexpr int kBig = 262144;
  TrainConfig config = BigVocabConfig(1, 1, 1, 1);
  config.mutable_data()->set_path(TokenFile("v262144", kBig - 1));
  config.mutable_model()->set_vocab(kBig);
  config.mutable_model()->set_attention(ModelConfig::none);
  config.mutable_model()->clear_heads();
  config.mutable_model()->clear_kv_heads();
  config.mutable_model()->clear_rope_theta();
  config.mutable_model()->set_layers(1);
  const std::vector<StepMetrics> h = TrainOrDie(config);
  ASSERT_EQ(h.size(), 1u);
  EXPECT_NEAR(h[0].ce(), std::log(double{kBig}), 1.0);

  struct Bad {
    int vocab;
    bool byte_corpus;
    std::string message;
  };
  for (const Bad& bad : std::vector<Bad>{
           {kBig - 1, false, absl::StrCat("model.vocab=", kBig - 1)},
           {kBig, true, absl::StrCat("model.vocab=", kBig)},
           {0, false, "model.vocab=0"},
       }) {
    TrainConfig c = config;
    c.mutable_model()->set_vocab(bad.vocab);
    if (bad.byte_corpus) {
      c.mutable_data()->clear_path();
      c.mutable_data()->set_corpus(DataConfig::markov1);
    }
    absl::StatusOr<std::vector<RankOutcome>> out = RunInProcess(c);
    const absl::Status s = out.ok() ? (*out)[0].status : out.status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad.message << ": " << s;
    EXPECT_THAT(s.message(), HasSubstr(bad.message));
  }
  // The message names what does not fit: the file and its largest id.
  TrainConfig small = config;
  small.mutable_model()->set_vocab(kBig - 1);
  absl::StatusOr<std::vector<RankOutcome>> out = RunInProcess(small);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_THAT(
      (*out)[0].status.message(),
      HasSubstr(absl::StrCat("holds token id ", kBig - 1, ", so vocab must be at least ", kBig)));
}

}  // namespace
}  // namespace gradsum::train
