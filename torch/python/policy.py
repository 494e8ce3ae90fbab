"""The token-level RL policy loss of SEMANTICS.md §13 as an autograd op.

    stats = gradsum_torch.dist.policy_stats([(labels[m], seq_ids[m], mask[m]) for m in range(G)])
    loss, metrics = gradsum_torch.policy_loss(logits, labels[m], old_logprob[m], advantages[m],
                                              stats.global_valid_tokens, mask=mask[m])
    loss.backward()

The forward and the gradient are the library's fused kernel (losses/policy_loss.h); nothing
here computes the loss.
"""

import numbers
from typing import Dict, Optional, Tuple, Union

import torch

from gradsum_torch import _C

_METRICS = ("kl", "kl_sum", "valid_tokens", "clip_count", "dual_clip_count", "ratio_sum",
            "ratio_max", "ratio_min")


def _number(name, x):
    """x as a float: a real number or a one-element tensor (a normaliser from dist), else
    ValueError naming the argument. float() alone would take the string '6'."""
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        if x.numel() != 1 or x.is_complex():
            raise ValueError(f"policy_loss: {name} must be a number or a one-element real "
                             f"tensor, got a tensor of shape {list(x.shape)} ({x.dtype})")
        return float(x.item())
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise ValueError(f"policy_loss: {name} must be a number (int or float), got "
                         f"{type(x).__name__} {x!r}")
    return float(x)


def policy_loss(logits: torch.Tensor, labels: torch.Tensor, old_logprob: torch.Tensor,
                advantages: torch.Tensor,
                global_valid_tokens: Union[None, int, float, torch.Tensor] = None, *,
                mask: Optional[torch.Tensor] = None,
                is_weights: Optional[torch.Tensor] = None,
                ref_logprob: Optional[torch.Tensor] = None,
                eps_low: float = 0.2, eps_high: float = 0.2, dual_clip_c: float = 3.0,
                kl_coef: float = 0.0, kl_estimator: str = "k3", is_cap: float = 2.0,
                aggregation: str = "token_mean",
                global_sequences: Union[None, int, float, torch.Tensor] = None,
                sequence_valid_tokens: Optional[torch.Tensor] = None,
                ignore_index: int = -100) -> Tuple[torch.Tensor, Dict[str, float]]:
    """Rank-local policy-loss component L_pg[r, m] of SEMANTICS.md §13, and its metrics.

        L_pg[r, m] = sum over valid t of c_t * (min(iw_t, is_cap) * pg_t + kl_coef * kl_t)

    pg_t is the PPO clipped term with ratio r_t = exp(clamp(logp_t - old_t, -20, 20)), clip
    range [1 - eps_low, 1 + eps_high] and, for A_t < 0, the dual clip at -dual_clip_c * A_t
    (0 disables it); kl_t is the k1, k2 or k3 estimator against ref_logprob (needed when
    kl_coef > 0); logp_t = log_softmax(logits_t)[labels_t], the only differentiable input.

    logits: [..., V] float32 or bfloat16 CPU tensor (the gradient comes back in its dtype).
    labels: integer [...]; a token is valid when its label is not ignore_index and its mask
    (if given, bool or integer [...]) is not 0. old_logprob, advantages, is_weights (rollout
    importance weights, truncated at is_cap; +inf: no cap) and ref_logprob: floating [...],
    converted to float32, detached.

    Normalisers (detached, from gradsum_torch.dist.policy_stats, never local counts):
    - aggregation="token_mean": c_t = 1 / N, N = global_valid_tokens, the valid tokens of
      ALL ranks and micro-batches of the step;
    - aggregation="seq_mean_token_mean": c_t = 1 / (n_s S), S = global_sequences (sequences
      with a valid token, all ranks and micro-batches) and n_s = sequence_valid_tokens
      (integer [...], the valid-token count of each token's sequence).
    N = 0 (or S = 0) gives loss 0 and an exactly zero gradient.

    Returns (loss, metrics): loss a 0-dim float32 tensor (the KL part included); metrics a
    dict of this call's detached values: "kl" (the KL part of the loss), "kl_sum" (sum of
    kl_t), "valid_tokens", "clip_count" (PPO clip active), "dual_clip_count", "ratio_sum",
    "ratio_max", "ratio_min" (0 with no valid token). gradsum_torch.dist.policy_metrics
    reduces them over micro-batches and ranks.

    Forward runs the fused forward+backward kernel once (always: there is no forward-only
    policy kernel); backward only scales the kept gradient. Bad arguments raise ValueError
    with the library's message (shapes, dtypes, options out of range, a label outside
    [0, V), non-finite inputs of a valid token, a normaliser smaller than this call's own
    count).
    """
    out = _C._policy_loss(logits, labels, old_logprob, advantages,
                          _number("global_valid_tokens", global_valid_tokens), mask, is_weights,
                          ref_logprob, _number("eps_low", eps_low), _number("eps_high", eps_high),
                          _number("dual_clip_c", dual_clip_c), _number("kl_coef", kl_coef),
                          kl_estimator, _number("is_cap", is_cap), aggregation,
                          _number("global_sequences", global_sequences), sequence_valid_tokens,
                          int(ignore_index))
    return out[0], dict(zip(_METRICS, out[1:]))
