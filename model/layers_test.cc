#include "model/layers.h"

#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace gradsum::model {
namespace {

// L(h, g) = sum_t sum_i w_ti * RmsNorm(h; g)_ti in double, for finite differences.
double WeightedNormLoss(const std::vector<double>& h, const std::vector<double>& g,
                        const std::vector<double>& w, int rows, int dim) {
  double loss = 0;
  for (int t = 0; t < rows; ++t) {
    double ms = 0;
    for (int i = 0; i < dim; ++i) ms += h[t * dim + i] * h[t * dim + i];
    const double r = 1.0 / std::sqrt(ms / dim + 1e-6);
    for (int i = 0; i < dim; ++i) loss += w[t * dim + i] * h[t * dim + i] * r * g[i];
  }
  return loss;
}

// dim 7: only the scalar tail of the row kernels (core/vec_math.h); 37: the 8-lane body
// and a tail.
class RmsNormTest : public ::testing::TestWithParam<int> {};

TEST_P(RmsNormTest, ForwardMatchesDoubleAndBackwardMatchesFiniteDifferences) {
  const int rows = 5, dim = GetParam();
  std::mt19937 rng(3);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> h(rows * dim), g(dim), w(rows * dim);
  for (double& x : h) x = static_cast<float>(normal(rng));
  for (double& x : g) x = static_cast<float>(1.0 + 0.3 * normal(rng));
  for (double& x : w) x = static_cast<float>(normal(rng));
  std::vector<float> hf(h.begin(), h.end()), gf(g.begin(), g.end()), wf(w.begin(), w.end());
  std::vector<float> a(rows * dim), inv(rows);
  RmsNormForward(hf, gf, rows, dim, absl::MakeSpan(a), absl::MakeSpan(inv));
  for (int t = 0; t < rows; ++t) {
    double ms = 0;
    for (int i = 0; i < dim; ++i) ms += h[t * dim + i] * h[t * dim + i];
    const double r = 1.0 / std::sqrt(ms / dim + 1e-6);
    for (int i = 0; i < dim; ++i) {
      EXPECT_NEAR(a[t * dim + i], h[t * dim + i] * r * g[i], 1e-6) << t << "," << i;
    }
  }
  std::vector<float> dh(rows * dim, 0.5f), dg(dim, -0.25f);  // backward accumulates
  RmsNormBackward(hf, gf, inv, wf, rows, dim, absl::MakeSpan(dh), absl::MakeSpan(dg));
  const double eps = 1e-6;
  for (int k = 0; k < rows * dim; ++k) {
    std::vector<double> hp = h, hm = h;
    hp[k] += eps;
    hm[k] -= eps;
    const double fd =
        (WeightedNormLoss(hp, g, w, rows, dim) - WeightedNormLoss(hm, g, w, rows, dim)) / (2 * eps);
    EXPECT_NEAR(dh[k] - 0.5f, fd, 2e-5) << "h[" << k << "]";
  }
  for (int i = 0; i < dim; ++i) {
    std::vector<double> gp = g, gm = g;
    gp[i] += eps;
    gm[i] -= eps;
    const double fd =
        (WeightedNormLoss(h, gp, w, rows, dim) - WeightedNormLoss(h, gm, w, rows, dim)) / (2 * eps);
    EXPECT_NEAR(dg[i] + 0.25f, fd, 2e-5) << "g[" << i << "]";
  }
}

INSTANTIATE_TEST_SUITE_P(Dims, RmsNormTest, ::testing::Values(7, 37));

TEST(EmbeddingTest, GathersRowsAndScatterAddsGradients) {
  const int dim = 3;
  std::vector<float> emb = {0, 1, 2, 10, 11, 12, 20, 21, 22};
  std::vector<int32_t> tokens = {2, 0, 2};
  std::vector<float> h(tokens.size() * dim);
  EmbeddingForward(emb, tokens, dim, absl::MakeSpan(h));
  EXPECT_EQ(h, (std::vector<float>{20, 21, 22, 0, 1, 2, 20, 21, 22}));
  std::vector<float> dh = {1, 2, 3, 4, 5, 6, 7, 8, 9}, demb(9, 0.f);
  EmbeddingBackward(tokens, dh, dim, absl::MakeSpan(demb));
  EXPECT_EQ(demb, (std::vector<float>{4, 5, 6, 0, 0, 0, 8, 10, 12}));
}

}  // namespace
}  // namespace gradsum::model
