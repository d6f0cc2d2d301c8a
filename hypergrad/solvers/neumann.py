"""Truncated Neumann series ``x = alpha * sum_{k=0}^{K} (I - alpha A)^k b`` for SPD systems."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import HypergradValueError
from ..tree import Tensors, tree_add, tree_axpy, tree_norm, tree_scale, tree_sub, tree_zeros_like
from .base import (
    MatVec,
    SolveInfo,
    Solver,
    as_float,
    check_iters,
    check_nonneg,
    damped,
    warn_diverged,
)

#: Relative growth of a term over the smallest earlier term that counts as divergence. For SPD
#: ``A`` and ``0 < alpha <= 2 / lambda_max`` the term norms never increase, so any growth beyond
#: rounding means ``alpha`` is too large or ``A`` is indefinite: the series diverges eventually.
GROWTH_TOL = 1e-6


def _growth_tol(dtype: torch.dtype) -> float:
    return max(GROWTH_TOL, 100 * torch.finfo(dtype).eps)


def power_iteration(matvec: MatVec, like: Tensors, iters: int = 20) -> tuple[float, int]:
    """Estimate the largest-magnitude eigenvalue of a symmetric operator.

    The start vector comes from a private generator (seed 0), so the global RNG stream of the
    caller is not consumed. Returns ``(eigenvalue estimate, products spent)``.

    Example:
        >>> A = torch.diag(torch.tensor([1.0, 5.0], dtype=torch.float64))
        >>> like = (torch.zeros(2, dtype=torch.float64),)
        >>> round(power_iteration(lambda v: (A @ v[0],), like)[0], 6)
        5.0
    """
    gen = torch.Generator().manual_seed(0)
    v = tuple(torch.randn(a.shape, generator=gen, dtype=torch.float64).to(a) for a in like)
    v = tree_scale(1.0 / as_float(tree_norm(v)), v)
    lam = 0.0
    for _ in range(iters):
        av = matvec(v)
        nrm = as_float(tree_norm(av))
        if nrm == 0.0 or not math.isfinite(nrm):
            return nrm, iters
        lam = as_float(sum(torch.sum(a.double() * b.double()) for a, b in zip(v, av)))
        v = tree_scale(1.0 / nrm, av)
    return lam, iters


def solve_neumann(
    matvec: MatVec,
    b: Tensors,
    x0: Tensors | None = None,
    steps: int = 10,
    alpha: float | None = None,
    tol: float | None = None,
    damping: float = 0.0,
    power_iters: int = 20,
    exact_residual: bool = False,
) -> tuple[Tensors, SolveInfo]:
    """Approximate ``(A + damping I)^{-1} b`` by the truncated Neumann series.

    With ``v_0 = b`` and ``v_k = (I - alpha A) v_{k-1}``, returns ``x = alpha * sum_{k=0}^{K} v_k``
    after ``K = steps`` products, which equals ``A^{-1} (I - (I - alpha A)^{K+1}) b`` in closed
    form. It converges when ``0 < alpha < 2 / lambda_max`` and ``A`` is SPD, at a rate set by
    ``1 - alpha * lambda_min``: iterations grow like the condition number.

    Diagnostics: ``residual`` is ``||v_K|| / ||b||``, an upper bound on the true relative residual
    ``||v_{K+1}|| / ||b||`` whenever the series converges; ``exact_residual=True`` spends one more
    product to report the true value. A term whose norm exceeds the smallest earlier term norm
    (beyond rounding), or NaN/Inf, sets ``diverged`` (alpha too large or ``A`` indefinite: the
    series diverges, even if slowly), stops, and warns.

    Args:
        matvec: ``v -> A v``.
        b: right-hand side.
        x0: initial guess; the series is then applied to the residual ``b - A x0``.
        steps: number of products K (K + 1 series terms).
        alpha: step size; None estimates ``1 / lambda_max`` with ``power_iters`` products.
        tol: stop early when the residual bound is ``<= tol``; None runs all steps.
        damping: added to the diagonal.
        power_iters: power iterations used when ``alpha`` is None.
        exact_residual: spend one more product to report the exact residual.

    Example:
        >>> A = torch.diag(torch.tensor([1.0, 2.0], dtype=torch.float64))
        >>> x, info = solve_neumann(lambda v: (A @ v[0],), (torch.ones(2, dtype=torch.float64),),
        ...                         steps=60, alpha=0.5)
        >>> x[0]
        tensor([1.0000, 0.5000], dtype=torch.float64)
    """
    op = damped(matvec, damping)
    info = SolveInfo(solver="neumann")
    b_norm = as_float(tree_norm(b))
    if b_norm == 0.0:
        info.residual, info.converged = 0.0, True
        return tree_zeros_like(b), info
    if alpha is None:
        lam, spent = power_iteration(op, b, power_iters)
        info.matvecs += spent
        info.extras["lambda_max"] = lam
        if not lam > 0.0 or not math.isfinite(lam):
            raise HypergradValueError(
                f"Neumann: estimated largest eigenvalue is {lam:.3g} (not positive): the operator "
                "is not positive definite; use MINRES or add damping"
            )
        alpha = 1.0 / lam
    info.alpha = float(alpha)
    info.extras["b_norm"] = b_norm
    if x0 is not None:
        v = tree_sub(b, op(x0))
        info.matvecs += 1
        norm_min = as_float(tree_norm(v))
    else:
        v = b
        norm_min = b_norm
    acc = v
    info.residual = norm_min / b_norm
    limit = 1.0 + _growth_tol(b[0].dtype)
    for _ in range(steps):
        if tol is not None and info.residual <= tol:
            break
        v = tree_axpy(-alpha, op(v), v)
        info.matvecs += 1
        info.iterations += 1
        norm = as_float(tree_norm(v))
        if not math.isfinite(norm) or norm > limit * norm_min:
            growth = norm / norm_min if norm_min > 0 else math.inf
            info.diverged = True
            info.residual = norm / b_norm
            info.extras["growth"] = growth
            warn_diverged(
                info,
                f"A Neumann term grew {growth:.6g}x over an earlier one: alpha={alpha:.3g} is too "
                "large for this operator (needs alpha < 2 / lambda_max) or it is indefinite; "
                "lower alpha, use alpha=None, add damping, or use MINRES.",
            )
            break
        acc = tree_add(acc, v)
        norm_min = min(norm_min, norm)
        info.residual = norm / b_norm
        info.residuals.append(info.residual)
    x = tree_scale(alpha, acc)
    if x0 is not None:
        x = tree_add(x0, x)
    if exact_residual and not info.diverged:
        v_next = tree_axpy(-alpha, op(v), v)
        info.matvecs += 1
        info.residual = as_float(tree_norm(v_next)) / b_norm
    info.extras["residual_is_bound"] = not exact_residual
    info.converged = (not info.diverged) and tol is not None and info.residual <= tol
    return x, info


@dataclass
class Neumann(Solver):
    """Truncated Neumann series: cheap, no inner products, but kappa-proportional iterations.

    Args:
        steps: number of Hessian-vector products K (the series has K + 1 terms).
        alpha: step size (must be < 2 / lambda_max); None estimates ``1 / lambda_max`` by power
            iteration (``power_iters`` extra products per solve).
        tol: optional early stop on the residual bound.
        damping: added to the diagonal.
        power_iters: power iterations for ``alpha=None``.
        exact_residual: spend one product more to report the exact residual.

    Example:
        >>> A = torch.diag(torch.tensor([1.0, 4.0], dtype=torch.float64))
        >>> x, info = Neumann(steps=100).solve(lambda v: (A @ v[0],),
        ...                                    (torch.ones(2, dtype=torch.float64),))
        >>> round(info.alpha, 4), [round(float(t), 4) for t in x[0]]
        (0.25, [1.0, 0.25])
    """

    steps: int = 10
    alpha: float | None = None
    tol: float | None = None
    damping: float = 0.0
    power_iters: int = 20
    exact_residual: bool = False
    name = "neumann"

    def __post_init__(self):
        check_iters("Neumann steps", self.steps)
        check_nonneg("Neumann alpha", self.alpha, allow_none=True, positive=True)
        check_nonneg("Neumann tol", self.tol, allow_none=True)
        check_nonneg("Neumann damping", self.damping)
        check_iters("Neumann power_iters", self.power_iters)
        if self.alpha is None and self.power_iters < 1:
            raise HypergradValueError("Neumann power_iters must be >= 1 when alpha is None")

    def solve(self, matvec: MatVec, b: Tensors, x0: Tensors | None = None):
        return solve_neumann(
            matvec,
            b,
            x0,
            self.steps,
            self.alpha,
            self.tol,
            self.damping,
            self.power_iters,
            self.exact_residual,
        )
