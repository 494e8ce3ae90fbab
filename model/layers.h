#ifndef GRADSUM_MODEL_LAYERS_H_
#define GRADSUM_MODEL_LAYERS_H_

// The two dense pieces of moe_lm (SEMANTICS.md §10) that no other package provides:
// the token embedding and RMSNorm, forward and backward, fp32 on the CPU, row by row.
//
//   RmsNormForward(h, gain, T, D, a, inv_rms);            // a = h / sqrt(mean(h^2)+1e-6) * g
//   RmsNormBackward(h, gain, inv_rms, da, T, D, dh, dgain);  // dh += ..., dgain += ...
//   EmbeddingForward(emb, tokens, D, h);                  // h[t] = emb[tokens[t]]
//   EmbeddingBackward(tokens, dh, D, demb);               // demb[tokens[t]] += dh[t]
//
// Sizes are the caller's contract (checked by the model once per shape, not per call):
// h, a, dh, da: [T, D]; gain, dgain: [D]; inv_rms: [T]; tokens: [T] in [0, V); emb: [V, D].

#include <cstdint>
#include <vector>

#include "absl/types/span.h"

namespace gradsum::model {

inline constexpr float kRmsNormEps = 1e-6f;  // SEMANTICS.md §10

// a[t] = h[t] * r_t * gain with r_t = 1 / sqrt(mean(h[t]^2) + eps) (accumulated in fp64);
// stores r_t in inv_rms[t]. The rows run through core/vec_math.h (vectorised, the same bits
// on every CPU; its RmsNormRow gives the exact order of the operations).
void RmsNormForward(absl::Span<const float> h, absl::Span<const float> gain, int64_t rows,
                    int64_t dim, absl::Span<float> a, absl::Span<float> inv_rms);

// Given da = dL/da, ADDS dL/dh into dh and dL/dgain into dgain (the sum over rows in
// fp64, rounded once):
//   dgain_i += sum_t da_ti h_ti r_t
//   dh_ti   += r_t g_i da_ti - r_t^3 h_ti (sum_j da_tj g_j h_tj) / D
void RmsNormBackward(absl::Span<const float> h, absl::Span<const float> gain,
                     absl::Span<const float> inv_rms, absl::Span<const float> da, int64_t rows,
                     int64_t dim, absl::Span<float> dh, absl::Span<float> dgain);

// h[t] = emb[tokens[t]] (overwrites h).
void EmbeddingForward(absl::Span<const float> emb, absl::Span<const int32_t> tokens, int64_t dim,
                      absl::Span<float> h);

// demb[tokens[t]] += dh[t], in token order.
void EmbeddingBackward(absl::Span<const int32_t> tokens, absl::Span<const float> dh, int64_t dim,
                       absl::Span<float> demb);

// RoPE's rotation table (SEMANTICS.md §10, rotate-half form) for tokens at `positions`:
// cos_table[t * half + i] = cos(positions[t] * theta^(-2 i / head_dim)), likewise sin_table,
// half = head_dim / 2; the angles in fp64, rounded once to fp32. Both devices rotate by
// these values.
void RopeTable(absl::Span<const int32_t> positions, int64_t head_dim, double theta,
               std::vector<float>* cos_table, std::vector<float>* sin_table);

}  // namespace gradsum::model

#endif  // GRADSUM_MODEL_LAYERS_H_
