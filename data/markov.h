#ifndef GRADSUM_DATA_MARKOV_H_
#define GRADSUM_DATA_MARKOV_H_

// The embedded corpora: byte-level documents that need no file. Document i is sampled from
// a fixed seeded Markov chain over a small printable alphabet, its length and tokens drawn
// from random streams keyed by (corpus_seed, i), so any document can be produced on demand.
// data.corpus picks the chain:
//   markov1 (MarkovCorpus): first order. The conditional entropy H(X_{t+1} | X_t) under
//     the stationary law is the floor of the expected CE of any model, per-token or not.
//   markov2 (SecondOrderMarkovCorpus): second order, the next byte depending mostly on
//     the byte before the current one, so a model that sees the previous token (attention)
//     can go well below what a per-token model can reach.
// Documents start in the stationary law of the chain's state, so every labelled pair is
// a stationary transition. Each corpus states two floors of the expected CE per labelled
// token: EntropyFloorNats, the best of a model that sees only the current token, and
// ContextFloorNats, the best of one that sees the whole document so far.
//
//   MarkovCorpus corpus(config.data());
//   std::vector<int32_t> doc = corpus.Document(17);  // the same on every rank and run

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/random.h"
#include "data/document_source.h"
#include "train/config.pb.h"

namespace gradsum::data {

// A first-order Markov chain over the 256 byte values. Only a small alphabet of
// printable bytes is reachable, each with a few successors of skewed probability, so
// the conditional entropy is well below ln 256. The chain is irreducible on its
// alphabet (each row includes the next symbol of a random cycle).
class MarkovChain {
 public:
  static constexpr int kStates = 256;

  // The chain for `seed`; the same seed gives the same chain everywhere.
  static MarkovChain Create(uint64_t seed);

  // P(next = to | current = from).
  double Transition(int from, int to) const { return transition_[from * kStates + to]; }
  // The stationary distribution pi (pi P = pi), 0 outside the alphabet.
  const std::vector<double>& stationary() const { return stationary_; }
  // Bytes that the chain visits, ascending.
  const std::vector<int>& alphabet() const { return alphabet_; }
  // H = sum_i pi_i * (-sum_j P_ij ln P_ij), in nats per token, computed exactly.
  double ConditionalEntropyNats() const;

  // Draws the next byte after `from` (which must be in the alphabet).
  int SampleNext(int from, SplitMix64& rng) const;
  // Draws a byte from the stationary distribution.
  int SampleStationary(SplitMix64& rng) const;

 private:
  std::vector<double> transition_;  // row-major [256, 256]
  std::vector<double> stationary_;
  std::vector<int> alphabet_;
};

// What the embedded corpora share: `corpus_documents` documents, document i of a length
// uniform in [min_doc_len, max_doc_len] drawn from the stream (corpus_seed, i, 1), its
// tokens from TokenStream(i) = (corpus_seed, i, 2).
class SeededCorpus : public DocumentSource {
 public:
  int64_t num_documents() const override { return num_documents_; }
  int64_t DocumentLength(int64_t i) const override;
  int64_t MinDocumentLength() const override { return min_len_; }
  int64_t MaxDocumentLength() const override { return max_len_; }

 protected:
  explicit SeededCorpus(const train::DataConfig& config);
  SplitMix64 TokenStream(int64_t i) const;

 private:
  uint64_t seed_;
  int64_t num_documents_;
  int min_len_, max_len_;
};

// The embedded corpus: `corpus_documents` documents from MarkovChain::Create(corpus_seed),
// lengths uniform in [min_doc_len, max_doc_len], first token from the stationary law.
class MarkovCorpus : public SeededCorpus {
 public:
  explicit MarkovCorpus(const train::DataConfig& config);
  std::vector<int32_t> Document(int64_t i) const override;
  double EntropyFloorNats() const override { return chain_.ConditionalEntropyNats(); }
  // A first-order chain: the current token is all the context there is, and every labelled
  // pair (the first of a document included) is stationary, so both floors are H.
  double ContextFloorNats() const override { return chain_.ConditionalEntropyNats(); }
  std::string Describe() const override { return "the embedded Markov corpus"; }
  const MarkovChain& chain() const { return chain_; }

 private:
  MarkovChain chain_;
};

// A second-order Markov chain over the 32 printable bytes of MarkovChain's alphabet: the
// state is the pair (previous, current), and P(next | previous, current) is a mixture:
// 85% from a few successors of the previous byte (4 per byte, log-normal weights), 15% the
// successor of the current byte in a random cycle, which gives the pair chain one recurrent
// class. So a model that sees only the current byte is left with a mixture over the bytes
// that may precede it, while one that also sees the previous byte knows the row. Pairs the
// chain never reaches have stationary mass 0.
//
//   SecondOrderMarkovChain chain = SecondOrderMarkovChain::Create(seed);
//   auto [a, b] = chain.SampleStationaryPair(rng);
//   int c = chain.SampleNext(a, b, rng);
class SecondOrderMarkovChain {
 public:
  // The chain for `seed`; the same seed gives the same chain everywhere.
  static SecondOrderMarkovChain Create(uint64_t seed);

  // P(next = to | previous = prev, current = cur); 0 if any byte is outside the alphabet.
  double Transition(int prev, int cur, int to) const;
  // The stationary law of the pair (X_{t-1}, X_t): pi2 with sum_a pi2(a, b) P(c | a, b) =
  // pi2(b, c); 0 outside the alphabet.
  double PairStationary(int prev, int cur) const;
  // Bytes that the chain visits, ascending.
  const std::vector<int>& alphabet() const { return alphabet_; }
  // H(X_{t+1} | X_{t-1}, X_t) under pi2, nats, computed exactly: the cost of every label
  // after a document's first for a model that sees the document so far.
  double ConditionalEntropyNats() const;
  // H(X_{t+1} | X_t) under pi2, nats, computed exactly: the cost of every label for a
  // model that sees only the current byte (and of the first label of a document for any
  // model, which has only its first byte to go on).
  double FirstOrderEntropyNats() const;

  // Draws the next byte after (prev, cur), both in the alphabet.
  int SampleNext(int prev, int cur, SplitMix64& rng) const;
  // Draws a pair (X_0, X_1) from pi2.
  std::pair<int, int> SampleStationaryPair(SplitMix64& rng) const;

 private:
  int Index(int byte) const { return byte >= 0 && byte < 256 ? index_[byte] : -1; }
  int n_ = 0;                            // alphabet size
  std::vector<int> alphabet_;            // bytes by index
  std::vector<int> index_;               // [256] index of each byte, -1 outside the alphabet
  std::vector<double> transition_;       // [n, n, n] by indices (prev, cur, next)
  std::vector<double> pair_stationary_;  // [n, n]
};

// The expected CE per labelled token over documents of lengths uniform in [min_len,
// max_len] (a document of n tokens has n - 1 labels) when a document's first label costs
// `first_label_nats` and each later one `later_label_nats` in expectation.
double ExpectedNatsPerLabel(double first_label_nats, double later_label_nats, int min_len,
                            int max_len);

// data.corpus = markov2: `corpus_documents` documents from
// SecondOrderMarkovChain::Create(corpus_seed), lengths uniform in [min_doc_len,
// max_doc_len], the first two tokens from pi2 (a one-token document keeps the first).
// Floors (exact, ExpectedNatsPerLabel over the length law): per-token, H1 =
// FirstOrderEntropyNats() for every label; context, H1 for each document's first label and
// H2 = ConditionalEntropyNats() for the others.
class SecondOrderMarkovCorpus : public SeededCorpus {
 public:
  explicit SecondOrderMarkovCorpus(const train::DataConfig& config);
  std::vector<int32_t> Document(int64_t i) const override;
  double EntropyFloorNats() const override;
  double ContextFloorNats() const override;
  std::string Describe() const override { return "the embedded order-2 Markov corpus"; }
  const SecondOrderMarkovChain& chain() const { return chain_; }

 private:
  SecondOrderMarkovChain chain_;
};

}  // namespace gradsum::data

#endif  // GRADSUM_DATA_MARKOV_H_
