"""What the inner solvers share: :class:`InnerInfo`, setting checks, and the flat-vector view of a
pytree (the solvers iterate on one 1-D tensor and hand the user's functions the pytree)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import HypergradTypeError, HypergradValueError
from ..tree import PyTree, TreeSpec, tree_flatten, tree_ravel, tree_unflatten, tree_unravel


@dataclass
class InnerInfo:
    """Diagnostics of one inner solve.

    The report states only what was measured: ``residual`` is computed at the returned point
    (never an estimate from the iteration), and ``converged`` is ``residual <= tol``.

    Attributes:
        solver: ``"anderson"``, ``"picard"``, ``"fista"``, ``"ista"``, ``"newton"`` or
            ``"lbfgs"``.
        iterations: steps taken (updates of the iterate).
        residual: the relative optimality residual at the returned point: fixed point
            ``||T(x) − x|| / max(||x||, ||T(x0) − x0||)``; proximal gradient
            ``||G_s(x)|| / ||G_s(0)||`` with the gradient mapping
            ``G_s(x) = (x − prox(x − s ∇f(x), s)) / s``; smooth ``||∇f(x)|| / ||∇f(0)||``.
            The proximal-gradient and smooth references are taken at the origin, so the
            residual is a function of ``x`` alone and a warm start from a converged solution
            stops at once; where the origin's value is zero or not finite, ``x0`` stands in
            for it. It is 0 exactly at a solution (also when the reference norm is 0).
        converged: ``residual <= tol``, measured at the returned point.
        diverged: a non-finite value appeared (the last finite iterate is returned), or a line
            search found no acceptable step.
        tol: the tolerance the residual was compared with.
        evaluations: calls of the map / loss (with its gradient) / Hessian, see the solver.
        residuals: the residual at each iterate the solver measured it at (for plots); for
            FISTA the cheap estimate at the extrapolated points and each verification.
        stepsize: the last step size (proximal gradient: the one ``G_s`` used; smooth solvers:
            the last line-search step; fixed point: the mixing).
        extras: solver-specific details: always ``"reference"``, the reference norm
            (``||T(x0) − x0||``; ``||G_s(0)||`` at the reported ``s``; ``||∇f(0)||``), with
            ``"reference_point"`` (``"origin"`` or ``"x0"``, the fallback) for the proximal
            gradient and smooth solvers; ``"reason"`` for a stop before ``maxiter`` on a
            failure; and ``"restarts"``, ``"backtracks"``, ``"damping"``... (see each solver).
    """

    solver: str
    iterations: int = 0
    residual: float = float("nan")
    converged: bool = False
    diverged: bool = False
    tol: float = float("nan")
    evaluations: int = 0
    residuals: list[float] = field(default_factory=list)
    stepsize: float | None = None
    extras: dict[str, Any] = field(default_factory=dict)


def check_maxiter(maxiter: Any, name: str = "maxiter") -> int:
    if isinstance(maxiter, bool) or not isinstance(maxiter, numbers.Integral) or maxiter < 1:
        raise HypergradValueError(f"{name} must be an integer >= 1, got {maxiter!r}")
    return int(maxiter)


def check_tol(tol: Any) -> float:
    if isinstance(tol, bool) or not isinstance(tol, numbers.Real):
        raise HypergradTypeError(f"tol must be a real number, got {tol!r}")
    t = float(tol)
    if not (0.0 <= t < math.inf):
        raise HypergradValueError(f"tol must be finite and >= 0, got {tol!r}")
    return t


def check_positive(value: Any, name: str, high: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise HypergradTypeError(f"{name} must be a real number, got {value!r}")
    v = float(value)
    if not (0.0 < v <= high) or math.isinf(v):
        bound = f"in (0, {high}]" if math.isfinite(high) else "finite and > 0"
        raise HypergradValueError(f"{name} must be {bound}, got {value!r}")
    return v


def detach_tree(tree: Any) -> Any:
    """``tree`` with every tensor detached (non-tensor leaves such as numbers kept)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach()
    if isinstance(tree, tuple):
        return tuple(detach_tree(t) for t in tree)
    if isinstance(tree, list):
        return [detach_tree(t) for t in tree]
    if isinstance(tree, dict):
        return {k: detach_tree(v) for k, v in tree.items()}
    return tree


class Flat:
    """The 1-D view of a pytree like ``x0``: ``vec(x)`` and ``tree(v)``."""

    def __init__(self, x0: PyTree) -> None:
        leaves, spec = tree_flatten(x0, "x0")
        if not leaves:
            raise HypergradValueError("x0 has no tensor")
        for i, leaf in enumerate(leaves):
            if not leaf.is_floating_point():
                raise HypergradTypeError(
                    f"x0 leaf {i} must be a floating-point tensor, got {leaf.dtype}"
                )
        self.like = tuple(leaf.detach() for leaf in leaves)
        self.spec: TreeSpec = spec
        self.dtype = leaves[0].dtype
        for leaf in leaves[1:]:
            self.dtype = torch.promote_types(self.dtype, leaf.dtype)
        self.x0 = tree_ravel(self.like, self.dtype)
        if not bool(torch.isfinite(self.x0).all()):
            raise HypergradValueError("x0 has NaN or Inf entries")

    def tree(self, v: torch.Tensor) -> PyTree:
        return tree_unflatten(self.spec, tree_unravel(v, self.like))

    def vec(self, tree: PyTree, what: str) -> torch.Tensor:
        """The flat vector of ``tree`` (checked against ``x0``'s structure); it may share memory
        with ``tree``, so the solvers never write into it."""
        leaves, spec = tree_flatten(tree, what)
        if spec != self.spec:
            raise HypergradValueError(
                f"{what} must return a pytree with the structure of x0 {self.spec!r}, got {spec!r}"
            )
        for a, b in zip(leaves, self.like):
            if a.shape != b.shape:
                raise HypergradValueError(
                    f"{what} must return leaves shaped like x0's: {tuple(a.shape)} vs "
                    f"{tuple(b.shape)}"
                )
        if len(leaves) == 1:  # a view where possible: no copy of a large single tensor
            return leaves[0].detach().reshape(-1).to(self.dtype)
        return tree_ravel(tuple(t.detach() for t in leaves), self.dtype)


def norm(v: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(v))


def ratio(num: float, den: float) -> float:
    """``num / den``, 0 when both are 0 (an exact start), inf for ``num > 0 = den``."""
    if den > 0.0:
        return num / den
    return 0.0 if num == 0.0 else math.inf


class Smooth:
    """Value and gradient of ``loss(x, hparams)`` over the flat vector, counted."""

    def __init__(self, loss: Callable[[PyTree, PyTree], torch.Tensor], flat: Flat, hp: Any):
        self.loss, self.flat, self.hp = loss, flat, hp
        self.evaluations = 0

    def value(self, v: torch.Tensor) -> torch.Tensor:
        self.evaluations += 1
        return self._scalar(self.loss(self.flat.tree(v), self.hp))

    def value_and_grad(self, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.evaluations += 1
        with torch.enable_grad():
            vv = v.detach().requires_grad_(True)
            val = self._scalar(self.loss(self.flat.tree(vv), self.hp))
            if val.requires_grad:
                (g,) = torch.autograd.grad(val, vv, allow_unused=True)
            else:
                g = None
        if g is None:
            g = torch.zeros_like(v)
        return val.detach(), g.detach()

    @staticmethod
    def _scalar(val: Any) -> torch.Tensor:
        if not isinstance(val, torch.Tensor) or val.numel() != 1:
            shape = tuple(val.shape) if isinstance(val, torch.Tensor) else type(val).__name__
            raise HypergradValueError(f"the loss must return a scalar tensor, got {shape}")
        return val.reshape(())


def origin_gradient(
    value_and_grad: Callable[[torch.Tensor], tuple[torch.Tensor | None, torch.Tensor]],
    x0: torch.Tensor,
    g0: torch.Tensor,
) -> torch.Tensor | None:
    """``∇f(0)`` (``g0`` when ``x0`` is the origin), or None where the loss or its gradient is
    not finite there, or cannot be evaluated there (``x0`` has been evaluated already, so an
    error at the origin is a property of the origin, not of the loss). ``value_and_grad(x)``
    gives ``(f(x), ∇f(x))``; a value of None (a gradient given without the loss) is not
    checked."""
    if not bool(x0.any()):
        return g0
    try:
        f, g = value_and_grad(torch.zeros_like(x0))
    except Exception:  # noqa: BLE001 (e.g. a Cholesky factorisation that fails at 0)
        return None
    return g if (f is None or finite(f)) and finite(g) else None


def finite(*ts: torch.Tensor) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in ts)
