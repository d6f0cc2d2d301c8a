"""``hypergrad.testing.check_unrolled``: unrolled hypergradients against differences of the
re-run procedure, and ``check_hypergrad``'s verdict when it is given one.

* ``hg.unrolled_grad`` through T SGD steps (and through heavy-ball steps whose learning rate is
  itself a hyperparameter) matches the central differences of the same procedure written by hand
  to ~1e-8 relative in float64, and the check passes; the independent reference is autograd
  through the hand-written procedure;
* a wrong unrolled hypergradient (scaled by 1.01, or truncated) fails with every direction
  marked, and ``assert_unrolled_close`` raises with the table;
* ``check_hypergrad`` given an unrolled hypergradient (the old misuse) says ``NOT AN INNER SOLVE
  (use check_unrolled)``, not ``FAILED (INNER SOLVE)``; an inexact solve checked with the implicit
  hypergradient, or a wrong gradient, still gets ``FAILED (INNER SOLVE)``;
* ``inner_tol=inf`` is refused with a pointer to ``check_unrolled``; bad arguments raise; a
  procedure drawing random minibatches is differenced with the same draws at every point.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import hypergrad as hg
import hypergrad.testing as hgt

F64 = torch.float64


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


# ridge regression with per-feature log penalties, solved by T SGD steps from zero
_g = torch.Generator().manual_seed(3)
X, Y = torch.randn(50, 4, generator=_g, dtype=F64), torch.randn(50, generator=_g, dtype=F64)
XV, YV = torch.randn(20, 4, generator=_g, dtype=F64), torch.randn(20, generator=_g, dtype=F64)
THETA = torch.tensor([-1.5, -0.5, 0.0, 0.7], dtype=F64)
STEPS, LR = 20, 0.3


def inner(w, theta):
    return 0.5 * ((X @ w - Y) ** 2).mean() + 0.5 * (theta.exp() * w**2).sum()


def outer(w, theta):  # with a direct term, so the hints have one to test
    return 0.5 * ((XV @ w - YV) ** 2).mean() + 0.05 * (theta**2).sum()


def sgd_steps(theta, steps=STEPS):
    """The procedure: STEPS SGD steps on ``inner`` from zero, written by hand."""
    w = torch.zeros(4, dtype=F64)
    for _ in range(steps):
        w = w - LR * (X.T @ (X @ w - Y) / 50 + theta.exp() * w)
    return w


def unrolled(steps=STEPS, truncate=None):
    g, _ = hg.unrolled_grad(inner, outer, torch.zeros(4, dtype=F64), THETA, steps=steps,
                            optimizer=hg.optim.sgd(lr=LR), truncate=truncate)  # fmt: skip
    return g


def autograd_through(procedure, hparams):
    h = hparams.clone().requires_grad_(True)
    return torch.autograd.grad(outer(procedure(h), h), h)[0]


def test_unrolled_grad_through_sgd_steps_passes_and_matches_to_1e8():
    g = unrolled()
    # hg.unrolled_grad differentiates exactly the hand-written procedure
    assert torch.allclose(g, autograd_through(sgd_steps, THETA), rtol=1e-12, atol=1e-15)
    report = hgt.check_unrolled(sgd_steps, outer, THETA, g)
    assert report.passed and report.inner_ok and report.procedure, str(report)
    assert not report.looks_unrolled and not report.inconclusive
    assert [r.direction for r in report.rows] == [f"hparams[{j}]" for j in range(4)]
    assert report.max_rel_err < 1e-7  # central differences' own error, eps = 1e-4
    for row, value in zip(report.rows, g.tolist()):
        assert row.analytic == pytest.approx(value, rel=1e-12)
        assert row.fd == pytest.approx(value, rel=1e-7)
        assert row.inner_ok and row.inner_err != row.inner_err  # NaN: nothing judged
    text = str(report)
    assert "PASSED: the hypergradient matches central differences of the re-run procedure" in (
        " ".join(text.split())
    )
    assert "inner procedure: re-run at 9 points" in text and "NOT CONVERGED" not in text
    lines = text.splitlines()
    assert lines[0].startswith("hypergradient check: 4 coordinate directions")
    assert lines[len(report.rows) + 5].startswith("PASSED: ")  # same layout as check_hypergrad
    for line in lines[3:7]:  # the inner columns are "-", not nan
        assert line.split()[-3:] == ["-", "ok", "-"]
    assert hgt.assert_unrolled_close(sgd_steps, outer, THETA, g) is not None


def test_learned_learning_rate_and_momentum_dict_hparams():
    """hparams {"theta", "log_lr"} through heavy-ball steps (torch.optim.SGD's momentum)."""
    h = {"theta": THETA, "log_lr": torch.tensor(-1.5, dtype=F64)}

    def heavy_ball(h, steps=10, mu=0.8):
        w, buf = torch.zeros(4, dtype=F64), torch.zeros(4, dtype=F64)
        for k in range(steps):
            grad = X.T @ (X @ w - Y) / 50 + h["theta"].exp() * w
            buf = grad if k == 0 else mu * buf + grad
            w = w - h["log_lr"].exp() * buf
        return w

    def outer_h(w, h):
        return outer(w, h["theta"])

    def heavy_ball_opt(h):
        return hg.optim.sgd(lr=h["log_lr"].exp(), momentum=0.8)

    g, _ = hg.unrolled_grad(lambda w, h: inner(w, h["theta"]), outer_h, torch.zeros(4, dtype=F64),
                            h, steps=10, optimizer=heavy_ball_opt)  # fmt: skip
    report = hgt.check_unrolled(heavy_ball, outer_h, h, g)
    assert report.passed and report.max_rel_err < 1e-7, str(report)
    assert report.rows[-1].direction == "hparams['log_lr']" and abs(report.rows[-1].fd) > 1e-3
    wrong = {"theta": g["theta"], "log_lr": 1.01 * g["log_lr"]}
    assert hgt.check_unrolled(heavy_ball, outer_h, h, wrong).failed == ["hparams['log_lr']"]


def test_a_one_percent_error_fails_in_every_direction():
    g = unrolled()
    report = hgt.check_unrolled(sgd_steps, outer, THETA, 1.01 * g)
    assert not report.passed and report.inner_ok and not report.inconclusive, str(report)
    assert report.failed == [f"hparams[{j}]" for j in range(4)]
    for row in report.rows:
        assert row.analytic / row.fd == pytest.approx(1.01, rel=1e-6)
        assert row.abs_err / row.tol > 50  # far outside rtol = 1e-4
    text = " ".join(str(report).split())
    assert "FAILED (HYPERGRADIENT)" in text and "[1.01, 1.01]" in text
    assert "the procedure is re-run as it is" in text and "inner solves are converged" not in text
    with pytest.raises(AssertionError, match="FAILED"):
        hgt.assert_unrolled_close(sgd_steps, outer, THETA, 1.01 * g)
    # the mutation the default rtol guards against: 100x looser passes the 1% error
    assert hgt.check_unrolled(sgd_steps, outer, THETA, 1.01 * g, rtol=2e-2).passed


def test_truncated_backprop_fails_with_a_hint_and_a_sign_flip_is_named():
    report = hgt.check_unrolled(sgd_steps, outer, THETA, unrolled(truncate=2))
    assert not report.passed and report.failed, str(report)
    assert "truncate < steps" in report.reason
    flipped = hgt.check_unrolled(sgd_steps, outer, THETA, -unrolled())
    assert "sign flip" in flipped.reason
    no_direct = hgt.check_unrolled(sgd_steps, outer, THETA, unrolled() - 0.1 * THETA)
    assert "misses the direct term" in no_direct.reason


@pytest.mark.parametrize("steps", [3, STEPS])
def test_check_hypergrad_given_an_unrolled_hypergradient_points_at_check_unrolled(steps):
    """The old misuse: T steps passed as solve_inner. It used to say FAILED (INNER SOLVE) even
    though grad matched the differences to 1e-9. After 3 steps the unrolled hypergradient is far
    from the implicit one at the same point; after 20 it equals it to the tolerance."""
    g = unrolled(steps)
    procedure = lambda t: sgd_steps(t, steps)  # noqa: E731
    report = hgt.check_hypergrad(procedure, inner, outer, THETA, g)
    assert not report.passed and not report.inner_ok and report.looks_unrolled, str(report)
    assert report.failed == [] and not report.procedure and report.max_rel_err < 1e-7
    text = " ".join(str(report).split())
    assert "NOT AN INNER SOLVE (use check_unrolled):" in text
    assert "FAILED (INNER SOLVE)" not in text and "hypergradient itself is wrong" not in text
    assert "hypergrad.testing.check_unrolled(solve_inner, outer_loss, hparams, grad)" in text
    assert ("differs from the implicit hypergradient" in text) == (steps == 3)
    assert ("solve it more accurately instead" in text) == (steps == STEPS)
    with pytest.raises(AssertionError, match="NOT AN INNER SOLVE"):
        hgt.assert_hypergrad_close(procedure, inner, outer, THETA, g)
    # and the check it points at passes
    assert hgt.check_unrolled(procedure, outer, THETA, g).passed


def test_inexact_solves_without_an_unrolled_gradient_stay_inner_solve_failures():
    # the implicit hypergradient at the procedure's point, or a wrong one: not the derivative
    # of the procedure, so no "unrolled" verdict; the hint still names check_unrolled
    procedure = lambda t: sgd_steps(t, 3)  # noqa: E731
    with warnings.catch_warnings():  # the point is not stationary, and implicit_grad says so
        warnings.simplefilter("ignore")
        implicit, _ = hg.implicit_grad(inner, outer, procedure(THETA), THETA, solver=hg.Exact())
    for grad in (implicit, 1.01 * unrolled(3)):
        report = hgt.check_hypergrad(procedure, inner, outer, THETA, grad)
        assert not report.looks_unrolled and not report.inner_ok and report.failed, str(report)
        assert "FAILED (INNER SOLVE)" in str(report)
        assert "checked by hypergrad.testing.check_unrolled" in " ".join(report.reason.split())
    # a correct gradient through solves off by a constant: the offset cancels in the
    # differences, so they match grad, while the first-order criterion fails the solves. Within
    # 10x the tolerance that is an inner-solve verdict; far beyond it, "unrolled", with a note
    # that grad is also the implicit hypergradient there
    exact = lambda t: torch.linalg.solve(X.T @ X / 50 + torch.diag(t.exp()), X.T @ Y / 50)  # noqa: E731
    for offset, unrolled_verdict in ((1e-9, False), (1e-7, True)):
        report = hgt.check_hypergrad(lambda t, o=offset: exact(t) + o, inner, outer, THETA)
        assert report.failed == [] and not report.inner_ok, str(report)
        assert report.looks_unrolled == unrolled_verdict
        text = " ".join(str(report).split())
        assert ("FAILED (INNER SOLVE)" in text) != unrolled_verdict
        assert ("solve it more accurately instead" in text) == unrolled_verdict


def test_hyperstep_and_inner_tol_point_at_check_unrolled():
    with pytest.raises(hg.HypergradValueError, match="check_unrolled"):
        hgt.check_hypergrad(sgd_steps, inner, outer, THETA, unrolled(), inner_tol=float("inf"))
    with pytest.raises(hg.HypergradValueError, match="finite number") as exc:
        hgt.check_hypergrad(sgd_steps, inner, outer, THETA, inner_tol=float("nan"))
    assert "check_unrolled" not in str(exc.value)


def test_bad_arguments():
    g = unrolled()
    with pytest.raises(hg.HypergradTypeError, match="procedure"):
        hgt.check_unrolled(None, outer, THETA, g)
    with pytest.raises(hg.HypergradTypeError, match="outer_loss"):
        hgt.check_unrolled(sgd_steps, None, THETA, g)
    with pytest.raises(hg.HypergradTypeError, match="grad is required"):
        hgt.check_unrolled(sgd_steps, outer, THETA, None)
    with pytest.raises(hg.HypergradValueError, match="grad"):
        hgt.check_unrolled(sgd_steps, outer, THETA, torch.zeros(3, dtype=F64))
    with pytest.raises(hg.HypergradValueError, match="eps"):
        hgt.check_unrolled(sgd_steps, outer, THETA, g, eps=-1.0)
    with pytest.raises(TypeError):
        hgt.check_unrolled(sgd_steps, outer, THETA, g, inner_tol=1e-3)  # no inner problem

    def changing(theta):
        return sgd_steps(theta) if bool(theta[0] == THETA[0]) else sgd_steps(theta)[:3]

    with pytest.raises(hg.HypergradValueError, match="procedure returned"):
        hgt.check_unrolled(changing, outer, THETA, g)
    with pytest.warns(hg.HypergradWarning, match="float32"):
        hgt.check_unrolled(lambda t: sgd_steps(t.double()).float(), lambda w, t: outer(
            w.double(), t.double()).float(), THETA.float(), g.float())  # fmt: skip


def test_random_minibatches_draw_the_same_numbers_at_every_point():
    """A stochastic procedure (a random minibatch per step) is differenced with the same draws:
    it runs with the RNG seeded to ``seed``; grad computed under the same seed matches."""

    def minibatch_sgd(theta):
        w = torch.zeros(4, dtype=F64)
        for _ in range(15):
            i = torch.randint(0, 50, (10,))
            w = w - LR * (X[i].T @ (X[i] @ w - Y[i]) / 10 + theta.exp() * w)
        return w

    state = torch.get_rng_state()
    with torch.random.fork_rng():
        torch.manual_seed(7)
        g = autograd_through(minibatch_sgd, THETA)
    report = hgt.check_unrolled(minibatch_sgd, outer, THETA, g, seed=7)
    assert report.passed and report.max_rel_err < 1e-7, str(report)
    assert torch.equal(torch.get_rng_state(), state)
    assert not hgt.check_unrolled(minibatch_sgd, outer, THETA, g, seed=8).passed
