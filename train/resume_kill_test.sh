#!/usr/bin/env bash
# kill -9 during training, then --resume, continues bit-exactly:
#   resume_kill_test.sh MOE_LM_BINARY
# An uninterrupted run and an interrupted-then-resumed run must log the same losses and
# gradient norms at every step, and end with byte-identical checkpoint shards.
set -euo pipefail
bin="$1"
tmp="${TEST_TMPDIR:-$(mktemp -d)}/resume_kill"
rm -rf "$tmp"
mkdir -p "$tmp"
steps=300
common=(--world=2 --ep=2 --grad_acc=2 --dim=8 --expert_dim=8 --layers=2 --experts=4
        --seq_len=32 --max_doc_len=24 --micro_batch=2 --steps=${steps} --checkpoint_every=5)
final=$(printf "step-%08d" ${steps})

"$bin" "${common[@]}" --checkpoint_dir="$tmp/ref_ckpt" --metrics="$tmp/ref.jsonl" \
  > "$tmp/ref.log" 2>&1

"$bin" "${common[@]}" --checkpoint_dir="$tmp/ckpt" --metrics="$tmp/run.jsonl" \
  > "$tmp/run1.log" 2>&1 &
pid=$!
for _ in $(seq 1 12000); do  # up to 2 min on a loaded machine
  [ -f "$tmp/ckpt/step-00000010/checkpoint.json" ] && break
  sleep 0.01
done
kill -9 "$pid"
wait "$pid" && { echo "FAIL: the run was not killed"; exit 1; }
if [ -f "$tmp/ckpt/${final}/checkpoint.json" ]; then
  echo "FAIL: the run finished before the kill; nothing was resumed"
  exit 1
fi
echo "killed after $(grep -c '"step"' "$tmp/run.jsonl" || true) logged steps"
# The newest complete save, and a newer save that died before its commit marker (with the
# temporary file it was writing): --resume must take the former, say so, and clean up.
latest=$(ls -d "$tmp"/ckpt/step-*/checkpoint.json | sort | tail -1)
latest_step=$(basename "$(dirname "$latest")" | sed 's/^step-0*//')
mkdir -p "$tmp/ckpt/step-00000299"
echo "half a shard" > "$tmp/ckpt/step-00000299/rank-00001.safetensors.tmp.12345.0"

"$bin" "${common[@]}" --checkpoint_dir="$tmp/ckpt" --metrics="$tmp/run.jsonl" --resume \
  > "$tmp/run2.log" 2>&1

# Deterministic fields of each step's JSONL record (timings dropped), last record per step.
deterministic() {
  sed -e 's/,"step_s".*$//' "$1" | tac | awk -F'[:,]' '!seen[$2]++' | sort -t: -k2,2n
}
deterministic "$tmp/ref.jsonl" > "$tmp/ref.txt"
deterministic "$tmp/run.jsonl" > "$tmp/run.txt"
if [ "$(wc -l < "$tmp/ref.txt")" -ne "${steps}" ]; then
  echo "FAIL: reference logged $(wc -l < "$tmp/ref.txt") steps"; exit 1
fi
if ! diff "$tmp/ref.txt" "$tmp/run.txt" > "$tmp/diff.txt"; then
  echo "FAIL: resumed run differs from the uninterrupted one:"; head -20 "$tmp/diff.txt"; exit 1
fi
for r in 0 1; do
  f=$(printf "rank-%05d.safetensors" $r)
  cmp "$tmp/ref_ckpt/${final}/$f" "$tmp/ckpt/${final}/$f" \
    || { echo "FAIL: final checkpoint shard $f differs"; exit 1; }
done
grep -q "^resumed from step ${latest_step} of run [0-9a-f]\{16\} in $tmp/ckpt/step-0*${latest_step} (skipped [0-9]* incomplete newer save(s), the newest step 299" "$tmp/run2.log" \
  || { echo "FAIL: no resume line naming step ${latest_step} and the skipped save:"; head -5 "$tmp/run2.log"; exit 1; }
if [ -e "$tmp/ckpt/step-00000299/rank-00001.safetensors.tmp.12345.0" ]; then
  echo "FAIL: the interrupted save's temporary file was not removed"; exit 1
fi
# Every save of both runs records the same run id (kept across the resume).
ids=$(grep -ho '"run_id":"[0-9a-f]*"' "$tmp"/ckpt/step-*/checkpoint.json | sort -u | wc -l)
[ "$ids" -eq 1 ] || { echo "FAIL: ${ids} run ids in the checkpoints, expected 1"; exit 1; }
echo "PASS: ${steps} steps identical after kill -9 and --resume"
