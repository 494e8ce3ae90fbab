"""Flags shared by the tests that launch //train:moe_lm under mpirun with --parity_check."""

# A tiny model and data set (E = 4, D = H = 8, 2 sequences of 32 per rank and micro-batch)
# with aux-loss weights large enough that their gradients matter.
TINY_PARITY_ARGS = [
    "--dim=8",
    "--expert_dim=8",
    "--experts=4",
    "--seq_len=32",
    "--max_doc_len=24",
    "--micro_batch=2",
    "--alpha_b=0.01",
    "--alpha_z=0.01",
    "--parity_check",
]
