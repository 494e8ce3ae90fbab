#!/usr/bin/env bash
# A blocking sync call that overruns its timeout ends the MPI job (the watchdog of
# collectives/mpi_backend.h): mpi_watchdog_test.sh BINARY MPIRUN_TEST_SH
# For each operation: the job exits non-zero, a waiting rank reported DEADLINE_EXCEEDED
# naming itself and the operation, no process of the job is left (the rank that never
# called sleeps 60 s), and it ended well before the bound (a hang check, not a speed test).
set -uo pipefail
bin="$1"
mpirun_sh="$2"
tmp="${TEST_TMPDIR:-$(mktemp -d)}/mpi_watchdog"
rm -rf "$tmp"; mkdir -p "$tmp"
fail() { echo "FAIL: $*"; exit 1; }
bound=40  # seconds: the 1 s timeout plus MPI start-up on a loaded 2-core machine

# run_case NP OP [nocheck] REPORTED_OP: REPORTED_OP is the call that waits (with the
# agreement check on, its descriptor all-reduce).
run_case() {
  local np="$1" op="$2" mode="$3" reported="$4"
  local name="${op}_${mode}_np${np}" out
  out="$tmp/$name.txt"
  local start=$SECONDS
  GRADSUM_MPI_TIMEOUT_S=$((bound + 30)) "$mpirun_sh" "$np" "$bin" "$op" "$mode" > "$out" 2>&1
  local rc=$? elapsed=$((SECONDS - start))
  echo "$name: exit $rc after ${elapsed}s"
  [ "$rc" -ne 0 ] || fail "$name: the job exited 0: $(cat "$out")"
  [ "$elapsed" -lt "$bound" ] || fail "$name: took ${elapsed}s (bound ${bound}s): $(cat "$out")"
  grep -q "the call returned" "$out" && fail "$name: a blocked call returned: $(cat "$out")"
  grep -Eq "gradsum mpi backend: DEADLINE_EXCEEDED: mpi $reported #[0-9]+ \(rank [0-9] of $np\): not every rank arrived within the timeout of 1s" "$out" \
    || fail "$name: no DeadlineExceeded report: $(cat "$out")"
  local left
  left=$(pgrep -f -- "$bin $op $mode" || true)
  if [ -n "$left" ]; then
    kill -9 $left 2>/dev/null
    fail "$name: processes of the job outlived it: $left"
  fi
}

for op in all_reduce broadcast barrier; do
  run_case 2 "$op" nocheck "$op"
done
run_case 2 broadcast check all_reduce
run_case 3 all_reduce check all_reduce
echo "PASS"
