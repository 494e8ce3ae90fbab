#!/usr/bin/python3
"""Train moe_model.TinyMoe with DDP over gloo, the gradsum way or the legacy way.

gradsum's way (gradsum_step): one all_reduce of detached counts before the step
(gradsum_torch.dist.step_stats), each rank back-propagates only its local loss components
(gradsum_torch ops), gradients are SUM-reduced (gradsum_torch.dist.sum_hook); the reduced
gradient equals the single-process full-batch gradient (SEMANTICS.md §2).

The legacy way (legacy_step), as many PyTorch trainers do it today (SEMANTICS.md §9): the
loss terms go through an autograd all_reduce, whose backward multiplies each rank's
gradient by the world size, and DDP's default hook averages; in fp32 with a power-of-two
world size that is the same gradient.

    /usr/bin/python3 examples/torch/train_ddp.py --world 2 --grad_acc 2 --mode sample
    # or: /usr/bin/python3 -m torch.distributed.run --nproc_per_node 2 examples/torch/train_ddp.py

(with bazel-bin/torch on PYTHONPATH, after ./bazelw build //torch:gradsum_torch).
Rank 0 prints each step's global loss (SEMANTICS.md §8: the same value on every rank).
"""

import argparse
import contextlib
import datetime
import os
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_autograd
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

import gradsum_torch as gt
import moe_model
from moe_model import IGNORE


def gradsum_ddp(model, group=None):
    ddp = nn.parallel.DistributedDataParallel(model, process_group=group)
    ddp.register_comm_hook(group, gt.dist.sum_hook)  # SUM, never average
    return ddp


def gradsum_step(ddp, micro_batches, cfg, mode, ce_impl="linear", group=None):
    """Forward and backward of one step's micro-batches on this rank; leaves the reduced
    gradient in .grad. Returns the step's global loss terms (§8), the same on every rank."""
    model = ddp.module
    g = len(micro_batches)
    stats = gt.dist.step_stats(micro_batches, mode=mode, group=group)  # one all_reduce
    local = {"ce": 0.0, "z": 0.0, "bal": 0.0}
    for m, mb in enumerate(micro_batches):
        mask = mb["input_mask"]
        with ddp.no_sync() if m < g - 1 else contextlib.nullcontext():
            hidden, router_logits, topk = ddp(mb["tokens"], mask)
            counts = gt.dist.expert_counts(topk, cfg.experts, input_mask=mask, group=group)
            if ce_impl == "linear":  # the LM head fused in: no [T, V] logits
                ce = gt.linear_cross_entropy(hidden, model.head.weight, mb["labels"],
                                             stats.global_ce_weight_sum,
                                             token_weights=stats.token_weights[m])
            else:
                ce = gt.cross_entropy(model.head(hidden), mb["labels"],
                                      stats.global_ce_weight_sum,
                                      token_weights=stats.token_weights[m])
            z = sum(gt.z_loss(u, stats.global_routed_tokens, cfg.alpha_z, input_mask=mask)
                    for u in router_logits)
            bal = sum(gt.balancing_loss(u, counts[layer], cfg.top_k, g, cfg.alpha_b,
                                        input_mask=mask)
                      for layer, u in enumerate(router_logits))
            (ce + z + bal).backward()
        for k, v in (("ce", ce), ("z", z), ("bal", bal)):
            local[k] += v.item()
    return gt.dist.global_sums(local, group=group)  # one all_reduce


def legacy_ddp(model, group=None):
    return nn.parallel.DistributedDataParallel(model, process_group=group)  # averages


def legacy_step(ddp, micro_batches, cfg, mode, group=None, loss_group=None):
    """The same step written the legacy way, in plain PyTorch. `loss_group` carries the
    loss's autograd all_reduces (apart from DDP's bucket traffic). Returns the global terms."""
    model = ddp.module
    g = len(micro_batches)
    weights = [moe_model.ce_weights(mb["labels"], mb["sample_ids"], mode).float()
               for mb in micro_batches]
    counts = torch.tensor([sum(float(w.double().sum()) for w in weights),
                           sum(float(mb["input_mask"].sum()) for mb in micro_batches)],
                          dtype=torch.float64)
    dist.all_reduce(counts, group=group)
    d, n = counts.tolist()
    terms = {"ce": 0.0, "z": 0.0, "bal": 0.0}
    for m, mb in enumerate(micro_batches):
        mask = mb["input_mask"]
        with ddp.no_sync() if m < g - 1 else contextlib.nullcontext():
            hidden, router_logits, topk = ddp(mb["tokens"], mask)
            ce_t = F.cross_entropy(model.head(hidden), mb["labels"], ignore_index=IGNORE,
                                   reduction="none")
            # The global CE through an autograd all_reduce: backward scales by the world size.
            ce = dist_autograd.all_reduce((weights[m] * ce_t).sum(), group=loss_group) / d
            z_local = sum((u.logsumexp(-1)[mask] ** 2).sum() for u in router_logits)
            z = cfg.alpha_z * dist_autograd.all_reduce(z_local, group=loss_group) / n
            bal = 0.0
            for u, idx in zip(router_logits, topk):
                c = torch.bincount(idx[mask].reshape(-1), minlength=cfg.experts).double()
                dist.all_reduce(c, group=group)
                n_lm = c.sum() / cfg.top_k
                if n_lm > 0:  # the gating sum all_reduced with autograd
                    p_sum = dist_autograd.all_reduce(u.softmax(-1)[mask].sum(0), group=loss_group)
                    coef = (cfg.alpha_b / g * cfg.experts * c / (n_lm * cfg.top_k) / n_lm).float()
                    bal = bal + (coef * p_sum).sum()
            (ce + z + bal).backward()
        for k, v in (("ce", ce), ("z", z), ("bal", bal)):
            terms[k] += float(v)  # already global on every rank
    return terms


def train(rank, world, args):
    cfg = moe_model.Config()
    model = moe_model.make_model(cfg)
    ddp = legacy_ddp(model) if args.legacy else gradsum_ddp(model)
    loss_group = dist.new_group(list(range(world))) if args.legacy else None
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    for step in range(args.steps):
        batches = [moe_model.micro_batch(cfg, step, rank, m, args.seed)
                   for m in range(args.grad_acc)]
        opt.zero_grad(set_to_none=True)
        if args.legacy:
            terms = legacy_step(ddp, batches, cfg, args.mode, loss_group=loss_group)
        else:
            terms = gradsum_step(ddp, batches, cfg, args.mode, args.ce)
        opt.step()
        if rank == 0:
            print(f"step {step + 1:3d} | loss {sum(terms.values()):.6f} | ce {terms['ce']:.6f} "
                  f"| z {terms['z']:.6f} | bal {terms['bal']:.6f}", flush=True)


def _spawned(rank, world, args, init_file):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    train(rank, world, args)
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2, help="processes (without torchrun)")
    parser.add_argument("--grad_acc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--mode", choices=["token", "sample", "square"], default="token")
    parser.add_argument("--ce", choices=["linear", "logits"], default="linear")
    parser.add_argument("--legacy", action="store_true", help="the legacy way (average)")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if "RANK" in os.environ:  # launched by torch.distributed.run
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        train(dist.get_rank(), dist.get_world_size(), args)
        dist.destroy_process_group()
        return
    with tempfile.TemporaryDirectory(prefix="train_ddp.") as d:  # the gloo rendezvous file
        mp.spawn(_spawned, args=(args.world, args, f"{d}/store"), nprocs=args.world)


if __name__ == "__main__":
    main()
