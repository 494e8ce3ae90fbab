#!/usr/bin/env bash
# Failures between two simulated hosts (testing/simhosts.sh, docs/MULTIHOST.md):
#   multihost_partition_test.sh MOE_LM_BINARY SIMHOSTS_SH
# Needs network namespaces (root); elsewhere it prints "SKIPPED: <why>" and passes.
# moe_lm --backend=mpi, world 4 = 2 hosts x 2 ranks, --reproducible, a checkpoint every step.
# Every run has N = 60 steps, so that each failure lands mid-run (checked).
# 1. Partition: when step K appears in the metrics file, host 2's link goes down (at the
#    switch). Every rank on both sides must end, non-zero, within --timeout_s + 5 s of the
#    link going down; each rank that ended on its own names the timed-out operation. The
#    last committed checkpoint then resumes on host 1 alone (world 2) and ends with the
#    bits of the uninterrupted run. mpirun and host 2's Open MPI daemon are measured and
#    reported, not required to end (Open MPI waits for the unreachable daemon; see
#    docs/MULTIHOST.md), and then killed.
# 2. A link that comes back: down at step K for FLAP_S seconds (less than the timeout), then
#    up: the run must finish with status 0 and the uninterrupted run's bits.
# 3. Host 2's ranks are SIGKILLed at step K (a long --timeout_s, so only the launcher can end
#    the others): every other rank and mpirun end non-zero within 5 s.
# Times are printed with the load average; the bounds are checked.
set -uo pipefail
bin="$(realpath "$1")"
source "$2"
tmp="${TEST_TMPDIR:-$(mktemp -d)}/multihost_partition"
rm -rf "$tmp"; mkdir -p "$tmp"
fail() { echo "FAIL: $*"; exit 1; }
simhosts_require_netns
GSH_LIMIT_S="${GSH_LIMIT_S:-300}"
simhosts_up 2 || fail "could not bring up the simulated hosts"

T="${PARTITION_TIMEOUT_S:-10}"   # --timeout_s of the partitioned run
K="${PARTITION_STEP:-3}"         # the step after which the link goes down
FLAP_S="${FLAP_S:-3}"            # how long the link stays down in case 2
# Steps of every run. A tiny step takes a few ms, and about 0.03 s with a checkpoint after
# it (every run here saves one every step), so the failure lands well before the end.
N=60
tiny=(--dim=8 --expert_dim=8 --experts=4 --layers=2 --seq_len=32 --max_doc_len=24
      --alpha_z=0.01 --alpha_b=0.01 --grad_acc=2 --reproducible)
two_hosts=(-np 4 --map-by ppr:2:node)

now() { echo "$EPOCHREALTIME"; }  # no process per call: the watch loop polls every 0.1 s
since() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", a - b }'; }
within() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a <= b) }'; }

# The uninterrupted run (thread backend, world 4, N steps): the bits every case must end with.
timeout --signal=KILL 120 "$bin" "${tiny[@]}" --backend=thread --world=4 --ep=2 --micro_batch=1 \
  --steps="$N" --timeout_s=60 --export="$tmp/ref.safetensors" > "$tmp/ref.log" 2>&1 \
  || { tail -20 "$tmp/ref.log"; fail "reference run"; }

# start NAME STEPS TIMEOUT_S [extra flags]: launches the two-host run in the background;
# sets $mp (the launcher's pid) and $dir (the ranks' logs, pids and exits).
start() {
  local name="$1" steps="$2" timeout_s="$3"; shift 3
  dir="$tmp/$name"; mkdir -p "$dir"
  simhosts_mpirun "${two_hosts[@]}" "$GSH_RANK" "$dir" "$bin" "${tiny[@]}" --backend=mpi \
    --world=4 --ep=2 --micro_batch=1 --steps="$steps" --timeout_s="$timeout_s" \
    --metrics="$dir/metrics.jsonl" "$@" > "$dir/mpirun.log" 2>&1 &
  mp=$!
}

# wait_step K: waits (at most 120 s) until step K is in the metrics file and every rank's
# pid is known.
wait_step() {
  local i
  for ((i = 0; i < 1200; i++)); do
    if grep -q "\"step\":$1[,}]" "$dir/metrics.jsonl" 2>/dev/null \
       && [[ -s "$dir/rank0.pid" && -s "$dir/rank1.pid" && -s "$dir/rank2.pid" && -s "$dir/rank3.pid" ]]; then
      return 0
    fi
    kill -0 "$mp" 2>/dev/null || { tail -20 "$dir/mpirun.log"; fail "$dir: the run ended before step $1"; }
    sleep 0.1
  done
  fail "$dir: step $1 did not appear within 120 s"
}

# watch T0 BOUND: polls the four ranks and mpirun every 0.1 s until all have ended or BOUND
# seconds after T0 have passed; prints each one's end (seconds after T0; for a rank, the
# time its wrapper recorded, else when the poll first missed it) and status, and sets
# ended[R] / ended[m] to those seconds (unset if still running).
watch() {
  local t0="$1" bound="$2" r pid t all_ranks=""
  local -A seen=()
  declare -gA ended=()
  while :; do
    t=$(now)
    for r in 0 1 2 3; do
      [[ -n "${seen[$r]:-}" ]] && continue
      pid=$(< "$dir/rank$r.pid"); pid="${pid%% *}"
      kill -0 "$pid" 2>/dev/null || seen[$r]="$t"
    done
    if [[ -z "${seen[m]:-}" ]] && ! kill -0 "$mp" 2>/dev/null; then seen[m]="$t"; fi
    [[ ${#seen[@]} -eq 5 ]] && break
    # Every rank has ended: give mpirun 5 s more (after a partition it waits for the
    # unreachable daemon far longer; docs/MULTIHOST.md).
    if [[ -n "${seen[0]:-}" && -n "${seen[1]:-}" && -n "${seen[2]:-}" && -n "${seen[3]:-}" ]]; then
      [[ -n "${all_ranks:-}" ]] || all_ranks="$t"
      [[ "$(since "$t" "$all_ranks" | cut -d. -f1)" -ge 5 ]] && break
    fi
    [[ "$(since "$t" "$t0" | cut -d. -f1)" -ge "$bound" ]] && break
    sleep 0.1
  done
  for r in 0 1 2 3 m; do
    [[ -n "${seen[$r]:-}" ]] || continue
    t="${seen[$r]}"
    if [[ "$r" != m && -s "$dir/rank$r.exit" ]]; then
      local recorded; recorded=$(awk '{print $2}' "$dir/rank$r.exit")
      [[ -n "$recorded" ]] && t="$recorded"
    fi
    ended[$r]=$(since "$t" "$t0")
  done
  for r in 0 1 2 3; do
    local how="still running after ${bound} s"
    if [[ -n "${ended[$r]:-}" ]]; then
      if [[ -s "$dir/rank$r.exit" ]]; then how="exit status $(awk '{print $1}' "$dir/rank$r.exit")"
      else how="killed (SIGKILL: no status recorded)"; fi
    fi
    echo "  rank $r on $(awk '{print $2}' "$dir/rank$r.pid"): ended ${ended[$r]:-never} s after; $how"
  done
  echo "  mpirun: ended ${ended[m]:-never (still running)} s after"
  if [[ -z "${ended[m]:-}" ]]; then
    echo "  mpirun: still running $(since "$(now)" "$t0") s after (killed by the test)"
  fi
}

# rank_status R: the rank's exit status, or 137 if it was SIGKILLed before recording one.
rank_status() { if [[ -s "$dir/rank$1.exit" ]]; then awk '{print $1}' "$dir/rank$1.exit"; else echo 137; fi; }

# Ends what a case left behind (mpirun waiting for an unreachable daemon, that daemon).
reap() {
  local i
  for ns in "$GSH_NS_LAUNCH" $(gsh_host_ns 1) $(gsh_host_ns 2); do _gsh_kill_ns "$ns" KILL; done
  wait "$mp" 2>/dev/null
  simhosts_link 2 up
  # Addresses that failed to resolve while the link was down stay FAILED in the neighbour
  # tables for a while, and the next launch's daemon on host 2 then cannot reach mpirun
  # (seen as "an inability to create a connection back to mpirun", 3 runs in 4 here).
  for ns in "$GSH_NS_LAUNCH" $(gsh_host_ns 1) $(gsh_host_ns 2); do
    _gsh_t ip -n "$ns" neigh flush all 2>/dev/null
  done
}

# ---- 1. Partition.
echo "== partition: host 2's link down after step $K, --timeout_s=$T"
start partition "$N" "$T" --checkpoint_dir="$tmp/ck" --checkpoint_every=1
wait_step "$K"
simhosts_link 2 down || fail "could not bring the link down"
t0=$(now)
at_down=$(grep -c '"step"' "$dir/metrics.jsonl")
echo "  the link went down after step $at_down of $N"
[[ "$at_down" -lt "$N" ]] || fail "partition: the run ended before the link went down"
echo "  link down at $(date -u +%T.%N | cut -c1-12); $(uptime | sed 's/.*load/load/')"
watch "$t0" $((T + 25))
lingering=$(for n in 1 2; do _gsh_t ip netns pids "$(gsh_host_ns "$n")"; done | xargs -r ps -o comm= -p | sort | uniq -c | tr '\n' ' ')
echo "  left in the hosts' namespaces then (killed by the test): ${lingering:-nothing}"
for r in 0 1 2 3; do
  [[ -n "${ended[$r]:-}" ]] || { reap; fail "partition: rank $r did not end within $((T + 25)) s"; }
  within "${ended[$r]}" $((T + 5)) || { reap; fail "partition: rank $r ended ${ended[$r]} s after the link went down (bound $((T + 5)) s)"; }
  st=$(rank_status "$r")
  [[ "$st" -ne 0 ]] || { reap; fail "partition: rank $r exited 0"; }
  if [[ "$st" -eq 1 ]]; then
    # (rank R of W) is the rank in the communicator that timed out: the world, or a
    # sub-group such as an EP or data-parallel group.
    grep -qE "mpi [a-z_0-9]+ #[0-9]+ \(rank [0-9]+ of [0-9]+\): not every rank arrived within the timeout" "$dir/rank$r.log" \
      || { reap; fail "partition: rank $r exited 1 without naming the timed-out operation: $(tail -3 "$dir/rank$r.log")"; }
    # ... and the peers it waited for, as they answered or did not (cut off: no answer).
    grep -qE "not every rank arrived within the timeout of [^;]*; waited for rank [0-9]+" "$dir/rank$r.log" \
      || { reap; fail "partition: rank $r exited 1 without naming the peer it waited for: $(tail -3 "$dir/rank$r.log")"; }
  fi
done
for r in 2 3; do  # host 2's ranks cannot hear from the launcher: they must end on their own
  grep -h "not every rank arrived" "$dir/rank$r.log" | sed 's/^/  /'
  [[ "$(rank_status "$r")" -eq 1 ]] || { reap; fail "partition: rank $r (host 2) did not end on its own timeout"; }
done
grep -h "not every rank arrived" "$dir/rank0.log" "$dir/rank1.log" | sed 's/^/  /'
reap
last=$(grep -o '"step":[0-9]*' "$dir/metrics.jsonl" | tail -1)
echo "  last logged step: ${last#*:}"

# The last committed checkpoint resumes on host 1 alone (world 2) to step N.
d1="$tmp/resume1"; mkdir -p "$d1"
simhosts_mpirun -np 2 --host "$(gsh_host_name 1):2" "$bin" "${tiny[@]}" --backend=mpi --world=2 \
  --ep=2 --micro_batch=2 --steps="$N" --timeout_s=60 --checkpoint_dir="$tmp/ck" --resume \
  --export="$tmp/resumed.safetensors" > "$d1/mpirun.log" 2>&1 \
  || { tail -20 "$d1/mpirun.log"; fail "resuming after the partition failed"; }
grep -m1 "^resumed from step" "$d1/mpirun.log" | sed 's/^/  /'
cmp -s "$tmp/ref.safetensors" "$tmp/resumed.safetensors" \
  || fail "the run resumed after the partition differs from the uninterrupted run"
echo "  identical: resumed on one host after the partition vs uninterrupted"

# ---- 2. A link that comes back within the timeout.
echo "== link flap: host 2's link down after step $K for ${FLAP_S} s, --timeout_s=30"
start flap "$N" 30 --export="$tmp/flap.safetensors" --checkpoint_dir="$tmp/ck_flap" --checkpoint_every=1
wait_step "$K"
simhosts_link 2 down || fail "could not bring the link down"
t0=$(now)
at_down=$(grep -c '"step"' "$dir/metrics.jsonl")
sleep "$FLAP_S"
simhosts_link 2 up || fail "could not bring the link up"
echo "  the link went down after step $at_down of $N, up ${FLAP_S} s later"
watch "$t0" 90
# The outage must have hit the run: no rank finished before the link came back.
for r in 0 1 2 3; do
  [[ -z "${ended[$r]:-}" ]] || within "$FLAP_S" "${ended[$r]}" \
    || { reap; fail "link flap: rank $r ended ${ended[$r]} s after the link went down, before it came back: the outage missed the run"; }
done
wait "$mp"; rc=$?
if [[ $rc -ne 0 ]]; then
  for r in 0 1 2 3; do tail -3 "$dir/rank$r.log"; done
  reap
  fail "link flap: the run did not survive a ${FLAP_S} s outage (mpirun exit $rc)"
fi
cmp -s "$tmp/ref.safetensors" "$tmp/flap.safetensors" \
  || fail "link flap: the run finished with other bits than the uninterrupted run"
echo "  the run continued and finished with the uninterrupted run's bits"

# ---- 3. Every rank of host 2 SIGKILLed.
echo "== host 2's ranks SIGKILLed after step $K, --timeout_s=120"
start kill "$N" 120 --checkpoint_dir="$tmp/ck_kill" --checkpoint_every=1
wait_step "$K"
victims="$(awk '{print $1}' "$dir/rank2.pid") $(awk '{print $1}' "$dir/rank3.pid")"
kill -KILL $victims
t0=$(now)
at_down=$(grep -c '"step"' "$dir/metrics.jsonl")
echo "  SIGKILLed host 2's ranks after step $at_down of $N"
[[ "$at_down" -lt "$N" ]] || fail "kill: the run ended before the ranks were killed"
echo "  killed $victims; $(uptime | sed 's/.*load/load/')"
watch "$t0" 30
for r in 0 1; do
  [[ -n "${ended[$r]:-}" ]] || { reap; fail "kill: rank $r did not end within 30 s"; }
  within "${ended[$r]}" 5 || { reap; fail "kill: rank $r ended ${ended[$r]} s after (bound 5 s)"; }
  [[ "$(rank_status "$r")" -ne 0 ]] || { reap; fail "kill: rank $r exited 0"; }
done
[[ -n "${ended[m]:-}" ]] && within "${ended[m]}" 5 || { reap; fail "kill: mpirun did not end within 5 s"; }
wait "$mp"; rc=$?
echo "  mpirun exit status $rc"
[[ $rc -ne 0 ]] || fail "kill: mpirun exited 0"
reap

echo "PASS: partition, link flap and a killed host between 2 simulated hosts"
