#include "testing/reference_config_of.h"

#include "data/streams.h"

namespace gradsum::testing {

ReferenceConfig ReferenceConfigOf(const model::MoeLmConfig& m) {
  ReferenceConfig rc;
  rc.vocab = static_cast<int>(m.vocab);
  rc.dim = static_cast<int>(m.dim);
  rc.layers = m.layers;
  rc.experts = m.experts;
  rc.top_k = m.top_k;
  rc.expert_dim = static_cast<int>(m.expert_dim);
  rc.norm_topk_prob = m.norm_topk_prob;
  rc.router_scale = m.router_scale;
  rc.alpha_b = m.alpha_b;
  rc.alpha_z = m.alpha_z;
  rc.ce = m.ce;
  rc.attention = m.attention;
  rc.n_heads = m.n_heads;
  rc.n_kv_heads = m.n_kv_heads;
  rc.rope_theta = m.rope_theta;
  rc.sigmoid_scores = m.router_sigmoid;
  rc.mtp_depth = m.mtp_depth;
  rc.mtp_scale = m.mtp_scale;
  rc.ignore_index = data::kIgnoreIndex;
  return rc;
}

}  // namespace gradsum::testing
