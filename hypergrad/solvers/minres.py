"""MINRES (Paige & Saunders 1975) for symmetric, possibly indefinite systems."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..tree import Tensors, tree_axpy, tree_norm, tree_scale, tree_sub, tree_vdot, tree_zeros_like
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


def solve_minres(
    matvec: MatVec,
    b: Tensors,
    x0: Tensors | None = None,
    maxiter: int | None = None,
    tol: float = 1e-6,
    damping: float = 0.0,
) -> tuple[Tensors, SolveInfo]:
    """Solve ``(A + damping I) x = b`` for symmetric ``A`` by MINRES.

    MINRES minimises ``||(A + damping I) x - b||`` over the Krylov space, so it is safe on
    indefinite Hessians (saddle points, non-convex inner problems) where CG breaks down.
    The residual norm is tracked by the Lanczos recurrence (no extra products).

    Args:
        matvec: ``v -> A v`` on flat pytrees (``A`` must be symmetric).
        b: right-hand side.
        x0: initial guess (zeros when None).
        maxiter: iteration cap; None gives ``min(2 * numel(b), 1000)``.
        tol: relative residual tolerance.
        damping: added to the diagonal.

    Returns:
        ``(x, info)``.

    Example:
        >>> A = torch.tensor([[1.0, 2.0], [2.0, -3.0]], dtype=torch.float64)  # indefinite
        >>> x, info = solve_minres(lambda v: (A @ v[0],), (torch.ones(2, dtype=torch.float64),))
        >>> torch.allclose(A @ x[0], torch.ones(2, dtype=torch.float64))
        True
    """
    op = damped(matvec, damping)
    maxiter = default_maxiter(b) if maxiter is None else maxiter
    info = SolveInfo(solver="minres")
    b_norm = as_float(tree_norm(b))
    info.extras["b_norm"] = b_norm
    if b_norm == 0.0:
        info.residual, info.converged = 0.0, True
        return tree_zeros_like(b), info
    if x0 is None:
        x = tree_zeros_like(b)
        r1 = b
    else:
        x = x0
        r1 = tree_sub(b, op(x0))
        info.matvecs += 1
    beta1 = as_float(tree_norm(r1))
    info.residual = beta1 / b_norm
    if info.residual <= tol:
        info.converged = True
        return x, info
    # Lanczos + QR state (scalars on the host, vectors as flat pytrees).
    y, r2 = r1, r1
    old_beta, beta = 0.0, beta1
    dbar, epsln, phibar = 0.0, 0.0, beta1
    cs, sn = -1.0, 0.0
    w = tree_zeros_like(b)
    w2 = tree_zeros_like(b)
    for it in range(1, maxiter + 1):
        v = tree_scale(1.0 / beta, y)
        y = op(v)
        info.matvecs += 1
        if it >= 2:
            y = tree_axpy(-beta / old_beta, r1, y)
        alfa = as_float(tree_vdot(v, y))
        y = tree_axpy(-alfa / beta, r2, y)
        r1, r2 = r2, y
        old_beta, beta = beta, as_float(tree_norm(y))
        old_eps = epsln
        delta = cs * dbar + sn * alfa
        gbar = sn * dbar - cs * alfa
        epsln = sn * beta
        dbar = -cs * beta
        gamma = max(math.hypot(gbar, beta), 1e-300)
        cs, sn = gbar / gamma, beta / gamma
        phi = cs * phibar
        phibar = sn * phibar
        w1, w2 = w2, w
        w = tree_scale(1.0 / gamma, tree_axpy(-delta, w2, tree_axpy(-old_eps, w1, v)))
        x = tree_axpy(phi, w, x)
        info.iterations = it
        rel = abs(phibar) / b_norm
        info.residual = rel
        info.residuals.append(rel)
        if not math.isfinite(rel):
            info.diverged = True
            warn_diverged(info, "NaN/Inf in the MINRES recurrence.")
            break
        if rel <= tol:
            info.converged = True
            break
        if beta == 0.0:  # Krylov space exhausted: x is the least-squares solution
            break
    return x, info


@dataclass
class MINRES(Solver):
    """MINRES: for symmetric indefinite Hessians (non-convex inner problems).

    Args:
        maxiter: iteration cap (None: ``min(2 * numel, 1000)``).
        tol: relative residual tolerance.
        damping: added to the diagonal.

    Example:
        >>> A = torch.diag(torch.tensor([2.0, -1.0], dtype=torch.float64))
        >>> x, info = MINRES(tol=1e-10).solve(lambda v: (A @ v[0],),
        ...                                   (torch.ones(2, dtype=torch.float64),))
        >>> x[0]
        tensor([ 0.5000, -1.0000], dtype=torch.float64)
    """

    maxiter: int | None = None
    tol: float = 1e-6
    damping: float = 0.0
    name = "minres"

    def __post_init__(self):
        check_iters("MINRES maxiter", self.maxiter)
        check_nonneg("MINRES tol", self.tol)
        check_nonneg("MINRES damping", self.damping)

    def solve(self, matvec: MatVec, b: Tensors, x0: Tensors | None = None):
        return solve_minres(matvec, b, x0, self.maxiter, self.tol, self.damping)
