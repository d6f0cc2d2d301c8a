"""Proximal gradient descent (ISTA) and its accelerated form (FISTA) for composite problems
``min_x f(x, hparams_smooth) + g(x, hparams_prox)`` with ``prox_g`` given."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..errors import HypergradTypeError, HypergradValueError
from ..tree import PyTree, tree_flatten
from ._common import (
    GROWTH,
    Flat,
    InnerInfo,
    Progress,
    Smooth,
    check_maxiter,
    check_positive,
    check_tol,
    detach_tree,
    explain_dtypes,
    finish,
    finite,
    model_gradient,
    norm,
    origin_gradient,
    ratio,
)

Prox = Callable[..., PyTree]
STALL_WINDOW = 10  # steps within rounding of x without a better residual: "stalled"
SmoothGrad = Callable[[PyTree, PyTree], PyTree]


def check_smooth_grad(smooth_grad: object) -> None:
    """``smooth_grad`` is None or a callable (``HypergradTypeError`` otherwise)."""
    if smooth_grad is not None and not callable(smooth_grad):
        raise HypergradTypeError(
            f"smooth_grad must be None or a callable (x, hparams_smooth) -> gradient like x, "
            f"got {type(smooth_grad).__name__}"
        )


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


def fista(
    smooth_loss: Callable[[PyTree, PyTree], torch.Tensor],
    prox: Prox,
    x0: PyTree,
    hparams_smooth: PyTree = None,
    hparams_prox: PyTree = None,
    *,
    stepsize: float | None = None,
    maxiter: int = 500,
    tol: float = 1e-6,
    accelerated: bool = True,
    restart: bool = True,
    init_stepsize: float = 1.0,
    max_backtracks: int = 60,
    smooth_grad: SmoothGrad | None = None,
) -> tuple[PyTree, InnerInfo]:
    """Minimise ``f(x, hparams_smooth) + g(x, hparams_prox)`` by proximal gradient steps.

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

    Args:
        smooth_loss: ``f(x, hparams_smooth) -> scalar tensor``, differentiable in ``x``.
        prox: ``prox(x, hparams_prox, scaling) -> pytree like x``.
        x0: the starting point, a tensor or a pytree of floating-point tensors.
        hparams_smooth: second argument of ``smooth_loss`` (detached here).
        hparams_prox: second argument of ``prox`` (detached here).
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

    Returns:
        ``(x, info)``: the last iterate and its :class:`InnerInfo` (``info.stepsize`` is the
        ``s`` of the reported residual; ``info.evaluations`` counts the calls of
        ``smooth_loss`` and ``smooth_grad``; ``extras["reference"]`` (``||G_s(0)||`` at that
        ``s``), ``extras["reference_point"]``, ``extras["backtracks"]``,
        ``extras["restarts"]``, ``extras["smooth_grad_calls"]`` and, with ``smooth_grad``,
        ``extras["smooth_grad_error"]``, the relative difference found by the check).

    Example:
        >>> import torch, hypergrad as hg
        >>> X = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
        >>> y = torch.tensor([3.0, 0.5], dtype=torch.float64)
        >>> f = lambda w, _: 0.5 * ((X @ w - y) ** 2).sum()
        >>> w, info = hg.inner.fista(f, hg.prox.prox_lasso, torch.zeros(2, dtype=torch.float64),
        ...                          None, 1.0, tol=1e-10)
        >>> w, info.converged
        (tensor([2., 0.], dtype=torch.float64), True)
        >>> grad = lambda w, _: X.T @ (X @ w - y)  # the same gradient in closed form
        >>> w, info = hg.inner.fista(f, hg.prox.prox_lasso, torch.zeros(2, dtype=torch.float64),
        ...                          None, 1.0, tol=1e-10, smooth_grad=grad)
        >>> w, info.converged
        (tensor([2., 0.], dtype=torch.float64), True)
    """
    maxiter = check_maxiter(maxiter)
    tol = check_tol(tol)
    check_smooth_grad(smooth_grad)
    fixed = stepsize is not None
    s = check_positive(
        stepsize if fixed else init_stepsize, "stepsize" if fixed else "init_stepsize"
    )
    max_backtracks = check_maxiter(max_backtracks, "max_backtracks")
    flat = Flat(x0)
    fn = Smooth(smooth_loss, flat, detach_tree(hparams_smooth))
    oracle = _Oracle(fn, flat, smooth_grad, values=not fixed)
    hp_prox = detach_tree(hparams_prox)
    prox_calls = 0

    def P(v: torch.Tensor, step: float) -> torch.Tensor:
        nonlocal prox_calls
        prox_calls += 1
        return oracle.vec(prox(oracle.tree(v), hp_prox, step), "prox")

    def mapping(v: torch.Tensor, step: float) -> tuple[float, torch.Tensor]:
        """``||G_s(v)||`` and ``∇f(v)``."""
        _, gv = oracle(v)
        return norm(v - P(v - step * gv, step)) / step, gv

    def finite_at(f: torch.Tensor | None, g: torch.Tensor) -> bool:
        return (f is None or math.isfinite(float(f))) and _all_finite(g)

    info = InnerInfo(solver="fista" if accelerated else "ista", tol=tol)
    backtracks = restarts = verifications = 0
    hparams = dict(hparams_smooth=hparams_smooth, hparams_prox=hparams_prox)
    with torch.no_grad(), explain_dtypes(x0, **hparams):
        x = flat.x0
        fy, gy = oracle(x)
        if not finite_at(fy, gy):
            raise HypergradValueError("the smooth loss or its gradient is not finite at x0")
        # the reference ||G_s(p)||: p the origin, or x0 where the origin cannot serve
        g_origin = origin_gradient(oracle, x, gy)
        point, p, gp = "origin", torch.zeros_like(x), gy if g_origin is None else g_origin
        cache: dict[float, float] = {}

        def reference(step: float) -> float:
            if step not in cache:
                cache[step] = norm(p - P(p - step * gp, step)) / step
            return cache[step]

        try:
            usable = g_origin is not None and (
                math.isfinite(reference(s)) and (reference(s) > 0.0 or g_origin is gy)
            )
        except Exception:  # noqa: BLE001 (a prox that cannot be evaluated at the origin)
            usable = False
        if not usable:
            point, p, gp = "x0", x, gy
            cache.clear()

        model_res: float | None = None
        model_here = False  # model_res was measured at the current x

        def model_passes(v: torch.Tensor, gv: torch.Tensor, mapping_v: float, step: float) -> bool:
            """Whether ``||G_s(v)||`` is also within ``tol`` of the gradient mapping at ``p`` of
            the quadratic model of ``f`` at ``v`` (``model_res``; skipped where the model's
            gradient cannot be evaluated)."""
            nonlocal model_res, model_here
            model_here = True
            if mapping_v == 0.0:
                model_res = 0.0
                return True
            m = model_gradient(lambda u: oracle(u)[1], v, gv, p)
            if m is None:
                model_res = None
                return True
            model_res = ratio(mapping_v, norm(p - P(p - step * m, step)) / step)
            return model_res <= tol

        y, t = x, 1.0
        k = 0
        residual = math.nan
        measured_at_x = False
        progress = Progress(STALL_WINDOW, x.dtype)
        y_norm = 0.0
        reason, detail = "", None
        while k < maxiter:
            # one proximal gradient step from y, with backtracking
            for _ in range(max_backtracks + 1):
                z = P(y - s * gy, s)
                d = z - y
                if fixed:
                    break
                assert fy is not None
                fz = fn.value(z)
                bound = fy + torch.dot(gy, d) + torch.dot(d, d) / (2 * s)
                if finite(fz) and float(fz) <= float(bound) + 1e-12 * abs(float(fy)):
                    break
                s *= 0.5
                backtracks += 1
            else:
                reason = "line_search"
                detail = f"no step size passed the line search ({max_backtracks} halvings)"
                break
            # ||d|| is finite exactly when z is (y is finite), but for an overflow of the norm
            norm_d = norm(d)
            if not math.isfinite(norm_d) and not finite(z):
                reason, detail = "diverged", "non-finite iterate; the last finite one returned"
                break
            estimate = ratio(norm_d / s, reference(s))
            info.residuals.append(estimate)
            if k == 0 and estimate <= tol:  # y = x0: this is G_s(x0) exactly, a warm start
                residual, measured_at_x = estimate, True
                if model_passes(x, gy, norm_d / s, s):
                    reason = "converged"
                    break
            k += 1
            x_prev, x = x, z
            measured_at_x = model_here = False
            if estimate <= tol:  # verify at the new iterate
                verifications += 1
                g_norm, gx = mapping(x, s)
                residual = ratio(g_norm, reference(s))
                info.residuals.append(residual)
                if residual <= tol:
                    measured_at_x = True
                    if model_passes(x, gx, g_norm, s):
                        reason = "converged"
                        break
            # the step is compared with ||y|| (a norm and a sync): measured only where it may be
            # within rounding of the last measured ||y||, and every 16 steps to keep that fresh
            if k % 16 == 1 or norm_d <= 32.0 * progress.eps * y_norm:
                y_norm = norm(y)
            progress.update(estimate, step=norm_d, size=y_norm)
            if progress.stalled():
                reason = "stalled"
                detail = (
                    f"{STALL_WINDOW} proximal steps within rounding of x without a 1% better "
                    "residual"
                )
                break
            if accelerated:
                step = x - x_prev
                # (y − x⁺)ᵀ(x⁺ − x_k) > 0, with y − x⁺ = −d exactly
                if restart and float(torch.dot(d, step)) < 0:
                    t = 1.0
                    restarts += 1
                t_next = (1.0 + math.sqrt(1.0 + 4.0 * t * t)) / 2.0
                y = x + ((t - 1.0) / t_next) * step if t != 1.0 else x
                t = t_next
            else:
                y = x
            fy, gy = oracle(y)
            if not finite_at(fy, gy):
                reason, detail = "diverged", "non-finite loss or gradient"
                break
        if not measured_at_x:
            g_norm, gx = mapping(x, s)
            residual = ratio(g_norm, reference(s))
            info.residuals.append(residual)
            # a stall detected on the estimates may still have left x within tol
            if reason in ("", "stalled") and residual <= tol and model_passes(x, gx, g_norm, s):
                reason, detail = "converged", None
        if not reason:
            reason = "maxiter"
            if residual > GROWTH * info.residuals[0]:  # not a slow convergence: a run-away
                reason = "diverged"
                detail = f"the residual grew by more than {GROWTH:.0e} over the first step's"
        if smooth_grad is not None:
            info.extras["smooth_grad_error"] = _check_gradient(oracle, x, gp, reason == "diverged")
        info.iterations = k
        info.residual = residual
        info.stepsize = s
        info.evaluations = fn.evaluations + oracle.grad_calls
        info.extras.update(
            reference=reference(s),
            reference_point=point,
            model_residual=model_res if model_here else None,
            backtracks=backtracks,
            restarts=restarts,
            verifications=verifications,
            prox_calls=prox_calls,
            smooth_grad_calls=oracle.grad_calls,
        )
        finish(info, reason, detail)
    return flat.tree(x), info


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
