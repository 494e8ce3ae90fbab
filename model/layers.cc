#include "model/layers.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "core/vec_math.h"

namespace gradsum::model {

void RmsNormForward(absl::Span<const float> h, absl::Span<const float> gain, int64_t rows,
                    int64_t dim, absl::Span<float> a, absl::Span<float> inv_rms) {
  for (int64_t t = 0; t < rows; ++t) {
    inv_rms[t] =
        vec::RmsNormRow(h.data() + t * dim, gain.data(), kRmsNormEps, a.data() + t * dim, dim);
  }
}

void RmsNormBackward(absl::Span<const float> h, absl::Span<const float> gain,
                     absl::Span<const float> inv_rms, absl::Span<const float> da, int64_t rows,
                     int64_t dim, absl::Span<float> dh, absl::Span<float> dgain) {
  // The gain gradient sums over every token of the micro-batch: accumulate it in fp64 and
  // round once, so it does not lose digits to thousands of fp32 additions.
  std::vector<double> dgain_sum(dim, 0.0);
  for (int64_t t = 0; t < rows; ++t) {
    vec::RmsNormBackwardRow(h.data() + t * dim, da.data() + t * dim, gain.data(), inv_rms[t],
                            dgain_sum.data(), dh.data() + t * dim, dim);
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

void RopeTable(absl::Span<const int32_t> positions, int64_t head_dim, double theta,
               std::vector<float>* cos_table, std::vector<float>* sin_table) {
  const int64_t half = head_dim / 2, T = static_cast<int64_t>(positions.size());
  cos_table->resize(T * half);
  sin_table->resize(T * half);
  for (int64_t i = 0; i < half; ++i) {
    const double f = std::pow(theta, -2.0 * i / static_cast<double>(head_dim));
    for (int64_t t = 0; t < T; ++t) {
      const double angle = static_cast<double>(positions[t]) * f;
      (*cos_table)[t * half + i] = static_cast<float>(std::cos(angle));
      (*sin_table)[t * half + i] = static_cast<float>(std::sin(angle));
    }
  }
}

}  // namespace gradsum::model
