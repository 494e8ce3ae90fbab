#!/usr/bin/env bash
# A failure on one MPI rank ends every rank of the job, promptly, with a non-zero status:
#   mpi_fault_test.sh MOE_LM_BINARY MPIRUN_TEST_SH
# Faults come from the test-only hook GRADSUM_TEST_FAULT=MODE:RANK:STEP (train/fault_injection.h).
# - stop: rank 1 is SIGSTOPped at step 2; rank 0 times out in its next collective (--timeout_s=3),
#   reports DeadlineExceeded and aborts the job, which takes the stopped rank down too.
#   The report names the peer it waited for: rank 1, which does not answer.
# - stall: rank 1 sleeps at step 2 outside any collective; rank 0 times out and names rank 1
#   with the last operation it ran (its progress thread answers).
# - kill: rank 1 dies (SIGKILL) at step 2; the launcher ends the others.
# - fail: rank 1 fails outside any collective at step 2; with a long collective timeout
#   (--timeout_s=120) every rank still learns at once, at the step boundary, and rank 0
#   reports rank 1's own message.
# - stop under --sharding=hsdp (shard groups of 1): as stop.
# - term with --save_on_signal: rank 1 gets SIGTERM at the start of step 3 (a preemption
#   notice to one process); every rank stops at that step boundary after saving steps 1-2,
#   the job ends non-zero naming the signal and the checkpoint, and --resume continues.
# - different --seed on the two ranks: refused at start naming the field and the ranks.
# - ringstop at world 4 with --cp=2: rank 1 stops inside the CP ring's exchange (its receive
#   posted, its send not), where its ring neighbour waits for it in a point-to-point receive
#   and the other ranks in collectives of groups that need not hold rank 1. Every timeout
#   report names world rank 1: as not answering, or as the peer of a pending receive
#   (issue 50 item 3: before, a data-parallel group's report said only "rank 0 (in no
#   operation; its last was mpi all_gather #55)").
# For each: the job's status is non-zero, no process of the job is left, and it ended well
# before the bound (a hang check, not a speed test; the hard kill comes 30 s after it).
set -uo pipefail
bin="$1"
mpirun_sh="$2"
tmp="${TEST_TMPDIR:-$(mktemp -d)}/mpi_fault"
rm -rf "$tmp"; mkdir -p "$tmp"
fail() { echo "FAIL: $*"; exit 1; }
tiny=(--backend=mpi --world=2 --ep=2 --grad_acc=1 --dim=8 --expert_dim=8 --experts=4
      --seq_len=32 --max_doc_len=24 --micro_batch=2 --steps=50)
bound=90  # seconds; every case ends within its collective timeout plus a few seconds

run_case() {  # run_case NAME FAULT TIMEOUT_S [extra args...]
  local name="$1" fault="$2" timeout_s="$3"; shift 3
  local out="$tmp/$name.txt"
  local start=$SECONDS
  # The unique --metrics path marks this job's processes (checked below).
  GRADSUM_TEST_FAULT="$fault" GRADSUM_MPI_TIMEOUT_S=$((bound + 30)) \
    "$mpirun_sh" 2 "$bin" "${tiny[@]}" --timeout_s="$timeout_s" \
    --metrics="$tmp/$name.metrics.jsonl" --log_every=1 "$@" > "$out" 2>&1
  local rc=$? elapsed=$((SECONDS - start))
  echo "$name: exit $rc after ${elapsed}s"
  [ "$rc" -ne 0 ] || fail "$name: the job exited 0: $(cat "$out")"
  # (137 is also mpirun's status when a rank was SIGKILLed; a hang shows in the time.)
  [ "$elapsed" -lt "$bound" ] || fail "$name: took ${elapsed}s (bound ${bound}s): $(cat "$out")"
  local left
  left=$(pgrep -f -- "$tmp/$name.metrics.jsonl" || true)
  if [ -n "$left" ]; then
    kill -9 $left 2>/dev/null
    fail "$name: processes of the job outlived it: $left"
  fi
}

run_case stop stop:1:2 3
grep -q "DEADLINE_EXCEEDED" "$tmp/stop.txt" || fail "stop: no DeadlineExceeded report: $(cat "$tmp/stop.txt")"
grep -q "rank 0" "$tmp/stop.txt" || fail "stop: the report does not name rank 0: $(cat "$tmp/stop.txt")"
# ... and the peer it waited for: stopped, it cannot answer where it is.
grep -q "waited for rank 1 (no answer within" "$tmp/stop.txt" \
  || fail "stop: the report does not name rank 1 as unanswering: $(cat "$tmp/stop.txt")"

# stall: rank 1 sleeps outside any collective; its progress thread still answers, so rank 0
# names it and the last operation it ran.
run_case stall stall:1:2 3
grep -qE "waited for rank 1 \(in no operation; its last was mpi [a-z_]+ #[0-9]+\)" "$tmp/stall.txt" \
  || fail "stall: the report does not say where rank 1 is: $(cat "$tmp/stall.txt")"

run_case kill kill:1:2 3

# The same stop under hsdp (SEMANTICS.md §7; shard groups of 1, replicated twice: every
# gradient crosses the replica group): rank 0 times out and ends the job the same way.
run_case stop_hsdp stop:1:2 3 --sharding=hsdp --ep=1 --shard_group=1
grep -q "DEADLINE_EXCEEDED" "$tmp/stop_hsdp.txt" \
  || fail "stop_hsdp: no DeadlineExceeded report: $(cat "$tmp/stop_hsdp.txt")"

run_case fail fail:1:2 120
grep -q "step 2 failed on rank 1 of 2: INTERNAL: injected fault on rank 1 at step 2" "$tmp/fail.txt" \
  || fail "fail: rank 1's message was not reported: $(cat "$tmp/fail.txt")"
[ "$(grep -c '^step ' "$tmp/fail.txt")" -eq 1 ] || fail "fail: expected exactly step 1 to run"

run_case term term:1:3 120 --checkpoint_dir="$tmp/term_ckpt" --save_on_signal
grep -q "stopped by signal 15 (Terminated) after step 2; checkpoint $tmp/term_ckpt/step-00000002" \
  "$tmp/term.txt" || fail "term: no stop report naming the checkpoint: $(cat "$tmp/term.txt")"
[ "$(grep -c '^step ' "$tmp/term.txt")" -eq 2 ] || fail "term: expected exactly steps 1-2 to run"
[ -f "$tmp/term_ckpt/step-00000002/checkpoint.json" ] || fail "term: step 2's checkpoint is not committed"
GRADSUM_MPI_TIMEOUT_S=$((bound + 30)) "$mpirun_sh" 2 "$bin" "${tiny[@]}" --steps=4 --timeout_s=120 \
  --checkpoint_dir="$tmp/term_ckpt" --resume > "$tmp/term_resume.txt" 2>&1 \
  || fail "term: the resume failed: $(cat "$tmp/term_resume.txt")"
grep -q "resumed from step 2" "$tmp/term_resume.txt" \
  || fail "term: the resume did not start from step 2: $(cat "$tmp/term_resume.txt")"

# Ranks launched with different seeds (MPMD: one process per app context).
GRADSUM_MPI_TIMEOUT_S=$((bound + 30)) "$mpirun_sh" 1 "$bin" "${tiny[@]}" --timeout_s=120 --seed=1 \
  : -np 1 "$bin" "${tiny[@]}" --timeout_s=120 --seed=2 > "$tmp/seed.txt" 2>&1
rc=$?
[ "$rc" -ne 0 ] || fail "different seeds: exit 0: $(cat "$tmp/seed.txt")"
grep -q "seed (1 on rank 0) differs: ranks {0} vs {1}" "$tmp/seed.txt" \
  || fail "different seeds: the field and ranks were not named: $(cat "$tmp/seed.txt")"
ring=(--backend=mpi --world=4 --ep=1 --cp=2 --grad_acc=1 --dim=8 --expert_dim=8 --experts=4
      --seq_len=32 --max_doc_len=24 --micro_batch=2 --steps=50)
start=$SECONDS
GRADSUM_TEST_FAULT=ringstop:1:2 GRADSUM_MPI_TIMEOUT_S=$((bound + 30)) \
  "$mpirun_sh" 4 "$bin" "${ring[@]}" --timeout_s=3 --metrics="$tmp/ringstop.metrics.jsonl" \
  > "$tmp/ringstop.txt" 2>&1
rc=$?
elapsed=$((SECONDS - start))
echo "ringstop: exit $rc after ${elapsed}s"
[ "$rc" -ne 0 ] || fail "ringstop: the job exited 0: $(cat "$tmp/ringstop.txt")"
[ "$elapsed" -lt "$bound" ] || fail "ringstop: took ${elapsed}s: $(cat "$tmp/ringstop.txt")"
left=$(pgrep -f -- "$tmp/ringstop.metrics.jsonl" || true)
if [ -n "$left" ]; then kill -9 $left 2>/dev/null; fail "ringstop: processes outlived the job: $left"; fi
reports=$(grep -E "not every rank arrived|did not post the matching" "$tmp/ringstop.txt")
[ -n "$reports" ] || fail "ringstop: no timeout report: $(cat "$tmp/ringstop.txt")"
named='world rank 1 is pending|world rank 1\) \(no answer|[ (]rank 1 \(no answer'
while IFS= read -r line; do
  echo "$line" | grep -qE "$named" || fail "ringstop: a report does not name world rank 1: $line"
done <<< "$reports"

for name in stop stop_hsdp kill fail term ringstop; do echo "--- $name"; tail -4 "$tmp/$name.txt"; done
echo "PASS"
