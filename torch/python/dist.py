"""Detached global statistics and SUM gradient reduction over torch.distributed.

The PyTorch side of SEMANTICS.md §2-5, §7 and §8, over any process group (gloo, nccl, ...):

- step_stats(): before a step's first forward, ONE float64 SUM all_reduce gives every rank
  D (§3, for the chosen CE mode), N (§4, routed tokens) and the valid-token count of the
  whole step, plus this rank's per-token weights w_t.
- expert_counts(): during forward, ONE int64 SUM all_reduce per micro-batch gives the
  per-layer expert counts c[l, m, :] of §5 (they depend on the routing, so they cannot be
  known before the step); it can run asynchronously while the experts compute.
- sum_hook: a DDP comm hook that all-reduces gradient buckets with SUM, never averaging.
  sum_gradients() does the same for parameters outside DDP.
- global_sums(): the §8 display pipeline: one float64 SUM all_reduce of each term's
  detached local components gives the global value, the same on every rank.
- policy_stats(): for the policy loss of §13, ONE float64 SUM all_reduce gives N (valid
  tokens) and S (sequences with a valid token) of the step, and this rank's n_s per token;
  policy_metrics() reduces the loss's metrics (SUM, and MAX / MIN for the ratio extremes).

    stats = dist.step_stats([(labels_m, sample_ids_m, mask_m) for m in range(G)], mode="sample")
    ddp.register_comm_hook(None, dist.sum_hook)
    for m in range(G):
        with ddp.no_sync() if m < G - 1 else contextlib.nullcontext():
            hidden, router_logits, topk = ddp(tokens[m])
            counts = dist.expert_counts(topk, num_experts=E, input_mask=mask[m])   # [L, E]
            loss = gradsum_torch.linear_cross_entropy(
                hidden, head.weight, labels[m], stats.global_ce_weight_sum,
                token_weights=stats.token_weights[m])
            for l in range(L):
                loss = loss + gradsum_torch.z_loss(router_logits[l], stats.global_routed_tokens,
                                                   input_mask=mask[m])
                loss = loss + gradsum_torch.balancing_loss(router_logits[l], counts[l], K, G,
                                                           input_mask=mask[m])
            loss.backward()

A rank whose own input is bad still joins the collective (so no rank is left waiting) and
raises ValueError with its message; the other ranks raise ValueError naming the problem as
another rank's. Collectives are the only thing here that communicates: the loss ops in
gradsum_torch never do.
"""

import dataclasses
import math
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from gradsum_torch import _C

_EXACT_LIMIT = float(2**53)  # counts travel as float64, exact below this


@dataclasses.dataclass(frozen=True)
class StepStats:
    """The detached statistics of one optimizer step (global = all ranks, all micro-batches)."""

    mode: str
    # G, the same on every rank (checked).
    num_micro_batches: int
    # D of §3: sum of w_t over all ranks and micro-batches (0.0 when every label is ignored).
    global_ce_weight_sum: float
    # Tokens whose label is not ignore_index, all ranks and micro-batches.
    global_valid_tokens: int
    # N of §4: routed (non-padding) tokens, all ranks and micro-batches.
    global_routed_tokens: int
    # This rank's shares of the three sums.
    local_ce_weight_sum: float
    local_valid_tokens: int
    local_routed_tokens: int
    # w_t per micro-batch (float32, shaped like its labels): pass token_weights=... to the CE ops.
    token_weights: List[torch.Tensor]


def _unpack(micro_batch):
    """(labels, sample_ids, input_mask) from a labels tensor, a tuple or a dict."""
    if isinstance(micro_batch, torch.Tensor):
        return micro_batch, None, None
    if isinstance(micro_batch, dict):
        return (micro_batch["labels"], micro_batch.get("sample_ids"),
                micro_batch.get("input_mask"))
    items = tuple(micro_batch) + (None, None)
    return items[0], items[1], items[2]


def _local_stats(micro_batches, mode, ignore_index):
    weights, local_d, valid, routed = [], 0.0, 0, 0
    for m, mb in enumerate(micro_batches):
        labels, sample_ids, mask = _unpack(mb)
        w = _C.token_weights(labels, sample_ids, mode, ignore_index)
        weights.append(w)
        local_d += float(w.double().sum())
        valid += int((labels != ignore_index).sum())
        if mask is None:
            routed += labels.numel()
            continue
        if mask.shape != labels.shape:
            raise ValueError(f"step_stats: micro-batch {m}: input_mask has shape "
                             f"{tuple(mask.shape)}, labels {tuple(labels.shape)}")
        mask_i = mask.to(torch.int64)
        if bool(((mask_i != 0) & (mask_i != 1)).any()):
            raise ValueError(f"step_stats: micro-batch {m}: input_mask values must be 0 or 1")
        if bool(((mask_i == 0) & (labels != ignore_index)).any()):
            raise ValueError(f"step_stats: micro-batch {m}: a padding token (input_mask 0) has "
                             f"a label other than ignore_index ({ignore_index}) (SEMANTICS.md §1)")
        routed += int(mask_i.sum())
    return weights, local_d, valid, routed


def step_stats(micro_batches: Sequence, mode: str = "token",
               group: Optional[dist.ProcessGroup] = None, ignore_index: int = -100) -> StepStats:
    """D, N and the valid count of the step with ONE float64 SUM all_reduce over `group`.

    micro_batches: this rank's G micro-batches, each a labels tensor, a tuple
    (labels, sample_ids, input_mask) or a dict with those keys (sample_ids for the sample
    and square modes; input_mask 1 = routed, 0 = padding, None = all routed). Collective:
    every rank of the group calls it with the same G.
    """
    error = None
    try:
        if len(micro_batches) == 0:
            raise ValueError("step_stats: no micro-batches")
        weights, local_d, valid, routed = _local_stats(micro_batches, mode, ignore_index)
    except (ValueError, TypeError) as e:
        error, weights, local_d, valid, routed = e, [], 0.0, 0, 0
    g = len(micro_batches)
    # [D, valid, routed, G, G^2, ranks, failed ranks]: equal G everywhere iff
    # (sum G)^2 == ranks * sum G^2.
    packed = torch.tensor([local_d, valid, routed, g, g * g, 1, 0 if error is None else 1],
                          dtype=torch.float64)
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    d, n_valid, n_routed, sum_g, sum_g2, ranks, failed = packed.tolist()
    if error is not None:
        raise error
    if failed:
        raise ValueError(f"step_stats: {int(failed)} other rank(s) passed invalid micro-batches")
    if sum_g * sum_g != ranks * sum_g2:
        raise ValueError(f"step_stats: ranks disagree on the number of micro-batches (this rank "
                         f"has {g}, the mean is {sum_g / ranks})")
    if max(n_valid, n_routed) >= _EXACT_LIMIT:
        raise OverflowError("step_stats: a global token count reached 2^53")
    return StepStats(mode=mode, num_micro_batches=g, global_ce_weight_sum=d,
                     global_valid_tokens=int(n_valid), global_routed_tokens=int(n_routed),
                     local_ce_weight_sum=local_d, local_valid_tokens=valid,
                     local_routed_tokens=routed, token_weights=weights)


class PendingExpertCounts:
    """An expert_counts() all_reduce in flight; wait() returns the [L, E] global counts."""

    def __init__(self, buffer, work, num_layers, num_experts, error):
        self._buffer, self._work, self._error = buffer, work, error
        self._shape = (num_layers, num_experts)
        self._result = None

    def wait(self) -> torch.Tensor:
        if self._result is None:
            self._work.wait()
            self._result = _finish_counts(self._buffer, self._shape, self._error)
        return self._result


def _finish_counts(buffer, shape, error):
    if error is not None:
        raise error
    if int(buffer[-1]):
        raise ValueError(f"expert_counts: {int(buffer[-1])} other rank(s) passed invalid "
                         "top-k indices")
    return buffer[:-1].view(shape)


def expert_counts(topk_indices_per_layer: Sequence[torch.Tensor], num_experts: int,
                  input_mask: Optional[torch.Tensor] = None,
                  group: Optional[dist.ProcessGroup] = None, async_op: bool = False):
    """c[l, m, :] of §5 for every MoE layer of one micro-batch: ONE int64 SUM all_reduce.

    topk_indices_per_layer: per layer the [T, K] expert ids the router picked on this rank
    (rows where input_mask is 0 are not counted). Returns the global [L, E] int64 counts
    (row l is the global_expert_counts argument of balancing_loss for layer l), or with
    async_op=True a PendingExpertCounts whose wait() returns them. Collective.
    """
    num_layers = len(topk_indices_per_layer)
    error = None
    try:
        local = [_C.count_expert_assignments(idx.detach(), num_experts, input_mask)
                 for idx in topk_indices_per_layer]
        buffer = torch.cat(local + [torch.zeros(1, dtype=torch.int64)])
    except (ValueError, TypeError) as e:
        error = e
        buffer = torch.zeros(num_layers * max(num_experts, 0) + 1, dtype=torch.int64)
        buffer[-1] = 1
    work = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    if async_op:
        return PendingExpertCounts(buffer, work, num_layers, num_experts, error)
    return _finish_counts(buffer, (num_layers, num_experts), error)


def sum_hook(process_group: Optional[dist.ProcessGroup],
             bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: each gradient bucket is all-reduced with SUM, and nothing divides.

        ddp.register_comm_hook(None, gradsum_torch.dist.sum_hook)    # the default group
        ddp.register_comm_hook(group, gradsum_torch.dist.sum_hook)   # another group

    DDP's default hook divides by the world size; with gradsum's losses (local components
    over global normalisers) the SUM is the full-batch gradient (SEMANTICS.md §7).
    """
    group = process_group if process_group is not None else dist.group.WORLD
    fut = dist.all_reduce(bucket.buffer(), op=dist.ReduceOp.SUM, group=group,
                          async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def sum_gradients(parameters, group: Optional[dist.ProcessGroup] = None) -> None:
    """SUM-all-reduces the .grad of `parameters` in place (one collective per dtype), for
    parameters that DDP does not manage. Parameters without a gradient are skipped: every
    rank must have gradients for the same parameters."""
    by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for dtype in sorted(by_dtype, key=str):
        grads = by_dtype[dtype]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def global_sums(local_values: Dict[str, float],
                group: Optional[dist.ProcessGroup] = None) -> Dict[str, float]:
    """§8: ONE float64 SUM all_reduce of each term's detached local components (summed over
    this rank's micro-batches) gives every rank the global value of every term. Every rank
    must pass the same keys."""
    keys = sorted(local_values)
    packed = torch.tensor([float(local_values[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    return dict(zip(keys, packed.tolist()))


# ---- The policy loss of SEMANTICS.md §13. ----


@dataclasses.dataclass(frozen=True)
class PolicyStats:
    """The detached normalisers of the policy loss for one optimizer step (§13)."""

    # G, the same on every rank (checked).
    num_micro_batches: int
    # N: valid tokens (label != ignore_index and mask != 0), all ranks and micro-batches.
    global_valid_tokens: int
    # S: sequences with at least one valid token, all ranks and micro-batches (0 when no
    # sequence ids were given).
    global_sequences: int
    # This rank's shares.
    local_valid_tokens: int
    local_sequences: int
    # Per micro-batch n_s (int64, shaped like its labels: the valid-token count of each
    # token's sequence), or None without sequence ids: policy_loss's sequence_valid_tokens.
    sequence_valid_tokens: List[Optional[torch.Tensor]]


def _unpack_policy(micro_batch):
    """(labels, sequence_ids, mask) from a labels tensor, a tuple or a dict."""
    if isinstance(micro_batch, torch.Tensor):
        return micro_batch, None, None
    if isinstance(micro_batch, dict):
        return (micro_batch["labels"], micro_batch.get("sequence_ids"),
                micro_batch.get("mask"))
    items = tuple(micro_batch) + (None, None)
    return items[0], items[1], items[2]


def _policy_local(micro_batches, ignore_index):
    n_s, valid_total, seqs = [], 0, 0
    with_ids = [_unpack_policy(mb)[1] is not None for mb in micro_batches]
    if any(with_ids) and not all(with_ids):
        raise ValueError("policy_stats: give sequence ids for every micro-batch or for none")
    for m, mb in enumerate(micro_batches):
        labels, seq_ids, mask = _unpack_policy(mb)
        valid = labels != ignore_index
        if mask is not None:
            if mask.shape != labels.shape:
                raise ValueError(f"policy_stats: micro-batch {m}: mask has shape "
                                 f"{tuple(mask.shape)}, labels {tuple(labels.shape)}")
            valid = valid & (mask != 0)
        valid_total += int(valid.sum())
        if seq_ids is None:
            n_s.append(None)
            continue
        if seq_ids.shape != labels.shape or seq_ids.is_floating_point():
            raise ValueError(f"policy_stats: micro-batch {m}: sequence_ids must be integer and "
                             f"shaped like the labels {tuple(labels.shape)}, got "
                             f"{seq_ids.dtype}{tuple(seq_ids.shape)}")
        ids, inverse = torch.unique(seq_ids.reshape(-1), return_inverse=True)
        counts = torch.zeros(ids.numel(), dtype=torch.int64).index_add_(
            0, inverse, valid.reshape(-1).to(torch.int64))
        n_s.append(counts[inverse].reshape(labels.shape))
        seqs += int((counts > 0).sum())
    return n_s, valid_total, seqs, any(with_ids)


def policy_stats(micro_batches: Sequence, group: Optional[dist.ProcessGroup] = None,
                 ignore_index: int = -100) -> PolicyStats:
    """N, S and n_s of the step for gradsum_torch.policy_loss: ONE float64 SUM all_reduce.

    micro_batches: this rank's G micro-batches, each a labels tensor, a tuple
    (labels, sequence_ids, mask) or a dict with those keys. A token is valid when its label
    is not ignore_index and its mask (None = all 1) is not 0, as in policy_loss.
    sequence_ids (integer, shaped like the labels; None: token-mean only) name the
    sequences within one micro-batch: equal id = same sequence. A sequence must lie whole in
    one micro-batch of one rank (no sequence parallelism in the binding); n_s counts its
    valid tokens. Collective: every rank of the group calls it with the same G, and with
    sequence ids on every rank or on none.
    """
    error = None
    try:
        if len(micro_batches) == 0:
            raise ValueError("policy_stats: no micro-batches")
        n_s, valid, seqs, has_ids = _policy_local(micro_batches, ignore_index)
    except (ValueError, TypeError, KeyError) as e:
        error, n_s, valid, seqs, has_ids = e, [], 0, 0, False
    g = len(micro_batches)
    # [N, S, G, G^2, ranks, ranks with ids, failed ranks]: equal G everywhere iff
    # (sum G)^2 == ranks * sum G^2.
    packed = torch.tensor([valid, seqs, g, g * g, 1, 1 if has_ids else 0,
                           0 if error is None else 1], dtype=torch.float64)
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    n_valid, n_seqs, sum_g, sum_g2, ranks, ranks_ids, failed = packed.tolist()
    if error is not None:
        raise error
    if failed:
        raise ValueError(f"policy_stats: {int(failed)} other rank(s) passed invalid micro-batches")
    if sum_g * sum_g != ranks * sum_g2:
        raise ValueError(f"policy_stats: ranks disagree on the number of micro-batches (this "
                         f"rank has {g}, the mean is {sum_g / ranks})")
    if ranks_ids not in (0, ranks):
        raise ValueError(f"policy_stats: {int(ranks_ids)} of {int(ranks)} ranks gave sequence "
                         "ids; give them on every rank or on none")
    if n_valid >= _EXACT_LIMIT:
        raise OverflowError("policy_stats: the global valid-token count reached 2^53")
    return PolicyStats(num_micro_batches=g, global_valid_tokens=int(n_valid),
                       global_sequences=int(n_seqs), local_valid_tokens=valid,
                       local_sequences=seqs, sequence_valid_tokens=n_s)


_POLICY_SUMS = ("kl", "kl_sum", "valid_tokens", "clip_count", "dual_clip_count", "ratio_sum")


def policy_metrics(metrics: Sequence[Dict[str, float]],
                   group: Optional[dist.ProcessGroup] = None) -> Dict[str, float]:
    """The global policy-loss metrics of the step from this rank's per-micro-batch dicts
    (policy_loss's second result): one float64 SUM all_reduce and one MAX all_reduce (the
    minimum sent negated), as the display pipeline of §8 reduces them.

    Returns the summed "kl", "kl_sum", "valid_tokens", "clip_count", "dual_clip_count",
    "ratio_sum"; "ratio_max" and "ratio_min" over the valid tokens; "clip_fraction",
    "dual_clip_fraction" and "mean_ratio" per valid token. All 0 with no valid token.
    Collective: every rank calls it (with an empty list if it has no micro-batch).
    """
    sums = torch.tensor([sum(float(m[k]) for m in metrics) for k in _POLICY_SUMS],
                        dtype=torch.float64)
    # A micro-batch without valid tokens has no ratio: it must not pull the max down.
    with_tokens = [m for m in metrics if m["valid_tokens"] > 0]
    extremes = torch.tensor([max((m["ratio_max"] for m in with_tokens), default=-math.inf),
                             max((-m["ratio_min"] for m in with_tokens), default=-math.inf)],
                            dtype=torch.float64)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    out = dict(zip(_POLICY_SUMS, sums.tolist()))
    n = out["valid_tokens"]
    hi, neg_lo = extremes.tolist()
    out["ratio_max"] = hi if n > 0 else 0.0
    out["ratio_min"] = -neg_lo if n > 0 else 0.0
    for name, key in (("clip_fraction", "clip_count"), ("dual_clip_fraction", "dual_clip_count"),
                      ("mean_ratio", "ratio_sum")):
        out[name] = out[key] / n if n > 0 else 0.0
    return out
