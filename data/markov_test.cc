#include "data/markov.h"

#include <cmath>
#include <cstdint>
#include <iostream>
#include <set>
#include <utility>
#include <vector>

#include "core/random.h"
#include "gtest/gtest.h"

namespace gradsum::data {
namespace {

using train::DataConfig;

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

TEST(SecondOrderMarkovChainTest, RowsAndPairStationaryAreDistributions) {
  const SecondOrderMarkovChain chain = SecondOrderMarkovChain::Create(7);
  const std::vector<int>& alphabet = chain.alphabet();
  ASSERT_EQ(alphabet.size(), 32u);
  double pi_total = 0;
  for (int a : alphabet) {
    for (int b : alphabet) {
      double row = 0;
      for (int c = 0; c < 256; ++c) row += chain.Transition(a, b, c);
      EXPECT_NEAR(row, 1.0, 1e-12) << a << " " << b;
      pi_total += chain.PairStationary(a, b);
    }
  }
  EXPECT_NEAR(pi_total, 1.0, 1e-12);
  EXPECT_EQ(chain.Transition('A', alphabet[0], alphabet[0]), 0.0);
  EXPECT_EQ(chain.PairStationary(alphabet[0], 0), 0.0);
  // pi2 is stationary: sum_a pi2(a, b) P(c | a, b) = pi2(b, c), so its two marginals agree.
  for (int b : alphabet) {
    double first = 0, second = 0;
    for (int x : alphabet) {
      first += chain.PairStationary(b, x);
      second += chain.PairStationary(x, b);
    }
    EXPECT_NEAR(first, second, 1e-12) << b;
    for (int c : alphabet) {
      double flow = 0;
      for (int a : alphabet) flow += chain.PairStationary(a, b) * chain.Transition(a, b, c);
      EXPECT_NEAR(flow, chain.PairStationary(b, c), 1e-12) << b << " " << c;
    }
  }
  // Seeing the byte before the current one helps, and neither entropy is trivial.
  EXPECT_GT(chain.FirstOrderEntropyNats(), 1.15 * chain.ConditionalEntropyNats());
  EXPECT_GT(chain.ConditionalEntropyNats(), 0.3);
  EXPECT_LT(chain.FirstOrderEntropyNats(), std::log(32.0));
}

TEST(SecondOrderMarkovChainTest, SameSeedSameChainOtherSeedOther) {
  const SecondOrderMarkovChain a = SecondOrderMarkovChain::Create(1),
                               b = SecondOrderMarkovChain::Create(1),
                               c = SecondOrderMarkovChain::Create(2);
  EXPECT_EQ(a.ConditionalEntropyNats(), b.ConditionalEntropyNats());
  EXPECT_EQ(a.FirstOrderEntropyNats(), b.FirstOrderEntropyNats());
  EXPECT_NE(a.ConditionalEntropyNats(), c.ConditionalEntropyNats());
}

TEST(ExpectedNatsPerLabelTest, WeighsEachLengthByItsLabels) {
  // Lengths 2, 3, 4: labels 1 + 2 + 3 = 6, of which 3 are first labels.
  EXPECT_DOUBLE_EQ(ExpectedNatsPerLabel(2.0, 1.0, 2, 4), (3 * 2.0 + 3 * 1.0) / 6);
  EXPECT_DOUBLE_EQ(ExpectedNatsPerLabel(5.0, 1.0, 2, 2), 5.0);
  // One-token documents have no label.
  EXPECT_DOUBLE_EQ(ExpectedNatsPerLabel(2.0, 1.0, 1, 3), (2 * 2.0 + 1 * 1.0) / 3);
  EXPECT_LT(ExpectedNatsPerLabel(2.0, 1.0, 1, 1), 0);
}

// For the first-order chain the current token is all the context: both floors are H.
TEST(MarkovCorpusTest, BothFloorsAreTheConditionalEntropy) {
  const MarkovCorpus corpus{DataConfig()};
  EXPECT_EQ(corpus.EntropyFloorNats(), corpus.chain().ConditionalEntropyNats());
  EXPECT_EQ(corpus.ContextFloorNats(), corpus.EntropyFloorNats());
}

DataConfig SecondOrderConfig() {
  DataConfig c;
  c.set_corpus(DataConfig::markov2);
  return c;
}

TEST(SecondOrderMarkovCorpusTest, DeterministicPerSeedAndOnDemand) {
  const DataConfig config = SecondOrderConfig();
  const SecondOrderMarkovCorpus a(config), b(config);
  DataConfig other_seed = config;
  other_seed.set_corpus_seed(config.corpus_seed() + 1);
  const SecondOrderMarkovCorpus c(other_seed);
  const int n = 300;
  std::vector<std::vector<int32_t>> in_order;
  for (int64_t i = 0; i < n; ++i) in_order.push_back(a.Document(i));
  std::set<int> bytes(a.chain().alphabet().begin(), a.chain().alphabet().end());
  int differ = 0;
  for (int64_t i = n - 1; i >= 0; --i) {  // another instance, another order
    const std::vector<int32_t> doc = b.Document((i * 7) % n);
    EXPECT_EQ(doc, in_order[(i * 7) % n]) << "document " << (i * 7) % n;
    EXPECT_EQ(static_cast<int64_t>(in_order[i].size()), a.DocumentLength(i));
    EXPECT_GE(a.DocumentLength(i), config.min_doc_len());
    EXPECT_LE(a.DocumentLength(i), config.max_doc_len());
    for (int32_t x : in_order[i]) EXPECT_EQ(bytes.count(x), 1u) << x;
    differ += c.Document(i) != in_order[i];
  }
  EXPECT_GT(differ, n - 5) << "another seed gives other documents";
  // The first-order corpus of the same seed draws the same lengths, other tokens.
  const MarkovCorpus first(config);
  EXPECT_EQ(first.DocumentLength(5), a.DocumentLength(5));
  EXPECT_NE(first.Document(5), a.Document(5));
}

// Chi-square of `counts` (n draws) against the law `p` over the same cells; cells expected
// below 5 draws are pooled into one.
struct ChiSquare {
  double statistic = 0;
  int dof = -1;
};
ChiSquare ChiSquareAgainst(const std::vector<int64_t>& counts, const std::vector<double>& p,
                           int64_t n) {
  ChiSquare out;
  double pooled_expected = 0, pooled_observed = 0;
  for (size_t k = 0; k < counts.size(); ++k) {
    const double expected = p[k] * n;
    if (expected < 5) {
      pooled_expected += expected;
      pooled_observed += counts[k];
      continue;
    }
    out.statistic += (counts[k] - expected) * (counts[k] - expected) / expected;
    ++out.dof;
  }
  if (pooled_expected > 0) {
    out.statistic += (pooled_observed - pooled_expected) * (pooled_observed - pooled_expected) /
                     std::max(pooled_expected, 1.0);
    ++out.dof;
  }
  return out;
}

// Documents start in pi2, and the chain keeps it: the pair at positions (0, 1) and the one
// at (5, 6) both follow pi2 (chi-square within 5 standard deviations of its dof).
TEST(SecondOrderMarkovCorpusTest, DocumentsStartInTheStationaryPairLaw) {
  const SecondOrderMarkovCorpus corpus(SecondOrderConfig());
  const std::vector<int>& alphabet = corpus.chain().alphabet();
  const int n = static_cast<int>(alphabet.size());
  std::vector<int> index(256, -1);
  for (int k = 0; k < n; ++k) index[alphabet[k]] = k;
  std::vector<double> pi2(n * n);
  for (int a = 0; a < n; ++a) {
    for (int b = 0; b < n; ++b)
      pi2[a * n + b] = corpus.chain().PairStationary(alphabet[a], alphabet[b]);
  }
  const int64_t docs = 60000;
  std::vector<int64_t> first(n * n, 0), later(n * n, 0);
  for (int64_t i = 0; i < docs; ++i) {
    const std::vector<int32_t> doc = corpus.Document(i);
    ++first[index[doc[0]] * n + index[doc[1]]];
    ++later[index[doc[5]] * n + index[doc[6]]];  // every document has >= min_doc_len = 8
  }
  for (const auto& [name, counts] : {std::pair{"first", &first}, std::pair{"later", &later}}) {
    const ChiSquare chi = ChiSquareAgainst(*counts, pi2, docs);
    ASSERT_GT(chi.dof, 200) << name;
    EXPECT_LT(chi.statistic, chi.dof + 5 * std::sqrt(2.0 * chi.dof)) << name;
  }
  // A start drawn as a first-order stationary byte followed by a uniform one would not pass.
  std::vector<double> wrong(n * n);
  for (int a = 0; a < n; ++a) {
    double pi1 = 0;
    for (int b = 0; b < n; ++b) pi1 += pi2[a * n + b];
    for (int b = 0; b < n; ++b) wrong[a * n + b] = pi1 / n;
  }
  const ChiSquare bad = ChiSquareAgainst(first, wrong, docs);
  EXPECT_GT(bad.statistic, bad.dof + 50 * std::sqrt(2.0 * bad.dof));
}

// The exact floors against plug-in estimates from sampled documents, which know nothing of
// pi2 or of the length law: H(label | current token) over every label, and H(label |
// context) where the context of a document's first label is its first token only and that
// of every later label is (previous, current).
TEST(SecondOrderMarkovCorpusTest, FloorsMatchPlugInEstimatesFromDocuments) {
  const DataConfig config = SecondOrderConfig();
  const SecondOrderMarkovCorpus corpus(config);
  const std::vector<int>& alphabet = corpus.chain().alphabet();
  const int n = static_cast<int>(alphabet.size());
  std::vector<int> index(256, -1);
  for (int k = 0; k < n; ++k) index[alphabet[k]] = k;
  // Contexts: (previous, current) as previous * n + current, (start, current) as n * n + current.
  std::vector<int64_t> per_token(n * n, 0), per_context((n + 1) * n * n, 0);
  int64_t labels = 0;
  for (int64_t i = 0; i < 40000; ++i) {
    const std::vector<int32_t> doc = corpus.Document(i);
    for (size_t t = 0; t + 1 < doc.size(); ++t) {
      const int prev = t == 0 ? n : index[doc[t - 1]], cur = index[doc[t]];
      const int next = index[doc[t + 1]];
      ++per_token[cur * n + next];
      ++per_context[(prev * n + cur) * n + next];
      ++labels;
    }
  }
  ASSERT_GT(labels, 1000000);
  auto plug_in = [&](const std::vector<int64_t>& counts) {  // rows of n cells
    double h = 0;
    for (size_t row = 0; row < counts.size(); row += n) {
      int64_t total = 0;
      for (int c = 0; c < n; ++c) total += counts[row + c];
      for (int c = 0; c < n; ++c) {
        if (counts[row + c] == 0) continue;
        const double k = static_cast<double>(counts[row + c]);
        h -= k / labels * std::log(k / total);
      }
    }
    return h;
  };
  const double per_token_floor = corpus.EntropyFloorNats();
  const double context_floor = corpus.ContextFloorNats();
  // Sampling error and the plug-in's downward bias are about 0.1% here; 0.6% is well
  // below the 2.5% by which leaving out the first labels' H1 would lower the context floor.
  std::cout << "plug-in per-token " << plug_in(per_token) << " (floor " << per_token_floor
            << "), context " << plug_in(per_context) << " (floor " << context_floor << ", H2 "
            << corpus.chain().ConditionalEntropyNats() << ")\n";
  EXPECT_NEAR(plug_in(per_token) / per_token_floor, 1.0, 0.006);
  EXPECT_NEAR(plug_in(per_context) / context_floor, 1.0, 0.006);
  // The floors are what the chain's entropies give: H1 everywhere for a per-token model,
  // and for the context strictly between H2 and H1 (each document's first label costs H1).
  EXPECT_NEAR(per_token_floor, corpus.chain().FirstOrderEntropyNats(), 1e-12);
  EXPECT_GT(context_floor, corpus.chain().ConditionalEntropyNats());
  EXPECT_LT(context_floor, per_token_floor);
}

// The default parameters leave a clear gap for attention to close.
TEST(SecondOrderMarkovCorpusTest, PerTokenFloorIsClearlyAboveTheContextFloor) {
  const SecondOrderMarkovCorpus corpus(SecondOrderConfig());
  const double per_token = corpus.EntropyFloorNats(), context = corpus.ContextFloorNats();
  std::cout << "order-2 corpus, default config: per-token floor " << per_token
            << " nats, context floor " << context << " nats, ratio " << per_token / context << "\n";
  EXPECT_GE(per_token / context, 1.15);
}

}  // namespace
}  // namespace gradsum::data
