#!/usr/bin/env bash
# Issue 50, items 4 and 5, at the moe_lm command line: a float value its fp32 use cannot
# hold, a value the configuration would ignore, an --eval_data file and an MTP depth the
# documents cannot train are refused at start-up (exit 1) naming the field and the value;
# a resume says when it drops the checkpoint's expert bias and when the learning-rate
# schedule changed.
#   moe_lm_ignored_input_test.sh MOE_LM_BINARY
set -uo pipefail
bin="$1"
tmp="${TEST_TMPDIR:-$(mktemp -d)}/ignored"
rm -rf "$tmp"; mkdir -p "$tmp"
fail() { echo "FAIL: $*"; exit 1; }
tiny=(--world=2 --ep=2 --grad_acc=1 --dim=8 --expert_dim=8 --experts=4 --seq_len=32
      --max_doc_len=24 --micro_batch=2)

expect_error() {  # expect_error "substring" args...
  local want="$1"; shift
  timeout 60 "$bin" "${tiny[@]}" "$@" > "$tmp/out.txt" 2>&1
  local rc=$?
  [ "$rc" -eq 1 ] || fail "moe_lm $* exited $rc, expected 1: $(cat "$tmp/out.txt")"
  grep -qF -- "$want" "$tmp/out.txt" || fail "moe_lm $*: no '$want' in: $(cat "$tmp/out.txt")"
}

# Item 4: values that passed validation and overflowed in fp32 later.
expect_error "--logit_softcap: loss.logit_softcap=1e+300: must be at most 1e+30" --logit_softcap=1e300 --steps=2
expect_error "--expert_bias_speed: loss.expert_bias_speed=1e+39: times optim.steps=2 must be at most" \
  --expert_bias_speed=1e39 --steps=2
expect_error "--expert_bias_speed: loss.expert_bias_speed=3e+38: times optim.steps=2 must be at most" \
  --expert_bias_speed=3e38 --steps=2

# Item 5: the attention fields without attention.
expect_error "--heads: model.heads=3: is not used with model.attention=none" \
  --attention=none --heads=3 --kv_heads=2 --rope_theta=nan --steps=1
expect_error "--rope_theta: model.rope_theta=nan: is not used with model.attention=none" \
  --attention=none --rope_theta=nan --steps=1

# --eval_data: only with --data and --eval_every; its own errors; MTP depths that train.
printf 'a training document of some length\nand another training document here\n' > "$tmp/train.txt"
: > "$tmp/empty.txt"
expect_error "--eval_data: data.eval_path=$tmp/nonexistent.txt: is read only with data.path (--data)" \
  --eval_data="$tmp/nonexistent.txt" --eval_every=1 --steps=1
expect_error "--eval_data: data.eval_path=$tmp/train.txt: is read only with log.eval_every > 0" \
  --data="$tmp/train.txt" --eval_data="$tmp/train.txt" --steps=1
expect_error "--eval_data=$tmp/nonexistent.txt" \
  --data="$tmp/train.txt" --eval_data="$tmp/nonexistent.txt" --eval_every=1 --steps=1
grep -qF -- "--data=$tmp/nonexistent.txt" "$tmp/out.txt" && fail "labelled --data: $(cat "$tmp/out.txt")"
expect_error "--eval_data=$tmp/empty.txt: file is empty" \
  --data="$tmp/train.txt" --eval_data="$tmp/empty.txt" --eval_every=1 --steps=1
expect_error "--mtp_depth: model.mtp_depth=23: must be at most data.max_doc_len - 2 = 22" --mtp_depth=23 --steps=1
# A line's document holds its newline: 7 tokens here.
printf 'abcdef\nghijkl\n' > "$tmp/short.txt"
expect_error "model.mtp_depth=6: must be at most 5, the longest document of --data=$tmp/short.txt (7 tokens)" \
  --data="$tmp/short.txt" --mtp_depth=6 --mtp_scale=1 --steps=1
timeout 60 "$bin" "${tiny[@]}" --data="$tmp/short.txt" --mtp_depth=5 --mtp_scale=1 --steps=1 \
  > "$tmp/mtp5.txt" 2>&1 || fail "--mtp_depth=5 on 7-token documents: $(cat "$tmp/mtp5.txt")"
timeout 60 "$bin" "${tiny[@]}" --data="$tmp/train.txt" --eval_data="$tmp/train.txt" --eval_every=1 \
  --steps=1 > "$tmp/eval.txt" 2>&1 || fail "--eval_data run: $(cat "$tmp/eval.txt")"

# A resume with --expert_bias_speed=0 drops the checkpoint's bias, and says so.
timeout 60 "$bin" "${tiny[@]}" --steps=2 --expert_bias_speed=0.01 --checkpoint_dir="$tmp/bias" \
  > "$tmp/bias1.txt" 2>&1 || fail "bias run: $(cat "$tmp/bias1.txt")"
timeout 60 "$bin" "${tiny[@]}" --steps=3 --expert_bias_speed=0 --checkpoint_dir="$tmp/bias" --resume \
  > "$tmp/bias2.txt" 2>&1 || fail "bias resume: $(cat "$tmp/bias2.txt")"
grep -q "^resumed from step 2 .*the checkpoint's expert bias is dropped: loss.expert_bias_speed=0" \
  "$tmp/bias2.txt" || fail "no dropped bias in the resume line: $(grep resumed "$tmp/bias2.txt")"
# The model held none after the resume: its checkpoint (the commit marker's extra) has none.
has_bias() { python3 -c 'import json,sys; print("expert_bias" in json.load(open(sys.argv[1]))["extra"])' "$1"; }
[ "$(has_bias "$tmp/bias/step-00000002/checkpoint.json")" = True ] || fail "the first run saved no bias"
[ "$(has_bias "$tmp/bias/step-00000003/checkpoint.json")" = False ] \
  || fail "the resumed run (--expert_bias_speed=0) still holds the checkpoint's bias"

# A resume that moves the cosine schedule names the change.
timeout 60 "$bin" "${tiny[@]}" --steps=3 --warmup_steps=1 --lr_decay=cosine \
  --checkpoint_dir="$tmp/cos" > "$tmp/cos1.txt" 2>&1 || fail "cosine run: $(cat "$tmp/cos1.txt")"
timeout 60 "$bin" "${tiny[@]}" --steps=6 --warmup_steps=1 --lr_decay=cosine \
  --checkpoint_dir="$tmp/cos" --resume > "$tmp/cos2.txt" 2>&1 || fail "cosine resume: $(cat "$tmp/cos2.txt")"
grep -q "^resumed from step 3 .*the learning-rate schedule changed (optim.steps 3 -> 6 under optim.lr_decay=cosine, which decays to optim.min_lr at optim.steps): step 4's lr is " \
  "$tmp/cos2.txt" || fail "no schedule change in the resume line: $(grep resumed "$tmp/cos2.txt")"
# The constant schedule does not change with more steps: nothing said.
timeout 60 "$bin" "${tiny[@]}" --steps=2 --checkpoint_dir="$tmp/const" > "$tmp/c1.txt" 2>&1 \
  || fail "constant run: $(cat "$tmp/c1.txt")"
timeout 60 "$bin" "${tiny[@]}" --steps=4 --checkpoint_dir="$tmp/const" --resume > "$tmp/c2.txt" 2>&1 \
  || fail "constant resume: $(cat "$tmp/c2.txt")"
grep -q "learning-rate schedule" "$tmp/c2.txt" && fail "constant schedule named: $(grep resumed "$tmp/c2.txt")"
echo PASS
