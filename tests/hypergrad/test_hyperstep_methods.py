"""HyperStep's method as an object (hg.Implicit / hg.Unrolled: the one place of its settings),
and hg.WarmStart, the one warm-start rule (HyperStep's and implicit_grad users')."""

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


def _data(seed=0, n=40, d=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=F64), torch.randn(n, 1, generator=g, dtype=F64)


def _problem(seed=0, n=40, d=5):
    X, y = _data(seed, n, d)
    model = nn.Linear(d, 1, bias=False).to(F64)
    decay = torch.tensor(-1.0, dtype=F64, requires_grad=True)

    def inner(m, batch):
        return 0.5 * ((m(X) - y) ** 2).mean() + 0.5 * decay.exp() * (m.weight**2).sum()

    def outer(m, batch):
        return ((m(X) - 1.0) ** 2).mean()

    return model, decay, inner, outer


# ---- the method objects -----------------------------------------------------------------------


def test_the_step_gives_the_method_objects_results():
    """HyperStep with hg.Implicit / hg.Unrolled computes what implicit_grad / unrolled_grad do
    on the same problem (float64, closed-form inner solution for the implicit one)."""
    model, decay, inner, outer = _problem()
    X, y = _data()
    step = hg.HyperStep(
        model, [decay], inner, outer,
        method=hg.Implicit(solver=hg.CG(tol=1e-12), engine="recompute"),
    )  # fmt: skip
    info = step(None)
    assert isinstance(info, hg.HypergradInfo) and info.solve.solver == "cg"
    w = model.weight.detach()[0].clone()

    def f_in(w, d):
        return 0.5 * ((X @ w - y[:, 0]) ** 2).mean() + 0.5 * d.exp() * (w**2).sum()

    def f_out(w, d):
        return ((X @ w - 1.0) ** 2).mean()

    ref, _ = hg.implicit_grad(  # at HyperStep's point, away from the inner optimum
        f_in, f_out, w, decay.detach(), solver=hg.CG(tol=1e-12), stationarity=False
    )
    torch.testing.assert_close(decay.grad, ref)

    look = hg.HyperStep(
        model, [decay], inner, outer,
        method=hg.Unrolled(hg.optim.sgd(lr=0.1), steps=2, truncate=1),
    )  # fmt: skip
    info = look(None)
    assert isinstance(info, hg.UnrolledInfo) and (info.steps, info.truncate) == (2, 1)
    ref, _ = hg.unrolled_grad(
        f_in, f_out, w, decay.detach(), steps=2, optimizer=hg.optim.sgd(lr=0.1), truncate=1
    )
    torch.testing.assert_close(decay.grad, ref)


def test_solver_alone_is_the_shorthand_for_implicit():
    """DESIGN.md's contract call: solver= (and no method) is method=hg.Implicit(solver=...)."""
    model, decay, inner, outer = _problem()
    solver = hg.Neumann(maxiter=3, alpha=5e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step = hg.HyperStep(
            inner=model, hyper=[decay], inner_loss=inner, outer_loss=outer,
            solver=solver, buffers="freeze",
        )  # fmt: skip
    assert step.method == hg.Implicit(solver=solver) and step.method.solver is solver
    assert hg.HyperStep(model, [decay], inner, outer).method == hg.Implicit(solver=hg.CG())


def test_signature_has_one_keyword_per_setting():
    """The method's settings live in the method object: HyperStep has no keyword for them."""
    params = inspect.signature(hg.HyperStep).parameters
    assert "method" in params and "solver" in params
    assert not any(p.kind is p.VAR_KEYWORD for p in params.values())
    model, decay, inner, outer = _problem()
    for old in ("engine", "warm_start", "steps", "optimizer", "truncate"):
        assert old not in params
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{old}'"):
            hg.HyperStep(model, [decay], inner, outer, **{old: 1})
    for proxy in ("solver", "engine", "warm_start", "steps", "truncate", "optimizer"):
        assert not hasattr(hg.HyperStep, proxy), proxy  # read them from step.method


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: hg.Implicit(engine="fast"), "engine must be one of"),
        (lambda: hg.Implicit(solver=3), "solver must be a hypergrad solver"),
        (lambda: hg.Implicit(warm_start="next"), "warm_start must be one of"),
        (lambda: hg.Implicit(warm_start=True), "pass the kind, warm_start='previous'"),
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
        ({"method": hg.Unrolled(hg.optim.sgd(lr=0.1)), "distributed": "exact"}, "'local'"),
        ({"method": "implicit"}, r"not a name \(pass method=hg.Implicit\(solver=\.\.\.\)\)"),
        ({"method": "unrolled"}, r"not a name \(pass method=hg.Unrolled\(optimizer"),
        ({"method": "implicit", "solver": hg.CG()}, r"not a name \(pass method=hg.Implicit"),
        ({"method": "lookahead"}, "method must be hg.Implicit"),
        ({"method": hg.CG()}, "method must be hg.Implicit"),
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


def test_method_equality_is_by_value_and_hash_agrees():
    sgd = hg.optim.sgd(lr=0.1)
    equal = [
        (hg.Implicit(solver=hg.CG(tol=1e-8)), hg.Implicit(solver=hg.CG(tol=1e-8))),
        (hg.Implicit(), hg.Implicit(solver=hg.CG())),
        (hg.Implicit(warm_start="previous"), hg.Implicit(warm_start="previous")),
        (hg.Unrolled(sgd, steps=2), hg.Unrolled(sgd, steps=2, truncate=2)),
    ]
    for a, b in equal:
        assert a == b and hash(a) == hash(b), (a, b)
    assert len({a for a, _ in equal} | {b for _, b in equal}) == len(equal)
    different = [
        (hg.Implicit(solver=hg.CG(tol=1e-8)), hg.Implicit(solver=hg.CG(tol=1e-9))),
        (hg.Implicit(solver=hg.CG()), hg.Implicit(solver=hg.MINRES())),
        (hg.Implicit(), hg.Implicit(engine="recompute")),
        (hg.Unrolled(sgd, steps=2), hg.Unrolled(sgd, steps=2, truncate=1)),
        (hg.Unrolled(sgd), hg.Unrolled(hg.optim.sgd(lr=0.1))),  # two optimizers: identity
        (hg.Implicit(), hg.Unrolled(sgd)),
    ]
    for a, b in different:
        assert a != b, (a, b)
    for m in (hg.Implicit(), hg.Unrolled(sgd)):  # no equality with the old names
        assert m != "implicit" and m != "unrolled"


def test_assigning_a_method_checks_it_and_keeps_the_warm_start_when_it_can():
    model, decay, inner, outer = _problem()
    step = hg.HyperStep(
        model, [decay], inner, outer,
        method=hg.Implicit(solver=hg.CG(tol=1e-12), warm_start="previous"),
    )  # fmt: skip
    step(None)
    warm, kept = step.warm, step.adjoint
    assert warm is not None and kept is not None
    # another solver, the same kind of warm start: the adjoint (same system) is kept
    step.method = dataclasses.replace(step.method, solver=hg.MINRES(tol=1e-12))
    assert step.warm is warm and step.adjoint is kept
    assert isinstance(step.method, hg.Implicit) and isinstance(step.method.solver, hg.MINRES)
    info = step(None)
    assert info.solve.solver == "minres"
    # another kind: a fresh WarmStart; none: no WarmStart
    step.method = hg.Implicit(warm_start="extrapolate")
    assert step.warm is not warm and step.warm.kind == "extrapolate" and step.adjoint is None
    step.method = hg.Unrolled(hg.optim.sgd(lr=0.1))
    assert step.warm is None
    with pytest.raises(hg.HypergradTypeError, match=r"not a name \(pass method=hg.Implicit"):
        step.method = "implicit"  # type: ignore[assignment]
    ddp = hg.HyperStep(model, [decay], inner, outer, distributed="exact")
    with pytest.raises(hg.HypergradValueError, match="'local'"):
        ddp.method = hg.Unrolled(hg.optim.sgd(lr=0.1))
    assert isinstance(ddp.method, hg.Implicit)  # unchanged by the refused assignment


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
    assert step.warm is not None and step.warm.kept == 2 and step.warm.kind == "extrapolate"
    step.reset_adjoint()
    assert step.adjoint is None and step.warm.kept == 0
