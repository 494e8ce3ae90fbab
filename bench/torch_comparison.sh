#!/usr/bin/env bash
# moe_lm against its PyTorch DDP peer (bench/torch_ddp_moe_lm.py), side by side in one run:
# world 2 on the thread backend at the default sizes, ep 1 and 2, fsdp and replicated, then
# the torch script (gloo, 2 processes, one thread each, OpenBLAS single-threaded). Prints
# each run's routed tokens/s summary line and the load average before and after.
#
#   ./bazelw build -c opt //train:moe_lm
#   bench/torch_comparison.sh bazel-bin/train/moe_lm [OTHER_MOE_LM_BINARY ...]
#
# Extra binaries (e.g. one built from an older commit) run the same moe_lm configurations
# in the same session, interleaved, for before/after tables. The torch peer runs first and
# last.
set -euo pipefail
STEPS=${STEPS:-40}
TORCH_STEPS=${TORCH_STEPS:-30}
torch() {  # bounded: a gloo rank once hung in a futex after its peer had finished
  OPENBLAS_NUM_THREADS=1 timeout "${TORCH_TIMEOUT:-120}" /usr/bin/python3 \
    "$(dirname "$0")/torch_ddp_moe_lm.py" --world 2 --steps "${TORCH_STEPS}"
}
echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"
torch || echo "torch run failed"  # before and after the moe_lm runs, to show how far the load drifted
for ep in 1 2; do
  for sharding in fsdp replicated; do
    for bin in "$@"; do  # interleaved, so binaries see the same load
      line=$("${bin}" --world=2 --ep="${ep}" --sharding="${sharding}" --steps="${STEPS}" 2>&1 |
        grep "summary: steps")
      echo "${bin} ep=${ep} ${sharding}: ${line}"
    done
  done
done
torch || echo "torch run failed"
echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"
