#!/usr/bin/env bash
# --data_path (data/blend.h, SEMANTICS.md §11) through the moe_lm binary, on two Megatron
# datasets written here by a plain Python writer (independent of the C++ one):
# 1. --reproducible: world 1, thread world 4 (ep 2, micro_batch 1), Open MPI world 2 and SP 2
#    give byte-identical --export files and identical logged values, with --eval_every on
#    the validation part of --split.
# 2. Resume: 3 steps on world 2, resumed on Open MPI world 4 to step 8, ends with the bits of
#    the uninterrupted run; the same resume after one dataset's .bin changed is refused by the
#    checkpoint's data fingerprint.
# 3. Bad input: each refused with a message naming the value.
#   data_path_test.sh MOE_LM_BINARY MPIRUN_TEST_SH
set -euo pipefail
bin="$1"
mpirun_sh="$2"
tmp="${TEST_TMPDIR:-$(mktemp -d)}/data_path"
rm -rf "$tmp"; mkdir -p "$tmp"
fail() { echo "FAIL: $*"; exit 1; }

# Megatron .bin/.idx (uint16) of `n` documents of 3..40 tokens below `vocab`, from `seed`.
python3 - "$tmp" <<'PY'
import random, struct, sys
def write(prefix, n, vocab, seed):
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        length = rng.randint(3, 40)
        start = rng.randrange(vocab)
        # A learnable stream: each token the previous plus a small step.
        doc = [start]
        for _ in range(length - 1):
            doc.append((doc[-1] + rng.choice((1, 2, 3))) % vocab)
        docs.append(doc)
    with open(prefix + ".bin", "wb") as f:
        for d in docs:
            f.write(struct.pack("<%dH" % len(d), *d))
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8))
        f.write(struct.pack("<QQ", len(docs), len(docs) + 1))
        f.write(struct.pack("<%di" % len(docs), *[len(d) for d in docs]))
        ptr, ptrs = 0, []
        for d in docs:
            ptrs.append(ptr)
            ptr += 2 * len(d)
        f.write(struct.pack("<%dq" % len(docs), *ptrs))
        f.write(struct.pack("<%dq" % (len(docs) + 1), *range(len(docs) + 1)))
write(sys.argv[1] + "/web", 400, 500, 1)
write(sys.argv[1] + "/code", 150, 500, 2)
PY

blend="0.7 $tmp/web 0.3 $tmp/code"
tiny=(--dim=8 --expert_dim=8 --experts=4 --layers=2 --seq_len=32 --max_doc_len=32 --vocab=500
      --alpha_z=0.01 --alpha_b=0.01 --grad_acc=2 --steps=8 --timeout_s=60 --eval_every=4
      --split=90,10 --reproducible)

run() {  # run NAME LAUNCH... -- FLAGS...
  local name="$1"; shift
  local launch=()
  while [[ "$1" != "--" ]]; do launch+=("$1"); shift; done
  shift
  "${launch[@]}" "$bin" "${tiny[@]}" --data_path="$blend" "$@" --export="$tmp/$name.safetensors" \
    --metrics="$tmp/$name.jsonl" > "$tmp/$name.log" 2>&1 \
    || { tail -20 "$tmp/$name.log"; fail "run $name"; }
}
same() {  # same REF OTHER
  cmp -s "$tmp/$1.safetensors" "$tmp/$2.safetensors" || fail "parameters differ: $1 vs $2"
  python3 - "$tmp/$1.jsonl" "$tmp/$2.jsonl" <<'PY' || fail "logged values differ: $1 vs $2"
import json, sys
rows = lambda p: [json.loads(l) for l in open(p) if l.strip()]
a, b = rows(sys.argv[1]), rows(sys.argv[2])
assert len(a) == len(b) == 8, (len(a), len(b))
for x, y in zip(a, b):
    for k in ("ce", "z", "bal", "loss", "grad_norm", "valid_tokens", "eval_ce"):
        if x.get(k) != y.get(k):
            sys.exit(f"step {x['step']}: {k} {x.get(k)!r} != {y.get(k)!r}")
assert any("eval_ce" in x for x in a), "no held-out CE logged"
PY
  echo "identical: $1 vs $2"
}

run w1 -- --world=1 --ep=1 --micro_batch=4
grep -q "train part of --split=90,10, shuffled each epoch" "$tmp/w1.log" || fail "no data line"
run w4 -- --world=4 --ep=2 --micro_batch=1
same w1 w4
run mpi2 "$mpirun_sh" 2 -- --backend=mpi --world=2 --ep=2 --micro_batch=2
same w1 mpi2
run sp2 -- --world=2 --ep=1 --sp=2 --micro_batch=4 --attention=causal --heads=2 --kv_heads=2
run sp1 -- --world=1 --ep=1 --micro_batch=4 --attention=causal --heads=2 --kv_heads=2
same sp1 sp2

# Resume onto another mesh, then refuse a changed file.
"$bin" "${tiny[@]}" --data_path="$blend" --world=2 --ep=2 --micro_batch=2 --steps=3 \
  --checkpoint_dir="$tmp/ckpt" > "$tmp/first.log" 2>&1 || { tail "$tmp/first.log"; fail "segment 1"; }
cp -r "$tmp/ckpt" "$tmp/ckpt_copy"
run resumed "$mpirun_sh" 4 -- --backend=mpi --world=4 --ep=4 --micro_batch=1 \
  --checkpoint_dir="$tmp/ckpt" --resume
grep -q "^resumed from step 3" "$tmp/resumed.log" || fail "did not resume"
cmp -s "$tmp/w1.safetensors" "$tmp/resumed.safetensors" || fail "the resumed run's parameters differ"
echo "identical: w1 vs resumed"
python3 - "$tmp/code.bin" <<'PY'
import sys
b = bytearray(open(sys.argv[1], "rb").read())
b[100] ^= 1
open(sys.argv[1], "wb").write(b)
PY
if "$bin" "${tiny[@]}" --data_path="$blend" --world=2 --ep=2 --micro_batch=2 \
  --checkpoint_dir="$tmp/ckpt_copy" --resume > "$tmp/changed.log" 2>&1; then
  fail "a resume on a changed file was accepted"
fi
grep -q "the data changed since the checkpoint of step 3" "$tmp/changed.log" \
  || fail "no fingerprint refusal: $(tail -3 "$tmp/changed.log")"
echo "refused: a changed dataset under --resume"

expect_error() {  # expect_error "substring" flags...
  local want="$1"; shift
  local rc=0
  "$bin" --dim=8 --expert_dim=8 --experts=4 --layers=1 --seq_len=32 --max_doc_len=32 \
    --vocab=500 --steps=1 "$@" > "$tmp/err.txt" 2>&1 || rc=$?
  [ "$rc" -eq 1 ] || fail "moe_lm $* exited $rc, expected 1: $(cat "$tmp/err.txt")"
  grep -qF -- "$want" "$tmp/err.txt" || fail "moe_lm $*: no '$want' in: $(cat "$tmp/err.txt")"
}
expect_error "data.data_path=0 $tmp/web 1 $tmp/code: weight 0 of $tmp/web must be positive" \
  --data_path="0 $tmp/web 1 $tmp/code"
expect_error "weight -0.5 of $tmp/code must be positive" --data_path="1 $tmp/web -0.5 $tmp/code"
expect_error "data.data_path=0.7 $tmp/web 0.3: has 3 words" --data_path="0.7 $tmp/web 0.3"
expect_error "$tmp/nothere is no token file" --data_path="1 $tmp/web 1 $tmp/nothere"
expect_error "data.split=0,0,0: the parts sum to 0" --data_path="$tmp/web" --split=0,0,0
expect_error "data.split=90,x: part 2 \"x\" is not a number" --data_path="$tmp/web" --split=90,x
expect_error "data.split=90,10: is not used without data.data_path" --split=90,10
expect_error "both name the data" --data_path="$tmp/web" --data="$tmp/web.bin"
expect_error "data.eval_path=$tmp/code: is not read with data.data_path" \
  --data_path="$tmp/web" --eval_data="$tmp/code" --eval_every=1
expect_error "log.eval_every=2: evaluates the validation part of data.split=1,0,1, which is empty" \
  --data_path="$tmp/web" --split=1,0,1 --eval_every=2
expect_error "model.vocab=400: --data_path=$tmp/web (train part of --split) holds token id 499" \
  --data_path="$tmp/web" --vocab=400
echo PASS
