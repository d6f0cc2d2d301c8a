"""What every linear solver shares: the :class:`SolveInfo` record and the solver protocol.

A solver solves ``(A + damping*I) x = b`` for a symmetric operator ``A`` given only as a
``matvec`` on flat pytrees (tuples of tensors). It knows nothing about losses or modules.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import HypergradValueError, SolverDivergedWarning
from ..tree import Tensors, tree_axpy, tree_numel

MatVec = Callable[[Tensors], Tensors]


@dataclass
class SolveInfo:
    """Diagnostics of one linear solve.

    Attributes:
        solver: solver name ("cg", "minres", "neumann", "exact", "nystrom").
        iterations: iterations performed.
        matvecs: operator products spent (power iterations included).
        residual: relative residual ``||(A + damping I) x - b|| / ||b||`` (for Neumann without
            ``exact_residual`` an upper bound, see :class:`hypergrad.Neumann`).
        converged: the residual met the requested tolerance.
        diverged: the iteration blew up (growing terms, NaN/Inf, or negative curvature in CG);
            the result must not be trusted.
        alpha: step size used (Neumann only).
        residuals: residual after each iteration (for convergence plots).
        extras: solver-specific details (e.g. ``"negative_curvature"`` for CG).
    """

    solver: str
    iterations: int = 0
    matvecs: int = 0
    residual: float = float("nan")
    converged: bool = False
    diverged: bool = False
    alpha: float | None = None
    residuals: list[float] = field(default_factory=list)
    extras: dict[str, Any] = field(default_factory=dict)


class Solver:
    """Base class: a configured solver is called as ``solver.solve(matvec, b, x0)``."""

    name = "solver"
    damping: float = 0.0

    def solve(
        self, matvec: MatVec, b: Tensors, x0: Tensors | None = None
    ) -> tuple[Tensors, SolveInfo]:
        raise NotImplementedError

    def __call__(self, matvec: MatVec, b: Tensors, x0: Tensors | None = None):
        return self.solve(matvec, b, x0)


def damped(matvec: MatVec, damping: float) -> MatVec:
    """Return ``v -> matvec(v) + damping * v`` (``matvec`` itself when damping is 0)."""
    if damping == 0.0:
        return matvec
    return lambda v: tree_axpy(damping, v, matvec(v))


def check_nonneg(name: str, value: float | None, allow_none: bool = False, positive: bool = False):
    """Validate a numeric hyperparameter of a solver."""
    if value is None and allow_none:
        return
    if not isinstance(value, (int, float)) or value != value:
        raise HypergradValueError(f"{name} must be a number, got {value!r}")
    if value < 0 or (positive and value == 0):
        kind = "> 0" if positive else ">= 0"
        raise HypergradValueError(f"{name} must be {kind}, got {value!r}")


def check_iters(name: str, value: int | None):
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise HypergradValueError(f"{name} must be a non-negative int or None, got {value!r}")


def default_maxiter(b: Tensors, cap: int = 1000) -> int:
    """Default iteration budget of the Krylov solvers: 2 * numel(b), capped at ``cap``."""
    return max(1, min(2 * tree_numel(b), cap))


def warn_diverged(info: SolveInfo, hint: str) -> None:
    """Emit the standard divergence warning."""
    warnings.warn(
        f"{info.solver} solver diverged after {info.iterations} iterations "
        f"(relative residual {info.residual:.3g}); the hypergradient is not reliable. {hint}",
        SolverDivergedWarning,
        stacklevel=3,
    )


def as_float(t: torch.Tensor | float) -> float:
    return float(t.item()) if isinstance(t, torch.Tensor) else float(t)
