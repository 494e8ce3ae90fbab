"""gradsum_torch.policy_loss on gloo ranks against the single-process full batch.

World 2 and 3, G = 2 micro-batches per rank, uneven token and valid counts, and rank 1's
tokens all masked. Each rank gets N, S and n_s from ONE all_reduce (dist.policy_stats), runs
the op on each micro-batch of logits = hidden @ W.T (W a head shared by all ranks) and
back-propagates its own components; W's gradient is then SUM-reduced (dist.sum_gradients).
Checked, for token-mean and seq-mean-token-mean with clip, dual clip, importance weights and
a k3 KL term:
- the per-rank logits gradients, concatenated, equal the op's gradient on the whole batch in
  one process (bit for bit: rows are independent) and the float64 reference (1e-6);
- the reduced W gradient equals the float64 reference's;
- the losses summed over ranks and micro-batches equal the full-batch loss;
- the masked rank's gradients are exactly 0; the metrics reduce to the full batch's.
"""

import unittest

import torch
import torch.distributed as dist

import gloo_ranks
import gradsum_torch as gt
from policy_loss_test import IGNORE, reference_policy, sequence_counts

G = 2
V, DM = 29, 8
MASKED_RANK = 1
OPTIONS = dict(eps_low=0.2, eps_high=0.28, dual_clip_c=2.0, kl_coef=0.05, kl_estimator="k3",
               is_cap=1.5)


def head():
    return torch.randn(V, DM, generator=torch.Generator().manual_seed(5)) * 0.7


def micro_batch(rank, m):
    """The inputs of (rank, m): hidden [T, DM], labels, sequence ids, mask, and the detached
    per-token values, with ratios around 1 (old_logprob near the current log-prob)."""
    gen = torch.Generator().manual_seed(100 * rank + m)
    t = 9 + 4 * rank + 3 * m  # uneven sizes
    hidden = torch.randn(t, DM, generator=gen)
    labels = torch.randint(0, V, (t,), generator=gen)
    labels[torch.rand(t, generator=gen) < 0.1 + 0.1 * rank] = IGNORE
    seq_ids = torch.arange(t) // (3 + m)
    mask = torch.rand(t, generator=gen) > 0.2
    if rank == MASKED_RANK:
        mask[:] = False
    logp = torch.log_softmax(hidden.double() @ head().double().t(), -1).gather(
        -1, labels.clamp(min=0)[:, None])[:, 0]
    old = (logp + torch.randn(t, generator=gen, dtype=torch.float64) * 0.7).float()
    adv = torch.randn(t, generator=gen)
    iw = torch.rand(t, generator=gen) * 2
    ref = (logp + torch.randn(t, generator=gen, dtype=torch.float64) * 0.5).float()
    return dict(hidden=hidden, labels=labels, seq_ids=seq_ids, mask=mask, old=old, adv=adv,
                iw=iw, ref=ref)


def ranks_main(rank, world):
    mbs = [micro_batch(rank, m) for m in range(G)]
    stats = gt.dist.policy_stats([(b["labels"], b["seq_ids"], b["mask"]) for b in mbs])
    out = {"stats": stats}
    for agg in ("token_mean", "seq_mean_token_mean"):
        w = head().requires_grad_()
        losses, metrics, logits, logits_grads = [], [], [], []
        for m, b in enumerate(mbs):
            z = b["hidden"] @ w.t()
            z.retain_grad()
            if agg == "token_mean":
                norm = dict(global_valid_tokens=stats.global_valid_tokens)
            else:
                norm = dict(global_sequences=stats.global_sequences,
                            sequence_valid_tokens=stats.sequence_valid_tokens[m])
            loss, mets = gt.policy_loss(z, b["labels"], b["old"], b["adv"], mask=b["mask"],
                                        is_weights=b["iw"], ref_logprob=b["ref"],
                                        aggregation=agg, **norm, **OPTIONS)
            loss.backward()
            losses.append(loss.item())
            metrics.append(mets)
            logits.append(z.detach())
            logits_grads.append(z.grad)
        gt.dist.sum_gradients([w])
        out[agg] = dict(losses=losses, logits=logits, logits_grads=logits_grads, w_grad=w.grad,
                        metrics=gt.dist.policy_metrics(metrics))
    return out


def full_batch(world):
    """Every (rank, m) micro-batch concatenated in rank-major order, with n_s and S counted
    here per micro-batch (a sequence lies within one micro-batch)."""
    parts = [micro_batch(r, m) for r in range(world) for m in range(G)]
    cat = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    counts = [sequence_counts(p["labels"], p["seq_ids"], p["mask"]) for p in parts]
    cat["n_s"] = torch.cat([c[0] for c in counts])
    cat["sequences"] = sum(c[1] for c in counts)
    cat["valid_tokens"] = int(((cat["labels"] != IGNORE) & cat["mask"]).sum())
    return cat


class PolicyDistTest(unittest.TestCase):
    def check_world(self, world):
        results = gloo_ranks.run(ranks_main, world, timeout_s=180)
        full = full_batch(world)
        n, s = full["valid_tokens"], full["sequences"]
        for rank, res in enumerate(results):
            st = res["stats"]
            self.assertEqual((st.global_valid_tokens, st.global_sequences, st.num_micro_batches),
                             (n, s, G))
            if rank == MASKED_RANK:
                self.assertEqual((st.local_valid_tokens, st.local_sequences), (0, 0))
        for agg in ("token_mean", "seq_mean_token_mean"):
            with self.subTest(world=world, aggregation=agg):
                norm = (dict(n=n) if agg == "token_mean" else dict(s=float(s), n_s=full["n_s"]))
                ref_kw = dict(mask=full["mask"], is_weights=full["iw"], ref=full["ref"],
                              aggregation=agg, **norm, **OPTIONS)
                per_rank = [res[agg] for res in results]
                # The ranks' float32 logits, concatenated: the reference for their gradients,
                # and the op itself on the whole batch in one call, one process.
                logits = torch.cat([z for r in per_rank for z in r["logits"]])
                z = logits.double().requires_grad_()
                ref_loss, ref_metrics = reference_policy(z, full["labels"], full["old"],
                                                         full["adv"], **ref_kw)
                ref_loss.backward()
                z1 = logits.clone().requires_grad_()
                op_norm = (dict(global_valid_tokens=n) if agg == "token_mean" else
                           dict(global_sequences=s, sequence_valid_tokens=full["n_s"]))
                one_loss, _ = gt.policy_loss(z1, full["labels"], full["old"], full["adv"],
                                             mask=full["mask"], is_weights=full["iw"],
                                             ref_logprob=full["ref"], aggregation=agg,
                                             **op_norm, **OPTIONS)
                one_loss.backward()
                # The head's gradient through float64 logits = hidden @ W.T.
                w = head().double().requires_grad_()
                ref_w_loss, _ = reference_policy(full["hidden"].double() @ w.t(), full["labels"],
                                                 full["old"], full["adv"], **ref_kw)
                ref_w_loss.backward()

                grads = torch.cat([g for r in per_rank for g in r["logits_grads"]])
                self.assertTrue(torch.equal(grads, z1.grad))
                torch.testing.assert_close(grads.double(), z.grad, rtol=0, atol=1e-6)
                total = sum(sum(r["losses"]) for r in per_rank)
                self.assertAlmostEqual(total, ref_loss.item(), delta=1e-6 * abs(ref_loss.item()))
                self.assertAlmostEqual(total, one_loss.item(), delta=1e-6 * abs(ref_loss.item()))
                masked = per_rank[MASKED_RANK]
                self.assertEqual(masked["losses"], [0.0] * G)
                for g in masked["logits_grads"]:
                    self.assertTrue(bool((g == 0).all()))
                for r in per_rank:  # every rank holds the SUM-reduced head gradient
                    torch.testing.assert_close(r["w_grad"].double(), w.grad, rtol=1e-5, atol=1e-6)
                self.assertTrue(bool((w.grad.abs() > 1e-4).any()))
                for r in per_rank:
                    mets = r["metrics"]
                    for key in ("valid_tokens", "clip_count", "dual_clip_count"):
                        self.assertEqual(mets[key], ref_metrics[key], key)
                    for key in ("kl", "kl_sum", "ratio_sum", "ratio_max", "ratio_min"):
                        self.assertAlmostEqual(mets[key], ref_metrics[key],
                                               delta=1e-5 * max(1.0, abs(ref_metrics[key])),
                                               msg=key)
                    self.assertAlmostEqual(mets["clip_fraction"],
                                           ref_metrics["clip_count"] / n, delta=1e-12)
                self.assertGreater(ref_metrics["clip_count"], 0)
                self.assertGreater(ref_metrics["dual_clip_count"], 0)

    def test_world_2(self):
        self.check_world(2)

    def test_world_3(self):
        self.check_world(3)


class PolicyStatsErrorsTest(unittest.TestCase):
    def test_every_rank_raises_together(self):
        results = gloo_ranks.run(errors_main, 2, timeout_s=120)
        self.assertIn("mask has shape", results[0])
        self.assertIn("1 other rank(s)", results[1])


def errors_main(rank, world):
    labels = torch.zeros(5, dtype=torch.int64)
    mask = torch.ones(4 if rank == 0 else 5, dtype=torch.bool)
    try:
        gt.dist.policy_stats([(labels, None, mask)])
    except ValueError as e:
        return str(e)
    return ""


if __name__ == "__main__":
    unittest.main()
