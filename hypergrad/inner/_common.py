"""What the inner solvers share: :class:`InnerInfo`, the stop reasons, and the flat-vector view of a
pytree (the solvers iterate on one 1-D tensor and hand the user's functions the pytree)."""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import (
    HypergradTypeError,
    HypergradValueError,
    SolverDivergedWarning,
    SolverStalledWarning,
    warn,
)
from ..report_base import IterationReport
from ..tree import PyTree, TreeSpec, tree_flatten, tree_ravel, tree_unflatten, tree_unravel

#: Why a solve stopped: the values of :attr:`InnerInfo.reason`.
REASONS = ("converged", "maxiter", "stalled", "diverged", "line_search", "saddle")

#: A residual that grows by this factor over its first value is divergence (``"diverged"``).
GROWTH = 1e10


@dataclass
class InnerInfo(IterationReport):
    """Diagnostics of one inner solve.

    The report states only what was measured: ``residual`` is computed at the returned point
    (never an estimate from the iteration), ``converged`` is true only when the checks below
    passed there, and ``reason`` says why the solve stopped. Every stop other than
    ``"converged"`` is warned about (see ``reason``).

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
        converged: ``reason == "converged"``: ``residual <= tol`` at the returned point and,
            for the proximal-gradient and smooth solvers, ``extras["model_residual"] <= tol``
            there too (the same norm relative to the gradient, or gradient mapping, that the
            quadratic model of ``f`` at ``x`` predicts at the reference point: a steep loss at
            the origin cannot certify a point far from the minimiser), and for Newton no
            negative curvature at the returned point.
        diverged: ``reason == "diverged"``: a non-finite value appeared (the last finite
            iterate is returned), or (fixed points, proximal gradient) ``maxiter`` ran out
            with the residual grown by more than :data:`GROWTH` over its first value.
        reason: why the solve stopped, one of :data:`REASONS`: ``"converged"``;
            ``"maxiter"`` (the budget ran out before ``tol`` was met); ``"stalled"`` (no
            progress: the iterate stopped changing at the precision of its dtype, or, for
            Newton and L-BFGS, neither the best residual halved nor the loss fell by more than
            its rounding over the last 5 (Newton) / 10 (L-BFGS) iterations; for fixed points
            and proximal gradient, 10 iterations whose steps were all within ``16 eps ||x||``
            without a 1% better residual); ``"diverged"`` (see ``diverged``);
            ``"line_search"`` (no step passed the line search); ``"saddle"`` (Newton: the
            gradient test passed at a point with negative curvature, a saddle or a maximum,
            and no step along it lowered the loss). Anything but ``"converged"`` emits a
            :class:`~hypergrad.SolverStalledWarning` (``"maxiter"``, ``"stalled"``,
            ``"line_search"``) or :class:`~hypergrad.SolverDivergedWarning` (``"diverged"``,
            ``"saddle"``) with a fixed text, so Python's default filter shows it once per
            call site.
        tol: the tolerance the residual was compared with.
        evaluations: calls of the map / loss (with its gradient) / Hessian, see the solver.
        residuals: the residual at each iterate the solver measured it at (for plots); for
            FISTA the cheap estimate at the extrapolated points and each verification.
        stepsize: the last step size (proximal gradient: the one ``G_s`` used; smooth solvers:
            the last line-search step; fixed point: the mixing).
        extras: solver-specific details: always ``"reference"``, the reference norm
            (``||T(x0) − x0||``; ``||G_s(0)||`` at the reported ``s``; ``||∇f(0)||``), with
            ``"reference_point"`` (``"origin"`` or ``"x0"``, the fallback) and
            ``"model_residual"`` (None where it was not measured at the returned point) for
            the proximal gradient and smooth solvers; ``"reason"``, a sentence on the cause
            of a ``"diverged"``, ``"line_search"``, ``"stalled"`` or ``"saddle"`` stop; and
            ``"restarts"``, ``"backtracks"``, ``"damping"``... (see each solver).
    """

    # solver, iterations, residual, converged, diverged, residuals, extras: IterationReport's
    tol: float = float("nan")
    evaluations: int = 0
    stepsize: float | None = None
    reason: str = ""


_ADVICE = {
    "maxiter": (
        "stopped at maxiter without meeting tol (InnerInfo.reason == 'maxiter'); the returned "
        "point is not a solution to tol (its residual is in the returned InnerInfo). Raise "
        "maxiter, loosen tol, or warm-start closer.",
        SolverStalledWarning,
    ),
    "stalled": (
        "the iteration stalled (InnerInfo.reason == 'stalled'): it made no progress over its "
        "last iterations, so tol is below what the precision of x and of the loss allows (or "
        "the map/loss is noisy). Loosen tol to about the reported residual, or solve in "
        "float64.",
        SolverStalledWarning,
    ),
    "diverged": (
        "the iteration diverged (InnerInfo.reason == 'diverged'): a value became NaN/Inf or "
        "the residual grew without bound; the returned point (the last finite iterate) is "
        "not a solution. Check the map or loss, and take smaller steps (a smaller mixing or "
        "stepsize; Anderson or a line search).",
        SolverDivergedWarning,
    ),
    "line_search": (
        "no step passed the line search (InnerInfo.reason == 'line_search'); the returned "
        "point is not a solution to tol. The loss may be non-smooth, noisy or not finite "
        "near it: check it, or loosen tol to about the reported residual.",
        SolverStalledWarning,
    ),
    "saddle": (
        "the gradient vanishes at the returned point but the Hessian there has a negative "
        "eigenvalue (InnerInfo.reason == 'saddle'): a saddle point or a maximum, not a "
        "minimum, and no step along that direction lowered the loss. Start from another x0.",
        SolverDivergedWarning,
    ),
}


def finish(info: InnerInfo, reason: str, detail: str | None = None) -> None:
    """Record why the solve stopped (``reason``, ``converged``, ``diverged``, the sentence
    ``detail`` in ``extras["reason"]``) and warn on anything but convergence.

    The text is fixed per solver and reason (the numbers are in ``info``), so Python's default
    warning filter shows it once per call site; it points at the user's line."""
    assert reason in REASONS, reason
    info.reason = reason
    info.converged = reason == "converged"
    info.diverged = reason == "diverged"
    if detail is not None:
        info.extras["reason"] = detail
    if reason != "converged":
        text, category = _ADVICE[reason]
        warn(f"hg.inner ({info.solver}): {text}", category)


class Progress:
    """Stall detection over a window of ``window`` iterations.

    ``update(res, f, step, size)`` after each iterate: its residual, its loss value (None
    where the solver has none), the norm of the step that reached it and the norm of the
    iterate it left. :meth:`stalled` is true when the window shows no progress:

    * with a loss (Newton, L-BFGS): the best residual did not halve and the best loss did not
      fall by more than ``8 eps |f|`` (its rounding) over the last ``window`` iterates;
    * without (fixed points, proximal gradient): every step of the window was within
      ``16 eps`` of the iterate's norm (the iterate no longer changes beyond rounding) and the
      best residual did not improve by 1%.
    """

    def __init__(self, window: int, dtype: torch.dtype) -> None:
        self.window = window
        self.eps = torch.finfo(dtype).eps
        self.best_res = math.inf
        self.best_f = math.inf
        self.history: list[tuple[float, float]] = []
        self.tiny = 0  # consecutive steps within rounding of the iterate

    def update(
        self, res: float, f: float | None = None, step: float | None = None, size: float = 0.0
    ) -> None:
        if res < self.best_res:
            self.best_res = res
        if f is not None and f < self.best_f:
            self.best_f = f
        self.history.append((self.best_res, self.best_f))
        if step is not None:
            self.tiny = self.tiny + 1 if step <= 16.0 * self.eps * size else 0

    def stalled(self) -> bool:
        if len(self.history) <= self.window:
            return False
        (r0, f0), (r1, f1) = self.history[-1 - self.window], self.history[-1]
        if math.isfinite(f1):  # a loss: the residual halved, or the loss fell beyond rounding
            noise = 8.0 * self.eps * abs(f1)
            return not (r1 <= 0.5 * r0 or f1 < f0 - noise)
        return self.tiny >= self.window and not r1 <= 0.99 * r0


def model_gradient(
    grad: Callable[[torch.Tensor], torch.Tensor | None],
    x: torch.Tensor,
    g: torch.Tensor,
    p: torch.Tensor,
) -> torch.Tensor | None:
    """``∇f(x) + ∇²f(x)(p − x)``: the gradient at ``p`` of the quadratic model of ``f`` at ``x``
    (``g = ∇f(x)``), with the Hessian product from a central difference of the gradient along
    ``p − x`` (two gradients, step ``eps^(1/3) max(||x||, ||p − x||)``); exact for a quadratic
    up to rounding. None where a gradient there is not finite or cannot be evaluated."""
    v = p - x
    nv = norm(v)
    if nv == 0.0:
        return g
    h = torch.finfo(x.dtype).eps ** (1.0 / 3.0) * max(norm(x), nv)
    u = v * (h / nv)
    try:
        g_plus, g_minus = grad(x + u), grad(x - u)
    except Exception:  # noqa: BLE001 (outside the loss's domain: no model check)
        return None
    if g_plus is None or g_minus is None or not finite(g_plus, g_minus):
        return None
    out: torch.Tensor = g + (g_plus - g_minus) * (nv / (2.0 * h))
    return out


_DTYPE_ERROR = re.compile(
    r"dtype|scalar type|can't be cast|(Float|Double|Half|BFloat16).*(Float|Double|Half|BFloat16)"
)


def tensor_leaves(tree: Any, name: str) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a pytree (numbers and None are skipped) with their paths, for messages."""
    if isinstance(tree, torch.Tensor):
        return [(name, tree)]
    out: list[tuple[str, torch.Tensor]] = []
    if isinstance(tree, (tuple, list)):
        for i, t in enumerate(tree):
            out += tensor_leaves(t, f"{name}[{i}]")
    elif isinstance(tree, dict):
        for k, t in tree.items():
            out += tensor_leaves(t, f"{name}[{k!r}]")
    return out


@contextlib.contextmanager
def explain_dtypes(x0: PyTree, **hparams: Any) -> Iterator[None]:
    """Turn torch's dtype errors raised inside the block (a user's function that mixes float32
    and float64) into a :class:`~hypergrad.HypergradTypeError` naming which argument has which
    dtype, as :func:`~hypergrad.implicit_grad` does. Mixed dtypes are not refused up front: a
    function that promotes (``lam * (x**2).sum()``) works."""
    try:
        yield
    except RuntimeError as err:
        if not _DTYPE_ERROR.search(str(err)):
            raise
        leaves = tensor_leaves(x0, "x0")
        for what, tree in hparams.items():
            leaves += tensor_leaves(tree, what)
        first: dict[torch.dtype, str] = {}
        for n, t in leaves:
            if t.is_floating_point():
                first.setdefault(t.dtype, n)
        if len(first) >= 2:
            (da, na), (db, nb) = list(first.items())[:2]
            raise HypergradTypeError(
                f"{na} is {da} but {nb} is {db}, and the solver's function failed on the mix "
                f"({err}). The inner solvers iterate in x0's dtype: give x0 and the "
                f"hyperparameters one dtype (e.g. {nb}.to({da}))"
            ) from err
        dtype = next(iter(first), None)
        raise HypergradTypeError(
            f"the solver's function failed on mixed dtypes ({err}) while x0 and the "
            f"hyperparameters are all {dtype}: a tensor it uses by closure (data, weights) has "
            f"another dtype. Give them one dtype (e.g. data.to({dtype}))"
        ) from err


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
