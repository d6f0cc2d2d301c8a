"""Smooth unconstrained minimisation of ``loss(x, hparams)``: damped Newton with a dense Hessian
(small problems) and L-BFGS."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch

from ..errors import HypergradTypeError, HypergradValueError
from ..solvers.precond import DensePreconditioner
from ..tree import PyTree
from ._common import (
    Flat,
    InnerInfo,
    Progress,
    Smooth,
    check_maxiter,
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

Loss = Callable[[PyTree, PyTree], torch.Tensor]

_C1 = 1e-4  # Armijo's sufficient decrease
_C2 = 0.9  # the curvature condition of the (weak) Wolfe line search
NEWTON_WINDOW = 5  # Newton iterations without progress: "stalled"
LBFGS_WINDOW = 10  # L-BFGS iterations without progress: "stalled"


def _start(
    loss: Loss, x0: PyTree, hparams: PyTree, maxiter: int, tol: float, name: str
) -> tuple[Flat, Smooth, int, float]:
    maxiter = check_maxiter(maxiter)
    tol = check_tol(tol)
    flat = Flat(x0)
    return flat, Smooth(loss, flat, detach_tree(hparams)), maxiter, tol


def _first(fn: Smooth, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float, str]:
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


def newton(
    loss: Loss,
    x0: PyTree,
    hparams: PyTree = None,
    *,
    maxiter: int = 50,
    tol: float = 1e-8,
    max_backtracks: int = 50,
    factor: DensePreconditioner | None = None,
) -> tuple[PyTree, InnerInfo]:
    """Minimise ``loss(x, hparams)`` by Newton's method with a dense Hessian and a line search.

    Each step solves ``(H + μ I) d = −∇f`` with the dense Hessian ``H`` of the flattened
    problem, ``torch.func.jacrev(torch.func.grad(loss))`` (``n²`` entries: for small problems).
    ``μ = 0`` when ``H`` is positive definite (a Cholesky factorisation succeeds); otherwise
    ``μ`` grows from ``1e-8 · max|H_ii|`` by factors of 10 until it is (Levenberg-Marquardt
    damping). The step length halves from 1 until Armijo's condition
    ``f(x + a d) <= f(x) + 1e-4 · a ∇fᵀd`` holds.

    With ``factor`` (a :class:`~hypergrad.DensePreconditioner` kept across calls, e.g. across
    the outer steps of a bilevel loop) each Hessian's factor is kept in it, and a call's first
    step reuses the factor left by the previous call (built at that call's last iterate, where
    a warm start begins) instead of computing a Hessian, while the factor is within its budget
    (``rebuild_after`` applications since its build: the preconditioner's rent-or-buy rule);
    every later step computes a fresh Hessian. A factor of a Hessian that is not positive
    definite is eigenvalue-clipped (as the preconditioner does), so every step is a descent
    direction. The same instance then preconditions the CG solve of the implicit derivative,
    which with the factor of the last Hessian converges in a few products
    (:class:`~hypergrad.inner.Newton` with ``reuse_hessian=True`` does both). Measured on a
    31-unknown logistic regression over 100 warm-started outer steps, this was faster than
    lagging the factor over several steps (rebuilding only when progress slowed): a Hessian
    there costs about 6 gradients, and Newton's quadratic convergence saves more.

    Residual: ``||∇f(x)|| / ||∇f(0)||``, the gradient relative to the gradient at the origin,
    measured at every iterate including the returned one. It is a function of ``x`` alone, so
    a warm start from a solution that met ``tol`` stops after 0 iterations; it is 0 exactly at
    a stationary point and does not change when the loss is multiplied by a constant. Where
    ``∇f(0)`` is zero or not finite, ``||∇f(x0)||`` is the reference instead
    (``extras["reference_point"]`` says which, ``p`` below).

    Convergence: ``residual <= tol`` **and** ``extras["model_residual"] <= tol``, where the
    model residual is ``||∇f(x)|| / ||∇f(x) + ∇²f(x)(p − x)||``, the gradient relative to the
    gradient at ``p`` of the quadratic model of ``f`` at ``x`` (the Hessian product from a
    central difference of two gradients, measured only where ``residual <= tol``). For a
    quadratic loss both are ``||H(x − x*)|| / ||H x*||``; for another loss the model's is the
    local relative error, so a loss that is steep at the origin (a large ``||∇f(0)||``) cannot
    certify a point far from the minimiser. Where the gradient cannot be evaluated near ``x``
    the model check is skipped (``model_residual`` None).

    Curvature: a point that passes both tests without having been reached by a step from a
    positive definite Hessian (the start, or a damped step) is checked: its Hessian is
    computed (``extras["hessians"]`` counts it) and, where it has an eigenvalue below
    ``−√eps`` times its largest magnitude (a saddle point or a maximum, where the gradient
    also vanishes), the solve steps along that eigenvector (``t`` halved from
    ``max(||x||, 1)`` until ``f`` falls by ``½ 1e-4 t² |λ|``; ``extras["escapes"]`` counts
    these steps) and goes on; where no such step lowers ``f`` it stops with reason
    ``"saddle"``. A stationary start that is also the reference point is replaced, after the
    escape, by the point the escape reached (``reference_point`` ``"escape"``).

    Why it stopped is ``info.reason`` (:class:`~hypergrad.inner.InnerInfo`), warned about
    unless ``"converged"``: ``"maxiter"``; ``"stalled"`` (a step left ``x`` unchanged at the
    precision of its dtype, or 5 iterations in which the residual did not halve and ``f`` did
    not fall by more than its rounding); ``"line_search"``; ``"diverged"`` (a non-finite
    Hessian or gradient); ``"saddle"``.

    Args:
        loss: ``(x, hparams) -> scalar tensor``, twice differentiable in ``x`` and written
            with ops ``torch.func`` can transform.
        x0: the starting point, a tensor or a pytree of floating-point tensors.
        hparams: second argument of ``loss`` (detached here).
        maxiter: at most this many Newton steps (>= 1).
        tol: tolerance on the relative gradient norm (>= 0): for a quadratic loss with Hessian
            ``H`` and minimiser ``x*`` it is ``||H(x − x*)|| / ||H x*||``, a relative error of
            ``x``.
        max_backtracks: step halvings allowed before the solve stops (``"line_search"``).
        factor: a kept Hessian factor (see above; None: a fresh Hessian every step).

    Returns:
        ``(x, info)``: the last iterate and its :class:`InnerInfo` (``evaluations`` counts
        loss-and-gradient evaluations; ``extras["hessians"]``: Hessians computed,
        ``extras["damping"]``: the last ``μ``; ``extras["escapes"]``: steps off a saddle
        point or maximum (see above); with ``factor``, ``extras["factor_steps"]``:
        steps taken with the previous call's factor, 0 or 1; a Hessian computed at the
        returned point for the curvature check is adopted by ``factor``).

    Example:
        >>> import torch, hypergrad as hg
        >>> f = lambda x, a: ((x - a) ** 4).sum() + (x**2).sum()
        >>> x, info = hg.inner.newton(f, torch.zeros(3, dtype=torch.float64), 1.0, tol=1e-12)
        >>> info.converged, round(float(x[0]), 8)
        (True, 0.41024549)
    """
    flat, fn, maxiter, tol = _start(loss, x0, hparams, maxiter, tol, "newton")
    max_backtracks = check_maxiter(max_backtracks, "max_backtracks")

    def flat_loss(v: torch.Tensor) -> torch.Tensor:
        return fn._scalar(fn.loss(flat.tree(v), fn.hp))

    if factor is not None and not isinstance(factor, DensePreconditioner):
        raise HypergradTypeError(
            f"factor must be a hg.DensePreconditioner, got {type(factor).__name__}"
        )
    info = InnerInfo(solver="newton", tol=tol)
    counts = dict(hessians=0, factor_steps=0, damping=0.0, escapes=0)

    def factor_is_cholesky() -> bool:
        # whether the kept factor is a Cholesky factor (a positive definite Hessian) rather
        # than an eigenvalue-clipped one (DensePreconditioner has no public name for this)
        return bool(getattr(factor, "_cholesky", False))

    def direction(x: torch.Tensor, g: torch.Tensor, k: int) -> tuple[torch.Tensor, bool] | None:
        """The Newton direction at ``x``, and whether the Hessian it used is positive definite
        (None for a non-finite Hessian)."""
        if factor is not None and k == 0 and not factor.stale((x,)):
            counts["factor_steps"] += 1  # the previous call's factor takes the first step
            return -factor.apply((g,))[0].to(g.dtype), factor_is_cholesky()
        H = hessian(flat_loss, x)
        counts["hessians"] += 1
        if not finite(H):
            return None
        if factor is not None:  # kept (eigenvalue-clipped where indefinite) for later calls
            factor.adopt(H, (x,))
            return -factor.apply((g,))[0].to(g.dtype), factor_is_cholesky()
        d, counts["damping"] = _damped_direction(H, g)
        return d, counts["damping"] == 0.0

    with torch.no_grad(), explain_dtypes(x0, hparams=hparams):
        x = flat.x0
        f, g, ref, point = _first(fn, x)
        p = torch.zeros_like(x) if point == "origin" else x
        progress = Progress(NEWTON_WINDOW, x.dtype)
        k = 0
        a = 1.0
        positive = False  # the last step came from a positive definite Hessian
        frozen = False
        model_res: float | None = None
        reason, detail = "", None
        while True:
            gn = norm(g)
            res = ratio(gn, ref)
            info.residuals.append(res)
            progress.update(res, float(f))
            model_res = None
            if res <= tol:
                model_res = _model_residual(fn, x, g, gn, p)
                if model_res is None or model_res <= tol:
                    if k > 0 and positive:
                        reason = "converged"
                        break
                    # reached without a positive definite Hessian (or the start): the curvature
                    # at x decides between a minimum and a saddle point or maximum
                    H = hessian(flat_loss, x)
                    counts["hessians"] += 1
                    if factor is not None and finite(H):
                        factor.adopt(H, (x,))
                    negative = _negative_curvature(H)
                    if negative is None:
                        reason = "converged"
                        break
                    escaped = None
                    if k < maxiter:
                        escaped = _escape(fn, x, f, g, *negative, max_backtracks)
                    if escaped is None:
                        reason = "saddle"
                        detail = (
                            f"stationary point with a Hessian eigenvalue {negative[1]:.3g} < 0; "
                            "no step along its eigenvector lowered the loss"
                        )
                        break
                    a, x, f, g = escaped
                    k += 1
                    positive = False
                    counts["escapes"] += 1
                    if ref == 0.0:  # the reference point was that stationary point
                        ref, point, p = norm(g), "escape", x
                    continue
            if k == maxiter:
                reason = "maxiter"
                break
            if frozen or progress.stalled():
                reason = "stalled"
                detail = (
                    "a step left x unchanged at the precision of its dtype"
                    if frozen
                    else f"no progress over {NEWTON_WINDOW} iterations (the residual did not "
                    "halve and the loss did not fall beyond its rounding)"
                )
                break
            dp = direction(x, g, k)
            if dp is None:
                reason, detail = "diverged", "non-finite Hessian"
                break
            d, positive = dp
            d, slope_t = descent(g, d)
            slope = float(slope_t)
            try:
                a, x_new, f, g = _armijo(fn, x, f, g, d, slope, max_backtracks)
            except _Stop as stop:
                reason, detail = stop.reason, stop.detail
                break
            frozen = norm(x_new - x) <= progress.eps * norm(x)
            x = x_new
            k += 1
        info.iterations = k
        info.residual = info.residuals[-1]
        info.evaluations = fn.evaluations
        info.stepsize = a
        if factor is None:
            del counts["factor_steps"]
        info.extras.update(counts, reference=ref, reference_point=point, model_residual=model_res)
        finish(info, reason, detail)
    return flat.tree(x), info


class _Stop(Exception):
    """A line search that ends the solve: ``reason`` (:data:`REASONS`) and a sentence."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def _model_residual(
    fn: Smooth, x: torch.Tensor, g: torch.Tensor, gn: float, p: torch.Tensor
) -> float | None:
    """``||∇f(x)|| / ||∇m(p)||`` with ``m`` the quadratic model of ``f`` at ``x`` and ``p`` the
    reference point (None where the model's gradient could not be evaluated)."""
    if gn == 0.0:
        return 0.0
    m = model_gradient(lambda v: fn.value_and_grad(v)[1], x, g, p)
    return None if m is None else ratio(gn, norm(m))


def _negative_curvature(H: torch.Tensor) -> tuple[torch.Tensor, float] | None:
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


def _escape(
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


def _damped_direction(H: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, float]:
    """``−(H + μ I)⁻¹ g`` by :func:`damped_cholesky`'s ``"levenberg_marquardt"`` rule, and
    that ``μ``."""
    factor = damped_cholesky(0.5 * (H + H.T), "levenberg_marquardt")
    return -cholesky_solve(factor.chol, g), float(factor.mu)


# The damped Newton step, shared by newton() and hg.compile_outer_step: the factor of a
# symmetric Hessian under a named rule for one that is not positive definite, the solve with
# it, and the descent test.

#: The rules of :func:`damped_cholesky` for a Hessian that is not positive definite:
#:
#: * ``"levenberg_marquardt"`` (:func:`newton`): ``H + μ I`` with the smallest ``μ`` on the
#:   grid ``0, 1e-8 max|H_ii|, ×10, …`` whose Cholesky factorisation succeeds (as many
#:   factorisations as grid points tried, each read on the host: eager code);
#: * ``"gershgorin"`` (:func:`~hypergrad.compile_outer_step`): ``H + s I`` with
#:   ``s = max_i (Σ_{j≠i} |H_ij| − H_ii)₊ + 1e-8 max|H_ii|``, positive definite by Gershgorin's
#:   theorem: always two factorisations and no branch (traceable into one graph), but a shift
#:   at least as large as the Levenberg-Marquardt one, so a longer step is damped more.
#:
#: Both take the plain Newton step where ``H`` is positive definite, so they differ only away
#: from a strict local minimum.
DAMPING_RULES = ("levenberg_marquardt", "gershgorin")

#: Armijo's sufficient-decrease constant of the Newton line searches (:func:`newton`'s and
#: :func:`~hypergrad.compile_outer_step`'s)
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


def _armijo(
    fn: Smooth,
    x: torch.Tensor,
    f: torch.Tensor,
    g: torch.Tensor,
    d: torch.Tensor,
    slope: float,
    max_backtracks: int,
) -> tuple[float, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step ``x + a d`` with ``a`` halved from 1 until Armijo's condition holds, with its
    value and gradient; :class:`_Stop` (``"line_search"``) when none does, or (``"diverged"``)
    when the gradient there is not finite.

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
        raise _Stop("line_search", f"no step passed the line search ({max_backtracks} halvings)")
    f_new, g_new = fn.value_and_grad(x_try)
    if not finite(f_new, g_new):
        raise _Stop("diverged", "non-finite gradient")
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


def lbfgs(
    loss: Loss,
    x0: PyTree,
    hparams: PyTree = None,
    *,
    maxiter: int = 500,
    tol: float = 1e-6,
    history: int = 10,
    max_linesearch: int = 40,
) -> tuple[PyTree, InnerInfo]:
    """Minimise ``loss(x, hparams)`` by L-BFGS (Nocedal 1980; the two-loop recursion).

    The direction is ``−H_k ∇f`` with ``H_k`` the limited-memory inverse-Hessian estimate from
    the last ``history`` pairs ``(s, y)`` (steps and gradient changes), scaled by
    ``sᵀy / yᵀy`` of the newest pair; the first direction is ``−∇f / ||∇f||``. The step length
    satisfies the weak Wolfe conditions (sufficient decrease ``1e-4``, curvature ``0.9``),
    found by bracketing and bisection (Lewis and Overton's line search); a pair with
    ``sᵀy <= 1e-10 · ||s|| ||y||`` is not stored, so the estimate stays positive definite.

    Residual: ``||∇f(x)|| / ||∇f(0)||``, the gradient relative to the gradient at the origin,
    measured at every iterate including the returned one. It is a function of ``x`` alone, so
    a warm start from a solution that met ``tol`` stops after 0 iterations; it is 0 exactly at
    a stationary point and does not change when the loss is multiplied by a constant. Where
    ``∇f(0)`` is zero or not finite, ``||∇f(x0)||`` is the reference instead
    (``extras["reference_point"]`` says which, ``p`` below).

    Convergence: ``residual <= tol`` **and** ``extras["model_residual"] <= tol``, where the
    model residual is ``||∇f(x)|| / ||∇f(x) + ∇²f(x)(p − x)||``, the gradient relative to the
    gradient at ``p`` of the quadratic model of ``f`` at ``x`` (the Hessian product from a
    central difference of two gradients, measured only where ``residual <= tol``). For a
    quadratic loss both are ``||H(x − x*)|| / ||H x*||``; for another loss the model's is the
    local relative error, so a loss that is steep at the origin (a large ``||∇f(0)||``) cannot
    certify a point far from the minimiser. Where the gradient cannot be evaluated near ``x``
    the model check is skipped (``model_residual`` None).

    Why it stopped is ``info.reason`` (:class:`~hypergrad.inner.InnerInfo`), warned about
    unless ``"converged"``: ``"maxiter"``; ``"stalled"`` (two steps in a row left ``x``
    unchanged at the precision of its dtype, or 10 iterations in which the residual did not
    halve and ``f`` did not fall by more than its rounding); ``"line_search"`` (no trial step
    lowered the loss). A start at a stationary point is returned as converged (L-BFGS has no
    curvature to tell a minimum from a saddle there: use :func:`newton`).

    Args:
        loss: ``(x, hparams) -> scalar tensor``, differentiable in ``x``.
        x0: the starting point, a tensor or a pytree of floating-point tensors.
        hparams: second argument of ``loss`` (detached here).
        maxiter: at most this many steps (>= 1).
        tol: tolerance on the relative gradient norm (>= 0): for a quadratic loss with Hessian
            ``H`` and minimiser ``x*`` it is ``||H(x − x*)|| / ||H x*||``, a relative error of
            ``x``.
        history: number of stored pairs (>= 1).
        max_linesearch: trial steps allowed in one line search; when none satisfies both
            conditions the best one with sufficient decrease is taken, and when none decreases
            the loss the solve stops (``"line_search"``).

    Returns:
        ``(x, info)``: the last iterate and its :class:`InnerInfo` (``evaluations`` counts
        loss-and-gradient evaluations).

    Example:
        >>> import torch, hypergrad as hg
        >>> A = torch.tensor([[3.0, 1.0], [1.0, 2.0]], dtype=torch.float64)
        >>> f = lambda x, b: 0.5 * x @ A @ x - b @ x
        >>> b = torch.tensor([1.0, 1.0], dtype=torch.float64)
        >>> x, info = hg.inner.lbfgs(f, torch.zeros(2, dtype=torch.float64), b, tol=1e-12)
        >>> x, info.converged
        (tensor([0.2000, 0.4000], dtype=torch.float64), True)
    """
    flat, fn, maxiter, tol = _start(loss, x0, hparams, maxiter, tol, "lbfgs")
    history = check_maxiter(history, "history")
    max_linesearch = check_maxiter(max_linesearch, "max_linesearch")
    info = InnerInfo(solver="lbfgs", tol=tol)
    S: list[torch.Tensor] = []
    Y: list[torch.Tensor] = []
    skipped = 0
    with torch.no_grad(), explain_dtypes(x0, hparams=hparams):
        x = flat.x0
        f, g, ref, point = _first(fn, x)
        p = torch.zeros_like(x) if point == "origin" else x
        progress = Progress(LBFGS_WINDOW, x.dtype)
        frozen = 0  # consecutive steps that left x unchanged
        k = 0
        a = 1.0
        model_res: float | None = None
        reason, detail = "", None
        while True:
            gn = norm(g)
            res = ratio(gn, ref)
            info.residuals.append(res)
            progress.update(res, float(f))
            model_res = None
            if res <= tol:
                model_res = _model_residual(fn, x, g, gn, p)
                if model_res is None or model_res <= tol:
                    reason = "converged"
                    break
            if k == maxiter:
                reason = "maxiter"
                break
            if frozen >= 2 or progress.stalled():
                reason = "stalled"
                detail = (
                    "two steps in a row left x unchanged at the precision of its dtype"
                    if frozen >= 2
                    else f"no progress over {LBFGS_WINDOW} iterations (the residual did not "
                    "halve and the loss did not fall beyond its rounding)"
                )
                break
            d = _two_loop(g, S, Y) if S else -g / gn
            slope = float(torch.dot(g, d))
            if not slope < 0:  # cannot happen in exact arithmetic; reset the memory
                S.clear()
                Y.clear()
                d, slope = -g / gn, -gn
            step = _wolfe(fn, x, f, slope, d, max_linesearch)
            if step is None:
                reason, detail = "line_search", "the line search found no decrease"
                break
            a, x_new, f_new, g_new = step
            s_vec, y_vec = x_new - x, g_new - g
            if norm(s_vec) <= progress.eps * norm(x):
                frozen += 1  # x did not move beyond rounding (no pair to learn from)
            else:
                frozen = 0
                sy = float(torch.dot(s_vec, y_vec))
                if sy > 1e-10 * norm(s_vec) * norm(y_vec):
                    S.append(s_vec)
                    Y.append(y_vec)
                    if len(S) > history:
                        S.pop(0)
                        Y.pop(0)
                else:
                    skipped += 1
            x, f, g = x_new, f_new, g_new
            k += 1
        info.iterations = k
        info.residual = info.residuals[-1]
        info.evaluations = fn.evaluations
        info.stepsize = a
        info.extras.update(
            skipped_pairs=skipped, reference=ref, reference_point=point, model_residual=model_res
        )
        finish(info, reason, detail)
    return flat.tree(x), info


def _two_loop(g: torch.Tensor, S: list[torch.Tensor], Y: list[torch.Tensor]) -> torch.Tensor:
    q = g.clone()
    alphas = []
    rhos = [1.0 / float(torch.dot(y, s)) for s, y in zip(S, Y)]
    for s, y, rho in zip(reversed(S), reversed(Y), reversed(rhos)):
        alpha = rho * float(torch.dot(s, q))
        q -= alpha * y
        alphas.append(alpha)
    gamma = float(torch.dot(S[-1], Y[-1])) / float(torch.dot(Y[-1], Y[-1]))
    r = gamma * q
    for s, y, rho, alpha in zip(S, Y, rhos, reversed(alphas)):
        beta = rho * float(torch.dot(y, r))
        r += (alpha - beta) * s
    return -r


def _wolfe(
    fn: Smooth,
    x: torch.Tensor,
    f: torch.Tensor,
    slope: float,
    d: torch.Tensor,
    max_trials: int,
) -> tuple[float, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """A step ``a`` with ``f(x + a d) <= f + c1 a slope`` and ``∇f(x + a d)ᵀd >= c2 slope``."""
    lo, hi, a = 0.0, math.inf, 1.0
    best: tuple[float, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    f0 = float(f)
    for _ in range(max_trials):
        x_try = x + a * d
        f_try, g_try = fn.value_and_grad(x_try)
        if not finite(f_try, g_try) or float(f_try) > f0 + _C1 * a * slope:
            hi = a
        else:
            if best is None or float(f_try) < float(best[2]):
                best = (a, x_try, f_try, g_try)
            if float(torch.dot(g_try, d)) < _C2 * slope:
                lo = a
            else:
                return a, x_try, f_try, g_try
        a = 0.5 * (lo + hi) if math.isfinite(hi) else 2.0 * a
    return best
