"""Fixed-point iteration ``x = T(x, hparams)``: Picard (with mixing) and Anderson acceleration,
the class :class:`FixedPoint`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import Any

import torch

from ..errors import HypergradValueError
from ..implicit import custom_fixed_point
from ..settings import choice, count, number
from ..tree import PyTree
from ._common import (
    GROWTH,
    Flat,
    InnerInfo,
    Progress,
    detach_tree,
    explain_dtypes,
    finish,
    finite,
    norm,
    ratio,
)
from .base import InnerSolver, function, real, run_setting

METHODS = ("anderson", "picard")
STALL_WINDOW = 10  # iterations of rounding-level steps without a better residual: "stalled"

Stop = tuple[str, "str | None"]


@dataclass(eq=False)
class FixedPoint(InnerSolver):
    """A fixed point ``x = T(x, hparams)`` (Picard or Anderson), differentiable in ``hparams``.

    :meth:`solve` runs the iteration without autograd (``hparams`` reach ``T`` detached) and
    returns ``(x, InnerInfo)``. ``run(x0, hparams)`` returns ``x`` through
    :func:`~hypergrad.custom_fixed_point`: gradients reach ``hparams`` by solving
    ``(I − ∂T/∂x)ᵀ u = v`` with ``solver`` (default ``hg.GMRES()``; for a contraction,
    ``hg.Neumann(alpha=1.0, maxiter=...)`` is the classic adjoint iteration). This is the
    layer of a deep equilibrium model.

    Picard: ``x_{k+1} = x_k + β (T(x_k) − x_k)`` (``β = mixing``; ``β = 1`` is plain iteration
    of ``T``). Anderson (type II, as in Walker and Ni 2011, "Anderson acceleration for
    fixed-point iterations"): with the residuals ``g_i = T(x_i) − x_i`` of the last ``memory``
    iterates, ``x_{k+1} = x_k + β g_k − (ΔX + β ΔG) γ`` where ``γ`` minimises
    ``||g_k − ΔG γ||`` (a least-squares problem with ``memory`` unknowns, solved through its
    normal equations with a relative Tikhonov term ``regularization``); ``ΔX``, ``ΔG`` hold the
    differences of consecutive iterates and residuals. A non-finite Anderson step falls back to
    a Picard step and clears the memory. The history lives in two preallocated ring buffers of
    ``memory`` rows each, and the small Gram matrix ``ΔGᵀΔG`` gains one row and column per
    step, so a step allocates a few vectors of ``x``'s size and no copy of the history.

    The residual ``||T(x) − x|| / max(||x||, ||T(x0) − x0||)`` is measured at every iterate,
    the returned one included (one map evaluation per iteration plus the first); ``converged``
    is ``residual <= tol`` there.

    Why it stopped is ``info.reason`` (see :class:`~hypergrad.inner.InnerInfo`), and any stop
    but ``"converged"`` is warned about: ``"maxiter"``; ``"stalled"`` (10 iterations whose
    steps were all within ``16 eps ||x||`` without a 1% better residual: ``tol`` is below the
    rounding of ``T``); ``"diverged"`` (a non-finite iterate or ``T(x)``, the last finite
    iterate returned; or, at ``maxiter``, ``||T(x) − x||`` grown by more than ``1e10`` over
    its value at ``x0``). An Anderson step that does not move ``x`` (a stagnating history)
    clears the history, so the next step is a Picard step.

    Args:
        T: the map ``(x, hparams) -> pytree like x``.
        method: ``"anderson"`` or ``"picard"``.
        maxiter: at most this many updates (>= 1).
        tol: tolerance on the relative residual (>= 0; 0 runs ``maxiter`` updates, or until
            the iteration stalls).
        memory: Anderson's history length (>= 1).
        mixing: ``β`` in (0, 1].
        regularization: Tikhonov term relative to the largest diagonal entry of ``ΔGᵀΔG``.
        solver: the linear solver of the implicit derivative (``run`` only).

    Attributes:
        last_info: the :class:`~hypergrad.inner.InnerInfo` of the last ``run``.

    Example:
        >>> import torch, hypergrad as hg
        >>> W = 0.5 * torch.eye(3, dtype=torch.float64).roll(1, 0)
        >>> layer = hg.inner.FixedPoint(lambda z, x: torch.tanh(W @ z + x), tol=1e-12)
        >>> x = torch.tensor([0.1, -0.2, 0.3], dtype=torch.float64, requires_grad=True)
        >>> z = layer.run(torch.zeros(3, dtype=torch.float64), x)
        >>> z.sum().backward()
        >>> layer.last_info.converged, x.grad.shape
        (True, torch.Size([3]))

    Example (the plain iteration, ``solve``, without autograd: ``(x, info)``):
        >>> import torch, hypergrad as hg
        >>> T = lambda x, a: torch.cos(a * x)
        >>> cosine = hg.inner.FixedPoint(T, tol=1e-12)
        >>> x, info = cosine.solve(torch.zeros(1, dtype=torch.float64), 1.0)
        >>> round(float(x), 10), info.converged, info.iterations < 20
        (0.7390851332, True, True)
    """

    T: Callable[[PyTree, PyTree], PyTree] = function()
    _: KW_ONLY
    method: str = choice("anderson", METHODS)
    maxiter: int = count(100, minimum=1, allow_none=False)
    tol: float = real(1e-6)
    memory: int = count(5, minimum=1, allow_none=False)
    mixing: float = real(1.0, strict=True, high=1.0)
    regularization: float = number(1e-10)
    solver: Any = run_setting(None)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._decorated = custom_fixed_point(self.T, solver=self.solver)(self._recorded)

    def _differentiable(self) -> Callable[[PyTree, PyTree], PyTree]:
        return self._decorated  # type: ignore[no-any-return]

    def solve(self, x0: PyTree, hparams: PyTree = None) -> tuple[PyTree, InnerInfo]:
        """Solve ``x = T(x, hparams)`` from ``x0`` without autograd: ``(x, info)``, the last
        iterate (a pytree like ``x0``) and its :class:`~hypergrad.inner.InnerInfo`."""
        flat = Flat(x0)
        with torch.no_grad(), explain_dtypes(x0, hparams=hparams):
            it = _Iteration(self, flat, detach_tree(hparams))
            x, (reason, detail) = it.loop()
            it.report(reason, detail)
        return flat.tree(x), it.info


class _Iteration:
    """One solve's state: the map on the flat vector, Anderson's history, the report."""

    def __init__(self, s: FixedPoint, flat: Flat, hp: PyTree) -> None:
        self.s, self.flat, self.hp = s, flat, hp
        self.evals = 0
        self.info = InnerInfo(solver=s.method, tol=s.tol, stepsize=s.mixing)
        self.x = flat.x0
        fx = self.apply(self.x)
        if not finite(fx):
            raise HypergradValueError("T(x0) has NaN or Inf entries")
        self.g = fx - self.x
        del fx
        self.ref0 = norm(self.g)
        # Anderson's history: ring buffers of the last ``memory`` differences (one row each),
        # and their Gram matrix, updated one row and column per step (no re-stacking).
        self.anderson = s.method == "anderson"
        n, m = (self.x.numel(), s.memory) if self.anderson else (0, 0)
        self.dX = self.x.new_empty((m, n))
        self.dG = self.x.new_empty((m, n))
        self.gram = self.x.new_zeros((m, m))
        self.stored = self.slot = 0  # filled rows; the row the next pair overwrites (the oldest)
        self.restarts = 0
        self.progress = Progress(STALL_WINDOW, self.x.dtype)
        self.k = 0

    def apply(self, v: torch.Tensor) -> torch.Tensor:
        self.evals += 1
        return self.flat.vec(self.s.T(self.flat.tree(v), self.hp), "T")

    def loop(self) -> tuple[torch.Tensor, Stop]:
        """Iterate until a stop: the returned iterate and why."""
        x, g = self.x, self.g
        step_norm: float | None = None
        while True:
            gn, xn = norm(g), norm(x)
            res = ratio(gn, max(xn, self.ref0))
            self.info.residuals.append(res)
            self.progress.update(res, step=step_norm, size=xn)
            stop = self.stop(res, gn)
            if stop is not None:
                return x, stop
            x_new = self.propose(x, g)
            fx_new = self.apply(x_new)
            self.k += 1
            if not finite(x_new, fx_new):
                self.k -= 1
                return x, ("diverged", "non-finite iterate or T(x); the last finite one returned")
            g_new = fx_new - x_new
            del fx_new
            step_norm = self.remember(x, g, x_new, g_new, gn, xn)
            x, g = x_new, g_new

    def stop(self, res: float, gn: float) -> Stop | None:
        """Why the iteration stops at the current iterate (None: it goes on)."""
        if res <= self.s.tol:
            return "converged", None
        if self.k == self.s.maxiter:
            if gn > GROWTH * self.ref0:  # not a slow convergence: a run-away iteration
                return (
                    "diverged",
                    f"||T(x) − x|| grew by more than {GROWTH:.0e} over its value at x0",
                )
            return "maxiter", None
        if self.progress.stalled():
            return (
                "stalled",
                "the iterate stopped changing beyond rounding, without a better residual",
            )
        return None

    def propose(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """The next iterate: Anderson's (with a history), else Picard's."""
        x_new = None
        if self.anderson and self.stored:
            x_new = _anderson_step(
                x, g, self.dX, self.dG, self.gram, self.stored, self.s.mixing, self.s.regularization
            )
            if x_new is None:
                self.stored = self.slot = 0
                self.restarts += 1
        if x_new is None:
            x_new = x + self.s.mixing * g
        return x_new

    def remember(
        self,
        x: torch.Tensor,
        g: torch.Tensor,
        x_new: torch.Tensor,
        g_new: torch.Tensor,
        gn: float,
        xn: float,
    ) -> float:
        """Add the step to Anderson's history; the norm of the step."""
        step_norm = self.s.mixing * gn  # Picard's step (Anderson's: measured below)
        if not self.anderson:
            return step_norm
        slot = self.slot
        torch.sub(x_new, x, out=self.dX[slot])
        step_norm = norm(self.dX[slot])
        if step_norm <= self.progress.eps * xn and self.stored:
            # Anderson's combination cancelled the step (a stagnating history): the next step
            # starts afresh from a Picard step
            self.stored = self.slot = 0
            self.restarts += 1
        else:
            torch.sub(g_new, g, out=self.dG[slot])
            self.stored = min(self.stored + 1, self.s.memory)
            row = self.dG[: self.stored] @ self.dG[slot]
            self.gram[slot, : self.stored] = row
            self.gram[: self.stored, slot] = row
            self.slot = (slot + 1) % self.s.memory
        return step_norm

    def report(self, reason: str, detail: str | None) -> None:
        info = self.info
        info.iterations = self.k
        info.residual = info.residuals[-1]
        info.evaluations = self.evals
        info.extras["reference"] = self.ref0
        if self.anderson:
            info.extras["restarts"] = self.restarts
        finish(info, reason, detail)


def _anderson_step(
    x: torch.Tensor,
    g: torch.Tensor,
    dX: torch.Tensor,
    dG: torch.Tensor,
    gram: torch.Tensor,
    stored: int,
    beta: float,
    reg: float,
) -> torch.Tensor | None:
    """``x + β g − (ΔX + β ΔG) γ`` with ``γ`` from the regularised normal equations
    ``(ΔGᵀΔG + reg · max diag · I) γ = ΔGᵀ g`` over the ``stored`` rows of the ring buffers
    (their order does not matter); None when the step is not finite."""
    A = gram[:stored, :stored]
    A = A + (reg * float(A.diagonal().max())) * torch.eye(stored, dtype=A.dtype, device=A.device)
    G, X = dG[:stored], dX[:stored]
    gamma = torch.linalg.lstsq(A, (G @ g).unsqueeze(1)).solution.squeeze(1)
    cand = x + beta * g
    cand.addmv_(X.T, gamma, alpha=-1.0)
    cand.addmv_(G.T, gamma, alpha=-beta)
    return cand if finite(cand) else None
