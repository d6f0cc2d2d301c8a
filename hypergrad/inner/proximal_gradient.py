"""Proximal gradient descent (ISTA) and its accelerated form (FISTA) for composite problems
``min_x f(x, hparams_smooth) + g(x, hparams_prox)`` with ``prox_g`` given."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..errors import HypergradValueError
from ..tree import PyTree
from ._common import (
    Flat,
    InnerInfo,
    Smooth,
    check_maxiter,
    check_positive,
    check_tol,
    detach_tree,
    finite,
    norm,
    origin_gradient,
    ratio,
)

Prox = Callable[..., PyTree]


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
        max_backtracks: halvings allowed in one line search before giving up (``diverged``).

    Returns:
        ``(x, info)``: the last iterate and its :class:`InnerInfo` (``info.stepsize`` is the
        ``s`` of the reported residual; ``extras["reference"]`` (``||G_s(0)||`` at that ``s``),
        ``extras["reference_point"]``, ``extras["backtracks"]``, ``extras["restarts"]``).

    Example:
        >>> import torch, hypergrad as hg
        >>> X = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
        >>> y = torch.tensor([3.0, 0.5], dtype=torch.float64)
        >>> f = lambda w, _: 0.5 * ((X @ w - y) ** 2).sum()
        >>> w, info = hg.inner.fista(f, hg.prox.prox_lasso, torch.zeros(2, dtype=torch.float64),
        ...                          None, 1.0, tol=1e-10)
        >>> w, info.converged
        (tensor([2., 0.], dtype=torch.float64), True)
    """
    maxiter = check_maxiter(maxiter)
    tol = check_tol(tol)
    fixed = stepsize is not None
    s = check_positive(
        stepsize if fixed else init_stepsize, "stepsize" if fixed else "init_stepsize"
    )
    max_backtracks = check_maxiter(max_backtracks, "max_backtracks")
    flat = Flat(x0)
    fn = Smooth(smooth_loss, flat, detach_tree(hparams_smooth))
    hp_prox = detach_tree(hparams_prox)
    prox_calls = 0

    def P(v: torch.Tensor, step: float) -> torch.Tensor:
        nonlocal prox_calls
        prox_calls += 1
        return flat.vec(prox(flat.tree(v), hp_prox, step), "prox")

    def mapping_norm(v: torch.Tensor, step: float) -> float:
        _, gv = fn.value_and_grad(v)
        return norm(v - P(v - step * gv, step)) / step

    info = InnerInfo(solver="fista" if accelerated else "ista", tol=tol)
    backtracks = restarts = verifications = 0
    with torch.no_grad():
        x = flat.x0
        fy, gy = fn.value_and_grad(x)
        if not finite(fy, gy):
            raise HypergradValueError("the smooth loss or its gradient is not finite at x0")
        # the reference ||G_s(p)||: p the origin, or x0 where the origin cannot serve
        g_origin = origin_gradient(fn, x, gy)
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
        y, t = x, 1.0
        k = 0
        residual = math.nan
        measured_at_x = False
        while k < maxiter:
            # one proximal gradient step from y, with backtracking
            for _ in range(max_backtracks + 1):
                z = P(y - s * gy, s)
                d = z - y
                if fixed:
                    break
                fz = fn.value(z)
                bound = fy + torch.dot(gy, d) + torch.dot(d, d) / (2 * s)
                if finite(fz) and float(fz) <= float(bound) + 1e-12 * abs(float(fy)):
                    break
                s *= 0.5
                backtracks += 1
            else:
                info.diverged = True
                info.extras["reason"] = (
                    f"no step size passed the line search ({max_backtracks} halvings)"
                )
                break
            if not finite(z):
                info.diverged = True
                info.extras["reason"] = "non-finite iterate; the last finite one returned"
                break
            estimate = ratio(norm(d) / s, reference(s))
            info.residuals.append(estimate)
            if k == 0 and estimate <= tol:  # y = x0: this is G_s(x0) exactly, a warm start
                residual, measured_at_x = estimate, True
                break
            k += 1
            x_prev, x = x, z
            if estimate <= tol:  # verify at the new iterate
                verifications += 1
                residual = ratio(mapping_norm(x, s), reference(s))
                info.residuals.append(residual)
                if residual <= tol:
                    measured_at_x = True
                    break
            if accelerated:
                if restart and float(torch.dot(y - x, x - x_prev)) > 0:
                    t = 1.0
                    restarts += 1
                t_next = (1.0 + math.sqrt(1.0 + 4.0 * t * t)) / 2.0
                y = x + ((t - 1.0) / t_next) * (x - x_prev)
                t = t_next
            else:
                y = x
            fy, gy = fn.value_and_grad(y)
            if not finite(fy, gy):
                info.diverged = True
                info.extras["reason"] = "non-finite loss or gradient"
                break
        if not measured_at_x:
            residual = ratio(mapping_norm(x, s), reference(s))
            info.residuals.append(residual)
        info.iterations = k
        info.residual = residual
        info.converged = residual <= tol and not info.diverged
        info.stepsize = s
        info.evaluations = fn.evaluations
        info.extras.update(
            reference=reference(s),
            reference_point=point,
            backtracks=backtracks,
            restarts=restarts,
            verifications=verifications,
            prox_calls=prox_calls,
        )
    return flat.tree(x), info
