#!/usr/bin/python3
"""Draws moe_lm --metrics JSONL files as one PNG (issue 49): runs overlaid for comparison.

  ./bazelw run //tools:plot_metrics -- --output=run.png A.jsonl [B.jsonl ...]

Panels: training CE (and the held-out CE where evaluated) against consumed tokens, with the
corpus floors (the first run's entropy_floor / context_floor fields, where its corpus
states them, or --floor=NAME=VALUE); the learning rate; the gradient norm; tokens/s and MFU; the exposed-communication
share of step time. Lines of one file share a colour; the legend names the files.
Debian's python3-matplotlib (./bazelw installs it), no display needed (Agg).
"""
import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read(path):
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                sys.exit(f"plot_metrics: {path}:{n}: not a JSON line ({e})")
    if not rows:
        sys.exit(f"plot_metrics: {path}: no step records")
    return rows


def col(rows, key, default=0.0):
    return [float(r.get(key, default)) for r in rows]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", required=True, help="the PNG to write")
    p.add_argument("--floor", action="append", default=[],
                   help="NAME=VALUE: a horizontal line on the CE panel (nats/token)")
    p.add_argument("--title", default="", help="figure title")
    p.add_argument("files", nargs="+", help="--metrics JSONL files")
    a = p.parse_args()
    floors = []
    for f in a.floor:
        name, _, value = f.partition("=")
        try:
            floors.append((name, float(value)))
        except ValueError:
            sys.exit(f"plot_metrics: --floor={f}: want NAME=VALUE with a number")
    runs = [(os.path.basename(path), read(path)) for path in a.files]
    if not floors:
        # The floors the first run's corpus states (its records' entropy_floor and
        # context_floor), unless given by hand.
        for key, name in (("entropy_floor", "per-token floor"), ("context_floor", "context floor")):
            if key in runs[0][1][0]:
                floors.append((name, float(runs[0][1][0][key])))

    fig, ax = plt.subplots(2, 3, figsize=(15, 8))
    ce, lr, gn = ax[0]
    tps, mfu, exposed = ax[1]
    for i, (name, rows) in enumerate(runs):
        c = f"C{i}"
        # Consumed tokens: the field, or the running sum of routed tokens (older files).
        if "consumed_tokens" in rows[0]:
            x = col(rows, "consumed_tokens")
        else:
            x, total = [], 0.0
            for r in rows:
                total += float(r["routed_tokens"])
                x.append(total)
        ce.plot(x, col(rows, "ce"), color=c, lw=1, label=f"{name} train")
        ev = [(xi, r["eval_ce"]) for xi, r in zip(x, rows) if "eval_ce" in r]
        if ev:
            ce.plot(*zip(*ev), "o--", color=c, ms=3, lw=1, label=f"{name} eval")
        steps = col(rows, "step")
        lr.plot(steps, col(rows, "lr"), color=c, label=name)
        gn.plot(steps, col(rows, "grad_norm"), color=c, lw=0.8, label=name)
        tps.plot(steps, col(rows, "tokens_per_s"), color=c, lw=0.8, label=name)
        if "mfu" in rows[0]:
            mfu.plot(steps, [100 * v for v in col(rows, "mfu")], color=c, lw=0.8, label=name)
        share = [100 * r["comm_exposed_s"] / r["step_s"] if r["step_s"] > 0 else 0 for r in rows]
        exposed.plot(steps, share, color=c, lw=0.8, label=name)
    for j, (name, value) in enumerate(floors):
        ce.axhline(value, color="k", ls=[":", "--", "-."][j % 3], lw=1, label=f"{name} {value:g}")
    ce.set(xlabel="tokens", ylabel="CE (nats/token)", title="cross-entropy")
    lr.set(xlabel="step", ylabel="lr", title="learning rate")
    gn.set(xlabel="step", ylabel="norm", title="gradient norm (before clipping)")
    tps.set(xlabel="step", ylabel="tokens/s", title="throughput")
    mfu.set(xlabel="step", ylabel="%", title="MFU (model FLOPs / peak)")
    exposed.set(xlabel="step", ylabel="% of step time", title="exposed communication")
    for axis in ax.flat:
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    if a.title:
        fig.suptitle(a.title)
    fig.tight_layout()
    fig.savefig(a.output, dpi=80)
    shown = ", ".join(f"{name} {value:g}" for name, value in floors) or "none"
    print(f"plot_metrics: wrote {a.output} ({len(runs)} run(s); floors: {shown})")


if __name__ == "__main__":
    main()
