#include "losses/vocab_parallel_ce.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "collectives/status_agreement.h"
#include "core/dtype.h"
#include "core/gemm.h"
#include "core/status.h"
#include "data/streams.h"
#include "losses/cross_entropy_kernel.h"
#include "losses/cross_entropy_rows.h"
#include "losses/parallel.h"

namespace gradsum::losses {
namespace {

using internal::kCeTile;
using internal::kRowOk;
using internal::VpGradRow;

constexpr char kWho[] = "vocab-parallel cross-entropy";
constexpr double kInf = std::numeric_limits<double>::infinity();
// The automatic exchange of the plain variant with a gradient: rows whose shard is about
// this many bytes, so the exp values the local pass keeps in the gradient buffer are still
// in cache (L2/L3) when the gradient is written over them after the exchange.
constexpr int64_t kAutoExchangeBytes = int64_t{2} << 20;

// What the call is; part of what the ranks must agree on.
enum class Kind { kForward = 0, kForwardBackward = 1, kLinear = 2 };

// One call's arguments as every rank sees them, after its local checks.
struct Call {
  Kind kind = Kind::kForward;
  int64_t n = 0;  // labels.size(): defined whatever the tensors are, so every rank can
                  // join the exchanges even when its own tensors are bad
  int64_t vocab = 0;
  int64_t v0 = 0, vr = 0;  // this rank's shard
  double d = 0.0;
  int64_t ignore_index = data::kIgnoreIndex;
  double eps = 0.0, alpha = 0.0;
  int64_t exchange_rows = 1;   // resolved from agreed values only
  int64_t requested_rows = 0;  // the option as given (agreed)
  int64_t hidden_dim = 0;      // the linear variant's H, else 0
  int num_threads = 1;
  absl::Span<const int64_t> labels;
  absl::Span<const float> weights;
};

// The call's description from the arguments every variant shares; `requested_rows` is the
// variant's exchange option (rows_per_exchange, or the linear variant's chunk_rows).
template <typename Options>
Call MakeCall(Kind kind, absl::Span<const int64_t> labels, int64_t vocab_start,
              int64_t global_vocab, absl::Span<const float> token_weights, double global_weight_sum,
              const Options& options, int64_t requested_rows) {
  Call c;
  c.kind = kind;
  c.n = static_cast<int64_t>(labels.size());
  c.vocab = global_vocab;
  c.v0 = vocab_start;
  c.d = global_weight_sum;
  c.ignore_index = options.ignore_index;
  c.eps = options.label_smoothing;
  c.alpha = options.alpha_lse;
  c.requested_rows = requested_rows;
  c.num_threads = std::max(1, options.num_threads);
  c.labels = labels;
  c.weights = token_weights;
  return c;
}

float RowWeight(const Call& c, int64_t t) {
  if (c.d == 0.0 || c.labels[t] == c.ignore_index) return 0.0f;
  return c.weights.empty() ? 1.0f : c.weights[t];
}

// A 52-bit fingerprint of the labels and the effective weights (exact in a double), so the
// MAX all-reduce can tell whether every rank of the group has the same tokens.
double TokenFingerprint(const Call& c) {
  auto mix = [](uint64_t x) {  // splitmix64's finaliser
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
  };
  uint64_t h = mix(0x9e3779b97f4a7c15ull ^ static_cast<uint64_t>(c.n));
  for (int64_t t = 0; t < c.n; ++t) {
    const float w = c.labels[t] == c.ignore_index ? 0.0f : c.weights.empty() ? 1.0f : c.weights[t];
    uint32_t wb;
    std::memcpy(&wb, &w, sizeof(wb));
    h = mix(h ^ static_cast<uint64_t>(c.labels[t]));
    h = mix(h ^ wb);
  }
  return static_cast<double>(h >> 12);
}

struct Agreed {
  const char* name;
  double value;
};

// The scalars every rank must agree on, in a fixed order (the header's layout).
std::vector<Agreed> AgreedValues(const Call& c, double fingerprint) {
  return {{"the row count N", static_cast<double>(c.n)},
          {"global_vocab", static_cast<double>(c.vocab)},
          {"the global weight sum D", c.d},
          {"ignore_index", static_cast<double>(c.ignore_index)},
          {"label_smoothing", c.eps},
          {"alpha_lse", c.alpha},
          {"the rows per exchange (option)", static_cast<double>(c.requested_rows)},
          {"the variant (0 forward, 1 forward+backward, 2 linear)",
           static_cast<double>(static_cast<int>(c.kind))},
          {"the hidden size", static_cast<double>(c.hidden_dim)},
          {"the labels and weights (fingerprint)", fingerprint}};
}

// Per-call scratch, sized for one exchange.
struct Scratch {
  std::vector<float> weight, row_max, target, tile_ref;
  std::vector<double> row_sum, row_zsum;
  std::vector<int64_t> local_label;
  std::vector<uint8_t> code;
  std::vector<double> max_buf, sum_buf;
  std::vector<VpGradRow> grad_rows;
};

struct Totals {
  double weighted_ce = 0.0, weighted_lse_sq = 0.0, weight = 0.0;
  int64_t valid = 0;
  int collectives = 0;
};

const char* LocalCodeText(uint8_t code) {
  return code == internal::kRowNaN ? "contains NaN" : "contains +inf";
}

// Rows per block of the row passes, and whether to use the threads, as the CE kernel.
int64_t RowsPerBlock(int64_t vr) {
  return std::clamp<int64_t>((int64_t{1} << 18) / std::max<int64_t>(vr, 1), 1, 1024);
}

// fn(i0, k) for the blocks [i0, i0 + k) of `rows` rows of `vr` columns, on `num_threads`
// threads when the rows are large enough to be worth it.
template <typename Fn>
void ForEachRowBlock(int64_t rows, int64_t vr, int num_threads, Fn fn) {
  const int64_t per_block = RowsPerBlock(vr);
  const int64_t blocks = (rows + per_block - 1) / per_block;
  const int threads = rows * vr >= (int64_t{1} << 16) ? num_threads : 1;
  ParallelFor(threads, blocks, [&](int64_t b) {
    const int64_t i0 = b * per_block;
    fn(i0, std::min(rows, i0 + per_block) - i0);
  });
}

// Step 1 of an exchange, the local pass over rows [r0, r0 + rows) of this rank's shard: each
// row's weight and local label, then max, exp sum (exps kept in the gradient), target and
// sum of z. Only runs while *local is OK; a non-finite row sets *local.
void LocalPass(int rank, const Call& c, absl::Status* local, const float* logits, float* grad,
               int64_t r0, int64_t rows, Scratch* s) {
  const int64_t vr = c.vr;
  const int64_t tiles = (vr + kCeTile - 1) / kCeTile;
  const bool eps_on = c.eps > 0.0;
  s->weight.resize(rows);
  s->row_max.resize(rows);
  s->target.resize(rows);
  s->row_sum.resize(rows);
  s->row_zsum.resize(eps_on ? rows : 0);
  s->local_label.resize(rows);
  s->code.resize(rows);
  if (grad != nullptr) s->tile_ref.resize(static_cast<size_t>(rows * tiles));
  if (!local->ok()) return;
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t t = r0 + i;
    s->weight[i] = RowWeight(c, t);
    const int64_t y = c.labels[t];
    s->local_label[i] = s->weight[i] != 0.0f && y >= c.v0 && y < c.v0 + vr ? y - c.v0 : int64_t{-1};
  }
  const auto local_rows = internal::SelectedCeRowKernels().vp_local_f32;
  ForEachRowBlock(rows, vr, c.num_threads, [&](int64_t i0, int64_t k) {
    local_rows(logits + i0 * vr, grad == nullptr ? nullptr : grad + i0 * vr,
               grad == nullptr ? nullptr : s->tile_ref.data() + i0 * tiles, k, vr,
               s->weight.data() + i0, s->local_label.data() + i0, s->row_max.data() + i0,
               s->row_sum.data() + i0, eps_on ? s->row_zsum.data() + i0 : nullptr,
               s->target.data() + i0, s->code.data() + i0);
  });
  for (int64_t i = 0; i < rows; ++i) {
    if (s->code[i] == kRowOk) continue;
    *local = absl::InvalidArgumentError(
        absl::StrCat(kWho, ": logits row ", r0 + i, " (label ", c.labels[r0 + i], ") ",
                     LocalCodeText(s->code[i]), " in the shard [", c.v0, ", ", c.v0 + vr,
                     ") of rank ", rank, " (the loss would be NaN)"));
    break;
  }
}

// The reduced shard starts (mb[starts + q]) and sizes (mb[starts + p + q]) of the p ranks
// must tile [0, vocab) without gap or overlap.
absl::Status CheckShardsPartition(const std::vector<double>& mb, int64_t starts, int p,
                                  int64_t vocab) {
  std::vector<std::pair<int64_t, int>> order;  // (start, rank)
  for (int q = 0; q < p; ++q) order.push_back({static_cast<int64_t>(mb[starts + q]), q});
  std::sort(order.begin(), order.end());
  int64_t end = 0;
  for (const auto& [start, q] : order) {
    const int64_t size = static_cast<int64_t>(mb[starts + p + q]);
    if (start != end) {
      return MarkAgreed(absl::InvalidArgumentError(absl::StrCat(
          kWho, ": the shards do not partition [0, ", vocab, "): rank ", q, " starts at ", start,
          " where ", end == 0 ? "the first shard must start (0)" : "the shard before ends (",
          end == 0 ? "" : absl::StrCat(end, ")"))));
    }
    end = start + size;
  }
  if (end != vocab) {
    return MarkAgreed(absl::InvalidArgumentError(
        absl::StrCat(kWho, ": the shards do not partition [0, ", vocab, "): they end at ", end)));
  }
  return absl::OkStatus();
}

// Step 2, the MAX all-reduce of s->max_buf: [error flag | agreed scalars as (x, -x) | shard
// starts | shard sizes | row maxes]. The header costs a few dozen doubles next to the row
// maxes. Then the checks every rank makes on the same reduced values (so every rank takes
// the same branch): no rank flagged an error, the agreed values agree, the shards tile the
// vocabulary. On success *header is where the global row maxes start in s->max_buf.
absl::Status ReduceRowMaxes(Communicator& group, const Call& c, const absl::Status& local,
                            int64_t rows, double fingerprint, Scratch* s, Totals* totals,
                            int64_t* header) {
  const std::vector<Agreed> agreed = AgreedValues(c, fingerprint);
  const int p = group.size();
  *header = 1 + 2 * static_cast<int64_t>(agreed.size()) + 2 * p;
  std::vector<double>& mb = s->max_buf;
  mb.assign(static_cast<size_t>(*header + rows), -kInf);
  mb[0] = local.ok() ? 0.0 : 1.0;
  for (size_t k = 0; k < agreed.size(); ++k) {
    mb[1 + 2 * k] = agreed[k].value;
    mb[2 + 2 * k] = -agreed[k].value;
  }
  const int64_t starts = 1 + 2 * static_cast<int64_t>(agreed.size());
  mb[starts + group.rank()] = static_cast<double>(c.v0);
  mb[starts + p + group.rank()] = static_cast<double>(c.vr);
  if (local.ok()) {
    for (int64_t i = 0; i < rows; ++i) mb[*header + i] = static_cast<double>(s->row_max[i]);
  }
  absl::Status st = group.AllReduce(mb.data(), mb.data(), mb.size(), DType::kF64, ReduceOp::kMax);
  ++totals->collectives;
  if (!st.ok()) return Annotate(st, absl::StrCat(kWho, ": the MAX all-reduce of the row maxes"));
  if (mb[0] > 0.0) {
    // Some rank's own arguments are bad: every rank learns every failing rank's message.
    st = AgreeOnStatus(group, local, kWho);
    if (st.ok()) st = absl::InternalError(absl::StrCat(kWho, ": a rank flagged an error"));
    return st;
  }
  for (size_t k = 0; k < agreed.size(); ++k) {
    const double hi = mb[1 + 2 * k], lo = -mb[2 + 2 * k];
    if (hi != lo) {
      return MarkAgreed(absl::InvalidArgumentError(
          absl::StrCat(kWho, ": the ranks of the group disagree on ", agreed[k].name, " (min ", lo,
                       ", max ", hi, "); every rank must pass the same value")));
    }
  }
  return CheckShardsPartition(mb, starts, p, c.vocab);
}

// Step 3: rescale the local sums to the global maxes gmax; SUM all-reduce of s->sum_buf =
// [sums | targets | zsums].
absl::Status ReduceExpSums(Communicator& group, const Call& c, int64_t r0, int64_t rows,
                           const double* gmax, Scratch* s, Totals* totals) {
  const bool eps_on = c.eps > 0.0;
  for (int64_t i = 0; i < rows; ++i) {
    if (s->weight[i] != 0.0f && gmax[i] == -kInf) {
      return MarkAgreed(absl::InvalidArgumentError(
          absl::StrCat(kWho, ": logits row ", r0 + i, " (label ", c.labels[r0 + i],
                       ") is all -inf over the whole vocabulary (the loss would be NaN)")));
    }
  }
  std::vector<double>& sb = s->sum_buf;
  sb.assign(static_cast<size_t>((eps_on ? 3 : 2) * rows), 0.0);
  for (int64_t i = 0; i < rows; ++i) {
    if (s->weight[i] == 0.0f) continue;
    const double m = s->row_max[i];
    sb[i] = m == -kInf ? 0.0 : s->row_sum[i] * std::exp(m - gmax[i]);
    sb[rows + i] = s->target[i];
    if (eps_on) sb[2 * rows + i] = s->row_zsum[i];
  }
  absl::Status st = group.AllReduce(sb.data(), sb.data(), sb.size(), DType::kF64, ReduceOp::kSum);
  ++totals->collectives;
  if (!st.ok()) return Annotate(st, absl::StrCat(kWho, ": the SUM all-reduce of the exp sums"));
  return absl::OkStatus();
}

// Step 4: each row's loss from the reduced values (the same on every rank) into *totals,
// and with a gradient its parameters into s->grad_rows.
absl::Status RowLosses(const Call& c, bool with_grad, int64_t r0, int64_t rows, const double* gmax,
                       Scratch* s, Totals* totals) {
  const bool eps_on = c.eps > 0.0;
  const std::vector<double>& sb = s->sum_buf;
  s->grad_rows.assign(static_cast<size_t>(rows), VpGradRow{});
  const double inv_v = 1.0 / static_cast<double>(c.vocab);
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t t = r0 + i;
    if (c.labels[t] != c.ignore_index) ++totals->valid;
    const double w = s->weight[i];
    if (w == 0.0) continue;
    const double m = gmax[i];
    const double z_y = sb[rows + i];
    if (z_y == -kInf) {
      return MarkAgreed(absl::InvalidArgumentError(
          absl::StrCat(kWho, ": logits row ", t, " (label ", c.labels[t],
                       ") has a -inf target logit (the loss would be infinite)")));
    }
    const double log_sum = std::log(sb[i]);
    const double lse = m + log_sum;
    // (max - z_y) + log_sum: the difference first, so large logits lose nothing.
    double ce = (m - z_y) + log_sum;
    if (eps_on) {
      const double u = sb[2 * rows + i];
      if (!std::isfinite(u)) {
        return MarkAgreed(absl::InvalidArgumentError(absl::StrCat(
            kWho, ": logits row ", t, " (label ", c.labels[t], ") has a -inf logit; with ",
            "label_smoothing ", c.eps, " the loss would be infinite")));
      }
      // lse - (1 - eps) z_y - eps U / V = (lse - z_y) + eps (z_y - U / V).
      ce += c.eps * (z_y - u * inv_v);
    }
    totals->weighted_ce += w * ce;
    totals->weighted_lse_sq += w * lse * lse;
    totals->weight += w;
    if (with_grad) {
      // dL/dz_j = (w / D) ((1 + 2 alpha lse) p_j - (1 - eps) [j == y] - eps / V).
      const double wd = w / c.d;
      const double scale = wd * (1.0 + 2.0 * c.alpha * lse);
      VpGradRow& g = s->grad_rows[i];
      g.scale = scale;
      g.global_max = static_cast<float>(m);
      g.log_sum = log_sum;
      g.offset = static_cast<float>(-wd * c.eps * inv_v);
      g.local_label = s->local_label[i];
      if (g.local_label >= 0) {
        const double p_y = std::exp(z_y - lse);
        g.target_grad = static_cast<float>(scale * p_y - wd * (1.0 - c.eps) - wd * c.eps * inv_v);
      }
    }
  }
  return absl::OkStatus();
}

// One exchange: rows [r0, r0 + rows) of the call. `logits` / `grad` point at the exchange's
// first row (grad null: forward only; they may alias); they are only touched while *local
// is OK. Returns an error that every rank of the group returns too.
absl::Status Exchange(Communicator& group, const Call& c, absl::Status* local, const float* logits,
                      float* grad, int64_t r0, int64_t rows, double fingerprint, Scratch* s,
                      Totals* totals) {
  LocalPass(group.rank(), c, local, logits, grad, r0, rows, s);
  int64_t header = 0;
  GRADSUM_RETURN_IF_ERROR(ReduceRowMaxes(group, c, *local, rows, fingerprint, s, totals, &header));
  const double* gmax = s->max_buf.data() + header;
  GRADSUM_RETURN_IF_ERROR(ReduceExpSums(group, c, r0, rows, gmax, s, totals));
  GRADSUM_RETURN_IF_ERROR(RowLosses(c, grad != nullptr, r0, rows, gmax, s, totals));
  // 5. The gradient, in place over the kept exps: no collective.
  if (grad != nullptr) {
    const int64_t vr = c.vr;
    const int64_t tiles = (vr + kCeTile - 1) / kCeTile;
    const auto grad_rows = internal::SelectedCeRowKernels().vp_grad_f32;
    ForEachRowBlock(rows, vr, c.num_threads, [&](int64_t i0, int64_t k) {
      grad_rows(grad + i0 * vr, s->tile_ref.data() + i0 * tiles, k, vr, s->grad_rows.data() + i0);
    });
  }
  return absl::OkStatus();
}

// The checks of the arguments every variant shares; `c` is filled as far as it can be.
absl::Status CheckCommon(const Call& c) {
  if (!std::isfinite(c.eps) || c.eps < 0.0 || c.eps >= 1.0) {
    return absl::InvalidArgumentError(
        absl::StrCat(kWho, ": label_smoothing ", c.eps, " must be in [0, 1)"));
  }
  if (!std::isfinite(c.alpha) || c.alpha < 0.0) {
    return absl::InvalidArgumentError(
        absl::StrCat(kWho, ": alpha_lse ", c.alpha, " must be finite and >= 0"));
  }
  if (c.requested_rows < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(kWho, ": rows per exchange (rows_per_exchange / chunk_rows) ",
                     c.requested_rows, " must be >= 0"));
  }
  if (c.vocab < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(kWho, ": global_vocab ", c.vocab, " must be >= 1"));
  }
  if (c.v0 < 0 || c.v0 + c.vr > c.vocab) {
    return absl::InvalidArgumentError(absl::StrCat(kWho, ": the shard [", c.v0, ", ", c.v0 + c.vr,
                                                   ") (vocab_start ", c.v0, ", ", c.vr,
                                                   " columns) is outside [0, ", c.vocab, ")"));
  }
  return internal::CheckCrossEntropyArgs(c.n, c.vocab, c.labels, c.weights, c.d, c.ignore_index);
}

// The exchange size, from values every rank must agree on (checked in the first exchange;
// ranks that still pick different sizes fail in the MAX all-reduce's count check).
int64_t ExchangeRows(const Call& c, int group_size) {
  const int64_t n = std::max<int64_t>(c.n, 1);
  const int64_t even_shard =
      (std::max<int64_t>(c.vocab, 1) + group_size - 1) / std::max(group_size, 1);
  int64_t rows = c.requested_rows;
  if (rows <= 0) {
    switch (c.kind) {
      case Kind::kForward:
        rows = n;
        break;
      case Kind::kForwardBackward:
        rows = std::max<int64_t>(1, kAutoExchangeBytes / (even_shard * 4));
        break;
      case Kind::kLinear:
        rows = internal::AutoChunkRows(n, even_shard);
        break;
    }
  }
  return std::clamp<int64_t>(rows, 1, n);
}

VocabParallelCrossEntropyResult Finish(const Call& c, const Totals& t) {
  VocabParallelCrossEntropyResult r;
  r.local_weighted_ce_sum = t.weighted_ce;
  r.local_weighted_lse_sq_sum = t.weighted_lse_sq;
  r.local_weight_sum = t.weight;
  r.local_valid_tokens = t.valid;
  r.collectives = t.collectives;
  if (c.d > 0.0) {
    r.local_ce_loss = t.weighted_ce / c.d;
    r.local_z_loss = c.alpha * t.weighted_lse_sq / c.d;
  }
  r.local_loss = r.local_ce_loss + r.local_z_loss;
  return r;
}

absl::StatusOr<VocabParallelCrossEntropyResult> Plain(
    Communicator& group, const TensorView& logits, absl::Span<const int64_t> labels,
    int64_t vocab_start, int64_t global_vocab, absl::Span<const float> token_weights,
    double global_weight_sum, const TensorView* grad,
    const VocabParallelCrossEntropyOptions& options) {
  Call c =
      MakeCall(grad == nullptr ? Kind::kForward : Kind::kForwardBackward, labels, vocab_start,
               global_vocab, token_weights, global_weight_sum, options, options.rows_per_exchange);

  absl::Status local = internal::CheckF32Matrix(logits, kWho, "logits_shard", c.n, -1);
  if (local.ok()) {
    c.vr = logits.dim(1);
    if (grad != nullptr) {
      local = internal::CheckF32Matrix(*grad, kWho, "grad_logits_shard", c.n, c.vr);
      if (local.ok() && internal::Overlap(*grad, logits) && grad->raw() != logits.raw()) {
        local = absl::InvalidArgumentError(absl::StrCat(
            kWho, ": grad_logits_shard may only overlap logits_shard exactly (in place)"));
      }
    }
  }
  if (local.ok()) local = CheckCommon(c);
  if (!local.ok()) c.vr = 0;  // the exchanges still run, carrying the error flag

  const double fingerprint = TokenFingerprint(c);
  const int64_t chunk = ExchangeRows(c, group.size());
  Scratch scratch;
  Totals totals;
  const float* z = local.ok() ? logits.data<float>() : nullptr;
  float* g = local.ok() && grad != nullptr ? grad->data<float>() : nullptr;
  // At least one exchange, even for N == 0, so that a rank with rows never waits alone.
  int64_t r0 = 0;
  do {
    const int64_t rows = std::min(chunk, c.n - r0);
    absl::Status s =
        Exchange(group, c, &local, z == nullptr ? nullptr : z + r0 * c.vr,
                 g == nullptr ? nullptr : g + r0 * c.vr, r0, rows, fingerprint, &scratch, &totals);
    if (!s.ok()) return s;
    r0 += rows;
  } while (r0 < c.n);
  return Finish(c, totals);
}

}  // namespace

absl::StatusOr<VocabParallelCrossEntropyResult> VocabParallelCrossEntropy(
    Communicator& group, const TensorView& logits_shard, absl::Span<const int64_t> labels,
    int64_t vocab_start, int64_t global_vocab, absl::Span<const float> token_weights,
    double global_weight_sum, const TensorView& grad_logits_shard,
    const VocabParallelCrossEntropyOptions& options) {
  return Plain(group, logits_shard, labels, vocab_start, global_vocab, token_weights,
               global_weight_sum, &grad_logits_shard, options);
}

absl::StatusOr<VocabParallelCrossEntropyResult> VocabParallelCrossEntropyForward(
    Communicator& group, const TensorView& logits_shard, absl::Span<const int64_t> labels,
    int64_t vocab_start, int64_t global_vocab, absl::Span<const float> token_weights,
    double global_weight_sum, const VocabParallelCrossEntropyOptions& options) {
  return Plain(group, logits_shard, labels, vocab_start, global_vocab, token_weights,
               global_weight_sum, nullptr, options);
}

absl::StatusOr<VocabParallelLinearCrossEntropyResult> VocabParallelLinearCrossEntropy(
    Communicator& group, const TensorView& hidden, const TensorView& head_shard,
    absl::Span<const int64_t> labels, int64_t vocab_start, int64_t global_vocab,
    absl::Span<const float> token_weights, double global_weight_sum,
    const TensorView& grad_hidden_partial, const TensorView& grad_head_shard,
    const VocabParallelLinearCrossEntropyOptions& options) {
  Call c = MakeCall(Kind::kLinear, labels, vocab_start, global_vocab, token_weights,
                    global_weight_sum, options, options.chunk_rows);

  absl::Status local = internal::CheckF32Matrix(hidden, kWho, "hidden", c.n, -1);
  if (local.ok()) {
    c.hidden_dim = hidden.dim(1);
    local = internal::CheckF32Matrix(head_shard, kWho, "head_shard", -1, c.hidden_dim);
  }
  if (local.ok()) {
    c.vr = head_shard.dim(0);
    local = internal::CheckF32Matrix(grad_hidden_partial, kWho, "grad_hidden_partial", c.n,
                                     c.hidden_dim);
  }
  if (local.ok()) {
    local = internal::CheckF32Matrix(grad_head_shard, kWho, "grad_head_shard", c.vr, c.hidden_dim);
  }
  if (local.ok()) {
    using internal::Overlap;
    const TensorView& gh = grad_hidden_partial;
    const TensorView& gw = grad_head_shard;
    if (Overlap(gw, hidden) || Overlap(gw, head_shard) || Overlap(gw, gh) ||
        Overlap(gh, head_shard) || (Overlap(gh, hidden) && gh.raw() != hidden.raw())) {
      local = absl::InvalidArgumentError(absl::StrCat(
          kWho,
          ": grad_head_shard must not overlap any other buffer, and grad_hidden_partial "
          "may only overlap hidden exactly (in place)"));
    }
  }
  if (local.ok()) local = CheckCommon(c);
  if (!local.ok()) {
    c.vr = 0;
    c.hidden_dim = hidden.rank() == 2 ? hidden.dim(1) : 0;  // agreed H, for the message
  }

  const double fingerprint = TokenFingerprint(c);
  const int64_t chunk = ExchangeRows(c, group.size());
  const int64_t h = c.hidden_dim;
  const int64_t vr = c.vr;
  const int threads = c.num_threads;
  VocabParallelLinearCrossEntropyResult result;
  result.chunk_rows = chunk;
  std::unique_ptr<float[]> logits_buf;
  if (local.ok() && vr > 0) {
    logits_buf.reset(new float[static_cast<size_t>(chunk * vr)]);
    // The logits chunk, ~40 bytes of per-row scratch, and one float per 1024-column tile.
    result.peak_scratch_bytes =
        chunk * vr * static_cast<int64_t>(sizeof(float)) + chunk * 40 +
        chunk * ((vr + kCeTile - 1) / kCeTile) * static_cast<int64_t>(sizeof(float));
  }
  Scratch scratch;
  Totals totals;
  int64_t r0 = 0;
  do {
    const int64_t rows = std::min(chunk, c.n - r0);
    float* logits = nullptr;
    bool any_weight = false;
    if (local.ok()) {
      for (int64_t i = 0; i < rows && !any_weight; ++i) any_weight = RowWeight(c, r0 + i) != 0;
    }
    const absl::Span<const float> w =
        local.ok() ? absl::Span<const float>(head_shard.data<float>(), vr * h)
                   : absl::Span<const float>();
    if (local.ok() && vr > 0) {
      logits = logits_buf.get();
      const absl::Span<float> lz(logits, rows * vr);
      if (any_weight) {
        // logits_c = hidden_c @ Wo_r^T (core/gemm.h splits it over the threads).
        const absl::Span<const float> h_c(hidden.data<float>() + r0 * h, rows * h);
        local =
            Sgemm(Trans::kNo, Trans::kYes, rows, vr, h, 1.0f, h_c, h, w, h, 0.0f, lz, vr, threads);
      } else {
        std::fill(lz.begin(), lz.end(), 0.0f);  // no row is read: weight 0 everywhere
      }
    }
    absl::Status s =
        Exchange(group, c, &local, local.ok() ? logits : nullptr, local.ok() ? logits : nullptr, r0,
                 rows, fingerprint, &scratch, &totals);
    if (!s.ok()) return s;
    float* gh = grad_hidden_partial.data<float>() + r0 * h;
    if (!any_weight || vr == 0) {
      std::fill_n(gh, rows * h, 0.0f);  // no part of dhidden from this rank's columns
    } else {
      const absl::Span<const float> h_c(hidden.data<float>() + r0 * h, rows * h);
      const absl::Span<const float> dz(logits, rows * vr);
      // grad_head += dlogits_c^T @ hidden_c, before grad_hidden_c is written (it may alias
      // hidden).
      GRADSUM_RETURN_IF_ERROR(Sgemm(Trans::kYes, Trans::kNo, vr, h, rows, 1.0f, dz, vr, h_c, h,
                                    1.0f, absl::Span<float>(grad_head_shard.data<float>(), vr * h),
                                    h, threads));
      // grad_hidden_c (this rank's part) = dlogits_c @ Wo_r.
      GRADSUM_RETURN_IF_ERROR(Sgemm(Trans::kNo, Trans::kNo, rows, h, vr, 1.0f, dz, vr, w, h, 0.0f,
                                    absl::Span<float>(gh, rows * h), h, threads));
    }
    r0 += rows;
  } while (r0 < c.n);
  result.ce = Finish(c, totals);
  return result;
}

}  // namespace gradsum::losses
