#!/usr/bin/env bash
# One prepared script for every GPU check: the tests tagged `gpu`, the one-GPU
# `moe_lm --backend=nccl` parity run, //bench:gpu_bench and //bench:gpu_step_bench. See
# docs/GPU.md.
#
#   bench/run_gpu_checks.sh            # where Bazel works: build --config=cuda, test, bench
#   bench/run_gpu_checks.sh package    # here (Bazel, no GPU): build the GPU binaries into
#                                      # gpu_checks/ with their non-CUDA shared libraries
#   bench/run_gpu_checks.sh prebuilt   # on the GPU machine without Bazel: run gpu_checks/
#
# Time: everything shares one budget, GPU_CHECKS_BUDGET_S (default 540 s, inside the device
# tool's 600 s per command). Each step's timeout is its own cap or what is left, whichever is
# smaller; a step with under 10 s left is skipped and logged as such (and the exit status is
# non-zero). Order: tests, the moe_lm parity run, gpu_bench, gpu_step_bench, 100 moe_lm steps.
#
# Results (summary.txt, logs, test XML, *.json) go to $OUT when it is set, else a temp dir.
# Exit status: 0 when every step ran and passed; non-zero otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE="${1:-auto}"
OUT_DIR="${OUT:-$(mktemp -d /tmp/gpu_checks_out.XXXXXX)}"
mkdir -p "${OUT_DIR}"
BUNDLE=gpu_checks
DEADLINE=$(( $(date +%s) + ${GPU_CHECKS_BUDGET_S:-540} ))
BENCH_FLAGS=(--benchmark_min_time=0.2 --benchmark_out="${OUT_DIR}/gpu_bench.json"
             --benchmark_out_format=json --benchmark_counters_tabular=true)
STEP_BENCH_FLAGS=(--benchmark_out="${OUT_DIR}/gpu_step_bench.json" --benchmark_out_format=json
                  --benchmark_counters_tabular=true)
# The gpu-tagged tests, from the BUILD files. The bundle holds the gtest binaries only: the
# sh_tests that launch moe_lm under mpirun need Open MPI and one GPU per rank, so they run
# in the Bazel mode, and both modes run the one-GPU `moe_lm --backend=nccl` case directly.
gpu_tests() { "$1" query 'attr(tags, "\bgpu\b", tests(//...))' 2>/dev/null; }
gpu_gtests() { "$1" query 'attr(tags, "\bgpu\b", kind("cc_test", tests(//...)))' 2>/dev/null; }

log() { echo "[run_gpu_checks] $*" | tee -a "${OUT_DIR}/summary.txt"; }

# Seconds for a step capped at $1: min($1, time left). Empty when under 10 s are left.
step_timeout() {
  local left=$(( DEADLINE - $(date +%s) ))
  (( left < 10 )) && return 1
  (( left < $1 )) && echo "${left}" || echo "$1"
}

# run_step NAME CAP LOGFILE COMMAND...: runs COMMAND under the budget, output to LOGFILE.
run_step() {
  local name="$1" cap="$2" logfile="$3" t; shift 3
  if ! t="$(step_timeout "${cap}")"; then
    log "SKIPPED (budget spent): ${name}"; return 1
  fi
  timeout "${t}" "$@" > "${logfile}" 2>&1
  local rc=$?
  (( rc == 124 || rc == 137 )) && log "TIMEOUT after ${t} s: ${name}"
  return ${rc}
}

device_info() {
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv \
      > "${OUT_DIR}/nvidia-smi.txt" 2>&1
  else
    echo -e "nvidia-smi\nnot found" > "${OUT_DIR}/nvidia-smi.txt"
  fi
  log "device: $(head -2 "${OUT_DIR}/nvidia-smi.txt" | tail -1)"
}

bazel_cmd() {
  if command -v bazel >/dev/null 2>&1; then echo "./bazelw"; else echo ""; fi
}

# The training binary on one GPU (world 1 needs no MPI launcher; NCCL world of 1): step 1's
# parity check at the CI config, and later 100 steps of the default model (convergence).
moe_lm_parity() {
  local bin="$1"
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  run_step "moe_lm --backend=nccl parity" 90 "${OUT_DIR}/moe_lm_nccl_parity.log" \
      "${bin}" --backend=nccl --world=1 --ep=1 --grad_acc=2 --steps=3 --dim=8 --expert_dim=8 \
      --experts=4 --seq_len=32 --max_doc_len=24 --micro_batch=2 --alpha_b=0.01 --alpha_z=0.01 \
      --parity_check
  local rc=$?
  log "moe_lm --backend=nccl --world=1 G=2 fsdp: $(grep -E 'parity (PASSED|FAILED)' \
      "${OUT_DIR}/moe_lm_nccl_parity.log" || tail -2 "${OUT_DIR}/moe_lm_nccl_parity.log" | tr '\n' ' ')"
  return ${rc}
}

moe_lm_default() {
  local bin="$1"
  run_step "moe_lm --backend=nccl 100 steps" 120 "${OUT_DIR}/moe_lm_nccl_default.log" \
      "${bin}" --backend=nccl --world=1 --ep=1 --steps=100
  local rc=$?
  log "moe_lm --backend=nccl --world=1, default model, 100 steps: $(tail -2 \
      "${OUT_DIR}/moe_lm_nccl_default.log" | tr '\n' ' ')"
  return ${rc}
}

benches() {
  local dir="$1" rc=0
  log "bench: gpu_bench"
  run_step gpu_bench 180 "${OUT_DIR}/gpu_bench.txt" "${dir}/gpu_bench" "${BENCH_FLAGS[@]}" || rc=1
  cat "${OUT_DIR}/gpu_bench.txt"
  log "bench: gpu_step_bench"
  run_step gpu_step_bench 150 "${OUT_DIR}/gpu_step_bench.txt" "${dir}/gpu_step_bench" \
      "${STEP_BENCH_FLAGS[@]}" || rc=1
  cat "${OUT_DIR}/gpu_step_bench.txt"
  return ${rc}
}

run_with_bazel() {
  local bz="$1" rc=0
  device_info
  log "build: ${bz} build -c opt --config=cuda //..."
  run_step build 300 "${OUT_DIR}/build.log" "${bz}" build -c opt --config=cuda //... || {
    log "build FAILED (see build.log)"; tail -40 "${OUT_DIR}/build.log"; return 1; }
  log "test: ${bz} test -c opt --config=cuda --test_tag_filters=gpu //..."
  run_step test 240 "${OUT_DIR}/test.log" "${bz}" test -c opt --config=cuda \
      --test_tag_filters=gpu --test_output=errors --test_summary=detailed //... || rc=1
  grep -E "PASSED|FAILED|SKIPPED|NO STATUS|Executed" "${OUT_DIR}/test.log" | tee -a "${OUT_DIR}/summary.txt"
  # Test logs (one per target), flattened so the files come back from $OUT.
  for t in $(gpu_tests "${bz}"); do
    local p="${t#//}"; p="${p/://}"
    [[ -f "bazel-testlogs/${p}/test.log" ]] && cp "bazel-testlogs/${p}/test.log" "${OUT_DIR}/$(basename "${p}").log"
  done
  moe_lm_parity bazel-bin/train/moe_lm || rc=1
  benches bazel-bin/bench || rc=1
  moe_lm_default bazel-bin/train/moe_lm || rc=1
  return ${rc}
}

package_bundle() {
  local bz; bz="$(bazel_cmd)"
  [[ -n "${bz}" ]] || { echo "package needs Bazel" >&2; return 1; }
  local tests; tests=($(gpu_gtests "${bz}"))
  [[ ${#tests[@]} -gt 0 ]] || { echo "bazel query found no gpu tests" >&2; return 1; }
  "${bz}" build -c opt --config=cuda "${tests[@]}" //bench:gpu_bench //bench:gpu_step_bench \
      //train:moe_lm || return 1
  rm -rf "${BUNDLE}"; mkdir -p "${BUNDLE}/bin" "${BUNDLE}/lib"
  local bins=(bazel-bin/bench/gpu_bench bazel-bin/bench/gpu_step_bench bazel-bin/train/moe_lm)
  for t in "${tests[@]}"; do local p="${t#//}"; bins+=("bazel-bin/${p/://}"); done
  local b lib missing
  for b in "${bins[@]}"; do
    cp -L "${b}" "${BUNDLE}/bin/" || { echo "cannot copy ${b}" >&2; return 1; }
    # A library ldd cannot find here would fail there, after the device time is spent.
    missing="$(ldd "${b}" | grep 'not found' | grep -vE 'libcuda\.so' || true)"
    [[ -z "${missing}" ]] || { echo "${b}: ${missing}" >&2; return 1; }
    # Every shared library except glibc/libstdc++ and the CUDA ones (the GPU machine's own
    # CUDA 13 install provides those, matched to its driver).
    for lib in $(ldd "${b}" | awk '$3 ~ /^\// {print $3}'); do
      case "$(basename "${lib}")" in
        libc.so*|libm.so*|libdl.so*|libpthread.so*|librt.so*|libgcc_s.so*|libstdc++.so*) ;;
        libcuda.so*|libcudart.so*|libcublas*|libnccl.so*) ;;
        *) cp -Ln "${lib}" "${BUNDLE}/lib/" || { echo "cannot copy ${lib}" >&2; return 1; } ;;
      esac
    done
  done
  du -sh "${BUNDLE}"
  echo "bundle ready: carry '${BUNDLE}' and run: bench/run_gpu_checks.sh prebuilt"
}

cuda_lib_path() {
  # CUDA runtime, cuBLAS and NCCL: the toolkit first, then the pip wheels of the image.
  local dirs=(/usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib)
  local py
  for py in /opt/torch/.venv/lib/python3*/site-packages/nvidia /usr/local/lib/python3*/dist-packages/nvidia; do
    [[ -d "${py}" ]] && dirs+=("${py}"/*/lib)
  done
  local IFS=:; echo "${dirs[*]}"
}

run_prebuilt() {
  [[ -d "${BUNDLE}/bin" ]] || { echo "no ${BUNDLE}/ bundle: run 'package' where Bazel works" >&2; return 1; }
  device_info
  export LD_LIBRARY_PATH="${PWD}/${BUNDLE}/lib:$(cuda_lib_path):${LD_LIBRARY_PATH:-}"
  local rc=0 b
  for b in "${BUNDLE}"/bin/*_test; do
    local name; name="$(basename "${b}")"
    if run_step "${name}" 60 "${OUT_DIR}/${name}.log" "${b}" --gtest_output="xml:${OUT_DIR}/${name}.xml"; then
      log "ok ${name}: $(grep -E '^\[  (PASSED|SKIPPED) +\] [0-9]+ test' "${OUT_DIR}/${name}.log" | tr '\n' ' ')"
    else
      rc=1; log "FAILED ${name}"; tail -30 "${OUT_DIR}/${name}.log"
    fi
  done
  moe_lm_parity "${BUNDLE}/bin/moe_lm" || rc=1
  benches "${BUNDLE}/bin" || rc=1
  moe_lm_default "${BUNDLE}/bin/moe_lm" || rc=1
  return ${rc}
}

case "${MODE}" in
  package) package_bundle ;;
  prebuilt) run_prebuilt ;;
  auto)
    bz="$(bazel_cmd)"
    if [[ -n "${bz}" ]]; then run_with_bazel "${bz}"
    elif [[ -d "${BUNDLE}/bin" ]]; then run_prebuilt
    else echo "neither Bazel nor a ${BUNDLE}/ bundle: see docs/GPU.md" >&2; exit 1
    fi ;;
  *) echo "usage: $0 [auto|package|prebuilt]" >&2; exit 2 ;;
esac
rc=$?
log "exit status ${rc}; results in ${OUT_DIR}"
exit ${rc}
