"""gradsum_torch.dist on 3 gloo ranks: the step statistics, the expert counts, the SUM hook.

Every rank builds its micro-batches from a seed of (rank, m); this process rebuilds all of
them and computes the expected global values with plain torch (counts, sums, bincount, one
autograd pass over the concatenated batch). World 3 on purpose: not a power of two.
"""

import math
import unittest

import torch
import torch.distributed as dist
import torch.nn as nn

import gloo_ranks
import gradsum_torch as gt

WORLD = 3
G = 2
IGNORE = -100
E, K = 5, 2


def micro_batch(rank, m):
    """Labels (with padding and ignored tokens), sample ids and the mask of (rank, m)."""
    gen = torch.Generator().manual_seed(100 * rank + m)
    t = 10 + 3 * rank + m  # uneven sizes
    labels = torch.randint(0, 50, (t,), generator=gen)
    labels[torch.rand(t, generator=gen) < 0.3] = IGNORE
    mask = torch.ones(t, dtype=torch.bool)
    mask[-(rank + 1):] = False  # padding at the end
    labels[~mask] = IGNORE
    sample_ids = torch.arange(t) // 4
    return labels, sample_ids, mask


def topk_of(rank, m, layer):
    gen = torch.Generator().manual_seed(1000 * rank + 10 * m + layer)
    t = micro_batch(rank, m)[0].numel()
    return torch.rand(t, E, generator=gen).topk(K, dim=-1).indices


def model_data(rank):
    gen = torch.Generator().manual_seed(7 + rank)
    return torch.randn(6 + rank, 4, generator=gen)


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))


def ranks_main(rank, world):
    out = {}
    mbs = [micro_batch(rank, m) for m in range(G)]
    for mode in ("token", "sample"):
        s = gt.dist.step_stats(mbs, mode=mode)
        out[mode] = (s.global_ce_weight_sum, s.global_valid_tokens, s.global_routed_tokens,
                     s.local_ce_weight_sum, s.num_micro_batches)
    # Ranks that disagree on G, and a rank with a bad micro-batch: every rank raises.
    try:
        gt.dist.step_stats(mbs[: 1 + (rank == 1)])
    except ValueError as e:
        out["g_mismatch"] = str(e)
    bad = list(mbs)
    if rank == 2:
        labels, ids, mask = bad[0]
        labels = labels.clone()
        labels[~mask] = 3  # a padding token with a label
        bad[0] = (labels, ids, mask)
    try:
        gt.dist.step_stats(bad)
    except ValueError as e:
        out["bad_input"] = str(e)
    # Expert counts of micro-batch 1, all layers in one all_reduce, sync and async.
    topk = [topk_of(rank, 1, layer) for layer in range(3)]
    mask = mbs[1][2]
    out["counts"] = gt.dist.expert_counts(topk, E, input_mask=mask)
    out["counts_async"] = gt.dist.expert_counts(topk, E, input_mask=mask, async_op=True).wait()
    try:
        gt.dist.expert_counts([topk[0] + (rank == 0) * 10], E)
    except ValueError as e:
        out["counts_error"] = str(e)
    # DDP with the SUM hook: local sum losses -> the gradient of the global sum.
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(None, gt.dist.sum_hook)
    ddp(model_data(rank)).pow(2).sum().backward()
    out["ddp_grads"] = [p.grad.clone() for p in model.parameters()]
    # The same for parameters outside DDP.
    plain = make_model()
    plain(model_data(rank)).pow(2).sum().backward()
    gt.dist.sum_gradients(plain.parameters())
    out["plain_grads"] = [p.grad.clone() for p in plain.parameters()]
    out["global_sums"] = gt.dist.global_sums({"a": rank + 0.5, "b": 2.0 * rank})
    return out


class DistTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.results = gloo_ranks.run(ranks_main, WORLD, timeout_s=180)

    def test_step_stats(self):
        all_mbs = [micro_batch(r, m) for r in range(WORLD) for m in range(G)]
        valid = sum(int((lab != IGNORE).sum()) for lab, _, _ in all_mbs)
        routed = sum(int(mask.sum()) for _, _, mask in all_mbs)
        d_sample = 0.0
        for labels, ids, _ in all_mbs:
            for s in ids.unique():
                if int(((ids == s) & (labels != IGNORE)).sum()):
                    d_sample += 1.0  # each sample's weights sum to 1
        for rank, res in enumerate(self.results):
            local_valid = sum(int((micro_batch(rank, m)[0] != IGNORE).sum()) for m in range(G))
            self.assertEqual(res["token"], (float(valid), valid, routed, float(local_valid), G))
            self.assertTrue(math.isclose(res["sample"][0], d_sample, rel_tol=1e-6))

    def test_every_rank_raises_together(self):
        for rank, res in enumerate(self.results):
            self.assertIn("disagree on the number of micro-batches", res["g_mismatch"])
            if rank == 2:
                self.assertIn("padding token", res["bad_input"])
            else:
                self.assertIn("1 other rank(s)", res["bad_input"])
            if rank == 0:
                self.assertIn("expert", res["counts_error"])
            else:
                self.assertIn("other rank(s)", res["counts_error"])

    def test_expert_counts(self):
        for layer in range(3):
            ids = torch.cat([topk_of(r, 1, layer)[micro_batch(r, 1)[2]] for r in range(WORLD)])
            expected = torch.bincount(ids.reshape(-1), minlength=E)
            for res in self.results:
                self.assertTrue(torch.equal(res["counts"][layer], expected))
                self.assertTrue(torch.equal(res["counts_async"][layer], expected))

    def test_sum_hook_and_sum_gradients_give_the_global_batch_gradient(self):
        model = make_model().double()
        x = torch.cat([model_data(r) for r in range(WORLD)]).double()
        model(x).pow(2).sum().backward()
        for res in self.results:
            for key in ("ddp_grads", "plain_grads"):
                for got, p in zip(res[key], model.parameters()):
                    torch.testing.assert_close(got.double(), p.grad, rtol=1e-5, atol=1e-6)

    def test_global_sums(self):
        for res in self.results:
            self.assertEqual(res["global_sums"], {"a": 4.5, "b": 6.0})


if __name__ == "__main__":
    unittest.main()
