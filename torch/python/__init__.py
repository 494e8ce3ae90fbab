"""gradsum's losses for PyTorch: every loss term is a sum of rank-local components.

Each op returns this rank's component of one micro-batch (SEMANTICS.md §3-5, §13); the global
normalisers are detached numbers from one all_reduce before the step (gradsum_torch.dist),
gradients are reduced by SUM (gradsum_torch.dist.sum_hook), and nothing divides by the
world size. The reduced gradient then equals the single-process full-batch gradient.

    stats = gradsum_torch.dist.step_stats([labels_m for labels_m in micro_batches])
    loss = gradsum_torch.cross_entropy(logits, labels, stats.global_ce_weight_sum)
    ddp.register_comm_hook(None, gradsum_torch.dist.sum_hook)   # SUM, not average

Ops (CPU tensors, float32 or bfloat16; autograd through the library's fused kernels; no
op communicates):
  cross_entropy(logits, labels, global_weight_sum, mode="token", *, sample_ids, token_weights,
                label_smoothing=0.0, logit_softcap=0.0, alpha_lse=0.0)
  linear_cross_entropy(hidden, weight, labels, global_weight_sum, mode="token", ...)
  z_loss(router_logits, global_routed_tokens, alpha=0.001, *, input_mask)
  balancing_loss(router_logits, global_expert_counts, top_k, num_micro_batches=1,
                 alpha=0.001, *, input_mask, probs=False)
  token_weights(labels, sample_ids=None, mode="token"), count_expert_assignments(...)
  policy_loss(logits, labels, old_logprob, advantages, global_valid_tokens, *, mask, ...)
      -> (loss, metrics): the RL policy loss of §13 (PPO clip, dual clip, importance
      weights, KL), its normalisers from dist.policy_stats
Errors in the arguments raise ValueError with the library's message.

Threads: torch.get_num_threads(), as torch's own CPU ops. Gradient buffers of 32 MiB and
more use huge pages, and the last one freed is kept for the next call; empty_cache()
unmaps it.
"""

import torch  # noqa: F401  (loads libtorch's Python bindings before the extension)

from gradsum_torch._C import (  # noqa: F401
    balancing_loss,
    count_expert_assignments,
    cross_entropy,
    empty_cache,
    linear_cross_entropy,
    token_weights,
    z_loss,
)
from gradsum_torch.policy import policy_loss  # noqa: F401
from gradsum_torch import dist  # noqa: F401

__all__ = [
    "balancing_loss",
    "count_expert_assignments",
    "cross_entropy",
    "dist",
    "empty_cache",
    "linear_cross_entropy",
    "policy_loss",
    "token_weights",
    "z_loss",
]
