#include "train/layers.h"

#include <cmath>
#include <cstring>
#include <vector>

namespace gradsum::train {

void RmsNormForward(absl::Span<const float> h, absl::Span<const float> gain, int64_t rows,
                    int64_t dim, absl::Span<float> a, absl::Span<float> inv_rms) {
  for (int64_t t = 0; t < rows; ++t) {
    const float* x = h.data() + t * dim;
    double ms = 0;
    for (int64_t i = 0; i < dim; ++i) ms += static_cast<double>(x[i]) * x[i];
    const float r = static_cast<float>(1.0 / std::sqrt(ms / dim + kRmsNormEps));
    inv_rms[t] = r;
    float* y = a.data() + t * dim;
    for (int64_t i = 0; i < dim; ++i) y[i] = x[i] * r * gain[i];
  }
}

void RmsNormBackward(absl::Span<const float> h, absl::Span<const float> gain,
                     absl::Span<const float> inv_rms, absl::Span<const float> da, int64_t rows,
                     int64_t dim, absl::Span<float> dh, absl::Span<float> dgain) {
  // The gain gradient sums over every token of the micro-batch: accumulate it in fp64 and
  // round once, so it does not lose digits to thousands of fp32 additions.
  std::vector<double> dgain_sum(dim, 0.0);
  for (int64_t t = 0; t < rows; ++t) {
    const float* x = h.data() + t * dim;
    const float* g = da.data() + t * dim;
    const float r = inv_rms[t];
    double dot = 0;
    for (int64_t i = 0; i < dim; ++i) {
      dgain_sum[i] += static_cast<double>(g[i]) * x[i] * r;
      dot += static_cast<double>(g[i]) * gain[i] * x[i];
    }
    const float coef = static_cast<float>(static_cast<double>(r) * r * r * dot / dim);
    float* out = dh.data() + t * dim;
    for (int64_t i = 0; i < dim; ++i) out[i] += r * gain[i] * g[i] - coef * x[i];
  }
  for (int64_t i = 0; i < dim; ++i) dgain[i] += static_cast<float>(dgain_sum[i]);
}

void EmbeddingForward(absl::Span<const float> emb, absl::Span<const int32_t> tokens, int64_t dim,
                      absl::Span<float> h) {
  for (size_t t = 0; t < tokens.size(); ++t) {
    std::memcpy(h.data() + t * dim, emb.data() + static_cast<int64_t>(tokens[t]) * dim,
                sizeof(float) * dim);
  }
}

void EmbeddingBackward(absl::Span<const int32_t> tokens, absl::Span<const float> dh, int64_t dim,
                       absl::Span<float> demb) {
  for (size_t t = 0; t < tokens.size(); ++t) {
    float* row = demb.data() + static_cast<int64_t>(tokens[t]) * dim;
    const float* g = dh.data() + t * dim;
    for (int64_t i = 0; i < dim; ++i) row[i] += g[i];
  }
}

}  // namespace gradsum::train
