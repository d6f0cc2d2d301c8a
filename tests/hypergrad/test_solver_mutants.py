"""Inputs on which a weakened check would turn a warned failure into a silent one.

Each test pins the real behaviour on a concrete input where a hand-made mutant of the check
returns its answer without a warning (issue 30, item 2; the mutants survived every other test):

* GMRES without its stall check (``gmres.py``: ``rel > prev_rel * (1 - STALL_RTOL)``): on a
  cyclic shift with ``restart`` shorter than ``n`` every cycle leaves the residual exactly ``b``;
  the mutant runs to ``maxiter`` and returns ``x = 0`` with ``failure`` None and no warning.
* BiCGStab without its growth check (``bicgstab.py``: ``rel > GROWTH_LIMIT * best_rel``): on
  ``1e-9 I + S`` (``S`` skew-symmetric), ``<r, A r> = 1e-9 ||r||^2`` makes the first step ~1e9
  times ``b``; the mutant goes on and returns a truncated iterate (residual 0.2) with ``failure``
  None and no warning.
* The warm-start shortcut of :func:`~hypergrad.solvers.krylov.verified_krylov` (CG, MINRES)
  loosened to ``10 * tol``: a warm start whose residual is ``5 * tol`` is returned as converged.
  The contract tests' ``check_report`` accepts a true residual up to ``10 * tol``, which is why
  the mutant survived them; here ``converged`` must mean the residual is within ``tol``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import ALL_SOLVERS, DIRECT, F64, solver_tol

import hypergrad as hg


def _record(solve):
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        x, info = solve()
    return x, info, [w.category for w in rec]


def _true_rel(a, x, b):
    return float(torch.linalg.norm(a @ x - b) / torch.linalg.norm(b))


def test_gmres_stall_on_a_cyclic_shift_with_a_short_restart_is_reported():
    """``P e_i = e_{i+1}`` (n = 6), ``b = e_1``, ``restart=3``: a cycle's Krylov space is
    ``span(e_1, e_2, e_3)``, mapped onto ``span(e_2, e_3, e_4)``, orthogonal to ``e_1``, so the
    best ``x`` of every cycle is 0 and the residual stays exactly 1 (``restart = n`` would solve
    it). GMRES stops after one cycle and reports the stall."""
    n = 6
    shift = torch.roll(torch.eye(n, dtype=F64), 1, 0)
    b = torch.zeros(n, dtype=F64)
    b[0] = 1.0
    x, info, cats = _record(
        lambda: hg.GMRES(restart=3, maxiter=60, tol=1e-10).solve(lambda v: shift @ v, b)
    )
    assert torch.equal(x, torch.zeros(n, dtype=F64))
    assert info.failure == "stalled" and info.extras["stalled"] and not info.converged
    assert cats == [hg.SolverStalledWarning]
    assert info.extras["warned"] == "SolverStalledWarning"
    assert info.iterations == 3 and info.matvecs == 4  # one cycle and its residual check
    assert info.residual == _true_rel(shift, x, b) == 1.0
    assert torch.allclose(shift @ torch.linalg.solve(shift, b), b)  # solvable: not singular


def test_bicgstab_growth_of_a_near_breakdown_is_reported_as_diverged():
    """``A = 1e-9 I + S`` with ``S`` the 4 x 4 skew-symmetric tridiagonal matrix (eigenvalues
    about +-0.62i, +-1.62i: well conditioned), ``b`` = ones. With the shadow vector ``r_hat = b``,
    ``<r_hat, A b> = 1e-9 ||b||^2``, so ``alpha = 1e9`` and the first iterate's residual is about
    ``7e8 ||b||``: more than ``1e8`` times the best (the start). BiCGStab stops there, returns
    the best iterate (the start, ``x = 0``) and reports the divergence."""
    n = 4
    s = torch.diag(torch.ones(n - 1, dtype=F64), 1)
    a = 1e-9 * torch.eye(n, dtype=F64) + s - s.T
    b = torch.ones(n, dtype=F64)
    x, info, cats = _record(lambda: hg.BiCGStab(tol=1e-10, maxiter=10).solve(lambda v: a @ v, b))
    assert info.failure == "diverged" and info.diverged and not info.converged
    assert cats == [hg.SolverDivergedWarning]
    assert info.extras["warned"] == "SolverDivergedWarning"
    assert info.iterations == 1 and info.residuals[0] > 1e8
    assert info.extras["best_iteration"] == 0 and torch.equal(x, torch.zeros(n, dtype=F64))
    assert info.residual == _true_rel(a, x, b) == 1.0
    # GMRES solves the same system: BiCGStab's blow-up, not the system, is what is reported
    y, ginfo = hg.GMRES(tol=1e-10).solve(lambda v: a @ v, b)
    assert ginfo.converged and _true_rel(a, y, b) <= 1e-10


ITERATIVE = [p for p in ALL_SOLVERS if DIRECT not in p.values[1]]


@pytest.mark.parametrize("make, tags", ITERATIVE)
def test_a_warm_start_within_five_times_tol_is_iterated_to_tol(make, tags):
    """A warm start whose residual is ``5 * tol`` does not meet ``tol``: the solver iterates,
    and ``converged`` comes with a residual (recomputed, and against a dense float64 solve)
    within ``tol``."""
    solver = make()
    tol = solver_tol(solver)
    n = 9
    gen = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=F64))
    a = q @ torch.diag(torch.linspace(0.2, 1.0, n, dtype=F64)) @ q.T
    a = 0.5 * (a + a.T)
    b = torch.randn(n, generator=gen, dtype=F64)
    a_d = a + solver.damping * torch.eye(n, dtype=F64)
    ref = torch.linalg.solve(a_d, b)
    u = torch.randn(n, generator=gen, dtype=F64)
    # x0 = ref + A^-1 (5 tol ||b|| u / ||u||): its residual is exactly 5 tol (up to rounding)
    x0 = ref + torch.linalg.solve(a_d, 5 * tol * b.norm() * u / u.norm())
    assert _true_rel(a_d, x0, b) == pytest.approx(5 * tol, rel=1e-3)
    x, info, cats = _record(lambda: solver.solve(lambda v: a @ v, b, x0))
    assert not info.converged or info.residual <= tol, info  # never converged at 5 tol
    assert x is not x0 and info.iterations >= 1
    assert info.converged and info.failure is None and not cats, (info, cats)
    assert info.residual <= tol
    assert _true_rel(a_d, x, b) <= tol * (1 + 1e-6)
