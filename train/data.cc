#include "train/data.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "io/atomic_file.h"
#include "io/fingerprint.h"

namespace gradsum::train {
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

SeededCorpus::SeededCorpus(const DataConfig& config)
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

MarkovCorpus::MarkovCorpus(const DataConfig& config)
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

SecondOrderMarkovCorpus::SecondOrderMarkovCorpus(const DataConfig& config)
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

absl::StatusOr<std::unique_ptr<TextFileCorpus>> TextFileCorpus::Load(const std::string& path,
                                                                     int max_len) {
  const std::string name = absl::StrCat("--data=", path);
  if (max_len < 1) {
    return absl::InvalidArgumentError(absl::StrCat("max_len=", max_len, ": must be positive"));
  }
  absl::StatusOr<std::string> bytes = ReadFileToString(path, kMaxDataFileBytes);
  if (!bytes.ok()) return Annotate(bytes.status(), name);
  auto corpus = std::unique_ptr<TextFileCorpus>(new TextFileCorpus());
  corpus->path_ = path;
  corpus->bytes_ = std::move(*bytes);
  if (corpus->bytes_.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": file is empty"));
  }
  corpus->fingerprint_ = Fingerprint64(corpus->bytes_);
  const int64_t n = static_cast<int64_t>(corpus->bytes_.size());
  corpus->min_len_ = max_len;
  int64_t line_start = 0;
  while (line_start < n) {
    const void* nl = std::memchr(corpus->bytes_.data() + line_start, '\n', n - line_start);
    int64_t line_end = nl == nullptr ? n : static_cast<const char*>(nl) - corpus->bytes_.data() + 1;
    for (int64_t s = line_start; s < line_end; s += max_len) {
      corpus->starts_.push_back(s);
      const int64_t len = std::min<int64_t>(max_len, line_end - s);
      corpus->min_len_ = std::min(corpus->min_len_, len);
      corpus->max_len_ = std::max(corpus->max_len_, len);
    }
    line_start = line_end;
  }
  corpus->starts_.push_back(n);
  return corpus;
}

std::vector<int32_t> TextFileCorpus::Document(int64_t i) const {
  std::vector<int32_t> doc(DocumentLength(i));
  for (int64_t t = 0; t < static_cast<int64_t>(doc.size()); ++t) {
    doc[t] = static_cast<unsigned char>(bytes_[starts_[i] + t]);
  }
  return doc;
}

namespace {

// Documents offset .. offset + n - 1 of `source` as documents 0 .. n - 1.
class OffsetDocuments : public DocumentSource {
 public:
  OffsetDocuments(std::shared_ptr<const DocumentSource> source, int64_t offset)
      : source_(std::move(source)), offset_(offset) {}
  int64_t num_documents() const override { return source_->num_documents(); }
  int64_t DocumentLength(int64_t i) const override { return source_->DocumentLength(offset_ + i); }
  std::vector<int32_t> Document(int64_t i) const override { return source_->Document(offset_ + i); }
  double EntropyFloorNats() const override { return source_->EntropyFloorNats(); }
  double ContextFloorNats() const override { return source_->ContextFloorNats(); }
  int64_t MinDocumentLength() const override { return source_->MinDocumentLength(); }
  int64_t MaxDocumentLength() const override { return source_->MaxDocumentLength(); }
  std::string Describe() const override {
    return absl::StrCat(source_->Describe(), "'s held-out documents");
  }

 private:
  std::shared_ptr<const DocumentSource> source_;
  int64_t offset_;
};

}  // namespace

absl::StatusOr<std::shared_ptr<const DocumentSource>> MakeHeldOutCorpus(const DataConfig& config) {
  if (config.path().empty()) {
    absl::StatusOr<std::shared_ptr<const DocumentSource>> corpus = MakeCorpus(config);
    if (!corpus.ok()) return corpus.status();
    const int64_t n = (*corpus)->num_documents();
    return std::shared_ptr<const DocumentSource>(
        std::make_shared<const OffsetDocuments>(std::move(*corpus), n));
  }
  if (config.eval_path().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("log.eval_every > 0 with data.path=", config.path(),
                     " needs data.eval_path (--eval_data): a file of held-out documents"));
  }
  DataConfig held_out = config;
  held_out.set_path(config.eval_path());
  return MakeCorpus(held_out);
}

absl::StatusOr<std::shared_ptr<const DocumentSource>> MakeCorpus(const DataConfig& config) {
  if (config.path().empty()) {
    switch (config.corpus()) {
      case DataConfig::markov1:
        return std::make_shared<const MarkovCorpus>(config);
      case DataConfig::markov2:
        return std::make_shared<const SecondOrderMarkovCorpus>(config);
    }
    return absl::InvalidArgumentError(
        absl::StrCat("data.corpus=", static_cast<int>(config.corpus()), ": unknown corpus"));
  }
  // A resolved config with a file carries markov1 (ResolvedConfig); any other corpus set
  // beside a file is a contradiction.
  if (config.has_corpus() && config.corpus() != DataConfig::markov1) {
    return absl::InvalidArgumentError(
        absl::StrCat("data.corpus=", DataConfig::Corpus_Name(config.corpus()),
                     " names an embedded corpus, "
                     "but data.path=",
                     config.path(), " trains on a file: give one or the other"));
  }
  absl::StatusOr<std::unique_ptr<TextFileCorpus>> file =
      TextFileCorpus::Load(config.path(), config.seq_len());
  if (!file.ok()) return file.status();
  return std::shared_ptr<const DocumentSource>(std::move(*file));
}

int64_t MicroBatch::valid_tokens() const {
  return std::count_if(labels.begin(), labels.end(), [](int32_t y) { return y != kIgnoreIndex; });
}

int64_t MicroBatch::routed_tokens() const { return std::count(mask.begin(), mask.end(), 1); }

int64_t GlobalSequenceIndex(int64_t step, int m, int rank, int j, int world, int grad_acc,
                            int micro_batch) {
  const int64_t per_step = int64_t{world} * grad_acc * micro_batch;
  return step * per_step + (int64_t{m} * world + rank) * micro_batch + j;
}

absl::StatusOr<RankDataLoader> RankDataLoader::Create(std::shared_ptr<const DocumentSource> corpus,
                                                      const DataConfig& config, int rank, int world,
                                                      int sp, int cp) {
  if (world < 1 || rank < 0 || rank >= world) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank=", rank, ": must be in [0, world=", world, ")"));
  }
  if (sp < 1 || world % sp != 0 || config.seq_len() % sp != 0) {
    return absl::InvalidArgumentError(absl::StrCat("sp=", sp, ": must divide world=", world,
                                                   " and data.seq_len=", config.seq_len()));
  }
  if (cp < 1 || world % (sp * cp) != 0 ||
      (cp > 1 && (config.seq_len() % (2 * cp) != 0 || (config.seq_len() / cp) % sp != 0))) {
    return absl::InvalidArgumentError(absl::StrCat("cp=", cp, ": sp x cp must divide world=", world,
                                                   ", 2 cp data.seq_len=", config.seq_len(),
                                                   " and sp=", sp, " data.seq_len / cp"));
  }
  if (config.seq_len() < 2 || config.micro_batch() < 1) {
    return absl::InvalidArgumentError(absl::StrCat("data.seq_len=", config.seq_len(),
                                                   ", data.micro_batch=", config.micro_batch(),
                                                   ": need seq_len >= 2 and micro_batch >= 1"));
  }
  const int64_t n = corpus->num_documents();
  const std::string where = corpus->Describe();
  if (n < 1) return absl::InvalidArgumentError(absl::StrCat(where, ": has no document"));
  if (corpus->MaxDocumentLength() > config.seq_len()) {
    for (int64_t i = 0; i < n; ++i) {
      if (corpus->DocumentLength(i) > config.seq_len()) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": document ", i, " has length ",
                                                       corpus->DocumentLength(i),
                                                       " > data.seq_len=", config.seq_len()));
      }
    }
  }
  // A document needs 2 tokens for one labelled pair (SEMANTICS.md §1).
  bool trainable = corpus->MinDocumentLength() >= 2;
  for (int64_t i = 0; !trainable && i < n; ++i) trainable = corpus->DocumentLength(i) >= 2;
  if (!trainable) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": no trainable token in its ", n,
                     " documents (every document, i.e. line, has "
                     "fewer than 2 bytes, so no token has a next token to predict)"));
  }
  RankDataLoader loader;
  loader.corpus_ = std::move(corpus);
  loader.rank_ = rank / (sp * cp);
  loader.world_ = world / (sp * cp);
  loader.sp_ = sp;
  loader.sp_rank_ = rank % sp;
  loader.cp_ = cp;
  loader.cp_rank_ = (rank % (sp * cp)) / sp;
  loader.seq_len_ = config.seq_len();
  loader.micro_batch_ = config.micro_batch();
  return loader;
}

absl::Status RankDataLoader::Seek(const DataPosition& position) {
  if (position.next_document < 0 || position.next_document >= corpus_->num_documents() ||
      position.sequences < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("data position: next_document=", position.next_document,
                     ", sequences=", position.sequences, " is not a position in ",
                     corpus_->Describe(), " (", corpus_->num_documents(), " documents)"));
  }
  cursor_ = position.next_document;
  sequences_ = position.sequences;
  return absl::OkStatus();
}

absl::Status RankDataLoader::SetMtpDepth(int k) {
  if (k < 0) return absl::InvalidArgumentError(absl::StrCat("MTP depth ", k, ": must be >= 0"));
  mtp_depth_ = k;
  return absl::OkStatus();
}

std::vector<int64_t> RankDataLoader::NextSequenceDocs() {
  std::vector<int64_t> docs;
  int64_t used = 0;
  const int64_t n = corpus_->num_documents();
  while (true) {
    const int64_t len = corpus_->DocumentLength(cursor_);
    if (used + len > seq_len_) break;  // every document fits an empty sequence
    docs.push_back(cursor_);
    used += len;
    if (++cursor_ == n) cursor_ = 0;  // next epoch
  }
  ++sequences_;
  return docs;
}

std::vector<MicroBatch> RankDataLoader::NextStep(int grad_acc) {
  const int local = seq_len_ / (sp_ * cp_);
  std::vector<MicroBatch> step(grad_acc);
  for (MicroBatch& mb : step) {
    mb.batch = micro_batch_;
    mb.seq_len = seq_len_;
    mb.local_seq_len = local;
    const size_t n = static_cast<size_t>(micro_batch_) * local;
    mb.tokens.assign(n, 0);
    mb.labels.assign(n, kIgnoreIndex);
    mb.mask.assign(n, 0);
    mb.sample_ids.assign(n, -1);
    mb.sample_valid.assign(n, 0);
    mb.positions.assign(n, 0);
    mb.doc_start.assign(static_cast<size_t>(micro_batch_) * seq_len_, -1);
    mb.sequence_ids.assign(micro_batch_, -1);
    mb.doc_ids.assign(micro_batch_, {});
    mb.mtp_tokens.assign(mtp_depth_, std::vector<int32_t>(n, 0));
    mb.mtp_labels.assign(mtp_depth_, std::vector<int32_t>(n, kIgnoreIndex));
    mb.mtp_sample_valid.assign(mtp_depth_, std::vector<int64_t>(n, 0));
  }
  // The step's global sequences k = (m world + r) micro_batch + j, in order: this rank's
  // rows come in (m, j) order, so sample ids count its documents in packing order. A
  // sequence is laid out whole; the rank keeps its slice [sp_rank local, + local) of the
  // CP group's tokens (the whole sequence without CP; with it, chunks cp_rank and
  // 2 cp - 1 - cp_rank of 2 cp put together).
  int64_t sample = -1;  // index of the current document among those packed into the step
  const int per_micro = world_ * micro_batch_;
  const int64_t first = int64_t{sp_rank_} * local, last = first + local;
  const int64_t chunk = seq_len_ / (2 * cp_);
  // Position pos of the whole sequence in the CP group's tokens, or -1 if another has it.
  auto cp_index = [&](int64_t pos) -> int64_t {
    if (cp_ == 1) return pos;
    const int64_t c = pos / chunk;
    if (c == cp_rank_) return pos - c * chunk;
    if (c == 2 * cp_ - 1 - cp_rank_) return chunk + pos - c * chunk;
    return -1;
  };
  for (int64_t k = 0; k < int64_t{grad_acc} * per_micro; ++k) {
    const int64_t index = sequences_;
    std::vector<int64_t> docs = NextSequenceDocs();
    const int m = static_cast<int>(k / per_micro);
    const int r = static_cast<int>(k % per_micro) / micro_batch_;
    const int j = static_cast<int>(k % micro_batch_);
    if (r != rank_) continue;
    MicroBatch& mb = step[m];
    mb.sequence_ids[j] = index;
    int64_t pos = 0;  // in the whole sequence
    for (int64_t id : docs) {
      const std::vector<int32_t> doc = corpus_->Document(id);
      ++sample;
      const int64_t start = pos;
      for (size_t t = 0; t < doc.size(); ++t, ++pos) {
        mb.doc_start[static_cast<size_t>(j) * seq_len_ + pos] = static_cast<int32_t>(start);
        const int64_t held = cp_index(pos);
        if (held < first || held >= last) continue;  // -1 too
        const size_t at = static_cast<size_t>(j) * local + (held - first);
        mb.tokens[at] = doc[t];
        mb.mask[at] = 1;
        mb.sample_ids[at] = sample;
        mb.sample_valid[at] = static_cast<int64_t>(doc.size()) - 1;
        mb.positions[at] = static_cast<int32_t>(t);
        // The last token of a document has no next token in it: ignored.
        mb.labels[at] = t + 1 < doc.size() ? doc[t + 1] : kIgnoreIndex;
        // MTP depth d: token and label d further on, inside the document (§15.1).
        for (int d = 1; d <= mtp_depth_; ++d) {
          const size_t u = t + static_cast<size_t>(d);
          if (u < doc.size()) mb.mtp_tokens[d - 1][at] = doc[u];
          if (u + 1 < doc.size()) mb.mtp_labels[d - 1][at] = doc[u + 1];
          mb.mtp_sample_valid[d - 1][at] =
              std::max<int64_t>(0, static_cast<int64_t>(doc.size()) - 1 - d);
        }
      }
    }
    mb.doc_ids[j] = std::move(docs);
  }
  return step;
}

void RankDataLoader::SkipSteps(int64_t steps, int grad_acc) {
  const int64_t sequences = steps * grad_acc * world_ * micro_batch_;
  for (int64_t s = 0; s < sequences; ++s) NextSequenceDocs();
}

}  // namespace gradsum::train
