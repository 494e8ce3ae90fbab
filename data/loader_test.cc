#include "data/loader.h"

#include <cmath>
#include <cstdint>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "data/corpus.h"
#include "data/markov.h"
#include "data/shard.h"
#include "data/streams.h"
#include "data/text_corpus.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace gradsum::data {
namespace {

// World rank `rank`'s loader at world, sp, cp (data/shard.h DataPlaceOf, as the trainer
// makes it).
absl::StatusOr<RankDataLoader> LoaderAt(std::shared_ptr<const DocumentSource> corpus,
                                        const train::DataConfig& config, int rank, int world,
                                        int sp, int cp) {
  train::ParallelismConfig parallelism;
  parallelism.set_world(world);
  parallelism.set_sp(sp);
  parallelism.set_cp(cp);
  absl::StatusOr<DataPlace> place = DataPlaceOf(parallelism, config.seq_len(), rank);
  if (!place.ok()) return place.status();
  return RankDataLoader::Create(std::move(corpus), config, *place);
}

using ::testing::HasSubstr;
using train::DataConfig;

DataConfig SecondOrderConfig() {
  DataConfig c;
  c.set_corpus(DataConfig::markov2);
  return c;
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

// The reference packing, written out directly: documents 0, 1, 2, ... (cycling) laid into
// sequences greedily; sequence i is the i-th so filled.
std::vector<std::vector<int64_t>> ReferenceSequences(const DocumentSource& corpus, int seq_len,
                                                     int64_t count) {
  std::vector<std::vector<int64_t>> out(count);
  int64_t doc = 0;
  for (int64_t i = 0; i < count; ++i) {
    int64_t used = 0;
    while (used + corpus.DocumentLength(doc) <= seq_len) {
      used += corpus.DocumentLength(doc);
      out[i].push_back(doc);
      doc = (doc + 1) % corpus.num_documents();
    }
  }
  return out;
}

// Every mesh with the same B = world x G x micro_batch trains on the same sequences in every
// step: row j of micro-batch m on rank r of step s is global sequence
// s B + (m world + r) micro_batch + j of the reference packing. For the embedded corpus and
// for a --data file alike.
class GlobalStreamTest : public ::testing::TestWithParam<bool> {};

TEST_P(GlobalStreamTest, EveryMeshWithTheSameBatchSeesTheSameSequences) {
  DataConfig config = SmallConfig();
  config.set_corpus_documents(40);  // a few epochs in the steps below
  if (GetParam()) {
    const std::string path = ::testing::TempDir() + "/stream.txt";
    std::ofstream out(path, std::ios::binary);
    for (int i = 0; i < 30; ++i) out << "document " << i << (i % 3 ? " of the file" : "") << "\n";
    config.set_path(path);
  }
  auto corpus = MakeCorpus(config);
  ASSERT_TRUE(corpus.ok()) << corpus.status();
  const int B = 12, steps = 5;
  const std::vector<std::vector<int64_t>> want =
      ReferenceSequences(**corpus, config.seq_len(), int64_t{B} * steps);
  std::set<int64_t> valid_counts;
  struct Mesh {
    int world, grad_acc, micro_batch;
  };
  for (const Mesh& mesh : {Mesh{4, 1, 3}, Mesh{2, 2, 3}, Mesh{1, 4, 3}, Mesh{3, 2, 2},
                           Mesh{1, 1, 12}, Mesh{6, 2, 1}}) {
    config.set_micro_batch(mesh.micro_batch);
    std::vector<int> seen(int64_t{B} * steps, 0);
    for (int r = 0; r < mesh.world; ++r) {
      absl::StatusOr<RankDataLoader> loader =
          RankDataLoader::Create(*corpus, config, r, mesh.world);
      ASSERT_TRUE(loader.ok()) << loader.status();
      for (int s = 0; s < steps; ++s) {
        const std::vector<MicroBatch> step = loader->NextStep(mesh.grad_acc);
        ASSERT_EQ(step.size(), static_cast<size_t>(mesh.grad_acc));
        for (int m = 0; m < mesh.grad_acc; ++m) {
          const MicroBatch& mb = step[m];
          CheckPacking(mb, **corpus);
          valid_counts.insert(mb.valid_tokens());
          int64_t docs = 0;
          for (int j = 0; j < mb.batch; ++j) {
            const int64_t i = int64_t{s} * B + (int64_t{m} * mesh.world + r) * mesh.micro_batch + j;
            EXPECT_EQ(i,
                      GlobalSequenceIndex(s, m, r, j, mesh.world, mesh.grad_acc, mesh.micro_batch));
            ASSERT_EQ(mb.sequence_ids[j], i);
            EXPECT_EQ(mb.doc_ids[j], want[i]) << "sequence " << i << " world " << mesh.world;
            ++seen[i];
            docs += mb.doc_ids[j].size();
          }
          // Each document gives one ignored label; the rest are valid.
          EXPECT_EQ(mb.valid_tokens(), mb.routed_tokens() - docs);
        }
      }
      EXPECT_EQ(loader->position().sequences, int64_t{B} * steps);
    }
    for (size_t i = 0; i < seen.size(); ++i) EXPECT_EQ(seen[i], 1) << "sequence " << i;
  }
  EXPECT_GT(valid_counts.size(), 3u) << "valid-token counts should vary across micro-batches";
}

INSTANTIATE_TEST_SUITE_P(MarkovAndTextFile, GlobalStreamTest, ::testing::Bool());

// A loader of another rank and world that seeks to a position continues the same stream.
TEST(RankDataLoaderTest, SeekContinuesTheStreamOnAnotherMesh) {
  DataConfig config = SmallConfig();
  auto corpus = MakeCorpus(config);
  ASSERT_TRUE(corpus.ok());
  auto a = RankDataLoader::Create(*corpus, config, 1, 2);  // B = 2 x 2 x 3
  ASSERT_TRUE(a.ok());
  for (int s = 0; s < 3; ++s) a->NextStep(2);
  const DataPosition pos = a->position();
  EXPECT_EQ(pos.sequences, 36);
  const std::vector<std::vector<int64_t>> want = ReferenceSequences(**corpus, 32, 48);
  auto b = RankDataLoader::Create(*corpus, config, 0, 1);  // B = 1 x 4 x 3
  ASSERT_TRUE(b.ok());
  ASSERT_TRUE(b->Seek(pos).ok());
  const std::vector<MicroBatch> step = b->NextStep(4);
  for (int m = 0; m < 4; ++m) {
    for (int j = 0; j < 3; ++j) {
      EXPECT_EQ(step[m].sequence_ids[j], 36 + 3 * m + j);
      EXPECT_EQ(step[m].doc_ids[j], want[36 + 3 * m + j]);
    }
  }
  const absl::Status bad = b->Seek({5000, 0});
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.message(), HasSubstr("next_document=5000"));
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

// The packed stream of the order-2 corpus: mean -ln P(label | what the document shows so
// far) over valid tokens approaches the context floor (a document's first label is drawn
// from pi2 given its first token, later ones from the chain's row).
TEST(RankDataLoaderTest, SecondOrderPackedLabelsSitAtTheContextFloor) {
  const DataConfig config = SecondOrderConfig();
  auto corpus = std::make_shared<SecondOrderMarkovCorpus>(config);
  const SecondOrderMarkovChain& chain = corpus->chain();
  auto loader = RankDataLoader::Create(corpus, config, 1, 2);
  ASSERT_TRUE(loader.ok()) << loader.status();
  double total = 0;
  int64_t n = 0;
  for (int s = 0; s < 300; ++s) {
    for (const MicroBatch& mb : loader->NextStep(1)) {
      CheckPacking(mb, *corpus);
      for (size_t t = 0; t < mb.labels.size(); ++t) {
        if (mb.labels[t] == kIgnoreIndex) continue;
        const int cur = mb.tokens[t], next = mb.labels[t];
        if (mb.positions[t] == 0) {
          double pi1 = 0;
          for (int x : chain.alphabet()) pi1 += chain.PairStationary(cur, x);
          total -= std::log(chain.PairStationary(cur, next) / pi1);
        } else {
          total -= std::log(chain.Transition(mb.tokens[t - 1], cur, next));
        }
        ++n;
      }
    }
  }
  ASSERT_GT(n, 100000);
  EXPECT_NEAR(total / n, corpus->ContextFloorNats(), 0.015);
}

// Multi-token prediction (SEMANTICS.md §15.1): each depth's input tokens and labels are
// the main ones j further on inside the same document of the same sequence (else 0 and
// ignored), and n_s is the document's depth-j valid count; under CP 4 x SP 2 every rank
// holds exactly the unsplit loader's values at its positions (no rank needs another's).
TEST(RankDataLoaderTest, LabelStreamsAreRolledOnWholeSequences) {
  const DataConfig config = SmallConfig();  // seq_len 32
  auto corpus = MakeCorpus(config);
  ASSERT_TRUE(corpus.ok());
  const int K = 3, sp = 2, cp = 4, world = 16, L = 32, chunk = L / (2 * cp), local = L / (sp * cp);
  for (int data_rank = 0; data_rank < 2; ++data_rank) {
    auto whole = RankDataLoader::Create(*corpus, config, data_rank, 2);
    ASSERT_TRUE(whole.ok());
    ASSERT_TRUE(whole->SetLabelStreams(K + 1).ok());
    const std::vector<MicroBatch> want = whole->NextStep(2);
    int64_t cut = 0;  // labels a roll left ignored inside a document's last positions
    for (const MicroBatch& mb : want) {
      ASSERT_EQ(mb.extra_streams.size(), static_cast<size_t>(K));
      const int64_t n = static_cast<int64_t>(mb.tokens.size());
      for (int d = 1; d <= K; ++d) {
        std::map<int64_t, int64_t> doc_valid;  // by sample id
        for (int64_t t = 0; t < n; ++t) {
          const int64_t u = t + d;
          const bool inside =
              mb.mask[t] == 1 && u < n && u / L == t / L && mb.sample_ids[u] == mb.sample_ids[t];
          EXPECT_EQ(mb.extra_streams[d - 1].tokens[t], inside ? mb.tokens[u] : 0) << d << " " << t;
          EXPECT_EQ(mb.extra_streams[d - 1].labels[t], inside ? mb.labels[u] : kIgnoreIndex)
              << d << " " << t;
          if (mb.extra_streams[d - 1].labels[t] != kIgnoreIndex) ++doc_valid[mb.sample_ids[t]];
          cut += mb.labels[t] != kIgnoreIndex && mb.extra_streams[d - 1].labels[t] == kIgnoreIndex;
        }
        for (int64_t t = 0; t < n; ++t) {
          if (mb.mask[t] == 0) continue;
          EXPECT_EQ(mb.extra_streams[d - 1].sample_valid[t], doc_valid[mb.sample_ids[t]])
              << d << " " << t;
        }
      }
    }
    EXPECT_GT(cut, 0);
    for (int k = 0; k < sp * cp; ++k) {
      const int r = data_rank * sp * cp + k, i = k / sp, half = k % sp;
      auto loader = LoaderAt(*corpus, config, r, world, sp, cp);
      ASSERT_TRUE(loader.ok()) << loader.status();
      ASSERT_TRUE(loader->SetLabelStreams(K + 1).ok());
      const std::vector<MicroBatch> got = loader->NextStep(2);
      for (int m = 0; m < 2; ++m) {
        for (int j = 0; j < config.micro_batch(); ++j) {
          for (int u = 0; u < local; ++u) {
            const int v = half * local + u;
            const int pos = v < chunk ? i * chunk + v : (2 * cp - 1 - i) * chunk + v - chunk;
            const size_t at = static_cast<size_t>(j) * local + u;
            const size_t ref = static_cast<size_t>(j) * L + pos;
            for (int d = 0; d < K; ++d) {
              SCOPED_TRACE(absl::StrCat("rank ", r, " m ", m, " row ", j, " pos ", pos, " d ", d));
              EXPECT_EQ(got[m].extra_streams[d].tokens[at], want[m].extra_streams[d].tokens[ref]);
              EXPECT_EQ(got[m].extra_streams[d].labels[at], want[m].extra_streams[d].labels[ref]);
              EXPECT_EQ(got[m].extra_streams[d].sample_valid[at],
                        want[m].extra_streams[d].sample_valid[ref]);
            }
          }
        }
      }
    }
  }
  // One stream (the default) adds nothing; fewer than one is named.
  auto plain = RankDataLoader::Create(*corpus, config, 0, 2);
  ASSERT_TRUE(plain.ok());
  EXPECT_TRUE(plain->NextStep(1)[0].extra_streams.empty());
  EXPECT_EQ(plain->SetLabelStreams(0).code(), absl::StatusCode::kInvalidArgument);
}

// Context parallelism (SEMANTICS.md §16), crossed with SP: in world 16 with sp 2 and cp
// 4 (two data ranks), rank r holds, of each sequence cut into 8 chunks of 4 tokens, chunks
// i = (r % 8) / 2 and 7 - i put together, and of those 8 tokens the half r % 2. Every
// per-token value equals the unsplit loader's (world 2: the same two data ranks) at that
// position, the whole document starts are the same, and the 8 ranks of a group cover each
// position of each sequence exactly once.
TEST(RankDataLoaderTest, ContextParallelRanksHoldTheirZigzagChunks) {
  const DataConfig config = SmallConfig();  // seq_len 32
  auto corpus = MakeCorpus(config);
  ASSERT_TRUE(corpus.ok());
  const int sp = 2, cp = 4, world = 16, L = 32, chunk = L / (2 * cp), local = L / (sp * cp);
  for (int data_rank = 0; data_rank < 2; ++data_rank) {
    auto whole = RankDataLoader::Create(*corpus, config, data_rank, 2);
    ASSERT_TRUE(whole.ok());
    const std::vector<MicroBatch> want = whole->NextStep(2);
    std::vector<int> covered(2 * config.micro_batch() * L, 0);
    for (int k = 0; k < sp * cp; ++k) {
      const int r = data_rank * sp * cp + k, i = k / sp, half = k % sp;
      auto loader = LoaderAt(*corpus, config, r, world, sp, cp);
      ASSERT_TRUE(loader.ok()) << loader.status();
      const std::vector<MicroBatch> got = loader->NextStep(2);
      for (int m = 0; m < 2; ++m) {
        ASSERT_EQ(got[m].local_seq_len, local);
        EXPECT_EQ(got[m].doc_start, want[m].doc_start);
        EXPECT_EQ(got[m].sequence_ids, want[m].sequence_ids);
        for (int j = 0; j < config.micro_batch(); ++j) {
          for (int u = 0; u < local; ++u) {
            const int v = half * local + u;  // in the two chunks put together
            const int pos = v < chunk ? i * chunk + v : (2 * cp - 1 - i) * chunk + v - chunk;
            const size_t at = static_cast<size_t>(j) * local + u;
            const size_t ref = static_cast<size_t>(j) * L + pos;
            SCOPED_TRACE(absl::StrCat("rank ", r, " micro-batch ", m, " row ", j, " pos ", pos));
            EXPECT_EQ(got[m].tokens[at], want[m].tokens[ref]);
            EXPECT_EQ(got[m].labels[at], want[m].labels[ref]);
            EXPECT_EQ(got[m].mask[at], want[m].mask[ref]);
            EXPECT_EQ(got[m].positions[at], want[m].positions[ref]);
            EXPECT_EQ(got[m].sample_valid[at], want[m].sample_valid[ref]);
            ++covered[(m * config.micro_batch() + j) * L + pos];
          }
        }
      }
    }
    for (size_t p = 0; p < covered.size(); ++p) EXPECT_EQ(covered[p], 1) << p;
  }
  auto bad = LoaderAt(*corpus, config, 0, 16, 2, 3);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("cp=3"));
}

TEST(RankDataLoaderTest, BadArgumentsAreInvalidArgument) {
  DataConfig config = SmallConfig();
  config.set_corpus_documents(2);
  auto corpus = MakeCorpus(config);
  ASSERT_TRUE(corpus.ok());
  // Fewer documents than ranks is fine: the stream is global.
  EXPECT_TRUE(RankDataLoader::Create(*corpus, config, 3, 4).ok());
  auto s = RankDataLoader::Create(*corpus, config, 2, 2);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("rank=2"));
  config.set_corpus_documents(100);
  config.set_max_doc_len(40);  // > seq_len 32
  auto long_docs = MakeCorpus(config);
  ASSERT_TRUE(long_docs.ok());
  s = RankDataLoader::Create(*long_docs, config, 0, 1);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("data.seq_len=32"));
  // A place outside its data ranks, or a shard of sequences of another length, is named.
  DataPlace place;
  place.data_rank = 2;
  place.data_ranks = 2;
  s = RankDataLoader::Create(*corpus, config, place);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("data rank 2"));
  place.data_rank = 0;
  absl::StatusOr<SequenceShard> other = SequenceShard::Create(16, 1, 0, 1, 0);
  ASSERT_TRUE(other.ok());
  place.shard = *other;
  s = RankDataLoader::Create(*corpus, config, place);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("data.seq_len=32"));
  EXPECT_THAT(s.status().message(), HasSubstr("sequences of 16"));
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

TEST(TextFileCorpusTest, OnlyRegularFilesAndCorporaWithSomethingToPredict) {
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
  EXPECT_TRUE(RankDataLoader::Create(*corpus, config, 0, 2).ok());  // "ab\n" somewhere
  // Only one-byte lines: nothing to predict anywhere, named.
  std::ofstream(path, std::ios::binary | std::ios::trunc) << "\n\n\n";
  auto none = MakeCorpus(config);
  ASSERT_TRUE(none.ok()) << none.status();
  auto rank0 = RankDataLoader::Create(*none, config, 0, 2);
  EXPECT_EQ(rank0.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(rank0.status().message(),
              HasSubstr("--data=" + path + ": no trainable token in its 3 documents"));
}

}  // namespace
}  // namespace gradsum::data
