#include "data/blend.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/status.h"
#include "io/fingerprint.h"

namespace gradsum::data {

namespace {

// SplitMix64's finaliser (a bijection of 64-bit words with good avalanche).
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

int64_t EpochPermutation(uint64_t seed, int dataset, int64_t epoch, int64_t k, int64_t n) {
  int h = 1;
  while ((int64_t{1} << (2 * h)) < n) ++h;
  const uint64_t mask = (uint64_t{1} << h) - 1;
  const uint64_t base =
      Mix(Mix(Mix(seed) ^ static_cast<uint64_t>(dataset)) ^ static_cast<uint64_t>(epoch));
  uint64_t keys[4];
  for (uint64_t r = 0; r < 4; ++r) keys[r] = Mix(base ^ r);
  uint64_t x = static_cast<uint64_t>(k);
  do {
    uint64_t left = x >> h, right = x & mask;
    for (uint64_t key : keys) {
      const uint64_t next = left ^ (Mix(right ^ key) & mask);
      left = right;
      right = next;
    }
    x = (left << h) | right;
  } while (x >= static_cast<uint64_t>(n));  // cycle walking: at most 4^h / n < 4 tries on average
  return static_cast<int64_t>(x);
}

absl::StatusOr<std::unique_ptr<BlendedCorpus>> BlendedCorpus::Open(const BlendOptions& options) {
  std::vector<std::shared_ptr<const DocumentSource>> sources;
  for (const BlendEntry& e : options.entries) {
    if (!IsTokenFilePath(e.prefix)) {
      return absl::NotFoundError(absl::StrCat(options.describe, ": ", e.prefix,
                                              " is no token file (no ", e.prefix,
                                              ".idx beside it, nor an llm.c .bin, .u16 or .u32 "
                                              "file); tools/prepare_data makes one from text"));
    }
    TokenFileOptions token_options = options.token_options;
    token_options.flat_dtype = FlatDTypeOfPath(e.prefix);
    absl::StatusOr<std::unique_ptr<TokenFileCorpus>> corpus =
        TokenFileCorpus::Open(e.prefix, token_options);
    if (!corpus.ok()) return Annotate(corpus.status(), options.describe);
    sources.push_back(std::move(*corpus));
  }
  return Create(options, std::move(sources));
}

absl::StatusOr<std::unique_ptr<BlendedCorpus>> BlendedCorpus::Create(
    const BlendOptions& options, std::vector<std::shared_ptr<const DocumentSource>> sources) {
  const char* part_name[] = {"train", "validation", "test"};
  const int part = static_cast<int>(options.part);
  if (sources.size() != options.entries.size() || sources.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(options.describe, ": ", sources.size(),
                                                   " datasets for ", options.entries.size(),
                                                   " entries"));
  }
  auto corpus = std::unique_ptr<BlendedCorpus>(new BlendedCorpus());
  corpus->seed_ = options.seed;
  corpus->describe_ = absl::StrCat(options.describe, " (", part_name[part], " part of --split)");
  std::string identity =
      absl::StrFormat("blend v1 part %d seed %d split %.17g %.17g %.17g", part, options.seed,
                      options.split[0], options.split[1], options.split[2]);
  double total = 0;
  bool trainable = false;
  for (size_t d = 0; d < sources.size(); ++d) {
    const DocumentSource& s = *sources[d];
    const std::array<int64_t, 2> range = SplitRange(s.num_documents(), options.split, options.part);
    absl::StrAppend(&identity, absl::StrFormat(" | %.17g %d %d", options.entries[d].weight,
                                               s.num_documents(), s.ContentFingerprint()));
    if (range[1] == range[0]) {
      if (options.part == SplitPart::kTrain) {
        return absl::InvalidArgumentError(absl::StrCat(
            options.describe, ": ", options.entries[d].prefix, " has ", s.num_documents(),
            " documents, none of them in the train part of the split; give it more documents "
            "or a larger first --split part"));
      }
      continue;  // no held-out document: the other datasets' stand in
    }
    if (s.MaxDocumentLength() > options.token_options.max_len) {
      return absl::InvalidArgumentError(
          absl::StrCat(options.describe, ": ", s.Describe(), " has a document of ",
                       s.MaxDocumentLength(), " tokens > max_len ", options.token_options.max_len));
    }
    for (int64_t i = range[0]; !trainable && i < range[1]; ++i) {
      trainable = s.DocumentLength(i) >= 2;
    }
    corpus->dataset_.push_back(static_cast<int>(d));
    corpus->begin_.push_back(range[0]);
    corpus->count_.push_back(range[1] - range[0]);
    corpus->weights_.push_back(options.entries[d].weight);
    total += options.entries[d].weight;
    corpus->min_len_ = corpus->sources_.empty() ? s.MinDocumentLength()
                                                : std::min(corpus->min_len_, s.MinDocumentLength());
    corpus->max_len_ = std::max(corpus->max_len_, s.MaxDocumentLength());
    const auto* tokens = dynamic_cast<const TokenFileCorpus*>(&s);
    corpus->max_token_ = std::max(corpus->max_token_, tokens ? tokens->MaxToken() : int64_t{-1});
    corpus->sources_.push_back(sources[d]);
  }
  if (corpus->sources_.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(options.describe, ": the ", part_name[part],
                                                   " part of --split holds no document of any "
                                                   "dataset; give a larger ",
                                                   part_name[part], " part or more documents"));
  }
  if (!trainable) {
    return absl::InvalidArgumentError(absl::StrCat(
        corpus->describe_, ": no document has 2 tokens, so no token has a next one to predict"));
  }
  for (double& w : corpus->weights_) w /= total;
  corpus->fingerprint_ = Fingerprint64(identity);
  corpus->chunk_counts_.push_back(std::vector<int64_t>(corpus->sources_.size(), 0));
  return corpus;
}

void BlendedCorpus::DecodeChunk(int64_t c) const {
  std::vector<int64_t> counts = chunk_counts_[c];
  chunk_.resize(kChunk);
  const size_t n = sources_.size();
  for (int64_t j = 0; j < kChunk; ++j) {
    const double next = static_cast<double>(c * kChunk + j + 1);
    size_t best = 0;
    double best_error = weights_[0] * next - static_cast<double>(counts[0]);
    for (size_t d = 1; d < n; ++d) {
      const double error = weights_[d] * next - static_cast<double>(counts[d]);
      if (error > best_error) {
        best = d;
        best_error = error;
      }
    }
    const int64_t k = counts[best]++;
    const int64_t m = count_[best];
    chunk_[j] = {static_cast<int32_t>(best),
                 begin_[best] + EpochPermutation(seed_, dataset_[best], k / m, k % m, m)};
  }
  if (static_cast<int64_t>(chunk_counts_.size()) == c + 1) chunk_counts_.push_back(counts);
  chunk_index_ = c;
}

std::pair<int32_t, int64_t> BlendedCorpus::Resolve(int64_t i) const {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t c = i / kChunk;
  if (c != chunk_index_) {
    // The counts at chunk c's start need every chunk before it decoded once.
    while (static_cast<int64_t>(chunk_counts_.size()) <= c) {
      DecodeChunk(static_cast<int64_t>(chunk_counts_.size()) - 1);
    }
    if (c != chunk_index_) DecodeChunk(c);
  }
  return chunk_[i % kChunk];
}

std::pair<int, int64_t> BlendedCorpus::Source(int64_t i) const {
  const std::pair<int32_t, int64_t> at = Resolve(i);
  return {dataset_[at.first], at.second};
}

int64_t BlendedCorpus::DocumentLength(int64_t i) const {
  const std::pair<int32_t, int64_t> at = Resolve(i);
  return sources_[at.first]->DocumentLength(at.second);
}

std::vector<int32_t> BlendedCorpus::Document(int64_t i) const {
  const std::pair<int32_t, int64_t> at = Resolve(i);
  return sources_[at.first]->Document(at.second);
}

}  // namespace gradsum::data
