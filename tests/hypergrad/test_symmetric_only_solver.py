"""A new symmetric-only solver is protected without an edit outside its own declaration (issue
31): the symmetry probe of ``custom_root`` reads the solver's ``symmetric_only`` class attribute,
not a list of names, so a solver written here is refused on a non-symmetric condition instead of
converging to a wrong answer."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import hypergrad as hg
from hypergrad.solvers.base import Solver

DT = torch.float64


@dataclass(frozen=True, kw_only=True)
class SteepestDescent(Solver):
    """Steepest descent on ``x ↦ ½ xᵀAx − bᵀx``: right only for a symmetric positive definite A."""

    symmetric_only = True
    maxiter: int = 500

    def solve(self, matvec, b, x0=None):
        x = tuple(torch.zeros_like(t) for t in b) if x0 is None else x0
        for _ in range(self.maxiter):
            r = tuple(bi - ai for bi, ai in zip(b, matvec(x)))
            rr = sum(float((t * t).sum()) for t in r)
            if rr == 0.0:
                break
            ar = matvec(r)
            step = rr / sum(float((t * a).sum()) for t, a in zip(r, ar))
            x = tuple(xi + step * ri for xi, ri in zip(x, r))
        res = tuple(bi - ai for bi, ai in zip(b, matvec(x)))
        rel = (
            sum(float((t * t).sum()) for t in res) ** 0.5
            / sum(float((t * t).sum()) for t in b) ** 0.5
        )
        return x, hg.SolveInfo(
            solver="steepest", iterations=self.maxiter, residual=rel, converged=rel < 1e-8
        )


def _solve_root(A: torch.Tensor, solver: Solver):
    b = torch.tensor([1.0, -1.0], dtype=DT)
    F = lambda x, th: A @ x - th * b  # noqa: E731

    @hg.custom_root(F, solver=solver)
    def solve(th):
        return torch.linalg.solve(A, th * b)

    th = torch.tensor(1.5, dtype=DT, requires_grad=True)
    solve(th).sum().backward()
    return th.grad


def test_a_new_symmetric_only_solver_is_refused_on_a_non_symmetric_condition() -> None:
    A = torch.tensor([[3.0, 1.0], [-1.0, 2.0]], dtype=DT)
    assert SteepestDescent().assumes_symmetric() == "SteepestDescent"
    with pytest.raises(hg.HypergradValueError, match="SteepestDescent assumes a symmetric system"):
        _solve_root(A, SteepestDescent())


def test_the_same_solver_runs_on_a_symmetric_condition() -> None:
    A = torch.tensor([[3.0, 1.0], [1.0, 2.0]], dtype=DT)
    g = _solve_root(A, SteepestDescent())
    exact = torch.linalg.solve(A, torch.tensor([1.0, -1.0], dtype=DT)).sum()  # d/dθ Σ θ A⁻¹b
    assert float(g) == pytest.approx(float(exact), abs=1e-9)


def test_library_solvers_declare_their_assumption() -> None:
    assert hg.CG().assumes_symmetric() == "CG"
    assert hg.MINRES().assumes_symmetric() == "MINRES"
    assert hg.Nystrom(rank=2).assumes_symmetric() == "Nystrom"
    assert hg.Neumann().assumes_symmetric() == "Neumann(alpha=None)"
    assert hg.Neumann(alpha=0.5).assumes_symmetric() is None
    for s in (hg.GMRES(), hg.BiCGStab(), hg.Exact()):
        assert s.assumes_symmetric() is None
