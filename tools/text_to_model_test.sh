#!/usr/bin/env bash
# The README's newcomer path (tools/text_to_model.sh) at small sizes on the repository's own
# documentation: the tools and the trainer run end to end, the dataset reads back, and the
# held-out CE falls.
#   text_to_model_test.sh TEXT_TO_MODEL_SH TOKENIZER_TRAIN PREPARE_DATA MOE_LM DOCS...
set -euo pipefail
script="$1"
export TOKENIZER_TRAIN="$2" PREPARE_DATA="$3" MOE_LM="$4"
shift 4
tmp="${TEST_TMPDIR:-$(mktemp -d)}/text_to_model"
rm -rf "$tmp"; mkdir -p "$tmp"
fail() { echo "FAIL: $*"; exit 1; }
VOCAB=1000 "$script" "$tmp" "$@" -- --steps=150 --eval_every=50 --dim=32 --expert_dim=32 \
  --layers=1 --seq_len=64 --max_doc_len=64 --micro_batch=4 --world=2 --lr=0.01 \
  --metrics="$tmp/metrics.jsonl" > "$tmp/log.txt" 2>&1 || { tail -20 "$tmp/log.txt"; fail "run"; }
grep -q "tokenizer_train: wrote" "$tmp/log.txt" || fail "no tokenizer"
grep -q "prepare_data: wrote .*tokens/s" "$tmp/log.txt" || fail "no dataset"
python3 - "$tmp/metrics.jsonl" <<'PY' || fail "the held-out CE did not fall: $(grep 'held-out' "$tmp/log.txt")"
import json, sys
evals = [r["eval_ce"] for r in map(json.loads, filter(str.strip, open(sys.argv[1]))) if "eval_ce" in r]
assert len(evals) == 3, evals
print("held-out CE", evals)
assert evals[-1] < evals[0] - 0.5, evals
PY
grep "held-out ce" "$tmp/log.txt"
echo PASS
