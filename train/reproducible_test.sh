#!/usr/bin/env bash
# --reproducible (docs/REPRODUCIBILITY.md): the same bits at every mesh.
#   reproducible_test.sh MOE_LM_BINARY MPIRUN_TEST_SH
# Global batch B = world / (sp cp) x grad_acc x micro_batch = 8 sequences in every run.
# 1. Fixed G = 2 (default-style alpha_b > 0): eight steps on seven meshes (world 1, 2, 4;
#    ep 1, 2, 4; fsdp and replicated; reduce every micro-batch or once; layers_per_unit 1
#    and 2; thread and Open MPI backends; baseline and AVX builds of the kernels). The
#    --export files must be byte-identical, and so must every step's logged ce, z, bal,
#    loss, grad_norm and maxvio (doubles printed with 17 digits).
# 2. alpha_b = 0 (the balancing loss is the only G-dependent term, SEMANTICS.md §5): G = 1,
#    4 and 2 (world 1, 2, 4, thread and MPI) give identical bits too.
# 3. The sample and square CE weightings and bf16 compute: two meshes each.
# 4. A run checkpointed after 3 steps on one mesh and resumed on another (Open MPI) ends
#    with the bits of the uninterrupted run; and hsdp -> fsdp -> replicated -> hsdp the same.
#    (Part 1 includes four hsdp meshes: shard groups of 2 and 1, thread and Open MPI.)
# 5. With attention: SP sizes 1, 2, 4 (thread and Open MPI), and a resume from SP 2 onto 4;
#    CP sizes 1, 2, 4, CP 4 x SP 2 (thread and Open MPI), and a resume from CP 2 onto 4 x 2.
# 6. --expert_bias_speed (SEMANTICS.md §5.1): world 1 vs Open MPI world 4 and vs full
#    recomputation on world 2; sigmoid scores on world 1 vs 4.
# 7. --mtp_depth=2 (SEMANTICS.md §15.1): world 1 vs Open MPI world 4 and full recomputation
#    on world 2; with attention, SP 2, CP 2 and CP 2 x SP 2 (thread and Open MPI).
# 8. The default row block (no --repro_block; issue 50, item 1) at the binary's default
#    shape (seq_len 128, 4 heads, dim 128): SP 1, 2, 4 and CP 2 give one export.
# Every run also passes --parity_check on step 1 (gradients within 1e-5 of the double
# reference; 3e-2 with bf16 compute), and the normal mode must NOT give identical bits across two of the meshes
# (else this test could not tell the modes apart).
set -euo pipefail
bin="$1"
mpirun_sh="$2"
tmp="${TEST_TMPDIR:-$(mktemp -d)}/reproducible"
rm -rf "$tmp"; mkdir -p "$tmp"
fail() { echo "FAIL: $*"; exit 1; }
tiny=(--dim=8 --expert_dim=8 --experts=4 --layers=2 --seq_len=32 --max_doc_len=24
      --alpha_z=0.01 --steps=8 --timeout_s=60 --parity_check)

# run NAME BACKEND_PREFIX... -- FLAGS...: one training run writing NAME.safetensors/.jsonl.
run() {
  local name="$1"; shift
  local launch=()
  while [[ "$1" != "--" ]]; do launch+=("$1"); shift; done
  shift
  "${launch[@]}" "$bin" "${tiny[@]}" "$@" --export="$tmp/$name.safetensors" \
    --metrics="$tmp/$name.jsonl" > "$tmp/$name.log" 2>&1 \
    || { tail -20 "$tmp/$name.log"; fail "run $name"; }
}
mpi4=("$mpirun_sh" 4)
mpi2=("$mpirun_sh" 2)

# The logged values that must agree bit for bit (17 significant digits round-trip a double).
same_metrics() {
  python3 - "$tmp/$1.jsonl" "$tmp/$2.jsonl" <<'PY'
import json, sys
def rows(p):
    return [json.loads(l) for l in open(p) if l.strip()]
a, b = rows(sys.argv[1]), rows(sys.argv[2])
assert len(a) == len(b) == 8, (len(a), len(b))
for x, y in zip(a, b):
    for k in ("ce", "z", "bal", "loss", "grad_norm", "valid_tokens", "maxvio",
              "tokens_per_expert", "mtp"):
        if x.get(k) != y.get(k):
            sys.exit(f"step {x['step']}: {k} {x[k]!r} != {y[k]!r}")
PY
}

check_same() {  # check_same REF OTHER
  cmp -s "$tmp/$1.safetensors" "$tmp/$2.safetensors" \
    || fail "parameters after 8 steps differ: $1 vs $2"
  same_metrics "$1" "$2" || fail "logged values differ: $1 vs $2"
  echo "identical: $1 vs $2"
}

ab=(--alpha_b=0.01 --grad_acc=2)
run g2_w1 -- "${ab[@]}" --reproducible --world=1 --ep=1 --micro_batch=4
run g2_w2_fsdp -- "${ab[@]}" --reproducible --world=2 --ep=2 --micro_batch=2
# This one also forces the baseline builds of the run-time-picked kernels (vec_math, the CE
# rows, the exact adds): every build gives the same bits.
run g2_w2_repl env GRADSUM_VEC_ISA=generic GRADSUM_CE_ISA=generic GRADSUM_EXACT_ISA=generic \
  -- "${ab[@]}" --reproducible --world=2 --ep=1 --micro_batch=2 --sharding=replicated
run g2_w4_fsdp_once -- "${ab[@]}" --reproducible --world=4 --ep=2 --micro_batch=1 \
  --reduce_every_micro_batch=false --layers_per_unit=2
run g2_mpi4_repl "${mpi4[@]}" -- "${ab[@]}" --reproducible --backend=mpi --world=4 --ep=4 \
  --micro_batch=1 --sharding=replicated
run g2_mpi2_fsdp "${mpi2[@]}" -- "${ab[@]}" --reproducible --backend=mpi --world=2 --ep=2 \
  --micro_batch=2
run g2_mpi4_fsdp "${mpi4[@]}" -- "${ab[@]}" --reproducible --backend=mpi --world=4 --ep=1 \
  --micro_batch=1 --layers_per_unit=2
# HSDP (SEMANTICS.md §7): shard groups of 2 replicated twice (thread, EP 2; thread, EP 1,
# reducing once; Open MPI, EP 2), and groups of 1 (every unit whole, summed across 4).
run g2_w4_hsdp -- "${ab[@]}" --reproducible --world=4 --ep=2 --micro_batch=1 --sharding=hsdp \
  --shard_group=2
run g2_w4_hsdp_once -- "${ab[@]}" --reproducible --world=4 --ep=1 --micro_batch=1 \
  --sharding=hsdp --shard_group=2 --reduce_every_micro_batch=false
run g2_w4_hsdp_n1 -- "${ab[@]}" --reproducible --world=4 --ep=1 --micro_batch=1 \
  --sharding=hsdp --shard_group=1
run g2_mpi4_hsdp "${mpi4[@]}" -- "${ab[@]}" --reproducible --backend=mpi --world=4 --ep=2 \
  --micro_batch=1 --sharding=hsdp --shard_group=2
for other in g2_w2_fsdp g2_w2_repl g2_w4_fsdp_once g2_mpi4_repl g2_mpi2_fsdp g2_mpi4_fsdp \
    g2_w4_hsdp g2_w4_hsdp_once g2_w4_hsdp_n1 g2_mpi4_hsdp; do
  check_same g2_w1 "$other"
done

# Any G when alpha_b = 0.
run a0_g1_w1 -- --alpha_b=0 --reproducible --grad_acc=1 --world=1 --ep=1 --micro_batch=8
run a0_g4_w2 -- --alpha_b=0 --reproducible --grad_acc=4 --world=2 --ep=2 --micro_batch=1 \
  --sharding=replicated
run a0_g2_mpi4 "${mpi4[@]}" -- --alpha_b=0 --reproducible --backend=mpi --grad_acc=2 \
  --world=4 --ep=2 --micro_batch=1
check_same a0_g1_w1 a0_g4_w2
check_same a0_g1_w1 a0_g2_mpi4

# The per-sample and per-square CE weightings (SEMANTICS.md §3: D is a sum of fractional
# weights) and the bf16 compute dtype (another model, but as deterministic) are exact the
# same way.
run sample_w1 -- "${ab[@]}" --reproducible --ce_mode=sample --world=1 --ep=1 --micro_batch=4
run sample_mpi4 "${mpi4[@]}" -- "${ab[@]}" --reproducible --ce_mode=sample --backend=mpi \
  --world=4 --ep=2 --micro_batch=1
check_same sample_w1 sample_mpi4
run square_w1 -- "${ab[@]}" --reproducible --ce_mode=square --world=1 --ep=1 --micro_batch=4
run square_w4 -- "${ab[@]}" --reproducible --ce_mode=square --world=4 --ep=4 --micro_batch=1 \
  --sharding=replicated
check_same square_w1 square_w4
run bf16_w1 -- "${ab[@]}" --reproducible --compute_dtype=bf16 --world=1 --ep=1 --micro_batch=4
run bf16_mpi2 "${mpi2[@]}" -- "${ab[@]}" --reproducible --compute_dtype=bf16 --backend=mpi \
  --world=2 --ep=2 --micro_batch=2
check_same bf16_w1 bf16_mpi2

# Resume onto another mesh: 3 steps on world 2 (thread, fsdp), then Open MPI world 4
# (replicated) to step 8.
"$bin" "${tiny[@]}" "${ab[@]}" --reproducible --world=2 --ep=2 --micro_batch=2 --steps=3 \
  --checkpoint_dir="$tmp/ckpt" > "$tmp/resume_a.log" 2>&1 \
  || { tail -20 "$tmp/resume_a.log"; fail "first resume segment"; }
run resumed "${mpi4[@]}" -- "${ab[@]}" --reproducible --backend=mpi --world=4 --ep=4 \
  --micro_batch=1 --sharding=replicated --checkpoint_dir="$tmp/ckpt" --resume
grep -q "^resumed from step 3" "$tmp/resumed.log" || fail "the MPI segment did not resume"
cmp -s "$tmp/g2_w1.safetensors" "$tmp/resumed.safetensors" \
  || fail "the resumed run's parameters differ from the uninterrupted run's"
python3 - "$tmp/g2_w1.jsonl" "$tmp/resumed.jsonl" <<'PY' || fail "the resumed run logged other values"
import json, sys
ref = {r["step"]: r for r in map(json.loads, filter(str.strip, open(sys.argv[1])))}
got = [json.loads(l) for l in open(sys.argv[2]) if l.strip()]
assert [r["step"] for r in got] == [4, 5, 6, 7, 8], [r["step"] for r in got]
for r in got:
    for k in ("ce", "z", "bal", "loss", "grad_norm"):
        if r[k] != ref[r["step"]][k]:
            sys.exit(f"step {r['step']}: {k} {r[k]!r} != {ref[r['step']][k]!r}")
PY
echo "identical: g2_w1 vs the run resumed on another mesh"

# HSDP checkpoints read as fsdp's (SEMANTICS.md §7): hsdp (world 4, groups of 2) for 2
# steps -> fsdp (world 2) to step 4 -> replicated (Open MPI, world 4) to step 6 -> hsdp
# (Open MPI, world 4, groups of 2) to step 8, bit-identical to the uninterrupted run.
hsdp_seg() {  # hsdp_seg NAME STEPS LAUNCH... -- FLAGS...
  local name="$1" steps="$2"; shift 2
  local launch=()
  while [[ "$1" != "--" ]]; do launch+=("$1"); shift; done
  shift
  "${launch[@]}" "$bin" "${tiny[@]}" "${ab[@]}" --reproducible --steps="$steps" \
    --checkpoint_dir="$tmp/ckpt_hsdp" "$@" > "$tmp/$name.log" 2>&1 \
    || { tail -20 "$tmp/$name.log"; fail "HSDP resume segment $name"; }
}
hsdp_seg hsdp_a 2 -- --world=4 --ep=2 --micro_batch=1 --sharding=hsdp --shard_group=2
hsdp_seg hsdp_b 4 -- --world=2 --ep=2 --micro_batch=2 --resume
grep -q "^resumed from step 2" "$tmp/hsdp_b.log" || fail "fsdp did not resume the hsdp checkpoint"
hsdp_seg hsdp_c 6 "${mpi4[@]}" -- --backend=mpi --world=4 --ep=4 --micro_batch=1 \
  --sharding=replicated --resume
grep -q "^resumed from step 4" "$tmp/hsdp_c.log" || fail "replicated did not resume"
run hsdp_resumed "${mpi4[@]}" -- "${ab[@]}" --reproducible --backend=mpi --world=4 --ep=2 \
  --micro_batch=1 --sharding=hsdp --shard_group=2 --checkpoint_dir="$tmp/ckpt_hsdp" --resume
grep -q "^resumed from step 6" "$tmp/hsdp_resumed.log" || fail "hsdp did not resume"
cmp -s "$tmp/g2_w1.safetensors" "$tmp/hsdp_resumed.safetensors" \
  || fail "hsdp -> fsdp -> replicated -> hsdp differs from the uninterrupted run"
echo "identical: g2_w1 vs hsdp -> fsdp -> replicated -> hsdp resumes"

# Attention and sequence parallelism (SEMANTICS.md §12): the same bits at SP sizes 1, 2 and 4
# (row blocks of 8 tokens, which every rank's slice of a 32-token sequence holds whole),
# crossed with EP sizes, both modes and both backends, and across a resume onto another S.
attn=(--attention=causal --heads=4 --kv_heads=2 --repro_block=8 "${ab[@]}" --reproducible)
run sp1_w1 -- "${attn[@]}" --world=1 --ep=1 --micro_batch=4
run sp2_w2 -- "${attn[@]}" --world=2 --ep=2 --sp=2 --micro_batch=4
run sp4_w4_repl -- "${attn[@]}" --world=4 --ep=2 --sp=4 --micro_batch=4 --sharding=replicated
run sp2_mpi4 "${mpi4[@]}" -- "${attn[@]}" --backend=mpi --world=4 --ep=4 --sp=2 --micro_batch=2
for other in sp2_w2 sp4_w4_repl sp2_mpi4; do check_same sp1_w1 "$other"; done
"$bin" "${tiny[@]}" "${attn[@]}" --world=2 --ep=1 --sp=2 --micro_batch=4 --steps=3 \
  --checkpoint_dir="$tmp/ckpt_sp" > "$tmp/resume_sp_a.log" 2>&1 \
  || { tail -20 "$tmp/resume_sp_a.log"; fail "first SP resume segment"; }
run sp_resumed -- "${attn[@]}" --world=4 --ep=2 --sp=4 --micro_batch=4 \
  --checkpoint_dir="$tmp/ckpt_sp" --resume
cmp -s "$tmp/sp1_w1.safetensors" "$tmp/sp_resumed.safetensors" \
  || fail "the run resumed from SP 2 onto SP 4 differs from the uninterrupted run"
echo "identical: sp1_w1 vs the run resumed from SP 2 onto SP 4"

# Context parallelism (SEMANTICS.md §16): reproducible mode's gathered attention gives the
# same bits at CP sizes 1, 2 and 4, crossed with SP 2, EP sizes, both modes and both
# backends, and across a resume from CP 2 onto CP 4 x SP 2. Row blocks of 4 tokens: they
# must divide the chunks (32 / 2C tokens; a block holding two chunks would put a token at
# another place in its block than at C = 1).
cpa=(--attention=causal --heads=4 --kv_heads=2 --repro_block=4 "${ab[@]}" --reproducible)
run cp1_w1 -- "${cpa[@]}" --world=1 --ep=1 --micro_batch=4
run cp2_w2 -- "${cpa[@]}" --world=2 --ep=2 --cp=2 --micro_batch=4
run cp4_w4_repl -- "${cpa[@]}" --world=4 --ep=2 --cp=4 --micro_batch=4 --sharding=replicated
run cp4_sp2_w8 -- "${cpa[@]}" --world=8 --ep=4 --cp=4 --sp=2 --micro_batch=4
run cp2_mpi4 "${mpi4[@]}" -- "${cpa[@]}" --backend=mpi --world=4 --ep=4 --cp=2 --micro_batch=2
for other in cp2_w2 cp4_w4_repl cp4_sp2_w8 cp2_mpi4; do check_same cp1_w1 "$other"; done
"$bin" "${tiny[@]}" "${cpa[@]}" --world=2 --ep=1 --cp=2 --micro_batch=4 --steps=3 \
  --checkpoint_dir="$tmp/ckpt_cp" > "$tmp/resume_cp_a.log" 2>&1 \
  || { tail -20 "$tmp/resume_cp_a.log"; fail "first CP resume segment"; }
run cp_resumed -- "${cpa[@]}" --world=8 --ep=2 --cp=4 --sp=2 --micro_batch=4 \
  --checkpoint_dir="$tmp/ckpt_cp" --resume
cmp -s "$tmp/cp1_w1.safetensors" "$tmp/cp_resumed.safetensors" \
  || fail "the run resumed from CP 2 onto CP 4 x SP 2 differs from the uninterrupted run"
echo "identical: cp1_w1 vs the run resumed from CP 2 onto CP 4 x SP 2"
cmp -s "$tmp/sp1_w1.safetensors" "$tmp/cp1_w1.safetensors" \
  && fail "row blocks of 4 and 8 gave the same bits: the CP lines would not see a change"

# The expert bias (SEMANTICS.md §5.1): the counts it moves by are exact integers, so the
# bias and the parameters are the same bits on every mesh, with full recomputation too
# (which must not count again), and with sigmoid scores; the export then holds the bias.
eb=("${ab[@]}" --expert_bias_speed=0.01)
run eb_w1 -- "${eb[@]}" --reproducible --world=1 --ep=1 --micro_batch=4
run eb_mpi4 "${mpi4[@]}" -- "${eb[@]}" --reproducible --backend=mpi --world=4 --ep=2 \
  --micro_batch=1
run eb_w2_full -- "${eb[@]}" --reproducible --world=2 --ep=2 --micro_batch=2 --recompute=full
check_same eb_w1 eb_mpi4
check_same eb_w1 eb_w2_full
grep -q "layers.1.expert_bias" "$tmp/eb_w1.safetensors" || fail "the export holds no expert bias"
cmp -s "$tmp/g2_w1.safetensors" "$tmp/eb_w1.safetensors" && fail "the expert bias changed nothing"
sig=(--alpha_b=0 --grad_acc=2 --router_score=sigmoid --expert_bias_speed=0.001)
run sig_w1 -- "${sig[@]}" --reproducible --world=1 --ep=1 --micro_batch=4
run sig_w4 -- "${sig[@]}" --reproducible --world=4 --ep=4 --micro_batch=1 --sharding=replicated
check_same sig_w1 sig_w4

# Multi-token prediction (SEMANTICS.md §15.1): every depth's tokens and labels are rolled
# by the loader on whole sequences and D_j is an exact count, so its blocks keep the bits on
# every mesh, with full recomputation, and under SP and CP (row blocks of 4 tokens).
mtp=("${ab[@]}" --mtp_depth=2 --mtp_scale=0.3 --reproducible)
run mtp_w1 -- "${mtp[@]}" --world=1 --ep=1 --micro_batch=4
run mtp_mpi4 "${mpi4[@]}" -- "${mtp[@]}" --backend=mpi --world=4 --ep=2 --micro_batch=1
run mtp_w2_full -- "${mtp[@]}" --world=2 --ep=2 --micro_batch=2 --recompute=full
check_same mtp_w1 mtp_mpi4
check_same mtp_w1 mtp_w2_full
cmp -s "$tmp/g2_w1.safetensors" "$tmp/mtp_w1.safetensors" && fail "--mtp_depth changed nothing"
mtpa=(--attention=causal --heads=4 --kv_heads=2 --repro_block=4 "${mtp[@]}")
run mtpa_w1 -- "${mtpa[@]}" --world=1 --ep=1 --micro_batch=4
run mtpa_sp2 -- "${mtpa[@]}" --world=2 --ep=2 --sp=2 --micro_batch=4
run mtpa_cp2 -- "${mtpa[@]}" --world=2 --ep=1 --cp=2 --micro_batch=4 --sharding=replicated
run mtpa_cp2_sp2_mpi4 "${mpi4[@]}" -- "${mtpa[@]}" --backend=mpi --world=4 --ep=2 --cp=2 \
  --sp=2 --micro_batch=4
for other in mtpa_sp2 mtpa_cp2 mtpa_cp2_sp2_mpi4; do check_same mtpa_w1 "$other"; done

# 8. The binary's default shape, no --repro_block, two steps: the default block is fixed by
#    the sequence length, so SP and CP sizes give the same bits with nothing to pass.
for m in "sp1 --world=1" "sp2 --world=2 --sp=2" "sp4 --world=4 --sp=4" "cp2 --world=2 --cp=2"; do
  name="default_${m%% *}"
  # shellcheck disable=SC2086
  "$bin" --reproducible --steps=2 --ep=1 --timeout_s=60 ${m#* } --export="$tmp/$name.safetensors" \
    > "$tmp/$name.log" 2>&1 || { tail -20 "$tmp/$name.log"; fail "run $name"; }
done
for other in default_sp2 default_sp4 default_cp2; do
  cmp -s "$tmp/default_sp1.safetensors" "$tmp/$other.safetensors" \
    || fail "default shape: default_sp1 and $other differ (the default row block depends on the mesh)"
done
echo "identical: the default shape at SP 1, 2, 4 and CP 2, no --repro_block"

# The normal mode is not bit-identical across meshes (so the checks above can fail).
run normal_w1 -- "${ab[@]}" --world=1 --ep=1 --micro_batch=4
run normal_w2 -- "${ab[@]}" --world=2 --ep=2 --micro_batch=2
if cmp -s "$tmp/normal_w1.safetensors" "$tmp/normal_w2.safetensors"; then
  fail "the normal mode gave identical bits on two meshes: this test cannot tell"
fi

echo "PASS: --reproducible gives the same bits on every mesh, backend, sharding and resume"
