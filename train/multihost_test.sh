#!/usr/bin/env bash
# moe_lm over Open MPI between two simulated hosts (testing/simhosts.sh, docs/MULTIHOST.md):
#   multihost_test.sh MOE_LM_BINARY SIMHOSTS_SH
# Needs network namespaces (root); elsewhere it prints "SKIPPED: <why>" and passes.
# 2 hosts x 2 ranks, TCP between the hosts (vader only inside a host). Global batch
# B = world x grad_acc x micro_batch = 8 in every run, G = 2, --reproducible throughout:
# 1. world 4 over two hosts passes --parity_check, and its --export after 6 steps is
#    byte-identical to the thread backend's world 4 run with the same flags (the reference);
#    the metrics (ce, z, bal, loss, grad_norm) are identical too, and bytes crossed the link;
# 2. 3 steps on one host (world 2, both ranks in host 1's namespace) checkpointed, resumed
#    on two hosts (world 4) to step 6: the export is the reference's bytes;
# 3. the reverse: 3 steps on two hosts, resumed on one host (host 2): the reference's bytes.
# And (1b) hsdp with the default shard group, resolved to a host's 2 ranks: parity and the
# reference's bits.
set -uo pipefail
bin="$(realpath "$1")"
source "$2"
tmp="${TEST_TMPDIR:-$(mktemp -d)}/multihost"
rm -rf "$tmp"; mkdir -p "$tmp"
fail() { echo "FAIL: $*"; exit 1; }
simhosts_require_netns
GSH_LIMIT_S="${GSH_LIMIT_S:-240}"
simhosts_up 2 || fail "could not bring up the simulated hosts"
echo "hosts: $(cat "$GSH_HOSTFILE" | tr '\n' ' ')"

tiny=(--dim=8 --expert_dim=8 --experts=4 --layers=2 --seq_len=32 --max_doc_len=24
      --alpha_z=0.01 --alpha_b=0.01 --grad_acc=2 --timeout_s=60 --reproducible --steps=6)
two_hosts=(-np 4 --map-by ppr:2:node)
host1=(-np 2 --host "$(gsh_host_name 1):2")
host2=(-np 2 --host "$(gsh_host_name 2):2")

# run NAME LAUNCH... -- FLAGS...: one run writing NAME.log/.jsonl (and whatever FLAGS ask).
run() {
  local name="$1"; shift
  local launch=()
  while [[ "$1" != "--" ]]; do launch+=("$1"); shift; done
  shift
  local start=$SECONDS
  if ((${#launch[@]})); then
    simhosts_mpirun "${launch[@]}" "$bin" "${tiny[@]}" --backend=mpi "$@" \
      --metrics="$tmp/$name.jsonl" > "$tmp/$name.log" 2>&1
  else
    timeout --signal=KILL "$GSH_LIMIT_S" "$bin" "${tiny[@]}" "$@" \
      --metrics="$tmp/$name.jsonl" > "$tmp/$name.log" 2>&1
  fi
  local rc=$?
  echo "$name: exit $rc after $((SECONDS - start)) s"
  [[ $rc -eq 0 ]] || { tail -30 "$tmp/$name.log"; fail "run $name"; }
}

same_metrics() {  # same_metrics REF OTHER FIRST_STEP
  python3 - "$tmp/$1.jsonl" "$tmp/$2.jsonl" "$3" <<'PY'
import json, sys
ref = {r["step"]: r for r in map(json.loads, filter(str.strip, open(sys.argv[1])))}
got = [json.loads(l) for l in open(sys.argv[2]) if l.strip()]
first = int(sys.argv[3])
assert [r["step"] for r in got] == list(range(first, 7)), [r["step"] for r in got]
for r in got:
    for k in ("ce", "z", "bal", "loss", "grad_norm", "valid_tokens"):
        if r[k] != ref[r["step"]][k]:
            sys.exit(f"step {r['step']}: {k} {r[k]!r} != {ref[r['step']][k]!r}")
PY
}

# The reference: thread backend, world 4, the same flags.
run ref -- --backend=thread --world=4 --ep=2 --micro_batch=1 --parity_check \
  --export="$tmp/ref.safetensors"

# 1. Parity and bit-identity across the two hosts.
before=$(simhosts_link_bytes 2)
run hosts2 "${two_hosts[@]}" -- --world=4 --ep=2 --micro_batch=1 --parity_check \
  --export="$tmp/hosts2.safetensors"
after=$(simhosts_link_bytes 2)
grep -q "parity PASSED" "$tmp/hosts2.log" || fail "no 'parity PASSED' line: $(tail -5 "$tmp/hosts2.log")"
read -r rx0 tx0 <<< "$before"; read -r rx1 tx1 <<< "$after"
echo "host 2's link: received $((rx1 - rx0)) bytes, sent $((tx1 - tx0)) bytes during the run"
(( rx1 - rx0 > 100000 && tx1 - tx0 > 100000 )) || fail "too little traffic crossed host 2's link"
cmp -s "$tmp/ref.safetensors" "$tmp/hosts2.safetensors" \
  || fail "the two-host export differs from the thread backend's"
same_metrics ref hosts2 1 || fail "the two-host run logged other values than the thread run"
echo "identical: thread world 4 vs Open MPI on 2 hosts x 2 ranks (parity passed)"

# 1b. HSDP with the default shard group (the ranks of one host, from Open MPI): groups of 2
# inside each host, replicated across the link; parity, and the reference's bits.
run hsdp2 "${two_hosts[@]}" -- --world=4 --ep=2 --micro_batch=1 --parity_check \
  --sharding=hsdp --export="$tmp/hsdp2.safetensors"
grep -q "parity PASSED" "$tmp/hsdp2.log" || fail "hsdp: no 'parity PASSED' line"
grep -q "^hsdp: shard groups of 2 consecutive ranks, replicated 2 times" "$tmp/hsdp2.log" \
  || fail "hsdp: shard_group 0 did not resolve to the 2 ranks of a host: $(grep hsdp "$tmp/hsdp2.log")"
cmp -s "$tmp/ref.safetensors" "$tmp/hsdp2.safetensors" \
  || fail "the two-host hsdp export differs from the thread backend's fsdp"
same_metrics ref hsdp2 1 || fail "the two-host hsdp run logged other values than the thread run"
echo "identical: thread world 4 fsdp vs hsdp on 2 hosts x 2 ranks (a host per shard group)"

# 2 and 3: 3 steps on one mesh, checkpointed, resumed on the other to step 6.
# resume_case NAME WHAT FIRST_LAUNCH FIRST_MESH SECOND_LAUNCH SECOND_MESH (each a quoted list)
resume_case() {
  local name="$1" what="$2"; local -a l1 m1 l2 m2
  read -ra l1 <<< "$3"; read -ra m1 <<< "$4"; read -ra l2 <<< "$5"; read -ra m2 <<< "$6"
  run "${name}1" "${l1[@]}" -- "${m1[@]}" --steps=3 --checkpoint_dir="$tmp/ck_$name"
  run "${name}2" "${l2[@]}" -- "${m2[@]}" --checkpoint_dir="$tmp/ck_$name" \
    --resume --export="$tmp/${name}2.safetensors"
  grep -q "^resumed from step 3" "$tmp/${name}2.log" || fail "$what: the second segment did not resume"
  cmp -s "$tmp/ref.safetensors" "$tmp/${name}2.safetensors" \
    || fail "$what: the export differs from the uninterrupted run's"
  same_metrics ref "${name}2" 4 || fail "$what: other logged values"
  echo "identical: $what, 3 + 3 steps vs uninterrupted"
}
one_host_mesh="--world=2 --ep=2 --micro_batch=2"
two_host_mesh="--world=4 --ep=2 --micro_batch=1"
resume_case a "one host (world 2) -> two hosts (world 4)" \
  "${host1[*]}" "$one_host_mesh" "${two_hosts[*]}" "$two_host_mesh"
resume_case b "two hosts (world 4) -> one host (world 2)" \
  "${two_hosts[*]}" "$two_host_mesh" "${host2[*]}" "$one_host_mesh"

echo "PASS: 2 simulated hosts x 2 ranks: parity, thread-identical bits, resume both ways"
