#include "train/data.h"

#include <cmath>
#include <fstream>
#include <map>
#include <set>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace gradsum::train {
namespace {

using ::testing::HasSubstr;

TEST(MarkovChainTest, RowsAndStationaryAreDistributions) {
  const MarkovChain chain = MarkovChain::Create(7);
  double pi_total = 0;
  for (int i : chain.alphabet()) {
    double row = 0;
    for (int j = 0; j < MarkovChain::kStates; ++j) row += chain.Transition(i, j);
    EXPECT_NEAR(row, 1.0, 1e-12) << i;
    pi_total += chain.stationary()[i];
  }
  EXPECT_NEAR(pi_total, 1.0, 1e-12);
  // pi P = pi.
  for (int j : chain.alphabet()) {
    double flow = 0;
    for (int i : chain.alphabet()) flow += chain.stationary()[i] * chain.Transition(i, j);
    EXPECT_NEAR(flow, chain.stationary()[j], 1e-12) << j;
  }
  // Well below ln 256 (and below ln of the successor count).
  EXPECT_LT(chain.ConditionalEntropyNats(), std::log(6.0));
  EXPECT_GT(chain.ConditionalEntropyNats(), 0.3);
}

TEST(MarkovChainTest, SameSeedSameChainOtherSeedOther) {
  const MarkovChain a = MarkovChain::Create(1), b = MarkovChain::Create(1),
                    c = MarkovChain::Create(2);
  EXPECT_EQ(a.ConditionalEntropyNats(), b.ConditionalEntropyNats());
  EXPECT_NE(a.ConditionalEntropyNats(), c.ConditionalEntropyNats());
}

// The exact entropy against two independent estimates on a long sampled path: the
// plug-in estimate from transition counts, and the mean -ln P along the path.
TEST(MarkovChainTest, EntropyMatchesEmpiricalEstimate) {
  const MarkovChain chain = MarkovChain::Create(20261202);
  SplitMix64 rng(99);
  const int64_t n = 2000000;
  std::vector<int64_t> counts(256 * 256, 0), from_counts(256, 0);
  double neg_log_p = 0;
  int x = chain.SampleStationary(rng);
  for (int64_t t = 0; t < n; ++t) {
    const int y = chain.SampleNext(x, rng);
    ++counts[x * 256 + y];
    ++from_counts[x];
    neg_log_p -= std::log(chain.Transition(x, y));
    x = y;
  }
  double plug_in = 0;
  for (int i = 0; i < 256; ++i) {
    for (int j = 0; j < 256; ++j) {
      if (counts[i * 256 + j] == 0) continue;
      const double c = static_cast<double>(counts[i * 256 + j]);
      plug_in -= c / n * std::log(c / from_counts[i]);
    }
  }
  const double h = chain.ConditionalEntropyNats();
  // Standard error of either estimate is about 1e-3 at this length.
  EXPECT_NEAR(neg_log_p / n, h, 0.006);
  EXPECT_NEAR(plug_in, h, 0.006);
}

DataConfig SmallConfig() {
  DataConfig c;
  c.set_seq_len(32);
  c.set_micro_batch(3);
  c.set_min_doc_len(4);
  c.set_max_doc_len(20);
  c.set_corpus_documents(5000);
  return c;
}

void CheckPacking(const MicroBatch& mb, const DocumentSource& corpus) {
  ASSERT_EQ(mb.tokens.size(), static_cast<size_t>(mb.batch * mb.seq_len));
  for (int b = 0; b < mb.batch; ++b) {
    const int base = b * mb.seq_len;
    int pos = 0;
    for (int64_t id : mb.doc_ids[b]) {
      const std::vector<int32_t> doc = corpus.Document(id);
      for (size_t t = 0; t < doc.size(); ++t, ++pos) {
        EXPECT_EQ(mb.tokens[base + pos], doc[t]);
        EXPECT_EQ(mb.mask[base + pos], 1);
        EXPECT_EQ(mb.labels[base + pos], t + 1 < doc.size() ? doc[t + 1] : kIgnoreIndex);
      }
    }
    ASSERT_LE(pos, mb.seq_len);
    for (; pos < mb.seq_len; ++pos) {  // padding only at the end
      EXPECT_EQ(mb.mask[base + pos], 0);
      EXPECT_EQ(mb.labels[base + pos], kIgnoreIndex);
      EXPECT_EQ(mb.tokens[base + pos], 0);
    }
  }
}

TEST(RankDataLoaderTest, PackingInvariantsAndDisjointShards) {
  const DataConfig config = SmallConfig();
  auto corpus = MakeCorpus(config);
  ASSERT_TRUE(corpus.ok());
  const int world = 3, grad_acc = 2;
  std::vector<std::set<int64_t>> seen(world);
  std::set<int64_t> valid_counts;
  for (int r = 0; r < world; ++r) {
    absl::StatusOr<RankDataLoader> loader = RankDataLoader::Create(*corpus, config, r, world);
    ASSERT_TRUE(loader.ok()) << loader.status();
    for (int step = 0; step < 4; ++step) {
      for (const MicroBatch& mb : loader->NextStep(grad_acc)) {
        CheckPacking(mb, **corpus);
        valid_counts.insert(mb.valid_tokens());
        int64_t docs = 0;
        for (const auto& ids : mb.doc_ids) {
          docs += ids.size();
          for (int64_t id : ids) {
            EXPECT_GE(id, loader->shard_begin());
            EXPECT_LT(id, loader->shard_end());
            seen[r].insert(id);
          }
        }
        // Each document gives one ignored label; the rest are valid.
        EXPECT_EQ(mb.valid_tokens(), mb.routed_tokens() - docs);
      }
    }
  }
  for (int a = 0; a < world; ++a) {
    EXPECT_FALSE(seen[a].empty());
    for (int b = a + 1; b < world; ++b) {
      for (int64_t id : seen[a]) EXPECT_EQ(seen[b].count(id), 0u) << "doc " << id;
    }
  }
  EXPECT_GT(valid_counts.size(), 3u) << "valid-token counts should vary across micro-batches";
}

// Sample ids (the CE's samples, SEMANTICS.md §3): one per packed document occurrence, in
// packing order, unique within the rank's step, -1 on padding; runs of equal ids are
// exactly the documents' tokens.
TEST(RankDataLoaderTest, SampleIdsNameEachPackedDocumentOfTheStep) {
  const DataConfig config = SmallConfig();
  auto corpus = MakeCorpus(config);
  ASSERT_TRUE(corpus.ok());
  absl::StatusOr<RankDataLoader> loader = RankDataLoader::Create(*corpus, config, 0, 2);
  ASSERT_TRUE(loader.ok()) << loader.status();
  for (int step = 0; step < 3; ++step) {
    int64_t next_id = 0;
    for (const MicroBatch& mb : loader->NextStep(3)) {
      ASSERT_EQ(mb.sample_ids.size(), mb.tokens.size());
      for (int b = 0; b < mb.batch; ++b) {
        size_t pos = static_cast<size_t>(b) * mb.seq_len;
        for (int64_t doc : mb.doc_ids[b]) {
          const int64_t len = (*corpus)->DocumentLength(doc);
          for (int64_t t = 0; t < len; ++t, ++pos) {
            ASSERT_EQ(mb.sample_ids[pos], next_id) << "step " << step << " pos " << pos;
          }
          ++next_id;
        }
        for (; pos < static_cast<size_t>(b + 1) * mb.seq_len; ++pos) {
          EXPECT_EQ(mb.sample_ids[pos], -1) << "padding at " << pos;
          EXPECT_EQ(mb.mask[pos], 0);
        }
      }
    }
    EXPECT_GT(next_id, 3) << "a step packs several documents";
  }
}

TEST(RankDataLoaderTest, SkipStepsReplaysTheSameStream) {
  const DataConfig config = SmallConfig();
  auto corpus = MakeCorpus(config);
  ASSERT_TRUE(corpus.ok());
  auto a = RankDataLoader::Create(*corpus, config, 1, 2);
  auto b = RankDataLoader::Create(*corpus, config, 1, 2);
  ASSERT_TRUE(a.ok() && b.ok());
  for (int s = 0; s < 5; ++s) a->NextStep(3);
  b->SkipSteps(5, 3);
  const std::vector<MicroBatch> x = a->NextStep(3), y = b->NextStep(3);
  for (int m = 0; m < 3; ++m) {
    EXPECT_EQ(x[m].tokens, y[m].tokens);
    EXPECT_EQ(x[m].labels, y[m].labels);
    EXPECT_EQ(x[m].doc_ids, y[m].doc_ids);
  }
}

// Labels of the packed stream are stationary transitions: the mean -ln P(label | token)
// over valid tokens approaches the entropy floor.
TEST(RankDataLoaderTest, PackedLabelsSitAtTheEntropyFloor) {
  DataConfig config;  // the defaults the binary uses
  MarkovCorpus corpus(config);
  auto shared = std::make_shared<MarkovCorpus>(config);
  auto loader = RankDataLoader::Create(shared, config, 0, 2);
  ASSERT_TRUE(loader.ok());
  double total = 0;
  int64_t n = 0;
  for (int s = 0; s < 400; ++s) {
    for (const MicroBatch& mb : loader->NextStep(1)) {
      for (size_t t = 0; t < mb.labels.size(); ++t) {
        if (mb.labels[t] == kIgnoreIndex) continue;
        total -= std::log(corpus.chain().Transition(mb.tokens[t], mb.labels[t]));
        ++n;
      }
    }
  }
  ASSERT_GT(n, 100000);
  EXPECT_NEAR(total / n, corpus.EntropyFloorNats(), 0.015);
}

TEST(RankDataLoaderTest, BadArgumentsAreInvalidArgument) {
  DataConfig config = SmallConfig();
  config.set_corpus_documents(2);
  auto corpus = MakeCorpus(config);
  ASSERT_TRUE(corpus.ok());
  auto s = RankDataLoader::Create(*corpus, config, 0, 4);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("world=4"));
  s = RankDataLoader::Create(*corpus, config, 2, 2);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("rank=2"));
  config.set_corpus_documents(100);
  config.set_max_doc_len(40);  // > seq_len 32
  auto long_docs = MakeCorpus(config);
  ASSERT_TRUE(long_docs.ok());
  s = RankDataLoader::Create(*long_docs, config, 0, 1);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("data.seq_len=32"));
}

TEST(TextFileCorpusTest, LinesAreDocumentsAndLongLinesSplit) {
  const std::string path = ::testing::TempDir() + "/corpus.txt";
  std::ofstream(path, std::ios::binary) << "hello\n\nabcdefghij\xff"
                                        << "xyz";
  auto corpus = TextFileCorpus::Load(path, 4);
  ASSERT_TRUE(corpus.ok()) << corpus.status();
  // "hell" "o\n" "\n" "abcd" "efgh" "ij\xffx" "yz"
  ASSERT_EQ((*corpus)->num_documents(), 7);
  EXPECT_EQ((*corpus)->Document(1), (std::vector<int32_t>{'o', '\n'}));
  EXPECT_EQ((*corpus)->Document(2), (std::vector<int32_t>{'\n'}));
  EXPECT_EQ((*corpus)->Document(5), (std::vector<int32_t>{'i', 'j', 255, 'x'}));
  EXPECT_EQ((*corpus)->DocumentLength(6), 2);
  EXPECT_LT((*corpus)->EntropyFloorNats(), 0);

  EXPECT_EQ(TextFileCorpus::Load("/nonexistent/x.txt", 4).status().code(),
            absl::StatusCode::kNotFound);
  std::ofstream(path, std::ios::binary | std::ios::trunc).flush();
  auto empty = TextFileCorpus::Load(path, 4);
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(empty.status().message(), HasSubstr(path));
}

TEST(TextFileCorpusTest, PacksThroughTheLoader) {
  const std::string path = ::testing::TempDir() + "/corpus2.txt";
  {
    std::ofstream out(path, std::ios::binary);
    for (int i = 0; i < 50; ++i) out << "line number " << i << " of the file\n";
  }
  DataConfig config = SmallConfig();
  config.set_path(path);
  auto corpus = MakeCorpus(config);
  ASSERT_TRUE(corpus.ok()) << corpus.status();
  auto loader = RankDataLoader::Create(*corpus, config, 1, 2);
  ASSERT_TRUE(loader.ok()) << loader.status();
  for (const MicroBatch& mb : loader->NextStep(2)) CheckPacking(mb, **corpus);
}


TEST(TextFileCorpusTest, OnlyRegularFilesAndShardsWithSomethingToPredict) {
  auto dev = TextFileCorpus::Load("/dev/zero", 4);
  EXPECT_EQ(dev.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(dev.status().message(), HasSubstr("--data=/dev/zero: not a regular file"));
  auto dir = TextFileCorpus::Load(::testing::TempDir(), 4);
  EXPECT_EQ(dir.status().code(), absl::StatusCode::kFailedPrecondition);

  // Lines of one byte ("\n") have no token with a next token to predict.
  const std::string path = ::testing::TempDir() + "/no_pairs.txt";
  std::ofstream(path, std::ios::binary) << "\n\n\nab\n\n\n";  // documents: 1 1 1 3 1 1
  DataConfig config = SmallConfig();
  config.set_path(path);
  auto corpus = MakeCorpus(config);
  ASSERT_TRUE(corpus.ok()) << corpus.status();
  EXPECT_EQ((*corpus)->MinDocumentLength(), 1);
  EXPECT_EQ((*corpus)->MaxDocumentLength(), 3);
  auto rank0 = RankDataLoader::Create(*corpus, config, 0, 2);  // documents [0, 3): all "\n"
  EXPECT_EQ(rank0.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(rank0.status().message(),
              HasSubstr("--data=" + path + ", rank 0 of world=2: no trainable token"));
  EXPECT_TRUE(RankDataLoader::Create(*corpus, config, 1, 2).ok());  // has "ab\n"
  // More ranks than documents: a rank with an empty shard, named.
  auto empty = RankDataLoader::Create(*corpus, config, 0, 7);
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(empty.status().message(), HasSubstr(", rank 0 of world=7: the corpus has 6 documents"));
}

}  // namespace
}  // namespace gradsum::train
