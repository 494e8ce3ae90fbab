#!/usr/bin/env bash
# //tools:plot_metrics draws two small runs (the second with eval_ce and no mfu, as older
# files are) into a PNG, and refuses a file that is not JSONL with its line number.
set -euo pipefail
tool="$TEST_SRCDIR/gradsum/tools/plot_metrics"
dir="$TEST_TMPDIR"
for s in 1 2 3; do
  echo "{\"step\":$s,\"ce\":$((7 - s)).5,\"lr\":0.01,\"grad_norm\":1.0,\"tokens_per_s\":3e4,\"routed_tokens\":3000,\"consumed_tokens\":$((s * 3000)),\"mfu\":0.3,\"comm_exposed_s\":0.01,\"step_s\":0.1}"
done >"$dir/a.jsonl"
for s in 1 2; do
  echo "{\"step\":$s,\"ce\":$((6 - s)).25,\"lr\":0.01,\"grad_norm\":0.5,\"tokens_per_s\":2e4,\"routed_tokens\":3100,\"comm_exposed_s\":0.0,\"step_s\":0.0,\"eval_ce\":4.5}"
done >"$dir/b.jsonl"
"$tool" --output="$dir/run.png" --floor=context=1.32 "$dir/a.jsonl" "$dir/b.jsonl"
head -c 8 "$dir/run.png" | od -An -c | grep -q "P   N   G" || { echo "not a PNG"; exit 1; }
grep -q . "$dir/run.png"
# Without --floor, the floors the first run's records state are drawn.
for s in 1 2; do
  echo "{\"step\":$s,\"ce\":$((7 - s)).5,\"lr\":0.01,\"grad_norm\":1.0,\"tokens_per_s\":3e4,\"routed_tokens\":3000,\"comm_exposed_s\":0.01,\"step_s\":0.1,\"entropy_floor\":2.9248,\"context_floor\":1.3224}"
done >"$dir/c.jsonl"
"$tool" --output="$dir/floors.png" "$dir/c.jsonl" >"$dir/out"
grep -q "floors: per-token floor 2.9248, context floor 1.3224" "$dir/out" || { cat "$dir/out"; exit 1; }
echo "not json" >"$dir/bad.jsonl"
if "$tool" --output="$dir/bad.png" "$dir/bad.jsonl" 2>"$dir/err"; then echo "accepted bad"; exit 1; fi
grep -q "bad.jsonl:1: not a JSON line" "$dir/err" || { cat "$dir/err"; exit 1; }
echo PASS
