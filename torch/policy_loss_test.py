"""gradsum_torch.policy_loss against a straightforward float64 PyTorch reference.

The reference is SEMANTICS.md §13 written line by line with torch ops (log_softmax, exp,
clamp, maximum, minimum, where) in float64 and differentiated by autograd; the op under
test runs the library's fused kernel once. Every option is exercised (PPO clip, dual clip,
the log-ratio clamp, truncated importance weights, KL k1/k2/k3 with the k3 clamp, both
aggregations, masked and ignored tokens, N = 0), and each case checks that the branch it
is about was actually taken. Errors raise ValueError with the library's message.
"""

import math
import unittest

import torch

import gradsum_torch as gt

IGNORE = -100


def reference_policy(logits, labels, old, adv, *, mask=None, is_weights=None, ref=None,
                     eps_low=0.2, eps_high=0.2, dual_clip_c=3.0, kl_coef=0.0, kl_estimator="k3",
                     is_cap=2.0, aggregation="token_mean", n=None, s=None, n_s=None):
    """(loss, metrics) of §13 in float64, differentiable in `logits` ([T, V])."""
    valid = labels != IGNORE
    if mask is not None:
        valid = valid & (mask != 0)
    logp = torch.log_softmax(logits.double(), -1).gather(-1, labels.clamp(min=0)[:, None])[:, 0]
    a = adv.double()
    r = torch.exp(torch.clamp(logp - old.double(), -20.0, 20.0))
    pg1 = -r * a
    pg2 = -torch.clamp(r, 1.0 - eps_low, 1.0 + eps_high) * a
    pg = torch.maximum(pg1, pg2)
    dual = torch.zeros_like(valid)
    if dual_clip_c > 0:
        dual = (a < 0) & (pg > -dual_clip_c * a)
        pg = torch.where(a < 0, torch.minimum(pg, -dual_clip_c * a), pg)
    if is_weights is not None:
        pg = torch.clamp(is_weights.double(), max=is_cap) * pg
    kl = torch.zeros_like(pg)
    if ref is not None:
        d = logp - ref.double()
        if kl_estimator == "k1":
            kl = d
        elif kl_estimator == "k2":
            kl = 0.5 * d * d
        else:
            kl = torch.clamp(torch.exp(-d) + d - 1.0, -10.0, 10.0)
    term = pg + kl_coef * kl
    if aggregation == "token_mean":
        coef = torch.full_like(pg, 1.0 / n if n else 0.0)
    else:
        coef = torch.where(valid, 1.0 / (n_s.double().clamp(min=1) * s), torch.zeros_like(pg))
    zero = torch.zeros_like(pg)
    loss = torch.where(valid, coef * term, zero).sum()
    rv = r.detach()[valid]
    metrics = {
        "kl": float(torch.where(valid, coef * kl_coef * kl, zero).sum()),
        "kl_sum": float(kl.detach()[valid].sum()),
        "valid_tokens": int(valid.sum()),
        "clip_count": int(((pg2 > pg1) & valid).sum()),
        "dual_clip_count": int((dual & valid).sum()),
        "ratio_sum": float(rv.sum()),
        "ratio_max": float(rv.max()) if rv.numel() else 0.0,
        "ratio_min": float(rv.min()) if rv.numel() else 0.0,
    }
    return loss, metrics


def sequence_counts(labels, seq_ids, mask=None):
    """n_s per token and the number of sequences with a valid token, from plain loops."""
    valid = labels != IGNORE
    if mask is not None:
        valid = valid & (mask != 0)
    n_s = torch.zeros_like(labels)
    sequences = 0
    for s in seq_ids.unique():
        in_s = seq_ids == s
        count = int((in_s & valid).sum())
        n_s[in_s] = count
        sequences += count > 0
    return n_s, sequences


class PolicyLossTest(unittest.TestCase):
    def setUp(self):
        self.gen = torch.Generator().manual_seed(11)

    def batch(self, t=64, v=37, spread=0.5, ignore_fraction=0.15):
        """Logits, labels, and an old_logprob near the current log-prob (ratios around 1)."""
        g = self.gen
        logits = torch.randn(t, v, generator=g) * 2
        labels = torch.randint(0, v, (t,), generator=g)
        labels[torch.rand(t, generator=g) < ignore_fraction] = IGNORE
        logp = torch.log_softmax(logits.double(), -1).gather(-1, labels.clamp(min=0)[:, None])[:, 0]
        old = (logp + torch.randn(t, generator=g, dtype=torch.float64) * spread).float()
        adv = torch.randn(t, generator=g)
        return logits, labels, old, adv, logp

    def near(self, logp, spread):
        """A float32 log-prob near `logp` (a ref_logprob)."""
        noise = torch.randn(logp.shape, generator=self.gen, dtype=torch.float64) * spread
        return (logp + noise).float()

    def check(self, logits, labels, old, adv, dtype=torch.float32, grad_tol=None, **kw):
        """Runs the op and the reference with the same arguments; returns the metrics."""
        op_kw = {k: v for k, v in kw.items() if k not in ("n", "s", "n_s", "ref")}
        ref_kw = {k: v for k, v in kw.items()}
        if "ref" in kw:
            op_kw["ref_logprob"] = kw["ref"]
        agg = kw.get("aggregation", "token_mean")
        if agg == "token_mean":
            op_kw["global_valid_tokens"] = kw["n"]
        else:
            op_kw["global_sequences"] = kw["s"]
            op_kw["sequence_valid_tokens"] = kw["n_s"]
        x = logits.to(dtype).clone().requires_grad_()
        loss, metrics = gt.policy_loss(x, labels, old, adv, **op_kw)
        loss.backward()
        z = x.detach().double().requires_grad_()
        ref_loss, ref_metrics = reference_policy(z, labels, old, adv, **ref_kw)
        (ref_grad,) = torch.autograd.grad(ref_loss, z)
        self.assertEqual(loss.dtype, torch.float32)
        self.assertEqual(loss.dim(), 0)
        self.assertEqual(x.grad.dtype, dtype)
        self.assertAlmostEqual(loss.item(), ref_loss.item(),
                               delta=1e-6 * max(abs(ref_loss.item()), 1e-3))
        tol = grad_tol or dict(rtol=1e-5, atol=1e-8)
        torch.testing.assert_close(x.grad.double(), ref_grad, **tol)
        for key in ("valid_tokens", "clip_count", "dual_clip_count"):
            self.assertEqual(metrics[key], ref_metrics[key], key)
        for key in ("kl", "kl_sum", "ratio_sum", "ratio_max", "ratio_min"):
            self.assertAlmostEqual(metrics[key], ref_metrics[key],
                                   delta=1e-5 * max(1.0, abs(ref_metrics[key])), msg=key)
        # Invalid tokens (ignored label or mask 0) get exactly zero gradient rows.
        valid = labels != IGNORE
        if kw.get("mask") is not None:
            valid = valid & (kw["mask"] != 0)
        self.assertTrue(bool((x.grad[~valid] == 0).all()))
        return metrics

    def test_ppo_clip(self):
        logits, labels, old, adv, _ = self.batch()
        n = int((labels != IGNORE).sum()) + 20  # other ranks' and micro-batches' tokens
        m = self.check(logits, labels, old, adv, n=n, dual_clip_c=0.0)
        self.assertGreater(m["clip_count"], 5)
        self.assertLess(m["clip_count"], m["valid_tokens"] - 5)
        m = self.check(logits, labels, old, adv, n=n, eps_low=0.1, eps_high=0.3, dual_clip_c=0.0)
        self.assertGreater(m["clip_count"], 5)

    def test_dual_clip(self):
        logits, labels, old, adv, _ = self.batch(spread=1.0)
        n = int((labels != IGNORE).sum())
        for c in (3.0, 1.5):
            with self.subTest(c=c):
                m = self.check(logits, labels, old, adv, n=n, dual_clip_c=c)
                self.assertGreater(m["dual_clip_count"], 0)

    def test_log_ratio_clamp(self):
        logits, labels, old, adv, logp = self.batch(t=8, ignore_fraction=0.0)
        old[0] = float(logp[0]) - 25.0  # ratio e^20, a constant: no gradient through it
        adv[0] = -1.0                   # the unclipped branch (dual clip off)
        old[1] = float(logp[1]) + 25.0
        adv[1] = 1.0
        m = self.check(logits, labels, old, adv, n=8.0, dual_clip_c=0.0)
        self.assertAlmostEqual(m["ratio_max"], math.exp(20.0), delta=1e-6 * math.exp(20.0))

    def test_importance_weights(self):
        logits, labels, old, adv, _ = self.batch()
        iw = torch.rand(labels.shape, generator=self.gen) * 3  # about a third above the cap
        n = int((labels != IGNORE).sum())
        for cap in (2.0, 0.5, math.inf):
            with self.subTest(cap=cap):
                self.check(logits, labels, old, adv, n=n, is_weights=iw, is_cap=cap)

    def test_kl_estimators(self):
        logits, labels, old, adv, logp = self.batch()
        ref = self.near(logp, 0.3)
        ref[0] = float(logp[0]) + 4.0  # k3 = e^4 - 5 > 10: clamped, no gradient
        labels[0] = labels[0].clamp(min=0)
        n = int((labels != IGNORE).sum())
        for est in ("k1", "k2", "k3"):
            with self.subTest(estimator=est):
                m = self.check(logits, labels, old, adv, n=n, ref=ref, kl_coef=0.05,
                               kl_estimator=est)
                self.assertNotEqual(m["kl"], 0.0)
                if est == "k3":
                    self.assertGreaterEqual(m["kl_sum"], 10.0)
        # ref_logprob without kl_coef: kl_t is a metric only.
        m = self.check(logits, labels, old, adv, n=n, ref=ref, kl_estimator="k2")
        self.assertEqual(m["kl"], 0.0)
        self.assertGreater(m["kl_sum"], 0.0)

    def test_everything_together_with_a_mask(self):
        logits, labels, old, adv, logp = self.batch()
        mask = (torch.rand(labels.shape, generator=self.gen) > 0.2).to(torch.uint8)
        iw = torch.rand(labels.shape, generator=self.gen) * 2.5
        ref = self.near(logp, 0.2)
        n = int(((labels != IGNORE) & (mask != 0)).sum()) + 7
        m = self.check(logits, labels, old, adv, n=n, mask=mask, is_weights=iw, ref=ref,
                       kl_coef=0.1, kl_estimator="k3", dual_clip_c=2.0, eps_high=0.28)
        self.assertLess(m["valid_tokens"], int((labels != IGNORE).sum()))
        # A bool mask is the same mask.
        self.check(logits, labels, old, adv, n=n, mask=mask.bool(), is_weights=iw, ref=ref,
                   kl_coef=0.1, kl_estimator="k3", dual_clip_c=2.0, eps_high=0.28)

    def test_masked_token_values_are_never_read(self):
        logits, labels, old, adv, _ = self.batch(t=10, ignore_fraction=0.0)
        mask = torch.ones(10, dtype=torch.bool)
        mask[3] = False
        x = logits.clone().requires_grad_()
        loss, _ = gt.policy_loss(x, labels, old, adv, 9, mask=mask)
        loss.backward()
        junk_old, junk_adv = old.clone(), adv.clone()
        junk_old[3], junk_adv[3] = float("nan"), float("inf")
        y = logits.clone().requires_grad_()
        loss2, _ = gt.policy_loss(y, labels, junk_old, junk_adv, 9, mask=mask)
        loss2.backward()
        self.assertEqual(loss.item(), loss2.item())
        self.assertTrue(torch.equal(x.grad, y.grad))
        self.assertTrue(bool((y.grad[3] == 0).all()))

    def test_seq_mean_token_mean(self):
        logits, labels, old, adv, logp = self.batch(t=60)
        seq_ids = torch.arange(60) // 7  # 9 sequences of 7 tokens, the last one of 4
        mask = torch.ones(60, dtype=torch.uint8)
        mask[7:14] = 0  # a sequence with no valid token: not counted in S
        n_s, sequences = sequence_counts(labels, seq_ids, mask)
        ref = self.near(logp, 0.2)
        for s in (float(sequences), sequences + 5.0):
            with self.subTest(s=s):
                self.check(logits, labels, old, adv, aggregation="seq_mean_token_mean", s=s,
                           n_s=n_s, mask=mask, ref=ref, kl_coef=0.02)
        # n_s counting the tokens of the sequence on other ranks too (sequence parallelism).
        self.check(logits, labels, old, adv, aggregation="seq_mean_token_mean",
                   s=float(sequences), n_s=n_s * 2, mask=mask)

    def test_bf16_logits(self):
        logits, labels, old, adv, _ = self.batch(t=40, v=500)
        logits = logits.bfloat16().float()  # the reference sees the same values
        n = int((labels != IGNORE).sum())
        self.check(logits, labels, old, adv, dtype=torch.bfloat16, n=n, dual_clip_c=0.0,
                   grad_tol=dict(rtol=2**-7, atol=1e-6))

    def test_leading_dimensions_and_upstream_gradient(self):
        logits, labels, old, adv, _ = self.batch(t=24, v=11)
        n = int((labels != IGNORE).sum())
        x = logits.reshape(2, 12, 11).clone().requires_grad_()
        loss, metrics = gt.policy_loss(x, labels.reshape(2, 12), old.reshape(2, 12),
                                       adv.reshape(2, 12), n)
        (3.0 * loss).backward()
        z = logits.double().requires_grad_()
        ref_loss, _ = reference_policy(z, labels, old, adv, n=n)
        (ref_grad,) = torch.autograd.grad(3.0 * ref_loss, z)
        self.assertEqual(x.grad.shape, (2, 12, 11))
        torch.testing.assert_close(x.grad.reshape(24, 11).double(), ref_grad, rtol=1e-5, atol=1e-8)
        self.assertEqual(metrics["valid_tokens"], n)

    def test_no_valid_token_gives_zero_loss_and_gradient(self):
        logits, labels, old, adv, _ = self.batch(t=12)
        for kw in (dict(global_valid_tokens=0),
                   dict(aggregation="seq_mean_token_mean", global_sequences=0,
                        sequence_valid_tokens=torch.zeros(12, dtype=torch.int64))):
            with self.subTest(**{k: str(v) for k, v in kw.items()}):
                x = logits.clone().requires_grad_()
                none = torch.zeros(12, dtype=torch.bool)
                loss, m = gt.policy_loss(x, labels, old, adv, mask=none, **kw)
                loss.backward()
                self.assertEqual(loss.item(), 0.0)
                self.assertTrue(bool((x.grad == 0).all()))
                self.assertEqual((m["valid_tokens"], m["ratio_max"], m["ratio_min"]), (0, 0.0, 0.0))
        # Every label ignored, N = 0 globally.
        x = logits.clone().requires_grad_()
        loss, _ = gt.policy_loss(x, torch.full((12,), IGNORE), old, adv, 0)
        loss.backward()
        self.assertEqual(loss.item(), 0.0)
        self.assertTrue(bool((x.grad == 0).all()))

    def test_no_grad_and_frozen_logits(self):
        logits, labels, old, adv, _ = self.batch(t=16)
        n = int((labels != IGNORE).sum())
        ref_loss, _ = reference_policy(logits, labels, old, adv, n=n)
        with torch.no_grad():
            loss, _ = gt.policy_loss(logits.clone().requires_grad_(), labels, old, adv, n)
        self.assertIsNone(loss.grad_fn)
        loss2, _ = gt.policy_loss(logits, labels, old, adv, n)
        self.assertFalse(loss2.requires_grad)
        for value in (loss.item(), loss2.item()):
            self.assertAlmostEqual(value, ref_loss.item(), delta=1e-6 * abs(ref_loss.item()))


class PolicyLossErrorsTest(unittest.TestCase):
    def setUp(self):
        gen = torch.Generator().manual_seed(12)
        self.z = torch.randn(4, 5, generator=gen, requires_grad=True)
        self.y = torch.tensor([0, 1, IGNORE, 4])
        self.old = torch.full((4,), -1.5)
        self.adv = torch.tensor([1.0, -1.0, 0.5, 2.0])

    def raises(self, *fragments, z=None, y=None, old=None, adv=None, n=3, **kw):
        args = (self.z if z is None else z, self.y if y is None else y,
                self.old if old is None else old, self.adv if adv is None else adv)
        with self.assertRaises(ValueError) as cm:
            gt.policy_loss(*args, n, **kw)
        for f in fragments:
            self.assertIn(f, str(cm.exception))

    def test_shapes_and_dtypes(self):
        self.raises("old_logprob has shape [3], expected [4]", old=self.old[:3])
        self.raises("advantages has shape [4, 1]", adv=self.adv[:, None])
        self.raises("labels has shape [3]", y=self.y[:3])
        self.raises("labels must be an integer", y=self.y.float())
        self.raises("float32 or bfloat16", z=self.z.double())
        self.raises("old_logprob must be floating", old=torch.zeros(4, dtype=torch.int64))
        self.raises("is_weights has shape", is_weights=torch.ones(5))
        self.raises("ref_logprob has shape", ref_logprob=torch.ones(3), kl_coef=0.1)
        self.raises("mask has shape", mask=torch.ones(3, dtype=torch.bool))
        self.raises("mask must be an integer or bool", mask=torch.ones(4))

    def test_options_out_of_range_name_the_value(self):
        self.raises("INVALID_ARGUMENT", "eps_low = -0.1", eps_low=-0.1)
        self.raises("eps_high = inf", eps_high=math.inf)
        self.raises("dual_clip_c = 0.5", dual_clip_c=0.5)
        self.raises("dual_clip_c = 1", dual_clip_c=1.0)
        self.raises("kl_coef = -1", kl_coef=-1.0, ref_logprob=torch.zeros(4))
        self.raises("is_cap = 0", is_cap=0.0)
        self.raises("is_cap = nan", is_cap=math.nan)
        self.raises("kl_coef = 0.1 > 0 needs ref_logprob", kl_coef=0.1)
        self.raises("unknown kl_estimator 'k4'", kl_estimator="k4")
        self.raises("unknown aggregation 'mean'", aggregation="mean")

    def test_normalisers(self):
        self.raises("FAILED_PRECONDITION", "N = 2", "this call's 3 valid tokens",
                    "SEMANTICS.md §13", n=2)
        self.raises("N = nan", n=math.nan)
        self.raises("N = -1", n=-1)
        self.raises("token_mean needs global_valid_tokens", n=None)
        self.raises("token_mean takes global_valid_tokens only", global_sequences=3)
        n_s = torch.tensor([2, 2, 1, 1])  # tokens 0, 1 one sequence, token 3 another
        seq = dict(aggregation="seq_mean_token_mean", sequence_valid_tokens=n_s)
        self.raises("needs global_sequences", n=None, **seq)
        self.raises("not global_valid_tokens", n=3, global_sequences=2, **seq)
        self.raises("FAILED_PRECONDITION", "S = 1.5", "share of sequences 2", n=None,
                    global_sequences=1.5, **seq)
        self.raises("INVALID_ARGUMENT", "S = -1 must be finite and >= 0", n=None,
                    global_sequences=-1, **seq)
        self.raises("n_s = 0 at row 1", n=None, global_sequences=2,
                    aggregation="seq_mean_token_mean", sequence_valid_tokens=torch.tensor(
                        [2, 0, 1, 1]))
        self.raises("sequence_valid_tokens has shape", n=None, global_sequences=2,
                    aggregation="seq_mean_token_mean", sequence_valid_tokens=n_s[:2])

    def test_numbers_must_be_numbers(self):
        # Issue 50: float('6') made the string a normaliser; every number argument is
        # checked, naming it. Tensors of one element (dist's normalisers) are numbers.
        self.raises("policy_loss: global_valid_tokens must be a number", "str '6'", n="6")
        self.raises("global_valid_tokens must be a number", "bool True", n=True)
        self.raises("global_valid_tokens must be a number or a one-element real tensor",
                    n=torch.tensor([3.0, 3.0]))
        self.raises("eps_low must be a number", "str '0.2'", eps_low="0.2")
        n_s = torch.tensor([2, 2, 1, 1])
        self.raises("global_sequences must be a number", "str '2'", n=None, global_sequences="2",
                    aggregation="seq_mean_token_mean", sequence_valid_tokens=n_s)
        want, _ = gt.policy_loss(self.z, self.y, self.old, self.adv, 3)
        for n in (3.0, torch.tensor(3), torch.tensor([3.0])):
            got, _ = gt.policy_loss(self.z, self.y, self.old, self.adv, n)
            self.assertEqual(got.item(), want.item())

    def test_sparse_and_mkldnn_inputs_name_the_argument(self):
        self.raises("policy_loss: logits must be a dense (strided) tensor, got a Sparse tensor",
                    z=self.z.detach().to_sparse())
        self.raises("logits must be a dense (strided) tensor, got a Mkldnn tensor",
                    z=self.z.detach().to_mkldnn())
        self.raises("policy_loss: old_logprob must be a dense", old=self.old.to_sparse())
        self.raises("policy_loss: mask must be a dense",
                    mask=torch.ones(4, dtype=torch.long).to_sparse())

    def test_bad_values_of_valid_tokens(self):
        self.raises("label 5 at row 2", y=torch.tensor([0, 1, 5, 4]))
        adv = self.adv.clone()
        adv[1] = math.inf
        self.raises("advantage inf at row 1", adv=adv)
        old = self.old.clone()
        old[0] = math.nan
        self.raises("old_logprob nan at row 0", old=old)
        self.raises("importance weight -1 at row 3", is_weights=torch.tensor([1.0, 1, 1, -1]))
        bad = self.z.detach().clone()
        bad[3, 2] = math.nan
        self.raises("row 3", z=bad)
        # The same values in an ignored row are not read.
        adv = self.adv.clone()
        adv[2] = math.nan
        loss, _ = gt.policy_loss(self.z, self.y, self.old, adv, 3)
        self.assertTrue(math.isfinite(loss.item()))


if __name__ == "__main__":
    unittest.main()
