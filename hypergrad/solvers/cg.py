"""Conjugate gradient for symmetric positive-definite systems ``(A + damping I) x = b``."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..tree import Tensors, tree_axpy, tree_norm, tree_vdot, tree_zeros_like
from .base import (
    MatVec,
    SolveInfo,
    Solver,
    as_float,
    check_iters,
    check_number,
    check_product,
    damped,
    default_maxiter,
    start,
    verified_krylov,
    warn_diverged,
)


def solve_cg(
    matvec: MatVec,
    b: Tensors,
    x0: Tensors | None = None,
    *,
    maxiter: int | None = None,
    tol: float = 1e-6,
    damping: float = 0.0,
) -> tuple[Tensors, SolveInfo]:
    """Solve ``(A + damping I) x = b`` by conjugate gradient.

    Stops when the recurrence residual is ``<= tol * ||b||``; one more product then recomputes
    ``r = b - A x``, and that value is ``info.residual`` and alone decides ``converged`` (see
    :func:`~hypergrad.solvers.base.verified_krylov`). A non-positive curvature ``p^T A p <= 0``
    means the operator is not positive definite: the iteration stops, ``diverged`` is set and a
    warning suggests MINRES or damping (CG would otherwise return garbage silently).

    Args:
        matvec: ``v -> A v`` on flat pytrees.
        b: right-hand side.
        x0: initial guess (zeros when None).
        maxiter: iteration cap; None gives ``min(2 * numel(b), 1000)``.
        tol: relative residual tolerance.
        damping: Tikhonov damping added to the diagonal.

    Returns:
        ``(x, info)``.

    Raises:
        HypergradValueError: a product of the operator returned NaN/Inf.

    Example:
        >>> A = torch.tensor([[4.0, 1.0], [1.0, 3.0]], dtype=torch.float64)
        >>> x, info = solve_cg(lambda v: (A @ v[0],), (torch.ones(2, dtype=torch.float64),))
        >>> bool(info.converged)
        True
    """
    op = damped(matvec, damping)
    maxiter = default_maxiter(b) if maxiter is None else maxiter
    info = SolveInfo(solver="cg")
    started = start(op, b, x0, info)
    if started is None:
        return tree_zeros_like(b), info
    x, r, b_norm = started

    def iterate(x: Tensors, r: Tensors, budget: int) -> tuple[str, Tensors, None]:
        p = r
        rs = tree_vdot(r, r)
        for _ in range(budget):
            ap = op(p)
            info.matvecs += 1
            pap = tree_vdot(p, ap)
            pap_f = as_float(pap)
            if not math.isfinite(pap_f):
                check_product("CG", f"iteration {info.iterations + 1}", p, ap)
                info.diverged = True
                warn_diverged(info, "NaN/Inf in the CG recurrence (overflow).")
                return "diverged", x, None
            if pap_f <= 0.0:
                info.diverged = True
                info.extras["negative_curvature"] = pap_f
                hint = "The operator is not positive definite: use MINRES or damping."
                if pap_f == 0.0 and as_float(tree_norm(ap)) == 0.0:
                    info.extras["zero_operator"] = True
                    hint = (
                        "The Hessian-vector product is exactly zero (no curvature in this "
                        "direction, e.g. an inner loss linear in the parameters): the operator is "
                        "not positive definite; add damping."
                    )
                warn_diverged(info, hint)
                return "diverged", x, None
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
                return "diverged", x, None
            if rel <= tol:
                return "claimed", x, None
            p = tree_axpy(rs_new / rs, p, r)
            rs = rs_new
        return "maxiter", x, None

    x = verified_krylov(iterate, op, b, x, r, b_norm, tol, maxiter, info, "CG")
    return x, info


@dataclass(kw_only=True)
class CG(Solver):
    """Conjugate gradient: the default for convex inner problems (SPD Hessian).

    Needs about sqrt(condition number) iterations. Use :class:`MINRES` when the Hessian may be
    indefinite (non-convex inner problem), or add ``damping``.

    ``info.converged`` is verified with one recomputed residual (one product more than the
    iterations when the iteration claims convergence).

    Args:
        maxiter: iteration cap, >= 1 (None: ``min(2 * numel, 1000)``).
        tol: relative residual tolerance, finite and >= 0.
        damping: added to the diagonal, i.e. solves ``(H + damping I) x = b`` (finite, >= 0).

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
        self.maxiter = check_iters(
            "CG maxiter", self.maxiter, minimum=1, why=" (zero iterations give no solution)"
        )
        self.tol = check_number("CG tol", self.tol)
        self.damping = check_number("CG damping", self.damping)

    def solve(self, matvec: MatVec, b: Tensors, x0: Tensors | None = None):
        return solve_cg(matvec, b, x0, maxiter=self.maxiter, tol=self.tol, damping=self.damping)
