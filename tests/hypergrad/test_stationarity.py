"""``info.stationarity`` of every implicit entry point (issue 22 item 5).

The implicit formula is the hypergradient only at a stationary point of the inner loss. A point a
few inner CG iterations short of the minimiser gives a result 46% off the closed form with a
converged adjoint solve; these tests check that every entry point reports how far the point is
(``||g|| / max(||H psi||, ||g - H psi||)``, ``g`` the inner gradient), that ``implicit_grad`` and
``@hg.implicit`` warn there and stay silent at a tight solution, and that ``HyperStep`` reports
without warning (its documented policy).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import hypergrad as hg
from hypergrad.conditions import STATIONARITY_THRESHOLD
from hypergrad.implicit.adjoint import hypergradient_core
from hypergrad.solvers import SolveInfo

F64 = torch.float64


def _ridge():
    """An ill-conditioned per-feature ridge problem, its closed-form hypergradient and an inner
    CG solver (``inner_cg(k)``: ``k`` CG iterations on the normal equations)."""
    gen = torch.Generator().manual_seed(2)
    X = torch.randn(60, 8, generator=gen, dtype=F64) * torch.logspace(0, 1.5, 8, dtype=F64)
    y = torch.randn(60, generator=gen, dtype=F64)
    Xv, yv = torch.randn(40, 8, generator=gen, dtype=F64), torch.randn(40, generator=gen, dtype=F64)
    lam = torch.full((8,), 0.5, dtype=F64)

    def inner(w, lam):
        return 0.5 * ((X @ w - y) ** 2).mean() + 0.5 * (lam * w**2).sum()

    def outer(w, lam):
        return 0.5 * ((Xv @ w - yv) ** 2).mean()

    def solution(lam):
        return torch.linalg.solve(X.T @ X / 60 + torch.diag(lam), X.T @ y / 60)

    exact = torch.func.grad(lambda lam: outer(solution(lam), lam))(lam)
    A, c = X.T @ X / 60 + torch.diag(lam), X.T @ y / 60

    def inner_cg(k):
        w, r = torch.zeros(8, dtype=F64), c.clone()
        p = r.clone()
        for _ in range(k):
            a = (r @ r) / (p @ A @ p)
            w, r_new = w + a * p, r - a * (A @ p)
            p, r = r_new + (r_new @ r_new) / (r @ r) * p, r_new
        return w

    return inner, outer, lam, solution, exact, A, c, inner_cg


def _rel(a, b):
    return float((a - b).norm() / b.norm())


# -- implicit_grad ---------------------------------------------------------------------------


def test_the_45_percent_off_point_warns_and_reports_a_large_stationarity():
    inner, outer, lam, _, exact, _, _, inner_cg = _ridge()
    with pytest.warns(hg.NonStationaryWarning, match="inner_loss") as rec:
        g, info = hg.implicit_grad(inner, outer, inner_cg(5), lam, solver=hg.CG(tol=1e-12))
    assert 0.3 < _rel(g, exact) < 0.6  # the symptom: ~45% off ...
    assert info.solve.converged  # ... with a converged adjoint solve that cannot see it
    assert info.stationarity > 10 * STATIONARITY_THRESHOLD
    assert len([r for r in rec if r.category is hg.NonStationaryWarning]) == 1
    assert rec[0].filename == __file__  # points at the call


def test_a_tight_solution_is_silent_and_reports_rounding():
    inner, outer, lam, solution, exact, _, _, _ = _ridge()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g, info = hg.implicit_grad(inner, outer, solution(lam), lam, solver=hg.CG(tol=1e-12))
    assert info.stationarity < 1e-8
    assert _rel(g, exact) < 1e-8
    assert info.extras["condition_products"] == 1


def test_stationarity_shrinks_with_the_hypergradient_error():
    """Along the inner CG iterates, a smaller stationarity goes with a smaller error."""
    inner, outer, lam, _, exact, _, _, inner_cg = _ridge()
    stats, errs = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", hg.NonStationaryWarning)
        for k in (3, 5, 6):
            g, info = hg.implicit_grad(inner, outer, inner_cg(k), lam, solver=hg.Exact())
            stats.append(info.stationarity)
            errs.append(_rel(g, exact))
    assert stats == sorted(stats, reverse=True) and errs == sorted(errs, reverse=True)


def test_definition_for_a_quadratic_inner_loss():
    """``||g|| / max(||H w||, ||g - H w||)``; for ridge ``g = A w - c``, so ``H w = A w`` and
    ``g - H w = -c``: the relative residual of the normal equations."""
    inner, outer, lam, _, _, A, c, inner_cg = _ridge()
    w = inner_cg(4)
    with pytest.warns(hg.NonStationaryWarning):
        _, info = hg.implicit_grad(inner, outer, w, lam, solver=hg.Exact())
    expected = float((A @ w - c).norm()) / max(float((A @ w).norm()), float(c.norm()))
    assert info.stationarity == pytest.approx(expected, rel=1e-10)


def test_the_same_number_as_custom_root_of_the_stationary_condition():
    inner, outer, lam, _, _, _, _, inner_cg = _ridge()
    w = inner_cg(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", hg.NonStationaryWarning)
        _, info = hg.implicit_grad(inner, outer, w, lam, solver=hg.Exact())
        v = torch.ones(8, dtype=F64)
        _, rinfo = hg.root_vjp(hg.conditions.stationary(inner), w, lam, v, solver=hg.Exact())
    assert info.stationarity == pytest.approx(rinfo.stationarity, rel=1e-10)


def test_invariant_to_scaling_the_loss_and_the_parameters():
    inner, outer, lam, _, _, _, _, inner_cg = _ridge()
    w = inner_cg(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", hg.NonStationaryWarning)
        _, base = hg.implicit_grad(inner, outer, w, lam, solver=hg.Exact())
        _, loss_scaled = hg.implicit_grad(
            lambda w, h: 1e3 * inner(w, h), outer, w, lam, solver=hg.Exact()
        )
        _, param_scaled = hg.implicit_grad(  # w = 10 u
            lambda u, h: inner(10 * u, h), lambda u, h: outer(10 * u, h), w / 10, lam,
            solver=hg.Exact(),
        )  # fmt: skip
    assert loss_scaled.stationarity == pytest.approx(base.stationarity, rel=1e-9)
    assert param_scaled.stationarity == pytest.approx(base.stationarity, rel=1e-9)


def test_exactly_zero_at_an_exact_stationary_point_without_a_product():
    c = torch.tensor([1.0, -2.0, 3.0], dtype=F64)
    lam = torch.tensor(0.5, dtype=F64)

    def inner(w, lam):
        return 0.5 * ((w - c) ** 2).sum() + 0.0 * lam * (w**2).sum()

    def outer(w, lam):
        return (w**2).sum() + lam**2

    _, info = hg.implicit_grad(inner, outer, c.clone(), lam, solver=hg.CG())
    assert info.stationarity == 0.0
    assert info.extras["condition_products"] == 0


def test_engines_agree():
    inner, outer, lam, _, _, _, _, inner_cg = _ridge()
    w = inner_cg(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", hg.NonStationaryWarning)
        _, reuse = hg.implicit_grad(inner, outer, w, lam, solver=hg.Exact())
        _, recompute = hg.implicit_grad(inner, outer, w, lam, solver=hg.Exact(), engine="recompute")
    assert recompute.stationarity == pytest.approx(reuse.stationarity, rel=1e-12)


def test_the_warning_text_is_fixed_so_the_default_filter_shows_it_once():
    inner, outer, lam, _, _, _, _, inner_cg = _ridge()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        infos = [
            hg.implicit_grad(inner, outer, inner_cg(k), lam, solver=hg.Exact())[1] for k in (3, 5)
        ]
    assert infos[0].stationarity != infos[1].stationarity  # two different numbers ...
    assert [w.category for w in caught] == [hg.NonStationaryWarning]  # ... one warning


def test_stationarity_false_skips_the_product_and_the_warning():
    inner, outer, lam, _, exact, _, _, inner_cg = _ridge()
    w = inner_cg(5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g_off, info = hg.implicit_grad(
            inner, outer, w, lam, solver=hg.CG(tol=1e-12), stationarity=False
        )
    assert math.isnan(info.stationarity) and info.extras["condition_products"] == 0
    with pytest.warns(hg.NonStationaryWarning):
        g_on, _ = hg.implicit_grad(inner, outer, w, lam, solver=hg.CG(tol=1e-12))
    assert torch.equal(g_off, g_on)  # a report, not a different result
    with pytest.raises(hg.HypergradTypeError, match="stationarity"):
        hg.implicit_grad(inner, outer, w, lam, stationarity="off")


def test_a_logistic_inner_problem_solved_by_a_few_gradient_steps():
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(80, 5, generator=gen, dtype=F64)
    y = (torch.rand(80, generator=gen, dtype=F64) < 0.5).to(F64)
    lam = torch.full((5,), 0.1, dtype=F64)

    def inner(w, lam):
        z = X @ w
        return torch.nn.functional.binary_cross_entropy_with_logits(z, y) + 0.5 * (lam * w**2).sum()

    def outer(w, lam):
        return (w**2).sum()

    def newton(w, its):
        for _ in range(its):
            g = torch.func.grad(inner)(w, lam)
            w = w - torch.linalg.solve(torch.func.hessian(inner)(w, lam), g)
        return w

    w = torch.zeros(5, dtype=F64)
    for _ in range(3):  # three gradient steps: far from the minimiser
        w = w - 0.5 * torch.func.grad(inner)(w, lam)
    with pytest.warns(hg.NonStationaryWarning):
        _, loose = hg.implicit_grad(inner, outer, w, lam, solver=hg.CG(tol=1e-12))
    w_tight = newton(w, 20)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, tight = hg.implicit_grad(inner, outer, w_tight, lam, solver=hg.CG(tol=1e-12))
    assert loose.stationarity > 10 * STATIONARITY_THRESHOLD
    assert tight.stationarity < 1e-8


def test_a_reduce_carries_the_measure_without_extra_calls():
    """Under ``distributed="exact"`` the gradient and ``H psi`` travel in the right-hand side's
    and the direct term's all-reduce: the same number, and no extra collective."""
    inner, outer, lam, _, _, _, _, inner_cg = _ridge()
    w = inner_cg(5)
    calls = []

    def reduce(tree):
        calls.append(len(tree))
        return tree

    psi, theta = (w.clone().requires_grad_(True),), (lam.clone().requires_grad_(True),)
    _, info = hypergradient_core(
        lambda p, h: inner(p[0], h[0]), lambda p, h: outer(p[0], h[0]), psi, theta,
        hg.CG(tol=1e-12), reduce=reduce,
    )  # fmt: skip
    with pytest.warns(hg.NonStationaryWarning):
        _, plain = hg.implicit_grad(inner, outer, w, lam, solver=hg.CG(tol=1e-12))
    assert info.stationarity == pytest.approx(plain.stationarity, rel=1e-12)
    assert len(calls) == 1 + info.solve.matvecs + 2
    assert calls[0] == 2 and calls[-2] == 2  # (rhs, gradient) and (direct, H psi)


# -- @hg.implicit ----------------------------------------------------------------------------


def test_implicit_decorator_warns_off_the_minimiser_and_not_at_it():
    inner, outer, lam, solution, exact, _, _, inner_cg = _ridge()

    @hg.implicit(inner, solver=hg.CG(tol=1e-12))
    def loose(lam):
        return inner_cg(5)

    @hg.implicit(inner, solver=hg.CG(tol=1e-12))
    def tight(lam):
        return solution(lam)

    h = lam.clone().requires_grad_(True)
    with pytest.warns(hg.NonStationaryWarning, match="loose"):
        outer(loose(h), h).backward()
    assert loose.last_info.stationarity > 10 * STATIONARITY_THRESHOLD
    assert 0.3 < _rel(h.grad, exact) < 0.6
    h = lam.clone().requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        outer(tight(h), h).backward()
    assert tight.last_info.stationarity < 1e-8
    assert _rel(h.grad, exact) < 1e-8


def test_implicit_decorator_under_torch_func_and_opt_out():
    inner, outer, lam, solution, _, _, _, inner_cg = _ridge()

    @hg.implicit(inner, solver=hg.Exact())
    def tight(lam):
        return solution(lam)

    @hg.implicit(inner, solver=hg.Exact(), stationarity=False)
    def unmeasured(lam):
        return inner_cg(5)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.func.grad(lambda h: outer(tight(h), h))(lam)
        torch.func.grad(lambda h: outer(unmeasured(h), h))(lam)
    assert tight.last_info.stationarity < 1e-8
    assert math.isnan(unmeasured.last_info.stationarity)
    assert unmeasured.last_info.extras["condition_products"] == 0
    with pytest.raises(hg.HypergradTypeError, match="stationarity"):
        hg.implicit(inner, stationarity=None)


# -- HyperStep: reports, does not warn -------------------------------------------------------


def _hyperstep():
    torch.manual_seed(0)
    model = nn.Linear(4, 1).double()
    decay = torch.tensor(-2.0, dtype=F64, requires_grad=True)
    x, y = torch.randn(32, 4, dtype=F64), torch.randn(32, 1, dtype=F64)

    def inner(m, b):
        return ((m(b[0]) - b[1]) ** 2).mean() + decay.exp() * (m.weight**2).sum()

    def outer(m, b):
        return ((m(b[0]) - 1.0) ** 2).mean()

    return model, decay, inner, outer, (x, y)


def test_hyperstep_reports_stationarity_and_does_not_warn_away_from_the_optimum():
    model, decay, inner, outer, batch = _hyperstep()
    step = hg.HyperStep(model, [decay], inner, outer, solver=hg.CG(tol=1e-10))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # by design: one inner step per hyper step
        info = step(batch)
    assert info.stationarity > 10 * STATIONARITY_THRESHOLD
    assert info.extras["condition_products"] == 1
    # the documented opt-in
    with pytest.warns(hg.NonStationaryWarning):
        hg.conditions.warn_if_nonstationary(info.stationarity, "inner_loss")


def test_hyperstep_near_the_optimum_and_opt_out():
    model, decay, inner, outer, batch = _hyperstep()
    opt = torch.optim.LBFGS(model.parameters(), max_iter=200, tolerance_grad=1e-14,
                            tolerance_change=0, line_search_fn="strong_wolfe")  # fmt: skip

    def closure():
        opt.zero_grad()
        loss = inner(model, batch)
        loss.backward()
        return loss

    opt.step(closure)
    step = hg.HyperStep(model, [decay], inner, outer, solver=hg.CG(tol=1e-10))
    assert step.measure_stationarity is True
    assert step(batch).stationarity < 1e-6
    step.measure_stationarity = False
    info = step(batch)
    assert math.isnan(info.stationarity) and info.extras["condition_products"] == 0


# -- roots: the shared record and a custom solver's unwarned failure --------------------------


def test_hypergrad_info_stationarity_defaults_to_nan():
    assert math.isnan(hg.HypergradInfo(solve=SolveInfo(solver="cg")).stationarity)


class _SilentlyDiverging:
    """A duck-typed solver whose report says it diverged, without warning."""

    name = "silent"

    def solve(self, matvec, b, x0=None):
        return tuple(torch.zeros_like(t) for t in b), SolveInfo(solver="silent", diverged=True)


def test_root_vjp_warns_for_a_custom_solvers_unwarned_failure():
    A = torch.tensor([[2.0, 1.0], [0.0, 4.0]], dtype=F64)
    th = torch.tensor([1.0, 2.0], dtype=F64)
    x = torch.linalg.solve(A, th)
    with pytest.warns(hg.SolverDivergedWarning, match="_SilentlyDiverging"):
        _, info = hg.root_vjp(lambda x, th: A @ x - th, x, th, torch.ones(2, dtype=F64),
                              solver=_SilentlyDiverging())  # fmt: skip
    assert info.solve.extras["warned"] == "SolverDivergedWarning"
