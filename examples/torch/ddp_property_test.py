"""The seed's property in PyTorch: DDP gradients equal the single-process full-batch ones.

    ddp_property_test.py --world W

On W gloo ranks (processes), for grad-acc G in {1, 2}, CE mode token and sample (uneven
valid-token counts per rank, padding, several documents per sequence), two training steps
of train_ddp.gradsum_step (the LM head fused into linear_cross_entropy, and through
logits + cross_entropy) and of train_ddp.legacy_step (SEMANTICS.md §9's migration check:
autograd all_reduce + DDP's averaging). After each step's reduction every rank's gradient
of every parameter must equal moe_model.reference_step (one process, float64, the whole
global batch, written out from the formulas) to 1e-5, and the logged global loss must
equal the reference loss. Between the steps every run and the reference apply the same
SGD update to their own parameters.
"""

import argparse
import sys
import unittest

import torch

import gloo_ranks
import moe_model
import train_ddp

STEPS = 2
LR = 0.5
TOL = 1e-5
RUNS = [(g, mode, variant) for g in (1, 2) for mode in ("token", "sample")
        for variant in ("gradsum_linear", "gradsum_logits", "legacy")]


def rank_main(rank, world):
    """Every run on this rank: per run and step, the reduced gradients and logged terms."""
    import torch.distributed as dist
    cfg = moe_model.Config()
    loss_group = dist.new_group(list(range(world)))
    results = {}
    for g, mode, variant in RUNS:
        model = moe_model.make_model(cfg)
        legacy = variant == "legacy"
        ddp = train_ddp.legacy_ddp(model) if legacy else train_ddp.gradsum_ddp(model)
        steps = []
        for step in range(STEPS):
            batches = [moe_model.micro_batch(cfg, step, rank, m) for m in range(g)]
            model.zero_grad(set_to_none=True)
            if legacy:
                terms = train_ddp.legacy_step(ddp, batches, cfg, mode, loss_group=loss_group)
            else:
                terms = train_ddp.gradsum_step(ddp, batches, cfg, mode,
                                               ce_impl=variant.split("_")[1])
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            steps.append((grads, terms))
            with torch.no_grad():
                for p in model.parameters():
                    p -= LR * p.grad
        results[(g, mode, variant)] = steps
    return results


def reference_runs(world):
    """Per (G, mode) and step: the float64 single-process loss, gradients and terms."""
    cfg = moe_model.Config()
    out = {}
    for g in (1, 2):
        for mode in ("token", "sample"):
            model = moe_model.make_model(cfg).double()
            steps = []
            for step in range(STEPS):
                batches = moe_model.step_batches(cfg, step, world, g)
                steps.append(moe_model.reference_step(model, batches, cfg, mode))
                with torch.no_grad():
                    for p in model.parameters():
                        p -= LR * p.grad
            out[(g, mode)] = steps
    return out


class DdpPropertyTest(unittest.TestCase):
    world = 1

    @classmethod
    def setUpClass(cls):
        cls.ranks = gloo_ranks.run(rank_main, cls.world, timeout_s=300)
        cls.reference = reference_runs(cls.world)

    def test_gradients_and_logged_loss_equal_the_full_batch_reference(self):
        worst = 0.0
        for g, mode, variant in RUNS:
            for step in range(STEPS):
                ref_loss, ref_grads, ref_terms = self.reference[(g, mode)][step]
                for rank, res in enumerate(self.ranks):
                    grads, terms = res[(g, mode, variant)][step]
                    where = (f"world {self.world}, G {g}, {mode} mode, {variant}, step "
                             f"{step + 1}, rank {rank}")
                    self.assertEqual(set(grads), set(ref_grads), where)
                    for name, ref in ref_grads.items():
                        got = grads[name].double()
                        scale = max(float(ref.abs().max()), 1e-30)
                        err = float((got - ref).abs().max()) / scale  # relative, max norm
                        worst = max(worst, err)
                        self.assertLessEqual(err, TOL, f"{where}, {name}: max error {err:.3g} "
                                             f"(|ref| max {float(ref.abs().max()):.3g})")
                    logged = sum(terms.values())
                    self.assertLessEqual(abs(logged - ref_loss), TOL * abs(ref_loss),
                                         f"{where}: logged loss {logged} vs {ref_loss}")
                    for k in ref_terms:
                        self.assertLessEqual(abs(terms[k] - ref_terms[k]),
                                             TOL * max(abs(ref_terms[k]), 1e-3), f"{where}, {k}")
        print(f"world {self.world}: {len(RUNS)} runs x {STEPS} steps x {self.world} ranks; "
              f"worst gradient error (max norm, relative to the parameter's largest reference "
              f"gradient) {worst:.2e}", file=sys.stderr)

    def test_the_aux_terms_are_not_negligible(self):
        # The check would be vacuous if the router terms were far below the tolerance.
        _, _, terms = self.reference[(2, "token")][0]
        self.assertGreater(terms["z"], 100 * TOL)
        self.assertGreater(terms["bal"], 100 * TOL)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, required=True)
    args, rest = parser.parse_known_args()
    DdpPropertyTest.world = args.world
    unittest.main(argv=[sys.argv[0]] + rest)
