"""A result that is not a hypergradient is never handed over silently (issue 21, items 1 and 3).

Property tests over every solver (CG plain, Hutchinson- and dense-preconditioned, MINRES, GMRES,
BiCGStab, Neumann with and without alpha, Exact, Nystrom, and the compiled CG/Neumann/Exact) on
singular inconsistent systems, singular consistent ones, indefinite and ill-conditioned ones:

(Singular inconsistent systems over every solver: ``test_solver_contract.py``.)

* ``info.failure is not None`` exactly when a failure warning (a ``HypergradWarning`` subclass of
  ``FAILURE_WARNINGS``) was emitted, and ``extras["warned"]`` names it;
* ``converged=True`` only with a right answer (the dense float64 residual meets ``tol``; on a
  consistent singular system the minimum-norm solution, from ``numpy.linalg.lstsq``);
* a verified ``info.residual`` is the true relative residual of the returned ``x``.

And settings cannot change after construction (``FrozenSettingError``), nor be inf/NaN.

Before this file's changes, CG on the issue's problem returned ``|g| = 5e67`` with no warning
and ``failure == "residual above 1"`` (and entries near 1e190 with the dense preconditioner),
``Exact`` raised on every singular matrix (consistent ones included), Nystrom/CG returned
``failure`` without a warning, ``CG().tol = inf`` was accepted and ``compile_implicit_grad``
kept the damping of its first call.
"""

import dataclasses
import math
import warnings

import numpy as np
import pytest
import torch
from helpers import check_report, min_norm, psd

import hypergrad as hg
from hypergrad.errors import FrozenSettingError, SolveFailedWarning
from hypergrad.solvers.base import FAILURE_WARNINGS

F64 = torch.float64
N = 12

# name -> (factory, tol, damping used by the solver); a factory so that a DensePreconditioner
# starts empty in every test
SOLVERS = {
    "cg": (lambda: hg.CG(tol=1e-10), 1e-10, 0.0),
    "cg_hutchinson": (lambda: hg.CG(tol=1e-10, preconditioner="hutchinson"), 1e-10, 0.0),
    "cg_dense": (lambda: hg.CG(tol=1e-10, preconditioner=hg.DensePreconditioner()), 1e-10, 0.0),
    "minres": (lambda: hg.MINRES(tol=1e-10), 1e-10, 0.0),
    "gmres": (lambda: hg.GMRES(tol=1e-10), 1e-10, 0.0),
    "bicgstab": (lambda: hg.BiCGStab(tol=1e-10), 1e-10, 0.0),
    "neumann_alpha": (lambda: hg.Neumann(maxiter=3000, alpha=0.9, tol=1e-10), 1e-10, 0.0),
    "neumann_power": (lambda: hg.Neumann(maxiter=3000, tol=1e-10), 1e-10, 0.0),
    "exact": (lambda: hg.Exact(), 1e-6, 0.0),
    "nystrom_full": (lambda: hg.Nystrom(rank=N, damping=1e-2), 1e-6, 1e-2),
    "nystrom_low": (lambda: hg.Nystrom(rank=4, damping=1e-2), 1e-6, 1e-2),
}


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _basis(seed, n=N):
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=_gen(seed), dtype=F64))
    return q


def _solve(solver, a, b):
    """``solver.solve`` on the dense ``a``, recording warnings."""
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        x, info = solver.solve(lambda v: (a @ v[0],), (b.clone(),))
    return x[0], info, [w.category for w in rec]


_check_report, _min_norm, _psd = check_report, min_norm, psd


# ------------------------------------------------------------------ the issue's own example


def _issue_problem():
    w = torch.zeros(3, dtype=F64)
    lam = torch.ones(3, dtype=F64)

    def inner(w, l):  # w[1] is absent from the inner problem: H = diag(1, 0, 2)
        return 0.5 * (w[0] ** 2 + 2 * w[2] ** 2) + 0 * w[1] + (l * w).sum()

    def outer(w, l):  # ... but present in the outer one: b = -2 has a component along e_1
        return ((w - 1) ** 2).sum()

    return inner, outer, w, lam


@pytest.mark.parametrize("name", [k for k in SOLVERS if not k.startswith("nystrom")])
def test_issue_example_is_never_silent(name):
    inner, outer, w, lam = _issue_problem()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        g, info = hg.implicit_grad(inner, outer, w, lam, solver=SOLVERS[name][0]())
    s = info.solve
    cats = [c.category for c in rec if issubclass(c.category, FAILURE_WARNINGS)]
    assert s.failure is not None and cats and not s.converged, (s, cats)
    # whatever x is returned, it is not an exploded iterate (CG gave |g| = 5e67 before); the
    # stalled Neumann series grows linearly along the null space, by design (and says so)
    if not name.startswith("neumann"):
        assert float(g.norm()) < 1e3


@pytest.mark.parametrize("name", ["cg", "cg_dense", "minres", "exact"])
def test_issue_example_returns_the_least_squares_point_or_better(name):
    # CG, preconditioned or not, stops at its best iterate; MINRES and Exact reach the
    # least-squares floor 1/sqrt(3), Exact with the minimum-norm x = (-2, 0, -1) (b = -2)
    inner, outer, w, lam = _issue_problem()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, info = hg.implicit_grad(inner, outer, w, lam, solver=SOLVERS[name][0]())
    x = info.extras["adjoint"]
    assert info.solve.residual <= 1.0
    assert info.solve.failure == "singular" and info.solve.extras["singular"]
    if name in ("minres", "exact"):
        assert info.solve.residual == pytest.approx(1 / math.sqrt(3), rel=1e-9)
    if name == "exact":
        torch.testing.assert_close(x, torch.tensor([-2.0, 0.0, -1.0], dtype=F64))


# ------------------------------------------------------------------ random dense systems


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", list(SOLVERS))
def test_singular_consistent_systems_solve_without_failure(name, seed):
    factory, tol, damping = SOLVERS[name]
    a, range_basis, _ = _psd(30 + seed, rank=8)
    b = range_basis @ torch.randn(8, generator=_gen(40 + seed), dtype=F64)
    x, info, cats = _solve(factory(), a, b)
    a_d = a + damping * torch.eye(N, dtype=F64)
    _check_report(info, x, a_d, b, tol, cats)
    if name == "nystrom_low":  # an approximation of A: no accuracy promised, only honesty
        return
    assert info.failure is None and info.converged, (info.failure, info)
    # a solution from zero stays in the range: the minimum-norm one (Hutchinson's diagonal
    # preconditioner does not map the range into itself: another solution, as valid)
    if damping == 0.0 and name != "cg_hutchinson":
        ref = _min_norm(a, b)
        assert float((x - ref).norm() / ref.norm()) < 1e-6


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", list(SOLVERS))
def test_indefinite_systems_are_right_or_reported(name, seed):
    q = _basis(50 + seed)
    s = torch.cat([torch.linspace(0.2, 1.0, N - 3), -torch.tensor([0.3, 0.5, 0.9])]).to(F64)
    a = q @ torch.diag(s) @ q.T
    a = 0.5 * (a + a.T)
    b = torch.randn(N, generator=_gen(60 + seed), dtype=F64)
    factory, tol, damping = SOLVERS[name]
    try:
        x, info, cats = _solve(factory(), a, b)
    except hg.HypergradValueError as err:  # Neumann's power iteration may refuse: honest too
        assert name == "neumann_power" and "not positive" in str(err)
        return
    _check_report(info, x, a + damping * torch.eye(N, dtype=F64), b, tol, cats)
    if name in ("minres", "exact", "nystrom_full"):
        assert info.converged
    if name in ("cg", "neumann_alpha"):
        assert info.failure is not None


@pytest.mark.parametrize("name", ["cg", "cg_hutchinson", "cg_dense", "minres", "exact"])
def test_ill_conditioned_nonsingular_is_not_called_singular(name):
    # condition number 1e8: far from numerical singularity in float64
    q = _basis(70)
    a = q @ torch.diag(torch.logspace(0, -8, N, dtype=F64)) @ q.T
    a = 0.5 * (a + a.T)
    b = torch.randn(N, generator=_gen(71), dtype=F64)
    solver = {
        "cg": hg.CG(tol=1e-8, maxiter=500),
        "cg_hutchinson": hg.CG(tol=1e-8, maxiter=500, preconditioner="hutchinson"),
        "minres": hg.MINRES(tol=1e-8, maxiter=500),
    }.get(name, SOLVERS[name][0]())
    x, info, cats = _solve(solver, a, b)
    _check_report(info, x, a, b, 1e-8, cats)
    assert not info.extras.get("singular") and info.failure is None


def test_cg_growth_test_fires_on_a_slow_inconsistent_run():
    # a small null component: the range part converges first, then the iterate blows up; CG
    # stops, returns its best iterate (near the least-squares floor) and warns
    a, range_basis, null_basis = _psd(80, rank=8, lo=1e-3)
    b = range_basis @ torch.randn(8, generator=_gen(81), dtype=F64)
    b = b / b.norm() + 1e-6 * null_basis[:, 0]
    x, info, cats = _solve(hg.CG(tol=1e-12, maxiter=2000), a, b)
    _check_report(info, x, a, b, 1e-12, cats)
    assert info.failure == "singular" and info.extras["singular_test"] in ("curvature", "growth")
    assert hg.SingularSystemWarning in cats
    assert info.residual < 1e-3 and float((x - _min_norm(a, b)).norm()) < 1e-2


def test_nystrom_residual_above_one_warns():
    # a poor low-rank approximation of an indefinite matrix: residual above 1, never silent
    q = _basis(90)
    s = torch.cat([torch.full((N - 4,), 1e-3), torch.tensor([1.0, -1.0, 2.0, -2.0])]).to(F64)
    a = q @ torch.diag(s) @ q.T
    b = torch.randn(N, generator=_gen(91), dtype=F64)
    x, info, cats = _solve(hg.Nystrom(rank=2, damping=1e-3), a, b)
    _check_report(info, x, a + 1e-3 * torch.eye(N, dtype=F64), b, 1e-6, cats)
    if info.failure == "residual above 1":
        assert SolveFailedWarning in cats


def test_cg_maxiter_with_residual_above_one_warns():
    # truncated CG whose residual rose above ||b||: a failure, so it warns
    a = torch.diag(torch.tensor([1.0, 1e-4], dtype=F64))
    b = torch.tensor([1.0, 1e-2], dtype=F64)
    x, info, cats = _solve(hg.CG(maxiter=1), a, b)
    _check_report(info, x, a, b, 1e-6, cats)
    assert not info.converged


# ------------------------------------------------------------------ compiled variants


def _quadratic(a, c):
    def inner(w, l):
        return 0.5 * w @ a @ w + (l * w).sum()

    def outer(w, l):
        return (c * w).sum()

    return inner, outer


@pytest.mark.parametrize(
    "solver",
    [hg.CG(tol=1e-10), hg.Neumann(maxiter=600, alpha=0.9, tol=1e-10), hg.Exact()],
    ids=["cg", "neumann", "exact"],
)
@pytest.mark.parametrize("kind", ["inconsistent", "consistent"])
def test_compiled_matches_eager_on_singular_systems(solver, kind):
    a, range_basis, null_basis = _psd(100, rank=8)
    c = range_basis @ torch.randn(8, generator=_gen(101), dtype=F64)
    if kind == "inconsistent":
        c = c + null_basis[:, 0]
    inner, outer = _quadratic(a, c)
    w, lam = torch.zeros(N, dtype=F64), torch.ones(N, dtype=F64)
    f = hg.compile_implicit_grad(inner, outer, solver=solver, compile=False)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        g, info = f(w, lam)
    cats = [r.category for r in rec if issubclass(r.category, FAILURE_WARNINGS)]
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        g_eager, eager = hg.implicit_grad(inner, outer, w, lam, solver=solver)
    assert (info.solve.failure is not None) == bool(cats)
    assert info.solve.failure == eager.solve.failure
    assert info.solve.converged == eager.solve.converged
    if kind == "consistent":
        assert info.solve.failure is None and info.solve.converged
        torch.testing.assert_close(g, g_eager, rtol=1e-6, atol=1e-8)
    else:
        assert info.solve.failure is not None and not info.solve.converged
        assert info.solve.residual == pytest.approx(eager.solve.residual, rel=1e-6)


# ------------------------------------------------------------------ settings


ALL = {
    "CG": (hg.CG, ("tol", "damping")),
    "MINRES": (hg.MINRES, ("tol", "damping")),
    "Neumann": (hg.Neumann, ("alpha", "tol", "damping")),
    "Exact": (hg.Exact, ("damping",)),
    "Nystrom": (hg.Nystrom, ("damping", "tol")),
    "DensePreconditioner": (hg.DensePreconditioner, ("damping",)),
}


# the solvers' float settings and frozen settings: test_solver_contract.py (every solver)
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, np.float64(np.inf)])
@pytest.mark.parametrize("cls", ["DensePreconditioner"])
def test_every_float_setting_refuses_inf_and_nan(cls, value):
    factory, names = ALL[cls]
    for name in names:
        with pytest.raises(hg.HypergradValueError, match=name):
            factory(**{name: value})


@pytest.mark.parametrize(
    "cls, kwargs",
    [
        ("CG", {"maxiter": 0}),
        ("MINRES", {"maxiter": 0}),
        ("Neumann", {"alpha": 0.0}),
        ("Neumann", {"power_iters": 0}),
        ("Nystrom", {"rank": 0}),
        ("Nystrom", {"damping": 0.0}),
        ("CG", {"probes": 0}),
        ("CG", {"seed": 1.5}),
        ("Neumann", {"exact_residual": "yes"}),
    ],
)
def test_settings_that_cannot_give_a_hypergradient_are_refused(cls, kwargs):
    with pytest.raises(hg.HypergradError):
        ALL[cls][0](**kwargs)


@pytest.mark.parametrize("cls", ["DensePreconditioner"])
def test_settings_are_frozen(cls):
    obj = ALL[cls][0]()
    name = ALL[cls][1][0]
    with pytest.raises(FrozenSettingError, match=r"replace\(") as err:
        setattr(obj, name, math.inf)
    assert isinstance(err.value, hg.HypergradError)
    assert isinstance(err.value, AttributeError)
    assert isinstance(err.value, dataclasses.FrozenInstanceError)
    with pytest.raises(FrozenSettingError):
        delattr(obj, name)
    with pytest.raises(FrozenSettingError):  # a misspelt setting is not silently added
        obj.tolerance = 1e-3
    new = obj.replace(**{name: 0.5})
    assert getattr(new, name) == 0.5 and new is not obj and type(new) is type(obj)
    with pytest.raises(hg.HypergradValueError):  # replace validates like a constructor
        obj.replace(**{name: math.nan})


def test_tol_inf_after_construction_cannot_fake_convergence():
    s = hg.CG()
    with pytest.raises(FrozenSettingError):
        s.tol = math.inf
    assert s.tol == 1e-6


def test_a_misspelt_or_old_setting_name_cannot_be_written_either():
    n = hg.Neumann(maxiter=3)
    with pytest.raises(FrozenSettingError):
        n.steps = 5  # the name before 0.1.0: no attribute is added, nothing changes
    assert n.maxiter == 3 and not hasattr(n, "steps")
    ny = hg.Nystrom()
    with pytest.raises(FrozenSettingError):
        ny.rho = 1.0


def test_dense_preconditioner_state_still_updates():
    pre = hg.DensePreconditioner()
    a = torch.diag(torch.tensor([1.0, 2.0, 3.0], dtype=F64))
    _, info = hg.CG(preconditioner=pre).solve(lambda v: (a @ v[0],), (torch.ones(3, dtype=F64),))
    assert info.converged and pre.builds == 1
    pre.reset()


def test_compiled_reads_settings_from_its_frozen_solver():
    # the damping the compiled graphs use is the solver's, which cannot change afterwards
    a = torch.diag(torch.tensor([1.0, 2.0], dtype=F64))
    inner, outer = _quadratic(a, torch.ones(2, dtype=F64))
    solver = hg.CG(tol=1e-12, damping=0.5)
    f = hg.compile_implicit_grad(inner, outer, solver=solver, compile=False)
    w, lam = torch.zeros(2, dtype=F64), torch.ones(2, dtype=F64)
    g, _ = f(w, lam)
    with pytest.raises(FrozenSettingError):
        solver.damping = 0.0
    with pytest.raises(AttributeError):
        f.solver = hg.CG(damping=0.0)
    g2, _ = f(w, lam)
    g_eager, _ = hg.implicit_grad(inner, outer, w, lam, solver=solver)
    torch.testing.assert_close(g, g2)
    torch.testing.assert_close(g, g_eager)
    torch.testing.assert_close(g, -1.0 / torch.tensor([1.5, 2.5], dtype=F64))


def test_neumann_without_tol_does_not_call_rounding_a_stall():
    # a consistent singular system run far past convergence: the terms reach rounding in the
    # null space and stop shrinking (ratio 1), which is not a stall (the bound is ~1e-16)
    a, range_basis, _ = _psd(30, rank=8)
    b = range_basis @ torch.randn(8, generator=_gen(40), dtype=F64)
    x, info, cats = _solve(hg.Neumann(maxiter=3000, alpha=0.9), a, b)
    _check_report(info, x, a, b, 1e-10, cats)
    assert info.extras["contraction"] > 0.99 and not info.extras["stalled"]
    assert info.failure is None and not cats
    ref = _min_norm(a, b)
    assert float((x - ref).norm() / ref.norm()) < 1e-10


def test_exact_numerically_singular_matrix_uses_the_pseudo_inverse():
    # rank 8 of 12 in float64 rounding (LU succeeds with pivots ~1e-17): the minimum-norm answer
    a, range_basis, null_basis = _psd(110, rank=8)
    b = range_basis @ torch.randn(8, generator=_gen(111), dtype=F64)
    x, info, cats = _solve(hg.Exact(), a, b)
    assert info.extras["method"] == "pinv" and info.extras["numerical_rank"] == 8
    assert info.converged and info.failure is None and not cats
    assert float((x - _min_norm(a, b)).norm() / x.norm()) < 1e-10
    x, info, cats = _solve(hg.Exact(), a, b + 0.1 * null_basis[:, 0])
    assert info.failure == "singular" and hg.SingularSystemWarning in cats
    assert info.extras["lstsq_residual"] == pytest.approx(info.residual)
