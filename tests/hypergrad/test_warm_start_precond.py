"""Warm starts and preconditioning change the number of iterations, never the converged answer.

References: dense float64 solves (``torch.linalg.solve``), the ridge hypergradient in closed form.
The last part tests ``hg.DensePreconditioner`` (a dense factor kept across CG solves).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import hypergrad as hg
from hypergrad.solvers import SolveInfo, hutchinson_diagonal, solve_cg

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
    warm = hg.HyperStep(
        model, [log_decay], inner, outer,
        method=hg.Implicit(solver=hg.CG(tol=1e-10), warm_start="previous"),
    )  # fmt: skip
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


def test_warm_start_belongs_to_the_implicit_method():
    """Only hg.Implicit has a warm start (a solve to start); hg.Unrolled has no such setting."""
    assert "warm_start" in {f.name for f in dataclasses.fields(hg.Implicit)}
    assert "warm_start" not in {f.name for f in dataclasses.fields(hg.Unrolled)}
    with pytest.raises(TypeError, match="warm_start"):
        hg.Unrolled(hg.optim.sgd(lr=0.1), warm_start="previous")  # type: ignore[call-arg]


def test_extrapolated_warm_start_same_answer_fewer_iterations_than_previous():
    """warm_start="extrapolate" starts from 2 x_k - x_{k-1}: on a smooth outer path it needs
    fewer iterations than the previous adjoint alone, and converges to the same closed form."""
    model, log_decay, inner, outer, fit, closed_form = _ridge()
    steps = {
        mode: hg.HyperStep(
            model,
            [log_decay],
            inner,
            outer,
            method=hg.Implicit(solver=hg.CG(tol=1e-10), warm_start=mode),
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


@pytest.mark.parametrize("bad", ["next", 1, None, 0.5, True])
def test_warm_start_values_are_checked(bad):
    with pytest.raises(hg.HypergradValueError, match="warm_start must be one of"):
        hg.Implicit(warm_start=bad)


# ---- hg.DensePreconditioner ----------------------------------------------------------------


def _spd(n=50, seed=0, decades=4):
    """SPD with eigenvalues spread over ``decades`` decades, in a random basis."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=F64))
    a = q @ torch.diag(torch.logspace(-decades / 2, decades / 2, n, dtype=F64)) @ q.T
    return 0.5 * (a + a.T), torch.randn(n, generator=g, dtype=F64)


def _drift(a, k, seed=1, size=0.02):
    """``a`` perturbed by a symmetric positive semi-definite drift that grows with ``k``."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(a.shape[0], 4, generator=g, dtype=F64)
    return a + size * k * (u @ u.T) / a.shape[0]


def _cg(a, b, **kw):
    return solve_cg(lambda v: (a @ v[0],), (b,), maxiter=2000, tol=1e-11, **kw)


def test_fresh_factor_converges_at_once_to_the_dense_answer():
    a, b = _spd()
    pre = hg.DensePreconditioner()
    x, info = _cg(a, b, preconditioner=pre)
    torch.testing.assert_close(x[0], torch.linalg.solve(a, b), rtol=1e-9, atol=0)
    assert info.converged and info.iterations <= 2
    assert pre.builds == 1
    assert info.extras["preconditioner"] == "dense"
    assert info.extras["preconditioner_rebuilt"] is True
    assert info.extras["preconditioner_matvecs"] == 50
    assert info.matvecs >= 50 + info.iterations


def test_reused_factor_same_answers_fewer_products_than_plain_cg():
    """An outer-loop-like sequence of slowly drifting systems: each answer equals the dense
    solve; the total products (builds included) are far below plain CG's."""
    a, b = _spd(decades=5)
    pre = hg.DensePreconditioner()
    products = {"plain": 0, "dense": 0}
    rebuilt = []
    for k in range(12):
        ak = _drift(a, k)
        ref = torch.linalg.solve(ak, b)
        x_plain, plain = _cg(ak, b)
        x_pre, info = _cg(ak, b, preconditioner=pre)
        for x, i in ((x_plain, plain), (x_pre, info)):
            assert i.converged
            assert float((x[0] - ref).norm() / ref.norm()) < 1e-6  # kappa 1e5 x tol 1e-11
        products["plain"] += plain.matvecs
        products["dense"] += info.matvecs
        rebuilt.append(info.extras["preconditioner_rebuilt"])
        if not rebuilt[-1]:
            assert info.iterations < plain.iterations / 3, (k, info.iterations, plain.iterations)
            assert info.extras["preconditioner_age"] >= 1
    assert rebuilt[0] and sum(rebuilt) == pre.builds < 12
    assert products["dense"] < products["plain"] / 2, products


def test_rebuild_rule_rent_or_buy():
    """The next solve rebuilds once the applications since the build reach rebuild_after."""
    a, b = _spd(n=30, decades=4)
    far = _drift(a, 40, size=1.0)  # far from ``a``: the old factor costs several iterations
    pre = hg.DensePreconditioner(rebuild_after=3)
    _cg(a, b, preconditioner=pre)  # builds on ``a``
    _, info = _cg(far, b, preconditioner=pre)
    assert not info.extras["preconditioner_rebuilt"] and info.iterations > 3
    _, info = _cg(far, b, preconditioner=pre)  # the budget of 3 is spent: rebuilds on ``far``
    assert info.extras["preconditioner_rebuilt"] and pre.builds == 2
    assert info.iterations <= 2
    pre.reset()
    _, info = _cg(far, b, preconditioner=pre)
    assert info.extras["preconditioner_rebuilt"] and pre.builds == 3


def test_default_budget_is_one_build():
    """rebuild_after=None: the budget is n applications, the products of one build."""
    a, b = _spd(n=20, decades=6)
    far = _drift(a, 200, size=1.0)
    pre = hg.DensePreconditioner()
    _cg(a, b, preconditioner=pre)
    spent = [pre._spent]  # applications since the build, before each solve
    for _ in range(40):
        _, info = _cg(far, b, preconditioner=pre)
        if info.extras["preconditioner_rebuilt"]:
            break
        spent.append(pre._spent)
    assert pre.builds == 2
    assert spent[-2] < 20 <= spent[-1], spent  # rebuilt at the first solve past n = 20


def test_new_shapes_rebuild_and_float32_keeps_its_dtype():
    a, b = _spd(n=12)
    pre = hg.DensePreconditioner()
    _cg(a, b, preconditioner=pre)
    a2, b2 = _spd(n=7, seed=3)
    x, info = _cg(a2, b2, preconditioner=pre)  # different size: rebuilt, not an error
    assert info.extras["preconditioner_rebuilt"] and pre.builds == 2
    torch.testing.assert_close(x[0], torch.linalg.solve(a2, b2), rtol=1e-8, atol=0)
    a32, b32 = a2.float(), b2.float()
    x, info = solve_cg(lambda v: (a32 @ v[0],), (b32,), tol=1e-5, preconditioner=pre)
    assert info.extras["preconditioner_rebuilt"]  # dtype changed
    assert x[0].dtype == torch.float32 and info.converged


def test_indefinite_build_gives_a_positive_definite_preconditioner():
    """A factor built on an indefinite matrix is V |w|^-1 V^T (eigenvalues clipped), so that
    r^T M r > 0; reused on an SPD system it still gives the dense answer."""
    d = torch.tensor([2.0, -1.0, 3.0, 0.5], dtype=F64)
    pre = hg.DensePreconditioner()
    info = SolveInfo(solver="cg")
    apply = pre.setup(lambda v: (d * v[0],), (torch.ones(4, dtype=F64),), info)
    assert info.extras["preconditioner"] == "dense (eigenvalues clipped)"
    r = torch.tensor([1.0, 2.0, -1.0, 4.0], dtype=F64)
    torch.testing.assert_close(apply((r,))[0], r / d.abs(), rtol=1e-12, atol=0)
    spd = torch.diag(d.abs() + 0.1)
    x, info = solve_cg(lambda v: (spd @ v[0],), (r,), tol=1e-12, preconditioner=pre)
    assert not info.extras["preconditioner_rebuilt"] and info.converged
    torch.testing.assert_close(x[0], r / (d.abs() + 0.1), rtol=1e-10, atol=0)


def test_damping_is_part_of_the_factor():
    a, b = _spd(n=10)
    pre = hg.DensePreconditioner(damping=0.5)
    info = SolveInfo(solver="cg")
    apply = pre.setup(lambda v: (a @ v[0],), (b,), info)
    torch.testing.assert_close(
        apply((b,))[0], torch.linalg.solve(a + 0.5 * torch.eye(10, dtype=F64), b), rtol=1e-10,
        atol=0,
    )  # fmt: skip
    x, info = solve_cg(lambda v: (a @ v[0],), (b,), tol=1e-12, damping=0.5, preconditioner=pre)
    torch.testing.assert_close(
        x[0], torch.linalg.solve(a + 0.5 * torch.eye(10, dtype=F64), b), rtol=1e-9, atol=0
    )


def test_bad_settings_and_inputs_are_refused():
    with pytest.raises(hg.HypergradValueError, match="rebuild_after"):
        hg.DensePreconditioner(rebuild_after=0)
    with pytest.raises(hg.HypergradValueError, match="damping"):
        hg.DensePreconditioner(damping=float("nan"))
    a, b = _spd(n=10)
    with pytest.raises(hg.HypergradValueError, match="max_numel"):
        _cg(a, b, preconditioner=hg.DensePreconditioner(max_numel=5))
    z = torch.zeros(3, 3, dtype=F64)
    with pytest.raises(hg.HypergradValueError, match="zero"):
        _cg(z, torch.ones(3, dtype=F64), preconditioner=hg.DensePreconditioner())
    with pytest.raises(hg.HypergradValueError, match="preconditioner"):
        hg.compile_implicit_grad(
            lambda p, h: (p["w"] ** 2).sum(), lambda p, h: p["w"].sum(),
            solver=hg.CG(preconditioner=hg.DensePreconditioner()),
        )  # fmt: skip


def test_hyperstep_outer_loop_closed_form_with_a_kept_factor():
    """HyperStep keeps its solver, hence the factor, across outer steps: every hypergradient
    equals the closed form; after the first step the solves reuse the factor."""
    model, log_decay, inner, outer, fit, closed_form = _ridge()
    pre = hg.DensePreconditioner()
    plain = hg.HyperStep(model, [log_decay], inner, outer, solver=hg.CG(tol=1e-10))
    dense = hg.HyperStep(
        model, [log_decay], inner, outer, solver=hg.CG(tol=1e-10, preconditioner=pre)
    )
    its = {"plain": [], "dense": []}
    for step in range(5):
        with torch.no_grad():
            log_decay.add_(0.05 * (step + 1))
        fit()
        ref = closed_form()
        for name, hs in (("plain", plain), ("dense", dense)):
            info = hs(None)
            assert info.solve.converged
            its[name].append(info.solve.iterations)
            torch.testing.assert_close(log_decay.grad, ref, rtol=1e-8, atol=1e-12)
    assert pre.builds < 5
    assert sum(its["dense"]) < sum(its["plain"]) / 2, its
