#!/usr/bin/python3
"""gradsum_torch's losses against PyTorch's own path, side by side in one run.

    ./bazelw build -c opt //torch:gradsum_torch
    PYTHONPATH=bazel-bin/torch /usr/bin/python3 bench/torch_losses_bench.py [--threads 2]

1. Cross-entropy forward + backward at N x V = 4096 x 32768, f32 and bf16:
   torch.nn.functional.cross_entropy (mean over the valid tokens) against
   gradsum_torch.cross_entropy with D = the valid count (the same loss), on the same leaf
   logits, the gradient taken with torch.autograd.grad; and the C++ kernel alone, called in
   a loop into one preallocated gradient buffer of the op's kind (huge pages). Rounds alternate torch and gradsum; each
   number is the median over rounds of the median of the round's iterations. Run twice,
   each in its own process: with glibc's default allocator (what a user gets: every large
   tensor is a fresh mmap, so its first touch page-faults) and with glibc told to keep
   freed memory for reuse (GLIBC_TUNABLES mmap_max=0, trim_threshold huge: torch's
   allocations then reuse touched memory, leaving the compute).
2. Peak memory of linear_cross_entropy against torch's logits path (logits = hidden @
   weight.T, then F.cross_entropy) at the same N x V with Dm = 512: each path in its own
   process, after a small warm-up call; the growth of the peak resident set (VmHWM, reset
   through /proc/self/clear_refs) over the resident set before the call, with the inputs
   and both gradients (which both paths produce) held.
3. Per-call overhead at small shapes, with both allocators as in 1:
   gradsum_torch.cross_entropy forward + autograd.grad per call, minus the C++ kernel alone
   per call (forward + backward in one call, like the op); the op's forward alone under
   torch.no_grad (the forward-only kernel, no autograd graph); torch's F.cross_entropy
   forward + autograd.grad for reference. The best of the rounds (after a warm-up): a
   per-call cost that other processes' interference can only add to.

4. The policy loss of §13 (gradsum_torch.policy_loss: PPO clip, dual clip, importance
   weights and the k3 KL all on) against gradsum_torch.cross_entropy on the same leaf logits,
   forward + autograd.grad, at a moderate PN x V = 1024 x 32768, f32 and bf16, rounds
   alternating as in 1 (default allocator). Both ops are the same CE row kernel, the policy
   one with a per-row gradient scale, so the ratio should be about 1.

Prints the load average before and after. Threads: --threads for both torch
(torch.set_num_threads) and gradsum (which uses torch's setting); 1 for part 3.
"""

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import gradsum_torch as gt

N, V, DM = 4096, 32768, 512
PN = 1024  # rows of part 4
REUSE_ENV = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1000000000000"
ALLOCATORS = (("default allocator", None),
              ("glibc keeps freed memory", {"GLIBC_TUNABLES": REUSE_ENV}))


def load():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def median_ms(samples):
    return statistics.median(samples) * 1e3


def fwd_bwd(loss_fn, x):
    t = time.perf_counter()
    loss = loss_fn()
    (g,) = torch.autograd.grad(loss, x)
    elapsed = time.perf_counter() - t
    del g, loss
    return elapsed


def child_ce(args):
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    out = {}
    for name, dtype in (("f32", torch.float32), ("bf16", torch.bfloat16)):
        x = (torch.randn(N, V, generator=gen) * 2).to(dtype).requires_grad_()
        y = torch.randint(0, V, (N,), generator=gen)
        y[torch.rand(N, generator=gen) < 0.1] = -100
        d = float((y != -100).sum())
        paths = {
            "torch": lambda: F.cross_entropy(x, y, ignore_index=-100),
            "gradsum": lambda: gt.cross_entropy(x, y, d),
        }
        # The two losses and gradients agree (to the dtype's rounding).
        lt, lg = paths["torch"](), paths["gradsum"]()
        (gt_, ) = torch.autograd.grad(lt, x)
        (gg, ) = torch.autograd.grad(lg, x)
        diff = float((gt_.float() - gg.float()).abs().max())
        del gt_, gg
        rounds = {k: [] for k in paths}
        for _ in range(args.rounds):
            for k, fn in paths.items():
                rounds[k].append(statistics.median(fwd_bwd(fn, x) for _ in range(args.iters)))
        kernel = [gt._C._cross_entropy_kernel_seconds_per_call(x.detach(), y, d, args.iters)
                  for _ in range(args.rounds)]
        out[name] = {"torch_ms": median_ms(rounds["torch"]),
                     "gradsum_ms": median_ms(rounds["gradsum"]),
                     "kernel_ms": median_ms(kernel),
                     "torch_rounds_ms": [r * 1e3 for r in rounds["torch"]],
                     "gradsum_rounds_ms": [r * 1e3 for r in rounds["gradsum"]],
                     "loss_diff": abs(lt.item() - lg.item()), "grad_max_diff": diff}
        del x, lt, lg
        gc.collect()
    print(json.dumps(out))


def child_policy(args):
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(3)
    out = {}
    for name, dtype in (("f32", torch.float32), ("bf16", torch.bfloat16)):
        x = (torch.randn(PN, V, generator=gen) * 2).to(dtype).requires_grad_()
        y = torch.randint(0, V, (PN,), generator=gen)
        y[torch.rand(PN, generator=gen) < 0.1] = -100
        n = float((y != -100).sum())
        with torch.no_grad():  # ratios and KL around their usual values
            logp = torch.log_softmax(x.float(), -1).gather(-1, y.clamp(min=0)[:, None])[:, 0]
        old = logp + torch.randn(PN, generator=gen) * 0.3
        ref = logp + torch.randn(PN, generator=gen) * 0.3
        adv = torch.randn(PN, generator=gen)
        iw = torch.rand(PN, generator=gen) * 2
        del logp

        def policy():
            return gt.policy_loss(x, y, old, adv, n, is_weights=iw, ref_logprob=ref,
                                  kl_coef=0.001)[0]

        paths = {"ce": lambda: gt.cross_entropy(x, y, n), "policy": policy}
        clip = gt.policy_loss(x.detach(), y, old, adv, n, is_weights=iw, ref_logprob=ref,
                              kl_coef=0.001)[1]["clip_count"] / n
        rounds = {k: [] for k in paths}
        for _ in range(args.rounds):
            for k, fn in paths.items():
                rounds[k].append(statistics.median(fwd_bwd(fn, x) for _ in range(args.iters)))
        out[name] = {"ce_ms": median_ms(rounds["ce"]), "policy_ms": median_ms(rounds["policy"]),
                     "ce_rounds_ms": [r * 1e3 for r in rounds["ce"]],
                     "policy_rounds_ms": [r * 1e3 for r in rounds["policy"]],
                     "clip_fraction": clip}
        del x
        gc.collect()
    print(json.dumps(out))


def rss_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def child_memory(args):
    torch.set_num_threads(args.threads)

    def make(n, dm, v):
        gen = torch.Generator().manual_seed(1)
        hidden = torch.randn(n, dm, generator=gen).requires_grad_()
        weight = (torch.randn(v, dm, generator=gen) * 0.05).requires_grad_()
        labels = torch.randint(0, v, (n,), generator=gen)
        return hidden, weight, labels

    def run(hidden, weight, labels):
        if args.child == "memory_torch":
            loss = F.cross_entropy(hidden @ weight.t(), labels, reduction="sum") / labels.numel()
        else:
            loss = gt.linear_cross_entropy(hidden, weight, labels, float(labels.numel()))
        return loss, torch.autograd.grad(loss, [hidden, weight])

    run(*make(64, DM, 1024))  # warm-up: thread pools, BLAS buffers
    hidden, weight, labels = make(N, DM, V)
    gc.collect()
    before = rss_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    t = time.perf_counter()
    loss, grads = run(hidden, weight, labels)
    elapsed = time.perf_counter() - t
    peak = rss_kib("VmHWM")
    print(json.dumps({"extra_mib": (peak - before) / 1024, "seconds": elapsed,
                      "loss": loss.item(), "grad_mib": sum(g.numel() * 4 for g in grads) / 2**20,
                      "logits_mib": N * V * 4 / 2**20}))


def child_overhead(args):
    print(json.dumps(overhead(args)))


def overhead(args):
    torch.set_num_threads(1)
    rows = []
    for n, v in ((8, 128), (64, 1024), (256, 4096)):
        gen = torch.Generator().manual_seed(2)
        x = torch.randn(n, v, generator=gen).requires_grad_()
        y = torch.randint(0, v, (n,), generator=gen)
        d = float(n)
        iters = max(50, int(2e6 / (n * v)))

        def per_call(fn):
            for _ in range(10):  # warm-up
                torch.autograd.grad(fn(), x)
            t = time.perf_counter()
            for _ in range(iters):
                loss = fn()
                torch.autograd.grad(loss, x)
            return (time.perf_counter() - t) / iters

        def forward_only():
            t = time.perf_counter()
            with torch.no_grad():
                for _ in range(iters):
                    gt.cross_entropy(x, y, d)
            return (time.perf_counter() - t) / iters

        op, fwd, torch_ce, kernel = [], [], [], []
        for _ in range(args.rounds + 2):
            op.append(per_call(lambda: gt.cross_entropy(x, y, d)))
            fwd.append(forward_only())
            torch_ce.append(per_call(lambda: F.cross_entropy(x, y)))
            kernel.append(gt._C._cross_entropy_kernel_seconds_per_call(x.detach(), y, d, iters))
        # The best round: a per-call cost that interference from other processes only adds to.
        op_us, kernel_us = min(op) * 1e6, min(kernel) * 1e6
        rows.append((n, v, op_us, kernel_us, op_us - kernel_us, min(fwd) * 1e6,
                     min(torch_ce) * 1e6))
    return rows


def run_child(kind, args, env_extra=None):
    env = dict(os.environ)
    env.update(env_extra or {})
    cmd = [sys.executable, __file__, "--child", kind, "--threads", str(args.threads),
           "--rounds", str(args.rounds), "--iters", str(args.iters)]
    res = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--skip", default="", help="comma list of ce,memory,overhead,policy")
    args = parser.parse_args()
    if args.child == "ce":
        return child_ce(args)
    if args.child in ("memory_torch", "memory_gradsum"):
        return child_memory(args)
    if args.child == "overhead":
        return child_overhead(args)
    if args.child == "policy":
        return child_policy(args)
    skip = set(args.skip.split(","))
    print(f"load average at start: {load()}  (torch {torch.__version__}, threads "
          f"{args.threads}, rounds {args.rounds} x iters {args.iters})", flush=True)
    if "ce" not in skip:
        print(f"\n1. CE forward + backward, {N} x {V}, {args.threads} threads "
              "(median ms; ratio = torch / gradsum)")
        for alloc, env in ALLOCATORS:
            res = run_child("ce", args, env)
            for dtype, r in res.items():
                print(f"  {alloc:25s} {dtype:4s}: torch {r['torch_ms']:8.1f}  gradsum op "
                      f"{r['gradsum_ms']:7.1f}  kernel alone {r['kernel_ms']:6.1f}  ratio "
                      f"{r['torch_ms'] / r['gradsum_ms']:5.1f}x  (rounds torch "
                      f"{[round(t) for t in r['torch_rounds_ms']]}, gradsum "
                      f"{[round(t) for t in r['gradsum_rounds_ms']]}; max |grad diff| "
                      f"{r['grad_max_diff']:.1e}, load {load()})", flush=True)
    if "memory" not in skip:
        print(f"\n2. Peak memory, N {N}, Dm {DM}, V {V} (extra resident MiB over the inputs)")
        mem = {k: run_child("memory_" + k, args) for k in ("torch", "gradsum")}
        for k, r in mem.items():
            print(f"  {k:8s}: +{r['extra_mib']:7.0f} MiB peak ({r['grad_mib']:.0f} MiB of it the "
                  f"two gradients; one [N, V] fp32 logits = {r['logits_mib']:.0f} MiB), "
                  f"{r['seconds']:.2f} s, loss {r['loss']:.6f}")
        print(f"  gradsum / torch peak: {mem['gradsum']['extra_mib'] / mem['torch']['extra_mib']:.3f}"
              f"  (load {load()})", flush=True)
    if "overhead" not in skip:
        print(f"\n3. Per-call overhead, 1 thread (us per call, best of {args.rounds + 2} rounds)")
        for alloc, env in ALLOCATORS:
            for n, v, op, kernel, extra, fwd, torch_us in run_child("overhead", args, env):
                print(f"  {alloc:25s} {n:4d} x {v:5d}: gradsum op (fwd + autograd.grad) "
                      f"{op:7.1f}  C++ kernel alone {kernel:7.1f}  overhead {extra:6.1f}  (op "
                      f"forward only, no_grad {fwd:6.1f}; torch F.cross_entropy fwd + grad "
                      f"{torch_us:7.1f})", flush=True)
    if "policy" not in skip:
        print(f"\n4. Policy loss against CE, forward + backward, {PN} x {V}, {args.threads} "
              "threads, default allocator (median ms; ratio = policy / CE)")
        for dtype, r in run_child("policy", args).items():
            print(f"  {dtype:4s}: CE op {r['ce_ms']:7.1f}  policy op {r['policy_ms']:7.1f}  ratio "
                  f"{r['policy_ms'] / r['ce_ms']:5.2f}x  (rounds CE "
                  f"{[round(t, 1) for t in r['ce_rounds_ms']]}, policy "
                  f"{[round(t, 1) for t in r['policy_rounds_ms']]}; clip fraction "
                  f"{r['clip_fraction']:.2f}, load {load()})", flush=True)
    print(f"\nload average at end: {load()}")


if __name__ == "__main__":
    main()
