"""Nystrom low-rank solve (Hataya & Yamada, AISTATS 2023): ``(A_k + rho I)^{-1} b`` by Woodbury.

``A_k = C W^+ C^T`` with ``C = A[:, S]`` (k sampled columns, k products) and ``W = A[S, S]``;
Woodbury gives ``(A_k + rho I)^{-1} = I/rho - C (W + C^T C / rho)^{-1} C^T / rho^2``, which needs
only a k x k solve. At full rank ``A_k = A`` and the result is exact for ``A + rho I``.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from ..errors import HypergradValueError
from ..tree import Tensors, tree_norm, tree_numel, tree_ravel, tree_unravel
from .base import (
    MatVec,
    SolveInfo,
    Solver,
    as_float,
    check_nonneg,
    damped,
    nonfinite_product_error,
    recomputed_residual,
)


def solve_nystrom(
    matvec: MatVec,
    b: Tensors,
    x0: Tensors | None = None,
    rank: int = 10,
    rho: float = 1e-2,
    seed: int = 0,
    tol: float = 1e-6,
) -> tuple[Tensors, SolveInfo]:
    """Solve ``(A + rho I) x = b`` with a rank-``rank`` Nystrom approximation of ``A``.

    Columns are sampled uniformly without replacement by a private generator (``seed``), so the
    global RNG is not consumed. One extra product reports the true residual of the result.

    Example:
        >>> A = torch.tensor([[3.0, 1.0], [1.0, 2.0]], dtype=torch.float64)
        >>> x, info = solve_nystrom(lambda v: (A @ v[0],), (torch.ones(2, dtype=torch.float64),),
        ...                         rank=2, rho=1.0)
        >>> I = torch.eye(2, dtype=torch.float64)
        >>> torch.allclose((A + I) @ x[0], torch.ones(2, dtype=torch.float64))
        True
    """
    n = tree_numel(b)
    k = max(1, min(int(rank), n))
    ref = b[0]
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randperm(n, generator=gen)[:k]
    cols = []
    for j in idx.tolist():
        e = torch.zeros(n, dtype=ref.dtype, device=ref.device)
        e[j] = 1.0
        cols.append(tree_ravel(matvec(tree_unravel(e, b)), torch.float64))
    c = torch.stack(cols, dim=1)  # (n, k)
    bad = (~torch.isfinite(c)).any(dim=0).nonzero()
    if len(bad):
        j = int(idx[int(bad[0])])
        raise nonfinite_product_error("Nystrom", f"column {j} (unit vector e_{j})")
    w = c[idx.to(c.device)]  # (k, k)
    w = 0.5 * (w + w.T)
    rhs = tree_ravel(b, torch.float64)
    inner = w + (c.T @ c) / rho
    coef = torch.linalg.lstsq(inner, c.T @ rhs).solution
    sol = rhs / rho - (c @ coef) / rho**2
    x = tree_unravel(sol, b)
    info = SolveInfo(solver="nystrom", iterations=k, matvecs=k, extras={"rank": k, "rho": rho})
    b_norm = as_float(tree_norm(b))
    if b_norm > 0:
        _, info.residual = recomputed_residual(
            damped(matvec, rho), b, x, b_norm, info, "Nystrom", "the residual check"
        )
    else:
        info.residual = 0.0
    info.extras["residual_verified"] = True
    info.residuals.append(info.residual)
    info.converged = info.residual <= tol
    info.diverged = not bool(torch.isfinite(sol).all())
    return x, info


@dataclass
class Nystrom(Solver):
    """Nystrom low-rank approximation of the Hessian, solved by Woodbury (Hataya & Yamada 2023).

    Costs ``rank`` products (plus one for the residual) and a ``rank x rank`` dense solve; the
    result solves ``(H_k + rho I) x = b``, so ``rho`` is both damping and regulariser.

    Args:
        rank: number of sampled columns k (capped at the number of unknowns).
        rho: damping, must be > 0.
        seed: seed of the private column sampler.
        tol: residual tolerance used for ``converged``.

    Example:
        >>> A = torch.diag(torch.tensor([1.0, 3.0], dtype=torch.float64))
        >>> x, info = Nystrom(rank=2, rho=1.0).solve(lambda v: (A @ v[0],),
        ...                                          (torch.ones(2, dtype=torch.float64),))
        >>> x[0]
        tensor([0.5000, 0.2500], dtype=torch.float64)
    """

    rank: int = 10
    rho: float = 1e-2
    seed: int = 0
    tol: float = 1e-6
    name = "nystrom"

    def __post_init__(self):
        self.rho = check_nonneg("Nystrom rho", self.rho, positive=True)
        self.tol = check_nonneg("Nystrom tol", self.tol)
        for name in ("rank", "seed"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, numbers.Integral)
                or (name == "rank" and value < 1)
            ):
                kind = "a positive int" if name == "rank" else "an int"
                raise HypergradValueError(f"Nystrom {name} must be {kind}, got {value!r}")
            setattr(self, name, int(value))

    @property
    def damping(self) -> float:  # type: ignore[override]
        return self.rho

    def solve(self, matvec: MatVec, b: Tensors, x0: Tensors | None = None):
        return solve_nystrom(matvec, b, x0, self.rank, self.rho, self.seed, self.tol)
