#!/usr/bin/env bash
# One prepared script for every GPU check (tests tagged `gpu` + //bench:gpu_bench), sized to
# finish in ~10 minutes on one H200. See docs/GPU.md.
#
#   bench/run_gpu_checks.sh            # where Bazel works: build --config=cuda, test, bench
#   bench/run_gpu_checks.sh package    # here (Bazel, no GPU): build the GPU binaries into
#                                      # gpu_checks/ with their non-CUDA shared libraries
#   bench/run_gpu_checks.sh prebuilt   # on the GPU machine without Bazel: run gpu_checks/
#
# Results (logs, test XML, gpu_bench.json) go to $OUT when it is set, else to a temp dir.
# Exit status: 0 when every test passed and the bench ran; non-zero otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE="${1:-auto}"
OUT_DIR="${OUT:-$(mktemp -d /tmp/gpu_checks_out.XXXXXX)}"
mkdir -p "${OUT_DIR}"
BUNDLE=gpu_checks
BENCH_FLAGS=(--benchmark_min_time=0.2 --benchmark_out="${OUT_DIR}/gpu_bench.json"
             --benchmark_out_format=json --benchmark_counters_tabular=true)
STEP_BENCH_FLAGS=(--benchmark_out="${OUT_DIR}/gpu_step_bench.json" --benchmark_out_format=json
                  --benchmark_counters_tabular=true)
# The gpu-tagged tests, from the BUILD files (Bazel modes only; `prebuilt` runs every
# *_test binary in the bundle). The bundle holds the gtest binaries only: the sh_tests that
# launch moe_lm under mpirun need Open MPI and one GPU per rank, so they run in the Bazel
# mode, and `prebuilt` runs the one-GPU `moe_lm --backend=nccl` case itself (below).
gpu_tests() { "$1" query 'attr(tags, "\bgpu\b", tests(//...))' 2>/dev/null; }
gpu_gtests() { "$1" query 'attr(tags, "\bgpu\b", kind("cc_test", tests(//...)))' 2>/dev/null; }

log() { echo "[run_gpu_checks] $*" | tee -a "${OUT_DIR}/summary.txt"; }

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

run_with_bazel() {
  local bz="$1" rc=0
  device_info
  log "build: ${bz} build -c opt --config=cuda //..."
  timeout 300 "${bz}" build -c opt --config=cuda //... > "${OUT_DIR}/build.log" 2>&1 || {
    log "build FAILED (see build.log)"; tail -40 "${OUT_DIR}/build.log"; return 1; }
  log "test: ${bz} test -c opt --config=cuda --test_tag_filters=gpu //..."
  timeout 300 "${bz}" test -c opt --config=cuda --test_tag_filters=gpu --test_output=errors \
      --test_summary=detailed //... > "${OUT_DIR}/test.log" 2>&1 || rc=1
  grep -E "PASSED|FAILED|SKIPPED|NO STATUS|Executed" "${OUT_DIR}/test.log" | tee -a "${OUT_DIR}/summary.txt"
  # Test XML (one per target) for the record; flattened so the files come back from $OUT.
  for t in $(gpu_tests "${bz}"); do
    local p="${t#//}"; p="${p/://}"
    [[ -f "bazel-testlogs/${p}/test.log" ]] && cp "bazel-testlogs/${p}/test.log" "${OUT_DIR}/$(basename "${p}").log"
  done
  log "bench: gpu_bench"
  timeout 180 bazel-bin/bench/gpu_bench "${BENCH_FLAGS[@]}" > "${OUT_DIR}/gpu_bench.txt" 2>&1 || rc=1
  cat "${OUT_DIR}/gpu_bench.txt"
  log "bench: gpu_step_bench"
  timeout 150 bazel-bin/bench/gpu_step_bench "${STEP_BENCH_FLAGS[@]}" > "${OUT_DIR}/gpu_step_bench.txt" 2>&1 || rc=1
  cat "${OUT_DIR}/gpu_step_bench.txt"
  run_moe_lm_nccl bazel-bin/train/moe_lm || rc=1
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
  for b in "${bins[@]}"; do
    cp -L "${b}" "${BUNDLE}/bin/"
    # Every shared library except glibc/libstdc++ and the CUDA ones (the GPU machine's own
    # CUDA 13 install provides those, matched to its driver).
    ldd "${b}" | awk '$3 ~ /^\// {print $3}' | while read -r lib; do
      case "$(basename "${lib}")" in
        libc.so*|libm.so*|libdl.so*|libpthread.so*|librt.so*|libgcc_s.so*|libstdc++.so*) ;;
        libcuda.so*|libcudart.so*|libcublas*|libnccl.so*) ;;
        *) cp -Ln "${lib}" "${BUNDLE}/lib/" ;;
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

# The training binary on one GPU (world 1 needs no MPI launcher; NCCL world of 1): step 1's
# parity check at the CI config, then 100 steps of the default model (convergence). The
# step's speed against the CPU is gpu_step_bench's. Logs go to $OUT.
run_moe_lm_nccl() {
  local bin="$1" rc=0
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  log "moe_lm --backend=nccl --world=1 (parity, G=2, fsdp)"
  timeout 120 "${bin}" --backend=nccl --world=1 --ep=1 --grad_acc=2 --steps=3 --dim=8 \
      --expert_dim=8 --experts=4 --seq_len=32 --max_doc_len=24 --micro_batch=2 \
      --alpha_b=0.01 --alpha_z=0.01 --parity_check > "${OUT_DIR}/moe_lm_nccl_parity.log" 2>&1 || rc=1
  log "$(grep -E 'parity (PASSED|FAILED)' "${OUT_DIR}/moe_lm_nccl_parity.log" || tail -3 "${OUT_DIR}/moe_lm_nccl_parity.log")"
  log "moe_lm --backend=nccl --world=1, default model, 100 steps"
  timeout 150 "${bin}" --backend=nccl --world=1 --ep=1 --steps=100 \
      > "${OUT_DIR}/moe_lm_nccl_default.log" 2>&1 || rc=1
  log "$(tail -2 "${OUT_DIR}/moe_lm_nccl_default.log" | tr '\n' ' ')"
  return ${rc}
}

run_prebuilt() {
  [[ -d "${BUNDLE}/bin" ]] || { echo "no ${BUNDLE}/ bundle: run 'package' where Bazel works" >&2; return 1; }
  device_info
  export LD_LIBRARY_PATH="${PWD}/${BUNDLE}/lib:$(cuda_lib_path):${LD_LIBRARY_PATH:-}"
  local rc=0 b
  for b in "${BUNDLE}"/bin/*_test; do
    local name; name="$(basename "${b}")"
    if timeout 120 "${b}" --gtest_output="xml:${OUT_DIR}/${name}.xml" > "${OUT_DIR}/${name}.log" 2>&1; then
      log "ok ${name}: $(grep -E '^\[  (PASSED|SKIPPED) +\] [0-9]+ test' "${OUT_DIR}/${name}.log" | tr '\n' ' ')"
    else
      rc=1; log "FAILED ${name}"; tail -30 "${OUT_DIR}/${name}.log"
    fi
  done
  log "bench: gpu_bench"
  timeout 180 "${BUNDLE}/bin/gpu_bench" "${BENCH_FLAGS[@]}" > "${OUT_DIR}/gpu_bench.txt" 2>&1 || rc=1
  cat "${OUT_DIR}/gpu_bench.txt"
  log "bench: gpu_step_bench"
  timeout 150 "${BUNDLE}/bin/gpu_step_bench" "${STEP_BENCH_FLAGS[@]}" > "${OUT_DIR}/gpu_step_bench.txt" 2>&1 || rc=1
  cat "${OUT_DIR}/gpu_step_bench.txt"
  run_moe_lm_nccl "${BUNDLE}/bin/moe_lm" || rc=1
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
