#ifndef GRADSUM_TRAIN_DATA_H_
#define GRADSUM_TRAIN_DATA_H_

// Training data for moe_lm: byte-level documents packed into fixed-length sequences.
//
// The embedded corpora need no file: document i is sampled from a fixed seeded Markov
// chain over a small printable alphabet, its length and tokens drawn from random streams
// keyed by (corpus_seed, i), so any document can be produced on demand. data.corpus picks
// the chain:
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
// Packing (RankDataLoader): one global stream of packed sequences, the same at every mesh
// (SEMANTICS.md §11). A global cursor walks the documents 0, 1, ..., n - 1, 0, 1, ...
// (epochs) and fills sequences greedily with whole documents; sequence i (0-based, global)
// is the i-th sequence so packed. Step s consumes sequences [s B, (s + 1) B), B = world x
// grad_acc x micro_batch, and sequence
//   i = s B + (m world + r) micro_batch + j
// is row j of micro-batch m on rank r. So runs whose meshes give the same B train on the
// same sequences in every step, and micro-batch m of the step is the contiguous range
// [s B + m world micro_batch, s B + (m + 1) world micro_batch) whatever the world.
// Every rank runs the packer over the whole step (document lengths only, cheap) and
// builds the tokens of its own rows. Inside a sequence, label[t] = token[t+1] of the same
// document; the last token of each document is ignored (label kIgnoreIndex); the tail is
// padding (mask 0, label kIgnoreIndex, token 0). So valid-token counts differ across
// ranks and micro-batches. The stream's position (DataPosition: the next document and the
// sequences consumed) goes into checkpoints; Seek continues from it on any mesh.
//
//   GRADSUM_ASSIGN_OR_RETURN(auto corpus, MakeCorpus(config.data()));
//   GRADSUM_ASSIGN_OR_RETURN(RankDataLoader loader,
//       RankDataLoader::Create(corpus, config.data(), rank, world));
//   std::vector<MicroBatch> step = loader.NextStep(grad_acc);  // G micro-batches

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "core/random.h"
#include "train/config.pb.h"

namespace gradsum::train {

// Label of a token that CE ignores (SEMANTICS.md §1).
inline constexpr int32_t kIgnoreIndex = -100;

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

// A random-access collection of byte-level documents.
class DocumentSource {
 public:
  virtual ~DocumentSource() = default;
  virtual int64_t num_documents() const = 0;
  // Length of document i (cheap; used to replay packing when resuming).
  virtual int64_t DocumentLength(int64_t i) const = 0;
  // The tokens of document i (values in [0, 256)).
  virtual std::vector<int32_t> Document(int64_t i) const = 0;
  // The per-token floor: the lowest expected CE (nats per labelled token, over the
  // documents as generated) of any model that predicts each label from the current token
  // alone, if known (the embedded corpora), else < 0.
  virtual double EntropyFloorNats() const { return -1; }
  // The context floor: the same for a model that sees the whole document up to the current
  // token (the best any model can reach), if known, else < 0. <= EntropyFloorNats().
  virtual double ContextFloorNats() const { return -1; }
  // Bounds on DocumentLength over all documents (so a loader need not scan them).
  virtual int64_t MinDocumentLength() const = 0;
  virtual int64_t MaxDocumentLength() const = 0;
  // What the documents come from, for messages ("the embedded Markov corpus", "--data=x").
  virtual std::string Describe() const = 0;
  // A fingerprint of the content that the config does not already fix (the --data file's
  // bytes), so ranks can check they train on the same data; 0 for generated corpora.
  virtual uint64_t ContentFingerprint() const { return 0; }
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
  explicit SeededCorpus(const DataConfig& config);
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
  explicit MarkovCorpus(const DataConfig& config);
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
  explicit SecondOrderMarkovCorpus(const DataConfig& config);
  std::vector<int32_t> Document(int64_t i) const override;
  double EntropyFloorNats() const override;
  double ContextFloorNats() const override;
  std::string Describe() const override { return "the embedded order-2 Markov corpus"; }
  const SecondOrderMarkovChain& chain() const { return chain_; }

 private:
  SecondOrderMarkovChain chain_;
};

// The largest --data file (bytes): the file is held in memory with an 8-byte index entry
// per document, so a file of N bytes takes at most 9 N bytes.
inline constexpr uint64_t kMaxDataFileBytes = uint64_t{1} << 30;

// A text file as documents: each line including its '\n' is a document; a line longer
// than `max_len` bytes is split into pieces of at most `max_len`.
class TextFileCorpus : public DocumentSource {
 public:
  // Reads `path` (ReadFileToString). It must be a regular file (FailedPrecondition naming
  // it: not a device or a directory) of 1 to kMaxDataFileBytes bytes (InvalidArgument if
  // empty, OutOfRange if bigger); a file that cannot be read is NotFound / PermissionDenied.
  static absl::StatusOr<std::unique_ptr<TextFileCorpus>> Load(const std::string& path, int max_len);
  int64_t num_documents() const override { return static_cast<int64_t>(starts_.size()) - 1; }
  int64_t DocumentLength(int64_t i) const override { return starts_[i + 1] - starts_[i]; }
  std::vector<int32_t> Document(int64_t i) const override;
  int64_t MinDocumentLength() const override { return min_len_; }
  int64_t MaxDocumentLength() const override { return max_len_; }
  std::string Describe() const override { return "--data=" + path_; }
  // XXH3-64 of the file's bytes (io/fingerprint.h Fingerprint64, `xxhsum -H3 FILE`).
  uint64_t ContentFingerprint() const override { return fingerprint_; }

 private:
  std::string path_;
  std::string bytes_;
  uint64_t fingerprint_ = 0;
  std::vector<int64_t> starts_;  // documents tile the file: starts_[i + 1] ends document i
  int64_t min_len_ = 0, max_len_ = 0;
};

// The corpus `config` names: the text file `path`, or when it is empty the embedded corpus
// `corpus` (markov1: MarkovCorpus, markov2: SecondOrderMarkovCorpus). InvalidArgument naming
// both fields if `path` is set and `corpus` names another embedded corpus than the
// default; the file's errors as in TextFileCorpus::Load.
absl::StatusOr<std::shared_ptr<const DocumentSource>> MakeCorpus(const DataConfig& config);

// Documents no training step reads, for the held-out evaluation: for the embedded corpora,
// the same chain's documents corpus_documents .. 2 corpus_documents - 1 (document i of the
// result is the corpus's document corpus_documents + i, generated as every other from its
// index); for a `path` run, the file `eval_path` (InvalidArgument naming it when empty).
absl::StatusOr<std::shared_ptr<const DocumentSource>> MakeHeldOutCorpus(const DataConfig& config);

// One micro-batch of one rank: `batch` packed sequences of `seq_len` tokens, row-major.
struct MicroBatch {
  int batch = 0;
  int seq_len = 0;  // tokens of a whole sequence
  // Tokens of each sequence this rank holds: seq_len / (sp cp) (SEMANTICS.md §12, §16),
  // seq_len without sequence or context parallelism. The per-token vectors below hold
  // batch * local_seq_len entries, sequence after sequence, in the order RankDataLoader
  // gives (its slice of the sequence, or of its two zigzag chunks put together).
  int local_seq_len = 0;
  std::vector<int32_t> tokens;  // [batch * local_seq_len]; padding 0
  std::vector<int32_t> labels;  // next token or kIgnoreIndex
  std::vector<int32_t> mask;    // 1 routed (a document token), 0 padding
  // Which packed document (sample, SEMANTICS.md §3) each token belongs to: unique within the
  // rank's step (a running count of the documents packed into it), -1 for padding.
  std::vector<int64_t> sample_ids;
  // The valid (labelled) tokens of each token's whole document, n_s of §3 even where the
  // document spans the ranks of an SP group; 0 for padding.
  std::vector<int64_t> sample_valid;
  // Attention's layout: each token's position in its document (RoPE), and for every
  // token of the WHOLE sequences [batch * seq_len] the index within its sequence of its
  // document's first token (-1 for padding).
  std::vector<int32_t> positions;
  std::vector<int32_t> doc_start;
  // The global index of each sequence (row) in the stream (see RankDataLoader).
  std::vector<int64_t> sequence_ids;
  // The documents packed into each sequence, in order (for tests and dumps).
  std::vector<std::vector<int64_t>> doc_ids;
  // Multi-token prediction (SEMANTICS.md §15.1), per depth j = 1 .. k (index j - 1) when the
  // loader has k > 0 (SetMtpDepth), for each local token t, rolled on the WHOLE sequence so
  // that no rank of an SP or CP group needs another's tokens: the input token x_j[t] =
  // token[t + j] when t + j is in t's document, else 0; the label y_j[t] = label[t + j]
  // under the same condition, else kIgnoreIndex; and n_s of depth j (the valid depth-j
  // labels of t's whole document, doc length - 1 - j, at least 0; 0 for padding).
  std::vector<std::vector<int32_t>> mtp_tokens;
  std::vector<std::vector<int32_t>> mtp_labels;
  std::vector<std::vector<int64_t>> mtp_sample_valid;

  int64_t valid_tokens() const;   // labels != kIgnoreIndex
  int64_t routed_tokens() const;  // mask == 1
};

// Where the global sequence stream stands: the next document the packer takes and how
// many sequences it has packed.
struct DataPosition {
  int64_t next_document = 0;
  int64_t sequences = 0;
};

// The global index of row j of micro-batch m on rank r in step s (0-based), for a mesh of
// `world` ranks with `grad_acc` micro-batches of `micro_batch` sequences.
int64_t GlobalSequenceIndex(int64_t step, int m, int rank, int j, int world, int grad_acc,
                            int micro_batch);

// Packs the global sequence stream and hands rank `rank` its rows of every step.
class RankDataLoader {
 public:
  // `rank` of `world`; with sequence parallelism (SEMANTICS.md §12) the world is
  // world / sp groups of `sp` consecutive ranks: group r = rank / sp reads the rows of data
  // rank r of world / sp, and rank i = rank % sp of it holds tokens [i seq_len / sp,
  // (i + 1) seq_len / sp) of each. With context parallelism (§16) groups of sp cp
  // consecutive ranks share sequences: rank j = (rank % (sp cp)) / sp of the CP group holds
  // chunks j and 2 cp - 1 - j of the 2 cp chunks of each sequence, put together in that
  // order, and its SP group splits those seq_len / cp tokens as above. InvalidArgument if
  // rank is outside [0, world), sp cp does not divide world, 2 cp does not divide seq_len
  // or sp does not divide seq_len / cp, the corpus has no document, no document has a trainable
  // token (all shorter than 2 tokens) or a document is longer than data.seq_len; the
  // message names the corpus (Describe).
  static absl::StatusOr<RankDataLoader> Create(std::shared_ptr<const DocumentSource> corpus,
                                               const DataConfig& config, int rank, int world,
                                               int sp = 1, int cp = 1);

  // The next `grad_acc` micro-batches of this rank (one optimizer step).
  std::vector<MicroBatch> NextStep(int grad_acc);
  // Advances as if NextStep(grad_acc) had been called `steps` times, without generating
  // tokens (packs document lengths only).
  void SkipSteps(int64_t steps, int grad_acc);

  // The stream's position after the steps so far; Seek(position()) on a loader of any
  // rank and world continues the same stream. InvalidArgument naming the value if
  // next_document is outside [0, num_documents) or sequences is negative.
  DataPosition position() const { return {cursor_, sequences_}; }
  absl::Status Seek(const DataPosition& position);

  // Multi-token prediction: NextStep also gives each micro-batch k depths' rolled inputs and
  // labels (MicroBatch::mtp_*). 0 (the default): none. InvalidArgument for k < 0.
  absl::Status SetMtpDepth(int k);

 private:
  RankDataLoader() = default;
  // Documents of the next global sequence; advances the cursor.
  std::vector<int64_t> NextSequenceDocs();

  std::shared_ptr<const DocumentSource> corpus_;
  int rank_ = 0, world_ = 1;  // the data rank (SP x CP group) and the number of them
  int sp_ = 1, sp_rank_ = 0;
  int cp_ = 1, cp_rank_ = 0;
  int seq_len_ = 0, micro_batch_ = 0;
  int mtp_depth_ = 0;
  int64_t cursor_ = 0, sequences_ = 0;
};

}  // namespace gradsum::train

#endif  // GRADSUM_TRAIN_DATA_H_
