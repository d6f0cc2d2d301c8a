"""L-BFGS (limited-memory quasi-Newton) with a weak Wolfe line search: the class :class:`LBFGS`."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import Any

import torch

from ..settings import count
from ..tree import PyTree
from ._common import (
    Flat,
    Smooth,
    finish,
    finite,
    norm,
)
from .base import function, real, run_setting
from .smooth import ARMIJO, SmoothIteration, SmoothSolver, model_residual

Loss = Callable[[PyTree, PyTree], torch.Tensor]
Stop = tuple[str, "str | None"]
_C2 = 0.9  # the curvature condition of the (weak) Wolfe line search
LBFGS_WINDOW = 10  # L-BFGS iterations without progress: "stalled"


@dataclass(eq=False)
class LBFGS(SmoothSolver):
    """``argmin_x loss(x, hparams)`` by L-BFGS (Nocedal 1980; the two-loop recursion),
    differentiable in ``hparams``.

    :meth:`solve` runs the iteration without autograd (``hparams`` reach the loss detached).
    ``run(x0, hparams)`` returns ``x`` through :func:`~hypergrad.custom_root` of
    ``∇_x loss = 0`` (as :class:`~hypergrad.inner.Newton`).

    The direction is ``−H_k ∇f`` with ``H_k`` the limited-memory inverse-Hessian estimate from
    the last ``history`` pairs ``(s, y)`` (steps and gradient changes), scaled by
    ``sᵀy / yᵀy`` of the newest pair; the first direction is ``−∇f / ||∇f||``. The step length
    satisfies the weak Wolfe conditions (sufficient decrease ``1e-4``, curvature ``0.9``),
    found by bracketing and bisection (Lewis and Overton's line search); a pair with
    ``sᵀy <= 1e-10 · ||s|| ||y||`` is not stored, so the estimate stays positive definite.

    Residual and convergence: as :class:`~hypergrad.inner.Newton`'s (the gradient relative to
    the gradient at the origin, ``||∇f(x)|| / ||∇f(0)||``, or at ``x0`` where the origin cannot
    serve, measured at every iterate including the returned one; ``converged`` also needs the
    quadratic model's relative residual ``extras["model_residual"]`` within ``tol``, so a loss
    steep at the origin cannot certify a point far from the minimiser).

    Why it stopped is ``info.reason`` (:class:`~hypergrad.inner.InnerInfo`), warned about
    unless ``"converged"``: ``"maxiter"``; ``"stalled"`` (two steps in a row left ``x``
    unchanged at the precision of its dtype, or 10 iterations in which the residual did not
    halve and ``f`` did not fall by more than its rounding); ``"line_search"`` (no trial step
    lowered the loss). A start at a stationary point is returned as converged (L-BFGS has no
    curvature to tell a minimum from a saddle there: use :class:`~hypergrad.inner.Newton`).

    The report of ``solve`` (``(x, info)``): ``evaluations`` counts loss-and-gradient
    evaluations.

    Args:
        loss: ``(x, hparams) -> scalar tensor``, differentiable in ``x``.
        maxiter: at most this many steps (>= 1).
        tol: tolerance on the relative gradient norm (>= 0): for a quadratic loss with Hessian
            ``H`` and minimiser ``x*`` it is ``||H(x − x*)|| / ||H x*||``, a relative error of
            ``x``.
        history: number of stored pairs (>= 1).
        max_linesearch: trial steps allowed in one line search; when none satisfies both
            conditions the best one with sufficient decrease is taken, and when none decreases
            the loss the solve stops (``"line_search"``).
        solver: the linear solver of the implicit derivative (``run`` only; default
            ``hg.CG()``).

    Attributes:
        last_info: the :class:`~hypergrad.inner.InnerInfo` of the last ``run``.

    Example:
        >>> import torch, hypergrad as hg
        >>> y = torch.tensor([1.0, 2.0], dtype=torch.float64)
        >>> ridge = hg.inner.LBFGS(lambda w, lam: 0.5 * ((w - y) ** 2).sum()
        ...                        + 0.5 * lam * (w**2).sum(), tol=1e-12)
        >>> lam = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
        >>> ridge.run(torch.zeros(2, dtype=torch.float64), lam).sum().backward()
        >>> round(float(lam.grad), 10), ridge.last_info.converged
        (-0.75, True)

    Example (the plain iteration, ``solve``, without autograd: ``(x, info)``):
        >>> import torch, hypergrad as hg
        >>> A = torch.tensor([[3.0, 1.0], [1.0, 2.0]], dtype=torch.float64)
        >>> f = lambda x, b: 0.5 * x @ A @ x - b @ x
        >>> b = torch.tensor([1.0, 1.0], dtype=torch.float64)
        >>> x, info = hg.inner.LBFGS(f, tol=1e-12).solve(torch.zeros(2, dtype=torch.float64), b)
        >>> x, info.converged
        (tensor([0.2000, 0.4000], dtype=torch.float64), True)
    """

    loss: Loss = function()
    _: KW_ONLY
    maxiter: int = count(500, minimum=1, allow_none=False)
    tol: float = real(1e-6)
    history: int = count(10, minimum=1, allow_none=False)
    max_linesearch: int = count(40, minimum=1, allow_none=False)
    solver: Any = run_setting(None)

    def _iteration(self, flat: Flat, fn: Smooth) -> _Iteration:
        return _Iteration(self, flat, fn)


class _Iteration(SmoothIteration):
    """One solve's state: the iterate, its loss and gradient, the pairs ``(s, y)``."""

    window = LBFGS_WINDOW
    s: LBFGS

    def __init__(self, s: LBFGS, flat: Flat, fn: Smooth) -> None:
        super().__init__(s, flat, fn, "lbfgs")
        self.S: list[torch.Tensor] = []
        self.Y: list[torch.Tensor] = []
        self.skipped = 0
        self.frozen = 0  # consecutive steps that left x unchanged

    def loop(self) -> Stop:
        """L-BFGS steps until a stop: why."""
        while True:
            gn, res = self.measure()
            if res <= self.s.tol:
                self.model_res = model_residual(self.fn, self.x, self.g, gn, self.p)
                if self.model_res is None or self.model_res <= self.s.tol:
                    return "converged", None
            if self.k == self.s.maxiter:
                return "maxiter", None
            if self.frozen >= 2 or self.progress.stalled():
                return "stalled", (
                    "two steps in a row left x unchanged at the precision of its dtype"
                    if self.frozen >= 2
                    else f"no progress over {LBFGS_WINDOW} iterations (the residual did not "
                    "halve and the loss did not fall beyond its rounding)"
                )
            if not self.step(gn):
                return "line_search", "the line search found no decrease"

    def step(self, gn: float) -> bool:
        """One step along the two-loop direction (False: the line search found no decrease)."""
        x, g = self.x, self.g
        d = _two_loop(g, self.S, self.Y) if self.S else -g / gn
        slope = float(torch.dot(g, d))
        if not slope < 0:  # cannot happen in exact arithmetic; reset the memory
            self.S.clear()
            self.Y.clear()
            d, slope = -g / gn, -gn
        step = _wolfe(self.fn, x, self.f, slope, d, self.s.max_linesearch)
        if step is None:
            return False
        self.a, x_new, f_new, g_new = step
        self.remember(x_new - x, g_new - g, x)
        self.x, self.f, self.g = x_new, f_new, g_new
        self.k += 1
        return True

    def remember(self, s_vec: torch.Tensor, y_vec: torch.Tensor, x: torch.Tensor) -> None:
        """Store the pair ``(s, y)`` where it keeps the estimate positive definite."""
        if norm(s_vec) <= self.progress.eps * norm(x):
            self.frozen += 1  # x did not move beyond rounding (no pair to learn from)
            return
        self.frozen = 0
        sy = float(torch.dot(s_vec, y_vec))
        if sy > 1e-10 * norm(s_vec) * norm(y_vec):
            self.S.append(s_vec)
            self.Y.append(y_vec)
            if len(self.S) > self.s.history:
                self.S.pop(0)
                self.Y.pop(0)
        else:
            self.skipped += 1

    def report(self, reason: str, detail: str | None) -> None:
        info = self.info
        info.iterations = self.k
        info.residual = info.residuals[-1]
        info.evaluations = self.fn.evaluations
        info.stepsize = self.a
        info.extras.update(
            skipped_pairs=self.skipped,
            reference=self.ref,
            reference_point=self.point,
            model_residual=self.model_res,
        )
        finish(info, reason, detail)


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
        if not finite(f_try, g_try) or float(f_try) > f0 + ARMIJO * a * slope:
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
