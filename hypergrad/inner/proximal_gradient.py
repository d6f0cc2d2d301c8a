"""Proximal gradient descent (ISTA) and its accelerated form (FISTA) for composite problems
``min_x f(x, hparams_smooth) + g(x, hparams_prox)`` with ``prox_g`` given: the class
:class:`ProximalGradient`."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import Any

import torch

from .. import conditions
from ..errors import HypergradTypeError, HypergradValueError
from ..implicit import custom_fixed_point
from ..settings import count, flag, setting
from ..tree import PyTree, tree_flatten
from ._common import (
    GROWTH,
    Flat,
    InnerInfo,
    Progress,
    Smooth,
    detach_tree,
    explain_dtypes,
    finish,
    finite,
    model_gradient,
    norm,
    origin_gradient,
    ratio,
)
from .base import InnerSolver, function, real, run_setting

Prox = Callable[..., PyTree]
STALL_WINDOW = 10  # steps within rounding of x without a better residual: "stalled"
SmoothGrad = Callable[[PyTree, PyTree], PyTree]


def check_smooth_grad(name: str, smooth_grad: Any) -> Any:
    """``smooth_grad`` is None or a callable (``HypergradTypeError`` otherwise)."""
    if smooth_grad is not None and not callable(smooth_grad):
        raise HypergradTypeError(
            f"{name} must be None or a callable (x, hparams_smooth) -> gradient like x, "
            f"got {type(smooth_grad).__name__}"
        )
    return smooth_grad


class _Oracle:
    """``f`` and ``∇f`` on the flat vector: ``(f, ∇f)`` by autograd of ``smooth_loss``, or the
    user's ``smooth_grad`` with ``f`` (no autograd) only where ``values`` (the line search)."""

    def __init__(self, fn: Smooth, flat: Flat, grad: SmoothGrad | None, values: bool) -> None:
        self.fn, self.flat, self.grad, self.values = fn, flat, grad, values
        self.grad_calls = 0
        like = flat.like
        # a single tensor: hand the user a view of the flat vector, take theirs back as a view
        self.single = flat.spec.kind == "leaf"
        self.shape = like[0].shape
        self.flat_1d = self.single and like[0].dim() == 1  # the flat vector is x itself

    def tree(self, v: torch.Tensor) -> PyTree:
        if self.flat_1d:
            return v
        return v.reshape(self.shape) if self.single else self.flat.tree(v)

    def vec(self, out: PyTree, what: str) -> torch.Tensor:
        if self.single and isinstance(out, torch.Tensor) and out.shape == self.shape:
            v = out.detach().reshape(-1)
            return v if v.dtype == self.flat.dtype else v.to(self.flat.dtype)
        return self.flat.vec(out, what)  # checks the structure and shapes, or raises

    def grad_vec(self, out: PyTree) -> torch.Tensor:
        """The user's gradient as a flat vector: like ``x0`` in structure, shapes and dtype."""
        if (
            self.single
            and isinstance(out, torch.Tensor)
            and out.shape == self.shape
            and out.dtype == self.flat.dtype
        ):
            return out.detach().reshape(-1)
        leaves, _ = tree_flatten(out, "the result of smooth_grad")  # tensors only, or raises
        for leaf in leaves:
            if leaf.dtype != self.flat.dtype:
                raise HypergradTypeError(
                    f"smooth_grad must return tensors of x0's dtype {self.flat.dtype}, got "
                    f"{leaf.dtype} (a gradient in another precision caps the solution's)"
                )
        return self.flat.vec(out, "smooth_grad")  # the structure and shapes of x0, or raises

    def __call__(self, v: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        if self.grad is None:
            return self.fn.value_and_grad(v)
        self.grad_calls += 1
        g = self.grad_vec(self.grad(self.tree(v), self.fn.hp))
        return (self.fn.value(v) if self.values else None), g


def _all_finite(g: torch.Tensor) -> bool:
    """``g`` has no NaN/Inf: one reduction (a finite sum proves it), the elementwise test only
    where the sum is not finite (possibly an overflow of finite entries)."""
    return math.isfinite(float(g.sum())) or finite(g)


@dataclass(eq=False)
class ProximalGradient(InnerSolver):
    """``argmin_x f(x, hparams_smooth) + g(x, hparams_prox)`` by (F)ISTA, differentiable in
    both hyperparameter parts.

    ``solve(x0, (hparams_smooth, hparams_prox))`` runs the iteration without autograd and
    returns ``(x, info)``; ``run(x0, (hparams_smooth, hparams_prox))`` returns ``x`` through
    :func:`~hypergrad.custom_fixed_point` of the proximal-gradient map
    ``T(x) = prox(x − s ∇f(x), hparams_prox, s)``
    (:func:`hypergrad.conditions.proximal_gradient`) with ``s`` the step size the solve ended
    with: the fixed points of ``T`` are the minimisers for every ``s``, so the derivative does
    not depend on it. A part without hyperparameters is written ``()`` (or None) and reaches its
    function as None (the convention of :mod:`hypergrad.conditions`), in ``solve`` as in
    ``run``. :meth:`solve_parts` (``solve_parts(x0, hparams_smooth, hparams_prox)``) is the same
    iteration with the two parts passed apart and **as they are**: a ``()`` reaches the user's
    function as ``()``, for a function that needs that value. The derivative's ``T`` carries a
    ``kinks`` attribute (the operator's kinks at the run's step, ``info.extras["kinks"]``).

    Each step is ``x⁺ = prox(y − s ∇f(y), hparams_prox, s)`` from ``y = x`` (ISTA,
    ``accelerated=False``) or from the extrapolated point of Beck and Teboulle (2009, FISTA)
    ``y = x_k + (t_{k−1} − 1)/t_k · (x_k − x_{k−1})``; with ``restart`` the momentum is reset
    whenever ``(y − x⁺)ᵀ(x⁺ − x_k) > 0`` (the gradient restart of O'Donoghue and Candès 2015),
    which keeps the linear rate of strongly convex problems. ``prox`` has the signature of
    :mod:`hypergrad.prox`'s operators, ``prox(x, hparams, scaling)``, where the scaling is the
    step size.

    Step size: a fixed ``stepsize`` (at most ``1/L`` for an ``L``-smooth ``f``), or ``None``:
    a backtracking line search (Beck and Teboulle's) from ``init_stepsize``, halving ``s``
    until ``f(x⁺) <= f(y) + ∇f(y)ᵀ(x⁺ − y) + ||x⁺ − y||² / (2s)``; the accepted ``s`` is kept for
    the next steps.

    Gradient: ``∇f`` by autograd of ``smooth_loss`` (one forward and one backward pass per
    step), or, with ``smooth_grad``, the user's closed form ``smooth_grad(x, hparams_smooth)``
    (jaxopt's ``value_and_grad=True`` in spirit): the iterations then never call autograd, and
    with a fixed ``stepsize`` they never evaluate ``f`` either (the line search evaluates it,
    without autograd). ``smooth_grad`` must return a pytree like ``x`` (structure, shapes and
    dtype, else ``HypergradValueError`` / ``HypergradTypeError``), and it is **checked once per
    solve at the returned point** against autograd of ``smooth_loss``: a gradient that differs
    by more than ``√eps`` of the gradients' scale (``max(||∇f(x)||, ||∇f(p)||)``, ``p`` the
    reference point below) raises ``HypergradValueError`` rather than returning the minimiser of
    another function.

    Residual: the norm of the gradient mapping ``G_s(x) = (x − prox(x − s∇f(x), s)) / s`` (zero
    exactly at the minimisers), relative to its value at the origin with the same step size:
    ``||G_s(x)|| / ||G_s(0)||``. It is a function of ``x`` (and ``s``) alone, so a warm start
    from a solution that met ``tol`` stops after 0 iterations; it does not change when ``f`` and
    ``g`` are multiplied by a constant and ``s`` divided by it. Where ``G_s(0) = 0`` (the origin
    is a minimiser) or ``f`` cannot be evaluated at the origin, ``||G_s(x0)||`` is the
    reference instead (``extras["reference_point"]``). The iteration's cheap estimate
    ``||x⁺ − y|| / s`` (the mapping at ``y``) only triggers a check: the reported residual is
    recomputed at the returned point (one gradient and one prox), so ``converged`` is never an
    estimate. The start is checked first: ``x0`` is returned after 0 steps when its residual
    (exact, from the first step) meets ``tol``.

    Convergence: ``residual <= tol`` **and** ``extras["model_residual"] <= tol``: ``||G_s(x)||``
    relative to the gradient mapping at the reference point ``p`` of the problem whose smooth
    part is the quadratic model of ``f`` at ``x``, ``||p − prox(p − s ∇m(p), s)|| / s`` with
    ``∇m(p) = ∇f(x) + ∇²f(x)(p − x)`` (the Hessian product from a central difference of two
    gradients, by autograd or ``smooth_grad``; measured only where ``residual <= tol``). For a
    quadratic ``f`` the two agree; otherwise the model's is local, so an ``f`` that is steep
    at the origin cannot certify a point far from the minimiser. Where the gradient cannot be
    evaluated near ``x`` the model check is skipped (``model_residual`` None).

    Why it stopped is ``info.reason`` (:class:`~hypergrad.inner.InnerInfo`), warned about
    unless ``"converged"``: ``"maxiter"``; ``"stalled"`` (10 proximal steps within
    ``16 eps ||y||`` without a 1% better residual: ``tol`` is below the rounding of the
    iteration); ``"line_search"`` (``max_backtracks`` halvings did not pass);
    ``"diverged"`` (a non-finite iterate, loss or gradient, the last finite iterate returned;
    or, at ``maxiter``, a residual grown by more than ``1e10`` over the first step's, as with
    a ``stepsize`` above ``2/L``).

    The report of ``solve`` (``(x, info)``, the last iterate and its
    :class:`~hypergrad.inner.InnerInfo`): ``info.stepsize`` is the ``s`` of the reported
    residual; ``info.evaluations`` counts the calls of ``smooth_loss`` and ``smooth_grad``;
    ``extras["reference"]`` (``||G_s(0)||`` at that ``s``), ``extras["reference_point"]``,
    ``extras["backtracks"]``, ``extras["restarts"]``, ``extras["smooth_grad_calls"]`` and,
    with ``smooth_grad``, ``extras["smooth_grad_error"]``, the relative difference found by
    the check.

    Args:
        smooth_loss: ``f(x, hparams_smooth) -> scalar tensor``, differentiable in ``x``.
        prox: ``prox(x, hparams_prox, scaling) -> pytree like x``.
        stepsize: a fixed step size, or ``None`` for the line search.
        maxiter: at most this many proximal steps (>= 1).
        tol: tolerance on the relative residual (>= 0); roughly a relative error of ``x``
            (for the lasso with its support settled, ``G_s`` is ``A(x − x*)`` there while
            ``G_s(0)`` is the soft-thresholded ``−∇f(0)``, about ``A x*``).
        accelerated: FISTA (True) or ISTA (False).
        restart: FISTA's adaptive momentum restart.
        init_stepsize: the line search's first trial step.
        max_backtracks: halvings allowed in one line search before giving up
            (``"line_search"``).
        smooth_grad: None (autograd), or ``smooth_grad(x, hparams_smooth) -> ∇_x f``, a
            pytree like ``x`` (called without autograd, with ``hparams_smooth`` detached).

        solver: the linear solver of the implicit derivative (``run`` only; default
            ``hg.GMRES()``). With ``smooth_grad``, the implicit derivative still
            differentiates ``T`` through ``smooth_loss`` by autograd.

    Attributes:
        last_info: the :class:`~hypergrad.inner.InnerInfo` of the last ``run``.

    Example (lasso; the derivative of the solution in λ):
        >>> import torch, hypergrad as hg
        >>> X = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
        >>> y = torch.tensor([3.0, 4.0], dtype=torch.float64)
        >>> f = lambda w, _: 0.5 * ((X @ w - y) ** 2).sum()
        >>> lasso = hg.inner.ProximalGradient(f, hg.prox.prox_lasso, tol=1e-12)
        >>> lam = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
        >>> w = lasso.run(torch.zeros(2, dtype=torch.float64), ((), lam))
        >>> w.sum().backward()  # w = (y_i x_ii − λ) / x_ii²: dw/dλ = −1 − 1/4
        >>> w.detach(), round(float(lam.grad), 10)
        (tensor([2.0000, 1.7500], dtype=torch.float64), -1.25)

    Example (the plain iteration, ``solve``, without autograd; with a closed-form gradient):
        >>> import torch, hypergrad as hg
        >>> X = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
        >>> y = torch.tensor([3.0, 0.5], dtype=torch.float64)
        >>> f = lambda w, _: 0.5 * ((X @ w - y) ** 2).sum()
        >>> pg = hg.inner.ProximalGradient(f, hg.prox.prox_lasso, tol=1e-10)
        >>> w, info = pg.solve(torch.zeros(2, dtype=torch.float64), (None, 1.0))
        >>> w, info.converged
        (tensor([2., 0.], dtype=torch.float64), True)
        >>> grad = lambda w, _: X.T @ (X @ w - y)  # the same gradient in closed form
        >>> pg = pg.replace(smooth_grad=grad)
        >>> w, info = pg.solve(torch.zeros(2, dtype=torch.float64), (None, 1.0))
        >>> w, info.converged
        (tensor([2., 0.], dtype=torch.float64), True)
    """

    smooth_loss: Callable[[PyTree, PyTree], torch.Tensor] = function()
    prox: Prox = function()
    _: KW_ONLY
    stepsize: float | None = real(None, strict=True, allow_none=True)
    maxiter: int = count(500, minimum=1, allow_none=False)
    tol: float = real(1e-6)
    accelerated: bool = flag(True)
    restart: bool = flag(True)
    init_stepsize: float = real(1.0, strict=True)
    max_backtracks: int = count(60, minimum=1, allow_none=False)
    smooth_grad: SmoothGrad | None = setting(None, check_smooth_grad)
    solver: Any = run_setting(None)

    def solve(self, x0: PyTree, hparams: PyTree) -> tuple[PyTree, InnerInfo]:
        """The minimiser from ``x0`` without autograd, ``hparams = (hparams_smooth,
        hparams_prox)`` (``()`` for a part without hyperparameters): ``(x, info)``."""
        return self.solve_parts(x0, *_split(hparams))

    def solve_parts(
        self, x0: PyTree, hparams_smooth: PyTree = None, hparams_prox: PyTree = None
    ) -> tuple[PyTree, InnerInfo]:
        """The minimiser from ``x0`` without autograd, the hyperparameters of ``f`` and ``g``
        apart (passed as they are): ``(x, info)``, the last iterate and its
        :class:`~hypergrad.inner.InnerInfo`."""
        flat = Flat(x0)
        hparams = dict(hparams_smooth=hparams_smooth, hparams_prox=hparams_prox)
        it = _Iteration(self, flat, detach_tree(hparams_smooth), detach_tree(hparams_prox))
        with torch.no_grad(), explain_dtypes(x0, **hparams):
            it.start()
            x, reason, detail = it.loop()
            it.conclude(x, reason, detail)
        return flat.tree(x), it.info

    def run(self, x0: PyTree, hparams: PyTree) -> PyTree:
        """The minimiser from ``x0``, differentiable in ``hparams = (hparams_smooth,
        hparams_prox)``."""
        _split(hparams)
        return super().run(x0, hparams)

    def _differentiable(self) -> Callable[[PyTree, PyTree], PyTree]:
        step = [self.stepsize or 1.0]  # this run's step size, set by the solve

        def T(params: PyTree, h: PyTree) -> PyTree:
            return conditions.proximal_gradient(self.smooth_loss, self.prox, step[0])(params, h)

        def kinks(params: PyTree, h: PyTree, rtol: float) -> int | None:
            # the operator's kinks at this run's step (info.extras["kinks"] of the derivative)
            T_s = conditions.proximal_gradient(self.smooth_loss, self.prox, step[0])
            return T_s.kinks(params, h, rtol)  # type: ignore[attr-defined, no-any-return]

        T.kinks = kinks  # type: ignore[attr-defined]

        def solve(hparams: PyTree, x0: PyTree) -> PyTree:
            x = self._recorded(hparams, x0)
            assert self.last_info is not None and self.last_info.stepsize is not None
            step[0] = self.last_info.stepsize
            return x

        self._decorated = custom_fixed_point(T, solver=self.solver)(solve)
        return self._decorated  # type: ignore[no-any-return]


def _split(hparams: PyTree) -> tuple[PyTree, PyTree]:
    if not isinstance(hparams, (tuple, list)) or len(hparams) != 2:
        raise HypergradTypeError(
            "hparams must be a pair (hparams_smooth, hparams_prox); write () for a part "
            f"without hyperparameters. Got {type(hparams).__name__}"
        )
    return tuple(  # type: ignore[return-value]
        None if isinstance(h, (tuple, list)) and len(h) == 0 else h for h in hparams
    )


class _Iteration:
    """One solve's state: the oracle, the prox, the reference, the step size, the momentum."""

    def __init__(self, s: ProximalGradient, flat: Flat, hp_smooth: PyTree, hp_prox: PyTree):
        self.s, self.flat, self.hp_prox = s, flat, hp_prox
        self.fixed = s.stepsize is not None
        self.step = s.stepsize if s.stepsize is not None else s.init_stepsize
        self.fn = Smooth(s.smooth_loss, flat, hp_smooth)
        self.oracle = _Oracle(self.fn, flat, s.smooth_grad, values=not self.fixed)
        self.info = InnerInfo(solver="fista" if s.accelerated else "ista", tol=s.tol)
        self.prox_calls = self.backtracks = self.restarts = self.verifications = 0
        self.k = 0
        self.t = 1.0  # FISTA's momentum parameter
        self.residual = math.nan
        self.measured_at_x = False  # self.residual was measured at the current x
        self.model_res: float | None = None
        self.model_here = False  # model_res was measured at the current x
        self.progress = Progress(STALL_WINDOW, flat.dtype)
        self.y_norm = 0.0
        self.cache: dict[float, float] = {}

    def P(self, v: torch.Tensor, step: float) -> torch.Tensor:
        self.prox_calls += 1
        return self.oracle.vec(self.s.prox(self.oracle.tree(v), self.hp_prox, step), "prox")

    def mapping(self, v: torch.Tensor, step: float) -> tuple[float, torch.Tensor]:
        """``||G_s(v)||`` and ``∇f(v)``."""
        _, gv = self.oracle(v)
        return norm(v - self.P(v - step * gv, step)) / step, gv

    def reference(self, step: float) -> float:
        """``||G_s(p)||`` at the reference point ``p`` (cached per step size)."""
        if step not in self.cache:
            self.cache[step] = norm(self.p - self.P(self.p - step * self.gp, step)) / step
        return self.cache[step]

    def start(self) -> None:
        """``f`` and ``∇f`` at ``x0``, and the reference point: the origin, or ``x0`` where
        the origin cannot serve."""
        x = self.flat.x0
        self.fy, self.gy = self.oracle(x)
        if not _finite_at(self.fy, self.gy):
            raise HypergradValueError("the smooth loss or its gradient is not finite at x0")
        g_origin = origin_gradient(self.oracle, x, self.gy)
        self.point, self.p = "origin", torch.zeros_like(x)
        self.gp = self.gy if g_origin is None else g_origin
        try:
            usable = g_origin is not None and (
                math.isfinite(self.reference(self.step))
                and (self.reference(self.step) > 0.0 or g_origin is self.gy)
            )
        except Exception:  # noqa: BLE001 (a prox that cannot be evaluated at the origin)
            usable = False
        if not usable:
            self.point, self.p, self.gp = "x0", x, self.gy
            self.cache.clear()

    def model_passes(self, v: torch.Tensor, gv: torch.Tensor, mapping_v: float) -> bool:
        """Whether ``||G_s(v)||`` is also within ``tol`` of the gradient mapping at ``p`` of the
        quadratic model of ``f`` at ``v`` (``model_res``; skipped where the model's gradient
        cannot be evaluated)."""
        self.model_here = True
        if mapping_v == 0.0:
            self.model_res = 0.0
            return True
        m = model_gradient(lambda u: self.oracle(u)[1], v, gv, self.p)
        if m is None:
            self.model_res = None
            return True
        step = self.step
        self.model_res = ratio(mapping_v, norm(self.p - self.P(self.p - step * m, step)) / step)
        return self.model_res <= self.s.tol

    def prox_step(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One proximal gradient step from ``y``, ``(x⁺, x⁺ − y)``, the step size halved until
        the line search passes (None: ``max_backtracks`` halvings did not)."""
        fy, gy = self.fy, self.gy
        for _ in range(self.s.max_backtracks + 1):
            s = self.step
            z = self.P(y - s * gy, s)
            d = z - y
            if self.fixed:
                return z, d
            assert fy is not None
            fz = self.fn.value(z)
            bound = fy + torch.dot(gy, d) + torch.dot(d, d) / (2 * s)
            if finite(fz) and float(fz) <= float(bound) + 1e-12 * abs(float(fy)):
                return z, d
            self.step *= 0.5
            self.backtracks += 1
        return None

    def verify(self, x: torch.Tensor) -> bool:
        """The residual measured at the new iterate ``x``; whether it converged there."""
        self.verifications += 1
        g_norm, gx = self.mapping(x, self.step)
        self.residual = ratio(g_norm, self.reference(self.step))
        self.info.residuals.append(self.residual)
        if self.residual <= self.s.tol:
            self.measured_at_x = True
            return self.model_passes(x, gx, g_norm)
        return False

    def stalled(self, y: torch.Tensor, norm_d: float, estimate: float) -> bool:
        # the step is compared with ||y|| (a norm and a sync): measured only where it may be
        # within rounding of the last measured ||y||, and every 16 steps to keep that fresh
        if self.k % 16 == 1 or norm_d <= 32.0 * self.progress.eps * self.y_norm:
            self.y_norm = norm(y)
        self.progress.update(estimate, step=norm_d, size=self.y_norm)
        return self.progress.stalled()

    def momentum(self, x: torch.Tensor, x_prev: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        """The next point to step from: FISTA's extrapolation (with the gradient restart), or
        ``x`` (ISTA)."""
        if not self.s.accelerated:
            return x
        step = x - x_prev
        # (y − x⁺)ᵀ(x⁺ − x_k) > 0, with y − x⁺ = −d exactly
        if self.s.restart and float(torch.dot(d, step)) < 0:
            self.t = 1.0
            self.restarts += 1
        t, t_next = self.t, (1.0 + math.sqrt(1.0 + 4.0 * self.t * self.t)) / 2.0
        self.t = t_next
        return x + ((t - 1.0) / t_next) * step if t != 1.0 else x

    def loop(self) -> tuple[torch.Tensor, str, str | None]:
        """Proximal steps until a stop: the returned iterate, the reason ("" at maxiter) and
        the sentence on it."""
        x = y = self.flat.x0
        while self.k < self.s.maxiter:
            step = self.prox_step(y)
            if step is None:
                halvings = self.s.max_backtracks
                return (
                    x,
                    "line_search",
                    f"no step size passed the line search ({halvings} halvings)",
                )
            z, d = step
            # ||d|| is finite exactly when z is (y is finite), but for an overflow of the norm
            norm_d = norm(d)
            if not math.isfinite(norm_d) and not finite(z):
                return x, "diverged", "non-finite iterate; the last finite one returned"
            estimate = ratio(norm_d / self.step, self.reference(self.step))
            self.info.residuals.append(estimate)
            if self.k == 0 and estimate <= self.s.tol:  # y = x0: G_s(x0) exactly, a warm start
                self.residual, self.measured_at_x = estimate, True
                if self.model_passes(x, self.gy, norm_d / self.step):
                    return x, "converged", None
            self.k += 1
            x_prev, x = x, z
            self.measured_at_x = self.model_here = False
            if estimate <= self.s.tol and self.verify(x):  # verify at the new iterate
                return x, "converged", None
            if self.stalled(y, norm_d, estimate):
                detail = f"{STALL_WINDOW} proximal steps within rounding of x without a 1% better"
                return x, "stalled", detail + " residual"
            y = self.momentum(x, x_prev, d)
            self.fy, self.gy = self.oracle(y)
            if not _finite_at(self.fy, self.gy):
                return x, "diverged", "non-finite loss or gradient"
        return x, "", None

    def conclude(self, x: torch.Tensor, reason: str, detail: str | None) -> None:
        """The residual at the returned point (where the loop has not measured it), the
        reason at ``maxiter``, the check of ``smooth_grad``, the report."""
        tol, s, info = self.s.tol, self.step, self.info
        if not self.measured_at_x:
            g_norm, gx = self.mapping(x, s)
            self.residual = ratio(g_norm, self.reference(s))
            info.residuals.append(self.residual)
            # a stall detected on the estimates may still have left x within tol
            if (
                reason in ("", "stalled")
                and self.residual <= tol
                and self.model_passes(x, gx, g_norm)
            ):
                reason, detail = "converged", None
        if not reason:
            reason = "maxiter"
            if self.residual > GROWTH * info.residuals[0]:  # not a slow convergence: a run-away
                reason = "diverged"
                detail = f"the residual grew by more than {GROWTH:.0e} over the first step's"
        if self.s.smooth_grad is not None:
            diverged = reason == "diverged"
            info.extras["smooth_grad_error"] = _check_gradient(self.oracle, x, self.gp, diverged)
        info.iterations, info.residual, info.stepsize = self.k, self.residual, s
        info.evaluations = self.fn.evaluations + self.oracle.grad_calls
        info.extras.update(
            reference=self.reference(s),
            reference_point=self.point,
            model_residual=self.model_res if self.model_here else None,
            backtracks=self.backtracks,
            restarts=self.restarts,
            verifications=self.verifications,
            prox_calls=self.prox_calls,
            smooth_grad_calls=self.oracle.grad_calls,
        )
        finish(info, reason, detail)


def _finite_at(f: torch.Tensor | None, g: torch.Tensor) -> bool:
    return (f is None or math.isfinite(float(f))) and _all_finite(g)


def _check_gradient(oracle: _Oracle, x: torch.Tensor, g_ref: torch.Tensor, diverged: bool) -> float:
    """The user's ``smooth_grad`` at ``x`` against autograd of ``smooth_loss`` there: the
    relative difference, or ``HypergradValueError`` beyond ``√eps`` of the gradients' scale
    (NaN, not an error, where a solve that diverged left both not finite)."""
    _, g_user = oracle(x)
    _, g_auto = oracle.fn.value_and_grad(x)
    diff = norm(g_user - g_auto)
    scale = max(norm(g_auto), norm(g_user), norm(g_ref))
    err = ratio(diff, scale)
    bound = math.sqrt(torch.finfo(x.dtype).eps)
    if diverged and not (finite(g_user) or finite(g_auto)):
        return math.nan
    if not err <= bound:
        raise HypergradValueError(
            f"smooth_grad does not match the gradient of smooth_loss at the returned point: "
            f"||smooth_grad − autograd|| = {diff:.3g}, {err:.3g} of the gradients' scale "
            f"{scale:.3g} (allowed {bound:.1g}). Check the closed form (a missing term or "
            f"factor, e.g. the 1/n of a mean) or pass smooth_grad=None"
        )
    return err
