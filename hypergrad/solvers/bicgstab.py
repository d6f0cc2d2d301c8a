"""BiCGStab (van der Vorst 1992) for general, possibly non-symmetric systems."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..errors import HypergradWarning, SolverStalledWarning, warn
from ..settings import count, number
from ..tree import Tensors, tree_axpy, tree_norm, tree_vdot, tree_zeros_like
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
from .gmres import warn_residual_above_one
from .krylov import MAX_RESTARTS, default_maxiter, lstsq_rtols, recomputed_residual, start

#: An iterate whose residual exceeds this multiple of the best residual so far has blown up.
GROWTH_LIMIT = 1e8


@dataclass(kw_only=True)
class BiCGStab(Solver):
    """BiCGStab: for non-symmetric systems, with memory independent of the iteration count.

    Two products per iteration; the residual is not monotone (the best iterate is returned).
    Convergence is verified with one recomputed residual; breakdowns are restarted once, and
    singular, stalled or diverging runs are reported with a warning (see
    :meth:`solve`). Prefer :class:`GMRES` when memory allows: it
    minimises the residual and reports singular systems more reliably. Settings are immutable
    after construction.

    Args:
        maxiter: iteration cap (two products each), >= 1 (None: ``min(2 * numel, 1000)``).
        tol: relative residual tolerance, finite and >= 0.
        damping: added to the diagonal, finite and >= 0.

    Example:
        >>> A = torch.tensor([[1.0, 2.0], [0.0, 3.0]], dtype=torch.float64)
        >>> x, info = BiCGStab(tol=1e-12).solve(lambda v: (A @ v[0],),
        ...                                     (torch.tensor([3.0, 3.0], dtype=torch.float64),))
        >>> [round(float(t), 8) for t in x[0]], info.solver
        ([1.0, 1.0], 'bicgstab')
    """

    name = "bicgstab"
    display = "BiCGStab"
    maxiter: int | None = count(None, minimum=1, why=" (zero iterations give no solution)")
    tol: float = number(1e-6)
    damping: float = number(0.0)

    def solve(
        self, matvec: MatVec, b: Tensors, x0: Tensors | None = None
    ) -> tuple[Tensors, SolveInfo]:
        """Solve ``(A + damping I) x = b`` for a general (non-symmetric) ``A`` by BiCGStab.

        Two products per iteration and a few vectors of memory whatever the iteration count (unlike
        GMRES, whose memory grows with ``restart``), but no minimisation property: the residual can
        rise and fall. The iterate with the smallest residual seen is the one returned
        (``extras["best_iteration"]``); ``residuals`` is the recurrence residual after each
        iteration.

        What is reported:

        * the returned ``x``'s residual is always recomputed with one product: ``residual`` is that
          value (``extras["residual_verified"]`` True, the recurrence's value in
          ``extras["recurrence_residual"]``) and ``converged`` means it met ``tol``. When the
          recurrence claimed convergence but the recomputed residual misses ``tol``, the iteration
          restarts from it (at most twice, while each restart halves it; else
          ``extras["residual_mismatch"]`` and a :class:`~hypergrad.HypergradWarning`);
        * **breakdown**: ``rho = <r_hat, r>``, ``<r_hat, A p>`` or ``omega = <t, s> / <t, t>``
          within ``100 eps`` of zero (relative to the norms involved) ends the Lanczos recurrence:
          the iteration restarts once from the best iterate with a fresh shadow vector
          (``extras["breakdowns"]`` counts them); a second breakdown without progress in between
          stops it with ``extras["stalled"]`` and a :class:`~hypergrad.SolverStalledWarning`; so
          does a run in which no iterate improved on the start;
        * **singular**: a product ``A u`` with ``||A u|| <= 100 eps ||A|| ||u||`` (``||A||``
          estimated by the largest ratio seen) shows a null vector while the residual is above
          ``tol``: the system is singular and reported as such: ``extras["singular"]``, a
          :class:`~hypergrad.SingularSystemWarning`, and ``extras["lstsq_residual"]``, the returned
          ``x``'s residual (BiCGStab does not minimise it); ``extras["zero_operator"]`` when the
          product is exactly zero. On an inconsistent singular system the recurrence otherwise
          stagnates (reported as a breakdown or stalled) or blows up;
        * **diverged**: NaN/Inf in the recurrence, or a residual above ``1e8`` times the best one
          (the iterate is growing without bound): the best iterate is returned, with a
          :class:`~hypergrad.SolverDivergedWarning`;
        * a product returning NaN/Inf for a finite vector raises.

        Returns:
            ``(x, info)``.

        Raises:
            HypergradValueError: a product of the operator returned NaN/Inf.
        """
        x, info = self._run(matvec, b, x0)
        warn_residual_above_one(info)
        return x, info

    def _run(self, matvec: MatVec, b: Tensors, x0: Tensors | None) -> tuple[Tensors, SolveInfo]:
        op = damped(matvec, self.damping)
        maxiter = default_maxiter(b) if self.maxiter is None else self.maxiter
        tol = self.tol
        info = SolveInfo(solver=self.name)
        info.extras.update(singular=False, breakdowns=0)
        started = start(op, b, x0, info, self.display)
        if started is None:
            return tree_zeros_like(b), info
        x, r, b_norm = started
        del started
        info.extras["residual_verified"] = True
        if info.residual <= tol:
            info.converged = True
            return x, info
        run = _Run(op, b_norm, tol, lstsq_rtols(b)[0], info, x, info.residual)
        restarts = 0
        last_rel: float | None = None
        while True:
            status = run.iterate(x, r, maxiter - info.iterations)
            if status == "breakdown" and info.iterations >= maxiter:
                status = "maxiter"
            if status == "breakdown":
                info.extras["breakdowns"] += 1
                progressed = run.best_rel < run.breakdown_rel
                run.breakdown_rel = run.best_rel
                if info.extras["breakdowns"] == 1 or progressed:
                    # restart from the best iterate with a fresh shadow vector
                    x = run.best_x
                    r, rel = recomputed_residual(op, b, x, b_norm, info, self.display, "a restart")
                    if rel <= tol:
                        info.residual, info.converged = rel, True
                        return x, info
                    continue
            x = run.best_x
            info.extras["recurrence_residual"] = run.best_rel
            info.extras["best_iteration"] = run.best_it
            r, rel = recomputed_residual(op, b, x, b_norm, info, self.display, "the residual check")
            info.residual = rel
            if rel <= tol:
                info.converged = True
                info.extras["singular"] = False
                return x, info
            if not math.isfinite(rel):
                info.diverged = True
                warn_diverged(info, "The iterate overflowed (NaN/Inf in x).")
                return x, info
            if status == "diverged":
                return x, info  # warned by the iteration
            if _final(status, rel, info, run, maxiter):
                return x, info
            # "claimed" but the recomputed residual misses tol: restart from it
            stuck = last_rel is not None and rel > 0.5 * last_rel
            last_rel = rel
            if restarts >= MAX_RESTARTS or stuck:
                _warn_mismatch(info)
                return x, info
            restarts += 1
            info.extras["restarts"] = restarts
            run.best_x, run.best_rel = x, rel


@functional_form(BiCGStab)
def solve_bicgstab(
    matvec: MatVec, b: Tensors, x0: Tensors | None = None, **settings: Any
) -> tuple[Tensors, SolveInfo]:
    """``BiCGStab(**settings).solve(matvec, b, x0)``: BiCGStab as a function (the settings are
    :class:`BiCGStab`'s, keyword-only and validated the same way).

    Example:
        >>> A = torch.tensor([[2.0, 1.0], [-1.0, 3.0]], dtype=torch.float64)  # non-symmetric
        >>> b = (torch.tensor([3.0, 2.0], dtype=torch.float64),)
        >>> x, info = solve_bicgstab(lambda v: (A @ v[0],), b, tol=1e-12)
        >>> [round(float(t), 8) for t in x[0]], info.converged
        ([1.0, 1.0], True)
    """
    return BiCGStab(**settings).solve(matvec, b, x0)


class _Run:
    """The BiCGStab recurrence, with the best iterate and the ``||A||`` estimate kept across
    restarts."""

    def __init__(
        self,
        op: MatVec,
        b_norm: float,
        tol: float,
        stop_rtol: float,
        info: SolveInfo,
        x: Tensors,
        rel: float,
    ) -> None:
        self.op, self.b_norm, self.tol, self.info = op, b_norm, tol, info
        self.stop_rtol = stop_rtol
        self.a_norm = 0.0
        self.best_x, self.best_rel, self.best_it = x, rel, 0
        self.breakdown_rel = rel

    def _keep(self, x: Tensors, rel: float) -> None:
        if rel < self.best_rel:
            self.best_x, self.best_rel, self.best_it = x, rel, self.info.iterations

    def _product(self, u: Tensors, u_norm: float) -> tuple[Tensors, float, str | None]:
        """``A u``, its norm, and "singular" when ``u`` is (numerically) a null vector."""
        au = self.op(u)
        self.info.matvecs += 1
        au_norm = as_float(tree_norm(au))
        if not math.isfinite(au_norm):
            check_product("BiCGStab", f"iteration {self.info.iterations + 1}", u, au)
            return au, au_norm, "diverged"
        if u_norm > 0.0:
            self.a_norm = max(self.a_norm, au_norm / u_norm)
            if au_norm <= self.stop_rtol * self.a_norm * u_norm:
                if self.a_norm == 0.0:
                    self.info.extras["zero_operator"] = True
                return au, au_norm, "singular"
        return au, au_norm, None

    def _diverged(self, hint: str) -> str:
        self.info.diverged = True
        warn_diverged(self.info, hint)
        return "diverged"

    def iterate(self, x: Tensors, r: Tensors, budget: int) -> str:
        """Run up to ``budget`` iterations from ``(x, r)``; returns the status ("claimed",
        "maxiter", "breakdown", "singular", "diverged"). The best iterate is in ``best_x``."""
        info, tiny = self.info, self.stop_rtol
        r_hat = r
        r_hat_norm = as_float(tree_norm(r_hat))
        rho_old = alpha = omega = 1.0
        p = v = r
        for k in range(budget):
            r_norm = as_float(tree_norm(r))
            rho = as_float(tree_vdot(r_hat, r))
            if not abs(rho) > tiny * r_hat_norm * r_norm:
                return "breakdown"
            if k == 0:
                p = r
            else:
                beta = (rho / rho_old) * (alpha / omega)
                p = tree_axpy(beta, tree_axpy(-omega, v, p), r)
            p_norm = as_float(tree_norm(p))
            v, v_norm, flag = self._product(p, p_norm)
            if flag == "diverged":
                return self._diverged("NaN/Inf in the BiCGStab recurrence (overflow).")
            if flag is not None:
                return flag
            rv = as_float(tree_vdot(r_hat, v))
            if not abs(rv) > tiny * r_hat_norm * v_norm:
                return "breakdown"
            alpha = rho / rv
            s = tree_axpy(-alpha, v, r)
            s_rel = as_float(tree_norm(s)) / self.b_norm
            if s_rel <= self.tol:  # the half step already meets tol
                x = tree_axpy(alpha, p, x)
                info.iterations += 1
                info.residuals.append(s_rel)
                info.residual = s_rel
                self._keep(x, s_rel)
                return "claimed"
            t, t_norm, flag = self._product(s, s_rel * self.b_norm)
            if flag == "diverged":
                return self._diverged("NaN/Inf in the BiCGStab recurrence (overflow).")
            if flag is not None:
                x = tree_axpy(alpha, p, x)
                self._keep(x, s_rel)
                return flag
            ts = as_float(tree_vdot(t, s))
            omega = ts / (t_norm * t_norm)
            x = tree_axpy(omega, s, tree_axpy(alpha, p, x))
            r = tree_axpy(-omega, t, s)
            info.iterations += 1
            rel = as_float(tree_norm(r)) / self.b_norm
            info.residuals.append(rel)
            info.residual = rel
            if not math.isfinite(rel) or not math.isfinite(omega):
                return self._diverged("NaN/Inf in the BiCGStab recurrence (overflow).")
            self._keep(x, rel)
            if rel <= self.tol:
                return "claimed"
            if rel > GROWTH_LIMIT * self.best_rel:
                return self._diverged(
                    "The residual grew far above its best value (the iterate is blowing up, "
                    "e.g. on a singular inconsistent system); the best iterate is returned."
                )
            if not abs(ts) > tiny * t_norm * s_rel * self.b_norm:
                return "breakdown"
            rho_old = rho
        return "maxiter"


def _final(status: str, rel: float, info: SolveInfo, run: _Run, maxiter: int) -> bool:
    """Whether a run whose recomputed residual ``rel`` misses tol ends at ``status``: a singular
    stop, a breakdown without progress, or the budget spent (each reported, warned where it is a
    failure); False for "claimed", which restarts."""
    if status == "singular":
        info.extras["singular"] = True
        info.extras["lstsq_residual"] = rel  # the best BiCGStab reached, not a minimum
        detail = (
            "the operator product is exactly zero."
            if info.extras.get("zero_operator")
            else "the system is singular and inconsistent: BiCGStab met a null vector of "
            "the operator (A u = 0 up to rounding) with the residual above tol."
        )
        warn_singular(info, detail)
        return True
    if status == "breakdown":
        info.extras["stalled"] = True
        emit(
            info,
            "bicgstab: the recurrence broke down twice without progress (rho or omega "
            "vanished): the system may be singular and inconsistent (no x meets tol), or "
            "BiCGStab does not suit this operator; use GMRES, or add damping.",
            SolverStalledWarning,
        )
        return True
    if status == "maxiter" or info.iterations >= maxiter:
        if run.best_it == 0 and info.extras.get("restarts", 0) == 0:
            info.extras["stalled"] = True  # no iteration improved on the start
            emit(
                info,
                "bicgstab: no iterate improved on the starting residual in the whole run: "
                "the system may be singular and inconsistent, or BiCGStab does not suit "
                "this operator; use GMRES, or add damping.",
                SolverStalledWarning,
            )
        return True
    return False


def _warn_mismatch(info: SolveInfo) -> None:
    """The recurrence met tol, the recomputed residual does not, and restarting is over."""
    info.extras["residual_mismatch"] = True
    warn(
        "bicgstab: the recurrence residual met tol but the recomputed residual "
        "||Ax - b||/||b|| does not (both in SolveInfo: residual, "
        "extras['recurrence_residual']): the system is too ill-conditioned for this "
        "tolerance in this precision; loosen tol, add damping, or use float64",
        HypergradWarning,
    )
