"""What the smooth inner solvers (:class:`~hypergrad.inner.Newton`,
:class:`~hypergrad.inner.LBFGS`) share: the reference point and the model residual, the dense
Hessian, the damped Newton step (also used by :func:`~hypergrad.compile_outer_step`), the Armijo
line search and the step off a saddle point."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .. import conditions
from ..errors import HypergradValueError
from ..implicit import custom_root
from ..tree import PyTree
from ._common import (
    Flat,
    InnerInfo,
    Progress,
    Smooth,
    detach_tree,
    explain_dtypes,
    finite,
    model_gradient,
    norm,
    origin_gradient,
    ratio,
)
from .base import InnerSolver

Loss = Callable[[PyTree, PyTree], torch.Tensor]

_C1 = 1e-4  # Armijo's sufficient decrease


def first_point(fn: Smooth, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float, str]:
    """``f(x0)``, ``∇f(x0)``, and the reference norm with the point it was taken at:
    ``||∇f(0)||`` (``"origin"``), or ``||∇f(x0)||`` (``"x0"``) where the gradient at the origin
    is zero or not finite."""
    f, g = fn.value_and_grad(x)
    if not finite(f, g):
        raise HypergradValueError("the loss or its gradient is not finite at x0")
    g_origin = origin_gradient(fn.value_and_grad, x, g)
    if g_origin is not None:
        ref = norm(g_origin)
        if ref > 0.0 or g_origin is g:
            return f, g, ref, "origin"
    return f, g, norm(g), "x0"


class LineSearchStop(Exception):
    """A line search that ends the solve: ``reason`` (:data:`REASONS`) and a sentence."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def model_residual(
    fn: Smooth, x: torch.Tensor, g: torch.Tensor, gn: float, p: torch.Tensor
) -> float | None:
    """``||∇f(x)|| / ||∇m(p)||`` with ``m`` the quadratic model of ``f`` at ``x`` and ``p`` the
    reference point (None where the model's gradient could not be evaluated)."""
    if gn == 0.0:
        return 0.0
    m = model_gradient(lambda v: fn.value_and_grad(v)[1], x, g, p)
    return None if m is None else ratio(gn, norm(m))


def negative_curvature(H: torch.Tensor) -> tuple[torch.Tensor, float] | None:
    """The eigenvector of the smallest eigenvalue of ``H`` and that eigenvalue, where it is below
    ``−√eps`` times the largest magnitude (a saddle point or maximum); None otherwise."""
    H = 0.5 * (H + H.T)
    if int(torch.linalg.cholesky_ex(H)[1]) == 0:
        return None
    w, V = torch.linalg.eigh(H)
    scale = float(w.abs().max())
    if not (scale > 0.0 and float(w[0]) < -math.sqrt(torch.finfo(H.dtype).eps) * scale):
        return None
    return V[:, 0], float(w[0])


def escape(
    fn: Smooth,
    x: torch.Tensor,
    f: torch.Tensor,
    g: torch.Tensor,
    v: torch.Tensor,
    lam: float,
    max_backtracks: int,
) -> tuple[float, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """A step from a stationary point along the eigenvector ``v`` of the negative eigenvalue
    ``lam``: ``x + t v`` with ``t`` halved from ``max(||x||, 1)`` until
    ``f(x + t v) <= f(x) + ½ 1e-4 t² lam`` (the decrease the curvature promises); None when no
    ``t`` passes."""
    if float(torch.dot(g, v)) > 0:
        v = -v
    t = max(norm(x), 1.0)
    f0 = float(f)
    for _ in range(max_backtracks + 1):
        x_try = x + t * v
        f_try = fn.value(x_try)
        if finite(f_try) and float(f_try) <= f0 + 0.5 * _C1 * t * t * lam:
            f_new, g_new = fn.value_and_grad(x_try)
            return (t, x_try, f_new, g_new) if finite(f_new, g_new) else None
        t *= 0.5
    return None


def damped_direction(H: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, float]:
    """``−(H + μ I)⁻¹ g`` by :func:`damped_cholesky`'s ``"levenberg_marquardt"`` rule, and
    that ``μ``."""
    factor = damped_cholesky(0.5 * (H + H.T), "levenberg_marquardt")
    return -cholesky_solve(factor.chol, g), float(factor.mu)


# The damped Newton step, shared by Newton and hg.compile_outer_step: the factor of a
# symmetric Hessian under a named rule for one that is not positive definite, the solve with
# it, and the descent test.

#: The rules of :func:`damped_cholesky` for a Hessian that is not positive definite:
#:
#: * ``"levenberg_marquardt"`` (:class:`~hypergrad.inner.Newton`): ``H + μ I`` with the
#:   smallest ``μ`` on the grid ``0, 1e-8 max|H_ii|, ×10, …`` whose Cholesky factorisation
#:   succeeds (as many factorisations as grid points tried, each read on the host: eager code);
#: * ``"gershgorin"`` (:func:`~hypergrad.compile_outer_step`): ``H + s I`` with
#:   ``s = max_i (Σ_{j≠i} |H_ij| − H_ii)₊ + 1e-8 max|H_ii|``, positive definite by Gershgorin's
#:   theorem: always two factorisations and no branch (traceable into one graph), but a shift
#:   at least as large as the Levenberg-Marquardt one, so a longer step is damped more.
#:
#: Both take the plain Newton step where ``H`` is positive definite, so they differ only away
#: from a strict local minimum.
DAMPING_RULES = ("levenberg_marquardt", "gershgorin")

#: Armijo's sufficient-decrease constant of the Newton line searches
#: (:class:`~hypergrad.inner.Newton`'s and :func:`~hypergrad.compile_outer_step`'s)
ARMIJO = _C1


class DampedFactor(NamedTuple):
    """The Cholesky factor ``chol`` of ``H + mu I`` (``mu`` a float64 0-d tensor, 0 where
    ``positive_definite``, a 0-d bool tensor: the factor is that of ``H`` itself)."""

    chol: torch.Tensor
    mu: torch.Tensor
    positive_definite: torch.Tensor


def damped_cholesky(H: torch.Tensor, rule: str) -> DampedFactor:
    """The Cholesky factor of the symmetric ``H`` (symmetrise first: ``(H + Hᵀ) / 2``), or of
    ``H + μ I`` where ``H`` is not positive definite, ``μ`` chosen by ``rule``
    (:data:`DAMPING_RULES`).

    Raises:
        HypergradValueError: an unknown ``rule``.
    """
    if rule == "gershgorin":
        return _gershgorin(H)
    if rule == "levenberg_marquardt":
        return _levenberg_marquardt(H)
    raise HypergradValueError(f"rule must be one of {DAMPING_RULES}, got {rule!r}")


def _gershgorin(H: torch.Tensor) -> DampedFactor:
    # both factorisations run (no branch in a graph); on the few hundred unknowns of a compiled
    # step they cost little next to the Hessian
    chol0, err0 = torch.linalg.cholesky_ex(H)
    diag = H.diagonal()
    radius = H.abs().sum(1) - diag.abs()
    scale = diag.abs().max().clamp_min(torch.finfo(H.dtype).tiny)
    shift = (radius - diag).max().clamp_min(0) + 1e-8 * scale
    eye = torch.eye(H.shape[0], dtype=H.dtype, device=H.device)
    chol1, _ = torch.linalg.cholesky_ex(H + shift * eye)
    pd = err0 == 0
    mu = torch.where(pd, torch.zeros_like(shift), shift).double()
    return DampedFactor(torch.where(pd, chol0, chol1), mu, pd)


def _levenberg_marquardt(H: torch.Tensor) -> DampedFactor:
    eye = torch.eye(H.shape[0], dtype=H.dtype, device=H.device)
    mu = 0.0
    scale = max(float(H.diagonal().abs().max()), 1e-300)
    while True:
        L, err = torch.linalg.cholesky_ex(H + mu * eye)
        if int(err) == 0:
            break
        mu = 1e-8 * scale if mu == 0.0 else mu * 10.0
    return DampedFactor(L, torch.tensor(mu, dtype=torch.float64), torch.tensor(mu == 0.0))


def cholesky_solve(chol: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(L Lᵀ)⁻¹ b`` for a vector ``b``, by two triangular solves (``torch.cholesky_solve``
    gives the same numbers but checks its inputs with a host sync, measured at a quarter of a
    compiled step's time on 31 unknowns)."""
    y = torch.linalg.solve_triangular(chol, b.unsqueeze(1), upper=False)
    x: torch.Tensor = torch.linalg.solve_triangular(chol.mT, y, upper=True)
    return x.squeeze(1)


def descent(g: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d, gᵀd)``, or ``(−g, −gᵀg)`` where ``d`` is not a descent direction (``gᵀd`` not
    negative: rounding only, the factors being positive definite), as tensors (no branch)."""
    slope = g @ d
    bad = ~(slope < 0)
    return torch.where(bad, -g, d), torch.where(bad, -(g @ g), slope)


def armijo(
    fn: Smooth,
    x: torch.Tensor,
    f: torch.Tensor,
    g: torch.Tensor,
    d: torch.Tensor,
    slope: float,
    max_backtracks: int,
) -> tuple[float, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step ``x + a d`` with ``a`` halved from 1 until Armijo's condition holds, with its
    value and gradient; :class:`LineSearchStop` (``"line_search"``) when none does, or
    (``"diverged"``) when the gradient there is not finite.

    Near a minimiser the decrease Armijo asks for falls below the rounding of ``f`` itself
    (``|f(x + d) − f(x)| <= 4 eps |f|``) and the test passes or fails by chance; there the full
    step is taken when it lowers the gradient norm instead (so a tight ``tol`` is reachable
    and the iteration does not creep along with halved steps)."""
    a = 1.0
    f0 = float(f)
    noise = 4.0 * torch.finfo(x.dtype).eps * abs(f0)
    for _ in range(max_backtracks + 1):
        x_try = x + a * d
        f_try = fn.value(x_try)
        if finite(f_try) and float(f_try) <= f0 + _C1 * a * slope:
            break
        if a == 1.0 and finite(f_try) and abs(float(f_try) - f0) <= noise:
            f_new, g_new = fn.value_and_grad(x_try)
            if finite(f_new, g_new) and norm(g_new) < norm(g):
                return a, x_try, f_new, g_new
        a *= 0.5
    else:
        raise LineSearchStop(
            "line_search", f"no step passed the line search ({max_backtracks} halvings)"
        )
    f_new, g_new = fn.value_and_grad(x_try)
    if not finite(f_new, g_new):
        raise LineSearchStop("diverged", "non-finite gradient")
    return a, x_try, f_new, g_new


def hessian(flat_loss: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The dense Hessian of ``flat_loss`` at the flat vector ``x`` (detached, ``x``'s dtype).

    One batched double-backward pass over the ``n`` unit vectors (``is_grads_batched``), about
    3x faster than ``jacrev(grad(f))`` on small problems (1.9 vs 6.2 ms for 31 unknowns and
    285 rows of logistic regression, one CPU thread); ``torch.func.jacrev`` is the fallback for
    ops without a batching rule.
    """
    n = x.numel()
    with torch.enable_grad():
        v = x.detach().requires_grad_(True)
        val = flat_loss(v)
        if not val.requires_grad:
            return torch.zeros(n, n, dtype=x.dtype, device=x.device)
        (g,) = torch.autograd.grad(val, v, create_graph=True, allow_unused=True)
        if g is None or not g.requires_grad:  # linear in x
            return torch.zeros(n, n, dtype=x.dtype, device=x.device)
        eye = torch.eye(n, dtype=x.dtype, device=x.device)
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("error", message=".*performance drop.*")
                (H,) = torch.autograd.grad(g, v, eye, is_grads_batched=True, allow_unused=True)
        except (RuntimeError, UserWarning):
            H = torch.func.jacrev(torch.func.grad(flat_loss))(x)
    if H is None:
        return torch.zeros(n, n, dtype=x.dtype, device=x.device)
    return H.detach()


class SmoothIteration:
    """What one Newton or L-BFGS solve starts from and measures at every iterate: the iterate,
    its loss and gradient, the residual's reference and its point (``first_point``), the
    progress window and the report. Subclasses add their own state and ``loop``/``report``."""

    #: iterations of the progress window (the stall test)
    window: int

    def __init__(self, s: Any, flat: Flat, fn: Smooth, solver: str) -> None:
        self.s, self.flat, self.fn = s, flat, fn
        self.info = InnerInfo(solver=solver, tol=s.tol)
        self.x = flat.x0
        self.f, self.g, self.ref, self.point = first_point(fn, self.x)
        self.p = torch.zeros_like(self.x) if self.point == "origin" else self.x
        self.progress = Progress(self.window, self.x.dtype)
        self.k = 0
        self.a = 1.0
        self.model_res: float | None = None

    def measure(self) -> tuple[float, float]:
        """``(||∇f(x)||, residual)`` at the current iterate, recorded in the report and the
        progress window (the model residual is measured afresh where needed)."""
        gn = norm(self.g)
        res = ratio(gn, self.ref)
        self.info.residuals.append(res)
        self.progress.update(res, float(self.f))
        self.model_res = None
        return gn, res

    def loop(self) -> tuple[str, str | None]:
        raise NotImplementedError

    def report(self, reason: str, detail: str | None) -> None:
        raise NotImplementedError


class SmoothSolver(InnerSolver):
    """What :class:`~hypergrad.inner.Newton` and :class:`~hypergrad.inner.LBFGS` share:
    ``argmin_x loss(x, hparams)``, whose ``run`` differentiates ``x`` through
    :func:`~hypergrad.custom_root` of ``∇_x loss = 0``
    (:func:`hypergrad.conditions.stationary`), and whose :meth:`solve` runs the subclass's
    iteration (:meth:`_iteration`) without autograd."""

    loss: Any
    solver: Any

    def _adjoint_solver(self) -> Any:
        """The linear solver of the implicit derivative (None: the decorator's default)."""
        return self.solver

    def __post_init__(self) -> None:
        super().__post_init__()
        condition = conditions.stationary(self.loss)
        self._decorated = custom_root(condition, solver=self._adjoint_solver())(self._recorded)

    def _differentiable(self) -> Callable[[PyTree, PyTree], PyTree]:
        return self._decorated  # type: ignore[no-any-return]

    def _iteration(self, flat: Flat, fn: Smooth) -> SmoothIteration:
        raise NotImplementedError

    def solve(self, x0: PyTree, hparams: PyTree = None) -> tuple[PyTree, InnerInfo]:
        """The minimiser from ``x0`` without autograd: ``(x, info)``, the last iterate and its
        :class:`~hypergrad.inner.InnerInfo` (see the class for the extras)."""
        flat = Flat(x0)
        fn = Smooth(self.loss, flat, detach_tree(hparams))
        with torch.no_grad(), explain_dtypes(x0, hparams=hparams):
            it = self._iteration(flat, fn)
            reason, detail = it.loop()
            it.report(reason, detail)
        return flat.tree(it.x), it.info
