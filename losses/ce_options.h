#ifndef GRADSUM_LOSSES_CE_OPTIONS_H_
#define GRADSUM_LOSSES_CE_OPTIONS_H_

// The LM head's cross-entropy options of SEMANTICS.md §3.2, as one value: every struct that
// carries them (the CE kernels' options, the model's config, the fp64 reference's, the
// PyTorch binding's) holds a CeOptions `ce` and copies it whole, so an option added here
// reaches each of them. Each option is global in scope and 0 = off; with all three 0 the CE
// runs exactly as without them (same code, same bits).
//
//   losses::CrossEntropyOptions options;
//   options.ce = config.ce;   // label_smoothing, logit_softcap, alpha_lse
//   options.ce.label_smoothing = 0.1;

namespace gradsum::losses {

struct CeOptions {
  // eps in [0, 1): the target is (1 - eps) onehot + eps / V over the whole vocabulary.
  double label_smoothing = 0.0;
  // c >= 0 (finite): the loss sees c * tanh(z / c) in place of the logits z (Gemma 2); the
  // gradient is taken through it (factor 1 - tanh^2(z / c)).
  double logit_softcap = 0.0;
  // >= 0 (finite): adds alpha_lse * logsumexp(z_t)^2 per token (PaLM's output z-loss), with
  // the CE's weights and D.
  double alpha_lse = 0.0;
};

}  // namespace gradsum::losses

#endif  // GRADSUM_LOSSES_CE_OPTIONS_H_
