#!/usr/bin/env bash
# moe_lm against its PyTorch DDP peer (bench/torch_ddp_moe_lm.py), side by side in one run:
# world 2 on the thread backend at the default sizes, ep 1 and 2, fsdp and replicated, then
# the torch script (gloo, 2 processes, one thread each, OpenBLAS single-threaded). Prints
# each run's routed tokens/s summary line and the load average before and after.
#
#   ./bazelw build -c opt //train:moe_lm
#   bench/torch_comparison.sh bazel-bin/train/moe_lm [OTHER_MOE_LM_BINARY ...]
#   ATTENTION=1 SP="1 2" bench/torch_comparison.sh bazel-bin/train/moe_lm
#
# Extra binaries (e.g. one built from an older commit) run the same moe_lm configurations
# in the same session, interleaved, for before/after tables. The torch peer runs first and
# last.
#
# ATTENTION=1 compares the models with SEMANTICS.md §10's attention block: --attention to the
# torch peer, --attention=causal to moe_lm (unset: --attention=none --corpus=markov1, the
# per-token model); HEADS and KV_HEADS, when set, go to both (unset:
# each side's default, train/config.proto's). SP (a list, e.g. "1 2") runs moe_lm at each
# --sp; unset, moe_lm gets no --sp. The torch peer is data-parallel only.
set -euo pipefail
STEPS=${STEPS:-40}
TORCH_STEPS=${TORCH_STEPS:-30}
torch_args=() moe_lm_args=()
if [[ -n "${ATTENTION:-}" ]]; then
  torch_args+=(--attention)
  moe_lm_args+=(--attention=causal)
  if [[ -n "${HEADS:-}" ]]; then torch_args+=(--heads "${HEADS}"); moe_lm_args+=(--heads="${HEADS}"); fi
  if [[ -n "${KV_HEADS:-}" ]]; then
    torch_args+=(--kv_heads "${KV_HEADS}")
    moe_lm_args+=(--kv_heads="${KV_HEADS}")
  fi
fi
torch() {  # bounded: a gloo rank once hung in a futex after its peer had finished
  OPENBLAS_NUM_THREADS=1 timeout "${TORCH_TIMEOUT:-120}" /usr/bin/python3 \
    "$(dirname "$0")/torch_ddp_moe_lm.py" --world 2 --steps "${TORCH_STEPS}" "${torch_args[@]}"
}
echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"
torch || echo "torch run failed"  # before and after the moe_lm runs, to show how far the load drifted
for sp in ${SP:-none}; do
  sp_args=()
  [[ "${sp}" == none ]] || sp_args=(--sp="${sp}")
  for ep in 1 2; do
    for sharding in fsdp replicated; do
      for bin in "$@"; do  # interleaved, so binaries see the same load
        # Without ATTENTION, the per-token model on the first-order corpus, as the torch
        # peer trains it: moe_lm's defaults since issue 29 are attention on markov2, and
        # binaries from before have neither flag.
        bin_args=("${moe_lm_args[@]}")
        if [[ -z "${ATTENTION:-}" ]] && "${bin}" --helpfull 2>&1 | grep -q -- '--attention'; then
          bin_args+=(--attention=none --corpus=markov1)
        fi
        line=$("${bin}" --world=2 --ep="${ep}" --sharding="${sharding}" --steps="${STEPS}" \
          "${bin_args[@]}" "${sp_args[@]}" 2>&1 | grep "summary: steps")
        echo "${bin}${moe_lm_args[*]:+ ${moe_lm_args[*]}}${sp_args[*]:+ ${sp_args[*]}} ep=${ep}" \
          "${sharding}: ${line}"
      done
    done
  done
done
torch || echo "torch run failed"
echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"
