// Compares the CUDA cross-entropy with a straightforward double-precision CPU reference of
// SEMANTICS.md §3 (written here, independent of both implementations). Skips without a GPU.
#include "losses/cuda/cross_entropy_cuda.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/cuda/device_buffer.h"
#include "core/half.h"
#include "core/tensor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "losses/cross_entropy.h"
#include "testing/gpu_compare.h"
#include "testing/gpu_test_util.h"

namespace gradsum::losses {
namespace {

using cuda::DeviceBuffer;
using ::gradsum::testing::Dev;
using ::gradsum::testing::DownloadAsDouble;
using ::gradsum::testing::ExpectAllNear;
using ::gradsum::testing::Host;
using ::gradsum::testing::UploadAs;
using ::testing::HasSubstr;

// Reference: loss and gradient in double from the (already dtype-rounded) logits.
struct Reference {
  double loss = 0;
  double weight_sum = 0;
  std::vector<double> grad;
};

Reference ReferenceCe(const std::vector<float>& z, int64_t rows, int64_t vocab,
                      const std::vector<int64_t>& labels, const std::vector<float>& weights,
                      double D, double grad_scale) {
  Reference r;
  r.grad.assign(rows * vocab, 0.0);
  for (int64_t t = 0; t < rows; ++t) {
    if (labels[t] == -100) continue;
    const double w = weights.empty() ? 1.0 : weights[t];
    r.weight_sum += w;
    if (D == 0 || w == 0) continue;
    double mx = -INFINITY;
    for (int64_t j = 0; j < vocab; ++j) mx = std::max(mx, static_cast<double>(z[t * vocab + j]));
    double s = 0;
    for (int64_t j = 0; j < vocab; ++j) s += std::exp(z[t * vocab + j] - mx);
    const double lse = mx + std::log(s);
    r.loss += w * (lse - z[t * vocab + labels[t]]) / D;
    for (int64_t j = 0; j < vocab; ++j) {
      const double p = std::exp(z[t * vocab + j] - lse);
      r.grad[t * vocab + j] = grad_scale * w / D * (p - (j == labels[t] ? 1.0 : 0.0));
    }
  }
  return r;
}

std::vector<float> RandomLogits(int64_t n, uint32_t seed, float scale = 3.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> z(n);
  for (auto& v : z) v = dist(gen);
  return z;
}

std::vector<uint16_t> ToBf16Bits(std::vector<float>& z) {  // rounds z in place
  std::vector<uint16_t> bits(z.size());
  for (size_t i = 0; i < z.size(); ++i) {
    bits[i] = BF16::FromFloat(z[i]).bits;
    z[i] = BF16::FromBits(bits[i]).ToFloat();
  }
  return bits;
}

std::vector<int64_t> RandomLabels(int64_t rows, int64_t vocab, uint32_t seed, double ignore_frac) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int64_t> cls(0, vocab - 1);
  std::uniform_real_distribution<double> u(0, 1);
  std::vector<int64_t> y(rows);
  for (auto& v : y) v = u(gen) < ignore_frac ? -100 : cls(gen);
  return y;
}

// Device buffers for one CE call.
struct Bufs {
  DeviceBuffer logits, grad, labels, weights, d, loss, wsum, token_loss;
};

// The CE options of SEMANTICS.md §3.2 (0 = off).
struct CeOptions {
  double eps = 0, cap = 0, alpha = 0;
};

// Runs CE on device copies of the inputs (f32 or bf16) and returns the gradient as double.
struct CeRun {
  absl::Status status;
  double loss = 0, weight_sum = 0;
  double ce_loss = 0, z_out_loss = 0;  // the two display terms of §3.2
  std::vector<double> grad;
  std::vector<float> token_loss;
};

CeRun RunCe(DType dtype, const std::vector<float>& z_rounded, int64_t rows, int64_t vocab,
            const std::vector<int64_t>& labels, const std::vector<float>& weights, double D,
            bool in_place, float grad_scale = 1.0f, const CeOptions& options = {}) {
  CeRun out;
  Bufs b;
  b.logits = UploadAs(z_rounded, dtype);
  if (!in_place) {
    b.grad = *DeviceBuffer::Create(b.logits.size());
    EXPECT_TRUE(b.grad.Fill(0xff).ok());  // NaN garbage: every element must be overwritten
  }
  b.labels = Dev(labels);
  if (!weights.empty()) b.weights = Dev(weights);
  b.d = Dev(std::vector<double>{D});
  b.loss = Dev(std::vector<double>{12345.0});
  b.wsum = Dev(std::vector<double>{-1.0});
  b.token_loss = *DeviceBuffer::Create(sizeof(float) * std::max<int64_t>(rows, 1));

  CrossEntropyCudaArgs a;
  a.logits = b.logits.get();
  a.dtype = dtype;
  a.rows = rows;
  a.vocab = vocab;
  a.labels = b.labels.as<int64_t>();
  a.token_weights = weights.empty() ? nullptr : b.weights.as<float>();
  a.global_weight_sum = b.d.as<double>();
  a.grad_logits = in_place ? b.logits.get() : b.grad.get();
  a.grad_scale = grad_scale;
  a.loss = b.loss.as<double>();
  a.local_weight_sum = b.wsum.as<double>();
  a.token_loss = b.token_loss.as<float>();
  a.ce.label_smoothing = options.eps;
  a.ce.logit_softcap = options.cap;
  a.ce.alpha_lse = options.alpha;
  DeviceBuffer ce_loss = Dev(std::vector<double>{777.0}),
               z_out_loss = Dev(std::vector<double>{777.0});
  a.ce_loss = ce_loss.as<double>();
  a.z_out_loss = z_out_loss.as<double>();
  out.status = CrossEntropyCuda(a, nullptr);
  if (!out.status.ok()) return out;
  out.loss = Host<double>(b.loss)[0];
  out.ce_loss = Host<double>(ce_loss)[0];
  out.z_out_loss = Host<double>(z_out_loss)[0];
  out.weight_sum = Host<double>(b.wsum)[0];
  out.token_loss = Host<float>(b.token_loss);
  out.grad = DownloadAsDouble(in_place ? b.logits : b.grad, dtype);
  return out;
}

void ExpectGradNear(const std::vector<double>& got, const std::vector<double>& want, double atol,
                    double rtol) {
  ExpectAllNear(got, want, atol, rtol, "grad");
}

TEST(CrossEntropyCuda, F32MatchesReferenceWithIgnoredLabels) {
  GRADSUM_SKIP_WITHOUT_GPU();
  const int64_t rows = 37, vocab = 1000;
  std::vector<float> z = RandomLogits(rows * vocab, 1);
  std::vector<int64_t> y = RandomLabels(rows, vocab, 2, 0.25);
  const double D = 100;  // other ranks' tokens count too
  Reference ref = ReferenceCe(z, rows, vocab, y, {}, D, 1.0);
  CeRun run = RunCe(DType::kF32, z, rows, vocab, y, {}, D, /*in_place=*/false);
  ASSERT_TRUE(run.status.ok()) << run.status;
  EXPECT_NEAR(run.loss, ref.loss, 1e-5 * std::abs(ref.loss));
  EXPECT_EQ(run.weight_sum, ref.weight_sum);
  ExpectGradNear(run.grad, ref.grad, 1e-8, 1e-4);
  for (int64_t t = 0; t < rows; ++t) {
    if (y[t] == -100) {
      EXPECT_EQ(run.token_loss[t], 0.0f);
      for (int64_t j = 0; j < vocab; ++j) ASSERT_EQ(run.grad[t * vocab + j], 0.0) << "row " << t;
    }
  }
}

TEST(CrossEntropyCuda, Bf16InPlaceLargeVocabMatchesReference) {
  GRADSUM_SKIP_WITHOUT_GPU();
  const int64_t rows = 24, vocab = 32768;  // 512 threads per row, 16-byte bf16 vectors
  std::vector<float> z = RandomLogits(rows * vocab, 3, 4.0f);
  ToBf16Bits(z);  // the reference sees exactly the bf16 values the kernel reads
  std::vector<int64_t> y = RandomLabels(rows, vocab, 4, 0.1);
  const double D = 50;
  Reference ref = ReferenceCe(z, rows, vocab, y, {}, D, 1.0);
  CeRun run = RunCe(DType::kBF16, z, rows, vocab, y, {}, D, /*in_place=*/true);
  ASSERT_TRUE(run.status.ok()) << run.status;
  EXPECT_NEAR(run.loss, ref.loss, 1e-5 * std::abs(ref.loss));
  // The gradient is rounded to bf16 once (relative 2^-9) after fp32 math.
  ExpectGradNear(run.grad, ref.grad, 1e-10, 1.0 / 256);
}

TEST(CrossEntropyCuda, OddVocabScalarPathWithSampleWeightsAndGradScale) {
  GRADSUM_SKIP_WITHOUT_GPU();
  const int64_t rows = 19, vocab = 1001;  // not a multiple of 4 or 8: scalar loads
  std::vector<float> z = RandomLogits(rows * vocab, 5);
  std::vector<int64_t> y = RandomLabels(rows, vocab, 6, 0.2);
  std::vector<float> w(rows);
  for (int64_t t = 0; t < rows; ++t) w[t] = 1.0f / static_cast<float>(1 + t % 5);
  const double D = 40;
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    std::vector<float> zr = z;
    if (dtype == DType::kBF16) ToBf16Bits(zr);
    Reference ref = ReferenceCe(zr, rows, vocab, y, w, D, 0.5);
    CeRun run = RunCe(dtype, zr, rows, vocab, y, w, D, /*in_place=*/false, 0.5f);
    ASSERT_TRUE(run.status.ok()) << run.status;
    EXPECT_NEAR(run.loss, ref.loss, 1e-5 * std::abs(ref.loss)) << DTypeName(dtype);
    EXPECT_NEAR(run.weight_sum, ref.weight_sum, 1e-12) << DTypeName(dtype);
    ExpectGradNear(run.grad, ref.grad, 1e-9, dtype == DType::kBF16 ? 1.0 / 256 : 1e-4);
  }
}

// The CPU implementation (losses/cross_entropy.h) and the CUDA one agree on the same inputs.
TEST(CrossEntropyCuda, MatchesCpuImplementationF32AndBf16) {
  GRADSUM_SKIP_WITHOUT_GPU();
  const int64_t rows = 33, vocab = 4096;
  std::vector<float> z = RandomLogits(rows * vocab, 21, 5.0f);
  std::vector<int64_t> y = RandomLabels(rows, vocab, 22, 0.3);
  std::vector<float> w(rows);
  for (int64_t t = 0; t < rows; ++t) w[t] = 1.0f / std::sqrt(static_cast<float>(1 + t % 7));
  const double D = 60;
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    std::vector<float> zr = z;
    std::vector<uint16_t> zb;
    if (dtype == DType::kBF16) zb = ToBf16Bits(zr);
    std::vector<float> cpu_grad_f(rows * vocab);
    std::vector<uint16_t> cpu_grad_b(rows * vocab);
    void* cpu_in =
        dtype == DType::kBF16 ? static_cast<void*>(zb.data()) : static_cast<void*>(zr.data());
    void* cpu_out = dtype == DType::kBF16 ? static_cast<void*>(cpu_grad_b.data())
                                          : static_cast<void*>(cpu_grad_f.data());
    TensorView zv = *TensorView::Create(cpu_in, dtype, {rows, vocab});
    TensorView gv = *TensorView::Create(cpu_out, dtype, {rows, vocab});
    absl::StatusOr<CrossEntropyResult> cpu = CrossEntropyForwardBackward(zv, y, w, D, gv);
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    CeRun run = RunCe(dtype, zr, rows, vocab, y, w, D, /*in_place=*/false);
    ASSERT_TRUE(run.status.ok()) << run.status;
    EXPECT_NEAR(run.loss, cpu->local_loss, 1e-5 * std::abs(cpu->local_loss)) << DTypeName(dtype);
    EXPECT_NEAR(run.weight_sum, cpu->local_weight_sum, 1e-9) << DTypeName(dtype);
    std::vector<double> cpu_grad(rows * vocab);
    for (int64_t i = 0; i < rows * vocab; ++i) {
      cpu_grad[i] = dtype == DType::kBF16 ? BF16::FromBits(cpu_grad_b[i]).ToFloat() : cpu_grad_f[i];
    }
    // Both round an fp32 gradient once; bf16 results may differ by one bf16 ulp.
    ExpectGradNear(run.grad, cpu_grad, 1e-10, dtype == DType::kBF16 ? 1.0 / 128 : 1e-4);
  }
}

// ---- The CE options of SEMANTICS.md §3.2: label smoothing, logit softcap, output z-loss. ----

// The fp64 reference, from the definitions (not the kernels' rearranged forms): the capped
// logits z = c tanh(x / c), CE = -(1 - eps) log p_y - (eps / V) sum_j log p_j, the output
// z-loss alpha lse^2, each weighted w / D; the gradient with respect to the raw logits x.
struct OptionsReference {
  double loss = 0, ce = 0, z_out = 0, weight_sum = 0;
  std::vector<double> grad, token_loss;
};

// One row's CE and lse from raw logits x.
void RowCeAndLse(const double* x, int64_t vocab, int64_t y, const CeOptions& o, double* ce,
                 double* lse) {
  std::vector<double> z(x, x + vocab);
  if (o.cap > 0) {
    for (double& v : z) v = o.cap * std::tanh(v / o.cap);
  }
  double mx = -INFINITY;
  for (double v : z) mx = std::max(mx, v);
  double s = 0;
  for (double v : z) s += std::exp(v - mx);
  *lse = mx + std::log(s);
  double mean_logp = 0;
  for (double v : z) mean_logp += (v - *lse) / static_cast<double>(vocab);
  *ce = -(1.0 - o.eps) * (z[y] - *lse) - o.eps * mean_logp;
}

OptionsReference ReferenceCeOptions(const std::vector<float>& x, int64_t rows, int64_t vocab,
                                    const std::vector<int64_t>& labels,
                                    const std::vector<float>& weights, double D, double grad_scale,
                                    const CeOptions& o) {
  OptionsReference r;
  r.grad.assign(rows * vocab, 0.0);
  r.token_loss.assign(rows, 0.0);
  for (int64_t t = 0; t < rows; ++t) {
    if (labels[t] == -100) continue;
    const double w = weights.empty() ? 1.0 : weights[t];
    r.weight_sum += w;
    if (D == 0 || w == 0) continue;
    std::vector<double> xd(x.begin() + t * vocab, x.begin() + (t + 1) * vocab);
    double ce = 0, lse = 0;
    RowCeAndLse(xd.data(), vocab, labels[t], o, &ce, &lse);
    r.ce += w * ce / D;
    r.z_out += w * o.alpha * lse * lse / D;
    r.token_loss[t] = w * (ce + o.alpha * lse * lse) / D;
    for (int64_t j = 0; j < vocab; ++j) {
      const double z = o.cap > 0 ? o.cap * std::tanh(xd[j] / o.cap) : xd[j];
      const double p = std::exp(z - lse);
      double g = (1.0 + 2.0 * o.alpha * lse) * p - o.eps / static_cast<double>(vocab) -
                 (j == labels[t] ? 1.0 - o.eps : 0.0);
      if (o.cap > 0) g *= 1.0 - (z / o.cap) * (z / o.cap);
      r.grad[t * vocab + j] = grad_scale * w / D * g;
    }
  }
  r.loss = r.ce + r.z_out;
  return r;
}

// The reference's gradient is the derivative of its own loss: central differences of
// CE + alpha lse^2 at every element of a small row with all three options on. Runs
// without a GPU: it checks the reference the GPU tests below rely on.
TEST(CrossEntropyCudaReference, OptionsGradientIsTheFiniteDifferenceOfTheLoss) {
  const int64_t vocab = 7;
  const CeOptions o{0.2, 1.5, 0.05};
  std::vector<float> x = {0.3f, -1.2f, 2.5f, 0.0f, -0.7f, 1.1f, 3.0f};
  const int64_t y = 2;
  OptionsReference ref = ReferenceCeOptions(x, 1, vocab, {y}, {}, 1.0, 1.0, o);
  std::vector<double> xd(x.begin(), x.end());
  for (int64_t j = 0; j < vocab; ++j) {
    const double h = 1e-5;
    auto loss_at = [&](double v) {
      std::vector<double> xs = xd;
      xs[j] = v;
      double ce = 0, lse = 0;
      RowCeAndLse(xs.data(), vocab, y, o, &ce, &lse);
      return ce + o.alpha * lse * lse;
    };
    const double fd = (loss_at(xd[j] + h) - loss_at(xd[j] - h)) / (2 * h);
    EXPECT_NEAR(ref.grad[j], fd, 1e-8) << "element " << j;
  }
  // And each option moves the loss (so the tests below can tell them apart).
  const OptionsReference plain = ReferenceCeOptions(x, 1, vocab, {y}, {}, 1.0, 1.0, {});
  for (const CeOptions& one : {CeOptions{0.2, 0, 0}, CeOptions{0, 1.5, 0}, CeOptions{0, 0, 0.05}}) {
    EXPECT_GT(std::abs(ReferenceCeOptions(x, 1, vocab, {y}, {}, 1.0, 1.0, one).loss - plain.loss),
              1e-3);
  }
}

// The option sets every test below runs: each alone, and all three together.
std::vector<CeOptions> OptionSets() {
  return {{0.1, 0, 0}, {0, 4.0, 0}, {0, 0, 0.01}, {0.2, 3.0, 0.02}};
}

std::string OptionsName(const CeOptions& o) {
  return "eps " + std::to_string(o.eps) + " cap " + std::to_string(o.cap) + " alpha " +
         std::to_string(o.alpha);
}

// Every option set against the fp64 reference: f32 and bf16, the 16-byte vector path
// (V = 1000) and the scalar one (V = 1001), in place and not, sample weights, ignored
// labels and an upstream grad_scale. The loss, its two display terms, the per-row losses
// and the gradient.
TEST(CrossEntropyCuda, OptionsMatchTheFp64Reference) {
  GRADSUM_SKIP_WITHOUT_GPU();
  const int64_t rows = 23;
  for (int64_t vocab : {int64_t{1000}, int64_t{1001}}) {
    std::vector<float> x = RandomLogits(rows * vocab, 31, 4.0f);
    std::vector<int64_t> y = RandomLabels(rows, vocab, 32, 0.2);
    std::vector<float> w(rows);
    for (int64_t t = 0; t < rows; ++t) w[t] = 1.0f / static_cast<float>(1 + t % 4);
    const double D = 30;
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      std::vector<float> xr = x;
      if (dtype == DType::kBF16) ToBf16Bits(xr);
      int call = 0;
      for (const CeOptions& o : OptionSets()) {
        const std::string what = absl::StrCat(DTypeName(dtype), " V ", vocab, " ", OptionsName(o));
        const OptionsReference ref = ReferenceCeOptions(xr, rows, vocab, y, w, D, 0.5, o);
        CeRun run = RunCe(dtype, xr, rows, vocab, y, w, D, /*in_place=*/call++ % 2 == 0, 0.5f, o);
        ASSERT_TRUE(run.status.ok()) << what << ": " << run.status;
        EXPECT_NEAR(run.loss, ref.loss, 1e-5 * std::abs(ref.loss)) << what;
        EXPECT_NEAR(run.ce_loss, ref.ce, 1e-5 * std::abs(ref.ce)) << what;
        EXPECT_NEAR(run.z_out_loss, ref.z_out, 1e-5 * std::abs(ref.z_out)) << what;
        if (o.alpha == 0) {
          EXPECT_EQ(run.z_out_loss, 0.0) << what;
        }
        EXPECT_NEAR(run.weight_sum, ref.weight_sum, 1e-12) << what;
        ExpectAllNear(run.token_loss, ref.token_loss, 1e-9, 1e-5, what + " token_loss");
        ExpectGradNear(run.grad, ref.grad, 1e-9, dtype == DType::kBF16 ? 1.0 / 256 : 1e-4);
      }
    }
  }
}

// The CPU kernel with the same options (losses/cross_entropy.h) and the CUDA one agree:
// local_loss, the display terms local_weighted_ce_sum / D and alpha local_weighted_lse_sq_sum
// / D, and the gradient.
TEST(CrossEntropyCuda, OptionsMatchTheCpuImplementation) {
  GRADSUM_SKIP_WITHOUT_GPU();
  const int64_t rows = 29, vocab = 4096;
  std::vector<float> x = RandomLogits(rows * vocab, 33, 5.0f);
  std::vector<int64_t> y = RandomLabels(rows, vocab, 34, 0.3);
  std::vector<float> w(rows);
  for (int64_t t = 0; t < rows; ++t) w[t] = 1.0f / std::sqrt(static_cast<float>(1 + t % 7));
  const double D = 50;
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    std::vector<float> xr = x;
    std::vector<uint16_t> xb;
    if (dtype == DType::kBF16) xb = ToBf16Bits(xr);
    for (const CeOptions& o : OptionSets()) {
      const std::string what = absl::StrCat(DTypeName(dtype), " ", OptionsName(o));
      std::vector<float> cpu_grad_f(rows * vocab);
      std::vector<uint16_t> cpu_grad_b(rows * vocab);
      void* cpu_in =
          dtype == DType::kBF16 ? static_cast<void*>(xb.data()) : static_cast<void*>(xr.data());
      void* cpu_out = dtype == DType::kBF16 ? static_cast<void*>(cpu_grad_b.data())
                                            : static_cast<void*>(cpu_grad_f.data());
      TensorView xv = *TensorView::Create(cpu_in, dtype, {rows, vocab});
      TensorView gv = *TensorView::Create(cpu_out, dtype, {rows, vocab});
      CrossEntropyOptions co;
      co.ce.label_smoothing = o.eps;
      co.ce.logit_softcap = o.cap;
      co.ce.alpha_lse = o.alpha;
      absl::StatusOr<CrossEntropyResult> cpu = CrossEntropyForwardBackward(xv, y, w, D, gv, co);
      ASSERT_TRUE(cpu.ok()) << what << ": " << cpu.status();
      CeRun run = RunCe(dtype, xr, rows, vocab, y, w, D, /*in_place=*/false, 1.0f, o);
      ASSERT_TRUE(run.status.ok()) << what << ": " << run.status;
      EXPECT_NEAR(run.loss, cpu->local_loss, 1e-5 * std::abs(cpu->local_loss)) << what;
      const double cpu_ce = cpu->local_weighted_ce_sum / D;
      const double cpu_z_out = o.alpha * cpu->local_weighted_lse_sq_sum / D;
      EXPECT_NEAR(run.ce_loss, cpu_ce, 1e-5 * std::abs(cpu_ce)) << what;
      EXPECT_NEAR(run.z_out_loss, cpu_z_out, 1e-5 * std::abs(cpu_z_out)) << what;
      EXPECT_NEAR(run.weight_sum, cpu->local_weight_sum, 1e-9) << what;
      std::vector<double> cpu_grad(rows * vocab);
      for (int64_t i = 0; i < rows * vocab; ++i) {
        cpu_grad[i] =
            dtype == DType::kBF16 ? BF16::FromBits(cpu_grad_b[i]).ToFloat() : cpu_grad_f[i];
      }
      ExpectGradNear(run.grad, cpu_grad, 1e-10, dtype == DType::kBF16 ? 1.0 / 128 : 1e-4);
    }
  }
}

// Without options the display outputs are the loss itself and 0 (the plain kernel).
TEST(CrossEntropyCuda, PlainCallReportsItsLossAsTheCeTermAndNoZLoss) {
  GRADSUM_SKIP_WITHOUT_GPU();
  const int64_t rows = 9, vocab = 300;
  std::vector<float> x = RandomLogits(rows * vocab, 35);
  std::vector<int64_t> y = RandomLabels(rows, vocab, 36, 0.2);
  CeRun run = RunCe(DType::kF32, x, rows, vocab, y, {}, 20.0, /*in_place=*/false);
  ASSERT_TRUE(run.status.ok()) << run.status;
  EXPECT_EQ(run.ce_loss, run.loss);
  EXPECT_EQ(run.z_out_loss, 0.0);
}

// The options' edges, as the CPU kernel has them: the cap makes +-inf logits finite (loss
// as the reference's, gradient exactly 0 there); with smoothing a -inf logit is an error
// naming the row; D == 0 gives zeros; accumulation adds every output; forward only (no
// gradient) gives the same loss; bad options are refused by name before any launch.
TEST(CrossEntropyCuda, OptionsEdgeCases) {
  GRADSUM_SKIP_WITHOUT_GPU();
  const int64_t rows = 5, vocab = 64;
  std::vector<float> x = RandomLogits(rows * vocab, 37);
  std::vector<int64_t> y = {3, 10, 20, 30, 40};
  const float inf = std::numeric_limits<float>::infinity();
  x[1 * vocab + 7] = inf;
  x[3 * vocab + 9] = -inf;
  const CeOptions capped{0.1, 2.0, 0.01};
  const OptionsReference ref = ReferenceCeOptions(x, rows, vocab, y, {}, 5.0, 1.0, capped);
  CeRun run = RunCe(DType::kF32, x, rows, vocab, y, {}, 5.0, /*in_place=*/false, 1.0f, capped);
  ASSERT_TRUE(run.status.ok()) << run.status;
  EXPECT_TRUE(std::isfinite(ref.loss));
  EXPECT_NEAR(run.loss, ref.loss, 1e-5 * std::abs(ref.loss));
  EXPECT_EQ(run.grad[1 * vocab + 7], 0.0);
  EXPECT_EQ(run.grad[3 * vocab + 9], 0.0);
  ExpectGradNear(run.grad, ref.grad, 1e-9, 1e-4);

  // Smoothing without the cap: the -inf of row 3 makes its smoothed term infinite.
  std::vector<float> x2 = RandomLogits(rows * vocab, 38);
  x2[3 * vocab + 9] = -inf;
  run = RunCe(DType::kF32, x2, rows, vocab, y, {}, 5.0, false, 1.0f, CeOptions{0.1, 0, 0});
  EXPECT_EQ(run.status.code(), absl::StatusCode::kInvalidArgument) << run.status;
  EXPECT_THAT(std::string(run.status.message()), HasSubstr("row 3"));
  // The same row is fine with the z-loss alone (a -inf logit is p = 0, as in plain CE).
  run = RunCe(DType::kF32, x2, rows, vocab, y, {}, 5.0, false, 1.0f, CeOptions{0, 0, 0.01});
  EXPECT_TRUE(run.status.ok()) << run.status;

  // D == 0: every label ignored.
  std::vector<int64_t> ignored(rows, -100);
  run = RunCe(DType::kF32, x2, rows, vocab, ignored, {}, 0.0, false, 1.0f, capped);
  ASSERT_TRUE(run.status.ok()) << run.status;
  EXPECT_EQ(run.loss, 0.0);
  EXPECT_EQ(run.ce_loss, 0.0);
  EXPECT_EQ(run.z_out_loss, 0.0);
  for (double g : run.grad) ASSERT_EQ(g, 0.0);

  // Accumulation into every output, and the forward-only call.
  std::vector<float> x3 = RandomLogits(rows * vocab, 39);
  const OptionsReference ref3 = ReferenceCeOptions(x3, rows, vocab, y, {}, 10.0, 1.0, capped);
  auto logits = Dev(x3);
  auto grad = *DeviceBuffer::Create(logits.size());
  auto labels = Dev(y);
  auto d = Dev(std::vector<double>{10.0});
  auto loss = Dev(std::vector<double>{0.0}), ce = Dev(std::vector<double>{0.0});
  auto z_out = Dev(std::vector<double>{0.0});
  CrossEntropyCudaArgs a;
  a.logits = logits.get();
  a.rows = rows;
  a.vocab = vocab;
  a.labels = labels.as<int64_t>();
  a.global_weight_sum = d.as<double>();
  a.grad_logits = grad.get();
  a.loss = loss.as<double>();
  a.ce_loss = ce.as<double>();
  a.z_out_loss = z_out.as<double>();
  a.accumulate_loss = true;
  a.ce.label_smoothing = capped.eps;
  a.ce.logit_softcap = capped.cap;
  a.ce.alpha_lse = capped.alpha;
  ASSERT_TRUE(CrossEntropyCuda(a, nullptr).ok());
  CrossEntropyCudaArgs forward = a;
  forward.grad_logits = nullptr;
  ASSERT_TRUE(CrossEntropyCuda(forward, nullptr).ok());
  EXPECT_NEAR(Host<double>(loss)[0], 2 * ref3.loss, 1e-5 * std::abs(ref3.loss));
  EXPECT_NEAR(Host<double>(ce)[0], 2 * ref3.ce, 1e-5 * std::abs(ref3.ce));
  EXPECT_NEAR(Host<double>(z_out)[0], 2 * ref3.z_out, 1e-5 * std::abs(ref3.z_out));

  // Bad options: InvalidArgument naming the option, nothing enqueued.
  struct Bad {
    CeOptions o;
    const char* name;
  };
  for (const Bad& b :
       {Bad{{1.0, 0, 0}, "label_smoothing 1"}, Bad{{-0.1, 0, 0}, "label_smoothing"},
        Bad{{std::nan(""), 0, 0}, "label_smoothing nan"}, Bad{{0, -1.0, 0}, "logit_softcap -1"},
        Bad{{0, inf, 0}, "logit_softcap inf"}, Bad{{0, 0, -0.5}, "alpha_lse -0.5"},
        Bad{{0, 0, std::nan("")}, "alpha_lse nan"}}) {
    CrossEntropyCudaArgs bad = a;
    bad.ce.label_smoothing = b.o.eps;
    bad.ce.logit_softcap = b.o.cap;
    bad.ce.alpha_lse = b.o.alpha;
    absl::Status s = CrossEntropyCuda(bad, nullptr);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << b.name;
    EXPECT_THAT(std::string(s.message()), HasSubstr(b.name));
  }
}

TEST(CrossEntropyCuda, AllIgnoredWithZeroNormaliserGivesZeroLossAndExactZeroGrad) {
  GRADSUM_SKIP_WITHOUT_GPU();
  const int64_t rows = 8, vocab = 64;
  std::vector<float> z = RandomLogits(rows * vocab, 7);
  std::vector<int64_t> y(rows, -100);
  CeRun run = RunCe(DType::kF32, z, rows, vocab, y, {}, /*D=*/0.0, /*in_place=*/false);
  ASSERT_TRUE(run.status.ok()) << run.status;
  EXPECT_EQ(run.loss, 0.0);
  EXPECT_EQ(run.weight_sum, 0.0);
  for (double g : run.grad) ASSERT_EQ(g, 0.0);  // the buffer started as NaN bytes
}

TEST(CrossEntropyCuda, OutOfRangeLabelIsInvalidArgumentNamingRowAndLabel) {
  GRADSUM_SKIP_WITHOUT_GPU();
  const int64_t rows = 6, vocab = 50;
  std::vector<float> z = RandomLogits(rows * vocab, 8);
  std::vector<int64_t> y = {1, 2, 70, 3, -5, 4};
  CeRun run = RunCe(DType::kF32, z, rows, vocab, y, {}, 6.0, false);
  EXPECT_EQ(run.status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(run.status.message()), HasSubstr("label 70 at row 2"));
  EXPECT_THAT(std::string(run.status.message()), HasSubstr("2 such rows"));
}

TEST(CrossEntropyCuda, NormaliserSmallerThanLocalWeightIsFailedPrecondition) {
  GRADSUM_SKIP_WITHOUT_GPU();
  const int64_t rows = 6, vocab = 50;
  std::vector<float> z = RandomLogits(rows * vocab, 9);
  std::vector<int64_t> y = RandomLabels(rows, vocab, 10, 0.0);
  CeRun run = RunCe(DType::kF32, z, rows, vocab, y, {}, /*D=*/3.0, false);
  EXPECT_EQ(run.status.code(), absl::StatusCode::kFailedPrecondition) << run.status;
}

TEST(CrossEntropyCuda, NonFiniteLogitsAndBadWeightsAreInvalidArgument) {
  GRADSUM_SKIP_WITHOUT_GPU();
  const int64_t rows = 4, vocab = 16;
  std::vector<float> z = RandomLogits(rows * vocab, 11);
  z[2 * vocab + 5] = std::numeric_limits<float>::quiet_NaN();
  std::vector<int64_t> y = {0, 1, 2, 3};
  CeRun run = RunCe(DType::kF32, z, rows, vocab, y, {}, 4.0, false);
  EXPECT_EQ(run.status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(run.status.message()), HasSubstr("row 2"));

  std::vector<float> good = RandomLogits(rows * vocab, 12);
  run = RunCe(DType::kF32, good, rows, vocab, y, {1, 1, -1, 1}, 4.0, false);
  EXPECT_EQ(run.status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(run.status.message()), HasSubstr("weight at row 2"));

  run = RunCe(DType::kF32, good, rows, vocab, y, {}, std::nan(""), false);
  EXPECT_EQ(run.status.code(), absl::StatusCode::kInvalidArgument);
}

TEST(CrossEntropyCuda, AsyncRecordAccumulatesLossAndReportsErrorAtCheck) {
  GRADSUM_SKIP_WITHOUT_GPU();
  const int64_t rows = 10, vocab = 128;
  std::vector<float> z = RandomLogits(rows * vocab, 13);
  std::vector<int64_t> y = RandomLabels(rows, vocab, 14, 0.0);
  const double D = 20;  // two micro-batches of 10 tokens
  Reference ref = ReferenceCe(z, rows, vocab, y, {}, D, 1.0);
  auto logits = Dev(z);
  auto grad = *DeviceBuffer::Create(logits.size());
  auto labels = Dev(y);
  auto d = Dev(std::vector<double>{D});
  auto loss = Dev(std::vector<double>{0.0});
  auto record = CrossEntropyErrorRecord::Create();
  ASSERT_TRUE(record.ok()) << record.status();
  CrossEntropyCudaArgs a;
  a.logits = logits.get();
  a.rows = rows;
  a.vocab = vocab;
  a.labels = labels.as<int64_t>();
  a.global_weight_sum = d.as<double>();
  a.grad_logits = grad.get();
  a.loss = loss.as<double>();
  a.accumulate_loss = true;
  a.error_record = &*record;
  ASSERT_TRUE(CrossEntropyCuda(a, nullptr).ok());
  ASSERT_TRUE(CrossEntropyCuda(a, nullptr).ok());
  ASSERT_TRUE(record->CheckAndReset(nullptr).ok());
  EXPECT_NEAR(Host<double>(loss)[0], 2 * ref.loss, 1e-5 * std::abs(ref.loss));

  std::vector<int64_t> bad = y;
  bad[7] = vocab;  // one past the end
  ASSERT_TRUE(labels.CopyFromHost(bad.data(), bad.size() * sizeof(int64_t)).ok());
  ASSERT_TRUE(CrossEntropyCuda(a, nullptr).ok());  // enqueued; not yet checked
  absl::Status s = record->CheckAndReset(nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("label 128 at row 7"));
  EXPECT_TRUE(record->CheckAndReset(nullptr).ok());  // cleared
}

TEST(CrossEntropyCuda, RowOffsetsBeyondInt32AreIndexedCorrectly) {
  GRADSUM_SKIP_WITHOUT_GPU();
  // 16400 x 131072 bf16 = 2^31 + 2^21 elements (4.3 GB): the last rows start past 2^31.
  const int64_t rows = 16400, vocab = 131072, tail = 3;
  size_t free_bytes = 0, total_bytes = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total_bytes), cudaSuccess);
  if (free_bytes < (size_t{5} << 30)) GTEST_SKIP() << "needs 5 GiB of free device memory";
  auto logits = *DeviceBuffer::Create(sizeof(uint16_t) * rows * vocab);
  ASSERT_TRUE(logits.Fill(0).ok());  // every logit 0.0: uniform softmax
  std::vector<float> zt = RandomLogits(tail * vocab, 15);
  std::vector<uint16_t> zt_bits = ToBf16Bits(zt);
  const size_t tail_offset = sizeof(uint16_t) * (rows - tail) * vocab;
  ASSERT_EQ(cudaMemcpy(static_cast<char*>(logits.get()) + tail_offset, zt_bits.data(),
                       zt_bits.size() * 2, cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(cudaStreamLegacy), cudaSuccess);  // the DMA has landed
  std::vector<int64_t> y = RandomLabels(rows, vocab, 16, 0.0);
  auto labels = Dev(y);
  const double D = static_cast<double>(rows);
  auto d = Dev(std::vector<double>{D});
  auto loss = *DeviceBuffer::Create(sizeof(double));
  CrossEntropyCudaArgs a;
  a.logits = logits.get();
  a.dtype = DType::kBF16;
  a.rows = rows;
  a.vocab = vocab;
  a.labels = labels.as<int64_t>();
  a.global_weight_sum = d.as<double>();
  a.grad_logits = logits.get();
  a.loss = loss.as<double>();
  ASSERT_TRUE(CrossEntropyCuda(a, nullptr).ok());

  std::vector<int64_t> y_tail(y.end() - tail, y.end());
  Reference ref = ReferenceCe(zt, tail, vocab, y_tail, {}, D, 1.0);
  const double uniform_loss = (rows - tail) * std::log(static_cast<double>(vocab)) / D;
  EXPECT_NEAR(Host<double>(loss)[0], uniform_loss + ref.loss, 1e-5 * (uniform_loss + ref.loss));
  std::vector<uint16_t> g_bits(tail * vocab);
  ASSERT_EQ(cudaMemcpy(g_bits.data(), static_cast<char*>(logits.get()) + tail_offset,
                       g_bits.size() * 2, cudaMemcpyDeviceToHost),
            cudaSuccess);
  std::vector<double> g(g_bits.size());
  for (size_t i = 0; i < g.size(); ++i) g[i] = BF16::FromBits(g_bits[i]).ToFloat();
  ExpectGradNear(g, ref.grad, 1e-12, 1.0 / 256);
}

TEST(CrossEntropyCuda, BadArgumentsAreRejectedBeforeLaunch) {
  GRADSUM_SKIP_WITHOUT_GPU();
  auto logits = *DeviceBuffer::Create(sizeof(float) * 4 * 8);
  auto labels = Dev(std::vector<int64_t>{0, 1, 2, 3});
  auto d = Dev(std::vector<double>{4.0});
  auto loss = *DeviceBuffer::Create(sizeof(double));
  CrossEntropyCudaArgs a;
  a.logits = logits.get();
  a.rows = 4;
  a.vocab = 8;
  a.labels = labels.as<int64_t>();
  a.global_weight_sum = d.as<double>();
  a.loss = loss.as<double>();
  ASSERT_TRUE(CrossEntropyCuda(a, nullptr).ok());

  CrossEntropyCudaArgs host_labels = a;
  std::vector<int64_t> h = {0, 1, 2, 3};
  host_labels.labels = h.data();
  absl::Status s = CrossEntropyCuda(host_labels, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("labels"));

  CrossEntropyCudaArgs no_d = a;
  no_d.global_weight_sum = nullptr;
  EXPECT_EQ(CrossEntropyCuda(no_d, nullptr).code(), absl::StatusCode::kInvalidArgument);

  CrossEntropyCudaArgs f16 = a;
  f16.dtype = DType::kF16;
  EXPECT_EQ(CrossEntropyCuda(f16, nullptr).code(), absl::StatusCode::kInvalidArgument);

  CrossEntropyCudaArgs zero_vocab = a;
  zero_vocab.vocab = 0;
  EXPECT_EQ(CrossEntropyCuda(zero_vocab, nullptr).code(), absl::StatusCode::kInvalidArgument);

  CrossEntropyCudaArgs overlap = a;
  overlap.grad_logits = static_cast<char*>(logits.get()) + 4;
  EXPECT_EQ(CrossEntropyCuda(overlap, nullptr).code(), absl::StatusCode::kInvalidArgument);
}

// The one case that runs on this machine: without a device the wrapper must fail cleanly.
TEST(CrossEntropyCudaWithoutDevice, ReturnsFailedPreconditionNotACrash) {
  std::string why;
  if (::gradsum::testing::CudaDeviceAvailable(&why)) GTEST_SKIP() << "a GPU is present";
  CrossEntropyCudaArgs a;
  a.rows = 1;
  a.vocab = 4;
  absl::Status s = CrossEntropyCuda(a, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("no usable CUDA device"));
  EXPECT_EQ(CrossEntropyErrorRecord::Create().status().code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace gradsum::losses
