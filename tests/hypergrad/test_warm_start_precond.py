"""Warm starts and preconditioning change the number of iterations, never the converged answer.

References: dense float64 solves (``torch.linalg.solve``), the ridge hypergradient in closed form.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hypergrad as hg
from hypergrad.solvers import hutchinson_diagonal, solve_cg

F64 = torch.float64


def _badly_scaled(n=60, seed=0):
    """SPD with a diagonal spread over 6 decades and a small coupling: Jacobi's home ground."""
    g = torch.Generator().manual_seed(seed)
    d = torch.logspace(-3, 3, n, dtype=F64)
    u = torch.randn(n, 3, generator=g, dtype=F64)
    a = torch.diag(d) + 1e-3 * (u @ u.T)
    b = torch.randn(n, generator=g, dtype=F64)
    return a, b


def _solve(a, b, **kw):
    return solve_cg(lambda v: (a @ v[0],), (b,), maxiter=2000, tol=1e-10, **kw)


@pytest.mark.parametrize("kind", ["callable", "hutchinson"])
def test_preconditioning_cuts_iterations_not_accuracy(kind):
    a, b = _badly_scaled()
    exact = torch.linalg.solve(a, b)
    x_plain, plain = _solve(a, b)
    pre = (lambda r: (r[0] / torch.diagonal(a),)) if kind == "callable" else "hutchinson"
    x_pre, info = _solve(a, b, preconditioner=pre, probes=64)
    assert plain.converged and info.converged
    for x in (x_plain, x_pre):
        assert float((x[0] - exact).norm() / exact.norm()) < 1e-6  # kappa ~1e6 x tol 1e-10
    assert info.iterations < plain.iterations / 4, (info.iterations, plain.iterations)
    assert info.extras["preconditioner"] == kind
    if kind == "hutchinson":
        assert info.extras["preconditioner_matvecs"] == 64
        assert info.matvecs >= info.iterations + 64


def test_hutchinson_diagonal_is_unbiased():
    a, _ = _badly_scaled(n=20)
    est = hutchinson_diagonal(lambda v: (a @ v[0],), (torch.zeros(20, dtype=F64),), probes=4000)
    rel = (est[0] - torch.diagonal(a)).abs() / torch.diagonal(a)
    assert float(rel.max()) < 0.05


def test_bad_preconditioners_are_refused():
    a, b = _badly_scaled(n=10)
    with pytest.raises(hg.HypergradValueError, match="positive definite"):
        _solve(a, b, preconditioner=lambda r: (-r[0],))
    with pytest.raises(hg.HypergradTypeError, match="preconditioner"):
        hg.CG(preconditioner="jacobi")
    with pytest.raises(hg.HypergradValueError, match="probes"):
        hg.CG(preconditioner="hutchinson", probes=0)


def _ridge(seed=0, n=80, d=12):
    g = torch.Generator().manual_seed(seed)
    X, y = torch.randn(n, d, generator=g, dtype=F64), torch.randn(n, 1, generator=g, dtype=F64)
    Xv, yv = torch.randn(40, d, generator=g, dtype=F64), torch.randn(40, 1, generator=g, dtype=F64)
    model = nn.Linear(d, 1, bias=False).to(F64)
    log_decay = torch.full((d,), -1.0, dtype=F64, requires_grad=True)

    def inner(m, batch):
        return 0.5 * ((m(X) - y) ** 2).mean() + 0.5 * (log_decay.exp() * m.weight[0] ** 2).sum()

    def outer(m, batch):
        return 0.5 * ((m(Xv) - yv) ** 2).mean()

    def fit():  # the inner solution in closed form, written into the model
        a = X.T @ X / n + torch.diag(log_decay.detach().exp())
        with torch.no_grad():
            model.weight.copy_(torch.linalg.solve(a, X.T @ y / n).T)

    def closed_form():
        lam = log_decay.detach().exp()
        a = X.T @ X / n + torch.diag(lam)
        w = torch.linalg.solve(a, X.T @ y / n)[:, 0]
        gw = Xv.T @ (Xv @ w - yv[:, 0]) / 40
        return -torch.linalg.solve(a, gw) * w * lam  # d outer / d log_decay

    return model, log_decay, inner, outer, fit, closed_form


def test_hyperstep_warm_start_same_answer_fewer_iterations():
    model, log_decay, inner, outer, fit, closed_form = _ridge()
    cold = hg.HyperStep(model, [log_decay], inner, outer, solver=hg.CG(tol=1e-10))
    warm = hg.HyperStep(model, [log_decay], inner, outer, solver=hg.CG(tol=1e-10), warm_start=True)
    counts = {"cold": [], "warm": []}
    for step in range(4):  # an outer loop: small hyperparameter steps, inner problem re-solved
        with torch.no_grad():
            log_decay.add_(0.05 * (step + 1))
        fit()
        ref = closed_form()
        for name, hs in (("cold", cold), ("warm", warm)):
            info = hs(None)
            counts[name].append(info.solve.iterations)
            assert info.solve.converged
            torch.testing.assert_close(log_decay.grad, ref, rtol=1e-8, atol=1e-12)
    assert counts["warm"][0] == counts["cold"][0]  # nothing to start from yet
    assert sum(counts["warm"][1:]) < sum(counts["cold"][1:]), counts
    warm.reset_adjoint()
    assert warm.adjoint is None


def test_warm_start_needs_the_implicit_method():
    model, log_decay, inner, outer, _, _ = _ridge()
    with pytest.raises(hg.HypergradValueError, match="warm_start"):
        hg.HyperStep(model, [log_decay], inner, outer, method="unrolled",
                     optimizer=hg.optim.sgd(lr=0.1), warm_start=True)  # fmt: skip


def test_extrapolated_warm_start_same_answer_fewer_iterations_than_previous():
    """warm_start="extrapolate" starts from 2 x_k - x_{k-1}: on a smooth outer path it needs
    fewer iterations than the previous adjoint alone, and converges to the same closed form."""
    model, log_decay, inner, outer, fit, closed_form = _ridge()
    steps = {
        mode: hg.HyperStep(
            model, [log_decay], inner, outer, solver=hg.CG(tol=1e-10), warm_start=mode
        )
        for mode in ("previous", "extrapolate")
    }
    counts = {mode: [] for mode in steps}
    for _ in range(6):  # a smooth outer path: equal steps of the log decays
        with torch.no_grad():
            log_decay.add_(0.1)
        fit()
        ref = closed_form()
        for mode, hs in steps.items():
            info = hs(None)
            counts[mode].append(info.solve.iterations)
            assert info.solve.converged
            torch.testing.assert_close(log_decay.grad, ref, rtol=1e-8, atol=1e-12)
    # the first two solves start alike (zero, then the previous adjoint); later ones extrapolate
    assert counts["extrapolate"][:2] == counts["previous"][:2]
    assert sum(counts["extrapolate"][2:]) < sum(counts["previous"][2:]), counts
    steps["extrapolate"].reset_adjoint()
    assert steps["extrapolate"]._start() is None


@pytest.mark.parametrize("bad", ["next", 1, None, 0.5])
def test_warm_start_values_are_checked(bad):
    model, log_decay, inner, outer, _, _ = _ridge()
    with pytest.raises(hg.HypergradValueError, match="warm_start must be one of"):
        hg.HyperStep(model, [log_decay], inner, outer, warm_start=bad)
