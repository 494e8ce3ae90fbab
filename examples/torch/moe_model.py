"""A tiny MoE language model in plain PyTorch, its data, and the single-process reference.

The model is SEMANTICS.md §10's `moe_lm` with `attention = none` (the per-token model), at
toy sizes: embedding, L MoE layers (RMSNorm, softmax top-K router with renormalised
weights, SwiGLU experts, dropless), final RMSNorm, an untied LM head (an nn.Linear, so its
weight is [V, D]). Padding tokens are not routed. Per-token, so the reference can run a
micro-step's tokens of every rank as one batch.
Every expert runs every step (on zero rows if it got no token), so all parameters are in
every backward graph, as DDP without find_unused_parameters requires.

reference_step() is the check everything else is held to: one process, float64, the whole
global batch of a step, each loss term written out from SEMANTICS.md §3-5 with torch ops
(no gradsum_torch), differentiated by autograd.
"""

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

IGNORE = -100


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 32
    dim: int = 16
    layers: int = 2
    experts: int = 4
    top_k: int = 2
    expert_dim: int = 8
    seq_len: int = 12
    rows: int = 2  # sequences per micro-batch and rank
    alpha_z: float = 0.05  # larger than the 0.001 default, so the aux gradients are visible
    alpha_b: float = 0.05


class RmsNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class MoeLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.top_k = cfg.top_k
        self.norm = RmsNorm(cfg.dim)
        self.router = nn.Parameter(torch.randn(cfg.dim, cfg.experts) * 0.5)
        self.wg = nn.Parameter(torch.randn(cfg.experts, cfg.dim, cfg.expert_dim) * 0.3)
        self.wu = nn.Parameter(torch.randn(cfg.experts, cfg.dim, cfg.expert_dim) * 0.3)
        self.wd = nn.Parameter(torch.randn(cfg.experts, cfg.expert_dim, cfg.dim) * 0.3)

    def forward(self, h, mask):
        """h: [T, D]; mask: [T] bool (True = routed). Returns h, router logits [T, E], top-k ids."""
        a = self.norm(h)
        u = a @ self.router
        p = u.softmax(-1)
        w, idx = p.topk(self.top_k, dim=-1)  # ties: lower expert index first
        w = w / w.sum(-1, keepdim=True)  # norm_topk_prob
        y = torch.zeros_like(h)
        for e in range(self.wg.shape[0]):
            tok, slot = ((idx == e) & mask[:, None]).nonzero(as_tuple=True)
            x = a[tok]
            out = (F.silu(x @ self.wg[e]) * (x @ self.wu[e])) @ self.wd[e]
            y = y.index_add(0, tok, out * w[tok, slot].unsqueeze(1))
        return h + y, u, idx


class TinyMoe(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList([MoeLayer(cfg) for _ in range(cfg.layers)])
        self.final_norm = RmsNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens, mask):
        """tokens, mask: [T]. Returns the final-norm output [T, D] (the LM head's input), and
        per layer the router logits [T, E] and the top-k expert ids [T, K]."""
        h = self.embed(tokens)
        router_logits, topk = [], []
        for layer in self.layers:
            h, u, idx = layer(h, mask)
            router_logits.append(u)
            topk.append(idx)
        return self.final_norm(h), router_logits, topk


def make_model(cfg, seed=1):
    torch.manual_seed(seed)  # the same initial weights on every rank
    return TinyMoe(cfg)


def micro_batch(cfg, step, rank, m, seed=0):
    """Micro-batch m of `rank` at `step`: documents of 3-8 tokens packed into cfg.rows
    sequences of cfg.seq_len, the tail padded (mask 0, label -100). Labels are the next token
    within a document; the more so the higher the rank, labels are also dropped (-100), so
    valid-token counts differ across ranks. sample_ids number the documents."""
    gen = torch.Generator().manual_seed(1_000_003 * seed + 10_007 * step + 101 * rank + m)
    t = cfg.rows * cfg.seq_len
    tokens = torch.zeros(t, dtype=torch.int64)
    labels = torch.full((t,), IGNORE, dtype=torch.int64)
    sample_ids = torch.full((t,), -1, dtype=torch.int64)
    mask = torch.zeros(t, dtype=torch.bool)
    doc = 0
    for row in range(cfg.rows):
        pos = row * cfg.seq_len
        end = pos + cfg.seq_len - int(torch.randint(0, 4, (1,), generator=gen))
        while True:
            n = int(torch.randint(3, 9, (1,), generator=gen))
            if pos + n > end:
                break
            toks = torch.randint(0, cfg.vocab, (n,), generator=gen)
            tokens[pos:pos + n] = toks
            labels[pos:pos + n - 1] = toks[1:]
            sample_ids[pos:pos + n] = doc
            mask[pos:pos + n] = True
            pos, doc = pos + n, doc + 1
    drop = torch.rand(t, generator=gen) < 0.1 * rank
    labels[drop] = IGNORE
    return {"tokens": tokens, "labels": labels, "sample_ids": sample_ids, "input_mask": mask}


def step_batches(cfg, step, world, grad_acc, seed=0):
    """[rank][m] micro-batches of one step."""
    return [[micro_batch(cfg, step, r, m, seed) for m in range(grad_acc)] for r in range(world)]


def ce_weights(labels, sample_ids, mode):
    """Plain-torch w_t of §3 for one micro-batch (float64)."""
    valid = labels != IGNORE
    if mode == "token":
        return valid.double()
    w = torch.zeros(labels.shape, dtype=torch.float64)
    for s in sample_ids[valid].unique():
        in_s = valid & (sample_ids == s)
        n_s = int(in_s.sum())
        w[in_s] = 1.0 / n_s if mode == "sample" else 1.0 / math.sqrt(n_s)
    return w


def reference_step(model, batches, cfg, mode):
    """The step's global loss and its gradient in one process, float64 (SEMANTICS.md §2).

    batches[r][m] as step_batches(). Micro-step m of the step is micro-batch m of every
    rank, which matters only for the balancing loss (§5, per micro-step).
    Returns (loss value, {parameter name: gradient}, {term: value}).
    """
    model = model.double()
    model.zero_grad(set_to_none=True)
    world, grad_acc = len(batches), len(batches[0])
    all_mbs = [mb for rank in batches for mb in rank]
    d = sum(float(ce_weights(mb["labels"], mb["sample_ids"], mode).sum()) for mb in all_mbs)
    n = sum(int(mb["input_mask"].sum()) for mb in all_mbs)
    terms = {"ce": 0.0, "z": 0.0, "bal": 0.0}
    total = 0.0
    for m in range(grad_acc):
        step_mbs = [batches[r][m] for r in range(world)]
        tokens = torch.cat([mb["tokens"] for mb in step_mbs])
        labels = torch.cat([mb["labels"] for mb in step_mbs])
        mask = torch.cat([mb["input_mask"] for mb in step_mbs])
        w = torch.cat([ce_weights(mb["labels"], mb["sample_ids"], mode) for mb in step_mbs])
        hidden, router_logits, topk = model(tokens, mask)
        ce_t = F.cross_entropy(model.head(hidden), labels, ignore_index=IGNORE, reduction="none")
        ce = (w * ce_t).sum() / d  # §3
        z = sum(cfg.alpha_z * (u.logsumexp(-1)[mask] ** 2).sum() / n for u in router_logits)  # §4
        bal = 0.0
        for u, idx in zip(router_logits, topk):  # §5, counts of this micro-step, all ranks
            c = torch.bincount(idx[mask].reshape(-1), minlength=cfg.experts).double()
            n_lm = c.sum() / cfg.top_k
            if n_lm > 0:
                p_sum = u.softmax(-1)[mask].sum(0)
                bal = bal + cfg.alpha_b / grad_acc * cfg.experts * (
                    c / (n_lm * cfg.top_k) * p_sum).sum() / n_lm
        loss = ce + z + bal
        loss.backward()
        total += loss.item()
        for k, v in (("ce", ce), ("z", z), ("bal", bal)):
            terms[k] += float(v)
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return total, grads, terms
