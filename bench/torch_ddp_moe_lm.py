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

Batches: documents of U[8, 96] random bytes packed greedily into 128-token sequences, the
tail padded (mask 0, label -100), as train/data.cc packs its corpus; so the padding share
matches moe_lm's. They are built before timing. Prints routed (non-padding) tokens/s over
the timed steps, summed over ranks, the number moe_lm's summary line prints.

  OPENBLAS_NUM_THREADS=1 /usr/bin/python3 bench/torch_ddp_moe_lm.py --world 2 --steps 30

(Debian's python3-torch calls libblas.so.3; point that alternative at OpenBLAS for a fair
comparison: update-alternatives --display libblas.so.3-x86_64-linux-gnu.)
"""
import argparse
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


class MoeLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = RmsNorm()
        self.router = nn.Parameter(torch.randn(D, E) * INIT_STD)
        self.wg = nn.Parameter(torch.randn(E, D, H) * INIT_STD)
        self.wu = nn.Parameter(torch.randn(E, D, H) * INIT_STD)
        self.wd = nn.Parameter(torch.randn(E, H, D) * INIT_STD)

    def forward(self, h, routed_idx):
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
    def __init__(self):
        super().__init__()
        self.emb = nn.Parameter(torch.randn(V, D))
        self.layers = nn.ModuleList([MoeLayer() for _ in range(L)])
        self.final_norm = RmsNorm()
        self.out = nn.Parameter(torch.randn(D, V) * INIT_STD)


def pack_micro_batch(rng):
    tokens = torch.zeros(MICRO, SEQ, dtype=torch.long)
    labels = torch.full((MICRO, SEQ), IGNORE, dtype=torch.long)
    mask = torch.zeros(MICRO, SEQ, dtype=torch.bool)
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
            pos += n
    return tokens.reshape(-1), labels.reshape(-1), mask.reshape(-1)


def all_reduce_sum(t):
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def train_step(model, ddp, opt, step_batches, world):
    # Detached global statistics before the step's first forward (§3, §4).
    valid = torch.tensor([float((lab != IGNORE).sum()) for _, lab, _ in step_batches]).sum()
    routed = torch.tensor([float(m.sum()) for _, _, m in step_batches]).sum()
    stats = all_reduce_sum(torch.stack([valid, routed]))
    n_valid, n_routed = stats[0].item(), stats[1].item()
    opt.zero_grad(set_to_none=True)
    for m, (tokens, labels, mask) in enumerate(step_batches):
        routed_idx = mask.nonzero(as_tuple=True)[0]
        sync = m == len(step_batches) - 1
        ctx = ddp.no_sync() if not sync else _Null()
        with ctx:
            h = model.emb.index_select(0, tokens)
            z_loss = 0.0
            bal_loss = 0.0
            for layer in model.layers:
                h, u, p, counts = layer(h, routed_idx)
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
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def run(rank, world, steps, warmup, port, result):
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(1)  # the same initial weights on every rank
    model = MoeLm()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    rng = random.Random(1000 + rank)
    batches = [[pack_micro_batch(rng) for _ in range(G)] for _ in range(warmup + steps)]
    routed = 0
    for s, step_batches in enumerate(batches):
        if s == warmup:
            dist.barrier()
            start = time.perf_counter()
        train_step(model, ddp, opt, step_batches, world)
        sched.step()
        if s >= warmup:
            routed += sum(int(m.sum()) for _, _, m in step_batches)
    dist.barrier()
    elapsed = time.perf_counter() - start
    total = all_reduce_sum(torch.tensor([float(routed)])).item()
    if rank == 0:
        result.put((total, elapsed))
        # put() hands the item to a feeder thread; flush it before the gloo teardown, which
        # can block (holding the GIL) and so left the parent waiting for a result forever.
        result.close()
        result.join_thread()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--port", type=int, default=0, help="0: a free port")
    args = parser.parse_args()
    if args.port == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            args.port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    procs = [ctx.Process(target=run, args=(r, args.world, args.steps, args.warmup, args.port,
                                           result)) for r in range(args.world)]
    for p in procs:
        p.start()
    while True:  # a rank that dies never reports: stop instead of waiting forever
        try:
            total, elapsed = result.get(timeout=5)
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
    print(f"torch DDP world={args.world} steps={args.steps}: {total / elapsed:.0f} routed tok/s "
          f"({elapsed / args.steps * 1e3:.1f} ms/step, torch {torch.__version__}, "
          f"threads 1, BLAS {os.environ.get('OPENBLAS_NUM_THREADS', 'unset')} threads)")


if __name__ == "__main__":
    main()
