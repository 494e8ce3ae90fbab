#!/usr/bin/env bash
# maxvio (SEMANTICS.md §8) with and without the expert bias of §5.1 on the README job (the
# moe_lm defaults), one run per row: softmax scores with the default balancing loss, without
# it, and sigmoid scores, each at --expert_bias_speed 0, 0.001 and (some) 0.01. Prints per
# row the summary's per-layer maxvio (mean over the run; mean over the last 10 steps), the
# CE of the last 10 steps, tokens/s and the load average before and after.
#
#   ./bazelw build -c opt //train:moe_lm
#   STEPS=300 bench/expert_bias_maxvio.sh bazel-bin/train/moe_lm
set -uo pipefail
bin="$1"
steps="${STEPS:-300}"
out="$(mktemp -d)"
while read -r name flags; do
  l0=$(cut -d' ' -f1 /proc/loadavg)
  # shellcheck disable=SC2086  # the flags are words
  "$bin" --steps="$steps" $flags > "$out/$name.log" 2>&1 || echo "FAIL $name (log $out/$name.log)"
  l1=$(cut -d' ' -f1 /proc/loadavg)
  mv=$(grep "^summary: maxvio" "$out/$name.log" | sed 's/summary: maxvio per layer: //')
  ce=$(grep "^summary: ce" "$out/$name.log" | sed 's/.*mean of the last steps \([0-9.]*\).*/\1/')
  tps=$(grep "^summary: steps" "$out/$name.log" | sed 's/.* s, \([0-9.kM]*\) tok\/s.*/\1/')
  echo "$name | $flags | $mv | ce_tail $ce | $tps tok/s | load $l0 -> $l1"
done <<'RUNS'
softmax_ab1e-3_u0 --alpha_b=0.001
softmax_ab1e-3_u1e-3 --alpha_b=0.001 --expert_bias_speed=0.001
softmax_ab1e-3_u1e-2 --alpha_b=0.001 --expert_bias_speed=0.01
softmax_ab0_u0 --alpha_b=0
softmax_ab0_u1e-3 --alpha_b=0 --expert_bias_speed=0.001
sigmoid_u0 --alpha_b=0 --router_score=sigmoid
sigmoid_u1e-3 --alpha_b=0 --router_score=sigmoid --expert_bias_speed=0.001
sigmoid_u1e-2 --alpha_b=0 --router_score=sigmoid --expert_bias_speed=0.01
RUNS
