#!/usr/bin/env bash
# The moe_lm binary's command line: bad configs fail at start (exit 1, message naming the
# field and value), a tiny run logs one line per step, writes --metrics JSONL and a
# summary, and --parity_check passes.
#   moe_lm_cli_test.sh MOE_LM_BINARY
set -uo pipefail
bin="$1"
tmp="${TEST_TMPDIR:-$(mktemp -d)}/cli"
rm -rf "$tmp"; mkdir -p "$tmp"
fail() { echo "FAIL: $*"; exit 1; }

expect_error() {  # expect_error "substring" args...
  local want="$1"; shift
  "$bin" "$@" > "$tmp/out.txt" 2>&1
  local rc=$?
  [ "$rc" -eq 1 ] || fail "moe_lm $* exited $rc, expected 1: $(cat "$tmp/out.txt")"
  grep -qF -- "$want" "$tmp/out.txt" || fail "moe_lm $*: no '$want' in: $(cat "$tmp/out.txt")"
}
expect_error "ep=2: must divide world=3" --world=3
expect_error "model.top_k=9" --top_k=9
expect_error "model.vocab=300" --vocab=300
expect_error "ep=3: must divide model.experts=8" --world=3 --ep=3
expect_error "model.dim=0" --dim=0
expect_error "sharding=zero" --sharding=zero
expect_error "ce_mode=mean" --ce_mode=mean
expect_error "backend=nccl" --backend=nccl --steps=1 --dim=8 --expert_dim=8
expect_error "--config=/nonexistent.textproto" --config=/nonexistent.textproto
expect_error "--data=/nonexistent.txt" --data=/nonexistent.txt --steps=1

tiny=(--world=2 --ep=2 --grad_acc=2 --dim=8 --expert_dim=8 --experts=4 --seq_len=32
      --max_doc_len=24 --micro_batch=2)
"$bin" "${tiny[@]}" --steps=3 --parity_check --metrics="$tmp/m.jsonl" > "$tmp/run.txt" 2>&1 \
  || fail "tiny run failed: $(cat "$tmp/run.txt")"
grep -q "entropy floor: " "$tmp/run.txt" || fail "no entropy floor line"
[ "$(grep -c '^step [ 0-9]*/3 | ce ' "$tmp/run.txt")" -eq 3 ] || fail "expected 3 step lines"
grep -q "parity PASSED" "$tmp/run.txt" || fail "parity did not pass"
grep -q "^summary: " "$tmp/run.txt" || fail "no summary"
[ "$(wc -l < "$tmp/m.jsonl")" -eq 3 ] || fail "expected 3 JSONL records"
for key in '"step":3' '"ce":' '"z":' '"bal":' '"valid_tokens":' '"grad_norm":' '"comm_s":' '"comm_exposed_s":' \
    '"peak_unsharded_param_bytes":' '"full_param_bytes":'; do
  tail -1 "$tmp/m.jsonl" | grep -qF "$key" || fail "no $key in the metrics"
done

# A --data text file (byte-level tokens) trains too.
for i in $(seq 1 200); do echo "the quick brown fox $i jumps over the lazy dog"; done \
  > "$tmp/corpus.txt"
"$bin" "${tiny[@]}" --steps=2 --data="$tmp/corpus.txt" > "$tmp/data.txt" 2>&1 \
  || fail "--data run failed: $(cat "$tmp/data.txt")"
grep -q "^step 2/2" "$tmp/data.txt" || fail "--data run logged no step 2"
echo "PASS"
