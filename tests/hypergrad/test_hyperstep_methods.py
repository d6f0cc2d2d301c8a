"""HyperStep's method as an object (hg.Implicit / hg.Unrolled), the deprecated keywords, and
hg.WarmStart, the one warm-start rule (HyperStep's and implicit_grad users')."""

from __future__ import annotations

import dataclasses
import inspect
import warnings

import pytest
import torch
from helpers import F64
from torch import nn

import hypergrad as hg
from hypergrad.solvers import SolveInfo


def _problem(seed=0, n=40, d=5):
    g = torch.Generator().manual_seed(seed)
    X, y = torch.randn(n, d, generator=g, dtype=F64), torch.randn(n, 1, generator=g, dtype=F64)
    model = nn.Linear(d, 1, bias=False).to(F64)
    decay = torch.tensor(-1.0, dtype=F64, requires_grad=True)

    def inner(m, batch):
        return 0.5 * ((m(X) - y) ** 2).mean() + 0.5 * decay.exp() * (m.weight**2).sum()

    def outer(m, batch):
        return ((m(X) - 1.0) ** 2).mean()

    return model, decay, inner, outer


def _no_deprecation(make):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        return make()


# ---- the method objects -----------------------------------------------------------------------


def test_method_objects_give_the_old_keywords_results():
    model, decay, inner, outer = _problem()
    new = _no_deprecation(
        lambda: hg.HyperStep(
            model, [decay], inner, outer,
            method=hg.Implicit(solver=hg.CG(tol=1e-12), engine="recompute"),
        )
    )  # fmt: skip
    new(None)
    g_new = decay.grad.clone()
    with pytest.warns(DeprecationWarning, match=r"engine=\) is deprecated.*hg.Implicit"):
        old = hg.HyperStep(
            model, [decay], inner, outer, solver=hg.CG(tol=1e-12), engine="recompute"
        )
    old(None)
    torch.testing.assert_close(decay.grad, g_new)
    assert new.method == old.method == "implicit" and new.engine == "recompute"

    look = _no_deprecation(
        lambda: hg.HyperStep(
            model, [decay], inner, outer,
            method=hg.Unrolled(hg.optim.sgd(lr=0.1), steps=2, truncate=1),
        )
    )  # fmt: skip
    info = look(None)
    g_unrolled = decay.grad.clone()
    assert isinstance(info, hg.UnrolledInfo) and (info.steps, info.truncate) == (2, 1)
    with pytest.warns(DeprecationWarning, match=r"method='unrolled', steps=, optimizer=, trunc"):
        old = hg.HyperStep(
            model, [decay], inner, outer, method="unrolled", steps=2,
            optimizer=hg.optim.sgd(lr=0.1), truncate=1,
        )  # fmt: skip
    old(None)
    torch.testing.assert_close(decay.grad, g_unrolled)
    assert look.method == "unrolled" and look.steps == 2 and look.solver is None


def test_solver_alone_is_a_shorthand_without_warning():
    """DESIGN.md's contract call: solver= (and no method) stays supported, no warning."""
    model, decay, inner, outer = _problem()
    step = _no_deprecation(
        lambda: hg.HyperStep(
            inner=model, hyper=[decay], inner_loss=inner, outer_loss=outer,
            solver=hg.Neumann(maxiter=3, alpha=5e-2), buffers="freeze",
        )
    )  # fmt: skip
    assert isinstance(step.method, hg.Implicit) and isinstance(step.solver, hg.Neumann)
    default = _no_deprecation(lambda: hg.HyperStep(model, [decay], inner, outer))
    assert isinstance(default.solver, hg.CG)


def test_signature_shows_the_new_keywords_only():
    params = inspect.signature(hg.HyperStep).parameters
    assert "method" in params and "solver" in params
    for old in ("engine", "warm_start", "steps", "optimizer", "truncate"):
        assert old not in params
    model, decay, inner, outer = _problem()
    with pytest.raises(TypeError, match="unexpected keyword argument 'stepz'"):
        hg.HyperStep(model, [decay], inner, outer, stepz=3)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: hg.Implicit(engine="fast"), "engine must be one of"),
        (lambda: hg.Implicit(solver=3), "solver must be a hypergrad solver"),
        (lambda: hg.Implicit(warm_start="next"), "warm_start must be one of"),
        (lambda: hg.Implicit(warm_start=hg.WarmStart()), "takes the kind"),
        (lambda: hg.Unrolled(), "needs optimizer"),
        (lambda: hg.Unrolled(0.1), "functional optimizer"),
        (lambda: hg.Unrolled(hg.optim.sgd(lr=0.1), steps=0), "steps must be a positive int"),
        (lambda: hg.Unrolled(hg.optim.sgd(lr=0.1), steps=2, truncate=3), "truncate must be"),
        (lambda: hg.WarmStart("next"), "WarmStart kind must be one of"),
    ],
)
def test_each_object_validates_its_own_settings(make, match):
    with pytest.raises(hg.HypergradError, match=match):
        make()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"method": hg.Implicit(), "solver": hg.CG()}, "pass it once"),
        ({"method": hg.Unrolled(hg.optim.sgd(lr=0.1)), "solver": hg.CG()}, "no solver"),
        ({"method": hg.Implicit(), "engine": "recompute"}, "in the method object only"),
        ({"method": hg.Unrolled(hg.optim.sgd(lr=0.1)), "distributed": "exact"}, "'local'"),
        ({"method": "lookahead"}, "method must be one of"),
        ({"method": hg.CG()}, "method must be one of"),
    ],
)
def test_combinations_are_refused(kwargs, match):
    model, decay, inner, outer = _problem()
    with pytest.raises(hg.HypergradError, match=match):
        hg.HyperStep(model, [decay], inner, outer, **kwargs)


def test_method_objects_are_frozen_and_replaceable():
    m = hg.Implicit(solver=hg.CG(maxiter=5))
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.engine = "recompute"  # type: ignore[misc]
    r = dataclasses.replace(m, engine="recompute")
    assert r.engine == "recompute" and r.solver is m.solver and r != m
    assert hg.Unrolled(hg.optim.sgd(lr=0.1), steps=3).truncate == 3
    # a step's solver can still be swapped (a copy of the method with it)
    model, decay, inner, outer = _problem()
    step = hg.HyperStep(model, [decay], inner, outer, method=m)
    step.solver = hg.MINRES()
    assert isinstance(step.method.solver, hg.MINRES) and m.solver is not step.solver


# ---- hg.WarmStart -----------------------------------------------------------------------------


def _info(adjoint, failure_report=None):
    solve = failure_report or SolveInfo("fake", iterations=3, residual=1e-12, converged=True)
    return hg.HypergradInfo(solve=solve, extras={"adjoint": adjoint})


def test_warm_start_previous_and_extrapolated_over_pytrees():
    a0 = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor(0.5)}
    a1 = {"w": torch.tensor([1.5, 2.5]), "b": torch.tensor(1.0)}
    prev, extra = hg.WarmStart("previous"), hg.WarmStart("extrapolate")
    for s in (prev, extra):
        assert s.x0() is None and s.kept == 0  # nothing kept yet: from zero
        assert s.update(_info(a0))
    assert prev.x0() is a0 and extra.x0() is a0  # one kept: the previous adjoint
    for s in (prev, extra):
        s.update(_info(a1))
    assert prev.x0() is a1
    x0 = extra.x0()  # 2 a1 - a0
    torch.testing.assert_close(x0["w"], torch.tensor([2.0, 3.0]))
    torch.testing.assert_close(x0["b"], torch.tensor(1.5))
    assert not extra.update(None) and extra.x0() is None and extra.kept == 0  # forget both


@pytest.mark.parametrize(
    "report, adjoint",
    [
        (SolveInfo("fake", iterations=3, residual=0.5, diverged=True), torch.ones(2)),
        (SolveInfo("fake", iterations=3, residual=2.0), torch.ones(2)),  # residual above 1
        (None, torch.tensor([1.0, float("nan")])),
    ],
    ids=["diverged", "residual above 1", "NaN adjoint"],
)
def test_warm_start_keeps_no_adjoint_of_a_failed_solve(report, adjoint):
    starts = hg.WarmStart("extrapolate")
    starts.update(_info(torch.zeros(2)))
    starts.update(_info(torch.ones(2)))
    assert starts.kept == 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kept = starts.update(_info(adjoint, report))
    assert not kept and starts.x0() is None and starts.kept == 0


def test_warm_start_update_refuses_the_adjoint_or_the_solve_info():
    starts = hg.WarmStart()
    with pytest.raises(hg.HypergradTypeError, match="info.adjoint"):
        starts.update(torch.ones(2))  # type: ignore[arg-type]
    info = _info(torch.ones(2))
    with pytest.raises(hg.HypergradTypeError, match="HypergradInfo"):
        starts.update(info.solve)  # type: ignore[arg-type]


def test_warm_start_with_implicit_grad_matches_hyperstep():
    """The implicit_grad loop with hg.WarmStart starts each solve where HyperStep's does: the
    same iteration counts along a smooth path, and the same answers."""
    g = torch.Generator().manual_seed(1)
    X, y = torch.randn(60, 8, generator=g, dtype=F64), torch.randn(60, generator=g, dtype=F64)

    def inner(w, lam):
        return 0.5 * ((X @ w - y) ** 2).mean() + 0.5 * (lam.exp() * w**2).sum()

    def outer(w, lam):
        return ((X @ w - 1.0) ** 2).mean()

    model = nn.Linear(8, 1, bias=False).to(F64)
    lam = torch.full((8,), -1.0, dtype=F64, requires_grad=True)
    step = hg.HyperStep(
        model, [lam], lambda m, b: inner(m.weight[0], lam), lambda m, b: outer(m.weight[0], lam),
        method=hg.Implicit(solver=hg.CG(tol=1e-10), warm_start="extrapolate"),
    )  # fmt: skip
    starts = hg.WarmStart("extrapolate")
    for _ in range(4):
        with torch.no_grad():
            lam.add_(0.1)
            a = X.T @ X / 60 + torch.diag(lam.exp())
            model.weight.copy_(torch.linalg.solve(a, X.T @ y / 60)[None])
        info_step = step(None)
        w = model.weight.detach()[0].clone()
        gr, info = hg.implicit_grad(
            inner, outer, w, lam.detach(), solver=hg.CG(tol=1e-10), x0=starts.x0()
        )
        assert starts.update(info)
        assert info.solve.iterations == info_step.solve.iterations
        torch.testing.assert_close(gr, lam.grad)
        torch.testing.assert_close(starts.last, step.adjoint[0][0])
    assert step.warm is not None and step.warm.kept == 2 and step.warm_start == "extrapolate"
    step.reset_adjoint()
    assert step.adjoint is None and step.warm.kept == 0
