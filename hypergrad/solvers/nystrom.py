"""Nystrom low-rank solve (Hataya & Yamada, AISTATS 2023): ``(A_k + rho I)^{-1} b``, stably.

``rho`` is the ``damping`` setting.

``A_k = C W^+ C^T`` with ``C = A[:, S]`` (k sampled columns, k products) and ``W = A[S, S]``.
The textbook Woodbury form ``I/rho - C (W + C^T C / rho)^{-1} C^T / rho^2`` subtracts two terms
of size ``||b|| / rho`` whose difference is the (much smaller) solution, so it loses about
``eps * lambda / rho`` relative accuracy (4e-4 to 0.25 at full rank with ``rho = 1e-10``). The
rank-k approximation is put in orthonormal eigen-form and inverted directly:

1. ``W = U diag(s) U^T`` (symmetric eigendecomposition, k x k). Eigenvalues with
   ``|s_i| <= k * eps * max|s|`` are dropped (``eps`` of the products' dtype; the default cut-off
   of ``numpy.linalg.pinv``/``torch.linalg.pinv``; capped at ``sqrt(eps)``, which only half
   precision reaches), which is what ``W^+`` does.
2. ``B = C U |s|^{-1/2}`` (n x r), so ``A_k = B D B^T`` with ``D = diag(sign(s))`` (``D = I``
   for a positive semi-definite ``A``).
3. Thin QR ``B = Q R`` and the eigendecomposition ``R D R^T = V diag(lam) V^T`` (r x r) give
   ``A_k = P diag(lam) P^T`` with orthonormal ``P = Q V`` (n x r).
4. ``x = P diag(1 / (lam + rho)) P^T b + (b - P P^T b) / rho``; the second term (the part of
   ``b`` outside the range of ``A_k``) is omitted when ``r = n``.

No step divides by ``rho`` anything but the component of ``b`` that ``A_k`` does not see, so the
result is accurate for every ``rho > 0``: at full rank it matches a dense solve of
``A + rho I`` to ~1e-11 relative for ``rho`` down to 1e-10 and condition numbers up to 1e6, and
the exact solution to ~1e-15 on an exactly rank-deficient ``A`` (where a dense LU solve itself
loses ``eps * ||A|| / rho``). Costs: k
products, ``O(n k^2)`` flops, ``O(n k)`` float64 memory. At full rank ``A_k = A`` and the result
is the solution of ``A + rho I``; at lower rank it solves the approximation only (the recomputed
residual against the true ``A + rho I`` says how far off that is; see ``docs/solvers.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..settings import count, integer, number
from ..tree import Tensors, tree_norm, tree_numel, tree_ravel, tree_unravel
from .base import MatVec, SolveInfo, Solver, as_float, damped, functional_form, report_failure
from .dense import dense_matrix
from .krylov import recomputed_residual


@dataclass(kw_only=True)
class Nystrom(Solver):
    """Nystrom low-rank approximation of the Hessian (Hataya & Yamada 2023), solved stably.

    Costs ``rank`` products (plus one for the residual), a ``rank x rank`` eigendecomposition and
    a thin QR of an ``n x rank`` matrix; the result solves ``(H_k + damping I) x = b``, so
    ``damping`` is both damping and regulariser. Accurate for any ``damping > 0`` (see the module
    docstring): ``(H_k + damping I)^{-1}`` is applied in the orthonormal eigenbasis of ``H_k``,
    never by Woodbury's ``1 / damping**2`` cancellation. ``info.extras``: ``"rank"`` (columns
    sampled), ``"numerical_rank"`` (eigenvalues of the sampled core kept), ``"damping"``.

    Args:
        rank: number of sampled columns k (capped at the number of unknowns).
        damping: added to the diagonal of the approximation, must be > 0.
        seed: seed of the private column sampler.
        tol: residual tolerance used for ``converged``.

    Example:
        >>> A = torch.diag(torch.tensor([1.0, 3.0], dtype=torch.float64))
        >>> x, info = Nystrom(rank=2, damping=1.0).solve(lambda v: (A @ v[0],),
        ...                                              (torch.ones(2, dtype=torch.float64),))
        >>> x[0]
        tensor([0.5000, 0.2500], dtype=torch.float64)
    """

    name = "nystrom"
    display = "Nystrom"
    symmetric_only = True
    rank: int = count(10, minimum=1, allow_none=False)
    damping: float = number(1e-2, strict=True)
    seed: int = integer(0)
    tol: float = number(1e-6)

    def solve(
        self, matvec: MatVec, b: Tensors, x0: Tensors | None = None
    ) -> tuple[Tensors, SolveInfo]:
        """Solve ``(A + damping I) x = b`` with a rank-``rank`` Nystrom approximation of ``A``.

        Columns are sampled uniformly without replacement by a private generator (``seed``), so the
        global RNG is not consumed. One extra product reports the true residual of the result.

        Returns:
            ``(x, info)``.

        Raises:
            HypergradValueError: a product returned NaN/Inf (naming the column).
        """
        n = tree_numel(b)
        k = max(1, min(self.rank, n))
        damping = self.damping
        gen = torch.Generator().manual_seed(self.seed)
        idx = torch.randperm(n, generator=gen)[:k]
        c = dense_matrix(matvec, b, columns=idx.tolist(), solver=self.display)  # (n, k)
        basis, lam = _nystrom_eigenbasis(c, idx.to(c.device), _core_rtol(b, k))
        rhs = tree_ravel(b, torch.float64)
        coef = basis.T @ rhs
        sol = basis @ (coef / (lam + damping))
        if basis.shape[1] < n:  # the part of b outside the range of A_k sees only the damping
            sol = sol + (rhs - basis @ coef) / damping
        x = tree_unravel(sol, b)
        info = SolveInfo(
            solver=self.name,
            iterations=k,
            matvecs=k,
            extras={"rank": k, "damping": damping, "numerical_rank": int(lam.numel())},
        )
        b_norm = as_float(tree_norm(b))
        if b_norm > 0:
            _, info.residual = recomputed_residual(
                damped(matvec, damping), b, x, b_norm, info, self.display, "the residual check"
            )
        else:
            info.residual = 0.0
        info.extras["residual_verified"] = True
        info.residuals.append(info.residual)
        info.converged = info.residual <= self.tol
        info.diverged = not bool(torch.isfinite(sol).all())
        report_failure(info)
        return x, info


@functional_form(Nystrom)
def solve_nystrom(
    matvec: MatVec, b: Tensors, x0: Tensors | None = None, **settings: Any
) -> tuple[Tensors, SolveInfo]:
    """``Nystrom(**settings).solve(matvec, b, x0)``: the Nystrom solve as a function (the
    settings are :class:`Nystrom`'s, keyword-only and validated the same way; ``x0`` is ignored).

    Example:
        >>> A = torch.tensor([[3.0, 1.0], [1.0, 2.0]], dtype=torch.float64)
        >>> x, info = solve_nystrom(lambda v: (A @ v[0],), (torch.ones(2, dtype=torch.float64),),
        ...                         rank=2, damping=1.0)
        >>> I = torch.eye(2, dtype=torch.float64)
        >>> torch.allclose((A + I) @ x[0], torch.ones(2, dtype=torch.float64))
        True
    """
    return Nystrom(**settings).solve(matvec, b, x0)


def _core_rtol(b: Tensors, k: int) -> float:
    """Relative cut-off for the eigenvalues of the sampled core ``W``: ``min(k * eps, sqrt(eps))``.

    ``eps`` is the machine epsilon of the least precise leaf of ``b`` (the dtype the products
    were computed in), so rounding noise in a singular ``W`` is treated as zero, as
    ``torch.linalg.pinv`` does by default (``k * eps``). The ``sqrt(eps)`` cap only matters for
    half precision (or float32 with k > 2900), where ``k * eps`` could reach 1 and drop
    every eigenvalue.
    """
    eps = max(
        (torch.finfo(t.dtype).eps for t in b if t.is_floating_point()),
        default=torch.finfo(torch.float64).eps,
    )
    root: float = eps**0.5  # float ** float is typed Any
    return min(k * eps, root)


def _nystrom_eigenbasis(
    c: torch.Tensor, idx: torch.Tensor, rtol: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Orthonormal eigen-form of the Nystrom approximation ``A_k = C W^+ C^T``.

    Args:
        c: the sampled columns ``C = A[:, S]``, float64 of shape ``(n, k)``.
        idx: the sampled indices ``S`` (so ``W = C[S]``).
        rtol: eigenvalues of ``W`` with ``|s| <= rtol * max|s|`` are dropped (pseudo-inverse).

    Returns:
        ``(P, lam)`` with ``P`` of shape ``(n, r)`` with orthonormal columns and ``lam`` of shape
        ``(r,)`` such that ``A_k = P diag(lam) P^T``; ``r`` (at most k) is the numerical rank of
        ``W``. ``lam`` is negative where ``W`` has negative eigenvalues (an indefinite ``A``).
    """
    n = c.shape[0]
    w = c[idx]
    w = 0.5 * (w + w.T)
    s, u = torch.linalg.eigh(w)
    s_max = float(s.abs().max())
    keep = s.abs() > rtol * s_max
    if s_max == 0.0 or not bool(keep.any()):  # A_k = 0
        return c.new_zeros(n, 0), c.new_zeros(0)
    s, u = s[keep], u[:, keep]
    q, r = torch.linalg.qr((c @ u) / s.abs().sqrt())  # B = C U |s|^{-1/2} = Q R, B D B^T = A_k
    core = (r * s.sign()) @ r.T  # R D R^T
    lam, v = torch.linalg.eigh(0.5 * (core + core.T))
    return q @ v, lam
