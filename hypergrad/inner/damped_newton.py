"""Damped Newton with a dense Hessian (small problems): the class :class:`Newton`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import Any

import torch

from ..errors import HypergradTypeError
from ..settings import count
from ..solvers import CG
from ..solvers.precond import DensePreconditioner
from ..tree import PyTree
from ._common import (
    Flat,
    Smooth,
    finish,
    finite,
    norm,
)
from .base import function, instance, real, run_setting
from .smooth import (
    LineSearchStop,
    SmoothIteration,
    SmoothSolver,
    armijo,
    damped_direction,
    descent,
    escape,
    hessian,
    model_residual,
    negative_curvature,
)

Loss = Callable[[PyTree, PyTree], torch.Tensor]
Stop = tuple[str, "str | None"]
NEWTON_WINDOW = 5  # Newton iterations without progress: "stalled"
ESCAPED: Stop = ("", None)  # a step off a saddle point: the iteration goes on from there


def check_reuse_hessian(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise HypergradTypeError(f"{name} must be True or False, got {type(value).__name__}")
    return value


@dataclass(eq=False)
class Newton(SmoothSolver):
    """``argmin_x loss(x, hparams)`` by damped Newton (dense Hessian), differentiable in
    ``hparams``.

    :meth:`solve` runs the iteration without autograd (``hparams`` reach the loss detached).
    ``run(x0, hparams)`` returns ``x`` through :func:`~hypergrad.custom_root` of the
    stationarity condition ``∇_x loss = 0`` (:func:`hypergrad.conditions.stationary`; the
    adjoint system is Hessian-symmetric, solved by ``hg.CG()`` unless ``solver`` says
    otherwise).

    With ``reuse_hessian=True`` (for an outer loop that calls ``run`` again and again from the
    previous solution) one :class:`~hypergrad.DensePreconditioner`, ``self.factor``, holds the
    factor of the last Hessian computed: a run's first Newton step reuses the previous run's
    factor (see ``factor`` below) and, unless ``solver`` says otherwise, the implicit
    derivative is solved by ``hg.CG(tol=1e-10, preconditioner=self.factor)``, which with the
    factor of the last Newton step converges in two or three products instead of a dense solve
    or an unpreconditioned CG (``docs/inner.md``, "In an outer loop"). The answer is
    unchanged: both solves still stop on their own measured residuals. ``replace()`` keeps the
    same factor (the state travels with the copy).

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

    The report of ``solve`` (``(x, info)``, the last iterate and its
    :class:`~hypergrad.inner.InnerInfo`): ``evaluations`` counts loss-and-gradient
    evaluations; ``extras["hessians"]``: Hessians computed, ``extras["damping"]``: the last
    ``μ``; ``extras["escapes"]``: steps off a saddle point or maximum (see above); with
    ``factor``, ``extras["factor_steps"]``: steps taken with the previous call's factor, 0 or
    1 (a Hessian computed at the returned point for the curvature check is adopted by
    ``factor``).

    Args:
        loss: ``(x, hparams) -> scalar tensor``, twice differentiable in ``x`` and written
            with ops ``torch.func`` can transform.
        maxiter: at most this many Newton steps (>= 1).
        tol: tolerance on the relative gradient norm (>= 0): for a quadratic loss with Hessian
            ``H`` and minimiser ``x*`` it is ``||H(x − x*)|| / ||H x*||``, a relative error of
            ``x``.
        max_backtracks: step halvings allowed before the solve stops (``"line_search"``).
        factor: a kept Hessian factor (see above; None: a fresh Hessian every step, unless
            ``reuse_hessian`` makes one).
        solver: the linear solver of the implicit derivative (``run`` only).
        reuse_hessian: keep one Hessian factor across steps and runs, for the Newton steps
            and the implicit derivative's CG (see above; ``run`` only).

    Attributes:
        last_info: the :class:`~hypergrad.inner.InnerInfo` of the last ``run``.
        factor: the kept :class:`~hypergrad.DensePreconditioner` (None without
            ``reuse_hessian`` or a ``factor`` given).

    Example (ridge: ``w* = y / (1 + λ)``, ``dw*/dλ = −y / (1 + λ)²``):
        >>> import torch, hypergrad as hg
        >>> y = torch.tensor([1.0, 2.0], dtype=torch.float64)
        >>> ridge = hg.inner.Newton(lambda w, lam: 0.5 * ((w - y) ** 2).sum()
        ...                         + 0.5 * lam * (w**2).sum())
        >>> lam = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
        >>> ridge.run(torch.zeros(2, dtype=torch.float64), lam).sum().backward()
        >>> round(float(lam.grad), 10)
        -0.75

    Example (the plain iteration, ``solve``, without autograd: ``(x, info)``):
        >>> import torch, hypergrad as hg
        >>> f = lambda x, a: ((x - a) ** 4).sum() + (x**2).sum()
        >>> x, info = hg.inner.Newton(f, tol=1e-12).solve(torch.zeros(3, dtype=torch.float64), 1.0)
        >>> info.converged, round(float(x[0]), 8)
        (True, 0.41024549)
    """

    loss: Loss = function()
    _: KW_ONLY
    maxiter: int = count(50, minimum=1, allow_none=False)
    tol: float = real(1e-8)
    max_backtracks: int = count(50, minimum=1, allow_none=False)
    factor: DensePreconditioner | None = instance(
        None, DensePreconditioner, "a hg.DensePreconditioner"
    )
    solver: Any = run_setting(None)
    reuse_hessian: bool = run_setting(False, check_reuse_hessian)

    def check(self) -> None:
        if self.reuse_hessian and self.factor is None:
            self.factor = DensePreconditioner()

    def _adjoint_solver(self) -> Any:
        if self.reuse_hessian and self.solver is None:
            return CG(tol=1e-10, preconditioner=self.factor)
        return self.solver

    def _iteration(self, flat: Flat, fn: Smooth) -> _Iteration:
        return _Iteration(self, flat, fn)


class _Iteration(SmoothIteration):
    """One solve's state: the iterate, its loss and gradient, the reference, the counts."""

    window = NEWTON_WINDOW
    s: Newton

    def __init__(self, s: Newton, flat: Flat, fn: Smooth) -> None:
        super().__init__(s, flat, fn, "newton")
        self.factor = s.factor
        self.counts: dict[str, Any] = dict(hessians=0, factor_steps=0, damping=0.0, escapes=0)
        self.positive = False  # the last step came from a positive definite Hessian
        self.frozen = False

    def flat_loss(self, v: torch.Tensor) -> torch.Tensor:
        return self.fn._scalar(self.fn.loss(self.flat.tree(v), self.fn.hp))

    def loop(self) -> Stop:
        """Newton steps until a stop: why."""
        while True:
            gn, res = self.measure()
            if res <= self.s.tol:
                stop = self.at_stationary(gn)
                if stop == ESCAPED:
                    continue
                if stop is not None:
                    return stop
            if self.k == self.s.maxiter:
                return "maxiter", None
            if self.frozen or self.progress.stalled():
                return "stalled", (
                    "a step left x unchanged at the precision of its dtype"
                    if self.frozen
                    else f"no progress over {NEWTON_WINDOW} iterations (the residual did not "
                    "halve and the loss did not fall beyond its rounding)"
                )
            stop = self.step()
            if stop is not None:
                return stop

    def at_stationary(self, gn: float) -> Stop | None:
        """Where the gradient test passed: the model residual and the curvature decide
        (converged, saddle, :data:`ESCAPED` after a step off a saddle, or None: go on)."""
        x = self.x
        self.model_res = model_residual(self.fn, x, self.g, gn, self.p)
        if not (self.model_res is None or self.model_res <= self.s.tol):
            return None
        if self.k > 0 and self.positive:
            return "converged", None
        # reached without a positive definite Hessian (or the start): the curvature at x
        # decides between a minimum and a saddle point or maximum
        H = hessian(self.flat_loss, x)
        self.counts["hessians"] += 1
        if self.factor is not None and finite(H):
            self.factor.adopt(H, (x,))
        negative = negative_curvature(H)
        if negative is None:
            return "converged", None
        escaped = None
        if self.k < self.s.maxiter:
            escaped = escape(self.fn, x, self.f, self.g, *negative, self.s.max_backtracks)
        if escaped is None:
            return "saddle", (
                f"stationary point with a Hessian eigenvalue {negative[1]:.3g} < 0; "
                "no step along its eigenvector lowered the loss"
            )
        self.a, self.x, self.f, self.g = escaped
        self.k += 1
        self.positive = False
        self.counts["escapes"] += 1
        if self.ref == 0.0:  # the reference point was that stationary point
            self.ref, self.point, self.p = norm(self.g), "escape", self.x
        return ESCAPED

    def direction(self) -> tuple[torch.Tensor, bool] | None:
        """The Newton direction at ``x``, and whether the Hessian it used is positive definite
        (None for a non-finite Hessian)."""
        x, g, factor = self.x, self.g, self.factor
        if factor is not None and self.k == 0 and not factor.stale((x,)):
            self.counts["factor_steps"] += 1  # the previous call's factor takes the first step
            return -factor.apply((g,))[0].to(g.dtype), _is_cholesky(factor)
        H = hessian(self.flat_loss, x)
        self.counts["hessians"] += 1
        if not finite(H):
            return None
        if factor is not None:  # kept (eigenvalue-clipped where indefinite) for later calls
            factor.adopt(H, (x,))
            return -factor.apply((g,))[0].to(g.dtype), _is_cholesky(factor)
        d, self.counts["damping"] = damped_direction(H, g)
        return d, self.counts["damping"] == 0.0

    def step(self) -> Stop | None:
        """One damped Newton step with its line search (a stop where it fails)."""
        dp = self.direction()
        if dp is None:
            return "diverged", "non-finite Hessian"
        d, self.positive = dp
        d, slope_t = descent(self.g, d)
        slope = float(slope_t)
        x = self.x
        try:
            self.a, x_new, self.f, self.g = armijo(
                self.fn, x, self.f, self.g, d, slope, self.s.max_backtracks
            )
        except LineSearchStop as stop:
            return stop.reason, stop.detail
        self.frozen = norm(x_new - x) <= self.progress.eps * norm(x)
        self.x = x_new
        self.k += 1
        return None

    def report(self, reason: str, detail: str | None) -> None:
        info = self.info
        info.iterations = self.k
        info.residual = info.residuals[-1]
        info.evaluations = self.fn.evaluations
        info.stepsize = self.a
        if self.factor is None:
            del self.counts["factor_steps"]
        info.extras.update(
            self.counts,
            reference=self.ref,
            reference_point=self.point,
            model_residual=self.model_res,
        )
        finish(info, reason, detail)


def _is_cholesky(factor: DensePreconditioner) -> bool:
    # whether the kept factor is a Cholesky factor (a positive definite Hessian) rather than an
    # eigenvalue-clipped one (DensePreconditioner has no public name for this)
    return bool(getattr(factor, "_cholesky", False))
