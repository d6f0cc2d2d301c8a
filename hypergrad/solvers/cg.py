"""Conjugate gradient for symmetric positive-definite systems ``(A + damping I) x = b``."""

from __future__ import annotations

from dataclasses import dataclass

from ..tree import Tensors, tree_axpy, tree_norm, tree_sub, tree_vdot, tree_zeros_like
from .base import (
    MatVec,
    SolveInfo,
    Solver,
    as_float,
    check_iters,
    check_nonneg,
    damped,
    default_maxiter,
    warn_diverged,
)


def solve_cg(
    matvec: MatVec,
    b: Tensors,
    x0: Tensors | None = None,
    maxiter: int | None = None,
    tol: float = 1e-6,
    damping: float = 0.0,
) -> tuple[Tensors, SolveInfo]:
    """Solve ``(A + damping I) x = b`` by conjugate gradient.

    Stops when ``||r|| <= tol * ||b||``. A non-positive curvature ``p^T A p <= 0`` means the
    operator is not positive definite: the iteration stops, ``diverged`` is set and a warning
    suggests MINRES or damping (CG would otherwise return garbage silently).

    Args:
        matvec: ``v -> A v`` on flat pytrees.
        b: right-hand side.
        x0: initial guess (zeros when None).
        maxiter: iteration cap; None gives ``min(2 * numel(b), 1000)``.
        tol: relative residual tolerance.
        damping: Tikhonov damping added to the diagonal.

    Returns:
        ``(x, info)``.

    Example:
        >>> A = torch.tensor([[4.0, 1.0], [1.0, 3.0]], dtype=torch.float64)
        >>> x, info = solve_cg(lambda v: (A @ v[0],), (torch.ones(2, dtype=torch.float64),))
        >>> bool(info.converged)
        True
    """
    op = damped(matvec, damping)
    maxiter = default_maxiter(b) if maxiter is None else maxiter
    info = SolveInfo(solver="cg")
    b_norm = as_float(tree_norm(b))
    info.extras["b_norm"] = b_norm
    if b_norm == 0.0:
        info.residual, info.converged = 0.0, True
        return tree_zeros_like(b), info
    if x0 is None:
        x = tree_zeros_like(b)
        r = b
    else:
        x = x0
        r = tree_sub(b, op(x0))
        info.matvecs += 1
    p = r
    rs = tree_vdot(r, r)
    rel = as_float(rs.sqrt()) / b_norm
    info.residual = rel
    if rel <= tol:
        info.converged = True
        return x, info
    for _ in range(maxiter):
        ap = op(p)
        info.matvecs += 1
        pap = tree_vdot(p, ap)
        pap_f = as_float(pap)
        if not pap_f > 0.0:  # also catches NaN
            info.diverged = True
            info.extras["negative_curvature"] = pap_f
            warn_diverged(info, "The operator is not positive definite: use MINRES or damping.")
            break
        alpha = rs / pap
        x = tree_axpy(alpha, p, x)
        r = tree_axpy(-alpha, ap, r)
        rs_new = tree_vdot(r, r)
        info.iterations += 1
        rel = as_float(rs_new.sqrt()) / b_norm
        info.residuals.append(rel)
        info.residual = rel
        if rel != rel:
            info.diverged = True
            warn_diverged(info, "NaN in the residual.")
            break
        if rel <= tol:
            info.converged = True
            break
        p = tree_axpy(rs_new / rs, p, r)
        rs = rs_new
    return x, info


@dataclass
class CG(Solver):
    """Conjugate gradient: the default for convex inner problems (SPD Hessian).

    Needs about sqrt(condition number) iterations. Use :class:`MINRES` when the Hessian may be
    indefinite (non-convex inner problem), or add ``damping``.

    Args:
        maxiter: iteration cap (None: ``min(2 * numel, 1000)``).
        tol: relative residual tolerance.
        damping: added to the diagonal, i.e. solves ``(H + damping I) x = b``.

    Example:
        >>> solver = CG(maxiter=50, tol=1e-8)
        >>> A = torch.eye(3, dtype=torch.float64) * 2
        >>> x, info = solver.solve(lambda v: (A @ v[0],), (torch.ones(3, dtype=torch.float64),))
        >>> x[0]
        tensor([0.5000, 0.5000, 0.5000], dtype=torch.float64)
    """

    maxiter: int | None = None
    tol: float = 1e-6
    damping: float = 0.0
    name = "cg"

    def __post_init__(self):
        check_iters("CG maxiter", self.maxiter)
        check_nonneg("CG tol", self.tol)
        check_nonneg("CG damping", self.damping)

    def solve(self, matvec: MatVec, b: Tensors, x0: Tensors | None = None):
        return solve_cg(matvec, b, x0, self.maxiter, self.tol, self.damping)
