#!/usr/bin/env bash
# moe_lm across a throttled link between two simulated hosts (issue 36 item 5;
# testing/simhosts.sh, docs/MULTIHOST.md; results in docs/BENCHMARKS.md "Across a throttled
# link"). Needs root (network namespaces) and a built binary:
#   flock -o /tmp/gradsum-build.lock ./bazelw build -c opt //train:moe_lm
#   bench/multihost_bench.sh [OUT_DIR]
# For each link rate (tc tbf on both directions of every link, RATES / BURSTS) and each
# sharding (SHARDINGS), 2 hosts x 2 ranks run
#   moe_lm --backend=mpi --world=4 --ep=2 --layers=8 --sharding=S (other flags default;
#   hsdp with --shard_group=2: a host's ranks shard, the two hosts replicate)
# twice: STEPS_SHORT and STEPS_LONG steps. Reported per (rate, sharding):
# - from the long run's --metrics (rank 0, on host 1), the mean over the steps after the
#   first DROP: step_s, tokens_per_s, comm_s, comm_exposed_s, exposed_*_s, *_calls;
# - the bytes host 2's interface received and sent per step, as the difference of the two
#   runs' counter deltas divided by the difference of their steps (start-up, the warm-up
#   steps and the end cancel), and the long run's delta / STEPS_LONG beside it;
# - the bytes the design predicts per step, from the model shape in the binary's banner,
#   under two assumptions about Open MPI's algorithms (see predict() below).
# Every mpirun is bounded by GSH_LIMIT_S; simhosts removes the namespaces on exit or signal.
# Variables: RATES ("10gbit 1gbit"; "none" = no tbf), BURSTS (one per rate; default 2560kb
# for 10gbit, 256kb otherwise: about 2 ms at the rate), SHARDINGS ("fsdp replicated hsdp"),
# STEPS_SHORT (4), STEPS_LONG (12), DROP (2), EXTRA_FLAGS (appended to every run),
# MOE_LM (bazel-bin/train/moe_lm), GSH_LIMIT_S (180 s per mpirun).
set -uo pipefail
cd "$(dirname "$0")/.."
bin="$(realpath "${MOE_LM:-bazel-bin/train/moe_lm}")"
[[ -x "$bin" ]] || { echo "no binary $bin: build //train:moe_lm first" >&2; exit 1; }
out="${1:-$(mktemp -d /tmp/multihost_bench.XXXXXX)}"
mkdir -p "$out"
source testing/simhosts.sh
simhosts_require_netns
GSH_LIMIT_S="${GSH_LIMIT_S:-180}"
read -ra rates <<< "${RATES:-10gbit 1gbit}"
read -ra bursts <<< "${BURSTS:-}"
read -ra shardings <<< "${SHARDINGS:-fsdp replicated hsdp}"
short="${STEPS_SHORT:-4}" long="${STEPS_LONG:-12}" drop="${DROP:-2}"
read -ra extra <<< "${EXTRA_FLAGS:-}"
((long > short && long > drop)) || { echo "need STEPS_LONG > STEPS_SHORT and > DROP" >&2; exit 2; }

echo "multihost_bench: $(date -u '+%F %H:%M:%S') UTC, $(uptime | sed 's/.*load/load/'), out $out"
echo "binary: $bin; git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"

# one RATE_TAG SHARDING STEPS: one two-host run; appends "tag sharding steps rx tx rc secs"
# to $out/runs.tsv.
one() {
  local tag="$1" sh="$2" steps="$3" name="$1.$2.$3" rx0 tx0 rx1 tx1 rc t0
  local group=()
  [[ "$sh" == hsdp ]] && group=(--shard_group=2)
  read -r rx0 tx0 <<< "$(simhosts_link_bytes 2)"
  t0=$EPOCHREALTIME
  simhosts_mpirun -np 4 --map-by ppr:2:node "$bin" --backend=mpi --world=4 --ep=2 \
    --layers=8 --sharding="$sh" "${group[@]}" --steps="$steps" --timeout_s=120 \
    --metrics="$out/$name.jsonl" "${extra[@]}" > "$out/$name.log" 2>&1 &
  wait $!
  rc=$?
  read -r rx1 tx1 <<< "$(simhosts_link_bytes 2)"
  local secs; secs=$(awk -v a="$EPOCHREALTIME" -v b="$t0" 'BEGIN { printf "%.1f", a - b }')
  echo "  $name: exit $rc, ${secs} s, host 2 received $((rx1 - rx0)) B, sent $((tx1 - tx0)) B"
  [[ $rc -eq 0 ]] || tail -5 "$out/$name.log"
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$tag" "$sh" "$steps" "$((rx1 - rx0))" \
    "$((tx1 - tx0))" "$rc" "$secs" >> "$out/runs.tsv"
}

: > "$out/runs.tsv"
for i in "${!rates[@]}"; do
  rate="${rates[$i]}"
  burst="${bursts[$i]:-}"
  [[ -n "$burst" ]] || { [[ "$rate" == 10gbit ]] && burst=2560kb || burst=256kb; }
  if [[ "$rate" == none ]]; then
    echo "link: no tbf ($(uptime | sed 's/.*load/load/'))"
    simhosts_up 2 || { echo "could not bring the hosts up" >&2; exit 1; }
  else
    echo "link: tbf rate $rate burst $burst ($(uptime | sed 's/.*load/load/'))"
    simhosts_up 2 "$rate" "$burst" || { echo "could not bring the hosts up" >&2; exit 1; }
  fi
  for sh in "${shardings[@]}"; do
    one "$rate" "$sh" "$short"
    one "$rate" "$sh" "$long"
  done
  simhosts_cleanup
done

echo "done: $(date -u '+%F %H:%M:%S') UTC, $(uptime | sed 's/.*load/load/')"
python3 - "$out" "$short" "$long" "$drop" <<'PY'
import json, re, sys
out, short, long_, drop = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
runs = {}
for line in open(f"{out}/runs.tsv"):
    tag, sh, steps, rx, tx, rc, secs = line.split("\t")
    runs[(tag, sh, int(steps))] = (int(rx), int(tx), int(rc), float(secs))

def banner(path):
    for line in open(path):
        m = re.search(r"V=(\d+) D=(\d+) L=(\d+) E=(\d+) K=(\d+) H=(\d+), attention (\d+) heads \((\d+) kv\), (\d+) parameters; mesh F=(\d+) x P=(\d+), G=(\d+)", line)
        if m: return dict(zip("V D L E K H heads kv params F P G".split(), map(int, m.groups())))
    return None

def predict(b, sharding):
    """Bytes per step into (rx) and out of (tx) host 2, fp32 (4 bytes), world 4 = ranks 0,1
    on host 1 and 2,3 on host 2, EP groups {0,1} {2,3} (contiguous, so the EP all-to-alls
    never cross the link), expert data-parallel groups {0,2} {1,3} (always cross it).
    Units: emb (V*D; its backward reads no parameters: gathered once), each layer's dense
    group (attention, norms, router; world) and its experts (E/P experts of my slot; edp),
    head (final norm + out; the turn stage: gathered once). fsdp, reshard_after_forward and
    reduce_every_micro_batch (the defaults): per micro-batch every unit is gathered in
    forward and the layers again in backward, and every unit's gradient reduce-scattered;
    replicated: one all-reduce per unit per step. Small all-reduces (loss, norms, counts)
    and TCP/IP headers are left out."""
    V, D, L, E, H, P, G = (b[k] for k in "V D L E H P G".split())
    hd = D // b["heads"]
    attn = D + D * D + 2 * D * b["kv"] * hd + D * D
    layer_dense = attn + D + D * E
    emb, head = V * D, D + D * V
    W_l = 4 * L * layer_dense                # bytes, gathered again in backward
    W_d = 4 * (emb + head) + W_l             # all world-sharded bytes
    W_x = 4 * L * (E // P) * 3 * D * H       # one slot's expert bytes
    assert (W_d + 2 * W_x) // 4 == b["params"], (W_d, W_x, b["params"])
    if sharding == "fsdp":
        # ring: a ring all-gather / reduce-scatter over 0-1-2-3 carries (n-1)/n of the buffer
        # over each of the links 1->2 and 3->0; an edp pair (n = 2) exchanges halves.
        ring = G * (0.75 * (W_d + W_l) + 2 * W_x + 0.75 * W_d + W_x)
        # libnbc (the async path every unit collective takes, MPI_I*): linear all-gather
        # (every rank sends its block to every other: W in and out of host 2 for a world
        # buffer W); reduce-scatter = binomial reduce to rank 0 then linear scatter: host 2
        # sends the full partial sum of ranks 2+3 (W) and gets its two blocks back (W/2);
        # over an edp pair each host-2 rank sends its whole slot buffer and gets half back.
        nbc_rx = G * ((W_d + W_l) + 2 * W_x + W_d / 2 + W_x)
        nbc_tx = G * ((W_d + W_l) + 2 * W_x + W_d + 2 * W_x)
        lower = G * (0.5 * (W_d + W_l) + 2 * W_x + 0.5 * W_d + W_x)
        return dict(ring=(ring, ring), nbc=(nbc_rx, nbc_tx), lower=(lower, lower))
    if sharding == "hsdp":
        # shard group = a host (--shard_group=2 = P): dense units shard over {0,1} and {2,3},
        # all-gathers and reduce-scatters never cross the link; the experts' shard group is
        # one rank (N / P = 1), so they are held whole and reduced locally. Once per step
        # (the last micro-batch) each rank all-reduces its accumulated shard with its
        # replica on the other host: the dense pairs {0,2} {1,3} W_d / 2 each, the expert
        # pairs W_x each. A two-rank all-reduce (libnbc's binomial reduce + broadcast, or a
        # ring) moves the buffer once each way; that is also the lower bound.
        one = W_d + 2 * W_x
        return dict(ring=(one, one), nbc=(one, one), lower=(one, one))
    # replicated: ring all-reduce 2 (n-1)/n per link. libnbc's in-place all-reduce is its
    # "binomial" one: a binomial reduce to rank 0 (1->0, 3->2, then 2->0: host 2 sends the
    # buffer once) and a binomial broadcast from 0 (0->1, 0->2, then 1->3: host 2 receives it
    # twice, since both its ranks get it from host 1). An edp pair exchanges the whole slot
    # buffer each way (any algorithm). The lower bound: each direction once.
    ring = 1.5 * W_d + 2 * W_x
    lower = W_d + 2 * W_x
    return dict(ring=(ring, ring), nbc=(2 * W_d + 2 * W_x, W_d + 2 * W_x), lower=(lower, lower))

keys = ["step_s", "tokens_per_s", "comm_s", "comm_exposed_s", "exposed_all_gather_s",
        "exposed_reduce_scatter_s", "exposed_all_reduce_s", "exposed_all_to_all_s",
        "exposed_other_s", "all_gather_calls", "reduce_scatter_calls", "all_reduce_calls",
        "all_to_all_calls", "other_calls"]
results = []
for (tag, sh, steps), (rx, tx, rc, secs) in runs.items():
    if steps != long_: continue
    rs = runs.get((tag, sh, short))
    name = f"{out}/{tag}.{sh}.{long_}"
    recs = [json.loads(l) for l in open(f"{name}.jsonl") if l.strip()] if rc == 0 else []
    kept = [r for r in recs if r["step"] > drop]
    mean = {k: sum(r.get(k, 0) for r in kept) / len(kept) for k in keys} if kept else {}
    b = banner(f"{name}.log")
    pred = predict(b, sh) if b else None
    res = dict(rate=tag, sharding=sh, rc=rc, steps=long_, mean_after=drop, metrics=mean,
               naive_rx=rx / long_, naive_tx=tx / long_, predicted=pred, banner=b)
    if rs and rs[2] == 0 and rc == 0:
        res["rx"] = (rx - rs[0]) / (long_ - short)
        res["tx"] = (tx - rs[1]) / (long_ - short)
    results.append(res)
json.dump(results, open(f"{out}/summary.json", "w"), indent=1)

MB = 1e6
print(f"\nmeans over steps {drop + 1}-{long_} (rank 0); bytes per step over host 2's link "
      f"(runs of {long_} minus {short} steps; in parentheses the {long_}-step run / {long_})")
print("| link | sharding | tokens/s | step s | comm s | exposed s (share) | exposed ag / rs / ar / a2a / other s | calls ag / rs / ar / a2a |")
print("|---|---|---|---|---|---|---|---|")
for r in results:
    m = r["metrics"]
    if not m:
        print(f"| {r['rate']} | {r['sharding']} | failed (exit {r['rc']}) | | | | | |"); continue
    share = m["comm_exposed_s"] / m["comm_s"] if m["comm_s"] else float("nan")
    print(f"| {r['rate']} | {r['sharding']} | {m['tokens_per_s']:.0f} | {m['step_s']:.3f} | "
          f"{m['comm_s']:.3f} | {m['comm_exposed_s']:.3f} ({share:.2f}) | "
          f"{m['exposed_all_gather_s']:.3f} / {m['exposed_reduce_scatter_s']:.3f} / "
          f"{m['exposed_all_reduce_s']:.3f} / {m['exposed_all_to_all_s']:.3f} / "
          f"{m['exposed_other_s']:.3f} | {m['all_gather_calls']:.0f} / "
          f"{m['reduce_scatter_calls']:.0f} / {m['all_reduce_calls']:.0f} / "
          f"{m['all_to_all_calls']:.0f} |")
print("\n| link | sharding | host 2 in, MB/step | out, MB/step | predicted libnbc in / out | ring in = out | lower bound | measured / libnbc (in, out) |")
print("|---|---|---|---|---|---|---|---|")
for r in results:
    p = r["predicted"]
    if "rx" not in r or not p:
        print(f"| {r['rate']} | {r['sharding']} | n/a | n/a | | | | |"); continue
    print(f"| {r['rate']} | {r['sharding']} | {r['rx'] / MB:.2f} ({r['naive_rx'] / MB:.2f}) | "
          f"{r['tx'] / MB:.2f} ({r['naive_tx'] / MB:.2f}) | {p['nbc'][0] / MB:.2f} / "
          f"{p['nbc'][1] / MB:.2f} | {p['ring'][0] / MB:.2f} | {p['lower'][0] / MB:.2f} | "
          f"{r['rx'] / p['nbc'][0]:.3f}, {r['tx'] / p['nbc'][1]:.3f} |")
fsdp = {r["rate"]: r for r in results if r["sharding"] == "fsdp" and "rx" in r}
for r in results:
    if r["sharding"] != "hsdp" or "rx" not in r or r["rate"] not in fsdp: continue
    f = fsdp[r["rate"]]
    m = r["metrics"]
    share = m["comm_exposed_s"] / m["comm_s"] if m.get("comm_s") else float("nan")
    print(f"hsdp / fsdp cross-host bytes at {r['rate']}: in {r['rx'] / f['rx']:.3f}, "
          f"out {r['tx'] / f['tx']:.3f} (target <= 0.5); hsdp exposed / comm {share:.2f} "
          f"(target <= 0.3 at 10gbit)")
PY
