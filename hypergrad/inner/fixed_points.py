"""Fixed-point iteration ``x = T(x, hparams)``: Picard (with mixing) and Anderson acceleration."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..errors import HypergradValueError
from ..tree import PyTree
from ._common import (
    GROWTH,
    Flat,
    InnerInfo,
    Progress,
    check_maxiter,
    check_positive,
    check_tol,
    detach_tree,
    explain_dtypes,
    finish,
    finite,
    norm,
    ratio,
)

METHODS = ("anderson", "picard")
STALL_WINDOW = 10  # iterations of rounding-level steps without a better residual: "stalled"


def check_options(
    method: str, maxiter: int, tol: float, memory: int, mixing: float, regularization: float
) -> tuple[int, float, int, float, float]:
    """The settings of :func:`fixed_point`, checked."""
    if method not in METHODS:
        raise HypergradValueError(f"method must be one of {METHODS}, got {method!r}")
    if isinstance(regularization, bool) or not isinstance(regularization, (int, float)):
        raise HypergradValueError(f"regularization must be a number >= 0, got {regularization!r}")
    reg = float(regularization)
    if not 0.0 <= reg < math.inf:
        raise HypergradValueError(f"regularization must be finite and >= 0, got {regularization!r}")
    return (
        check_maxiter(maxiter),
        check_tol(tol),
        check_maxiter(memory, "memory"),
        check_positive(mixing, "mixing", 1.0),
        reg,
    )


def fixed_point(
    T: Callable[[PyTree, PyTree], PyTree],
    x0: PyTree,
    hparams: PyTree = None,
    *,
    method: str = "anderson",
    maxiter: int = 100,
    tol: float = 1e-6,
    memory: int = 5,
    mixing: float = 1.0,
    regularization: float = 1e-10,
) -> tuple[PyTree, InnerInfo]:
    """Solve ``x = T(x, hparams)`` without autograd.

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
    is ``residual <= tol`` there. ``hparams`` reach ``T`` detached (this is the solve; gradients
    come from :class:`~hypergrad.inner.FixedPoint` by implicit differentiation).

    Why it stopped is ``info.reason`` (see :class:`~hypergrad.inner.InnerInfo`), and any stop
    but ``"converged"`` is warned about: ``"maxiter"``; ``"stalled"`` (10 iterations whose
    steps were all within ``16 eps ||x||`` without a 1% better residual: ``tol`` is below the
    rounding of ``T``); ``"diverged"`` (a non-finite iterate or ``T(x)``, the last finite
    iterate returned; or, at ``maxiter``, ``||T(x) − x||`` grown by more than ``1e10`` over
    its value at ``x0``). An Anderson step that does not move ``x`` (a stagnating history)
    clears the history, so the next step is a Picard step.

    Args:
        T: the map ``(x, hparams) -> pytree like x``.
        x0: the starting point, a tensor or a pytree of floating-point tensors.
        hparams: passed to ``T`` as its second argument.
        method: ``"anderson"`` or ``"picard"``.
        maxiter: at most this many updates (>= 1).
        tol: tolerance on the relative residual (>= 0; 0 runs ``maxiter`` updates, or until
            the iteration stalls).
        memory: Anderson's history length (>= 1).
        mixing: ``β`` in (0, 1].
        regularization: Tikhonov term relative to the largest diagonal entry of ``ΔGᵀΔG``.

    Returns:
        ``(x, info)``: the last iterate (a pytree like ``x0``) and its :class:`InnerInfo`.

    Example:
        >>> import torch, hypergrad as hg
        >>> T = lambda x, a: torch.cos(a * x)
        >>> x, info = hg.inner.fixed_point(T, torch.zeros(1, dtype=torch.float64), 1.0, tol=1e-12)
        >>> round(float(x), 10), info.converged, info.iterations < 20
        (0.7390851332, True, True)
    """
    maxiter, tol, memory, beta, reg = check_options(
        method, maxiter, tol, memory, mixing, regularization
    )
    flat = Flat(x0)
    hp = detach_tree(hparams)
    evals = 0

    def apply(v: torch.Tensor) -> torch.Tensor:
        nonlocal evals
        evals += 1
        return flat.vec(T(flat.tree(v), hp), "T")

    info = InnerInfo(solver=method, tol=tol, stepsize=beta)
    with torch.no_grad(), explain_dtypes(x0, hparams=hparams):
        x = flat.x0
        fx = apply(x)
        if not finite(fx):
            raise HypergradValueError("T(x0) has NaN or Inf entries")
        g = fx - x
        del fx
        ref0 = norm(g)
        # Anderson's history: ring buffers of the last ``memory`` differences (one row each),
        # and their Gram matrix, updated one row and column per step (no re-stacking).
        if method == "anderson":
            n = x.numel()
            dX = x.new_empty((memory, n))
            dG = x.new_empty((memory, n))
            gram = x.new_zeros((memory, memory))
        stored = slot = 0  # filled rows; the row the next pair overwrites (the oldest)
        restarts = 0
        progress = Progress(STALL_WINDOW, x.dtype)
        step_norm: float | None = None
        k = 0
        reason, detail = "", None
        while True:
            gn, xn = norm(g), norm(x)
            res = ratio(gn, max(xn, ref0))
            info.residuals.append(res)
            progress.update(res, step=step_norm, size=xn)
            if res <= tol:
                reason = "converged"
                break
            if k == maxiter:
                reason = "maxiter"
                if gn > GROWTH * ref0:  # not a slow convergence: a run-away iteration
                    reason = "diverged"
                    detail = f"||T(x) − x|| grew by more than {GROWTH:.0e} over its value at x0"
                break
            if progress.stalled():
                reason = "stalled"
                detail = "the iterate stopped changing beyond rounding, without a better residual"
                break
            x_new = None
            if method == "anderson" and stored:
                x_new = _anderson_step(x, g, dX, dG, gram, stored, beta, reg)
                if x_new is None:
                    stored = slot = 0
                    restarts += 1
            if x_new is None:
                x_new = x + beta * g
            fx_new = apply(x_new)
            k += 1
            if not finite(x_new, fx_new):
                reason = "diverged"
                detail = "non-finite iterate or T(x); the last finite one returned"
                k -= 1
                break
            g_new = fx_new - x_new
            del fx_new
            step_norm = beta * gn  # Picard's step (Anderson's: measured below)
            if method == "anderson":
                torch.sub(x_new, x, out=dX[slot])
                step_norm = norm(dX[slot])
                if step_norm <= progress.eps * xn and stored:
                    # Anderson's combination cancelled the step (a stagnating history): the
                    # next step starts afresh from a Picard step
                    stored = slot = 0
                    restarts += 1
                else:
                    torch.sub(g_new, g, out=dG[slot])
                    stored = min(stored + 1, memory)
                    row = dG[:stored] @ dG[slot]
                    gram[slot, :stored] = row
                    gram[:stored, slot] = row
                    slot = (slot + 1) % memory
            x, g = x_new, g_new
        info.iterations = k
        info.residual = info.residuals[-1]
        info.evaluations = evals
        info.extras["reference"] = ref0
        if method == "anderson":
            info.extras["restarts"] = restarts
        finish(info, reason, detail)
    return flat.tree(x), info


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
