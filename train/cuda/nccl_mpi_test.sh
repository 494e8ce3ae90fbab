#!/usr/bin/env bash
# moe_lm --backend=nccl under Open MPI, one GPU per rank, with --parity_check:
#   nccl_mpi_test.sh NP MPIRUN_TEST_SH MOE_LM [ARGS...]
# Skips (exit 0 with a SKIPPED line) when fewer than NP GPUs are visible; otherwise fails
# unless the run exits 0 and rank 0 prints "parity PASSED".
set -euo pipefail
np="$1"; runner="$2"; shift 2
gpus="$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)"
if [[ "${gpus:-0}" -lt "${np}" ]]; then
  echo "SKIPPED: needs ${np} GPU(s), found ${gpus:-0} (nvidia-smi -L)"
  exit 0
fi
out="$(mktemp "${TEST_TMPDIR:-/tmp}/nccl_run.XXXXXX")"
"${runner}" "${np}" "$@" 2>&1 | tee "${out}"
grep -q "parity PASSED" "${out}" || { echo "FAIL: rank 0 did not print 'parity PASSED'"; exit 1; }
