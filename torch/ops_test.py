"""gradsum_torch's autograd ops against straightforward float64 PyTorch references.

Each reference is the textbook formula of SEMANTICS.md §3-5 written with torch ops
(F.cross_entropy, logsumexp, softmax) in float64 and differentiated by autograd; the op
under test runs once. Errors must raise ValueError with the library's message and leave
the interpreter running.
"""

import math
import unittest

import torch
import torch.nn.functional as F

import gradsum_torch as gt

IGNORE = -100


def make_labels(n, v, ignore_fraction, gen):
    y = torch.randint(0, v, (n,), generator=gen)
    y[torch.rand(n, generator=gen) < ignore_fraction] = IGNORE
    return y


def reference_weights(labels, sample_ids, mode):
    """w_t of §3, computed here independently of the library."""
    valid = labels != IGNORE
    if mode == "token":
        return valid.double()
    w = torch.zeros(labels.shape, dtype=torch.float64)
    for s in sample_ids.unique():
        in_s = (sample_ids == s) & valid
        n_s = int(in_s.sum())
        if n_s:
            w[in_s] = 1.0 / n_s if mode == "sample" else 1.0 / math.sqrt(n_s)
    return w


def reference_ce(logits, labels, weights, d):
    """sum_t w_t * CE_t / D in float64 (0 when D == 0), differentiable in logits."""
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(), labels.reshape(-1),
                         ignore_index=IGNORE, reduction="none")
    total = (weights.reshape(-1) * ce).sum()
    return total / d if d > 0 else total * 0.0


def grad_of(fn, *inputs):
    xs = [x.detach().double().requires_grad_() for x in inputs]
    loss = fn(*xs)
    grads = torch.autograd.grad(loss, xs)
    return loss.detach(), grads


class CrossEntropyTest(unittest.TestCase):
    def setUp(self):
        self.gen = torch.Generator().manual_seed(1)

    def check_ce(self, n, v, mode, dtype=torch.float32, shape=None):
        logits = torch.randn(n, v, generator=self.gen).mul(3).to(dtype)
        labels = make_labels(n, v, 0.25, self.gen)
        sample_ids = torch.randint(0, 4, (n,), generator=self.gen)
        w = reference_weights(labels, sample_ids, mode)
        d = float(w.sum()) * 1.75  # the other ranks' share of D
        if shape is not None:
            logits, labels, sample_ids = (logits.reshape(*shape, v), labels.reshape(shape),
                                          sample_ids.reshape(shape))
        x = logits.clone().requires_grad_()
        loss = gt.cross_entropy(x, labels, d, mode, sample_ids=sample_ids)
        loss.backward()
        ref_loss, (ref_grad,) = grad_of(lambda z: reference_ce(z, labels, w, d), logits)
        self.assertEqual(loss.dtype, torch.float32)
        self.assertEqual(loss.dim(), 0)
        self.assertEqual(x.grad.dtype, dtype)
        self.assertEqual(x.grad.shape, logits.shape)
        self.assertAlmostEqual(loss.item(), ref_loss.item(), delta=1e-6 * abs(ref_loss.item()))
        if dtype == torch.float32:
            torch.testing.assert_close(x.grad.double(), ref_grad, rtol=1e-5, atol=1e-7)
        else:  # the gradient is computed in fp32 and rounded once to bf16
            torch.testing.assert_close(x.grad.double(), ref_grad, rtol=2**-8, atol=1e-6)

    def test_modes_match_reference_f32(self):
        for mode in ("token", "sample", "square"):
            with self.subTest(mode=mode):
                self.check_ce(67, 301, mode)

    def test_bf16_matches_reference(self):
        for mode in ("token", "sample"):
            with self.subTest(mode=mode):
                self.check_ce(45, 1000, mode, dtype=torch.bfloat16)

    def test_leading_dimensions_are_flattened(self):
        self.check_ce(24, 17, "sample", shape=(2, 3, 4))

    def test_non_contiguous_logits(self):
        base = torch.randn(40, 30, generator=self.gen)
        logits = base.t()  # [30, 40], not contiguous
        labels = make_labels(30, 40, 0.2, self.gen)
        d = float((labels != IGNORE).sum())
        x = logits.clone().t().t().requires_grad_()  # keeps the transposed strides
        self.assertFalse(x.is_contiguous())
        gt.cross_entropy(x, labels, d).backward()
        _, (ref,) = grad_of(lambda z: reference_ce(z, labels, (labels != IGNORE).double(), d),
                            logits)
        torch.testing.assert_close(x.grad.double(), ref, rtol=1e-5, atol=1e-7)

    def test_upstream_gradient_scales(self):
        logits = torch.randn(10, 7, generator=self.gen)
        labels = make_labels(10, 7, 0.0, self.gen)
        x = logits.clone().requires_grad_()
        loss = gt.cross_entropy(x, labels, 10.0)
        (3.0 * loss + loss).backward()
        _, (ref,) = grad_of(lambda z: 4.0 * reference_ce(z, labels, torch.ones(10), 10.0), logits)
        torch.testing.assert_close(x.grad.double(), ref, rtol=1e-5, atol=1e-7)

    def test_explicit_token_weights_and_no_grad(self):
        logits = torch.randn(12, 9, generator=self.gen)
        labels = make_labels(12, 9, 0.3, self.gen)
        w = torch.rand(12, generator=self.gen)
        d = float((w.double() * (labels != IGNORE)).sum()) + 1.0
        ref = reference_ce(logits, labels, w.double() * (labels != IGNORE), d)
        with torch.no_grad():
            loss = gt.cross_entropy(logits, labels, d, token_weights=w)
        self.assertIsNone(loss.grad_fn)
        self.assertAlmostEqual(loss.item(), ref.item(), delta=1e-6 * ref.item())

    def test_all_ignored_gives_zero_loss_and_gradient(self):
        x = torch.randn(5, 6, requires_grad=True)
        loss = gt.cross_entropy(x, torch.full((5,), IGNORE), 0.0)
        loss.backward()
        self.assertEqual(loss.item(), 0.0)
        self.assertTrue(bool((x.grad == 0).all()))

    def test_results_do_not_depend_on_the_thread_count(self):
        logits = torch.randn(300, 2000, generator=self.gen)
        labels = make_labels(300, 2000, 0.1, self.gen)
        grads = []
        old = torch.get_num_threads()
        for threads in (1, 2):
            torch.set_num_threads(threads)
            x = logits.clone().requires_grad_()
            loss = gt.cross_entropy(x, labels, 300.0)
            loss.backward()
            grads.append((loss.item(), x.grad))
        torch.set_num_threads(old)
        self.assertEqual(grads[0][0], grads[1][0])
        self.assertTrue(torch.equal(grads[0][1], grads[1][1]))

    def test_large_gradient_buffers_are_reused_only_once_free(self):
        n, v = 1024, 8192  # a 32 MiB gradient: the huge-page buffers of large_buffers.h
        logits = torch.randn(n, v, generator=self.gen)
        labels = make_labels(n, v, 0.1, self.gen)
        d = float((labels != IGNORE).sum())
        _, (ref,) = grad_of(lambda z: reference_ce(z, labels, (labels != IGNORE).double(), d),
                            logits)
        x = logits.clone().requires_grad_()
        (g1,) = torch.autograd.grad(gt.cross_entropy(x, labels, d), x)
        kept = g1.clone()
        other = labels.roll(1)  # another loss, while g1 is still held
        (g2,) = torch.autograd.grad(gt.cross_entropy(x, other, float((other != IGNORE).sum())), x)
        self.assertNotEqual(g1.data_ptr(), g2.data_ptr())
        self.assertTrue(torch.equal(g1, kept))
        torch.testing.assert_close(g1.double(), ref, rtol=1e-5, atol=1e-7)
        ptr = g2.data_ptr()
        del g2
        (g3,) = torch.autograd.grad(gt.cross_entropy(x, labels, d), x)  # reuses g2's buffer
        self.assertEqual(g3.data_ptr(), ptr)
        torch.testing.assert_close(g3.double(), ref, rtol=1e-5, atol=1e-7)
        del g1, g3
        self.assertGreater(gt.empty_cache(), n * v * 4)
        self.assertEqual(gt.empty_cache(), 0)

    def test_second_backward_is_refused_not_a_crash(self):
        x = torch.randn(4, 5, requires_grad=True)
        loss = gt.cross_entropy(x, torch.tensor([0, 1, 2, 3]), 4.0)
        loss.backward(retain_graph=True)
        loss.backward()  # retained: allowed, accumulates
        _, (ref,) = grad_of(lambda z: reference_ce(z, torch.tensor([0, 1, 2, 3]), torch.ones(4),
                                                   4.0), x)
        torch.testing.assert_close(x.grad.double(), 2 * ref, rtol=1e-5, atol=1e-7)
        loss2 = gt.cross_entropy(x, torch.tensor([0, 1, 2, 3]), 4.0)
        loss2.backward()
        with self.assertRaises(RuntimeError):
            loss2.backward()


def reference_ce_options(logits, labels, weights, d, eps, cap, alpha):
    """SEMANTICS.md §3.2 written with torch ops in float64: the capped logits
    cap * tanh(z / cap), the smoothed CE (1 - eps) * NLL + eps * mean_v(-log p_v) (PyTorch's
    own label_smoothing), plus alpha * logsumexp^2, weighted and over D."""
    z = logits.reshape(-1, logits.shape[-1]).double()
    if cap > 0:
        z = cap * torch.tanh(z / cap)
    y = labels.reshape(-1)
    valid = y != IGNORE
    ce = F.cross_entropy(z, y, ignore_index=IGNORE, reduction="none", label_smoothing=eps)
    lse = torch.logsumexp(z, dim=-1)
    per_token = torch.where(valid, ce + alpha * lse * lse, torch.zeros_like(ce))
    total = (weights.reshape(-1) * per_token).sum()
    return total / d if d > 0 else total * 0.0


class CeOptionsTest(unittest.TestCase):
    """label_smoothing, logit_softcap and alpha_lse (§3.2) in both ops, against the float64
    reference above (whose smoothing is F.cross_entropy's), each alone and together."""

    def setUp(self):
        self.gen = torch.Generator().manual_seed(5)

    OPTIONS = [(0.1, 0.0, 0.0), (0.0, 2.5, 0.0), (0.0, 0.0, 1e-3), (0.2, 3.0, 2e-3)]

    def test_cross_entropy_matches_reference(self):
        n, v = 53, 211
        for eps, cap, alpha in self.OPTIONS:
            for dtype in (torch.float32, torch.bfloat16):
                with self.subTest(eps=eps, cap=cap, alpha=alpha, dtype=dtype):
                    logits = torch.randn(n, v, generator=self.gen).mul(3).to(dtype)
                    labels = make_labels(n, v, 0.2, self.gen)
                    sample_ids = torch.randint(0, 5, (n,), generator=self.gen)
                    w = reference_weights(labels, sample_ids, "sample")
                    d = float(w.sum()) * 1.5
                    x = logits.clone().requires_grad_()
                    loss = gt.cross_entropy(x, labels, d, "sample", sample_ids=sample_ids,
                                            label_smoothing=eps, logit_softcap=cap,
                                            alpha_lse=alpha)
                    loss.backward()
                    ref_loss, (ref_grad,) = grad_of(
                        lambda z: reference_ce_options(z, labels, w, d, eps, cap, alpha), logits)
                    self.assertAlmostEqual(loss.item(), ref_loss.item(),
                                           delta=1e-5 * abs(ref_loss.item()))
                    tol = (dict(rtol=1e-4, atol=1e-7) if dtype == torch.float32
                           else dict(rtol=2**-7, atol=1e-6))
                    torch.testing.assert_close(x.grad.double(), ref_grad, **tol)
                    # Forward only (no_grad) gives the same loss.
                    with torch.no_grad():
                        again = gt.cross_entropy(logits, labels, d, "sample",
                                                 sample_ids=sample_ids, label_smoothing=eps,
                                                 logit_softcap=cap, alpha_lse=alpha)
                    self.assertAlmostEqual(again.item(), loss.item(),
                                           delta=1e-6 * abs(loss.item()))

    def test_linear_cross_entropy_matches_reference(self):
        n, dm, v = 40, 12, 97
        for eps, cap, alpha in self.OPTIONS:
            with self.subTest(eps=eps, cap=cap, alpha=alpha):
                hidden = torch.randn(n, dm, generator=self.gen)
                weight = torch.randn(v, dm, generator=self.gen) * 0.5
                labels = make_labels(n, v, 0.2, self.gen)
                w = reference_weights(labels, None, "token")
                d = float(w.sum()) * 1.25
                h = hidden.clone().requires_grad_()
                wt = weight.clone().requires_grad_()
                loss = gt.linear_cross_entropy(h, wt, labels, d, chunk_rows=7,
                                               label_smoothing=eps, logit_softcap=cap,
                                               alpha_lse=alpha)
                loss.backward()
                ref_loss, (ref_h, ref_w) = grad_of(
                    lambda a, b: reference_ce_options(a @ b.t(), labels, w, d, eps, cap, alpha),
                    hidden, weight)
                self.assertAlmostEqual(loss.item(), ref_loss.item(),
                                       delta=1e-5 * abs(ref_loss.item()))
                torch.testing.assert_close(h.grad.double(), ref_h, rtol=1e-4, atol=1e-6)
                torch.testing.assert_close(wt.grad.double(), ref_w, rtol=1e-4, atol=1e-6)

    def test_each_option_matters_and_zero_is_the_plain_op(self):
        logits = torch.randn(20, 31, generator=self.gen)
        labels = make_labels(20, 31, 0.0, self.gen)
        plain = gt.cross_entropy(logits, labels, 20.0)
        self.assertEqual(gt.cross_entropy(logits, labels, 20.0, label_smoothing=0.0,
                                          logit_softcap=0.0, alpha_lse=0.0).item(),
                         plain.item())
        for kw in (dict(label_smoothing=0.1), dict(logit_softcap=1.0), dict(alpha_lse=0.01)):
            self.assertNotEqual(gt.cross_entropy(logits, labels, 20.0, **kw).item(),
                                plain.item(), kw)

    def test_bad_options_raise_value_errors_naming_them(self):
        logits = torch.randn(4, 7)
        labels = torch.tensor([0, 1, 2, 3])
        for kw, name in ((dict(label_smoothing=1.0), "label_smoothing"),
                         (dict(logit_softcap=-1.0), "logit_softcap"),
                         (dict(alpha_lse=float("nan")), "alpha_lse")):
            with self.subTest(kw=kw):
                with self.assertRaises(ValueError) as e:
                    gt.cross_entropy(logits, labels, 4.0, **kw)
                self.assertIn(name, str(e.exception))


class ErrorsTest(unittest.TestCase):
    def assert_value_error(self, fn, *fragments):
        with self.assertRaises(ValueError) as cm:
            fn()
        for f in fragments:
            self.assertIn(f, str(cm.exception))

    def test_cross_entropy_errors_carry_the_library_message(self):
        z = torch.randn(4, 5, requires_grad=True)
        y = torch.tensor([0, 1, IGNORE, 4])
        self.assert_value_error(lambda: gt.cross_entropy(z, torch.tensor([0, 1, 5, 4]), 4.0),
                                "INVALID_ARGUMENT", "label 5 at row 2 is outside [0, 5)")
        self.assert_value_error(lambda: gt.cross_entropy(z, torch.tensor([0, -1, 2, 4]), 4.0),
                                "label -1 at row 1")
        self.assert_value_error(lambda: gt.cross_entropy(z, y[:3], 4.0), "labels has shape [3]")
        self.assert_value_error(lambda: gt.cross_entropy(z, y.float(), 4.0), "integer")
        self.assert_value_error(lambda: gt.cross_entropy(z.double(), y, 4.0), "float32 or bfloat16")
        self.assert_value_error(lambda: gt.cross_entropy(z, y, 1.0), "FAILED_PRECONDITION",
                                "SEMANTICS.md §3")
        self.assert_value_error(lambda: gt.cross_entropy(z, y, float("nan")), "D = nan")
        self.assert_value_error(lambda: gt.cross_entropy(z, y, 4.0, "mean"), "unknown CE weight")
        self.assert_value_error(lambda: gt.cross_entropy(z, y, 4.0, "sample"),
                                "sample mode needs one sample id per token")
        self.assert_value_error(
            lambda: gt.cross_entropy(z, y, 4.0, token_weights=torch.tensor([1.0, -1, 1, 1])),
            "token weight -1 at row 1")
        bad = z.detach().clone()
        bad[3, 1] = float("inf")
        self.assert_value_error(lambda: gt.cross_entropy(bad, y, 4.0), "logits row 3",
                                "+inf")
        # A non-finite row whose label is ignored is not in the loss: fine.
        bad = z.detach().clone()
        bad[2, 0] = float("nan")
        self.assertTrue(math.isfinite(gt.cross_entropy(bad, y, 4.0).item()))

    def test_other_ops_raise_value_errors(self):
        h, w = torch.randn(6, 4), torch.randn(9, 4)
        y = torch.tensor([0, 1, 2, 3, 4, 8])
        self.assert_value_error(lambda: gt.linear_cross_entropy(h, w.t(), y, 6.0), "weight [V, Dm]")
        self.assert_value_error(lambda: gt.linear_cross_entropy(h, w, y.clamp(max=3) + 6, 6.0),
                                "label 9 at row 3")
        u = torch.randn(5, 4)
        self.assert_value_error(lambda: gt.z_loss(u, 3), "FAILED_PRECONDITION", "§4")
        self.assert_value_error(lambda: gt.z_loss(u, 5, input_mask=torch.tensor([0, 1, 2, 1, 1])),
                                "input_mask[2] = 2")
        self.assert_value_error(lambda: gt.z_loss(u, 5, input_mask=torch.ones(4)), "input_mask")
        self.assert_value_error(lambda: gt.balancing_loss(u, torch.tensor([1, 2, 3, 3]), 2),
                                "not a multiple of top_k")
        self.assert_value_error(lambda: gt.balancing_loss(u, torch.tensor([2, 2, 2]), 2),
                                "one count per expert")
        self.assert_value_error(lambda: gt.balancing_loss(u, torch.tensor([2, 2, 2, 0]), 2),
                                "§5")
        self.assert_value_error(
            lambda: gt.balancing_loss(u.softmax(-1), torch.tensor([2, 2, 2, 0]), 2, probs=True),
            "§5")
        self.assert_value_error(
            lambda: gt.count_expert_assignments(torch.tensor([[0, 4]]), 4), "expert")
        nan_u = u.clone()
        nan_u[1, 2] = float("nan")
        self.assert_value_error(lambda: gt.z_loss(nan_u, 5), "row 1")

    def test_mask_values_do_not_wrap_in_a_uint8_cast(self):
        # Issue 50: 256 became 0 in a cast to uint8, silently dropping the row; like 2, it is
        # a value the library's 0 / 1 mask does not take, named with its row.
        u = torch.randn(5, 4)
        counts = torch.tensor([2, 3, 3, 2])
        for big in (256, 257, -1, 2**40):
            mask = torch.tensor([1, big, 1, 1, 1])
            self.assert_value_error(lambda: gt.z_loss(u, 5, input_mask=mask), "z_loss",
                                    f"input_mask[1] = {big} must be 0 or 1")
            self.assert_value_error(lambda: gt.balancing_loss(u, counts, 2, input_mask=mask),
                                    "balancing_loss", f"input_mask[1] = {big} must be 0 or 1")
            self.assert_value_error(
                lambda: gt.count_expert_assignments(torch.zeros(5, 2, dtype=torch.long), 4,
                                                    input_mask=mask),
                f"input_mask[1] = {big}")
        # 0 / 1 and bool masks are as before.
        ones = torch.ones(5, dtype=torch.long)
        self.assertEqual(gt.z_loss(u, 5, input_mask=ones).item(), gt.z_loss(u, 5).item())
        self.assertEqual(gt.z_loss(u, 5, input_mask=ones.bool()).item(), gt.z_loss(u, 5).item())

    def test_balancing_probabilities_outside_0_1_are_refused(self):
        p = torch.tensor([[-0.5, 3.0, 0.5]] * 4)
        counts = torch.tensor([2, 3, 3])
        self.assert_value_error(lambda: gt.balancing_loss(p, counts, 2, probs=True),
                                "balancing_loss", "router probabilities (probs=True) must lie "
                                "in [0, 1], got values in [-0.5, 3]")
        nan_p = torch.full((4, 3), 1 / 3)
        nan_p[2, 1] = float("nan")
        self.assert_value_error(lambda: gt.balancing_loss(nan_p, counts, 2, probs=True),
                                "must lie in [0, 1]")
        # Probabilities, and logits of any sign without probs=True, are accepted.
        u = torch.randn(4, 3) * 5
        self.assertTrue(math.isfinite(gt.balancing_loss(u.softmax(-1), counts, 2,
                                                        probs=True).item()))
        self.assertTrue(math.isfinite(gt.balancing_loss(u, counts, 2).item()))

    def test_sparse_mkldnn_and_zero_width_tensors_name_the_argument(self):
        z = torch.randn(4, 5)
        y = torch.tensor([0, 1, 2, 4])
        u = torch.randn(4, 3)
        counts = torch.tensor([2, 3, 3])
        for layout, convert in (("Sparse", lambda t: t.to_sparse()),
                                ("Mkldnn", lambda t: t.to_mkldnn())):
            self.assert_value_error(lambda: gt.cross_entropy(convert(z), y, 4.0),
                                    f"cross_entropy: logits must be a dense (strided) tensor, "
                                    f"got a {layout} tensor")
            self.assert_value_error(lambda: gt.z_loss(convert(u), 4),
                                    f"z_loss: router_logits must be a dense (strided) tensor, "
                                    f"got a {layout} tensor")
            self.assert_value_error(lambda: gt.balancing_loss(convert(u), counts, 2),
                                    "balancing_loss: router_logits must be a dense")
            self.assert_value_error(
                lambda: gt.linear_cross_entropy(convert(z), torch.randn(6, 5), y, 4.0),
                "linear_cross_entropy: hidden must be a dense")
        sparse = lambda t: t.to_sparse()  # noqa: E731  (integer tensors: no mkldnn)
        self.assert_value_error(lambda: gt.cross_entropy(z, sparse(y), 4.0),
                                "cross_entropy: labels must be a dense")
        self.assert_value_error(
            lambda: gt.cross_entropy(z, y, 4.0, token_weights=sparse(torch.ones(4))),
            "cross_entropy: token_weights must be a dense")
        self.assert_value_error(lambda: gt.balancing_loss(u, sparse(counts), 2),
                                "balancing_loss: global_expert_counts must be a dense")
        self.assert_value_error(lambda: gt.z_loss(u, 4, input_mask=sparse(torch.ones(4))),
                                "z_loss: input_mask must be a dense")
        self.assert_value_error(lambda: gt.token_weights(sparse(y)), "token_weights: labels must")
        self.assert_value_error(
            lambda: gt.count_expert_assignments(sparse(torch.tensor([[0, 1]])), 3),
            "count_expert_assignments: topk_indices must be a dense")
        # Zero-width: no feature, expert or vocabulary entry to compute with.
        self.assert_value_error(
            lambda: gt.linear_cross_entropy(torch.randn(4, 0), torch.randn(5, 0), y, 4.0),
            "linear_cross_entropy: hidden must be [..., Dm]", "Dm >= 1")
        self.assert_value_error(lambda: gt.cross_entropy(torch.randn(4, 0), y, 4.0),
                                "cross_entropy: logits must be [..., V] with V >= 1")
        self.assert_value_error(lambda: gt.z_loss(torch.randn(4, 0), 4),
                                "z_loss: router_logits must be 2-D [T, E] with E >= 1")
        self.assert_value_error(
            lambda: gt.count_expert_assignments(torch.zeros(2, 0, dtype=torch.long), 3),
            "count_expert_assignments: topk_indices must be 2-D [T, K] with K >= 1")


class LinearCrossEntropyTest(unittest.TestCase):
    def setUp(self):
        self.gen = torch.Generator().manual_seed(2)

    def check(self, n, dm, v, dtype=torch.float32, chunk_rows=0, mode="token", lead=None,
              train_weight=True):
        hidden = torch.randn(n, dm, generator=self.gen).to(dtype)
        weight = (torch.randn(v, dm, generator=self.gen) * 0.5).to(dtype)
        labels = make_labels(n, v, 0.2, self.gen)
        sample_ids = torch.randint(0, 3, (n,), generator=self.gen)
        w = reference_weights(labels, sample_ids, mode)
        d = float(w.sum()) * 1.3
        h_in, y_in, s_in = hidden, labels, sample_ids
        if lead is not None:
            h_in, y_in, s_in = hidden.reshape(*lead, dm), labels.reshape(lead), sample_ids.reshape(
                lead)
        h = h_in.clone().requires_grad_()
        wt = weight.clone().requires_grad_(train_weight)
        loss = gt.linear_cross_entropy(h, wt, y_in, d, mode, sample_ids=s_in,
                                       chunk_rows=chunk_rows)
        loss.backward()
        ref_loss, (ref_h, ref_w) = grad_of(lambda a, b: reference_ce(a @ b.t(), labels, w, d),
                                           hidden, weight)
        self.assertAlmostEqual(loss.item(), ref_loss.item(), delta=1e-5 * abs(ref_loss.item()))
        self.assertEqual(h.grad.dtype, dtype)
        self.assertEqual(h.grad.shape, h_in.shape)
        tol = dict(rtol=1e-4, atol=1e-6) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-5)
        torch.testing.assert_close(h.grad.double().reshape(n, dm), ref_h, **tol)
        if train_weight:
            self.assertEqual(wt.grad.dtype, dtype)
            torch.testing.assert_close(wt.grad.double(), ref_w, **tol)
        else:
            self.assertIsNone(wt.grad)

    def test_matches_reference_for_every_chunking(self):
        for chunk in (0, 1, 7, 50, 1000):
            with self.subTest(chunk=chunk):
                self.check(50, 16, 211, chunk_rows=chunk)

    def test_sample_mode_leading_dims_and_frozen_head(self):
        self.check(24, 8, 97, mode="sample", lead=(2, 12), train_weight=False)

    def test_bf16_inputs(self):
        self.check(40, 16, 150, dtype=torch.bfloat16)

    def test_nn_linear_weight_is_used_in_place(self):
        head = torch.nn.Linear(8, 33, bias=False)
        h = torch.randn(10, 8, requires_grad=True)
        labels = make_labels(10, 33, 0.0, self.gen)
        gt.linear_cross_entropy(h, head.weight, labels, 10.0).backward()
        _, (ref_h, ref_w) = grad_of(
            lambda a, b: reference_ce(a @ b.t(), labels, torch.ones(10), 10.0), h, head.weight)
        torch.testing.assert_close(head.weight.grad.double(), ref_w, rtol=1e-4, atol=1e-6)

    def test_blas_thread_setting_is_left_alone(self):
        import ctypes
        blas = ctypes.CDLL("libopenblas.so.0")
        before = blas.openblas_get_num_threads()
        gt.linear_cross_entropy(torch.randn(64, 8), torch.randn(40, 8),
                                torch.randint(0, 40, (64,)), 64.0)
        self.assertEqual(blas.openblas_get_num_threads(), before)


class RouterLossesTest(unittest.TestCase):
    def setUp(self):
        self.gen = torch.Generator().manual_seed(3)
        self.t, self.e, self.k = 23, 6, 2
        self.u = torch.randn(self.t, self.e, generator=self.gen) * 2
        self.mask = (torch.rand(self.t, generator=self.gen) > 0.2).to(torch.uint8)

    def test_z_loss_matches_reference(self):
        n = int(self.mask.sum()) * 3  # the step has other micro-batches and ranks
        for dtype in (torch.float32, torch.bfloat16):
            with self.subTest(dtype=dtype):
                u_in = self.u.to(dtype)
                x = u_in.clone().requires_grad_()
                loss = gt.z_loss(x, n, 0.01, input_mask=self.mask.bool())
                loss.backward()
                m = self.mask.bool()
                ref_loss, (ref,) = grad_of(
                    lambda u: 0.01 * (u.logsumexp(-1)[m] ** 2).sum() / n, u_in)
                self.assertAlmostEqual(loss.item(), ref_loss.item(), delta=1e-6 * ref_loss.item())
                self.assertEqual(x.grad.dtype, dtype)
                tol = 1e-6 if dtype == torch.float32 else 2**-8
                torch.testing.assert_close(x.grad.double(), ref, rtol=tol, atol=1e-9)
                self.assertTrue(bool((x.grad[~m] == 0).all()))

    def reference_balancing(self, counts, g, alpha, m):
        n = counts.sum().double() / self.k
        coef = alpha / g * self.e * counts.double() / (n * self.k) / n
        return lambda p: (p[m] * coef).sum()

    def test_balancing_loss_matches_reference(self):
        counts = torch.tensor([9, 3, 0, 14, 6, 8])  # all ranks: 40 slots = 20 tokens x K
        counts = counts * 2
        m = self.mask.bool()
        for g in (1, 2):
            with self.subTest(g=g):
                x = self.u.clone().requires_grad_()
                loss = gt.balancing_loss(x, counts, self.k, g, 0.01, input_mask=self.mask)
                loss.backward()
                ref_fn = self.reference_balancing(counts, g, 0.01, m)
                ref_loss, (ref,) = grad_of(lambda u: ref_fn(u.softmax(-1)), self.u)
                self.assertAlmostEqual(loss.item(), ref_loss.item(), delta=1e-6 * ref_loss.item())
                torch.testing.assert_close(x.grad.double(), ref, rtol=1e-5, atol=1e-10)
                # The same term from probabilities, through the caller's own softmax.
                y = self.u.clone().requires_grad_()
                loss_p = gt.balancing_loss(y.softmax(-1), counts, self.k, g, 0.01,
                                           input_mask=self.mask, probs=True)
                loss_p.backward()
                self.assertAlmostEqual(loss_p.item(), ref_loss.item(),
                                       delta=1e-6 * ref_loss.item())
                torch.testing.assert_close(y.grad.double(), ref, rtol=1e-5, atol=1e-10)

    def test_empty_micro_step_contributes_zero(self):
        x = self.u.clone().requires_grad_()
        loss = gt.balancing_loss(x, torch.zeros(self.e, dtype=torch.int64), self.k,
                                 input_mask=torch.zeros(self.t, dtype=torch.uint8))
        loss.backward()
        self.assertEqual(loss.item(), 0.0)
        self.assertTrue(bool((x.grad == 0).all()))


class StatisticsHelpersTest(unittest.TestCase):
    def test_token_weights_match_reference(self):
        gen = torch.Generator().manual_seed(4)
        labels = make_labels(50, 10, 0.3, gen).reshape(5, 10)
        ids = torch.randint(0, 6, (5, 10), generator=gen)
        for mode in ("token", "sample", "square"):
            w = gt.token_weights(labels, ids, mode)
            self.assertEqual(w.shape, labels.shape)
            torch.testing.assert_close(w.double(), reference_weights(labels, ids, mode),
                                       rtol=1e-7, atol=0)

    def test_count_expert_assignments_matches_bincount(self):
        gen = torch.Generator().manual_seed(5)
        idx = torch.randint(0, 8, (30, 2), generator=gen)
        mask = torch.rand(30, generator=gen) > 0.3
        counts = gt.count_expert_assignments(idx, 8, mask)
        self.assertEqual(counts.dtype, torch.int64)
        self.assertTrue(torch.equal(counts, torch.bincount(idx[mask].reshape(-1), minlength=8)))


if __name__ == "__main__":
    unittest.main()
