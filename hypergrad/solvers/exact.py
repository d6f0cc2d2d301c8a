"""Dense exact solve: materialise ``A`` with one product per unknown, then LU in float64."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from ..errors import HypergradValueError, HypergradWarning
from ..tree import Tensors, tree_numel, tree_ravel, tree_unravel
from .base import MatVec, SolveInfo, Solver, check_iters, check_number, dense_matrix

#: Largest system :class:`Exact` agrees to materialise (n^2 float64 entries).
MAX_EXACT_NUMEL = 20_000
#: Condition numbers above this (about 1 / (1000 * float64 eps)) are reported as singular.
ILL_CONDITIONED = 1.0 / (1000 * torch.finfo(torch.float64).eps)


def solve_exact(
    matvec: MatVec,
    b: Tensors,
    x0: Tensors | None = None,
    *,
    damping: float = 0.0,
    max_numel: int = MAX_EXACT_NUMEL,
) -> tuple[Tensors, SolveInfo]:
    """Solve ``(A + damping I) x = b`` exactly with a dense float64 LU factorisation.

    Costs ``numel(b)`` products and ``O(n^3)`` flops: for small problems and tests. The residual
    is computed from the dense matrix, so ``converged`` (residual ``<= 1e-6``) is verified.

    Args:
        matvec: ``v -> A v`` on flat pytrees.
        b: right-hand side.
        x0: ignored (the solve is direct); accepted for the common solver signature.
        damping: added to the diagonal.
        max_numel: refuse systems with more unknowns than this.

    Returns:
        ``(x, info)``.

    Raises:
        HypergradValueError: too many unknowns, an exactly singular matrix, or a product that
            returned NaN/Inf (naming the column).

    Example:
        >>> A = torch.tensor([[2.0, 1.0], [1.0, 2.0]], dtype=torch.float64)
        >>> b = (torch.tensor([3.0, 3.0], dtype=torch.float64),)
        >>> x, info = solve_exact(lambda v: (A @ v[0],), b)
        >>> x[0]
        tensor([1., 1.], dtype=torch.float64)
    """
    n = tree_numel(b)
    if n > max_numel:
        raise HypergradValueError(
            f"Exact solver: the system has {n} unknowns (> max_numel={max_numel}); "
            "use CG, MINRES or Neumann for large problems"
        )
    info = SolveInfo(solver="exact", iterations=1, matvecs=n)
    mat = dense_matrix(matvec, b, solver="Exact")
    if damping:
        mat = mat + damping * torch.eye(n, dtype=mat.dtype, device=mat.device)
    rhs = tree_ravel(b, torch.float64)
    try:
        sol = torch.linalg.solve(mat, rhs)
    except RuntimeError as exc:  # singular
        raise HypergradValueError(
            "Exact solver: the Hessian is singular; add damping (Exact(damping=...)) or check that "
            "every parameter influences the inner loss"
        ) from exc
    b_norm = float(rhs.norm())
    info.residual = float((mat @ sol - rhs).norm()) / b_norm if b_norm > 0 else 0.0
    info.residuals.append(info.residual)
    info.converged = bool(torch.isfinite(sol).all()) and info.residual <= 1e-6
    info.diverged = not bool(torch.isfinite(sol).all())
    cond = float(torch.linalg.cond(mat)) if n <= 2000 else None
    info.extras["condition_number"] = cond
    if cond is not None and not cond < ILL_CONDITIONED:
        warnings.warn(
            "Exact solver: the Hessian is numerically singular (its condition number is in "
            "SolveInfo.extras['condition_number']); "
            "the solution is dominated by rounding. Add damping (Exact(damping=...)).",
            HypergradWarning,
            stacklevel=3,
        )
    return tree_unravel(sol, b), info


@dataclass(kw_only=True)
class Exact(Solver):
    """Dense exact solve (float64 LU over the full matrix, all leaves coupled).

    Args:
        damping: added to the diagonal.
        max_numel: refuse systems larger than this.

    Example:
        >>> A = torch.diag(torch.tensor([2.0, 4.0], dtype=torch.float64))
        >>> Exact().solve(lambda v: (A @ v[0],), (torch.ones(2, dtype=torch.float64),))[0][0]
        tensor([0.5000, 0.2500], dtype=torch.float64)
    """

    damping: float = 0.0
    max_numel: int = MAX_EXACT_NUMEL
    name = "exact"

    def __post_init__(self) -> None:
        self.damping = check_number("Exact damping", self.damping)
        self.max_numel = check_iters("Exact max_numel", self.max_numel, minimum=1, allow_none=False)

    def solve(
        self, matvec: MatVec, b: Tensors, x0: Tensors | None = None
    ) -> tuple[Tensors, SolveInfo]:
        return solve_exact(matvec, b, x0, damping=self.damping, max_numel=self.max_numel)
