"""Restarted GMRES (Saad & Schultz 1986) for general, possibly non-symmetric systems."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import HypergradWarning, SolveFailedWarning, SolverStalledWarning, warn
from ..settings import count, number
from ..tree import Tensors, tree_axpy, tree_norm, tree_numel, tree_scale, tree_vdot, tree_zeros_like
from .base import (
    MatVec,
    SolveInfo,
    Solver,
    as_float,
    check_product,
    damped,
    emit,
    functional_form,
    warn_diverged,
    warn_singular,
)
from .krylov import default_maxiter, lstsq_rtols, recomputed_residual, start

#: Default restart length: ``min(numel(b), DEFAULT_RESTART)`` Krylov vectors per cycle.
DEFAULT_RESTART = 30
#: A restart cycle that lowers the recomputed residual by less than this fraction has stalled.
STALL_RTOL = 1e-3


@dataclass(kw_only=True)
class GMRES(Solver):
    """Restarted GMRES: for non-symmetric systems (root finding, fixed points, any Jacobian).

    Minimises the residual over each cycle's Krylov space, so the residual never grows; costs one
    product and ``k`` inner products at iteration ``k`` of a cycle, and ``restart + 1`` vectors of
    memory. Convergence is verified with a recomputed residual at the end of every cycle;
    singular inconsistent systems (a vanishing pivot) and cycles that make no progress are
    reported (``info.extras["singular"]``, ``info.extras["stalled"]``) with a warning (see
    :meth:`solve`). Settings are immutable after construction.

    Args:
        maxiter: cap on iterations (products) over all cycles, >= 1 (None: ``min(2 * numel,
            1000)``).
        tol: relative residual tolerance, finite and >= 0.
        restart: Krylov vectors per cycle, >= 1 (None: ``min(numel, 30)``).
        damping: added to the diagonal, finite and >= 0.

    Example:
        >>> A = torch.tensor([[1.0, 2.0], [0.0, 3.0]], dtype=torch.float64)
        >>> x, info = GMRES(tol=1e-10).solve(lambda v: (A @ v[0],),
        ...                                  (torch.tensor([3.0, 3.0], dtype=torch.float64),))
        >>> x[0], info.solver
        (tensor([1., 1.], dtype=torch.float64), 'gmres')
    """

    name = "gmres"
    display = "GMRES"
    maxiter: int | None = count(None, minimum=1, why=" (zero iterations give no solution)")
    tol: float = number(1e-6)
    restart: int | None = count(None, minimum=1)
    damping: float = number(0.0)

    def solve(
        self, matvec: MatVec, b: Tensors, x0: Tensors | None = None
    ) -> tuple[Tensors, SolveInfo]:
        """Solve ``(A + damping I) x = b`` for a general (non-symmetric) ``A`` by restarted GMRES.

        Each cycle builds an orthonormal Krylov basis of at most ``restart`` vectors (Arnoldi with
        modified Gram-Schmidt, applied twice so the basis stays orthogonal in float32), reduces the
        small Hessenberg least-squares problem by Givens rotations in float64 on the host and so
        minimises ``||b - (A + damping I) x||`` over the cycle's Krylov space. The residual of the
        rotations after each iteration is ``residuals``; it never grows.

        What is reported:

        * every cycle ends with one product recomputing ``r = b - A x`` (the start of the next
          cycle): ``residual`` is always that recomputed value (``extras["residual_verified"]``
          True; the rotations' value is ``extras["recurrence_residual"]``) and ``converged`` means
          it met ``tol``. A cycle that claimed convergence but whose recomputed residual misses
          ``tol`` simply restarts from the recomputed residual;
        * **singular**: a rotated pivot ``|R_kk| <= 100 eps ||A||`` (``||A||`` estimated by the
          largest ``||A v_k||`` seen) means a combination of the basis vectors is mapped to
          (numerically) zero: ``A`` is singular (a nonsingular ``A`` keeps ``|R_kk| >=
          sigma_min(A)``, i.e. ``1 / cond(A)`` relative). With the residual still above ``tol`` no
          ``x`` in the Krylov space does better (``b`` has a component outside the range): the
          iteration stops before that column (which would divide by the vanishing pivot and blow
          ``x`` up) and reports ``extras["singular"]``, the least-squares floor
          ``extras["lstsq_residual"]``, warning :class:`~hypergrad.SingularSystemWarning`;
          ``extras["zero_operator"]`` when the first product is exactly zero. Pivots below
          ``sqrt(eps) ||A||`` mark a candidate iterate that is returned if the final one turns out
          worse. A singular but consistent system (``b`` in the range of an operator whose null
          space the Krylov space does not enter) is solved;
        * **stalled**: a whole restart cycle that leaves the recomputed residual almost unchanged
          (relative decrease below ``1e-3``) while it is above ``sqrt(eps)``: restarted GMRES cannot
          make progress, either because ``x`` is a least-squares point of a singular inconsistent
          system or because ``restart`` is too short for this operator (e.g. a cyclic shift). Which
          one cannot be told from products alone, so it is reported as ``extras["stalled"]`` with a
          :class:`~hypergrad.SolverStalledWarning` naming both (``SolveInfo.failure`` is not None
          either way). Stagnation below ``sqrt(eps)`` is the precision floor
          (``extras["precision_floor"]``), not a failure;
        * a product returning NaN/Inf for a finite vector raises; an overflowing iterate is
          ``diverged``.

        Returns:
            ``(x, info)``; ``info.extras["restart"]`` is the cycle length used,
            ``info.extras["restarts"]`` the cycles after the first.

        Raises:
            HypergradValueError: a product of the operator returned NaN/Inf.
        """
        x, info = self._run(matvec, b, x0)
        warn_residual_above_one(info)
        return x, info

    def _run(self, matvec: MatVec, b: Tensors, x0: Tensors | None) -> tuple[Tensors, SolveInfo]:
        op = damped(matvec, self.damping)
        n = tree_numel(b)
        maxiter = default_maxiter(b) if self.maxiter is None else self.maxiter
        tol = self.tol
        m = max(1, min(DEFAULT_RESTART if self.restart is None else self.restart, n))
        info = SolveInfo(solver=self.name)
        info.extras.update(singular=False, restart=m)
        started = start(op, b, x0, info, self.display)
        if started is None:
            return tree_zeros_like(b), info
        x, r, b_norm = started
        del started
        info.extras["residual_verified"] = True
        if info.residual <= tol:
            info.converged = True
            return x, info
        state = _State(op, b, b_norm, tol, info)
        floor = state.suspect_rtol  # sqrt(eps): stagnation below it is the precision floor
        prev_rel = info.residual
        claimed_before = False
        while True:
            status, x, est, cand = _cycle(state, x, r, min(m, maxiter - info.iterations))
            if status == "diverged":
                return x, info
            r, rel = recomputed_residual(op, b, x, b_norm, info, self.display, "the residual check")
            info.extras["recurrence_residual"] = est
            info.residual = rel
            if cand is not None and not rel <= tol:
                better = self._candidate(op, b, b_norm, info, cand, rel)
                if better is not None:
                    x, r, rel = better
                    status = "singular"
            if rel <= tol:
                info.converged = True
                info.extras["singular"] = False
                return x, info
            if not math.isfinite(rel):
                info.diverged = True
                warn_diverged(info, "The iterate overflowed (NaN/Inf in x).")
                return x, info
            if status == "singular":
                _warn_singular(info)
                return x, info
            if info.iterations >= maxiter:
                return x, info
            if rel > prev_rel * (1.0 - STALL_RTOL):  # a whole cycle made (almost) no progress
                _no_progress(info, rel <= floor, claimed_before or status == "claimed")
                return x, info
            claimed_before = claimed_before or status == "claimed"
            prev_rel = rel
            info.extras["restarts"] = info.extras.get("restarts", 0) + 1

    def _candidate(
        self,
        op: MatVec,
        b: Tensors,
        b_norm: float,
        info: SolveInfo,
        cand: tuple[Tensors, float, int],
        rel: float,
    ) -> tuple[Tensors, Tensors, float] | None:
        """The least-squares candidate ``(x, r, rel)`` when its recomputed residual is below the
        cycle's final ``rel`` (or that is not finite), reported as such; else None."""
        x_c, est_c, it_c = cand
        r_c, rel_c = recomputed_residual(
            op, b, x_c, b_norm, info, self.display, "the residual check"
        )
        if rel_c < rel or not math.isfinite(rel):
            info.residual = rel_c
            info.extras.update(lstsq_residual=est_c, lstsq_iteration=it_c)
            return x_c, r_c, rel_c
        return None


@functional_form(GMRES)
def solve_gmres(
    matvec: MatVec, b: Tensors, x0: Tensors | None = None, **settings: Any
) -> tuple[Tensors, SolveInfo]:
    """``GMRES(**settings).solve(matvec, b, x0)``: GMRES as a function (the settings are
    :class:`GMRES`'s, keyword-only and validated the same way).

    Example:
        >>> A = torch.tensor([[2.0, 1.0], [-1.0, 3.0]], dtype=torch.float64)  # non-symmetric
        >>> b = (torch.tensor([3.0, 2.0], dtype=torch.float64),)
        >>> x, info = solve_gmres(lambda v: (A @ v[0],), b)
        >>> [round(float(t), 8) for t in x[0]], info.converged
        ([1.0, 1.0], True)
        >>> S = torch.tensor([[1.0, 1.0], [0.0, 0.0]], dtype=torch.float64)  # singular
        >>> import warnings
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")
        ...     x, info = solve_gmres(lambda v: (S @ v[0],), (torch.ones(2, dtype=torch.float64),))
        >>> info.converged, info.failure, round(info.extras["lstsq_residual"], 4)
        (False, 'singular', 0.7071)
    """
    return GMRES(**settings).solve(matvec, b, x0)


def warn_residual_above_one(info: SolveInfo) -> None:
    """Warn when the result is worse than ``x = 0`` (``SolveInfo.failure == "residual above 1"``,
    e.g. a poor warm start that no iteration improved): every other failure has warned already."""
    if info.failure == "residual above 1" and not info.extras.get("warned"):
        emit(
            info,
            f"{info.solver}: the returned x is not a hypergradient: its relative residual "
            "||Ax - b||/||b|| (SolveInfo.residual) is above 1, a worse answer than x = 0 "
            "(the operator may be singular or very ill-conditioned). Add damping or raise "
            "maxiter.",
            SolveFailedWarning,
        )


class _State:
    """One GMRES solve's operator, report and thresholds, and what persists across its cycles:
    the running lower bound on ``||A||``."""

    def __init__(self, op: MatVec, b: Tensors, b_norm: float, tol: float, info: SolveInfo) -> None:
        self.op, self.b_norm, self.tol, self.info = op, b_norm, tol, info
        self.stop_rtol, self.suspect_rtol = lstsq_rtols(b)
        self.a_norm = 0.0


def _cycle(
    state: _State, x: Tensors, r: Tensors, budget: int
) -> tuple[str, Tensors, float, tuple[Tensors, float, int] | None]:
    """One GMRES cycle from ``x`` with residual ``r``: ``(status, x, recurrence residual,
    least-squares candidate)``; statuses "claimed", "exhausted", "singular", "maxiter",
    "diverged"."""
    op, b_norm, tol, info = state.op, state.b_norm, state.tol, state.info
    stop_rtol, suspect_rtol = state.stop_rtol, state.suspect_rtol
    beta = as_float(tree_norm(r))
    basis = [tree_scale(1.0 / beta, r)]
    del r
    cols: list[list[float]] = []  # columns of the triangular factor R
    cs: list[float] = []
    sn: list[float] = []
    g = [beta]  # rotated right-hand side beta * e_1
    status = "maxiter"
    cand_k: int | None = None
    cand_est = math.nan
    for k in range(budget):
        v = basis[k]
        av = op(v)
        info.matvecs += 1
        w, h = _orthogonalize(av, basis[: k + 1])
        h_next = h[-1]
        col_norm = math.sqrt(math.fsum(t * t for t in h))
        if not math.isfinite(col_norm):
            check_product("GMRES", f"iteration {info.iterations + 1}", v, av)
            info.diverged = True
            warn_diverged(info, "NaN/Inf in the Arnoldi recurrence (overflow).")
            return "diverged", x, math.nan, None
        state.a_norm = max(state.a_norm, col_norm)
        for i in range(k):  # the earlier rotations
            t = cs[i] * h[i] + sn[i] * h[i + 1]
            h[i + 1] = -sn[i] * h[i] + cs[i] * h[i + 1]
            h[i] = t
        pivot = math.hypot(h[k], h[k + 1])
        if pivot <= stop_rtol * state.a_norm:  # the new column is dependent: A is singular
            info.extras["lstsq_residual"] = abs(g[k]) / b_norm
            info.extras["lstsq_iteration"] = info.iterations
            if state.a_norm == 0.0:
                info.extras["zero_operator"] = True
            status = "singular"
            break
        if cand_k is None and pivot <= suspect_rtol * state.a_norm:
            cand_k, cand_est = k, abs(g[k]) / b_norm
        c_k, s_k = h[k] / pivot, h[k + 1] / pivot
        g.append(-s_k * g[k])
        g[k] = c_k * g[k]
        h[k] = pivot
        cols.append(h[: k + 1])
        cs.append(c_k)
        sn.append(s_k)
        info.iterations += 1
        est = abs(g[k + 1]) / b_norm
        info.residuals.append(est)
        info.residual = est
        if est <= tol:
            status = "claimed"
            break
        if h_next <= stop_rtol * state.a_norm:  # invariant Krylov space: x is exact in it
            status = "exhausted"
            break
        if k + 1 < budget:
            basis.append(tree_scale(1.0 / h_next, w))
    est = abs(g[len(cols)]) / b_norm
    cand = None
    if cand_k is not None and cand_k < len(cols):
        cand = (_update(x, basis, cols, g, cand_k), cand_est, cand_k)
    return status, _update(x, basis, cols, g, len(cols)), est, cand


def _orthogonalize(av: Tensors, basis: list[Tensors]) -> tuple[Tensors, list[float]]:
    """Arnoldi's step: ``A v_k`` orthogonalised against ``basis`` by modified Gram-Schmidt,
    twice (no host sync until the end): the new vector ``w`` and the column ``h`` of the
    Hessenberg matrix, ``||w||`` last."""
    w = av
    coef: list[torch.Tensor] = []
    for sweep in range(2):
        for j in range(len(basis)):
            c = tree_vdot(basis[j], w)
            w = tree_axpy(-c, basis[j], w)
            c64 = c.to(torch.float64)
            if sweep == 0:
                coef.append(c64)
            else:
                coef[j] = coef[j] + c64
    h: list[float] = torch.stack(coef).cpu().tolist()
    h.append(as_float(tree_norm(w)))
    return w, h


def _warn_singular(info: SolveInfo) -> None:
    """A "singular" stop whose residual misses tol: reported and warned."""
    info.extras["singular"] = True
    detail = (
        "the operator product is exactly zero."
        if info.extras.get("zero_operator")
        else "the system is singular and inconsistent: GMRES reached a vanishing "
        "pivot (a combination of its Krylov vectors is mapped to zero) with the "
        "residual above tol, so x is a least-squares point of its Krylov space."
    )
    warn_singular(info, detail)


def _no_progress(info: SolveInfo, at_floor: bool, claimed: bool) -> None:
    """A whole cycle made (almost) no progress: the precision floor (with a mismatch warning if
    the recurrence ever claimed convergence), or a stall (warned)."""
    if at_floor:
        info.extras["precision_floor"] = True
        if claimed:
            info.extras["residual_mismatch"] = True
            warn(
                "gmres: the recurrence residual met tol but the recomputed residual "
                "||Ax - b||/||b|| does not and restarting no longer reduces it: tol is "
                "below what this precision reaches for this system; loosen tol, add "
                "damping, or use float64",
                HypergradWarning,
            )
        return
    info.extras["stalled"] = True
    emit(
        info,
        "gmres: a whole restart cycle left the residual almost unchanged "
        "(SolveInfo.residual): "
        "either the system is singular and b is outside the operator's range (x is a "
        "least-squares point, the hypergradient is not determined), or restart is too "
        "short for this operator. Raise restart (up to numel), add damping, or check "
        "the system.",
        SolverStalledWarning,
    )


def _update(
    x: Tensors, basis: list[Tensors], cols: list[list[float]], g: list[float], k: int
) -> Tensors:
    """``x + V_k y`` with ``R_k y = g_k`` (back substitution in float64)."""
    y = [0.0] * k
    for i in reversed(range(k)):
        acc = g[i] - math.fsum(cols[j][i] * y[j] for j in range(i + 1, k))
        y[i] = acc / cols[i][i]
    for i in range(k):
        x = tree_axpy(y[i], basis[i], x)
    return x
