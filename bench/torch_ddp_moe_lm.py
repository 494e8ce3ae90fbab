#!/usr/bin/python3
"""The PyTorch peer of //train:moe_lm: the same model, batch and losses in PyTorch DDP.

What a user would write instead of gradsum: moe_lm (SEMANTICS.md §10) at the binary's
default sizes (train/config.proto: V=256, D=128, L=2, E=8, K=2, H=128, norm_topk_prob,
init_std 0.1; seq_len 128, micro_batch 8 sequences per rank, G=2 micro-batches per step),
trained with DDP over gloo, one process per rank, one thread each, AdamW (lr 0.01,
betas 0.9/0.95, warm-up 10 steps) with global-norm clipping at 1.0. Losses as §3-5: CE
summed over valid tokens / the global valid count, router z-loss and load-balancing loss
(alpha 0.001 each) with detached global counts. DDP averages gradients over ranks, so the
loss is scaled by the world size to give the SUM semantics of gradsum. Experts are
replicated (DDP has no expert parallelism); tokens reach their experts through
index_select / index_add_, the usual dropless PyTorch MoE.

With --attention (moe_lm --attention=causal), each layer starts with §10's attention block:
pre-norm RMSNorm (eps 1e-6), Wq/Wk/Wv/Wo without bias, --heads query and --kv_heads key/value
heads (GQA: kv head j serves query heads j G .. (j + 1) G - 1, G = heads / kv_heads), RoPE
in rotate-half form with positions counted from each document's first token (theta
--rope_theta), scale 1/sqrt(head_dim), and a causal mask restricted to the token's own
document, built per micro-batch from the packed documents' starts; padding neither attends
nor is attended to and its attention output is 0. The masked softmax attention is written
out (torch 1.13 has no scaled_dot_product_attention), as a user of that version would.
Parameters per layer: attn_norm, wq, wk, wv, wo, then the MoE block's.

Batches: documents of U[8, 96] random bytes packed greedily into 128-token sequences, the
tail padded (mask 0, label -100), as data/packer.cc packs its corpus; so the padding share
matches moe_lm's. They are built before timing. Prints routed (non-padding) tokens/s over
the timed steps, summed over ranks, the number moe_lm's summary line prints, and the mean
CE of the first and the last timed step on rank 0.

  OPENBLAS_NUM_THREADS=1 /usr/bin/python3 bench/torch_ddp_moe_lm.py --world 2 --steps 30
  OPENBLAS_NUM_THREADS=1 /usr/bin/python3 bench/torch_ddp_moe_lm.py --world 2 --steps 30 \
      --attention --heads 4 --kv_heads 4
  /usr/bin/python3 bench/torch_ddp_moe_lm.py --check_attention   # against a plain loop

(Debian's python3-torch calls libblas.so.3; point that alternative at OpenBLAS for a fair
comparison: update-alternatives --display libblas.so.3-x86_64-linux-gnu.)
"""
import argparse
import math
import os
import queue
import random
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

V, D, L, E, K, H = 256, 128, 2, 8, 2, 128
SEQ, MICRO, G = 128, 8, 2
ALPHA_B = ALPHA_Z = 1e-3
INIT_STD = 0.1
IGNORE = -100


class RmsNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.g = nn.Parameter(torch.ones(D))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.g


def rope(x, cos, sin):
    """§10's RoPE, rotate-half form, on the last dimension (head_dim)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class AttentionLayout:
    """What attention needs of a micro-batch, from its documents' starts.

    doc_start: [rows, SEQ] index within the row of each token's document's first token, -1
    for padding. `allowed[r, t, s]`: query t may attend key s (same document, s <= t); a
    padding query is given itself alone, so that its softmax is defined, and its output is
    zeroed by `valid`. cos, sin: [rows, 1, SEQ, head_dim / 2], angles pos * f_i in float64
    as model/layers.cc's RopeTable, then `dtype`.
    """

    def __init__(self, doc_start, head_dim, theta, dtype=torch.float32):
        rows, seq = doc_start.shape
        idx = torch.arange(seq)
        valid = doc_start >= 0
        same_doc = doc_start.unsqueeze(2) == doc_start.unsqueeze(1)
        causal = idx.unsqueeze(1) >= idx.unsqueeze(0)
        allowed = same_doc & causal & valid.unsqueeze(2)
        self.allowed = allowed | (torch.eye(seq, dtype=torch.bool) & ~valid.unsqueeze(2))
        self.valid = valid.reshape(-1, 1).to(dtype)
        pos = torch.where(valid, idx - doc_start, torch.zeros_like(doc_start))
        f = theta ** (-2.0 * torch.arange(head_dim // 2, dtype=torch.float64) / head_dim)
        angle = pos.to(torch.float64).unsqueeze(-1) * f  # [rows, SEQ, head_dim / 2]
        self.cos = angle.cos().to(dtype).unsqueeze(1)
        self.sin = angle.sin().to(dtype).unsqueeze(1)


class Attention(nn.Module):
    """§10's attention block: h + Attn(RMSNorm(h)) @ Wo, document-causal, GQA, RoPE."""

    def __init__(self, heads, kv_heads):
        super().__init__()
        if D % heads or heads % kv_heads or (D // heads) % 2:
            raise SystemExit(f"--heads={heads} --kv_heads={kv_heads}: need heads | D={D}, "
                             "kv_heads | heads and an even head_dim")
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, D // heads
        self.attn_norm = RmsNorm()
        self.wq = nn.Parameter(torch.randn(D, D) * INIT_STD)
        self.wk = nn.Parameter(torch.randn(D, kv_heads * self.head_dim) * INIT_STD)
        self.wv = nn.Parameter(torch.randn(D, kv_heads * self.head_dim) * INIT_STD)
        self.wo = nn.Parameter(torch.randn(D, D) * INIT_STD)

    def forward(self, h, layout):
        rows, seq = layout.allowed.shape[0], layout.allowed.shape[1]
        a = self.attn_norm(h)

        def split(x, n):  # [rows * seq, n * head_dim] -> [rows, n, seq, head_dim]
            return x.view(rows, seq, n, self.head_dim).transpose(1, 2)

        q = rope(split(a @ self.wq, self.heads), layout.cos, layout.sin)
        k = rope(split(a @ self.wk, self.kv_heads), layout.cos, layout.sin)
        v = split(a @ self.wv, self.kv_heads)
        group = self.heads // self.kv_heads  # query head i reads kv head i // group
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(self.head_dim))
        scores = scores.masked_fill(~layout.allowed.unsqueeze(1), float("-inf"))
        o = scores.softmax(-1) @ v  # [rows, heads, seq, head_dim]
        o = o.transpose(1, 2).reshape(rows * seq, D) * layout.valid  # padding: 0
        return h + o @ self.wo


class MoeLayer(nn.Module):
    def __init__(self, attention=None):
        super().__init__()
        if attention is not None:  # registered first: attn_norm, wq, wk, wv, wo, then MoE
            self.attention = Attention(*attention)
        self.norm = RmsNorm()
        self.router = nn.Parameter(torch.randn(D, E) * INIT_STD)
        self.wg = nn.Parameter(torch.randn(E, D, H) * INIT_STD)
        self.wu = nn.Parameter(torch.randn(E, D, H) * INIT_STD)
        self.wd = nn.Parameter(torch.randn(E, H, D) * INIT_STD)

    def forward(self, h, routed_idx, layout=None):
        if layout is not None:
            h = self.attention(h, layout)
        a = self.norm(h)
        ar = a.index_select(0, routed_idx)  # padding: no routing, h unchanged
        u = ar @ self.router
        p = u.softmax(-1)
        w, idx = p.topk(K, dim=-1)  # ties: lower index first
        w = w / w.sum(-1, keepdim=True)  # norm_topk_prob; router_scale 1
        y = torch.zeros_like(ar)
        flat_idx = idx.reshape(-1)
        flat_w = w.reshape(-1)
        token_of = torch.arange(ar.shape[0]).repeat_interleave(K)
        counts = torch.bincount(flat_idx, minlength=E)
        for e in range(E):
            sel = (flat_idx == e).nonzero(as_tuple=True)[0]
            if sel.numel() == 0:
                continue
            tok = token_of[sel]
            x = ar.index_select(0, tok)
            out = (F.silu(x @ self.wg[e]) * (x @ self.wu[e])) @ self.wd[e]
            y.index_add_(0, tok, out * flat_w[sel].unsqueeze(1))
        h = h.index_add(0, routed_idx, y)
        return h, u, p, counts


class MoeLm(nn.Module):
    def __init__(self, attention=None):
        """attention: None (moe_lm --attention=none), or (heads, kv_heads)."""
        super().__init__()
        self.emb = nn.Parameter(torch.randn(V, D))
        self.layers = nn.ModuleList([MoeLayer(attention) for _ in range(L)])
        self.final_norm = RmsNorm()
        self.out = nn.Parameter(torch.randn(D, V) * INIT_STD)


def pack_micro_batch(rng):
    """tokens, labels, mask [MICRO * SEQ] and doc_start [MICRO, SEQ] (-1: padding)."""
    tokens = torch.zeros(MICRO, SEQ, dtype=torch.long)
    labels = torch.full((MICRO, SEQ), IGNORE, dtype=torch.long)
    mask = torch.zeros(MICRO, SEQ, dtype=torch.bool)
    doc_start = torch.full((MICRO, SEQ), -1, dtype=torch.long)
    for b in range(MICRO):
        pos = 0
        while True:
            n = rng.randint(8, 96)
            if pos + n > SEQ:
                break  # the document opens the next sequence; this one is padded
            doc = torch.tensor([rng.randrange(V) for _ in range(n)])
            tokens[b, pos:pos + n] = doc
            labels[b, pos:pos + n - 1] = doc[1:]
            mask[b, pos:pos + n] = True
            doc_start[b, pos:pos + n] = pos
            pos += n
    return tokens.reshape(-1), labels.reshape(-1), mask.reshape(-1), doc_start


def all_reduce_sum(t):
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def train_step(model, ddp, opt, step_batches, world, attention):
    """One optimizer step; returns this rank's CE sum / the global valid count."""
    # Detached global statistics before the step's first forward (§3, §4).
    valid = torch.tensor([float((lab != IGNORE).sum()) for _, lab, _, _ in step_batches]).sum()
    routed = torch.tensor([float(m.sum()) for _, _, m, _ in step_batches]).sum()
    stats = all_reduce_sum(torch.stack([valid, routed]))
    n_valid, n_routed = stats[0].item(), stats[1].item()
    opt.zero_grad(set_to_none=True)
    ce_total = 0.0
    for m, (tokens, labels, mask, doc_start) in enumerate(step_batches):
        routed_idx = mask.nonzero(as_tuple=True)[0]
        layout = (AttentionLayout(doc_start, D // attention[0], attention[2])
                  if attention is not None else None)
        sync = m == len(step_batches) - 1
        ctx = ddp.no_sync() if not sync else _Null()
        with ctx:
            h = model.emb.index_select(0, tokens)
            z_loss = 0.0
            bal_loss = 0.0
            for layer in model.layers:
                h, u, p, counts = layer(h, routed_idx, layout)
                z_loss = z_loss + u.logsumexp(-1).pow(2).sum() * (ALPHA_Z / n_routed)
                # §5: global counts of this micro-step, detached (one SUM all-reduce).
                c = all_reduce_sum(counts.double())
                n_lm = c.sum() / K
                if n_lm > 0:
                    coef = (E * c / (n_lm * K) / n_lm).float()
                    bal_loss = bal_loss + (ALPHA_B / G) * (coef * p.sum(0)).sum()
            logits = model.final_norm(h) @ model.out
            ce = F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum") / n_valid
            loss = ce + z_loss + bal_loss
            # DDP averages over ranks; gradsum sums. Scale so both mean the same gradient.
            (loss * world).backward()
            ce_total += ce.item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return ce_total


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def run(rank, world, steps, warmup, port, attention, result):
    """attention: None or (heads, kv_heads, rope_theta)."""
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(1)  # the same initial weights on every rank
    model = MoeLm(attention[:2] if attention is not None else None)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    rng = random.Random(1000 + rank)
    batches = [[pack_micro_batch(rng) for _ in range(G)] for _ in range(warmup + steps)]
    routed = 0
    ces = []  # this rank's share of each timed step's CE
    for s, step_batches in enumerate(batches):
        if s == warmup:
            dist.barrier()
            start = time.perf_counter()
        ce = train_step(model, ddp, opt, step_batches, world, attention)
        sched.step()
        if s >= warmup:
            routed += sum(int(m.sum()) for _, _, m, _ in step_batches)
            ces.append(ce)
    dist.barrier()
    elapsed = time.perf_counter() - start
    total = all_reduce_sum(torch.tensor([float(routed)])).item()
    ce_ends = all_reduce_sum(torch.tensor([ces[0], ces[-1]], dtype=torch.float64))
    if rank == 0:
        result.put((total, elapsed, ce_ends[0].item(), ce_ends[1].item()))
        # put() hands the item to a feeder thread; flush it before the gloo teardown, which
        # can block (holding the GIL) and so left the parent waiting for a result forever.
        result.close()
        result.join_thread()
    dist.destroy_process_group()


def check_attention():
    """The attention block against §10 written as plain loops, in float64, on one packed
    micro-batch with GQA, several documents per row and padding. Raises on a mismatch."""
    torch.manual_seed(3)
    heads, kv_heads, seq, rows = 4, 2, 12, 2
    hd, group = D // heads, heads // kv_heads
    attn = Attention(heads, kv_heads).double()
    with torch.no_grad():
        attn.attn_norm.g.uniform_(0.5, 1.5)
    doc_start = torch.tensor([[0] * 5 + [5] * 4 + [-1] * 3, [0] * 2 + [2] * 7 + [9] * 3])
    h = torch.randn(rows * seq, D, dtype=torch.float64)
    layout = AttentionLayout(doc_start, hd, 10000.0, torch.float64)
    got = attn(h, layout)
    want = h.clone()
    a = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * attn.attn_norm.g
    q, k, v = a @ attn.wq, a @ attn.wk, a @ attn.wv
    for r in range(rows):
        for t in range(seq):
            if doc_start[r, t] < 0:
                continue  # padding: o = 0, h unchanged
            o = torch.zeros(D, dtype=torch.float64)
            for i in range(heads):
                j = i // group

                def rot(x, pos):  # x'_m and x'_{m + hd/2} of §10, element by element
                    y = x.clone()
                    for m in range(hd // 2):
                        ang = pos * 10000.0 ** (-2.0 * m / hd)
                        y[m] = x[m] * math.cos(ang) - x[m + hd // 2] * math.sin(ang)
                        y[m + hd // 2] = x[m + hd // 2] * math.cos(ang) + x[m] * math.sin(ang)
                    return y

                row = r * seq
                qt = rot(q[row + t, i * hd:(i + 1) * hd], t - doc_start[r, t].item())
                keys = [s for s in range(seq) if doc_start[r, s] == doc_start[r, t] and s <= t]
                logits = [float(qt @ rot(k[row + s, j * hd:(j + 1) * hd],
                                         s - doc_start[r, s].item())) / math.sqrt(hd)
                          for s in keys]
                top = max(logits)
                w = [math.exp(x - top) for x in logits]
                for s, ws in zip(keys, w):
                    o[i * hd:(i + 1) * hd] += ws / sum(w) * v[row + s, j * hd:(j + 1) * hd]
            want[r * seq + t] += o @ attn.wo
    err = (got - want).abs().max().item()
    if not err < 1e-12:
        raise SystemExit(f"attention block differs from the loop by {err}")
    # No gradient reaches another document or padding through attention: perturbing row 0's
    # second document and the padding leaves the first document's outputs unchanged.
    h2 = h.clone()
    h2[5:12] += 1.0
    if not torch.equal(attn(h2, layout)[:5], got[:5]):
        raise SystemExit("a document's output depends on another document or on padding")
    print(f"attention block matches the plain loop (max abs difference {err:.1e})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--port", type=int, default=0, help="0: a free port")
    # The model's attention, as moe_lm's flags; defaults as train/config.proto's ModelConfig.
    parser.add_argument("--attention", action="store_true",
                        help="§10's attention block in every layer (moe_lm --attention=causal)")
    parser.add_argument("--heads", type=int, default=4, help="query heads")
    parser.add_argument("--kv_heads", type=int, default=4, help="key/value heads (GQA)")
    parser.add_argument("--rope_theta", type=float, default=10000.0)
    parser.add_argument("--check_attention", action="store_true",
                        help="check the attention block against a plain loop and exit")
    args = parser.parse_args()
    if args.check_attention:
        check_attention()
        return
    attention = (args.heads, args.kv_heads, args.rope_theta) if args.attention else None
    if args.port == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            args.port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    procs = [ctx.Process(target=run, args=(r, args.world, args.steps, args.warmup, args.port,
                                           attention, result)) for r in range(args.world)]
    for p in procs:
        p.start()
    while True:  # a rank that dies never reports: stop instead of waiting forever
        try:
            total, elapsed, ce_first, ce_last = result.get(timeout=5)
            break
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs) or all(
                    p.exitcode is not None for p in procs):
                for p in procs:
                    p.kill()
                raise SystemExit("a rank failed or none reported: " +
                                 str([p.exitcode for p in procs]))
    for p in procs:
        p.join(timeout=60)  # the result is in: a rank stuck in teardown does not matter
        if p.exitcode is None:
            p.kill()
        elif p.exitcode != 0:
            raise SystemExit(f"rank exited with {p.exitcode}")
    model = (f"attention heads {args.heads} kv_heads {args.kv_heads}" if args.attention
             else "no attention")
    print(f"torch DDP world={args.world} steps={args.steps} {model}: {total / elapsed:.0f} "
          f"routed tok/s ({elapsed / args.steps * 1e3:.1f} ms/step, torch {torch.__version__}, "
          f"threads 1, BLAS {os.environ.get('OPENBLAS_NUM_THREADS', 'unset')} threads); "
          f"ce {ce_first:.4f} -> {ce_last:.4f} over the timed steps")


if __name__ == "__main__":
    main()
