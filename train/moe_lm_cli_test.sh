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
expect_error "parallelism.ep=2: must divide parallelism.world=3" --world=3
expect_error "model.top_k=9" --top_k=9
expect_error "model.vocab=300" --vocab=300
expect_error "parallelism.ep=3: must divide model.experts=8" --world=3 --ep=3
expect_error "model.dim=0" --dim=0
expect_error "sharding=zero" --sharding=zero
expect_error "ce_mode=mean" --ce_mode=mean
expect_error "parallelism.recompute=bogus: must be none, full or selective" --recompute=bogus
expect_error "backend=nccl" --backend=nccl --steps=1 --dim=8 --expert_dim=8
expect_error "precision.reproducible=true: is implemented for the CPU backends (thread, mpi) only, not comm.backend=nccl" \
  --reproducible --backend=nccl --steps=1
expect_error "precision.reproducible=true: reduces gradients exactly in integers" --reproducible \
  --reduce_dtype=bf16 --steps=1
expect_error "--config=/nonexistent.textproto" --config=/nonexistent.textproto
expect_error "--data=/nonexistent.txt" --data=/nonexistent.txt --steps=1

# --help lists the training flags with their descriptions.
"$bin" --help > "$tmp/help.txt" 2>&1
grep -q "Flags from train/config_flags.cc" "$tmp/help.txt" || fail "--help: no training flags: $(head -5 "$tmp/help.txt")"
grep -q -- "--lr_decay (constant (default) | cosine | linear" "$tmp/help.txt" || fail "--help: no --lr_decay"
grep -q -- "--save_on_signal" "$tmp/help.txt" || fail "--help: no --save_on_signal"

tiny=(--world=2 --ep=2 --grad_acc=2 --dim=8 --expert_dim=8 --experts=4 --seq_len=32
      --max_doc_len=24 --micro_batch=2)
"$bin" "${tiny[@]}" --steps=3 --log_every=1 --parity_check --metrics="$tmp/m.jsonl" > "$tmp/run.txt" 2>&1 \
  || fail "tiny run failed: $(cat "$tmp/run.txt")"
grep -q "entropy floor: " "$tmp/run.txt" || fail "no entropy floor line"
[ "$(grep -c '^step [ 0-9]*/3 | ce ' "$tmp/run.txt")" -eq 3 ] || fail "expected 3 step lines"
# --log_every=3 over 7 steps: the lines of steps 1, 3, 6 and 7; the JSONL keeps all 7.
"$bin" "${tiny[@]}" --steps=7 --log_every=3 --metrics="$tmp/every.jsonl" > "$tmp/every.txt" 2>&1 \
  || fail "--log_every run failed: $(cat "$tmp/every.txt")"
[ "$(grep -o '^step [ 0-9]*/7' "$tmp/every.txt" | tr -s ' ' | tr '\n' ',')" = "step 1/7,step 3/7,step 6/7,step 7/7," ] \
  || fail "--log_every=3: $(grep '^step ' "$tmp/every.txt")"
[ "$(wc -l < "$tmp/every.jsonl")" -eq 7 ] || fail "--log_every: the JSONL must keep every step"
expect_error "log.every=0: must be >= 1" --log_every=0
grep -q "parity PASSED" "$tmp/run.txt" || fail "parity did not pass"
grep -q "^summary: " "$tmp/run.txt" || fail "no summary"
# Full recomputation re-runs each layer's forward in backward: the parity check still passes.
"$bin" "${tiny[@]}" --steps=1 --parity_check --recompute=full > "$tmp/full.txt" 2>&1 \
  || fail "--recompute=full run failed: $(cat "$tmp/full.txt")"
grep -q "parity PASSED" "$tmp/full.txt" || fail "parity did not pass with --recompute=full"
# moe_lm does not link the fp64 reference: it hands --parity_check to moe_lm_parity beside
# it (the runs above); a moe_lm alone says where the check lives and trains nothing.
mkdir -p "$tmp/alone"
cp "$(readlink -f "$bin")" "$tmp/alone/moe_lm"
"$tmp/alone/moe_lm" "${tiny[@]}" --steps=1 --parity_check > "$tmp/alone.txt" 2>&1
[ $? -eq 1 ] || fail "moe_lm without moe_lm_parity beside it must exit 1: $(cat "$tmp/alone.txt")"
grep -q "FAILED_PRECONDITION: --parity_check runs in moe_lm_parity" "$tmp/alone.txt" \
  || fail "moe_lm alone: $(cat "$tmp/alone.txt")"
grep -q "^step " "$tmp/alone.txt" && fail "moe_lm alone trained: $(cat "$tmp/alone.txt")"
[ "$(wc -l < "$tmp/m.jsonl")" -eq 3 ] || fail "expected 3 JSONL records"
for key in '"step":3' '"ce":' '"z":' '"bal":' '"valid_tokens":' '"grad_norm":' '"comm_s":' '"comm_exposed_s":' \
    '"peak_unsharded_param_bytes":' '"full_param_bytes":' \
    '"peak_activation_bytes":'; do
  tail -1 "$tmp/m.jsonl" | grep -qF "$key" || fail "no $key in the metrics"
done
# Tools read the JSONL: every count is a JSON number (an int), every measure a float.
/usr/bin/python3 - "$tmp/m.jsonl" <<'EOF2' || fail "the metrics JSONL has the wrong types"
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    for k in ("step", "valid_tokens", "routed_tokens", "peak_unsharded_param_bytes", "full_param_bytes",
              "peak_activation_bytes", "all_reduce_calls", "all_to_all_calls"):
        assert type(r[k]) is int, (k, r[k])
    for k in ("ce", "z", "bal", "grad_norm", "comm_s", "step_s"):
        assert type(r[k]) is float, (k, r[k])
EOF2

# A --data text file (byte-level tokens) trains too.
for i in $(seq 1 200); do echo "the quick brown fox $i jumps over the lazy dog"; done \
  > "$tmp/corpus.txt"
"$bin" "${tiny[@]}" --steps=2 --data="$tmp/corpus.txt" > "$tmp/data.txt" 2>&1 \
  || fail "--data run failed: $(cat "$tmp/data.txt")"
grep -q "^step 2/2" "$tmp/data.txt" || fail "--data run logged no step 2"
# A file names no embedded corpus: an explicit --corpus beside it is refused.
expect_error "data.corpus=markov2 names an embedded corpus, but data.path=$tmp/corpus.txt trains on a file" \
  "${tiny[@]}" --steps=1 --data="$tmp/corpus.txt" --corpus=markov2

# A headerless uint16 token file (data/token_files.h) trains at a vocabulary above its largest
# id, split into documents at --eod_token; a smaller vocabulary and a torn file are refused.
python3 -c '
import struct, sys
ids = [(7 * i) % 999 + 1 if i % 23 else 0 for i in range(4000)]
open(sys.argv[1], "wb").write(struct.pack("<%dH" % len(ids), *ids))' "$tmp/tokens.u16"
"$bin" "${tiny[@]}" --steps=2 --data="$tmp/tokens.u16" --eod_token=0 --vocab=1000 \
  > "$tmp/tokens.txt" 2>&1 || fail "token-file run failed: $(cat "$tmp/tokens.txt")"
grep -q "^step 2/2" "$tmp/tokens.txt" || fail "token-file run logged no step 2"
expect_error "model.vocab=999: --data=$tmp/tokens.u16 (headerless token file, uint16 tokens) holds token id 999" \
  "${tiny[@]}" --steps=1 --data="$tmp/tokens.u16" --eod_token=0 --vocab=999
printf 'x' >> "$tmp/tokens.u16"
expect_error "$tmp/tokens.u16: end at byte offset 8001" \
  "${tiny[@]}" --steps=1 --data="$tmp/tokens.u16" --eod_token=0 --vocab=1000

# Config files: the sections, and the top-level fields of the layout before sections (with
# an enum quoted, as older files have it) give the same run; flags still override a file.
cat > "$tmp/sections.textproto" <<'EOF2'
model { dim: 8 expert_dim: 8 experts: 4 }
data { seq_len: 32 max_doc_len: 24 micro_batch: 2 }
parallelism { world: 2 ep: 2 grad_acc: 2 sharding: replicated }
optim { steps: 2 }
EOF2
cat > "$tmp/old_layout.textproto" <<'EOF2'
model { dim: 8 expert_dim: 8 experts: 4 }
data { seq_len: 32 max_doc_len: 24 micro_batch: 2 }
world: 2 ep: 2 grad_acc: 2 sharding: "replicated" steps: 3
EOF2
"$bin" --config="$tmp/sections.textproto" > "$tmp/sections.txt" 2>&1 \
  || fail "sections config failed: $(cat "$tmp/sections.txt")"
"$bin" --config="$tmp/old_layout.textproto" --steps=2 > "$tmp/old_layout.txt" 2>&1 \
  || fail "old-layout config failed: $(cat "$tmp/old_layout.txt")"
grep -q "replicated" "$tmp/old_layout.txt" || fail "old-layout config lost its sharding"
diff <(grep -o '^step.*| gnorm [0-9.]*' "$tmp/sections.txt") \
     <(grep -o '^step.*| gnorm [0-9.]*' "$tmp/old_layout.txt") \
  || fail "the old layout trained differently from the sections"
printf 'world: 2\nparallelism { world: 4 }\n' > "$tmp/both.textproto"
expect_error "world=2 and parallelism.world=4" --config="$tmp/both.textproto"

# Bad inputs found at start-up or during the run: status 1 and a message naming the value.
expect_error "--config=$tmp: is a directory; --config takes a regular file" --config="$tmp"
expect_error "--data=/dev/zero: is a character device; --data takes a regular file" \
  --data=/dev/zero "${tiny[@]}" --steps=1
# Sizes checked before anything is allocated, against overflow and the machine's memory.
expect_error "RESOURCE_EXHAUSTED: the run needs an estimated" --dim=100000000 --steps=1
expect_error "model.dim=1000000000" --dim=1000000000 --steps=1
expect_error "model.experts=2000000000" --experts=2000000000 --ep=1 --world=1 --steps=1
expect_error "model.layers=2000000000" --layers=2000000000 --steps=1
expect_error "data.micro_batch=2000000000 x data.seq_len=128" --micro_batch=2000000000 --steps=1
expect_error "grad_acc=2000000000" --grad_acc=2000000000 --steps=1
# Metrics to a device or a directory: refused at start-up, naming what it is (/dev/null,
# which discards the lines, is the one device --metrics takes).
expect_error "--metrics=/dev/full: is a character device; --metrics takes a regular file or /dev/null" \
  "${tiny[@]}" --steps=2 --metrics=/dev/full
expect_error "--metrics=$tmp: is a directory" "${tiny[@]}" --steps=1 --metrics="$tmp"
"$bin" "${tiny[@]}" --steps=1 --metrics=/dev/null > "$tmp/null.txt" 2>&1 \
  || fail "--metrics=/dev/null failed: $(cat "$tmp/null.txt")"
# Data that cannot train: no document with a token to predict. (A corpus with fewer documents
# than ranks trains: the sequence stream is global, data/packer.h.)
printf '\n\n\n\n' > "$tmp/no_pairs.txt"
expect_error "--data=$tmp/no_pairs.txt: no trainable token in its 4 documents" \
  "${tiny[@]}" --steps=1 --data="$tmp/no_pairs.txt"
# Both ranks fail at start-up: one message names both.
expect_error "start-up failed on ranks 0, 1 of 2" "${tiny[@]}" --steps=1 --data="$tmp/no_pairs.txt"
# A dump directory that cannot be created (a file is in the way) fails the run.
touch "$tmp/a_file"
expect_error "--dump_dir failed on ranks 0, 1 of 2" "${tiny[@]}" --steps=1 --dump_dir="$tmp/a_file/dump"
# Test-only fault hook: an exception escaping a rank is a clean error, not an abort.
GRADSUM_TEST_FAULT=throw:1:2 expect_error "INTERNAL: rank 1: uncaught exception: injected fault on rank 1 at step 2" \
  "${tiny[@]}" --steps=3 --timeout_s=5
# A rank-local failure on thread ranks reaches every rank at the step boundary.
GRADSUM_TEST_FAULT=fail:1:2 expect_error "step 2 failed on rank 1 of 2: INTERNAL: injected fault on rank 1 at step 2" \
  "${tiny[@]}" --steps=3
echo "PASS"
