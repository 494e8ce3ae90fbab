#include "data/markov.h"

#include <algorithm>
#include <cmath>
#include <utility>

namespace gradsum::data {
namespace {

// The reachable bytes: printable, so that dumped batches are readable.
constexpr char kAlphabet[] = "abcdefghijklmnopqrstuvwxyz .,!?'";
constexpr int kExtraSuccessors = 5;    // besides the cycle successor
constexpr double kWeightSpread = 1.2;  // log-normal spread of the successor weights

// SecondOrderMarkovChain: each byte a picks kPoolSize successors with weights
// exp(kWeightSpread N(0, 1)); row (a, b) is those weights scaled to 1 - kCycleMass, plus
// kCycleMass on b's successor in a random cycle.
constexpr int kPoolSize = 4;
constexpr double kCycleMass = 0.15;

// The alphabet's bytes, ascending.
std::vector<int> SortedAlphabet() {
  std::vector<int> bytes;
  for (const char* c = kAlphabet; *c != 0; ++c) bytes.push_back(static_cast<unsigned char>(*c));
  std::sort(bytes.begin(), bytes.end());
  return bytes;
}

// The index drawn from the discrete law `p` (summing to 1 up to rounding) by one uniform.
int SampleIndex(const double* p, int n, SplitMix64& rng) {
  const double u = rng.Uniform();
  double acc = 0;
  int last = 0;
  for (int j = 0; j < n; ++j) {
    if (p[j] <= 0) continue;
    acc += p[j];
    last = j;
    if (u < acc) return j;
  }
  return last;  // u within rounding of 1
}

// The stationary law of a chain by power iteration on its lazy version (P + I) / 2, which
// has the same stationary law and converges even if P is periodic: from `pi`, each round
// lazy_step(pi, next) adds one lazy step of pi into `next` (zeroed), until the L1 change is
// below 1e-15; the result is normalised.
template <typename LazyStep>
std::vector<double> StationaryByPowerIteration(std::vector<double> pi, LazyStep lazy_step) {
  std::vector<double> next(pi.size());
  for (int it = 0; it < 1000000; ++it) {
    std::fill(next.begin(), next.end(), 0.0);
    lazy_step(pi, next);
    double diff = 0;
    for (size_t s = 0; s < pi.size(); ++s) diff += std::abs(next[s] - pi[s]);
    pi.swap(next);
    if (diff < 1e-15) break;
  }
  double total = 0;
  for (double p : pi) total += p;
  for (double& p : pi) p /= total;
  return pi;
}

}  // namespace

MarkovChain MarkovChain::Create(uint64_t seed) {
  MarkovChain chain;
  SplitMix64 rng(MixSeed(seed, 0x6d61726b6f76ull));
  chain.alphabet_ = SortedAlphabet();
  const int n = static_cast<int>(chain.alphabet_.size());
  // A random cycle through the alphabet makes the chain irreducible.
  std::vector<int> cycle = chain.alphabet_;
  for (int i = n - 1; i > 0; --i) std::swap(cycle[i], cycle[rng.Below(i + 1)]);
  chain.transition_.assign(kStates * kStates, 0.0);
  for (int k = 0; k < n; ++k) {
    const int from = cycle[k];
    std::vector<int> succ = {cycle[(k + 1) % n]};
    while (static_cast<int>(succ.size()) < 1 + kExtraSuccessors) {
      const int to = chain.alphabet_[rng.Below(n)];
      if (std::find(succ.begin(), succ.end(), to) == succ.end()) succ.push_back(to);
    }
    double total = 0;
    std::vector<double> w(succ.size());
    for (double& x : w) total += (x = std::exp(kWeightSpread * rng.Normal()));
    for (size_t j = 0; j < succ.size(); ++j) {
      chain.transition_[from * kStates + succ[j]] = w[j] / total;
    }
  }
  std::vector<double> uniform(kStates, 0.0);
  for (int s : chain.alphabet_) uniform[s] = 1.0 / n;
  chain.stationary_ = StationaryByPowerIteration(
      std::move(uniform), [&chain](const std::vector<double>& pi, std::vector<double>& next) {
        for (int i : chain.alphabet_) {
          next[i] += 0.5 * pi[i];
          for (int j : chain.alphabet_) next[j] += 0.5 * pi[i] * chain.Transition(i, j);
        }
      });
  return chain;
}

double MarkovChain::ConditionalEntropyNats() const {
  double h = 0;
  for (int i : alphabet_) {
    double row = 0;
    for (int j : alphabet_) {
      const double p = Transition(i, j);
      if (p > 0) row -= p * std::log(p);
    }
    h += stationary_[i] * row;
  }
  return h;
}

int MarkovChain::SampleNext(int from, SplitMix64& rng) const {
  const double u = rng.Uniform();
  double acc = 0;
  int last = from;
  for (int j : alphabet_) {
    const double p = Transition(from, j);
    if (p <= 0) continue;
    acc += p;
    last = j;
    if (u < acc) return j;
  }
  return last;  // u within rounding of 1
}

int MarkovChain::SampleStationary(SplitMix64& rng) const {
  const double u = rng.Uniform();
  double acc = 0;
  int last = alphabet_.front();
  for (int j : alphabet_) {
    acc += stationary_[j];
    last = j;
    if (u < acc) return j;
  }
  return last;
}

SeededCorpus::SeededCorpus(const train::DataConfig& config)
    : seed_(config.corpus_seed()),
      num_documents_(config.corpus_documents()),
      min_len_(config.min_doc_len()),
      max_len_(config.max_doc_len()) {}

int64_t SeededCorpus::DocumentLength(int64_t i) const {
  SplitMix64 rng(MixSeed(seed_, static_cast<uint64_t>(i), 1));
  return min_len_ + static_cast<int64_t>(rng.Below(max_len_ - min_len_ + 1));
}

SplitMix64 SeededCorpus::TokenStream(int64_t i) const {
  return SplitMix64(MixSeed(seed_, static_cast<uint64_t>(i), 2));
}

MarkovCorpus::MarkovCorpus(const train::DataConfig& config)
    : SeededCorpus(config), chain_(MarkovChain::Create(config.corpus_seed())) {}

std::vector<int32_t> MarkovCorpus::Document(int64_t i) const {
  const int64_t len = DocumentLength(i);
  SplitMix64 rng = TokenStream(i);
  std::vector<int32_t> doc(len);
  doc[0] = chain_.SampleStationary(rng);
  for (int64_t t = 1; t < len; ++t) doc[t] = chain_.SampleNext(doc[t - 1], rng);
  return doc;
}

SecondOrderMarkovChain SecondOrderMarkovChain::Create(uint64_t seed) {
  SecondOrderMarkovChain chain;
  SplitMix64 rng(MixSeed(seed, 0x6d61726b6f7632ull));  // "markov2"
  chain.alphabet_ = SortedAlphabet();
  const int n = chain.n_ = static_cast<int>(chain.alphabet_.size());
  chain.index_.assign(256, -1);
  for (int k = 0; k < n; ++k) chain.index_[chain.alphabet_[k]] = k;
  // Indices from here on. The cycle successor of every current byte reaches every pair
  // (b, cycle[b]) from anywhere, so the pair chain has a single recurrent class.
  std::vector<int> order(n), cycle_next(n);
  for (int k = 0; k < n; ++k) order[k] = k;
  for (int k = n - 1; k > 0; --k) std::swap(order[k], order[rng.Below(k + 1)]);
  for (int k = 0; k < n; ++k) cycle_next[order[k]] = order[(k + 1) % n];
  std::vector<std::vector<int>> pool(n);
  std::vector<std::vector<double>> pool_weight(n);
  for (int a = 0; a < n; ++a) {
    while (static_cast<int>(pool[a].size()) < kPoolSize) {
      const int c = static_cast<int>(rng.Below(n));
      if (std::find(pool[a].begin(), pool[a].end(), c) == pool[a].end()) pool[a].push_back(c);
    }
    for (int j = 0; j < kPoolSize; ++j) {
      pool_weight[a].push_back(std::exp(kWeightSpread * rng.Normal()));
    }
  }
  chain.transition_.assign(static_cast<size_t>(n) * n * n, 0.0);
  for (int a = 0; a < n; ++a) {
    for (int b = 0; b < n; ++b) {
      double* row = &chain.transition_[(static_cast<size_t>(a) * n + b) * n];
      double total = 0;
      for (double w : pool_weight[a]) total += w;
      for (int j = 0; j < kPoolSize; ++j) {
        row[pool[a][j]] += (1 - kCycleMass) * pool_weight[a][j] / total;
      }
      row[cycle_next[b]] += kCycleMass;
    }
  }
  // pi2: the pair chain moves (a, b) to (b, c) with probability P(c | a, b).
  chain.pair_stationary_ = StationaryByPowerIteration(
      std::vector<double>(static_cast<size_t>(n) * n, 1.0 / (n * n)),
      [&chain, n](const std::vector<double>& pi, std::vector<double>& next) {
        for (size_t s = 0; s < pi.size(); ++s) next[s] += 0.5 * pi[s];
        for (int a = 0; a < n; ++a) {
          for (int b = 0; b < n; ++b) {
            const double mass = 0.5 * pi[a * n + b];
            const double* row = &chain.transition_[(static_cast<size_t>(a) * n + b) * n];
            for (int c = 0; c < n; ++c) next[b * n + c] += mass * row[c];
          }
        }
      });
  return chain;
}

double SecondOrderMarkovChain::Transition(int prev, int cur, int to) const {
  const int a = Index(prev), b = Index(cur), c = Index(to);
  if (a < 0 || b < 0 || c < 0) return 0;
  return transition_[(static_cast<size_t>(a) * n_ + b) * n_ + c];
}

double SecondOrderMarkovChain::PairStationary(int prev, int cur) const {
  const int a = Index(prev), b = Index(cur);
  return a < 0 || b < 0 ? 0 : pair_stationary_[a * n_ + b];
}

double SecondOrderMarkovChain::ConditionalEntropyNats() const {
  double h = 0;
  for (int ab = 0; ab < n_ * n_; ++ab) {
    const double* row = &transition_[static_cast<size_t>(ab) * n_];
    double row_h = 0;
    for (int c = 0; c < n_; ++c) {
      if (row[c] > 0) row_h -= row[c] * std::log(row[c]);
    }
    h += pair_stationary_[ab] * row_h;
  }
  return h;
}

double SecondOrderMarkovChain::FirstOrderEntropyNats() const {
  // pi2 is the stationary law of consecutive pairs, so H(X_{t+1} | X_t) is the conditional
  // entropy of its second coordinate given its first: -sum pi2(b, c) ln(pi2(b, c) / pi1(b)).
  double h = 0;
  for (int b = 0; b < n_; ++b) {
    double pi1 = 0;
    for (int c = 0; c < n_; ++c) pi1 += pair_stationary_[b * n_ + c];
    for (int c = 0; c < n_; ++c) {
      const double p = pair_stationary_[b * n_ + c];
      if (p > 0) h -= p * std::log(p / pi1);
    }
  }
  return h;
}

int SecondOrderMarkovChain::SampleNext(int prev, int cur, SplitMix64& rng) const {
  const int a = Index(prev), b = Index(cur);
  return alphabet_[SampleIndex(&transition_[(static_cast<size_t>(a) * n_ + b) * n_], n_, rng)];
}

std::pair<int, int> SecondOrderMarkovChain::SampleStationaryPair(SplitMix64& rng) const {
  const int ab = SampleIndex(pair_stationary_.data(), n_ * n_, rng);
  return {alphabet_[ab / n_], alphabet_[ab % n_]};
}

double ExpectedNatsPerLabel(double first_label_nats, double later_label_nats, int min_len,
                            int max_len) {
  // Each length is equally likely, so the expectation per label is the labels' total cost
  // over the lengths divided by their number.
  double cost = 0, labels = 0;
  for (int len = min_len; len <= max_len; ++len) {
    if (len < 2) continue;
    cost += first_label_nats + (len - 2) * later_label_nats;
    labels += len - 1;
  }
  return labels > 0 ? cost / labels : -1;
}

SecondOrderMarkovCorpus::SecondOrderMarkovCorpus(const train::DataConfig& config)
    : SeededCorpus(config), chain_(SecondOrderMarkovChain::Create(config.corpus_seed())) {}

std::vector<int32_t> SecondOrderMarkovCorpus::Document(int64_t i) const {
  const int64_t len = DocumentLength(i);
  SplitMix64 rng = TokenStream(i);
  std::vector<int32_t> doc(len);
  if (len == 0) return doc;
  const auto [first, second] = chain_.SampleStationaryPair(rng);
  doc[0] = first;
  if (len > 1) doc[1] = second;
  for (int64_t t = 2; t < len; ++t) doc[t] = chain_.SampleNext(doc[t - 2], doc[t - 1], rng);
  return doc;
}

double SecondOrderMarkovCorpus::EntropyFloorNats() const {
  // Every labelled pair is a stationary pair, the first of a document included.
  const double h1 = chain_.FirstOrderEntropyNats();
  return ExpectedNatsPerLabel(h1, h1, MinDocumentLength(), MaxDocumentLength());
}

double SecondOrderMarkovCorpus::ContextFloorNats() const {
  // A document's first label is predicted from its first token alone (the document mask
  // hides the others); every later one has the previous token too, which is all the
  // context there is for an order-2 chain.
  return ExpectedNatsPerLabel(chain_.FirstOrderEntropyNats(), chain_.ConditionalEntropyNats(),
                              MinDocumentLength(), MaxDocumentLength());
}

}  // namespace gradsum::data
