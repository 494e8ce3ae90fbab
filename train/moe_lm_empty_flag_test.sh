#!/usr/bin/env bash
# A value flag given an empty value (`--data=`, as an unset shell variable gives) is refused
# at start-up naming the flag, instead of being taken as "not given" (issue 50, item 5): the
# run would otherwise silently train on the embedded corpus, export nothing, and so on.
#   moe_lm_empty_flag_test.sh MOE_LM_BINARY
set -uo pipefail
bin="$1"
tmp="${TEST_TMPDIR:-$(mktemp -d)}/empty_flag"
rm -rf "$tmp"; mkdir -p "$tmp"
fail() { echo "FAIL: $*"; exit 1; }

for flag in data export checkpoint_dir recompute eval_data init_from metrics dump_dir config \
    world lr decay_norms sharding; do
  "$bin" "--$flag=" --steps=1 > "$tmp/out.txt" 2>&1
  rc=$?
  [ "$rc" -eq 1 ] || fail "moe_lm --$flag= exited $rc, expected 1: $(cat "$tmp/out.txt")"
  grep -qF -- "--$flag= was given an empty value" "$tmp/out.txt" \
    || fail "moe_lm --$flag=: the message does not name the flag: $(cat "$tmp/out.txt")"
done
echo "PASS"
