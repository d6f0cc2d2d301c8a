"""A dense factorised Hessian kept across solves as CG's preconditioner (a lagged preconditioner).

In an outer loop the inner Hessian changes a little from one hypergradient to the next. Building
it densely once (``n`` products, as :class:`~hypergrad.solvers.Exact` does) and reusing its
Cholesky factor as the preconditioner ``M = A_old^-1`` of the following CG solves makes each of
them take a few iterations, however badly conditioned ``A`` is, until ``A`` has drifted far from
``A_old``; then the factor is rebuilt. The rule is "rent or buy": the next solve rebuilds once the
products spent in the solves since the last build reach the build's own cost (``n`` products):
the cost of reusing a stale factor is never allowed to exceed what a fresh one would have cost,
with nothing to tune (``examples/weight_decay.py --precond dense``: 5 builds in 100 outer steps).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..errors import HypergradValueError
from ..settings import FrozenSettings, count, number
from ..tree import Tensors, tree_numel, tree_ravel, tree_unravel
from .base import DISPLAY_NAMES, MatVec, SolveInfo
from .dense import dense_matrix
from .exact import MAX_EXACT_NUMEL


@dataclass(kw_only=True)
class DensePreconditioner(FrozenSettings):
    """Cholesky factor of the dense operator from an earlier solve, reused by later CG solves.

    Pass one instance to :class:`~hypergrad.CG` (``CG(preconditioner=DensePreconditioner())``)
    and keep that solver across outer steps (``HyperStep`` and ``@implicit`` keep theirs): the
    instance holds the factor between solves. The first solve, and the first one after the
    factor has gone stale, builds ``A + damping I`` column by column (``n`` products, counted in
    ``info.matvecs``, with :func:`~hypergrad.solvers.dense_matrix`) and factorises it in float64;
    every solve applies ``M r = (A_old + damping I)^-1 r`` by two triangular solves. With a fresh
    factor CG converges in one or two iterations; as the operator drifts the iterations grow, and
    once the products spent since the build reach ``rebuild_after`` the next solve rebuilds.
    Preconditioning changes the number of iterations, never the answer: CG still judges
    convergence on the recomputed true residual.

    A factor built from a matrix that is not positive definite (a non-convex inner problem) or
    numerically singular (a Cholesky pivot below ``n eps`` times the largest diagonal entry) is
    replaced by ``V |w|^-1 V^T`` from its eigendecomposition so that ``M`` stays positive
    definite; ``info.extras["preconditioner"]`` says so. Eigenvalues with ``|w| <= n eps max|w|``
    (``eps`` of the products' dtype) count as a null space, which ``M`` scales by
    ``1 / max|w|``: the part of a residual there is not amplified, so CG solves a consistent
    singular system (minimum-norm solution) and stops on an inconsistent one with
    ``extras["singular"]`` (see :func:`~hypergrad.solvers.solve_cg`).

    Args:
        rebuild_after: preconditioner applications (one per CG iteration, each costing one
            product) since the last build after which the next solve rebuilds the factor
            (None: ``n``, the products of one build).
        damping: added to the diagonal of the built matrix (on top of CG's own damping).
        max_numel: refuse to build for more unknowns than this (``n^2`` float64 entries).

    Attributes:
        builds: how many times the factor has been built.

    The settings are fixed at construction (assigning one raises
    :class:`~hypergrad.errors.FrozenSettingError`; ``replace(damping=...)`` builds a new one).

    ``info.extras`` of each solve: ``preconditioner`` (``"dense"``), ``preconditioner_rebuilt``
    (whether this solve built the factor), ``preconditioner_age`` (solves since the build, 0 for
    the solve that built it) and ``preconditioner_matvecs`` (products spent on the build).

    Example:
        >>> from hypergrad import CG
        >>> A = torch.tensor([[4.0, 1.0], [1.0, 3.0]], dtype=torch.float64)
        >>> solver = CG(tol=1e-12, preconditioner=DensePreconditioner())
        >>> b = (torch.tensor([1.0, 2.0], dtype=torch.float64),)
        >>> x, info = solver.solve(lambda v: (A @ v[0],), b)
        >>> info.iterations, info.extras["preconditioner_rebuilt"]
        (1, True)
        >>> x, info = solver.solve(lambda v: (1.01 * A @ v[0],), b)  # reuses the factor
        >>> info.extras["preconditioner_rebuilt"], bool(info.converged)
        (False, True)
    """

    rebuild_after: int | None = count(None, minimum=1)
    damping: float = number(0.0)
    max_numel: int = count(MAX_EXACT_NUMEL, minimum=1, allow_none=False)
    builds: int = field(default=0, init=False)
    _factor: torch.Tensor | None = field(default=None, init=False, repr=False)
    _cholesky: bool = field(default=True, init=False, repr=False)
    _key: tuple[object, ...] | None = field(default=None, init=False, repr=False)
    _spent: int = field(default=0, init=False, repr=False)
    _age: int = field(default=0, init=False, repr=False)

    def reset(self) -> None:
        """Drop the factor: the next solve rebuilds it."""
        self._factor, self._key = None, None

    def setup(self, op: MatVec, b: Tensors, info: SolveInfo) -> Callable[[Tensors], Tensors]:
        """Called by CG at the start of a solve: (re)build the factor if needed and return
        ``r -> M r``. Rebuilds when there is no factor, when ``b``'s shapes, dtypes or device
        differ from the factor's, or when the products since the build reached the budget."""
        n = tree_numel(b)
        key = tuple((t.shape, t.dtype, t.device) for t in b)
        rebuild = self.stale(b)
        if rebuild:
            self._build(op, b, n, DISPLAY_NAMES.get(info.solver, info.solver))
            self._key = key
            info.matvecs += n
        else:
            self._age += 1
        info.extras.update(
            preconditioner="dense" if self._cholesky else "dense (eigenvalues clipped)",
            preconditioner_rebuilt=rebuild,
            preconditioner_age=self._age,
            preconditioner_matvecs=n if rebuild else 0,
        )
        return self._apply

    def stale(self, like: Tensors) -> bool:
        """Whether the next use would rebuild the factor: no factor yet, ``like``'s shapes,
        dtypes or device differ from the factor's, or the applications since the build reached
        ``rebuild_after`` (default ``n``)."""
        n = tree_numel(like)
        budget = n if self.rebuild_after is None else self.rebuild_after
        key = tuple((t.shape, t.dtype, t.device) for t in like)
        return self._factor is None or key != self._key or self._spent >= budget

    def adopt(self, matrix: torch.Tensor, like: Tensors) -> None:
        """Factorise a dense matrix the caller already has (e.g. the Hessian a Newton step
        computed) as the kept factor, for unknowns shaped like ``like``: counted in ``builds``,
        and the budget of applications starts again.

        Example:
            >>> pre = DensePreconditioner()
            >>> pre.adopt(torch.tensor([[2.0, 0.0], [0.0, 4.0]], dtype=torch.float64),
            ...           (torch.zeros(2, dtype=torch.float64),))
            >>> r = (torch.tensor([2.0, 4.0], dtype=torch.float64),)
            >>> [round(v, 12) for v in pre.apply(r)[0].tolist()]
            [1.0, 1.0]
        """
        n = tree_numel(like)
        if matrix.shape != (n, n):
            raise HypergradValueError(
                f"DensePreconditioner.adopt: a {n} x {n} matrix is needed for {n} unknowns, "
                f"got {tuple(matrix.shape)}"
            )
        self._check_size(n)
        self._factorize(matrix.to(torch.float64), like, n)
        self._key = tuple((t.shape, t.dtype, t.device) for t in like)

    def apply(self, r: Tensors) -> Tensors:
        """``M r = (A_old + damping I)^-1 r`` with the kept factor (one application, counted
        against ``rebuild_after``)."""
        if self._factor is None:
            raise HypergradValueError("DensePreconditioner.apply: no factor has been built yet")
        return self._apply(r)

    def _check_size(self, n: int) -> None:
        if n > self.max_numel:
            raise HypergradValueError(
                f"DensePreconditioner: the system has {n} unknowns (> max_numel={self.max_numel});"
                " use CG without it (or with preconditioner='hutchinson') for large problems"
            )

    def _build(self, op: MatVec, b: Tensors, n: int, solver: str) -> None:
        self._check_size(n)
        mat = dense_matrix(op, b, solver=f"{solver} (DensePreconditioner)")
        self._factorize(mat, b, n)

    def _factorize(self, mat: torch.Tensor, b: Tensors, n: int) -> None:
        mat = 0.5 * (mat + mat.T)  # symmetric up to rounding; the factor must be exactly so
        if self.damping:
            mat = mat + self.damping * torch.eye(n, dtype=mat.dtype, device=mat.device)
        chol, status = torch.linalg.cholesky_ex(mat)
        eps = max(torch.finfo(t.dtype).eps for t in b)  # the products' precision
        self._cholesky = int(status) == 0
        if self._cholesky:  # pivots at rounding level: numerically singular, take the eigen path
            pivots = chol.diagonal() ** 2
            self._cholesky = bool(pivots.min() > n * eps * mat.diagonal().abs().max())
        if self._cholesky:
            self._factor = chol
        else:  # not positive definite: M = V |w|^-1 V^T, |w| clipped away from 0
            w, v = torch.linalg.eigh(mat)
            w_max = float(w.abs().max())
            floor = w_max * n * eps
            if not floor > 0:
                raise HypergradValueError(
                    "DensePreconditioner: the operator is zero; add damping "
                    "(DensePreconditioner(damping=...) or CG(damping=...))"
                )
            # eigenvalues at rounding level are a null space: M scales it by 1 / max|w|, not by
            # 1 / floor, so that a residual component there (rounding, or the part of b outside
            # the range of a singular A) is not amplified into x
            scale = torch.where(w.abs() > floor, w.abs(), torch.full_like(w, w_max))
            self._factor = v * scale.rsqrt()  # M = F F^T
        self.builds += 1
        self._spent, self._age = 0, 0

    def _apply(self, r: Tensors) -> Tensors:
        self._spent += 1
        assert self._factor is not None
        flat = tree_ravel(r, torch.float64).to(self._factor.device)[:, None]
        if self._cholesky:
            out = torch.cholesky_solve(flat, self._factor)
        else:
            out = self._factor @ (self._factor.T @ flat)
        return tree_unravel(out[:, 0], r)
