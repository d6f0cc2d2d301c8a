"""``hypergrad.testing``: the hypergradient checks against independent references.

* passes on closed-form problems: ridge regression with per-feature penalties (inner solution by
  ``torch.linalg.solve``) whose outer loss also depends directly on the hyperparameters, a dict of
  hyperparameters (reference: autograd through the closed-form solve), random directions, and the
  ``HyperStep`` variant (an ``nn.Linear`` ridge regression retrained in closed form);
* the finite differences it reports equal the closed-form hypergradient, computed by hand;
* catches injected errors — a sign flip, a missing direct term, a damped adjoint solve — with
  exactly the offending directions marked (predicted from the closed forms), and reports an
  unconverged inner solve as an inner-solve problem, not a wrong hypergradient;
* ``assert_*`` raise with the table, float32 warns, the table has one line per direction, the
  user's modules and RNG are left as they were;
* the code blocks of ``docs/testing.md`` run and print what the page shows (numbers aside).
"""

from __future__ import annotations

import contextlib
import io
import re

import pytest
import torch
from helpers import ROOT
from torch import nn

import hypergrad as hg
import hypergrad.testing as hgt

F64 = torch.float64


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


# --------------------------------------------------------------------------------------------
# ridge regression with per-feature penalties lambda_j = exp(theta_j)
#   inner(w, theta) = 1/2 mean (X w - y)^2 + 1/2 sum_j exp(theta_j) w_j^2
#   outer(w, theta) = 1/2 mean (Xv w - yv)^2 + c/2 sum_j k_j theta_j^2   (direct term)
# --------------------------------------------------------------------------------------------
class Ridge:
    def __init__(self, d=5, n=60, nv=30, seed=0, direct=(0.3, 0.2, 0.0, 0.0, 0.0)):
        g = torch.Generator().manual_seed(seed)
        self.d, self.n, self.nv = d, n, nv
        self.X = torch.randn(n, d, generator=g, dtype=F64)
        self.y = self.X @ torch.randn(d, generator=g, dtype=F64) + torch.randn(
            n, generator=g, dtype=F64
        )
        self.Xv = torch.randn(nv, d, generator=g, dtype=F64)
        self.yv = torch.randn(nv, generator=g, dtype=F64)
        k = torch.zeros(d, dtype=F64)
        k[: len(direct)] = torch.tensor(direct[:d], dtype=F64)
        self.k = k  # direct-term weights: only the first coordinates have one
        self.theta = torch.linspace(-1.0, 0.5, d, dtype=F64)

    def A(self, theta, damping=0.0):
        return (
            self.X.T @ self.X / self.n
            + torch.diag(theta.exp())
            + damping * torch.eye(self.d, dtype=F64)
        )

    def solve(self, theta):
        return torch.linalg.solve(self.A(theta), self.X.T @ self.y / self.n)

    def inner(self, w, theta):
        return 0.5 * ((self.X @ w - self.y) ** 2).mean() + 0.5 * (theta.exp() * w**2).sum()

    def outer(self, w, theta):
        return 0.5 * ((self.Xv @ w - self.yv) ** 2).mean() + 0.5 * (self.k * theta**2).sum()

    def direct(self, theta):
        return self.k * theta

    def closed_form(self, theta, damping=0.0, direct=True):
        """dL_out/dtheta = direct - lambda * w * A^{-1} grad_w L_out (A damped if asked)."""
        w = self.solve(theta)
        g_out = self.Xv.T @ (self.Xv @ w - self.yv) / self.nv
        z = torch.linalg.solve(self.A(theta, damping), g_out)
        return -(theta.exp() * w * z) + (self.direct(theta) if direct else 0.0)

    def gradient_steps(self, steps):
        """An inner solver that stops after a few gradient steps (not converged)."""

        def solve(theta):
            w = torch.zeros(self.d, dtype=F64)
            for _ in range(steps):
                w = w - 0.5 * (self.X.T @ (self.X @ w - self.y) / self.n + theta.exp() * w)
            return w

        return solve


def _labels(d, name="hparams"):
    return [f"{name}[{j}]" for j in range(d)]


def _expected_failures(ref, wrong, rtol=1e-4, atol=1e-8, margin=10.0):
    """Coordinates where ``wrong`` misses ``ref`` by far more (or far less) than the tolerance;
    asserts that no coordinate is close to the threshold, so the prediction is unambiguous."""
    out = []
    for j, (a, b) in enumerate(zip(ref.tolist(), wrong.tolist())):
        err, tol = abs(a - b), atol + rtol * max(abs(a), abs(b))
        assert err > margin * tol or err < tol / margin, (j, err, tol)
        if err > tol:
            out.append(f"hparams[{j}]")
    return out


# --------------------------------------------------------------------------------------------
# passes
# --------------------------------------------------------------------------------------------
def test_ridge_passes_and_differences_equal_closed_form():
    r = Ridge()
    ref = r.closed_form(r.theta)
    # the direct term matters at this point (so a check that ignored it could not pass)
    assert float((ref - r.closed_form(r.theta, direct=False)).norm() / ref.norm()) > 0.1
    report = hgt.check_hypergrad(r.solve, r.inner, r.outer, r.theta)
    assert report.passed and report.inner_ok, str(report)
    assert report.directions == "coordinates"
    assert [row.direction for row in report.rows] == _labels(r.d)
    for j, row in enumerate(report.rows):
        # the analytic side is hg.implicit_grad; the finite difference is the checker's own
        assert row.analytic == pytest.approx(float(ref[j]), rel=1e-9, abs=1e-13)
        assert row.fd == pytest.approx(float(ref[j]), rel=1e-6, abs=1e-10)
        assert row.passed and row.inner_ok
    assert report.max_abs_err < 1e-8 and report.max_rel_err < 1e-4
    assert report.center_inner_grad_norm < 1e-12


def test_ridge_passes_with_given_closed_form_grad():
    r = Ridge()
    report = hgt.check_hypergrad(r.solve, r.inner, r.outer, r.theta, r.closed_form(r.theta))
    assert report.passed, str(report)


def test_dict_hparams_against_autograd_through_the_closed_form():
    """hparams {"log_lam": (3,), "scale": ()}, params {"w", "b"} (unpenalised intercept); the
    reference differentiates the closed-form solution with ordinary autograd."""
    g = torch.Generator().manual_seed(1)
    n, d = 40, 3
    X, y = torch.randn(n, d, generator=g, dtype=F64), torch.randn(n, generator=g, dtype=F64)
    Xv, yv = torch.randn(25, d, generator=g, dtype=F64), torch.randn(25, generator=g, dtype=F64)
    Xa = torch.cat([X, torch.ones(n, 1, dtype=F64)], 1)

    def solve(h):
        pen = torch.cat([h["log_lam"].exp(), torch.zeros(1, dtype=F64)])
        sol = torch.linalg.solve(Xa.T @ Xa / n + torch.diag(pen), Xa.T @ (h["scale"] * y) / n)
        return {"w": sol[:d], "b": sol[d]}

    def inner(p, h):
        r = X @ p["w"] + p["b"] - h["scale"] * y
        return 0.5 * (r**2).mean() + 0.5 * (h["log_lam"].exp() * p["w"] ** 2).sum()

    def outer(p, h):
        r = Xv @ p["w"] + p["b"] - yv
        return 0.5 * (r**2).mean() + 0.1 * (h["scale"] - 2.0) ** 2

    h = {
        "log_lam": torch.tensor([-1.0, 0.0, 1.0], dtype=F64),
        "scale": torch.tensor(0.7, dtype=F64),
    }
    hr = {k: v.clone().requires_grad_(True) for k, v in h.items()}
    ref = torch.autograd.grad(outer(solve(hr), hr), [hr["log_lam"], hr["scale"]])
    ref = torch.cat([ref[0], ref[1].reshape(1)])

    report = hgt.check_hypergrad(solve, inner, outer, h)
    assert report.passed, str(report)
    labels = [f"hparams['log_lam'][{j}]" for j in range(3)] + ["hparams['scale']"]
    assert [row.direction for row in report.rows] == labels
    for row, value in zip(report.rows, ref.tolist()):
        assert row.fd == pytest.approx(value, rel=1e-6, abs=1e-10)
        assert row.analytic == pytest.approx(value, rel=1e-9, abs=1e-13)


def test_random_directions_above_sixteen_elements():
    r = Ridge(d=20, n=80)
    ref = r.closed_form(r.theta)
    report = hgt.check_hypergrad(r.solve, r.inner, r.outer, r.theta)
    assert report.passed, str(report)
    assert report.directions == "random" and len(report.rows) == 8
    # the same seed draws the same unit directions; <ref, d> is what the rows compare with
    gen = torch.Generator().manual_seed(0)
    for row in report.rows:
        v = torch.randn(20, generator=gen, dtype=F64)
        assert row.fd == pytest.approx(float(ref @ (v / v.norm())), rel=1e-6, abs=1e-10)
    assert len(hgt.check_hypergrad(r.solve, r.inner, r.outer, r.theta, directions=3).rows) == 3
    assert hgt.check_hypergrad(r.solve, r.inner, r.outer, r.theta, directions="all").passed


def test_given_direction_is_used_as_is():
    r = Ridge()
    ref = r.closed_form(r.theta)
    d = torch.zeros(r.d, dtype=F64)
    d[0], d[3] = 1.0, 2.0
    report = hgt.check_hypergrad(r.solve, r.inner, r.outer, r.theta, directions=[d])
    assert report.directions == "given" and report.rows[0].direction == "direction #0"
    assert report.rows[0].fd == pytest.approx(float(ref[0] + 2 * ref[3]), rel=1e-6)


# --------------------------------------------------------------------------------------------
# catches
# --------------------------------------------------------------------------------------------
def test_catches_sign_flip():
    r = Ridge()
    report = hgt.check_hypergrad(r.solve, r.inner, r.outer, r.theta, -r.closed_form(r.theta))
    assert not report.passed and report.inner_ok
    assert report.failed == _labels(r.d)
    assert "sign flip" in report.reason and "FAILED (HYPERGRADIENT)" in str(report)


def test_catches_missing_direct_term():
    r = Ridge()
    ref = r.closed_form(r.theta)
    wrong = r.closed_form(r.theta, direct=False)  # what forgetting dL_out/dtheta gives
    report = hgt.check_hypergrad(r.solve, r.inner, r.outer, r.theta, wrong)
    assert not report.passed and report.inner_ok
    # only the coordinates with a direct term are wrong, and only they are marked
    assert report.failed == _expected_failures(ref, wrong) == ["hparams[0]", "hparams[1]"]
    assert "direct term" in report.reason


def test_catches_damped_adjoint_solve():
    r = Ridge()
    w = r.solve(r.theta)
    wrong, _ = hg.implicit_grad(r.inner, r.outer, w, r.theta, solver=hg.CG(damping=1.0, tol=1e-12))
    # the injected error is the damped closed form, and damping matters here
    assert torch.allclose(wrong, r.closed_form(r.theta, damping=1.0), rtol=1e-8, atol=1e-12)
    ref = r.closed_form(r.theta)
    expected = _expected_failures(ref, wrong)
    assert len(expected) >= 3
    report = hgt.check_hypergrad(r.solve, r.inner, r.outer, r.theta, wrong)
    assert not report.passed and report.inner_ok
    assert report.failed == expected
    lines = {line.split()[0]: line for line in str(report).splitlines()}
    for row in report.rows:  # the table marks exactly the failing directions
        assert ("FAIL" in lines[row.direction]) == (not row.passed)


def test_unconverged_inner_solve_is_an_inner_solve_failure():
    r = Ridge()
    bad = r.gradient_steps(3)
    for grad in (None, r.closed_form(r.theta)):  # computed at the bad point, or the exact one
        report = hgt.check_hypergrad(bad, r.inner, r.outer, r.theta, grad)
        assert report.inner_ok is False and report.passed is False
        assert not report.center_inner_ok and not any(row.inner_ok for row in report.rows)
        assert "inner solve is not converged" in report.reason
        assert "not a verdict on the hypergradient" in report.reason
        assert "hypergradient itself is wrong" not in report.reason
        text = str(report)
        assert "FAILED (INNER SOLVE)" in text and "NOT CONVERGED" in text
    # a converged iterative solve passes
    assert hgt.check_hypergrad(r.gradient_steps(2000), r.inner, r.outer, r.theta).passed


def test_inner_tol_is_a_gradient_norm_bound():
    r = Ridge()
    bad = r.gradient_steps(3)
    gnorm = hgt.check_hypergrad(bad, r.inner, r.outer, r.theta).center_inner_grad_norm
    assert gnorm > 1e-3
    loose = hgt.check_hypergrad(bad, r.inner, r.outer, r.theta, inner_tol=10 * gnorm)
    assert loose.inner_ok and "inner_tol" in str(loose)
    strict = hgt.check_hypergrad(r.solve, r.inner, r.outer, r.theta, inner_tol=0.0)
    assert strict.inner_ok is False  # closed-form solves still leave ~1e-16 of gradient


# --------------------------------------------------------------------------------------------
# the default tolerance is pinned: a looser (or tighter) rtol or atol changes these verdicts
# --------------------------------------------------------------------------------------------
def test_default_rtol_fails_a_half_percent_error_and_passes_half_of_rtol():
    """The coordinates of the ridge hypergradient are 0.04-0.74, so atol (1e-8) is negligible
    and the verdict is rtol's: scaled by 1.005 every direction is ~50x its tolerance off (a 100x
    looser rtol, 1e-2, would pass it), by 1 + 2e-4 ~2x off, by 1 + 5e-5 ~0.5x (passes). The
    finite differences agree with the closed form to ~1e-9 relative, far inside these margins."""
    r = Ridge()
    ref = r.closed_form(r.theta)
    assert float(ref.abs().min()) > 0.04
    for factor, ratio in ((1.005, 50.0), (1 + 2e-4, 2.0)):
        report = hgt.check_hypergrad(r.solve, r.inner, r.outer, r.theta, ref * factor)
        assert not report.passed and not report.inconclusive and report.inner_ok, str(report)
        assert report.failed == _labels(r.d)
        for row in report.rows:
            assert row.abs_err / row.tol == pytest.approx(ratio, rel=0.01)
        assert "FAILED (HYPERGRADIENT)" in str(report)
        with pytest.raises(AssertionError, match="FAILED"):
            hgt.assert_hypergrad_close(r.solve, r.inner, r.outer, r.theta, ref * factor)
    # the mutation this guards against: 100x the default rtol passes the half-percent error
    assert hgt.check_hypergrad(r.solve, r.inner, r.outer, r.theta, ref * 1.005, rtol=1e-2).passed
    report = hgt.check_hypergrad(r.solve, r.inner, r.outer, r.theta, ref * (1 + 5e-5))
    assert report.passed and not report.inconclusive, str(report)
    for row in report.rows:
        assert row.abs_err / row.tol == pytest.approx(0.5, rel=0.01)


def test_default_atol_fails_an_absolute_error_of_five_atol():
    """With the outer loss scaled by 1e-4 the hypergradient is 4e-6 to 7e-5 (rtol * |g| <= 7e-9,
    comparable to atol): an error of 5e-8 in every coordinate is 2.9-4.8x the tolerance, fails
    (a 100x looser atol, 1e-6, would pass it); an error of 3e-9 is < 0.3x and passes."""
    r = Ridge()
    outer = lambda w, theta: 1e-4 * r.outer(w, theta)  # noqa: E731
    ref = 1e-4 * r.closed_form(r.theta)
    assert 4e-6 < float(ref.abs().min()) and float(ref.abs().max()) < 1e-4
    report = hgt.check_hypergrad(r.solve, r.inner, outer, r.theta, ref + 5e-8)
    assert not report.passed and report.failed == _labels(r.d), str(report)
    assert all(2.5 < row.abs_err / row.tol < 5.0 for row in report.rows)
    assert hgt.check_hypergrad(r.solve, r.inner, outer, r.theta, ref + 5e-8, atol=1e-6).passed
    report = hgt.check_hypergrad(r.solve, r.inner, outer, r.theta, ref + 3e-9)
    assert report.passed and all(row.abs_err / row.tol < 0.3 for row in report.rows)


# --------------------------------------------------------------------------------------------
# inconclusive: a hypergradient below atol everywhere is no PASS; degenerate directions
# --------------------------------------------------------------------------------------------
def test_hypergradient_below_atol_everywhere_is_inconclusive_not_passed():
    """Outer loss scaled by 1e-9: |g| <= 7.4e-10 < atol in every direction, so the right
    hypergradient and a zero one both 'match'; neither may be reported as PASSED."""
    r = Ridge()
    outer = lambda w, theta: 1e-9 * r.outer(w, theta)  # noqa: E731
    ref = 1e-9 * r.closed_form(r.theta)
    assert float(ref.abs().max()) < 1e-9
    for grad in (None, torch.zeros(r.d, dtype=F64), ref):
        report = hgt.check_hypergrad(r.solve, r.inner, outer, r.theta, grad)
        assert report.inconclusive and not report.passed and report.inner_ok, str(report)
        assert report.blind == _labels(r.d) and report.failed == []
        text = " ".join(str(report).split())
        assert "INCONCLUSIVE: the hypergradient is below atol in every direction" in text
        assert "PASSED" not in text and "atol = 1e-08" in text
        with pytest.raises(AssertionError, match="INCONCLUSIVE"):
            hgt.assert_hypergrad_close(r.solve, r.inner, outer, r.theta, grad)
    # with atol below the hypergradient's size the check can tell again, both ways
    good = hgt.check_hypergrad(r.solve, r.inner, outer, r.theta, atol=1e-16)
    assert good.passed and not good.inconclusive and good.blind == [], str(good)
    zero = hgt.check_hypergrad(r.solve, r.inner, outer, r.theta, torch.zeros(r.d, dtype=F64),
                               atol=1e-16)  # fmt: skip
    assert not zero.passed and not zero.inconclusive and zero.failed == _labels(r.d)


def test_some_directions_below_atol_pass_but_are_named():
    r = Ridge()
    outer = lambda w, theta: 1e-9 * r.outer(w, theta)  # noqa: E731
    small, large = torch.zeros(r.d, dtype=F64), torch.zeros(r.d, dtype=F64)
    small[0], large[2] = 1.0, 1e3  # <g, small> ~ -2.8e-10 (blind), <g, large> ~ -7.4e-7
    report = hgt.check_hypergrad(r.solve, r.inner, outer, r.theta, directions=[small, large])
    assert report.passed and not report.inconclusive and report.blind == ["direction #0"]
    assert "below atol" in report.reason and "direction #0" in report.reason


def test_atol_above_every_value_is_inconclusive_for_hyperstep_too():
    mr = ModuleRidge()
    batch, val = (mr.X, mr.y), (mr.Xv, mr.yv)
    report = hgt.check_hyperstep(mr.step, batch, mr.retrain, val, atol=10.0)
    assert report.inconclusive and not report.passed, str(report)
    with pytest.raises(AssertionError, match="INCONCLUSIVE"):
        hgt.assert_hyperstep_close(mr.step, batch, mr.retrain, val, grad=[0 * mr.closed_form()],
                                   atol=10.0)  # fmt: skip


@pytest.mark.parametrize(
    ("scale", "match"),
    [(0.0, "is zero"), (float("nan"), "not finite"), (1e-12, "degenerate")],
)
def test_zero_and_degenerate_directions_are_refused(scale, match):
    """A given direction of norm 1e-12 made every comparison trivially pass (the step eps * d
    = 1e-16 is below the rounding of hparams ~ 1)."""
    r = Ridge()
    d = torch.full((r.d,), scale, dtype=F64)
    with pytest.raises(hg.HypergradValueError, match=match):
        hgt.check_hypergrad(r.solve, r.inner, r.outer, r.theta, directions=[d])
    with pytest.raises(hg.HypergradValueError, match=match):
        hgt.check_hypergrad(r.solve, r.inner, r.outer, r.theta,
                            directions=[torch.ones(r.d, dtype=F64), d])  # fmt: skip


def test_a_step_lost_in_rounding_is_refused():
    r = Ridge()
    with pytest.raises(hg.HypergradValueError, match="degenerate"):
        hgt.check_hypergrad(r.solve, r.inner, r.outer, r.theta, eps=1e-15)
    # a small but resolvable direction is accepted (used as given)
    d = torch.zeros(r.d, dtype=F64)
    d[2] = 1e-3
    report = hgt.check_hypergrad(r.solve, r.inner, r.outer, r.theta, directions=[d])
    assert report.passed, str(report)


# --------------------------------------------------------------------------------------------
# assert, warnings, table, arguments
# --------------------------------------------------------------------------------------------
def test_assert_hypergrad_close_raises_with_the_table():
    r = Ridge()
    report = hgt.assert_hypergrad_close(r.solve, r.inner, r.outer, r.theta)
    assert report.passed
    with pytest.raises(AssertionError) as exc:
        hgt.assert_hypergrad_close(r.solve, r.inner, r.outer, r.theta, -r.closed_form(r.theta))
    msg = " ".join(str(exc.value).split())  # the verdict is wrapped at 100 columns
    for col in ("direction", "finite diff", "analytic", "abs err", "rel err", "inner err"):
        assert col in msg
    assert msg.count("FAIL") >= r.d and "sign flip" in msg


def test_float32_warns():
    r = Ridge()
    with pytest.warns(hg.HypergradWarning, match="float32"):
        report = hgt.check_hypergrad(r.solve, r.inner, r.outer, r.theta.float())
    assert report.dtype == "float32"
    if not report.passed:  # then the verdict blames the precision, not the hypergradient
        assert report.precision_limited and "FAILED (PRECISION)" in str(report)
    assert issubclass(hg.HypergradWarning, UserWarning)


def test_str_has_header_and_one_line_per_direction():
    r = Ridge()
    report = hgt.check_hypergrad(r.solve, r.inner, r.outer, r.theta)
    lines = str(report).splitlines()
    header = lines[1]
    for col in ("direction", "finite diff", "analytic", "abs err", "rel err", "inner err", "ok"):
        assert col in header
    rows = [line for line in lines if line.startswith("hparams[")]
    assert len(rows) == r.d == len(report.rows)
    assert [line.split()[0] for line in rows] == _labels(r.d)
    assert all(line.rstrip().endswith("ok") for line in rows)
    assert lines[0].startswith("hypergradient check: 5 coordinate directions")
    assert lines[len(report.rows) + 5].startswith("PASSED: ")  # after the inner-solve lines


def test_bad_arguments_and_rng_untouched():
    r = Ridge()
    with pytest.raises(hg.HypergradValueError, match="eps"):
        hgt.check_hypergrad(r.solve, r.inner, r.outer, r.theta, eps=0.0)
    with pytest.raises(hg.HypergradValueError, match="directions"):
        hgt.check_hypergrad(r.solve, r.inner, r.outer, r.theta, directions="some")
    with pytest.raises(hg.HypergradValueError, match="grad"):
        hgt.check_hypergrad(r.solve, r.inner, r.outer, r.theta, torch.zeros(2, dtype=F64))
    with pytest.raises(hg.HypergradTypeError, match="solve_inner"):
        hgt.check_hypergrad(None, r.inner, r.outer, r.theta)
    state = torch.get_rng_state()

    def noisy_solve(theta):  # draws random numbers; the draws are the same at every point
        torch.randn(3)
        return r.solve(theta)

    assert hgt.check_hypergrad(noisy_solve, r.inner, r.outer, r.theta).passed
    assert torch.equal(torch.get_rng_state(), state)


# --------------------------------------------------------------------------------------------
# HyperStep: nn.Linear ridge regression (unpenalised bias), per-feature log penalties in a hyper
# module, closed-form retraining
# --------------------------------------------------------------------------------------------
class LogPenalty(nn.Module):
    def __init__(self, values):
        super().__init__()
        self.log_lam = nn.Parameter(torch.tensor(values, dtype=F64))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))


class ModuleRidge:
    def __init__(self, d=3, n=50, nv=20, seed=2):
        g = torch.Generator().manual_seed(seed)
        self.d, self.n, self.nv = d, n, nv
        self.X = torch.randn(n, d, generator=g, dtype=F64)
        self.y = torch.randn(n, 1, generator=g, dtype=F64)
        self.Xv = torch.randn(nv, d, generator=g, dtype=F64)
        self.yv = torch.randn(nv, 1, generator=g, dtype=F64)
        self.model = nn.Linear(d, 1).double()
        self.hyper = LogPenalty([-1.0, 0.0, -2.0][:d])
        self.step = hg.HyperStep(
            self.model, self.hyper, self.inner, self.outer, solver=hg.CG(tol=1e-12)
        )

    def inner(self, m, batch):
        x, t = batch
        pen = (self.hyper.log_lam.exp() * m.weight[0] ** 2).sum()
        return 0.5 * ((m(x) - t) ** 2).mean() + 0.5 * pen

    def outer(self, m, batch):
        x, t = batch
        return 0.5 * ((m(x) - t) ** 2).mean() + 0.05 * (self.hyper.log_lam**2).sum()

    def solution(self, log_lam):
        Xa = torch.cat([self.X, torch.ones(self.n, 1, dtype=F64)], 1)
        pen = torch.cat([log_lam.exp(), torch.zeros(1, dtype=F64)])
        return torch.linalg.solve(Xa.T @ Xa / self.n + torch.diag(pen), Xa.T @ self.y / self.n)

    def retrain(self, hyper):
        """Closed-form retraining, in place; also bumps a buffer and a .grad (restored)."""
        sol = self.solution(hyper.log_lam.detach())[:, 0]
        with torch.no_grad():
            self.model.weight.copy_(sol[: self.d][None])
            self.model.bias.copy_(sol[self.d :])
        hyper.calls += 1
        self.model.weight.grad = torch.full_like(self.model.weight, 7.0)

    def closed_form(self):
        """d outer / d log_lam through the closed form (ordinary autograd)."""
        ll = self.hyper.log_lam.detach().clone().requires_grad_(True)
        sol = self.solution(ll)
        Xva = torch.cat([self.Xv, torch.ones(self.nv, 1, dtype=F64)], 1)
        loss = 0.5 * ((Xva @ sol - self.yv) ** 2).mean() + 0.05 * (ll**2).sum()
        return torch.autograd.grad(loss, ll)[0]


def _state(mr):
    return {
        "params": [p.detach().clone() for p in mr.model.parameters()]
        + [mr.hyper.log_lam.detach().clone()],
        "grads": [None if p.grad is None else p.grad.clone() for p in mr.model.parameters()]
        + [mr.hyper.log_lam.grad],
        "buffers": [b.clone() for b in mr.hyper.buffers()],
        "training": [mr.model.training, mr.hyper.training],
    }


def _same(a, b):
    def eq(x, y):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            return torch.equal(x, y)
        return x == y

    return all(len(a[k]) == len(b[k]) and all(eq(x, y) for x, y in zip(a[k], b[k])) for k in a)


def test_hyperstep_ridge_passes_and_leaves_modules_untouched():
    mr = ModuleRidge()
    with torch.no_grad():  # the model starts somewhere that is not the inner solution
        mr.model.weight.fill_(0.25)
    mr.model.bias.grad = torch.ones(1, dtype=F64)
    mr.model.eval()
    before = _state(mr)
    batch, val = (mr.X, mr.y), (mr.Xv, mr.yv)
    report = hgt.check_hyperstep(mr.step, batch, mr.retrain, val)
    assert report.passed and report.inner_ok, str(report)
    assert [row.direction for row in report.rows] == [f"hyper.log_lam[{j}]" for j in range(3)]
    ref = mr.closed_form()
    for row, value in zip(report.rows, ref.tolist()):
        assert row.fd == pytest.approx(value, rel=1e-6, abs=1e-10)
        assert row.analytic == pytest.approx(value, rel=1e-9, abs=1e-13)
    assert _same(_state(mr), before)
    assert mr.model.weight.grad is None and mr.model.training is False
    assert hgt.assert_hyperstep_close(mr.step, batch, mr.retrain, val, grad=ref).passed
    assert _same(_state(mr), before)


def test_hyperstep_catches_sign_flip_and_unconverged_retraining():
    mr = ModuleRidge()
    batch, val = (mr.X, mr.y), (mr.Xv, mr.yv)
    before = _state(mr)
    ref = mr.closed_form()
    report = hgt.check_hyperstep(mr.step, batch, mr.retrain, val, grad=[-ref])
    assert not report.passed and report.inner_ok and len(report.failed) == 3
    assert "sign flip" in report.reason
    with pytest.raises(AssertionError, match="finite diff"):
        hgt.assert_hyperstep_close(mr.step, batch, mr.retrain, val, grad=[-ref])

    def three_steps(hyper):  # from a fixed start, three gradient steps only
        with torch.no_grad():
            mr.model.weight.zero_()
            mr.model.bias.zero_()
        opt = torch.optim.SGD(mr.model.parameters(), lr=0.5)
        for _ in range(3):
            opt.zero_grad()
            mr.inner(mr.model, batch).backward()
            opt.step()

    report = hgt.check_hyperstep(mr.step, batch, three_steps, val)
    assert report.inner_ok is False and report.passed is False
    assert "FAILED (INNER SOLVE)" in str(report)
    assert _same(_state(mr), before)


def test_hyperstep_retrain_must_not_replace_parameters():
    mr = ModuleRidge()
    before = _state(mr)
    weight = mr.model.weight

    def replace(hyper):
        mr.model.weight = nn.Parameter(torch.zeros(1, mr.d, dtype=F64))

    with pytest.raises(hg.HypergradValueError, match="in place"):
        hgt.check_hyperstep(mr.step, (mr.X, mr.y), replace)
    assert mr.model.weight is weight and _same(_state(mr), before)


# --------------------------------------------------------------------------------------------
# docs/testing.md: its code blocks run and print what the page shows
# --------------------------------------------------------------------------------------------
def _skeleton(text):
    """Whitespace-normalised text with every number replaced by '#' (digits may differ)."""
    return re.sub(r"[-+]?\d+(\.\d+)?(e[-+]\d+)?", "#", " ".join(text.split()))


def test_docs_testing_md_blocks_run_and_print_what_the_page_shows():
    page = (ROOT / "docs" / "testing.md").read_text()
    fences = re.findall(r"```(python|text)\n(.*?)```", page, re.S)
    namespace: dict = {}
    ran = 0
    for k, (lang, code) in enumerate(fences):
        if lang != "python":
            continue
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, f"docs/testing.md block {ran}", "exec"), namespace)
        shown = fences[k + 1]
        assert shown[0] == "text", f"python block {ran} is not followed by its output"
        assert _skeleton(out.getvalue()) == _skeleton(shown[1]), f"block {ran}"
        ran += 1
    assert ran == 9
