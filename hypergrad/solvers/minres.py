"""MINRES (Paige & Saunders 1975) for symmetric, possibly indefinite systems."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..settings import count, number
from ..tree import Tensors, tree_axpy, tree_norm, tree_scale, tree_vdot, tree_zeros_like
from .base import (
    MatVec,
    SolveInfo,
    Solver,
    as_float,
    check_product,
    damped,
    functional_form,
    report_failure,
    warn_diverged,
)
from .krylov import Candidate, default_maxiter, lstsq_rtols, start, verified_krylov


@dataclass(kw_only=True)
class MINRES(Solver):
    """MINRES: for symmetric indefinite Hessians (non-convex inner problems).

    Convergence is verified with one recomputed residual; a singular system whose right-hand
    side is not in the Hessian's range is reported (``info.extras["singular"]``, the
    least-squares floor in ``info.extras["lstsq_residual"]``) with a
    :class:`~hypergrad.SingularSystemWarning` instead of a meaningless "converged" (below).

    MINRES minimises ``||(A + damping I) x - b||`` over the Krylov space, so it is safe on
    indefinite Hessians (saddle points, non-convex inner problems) where CG breaks down.

    What is reported (see :func:`~hypergrad.solvers.krylov.verified_krylov`):

    * the Lanczos recurrence tracks ``||r||`` and, one iteration late, ``||A r||``
      (Paige & Saunders 1975) at no extra product; ``residuals`` is that history;
    * before claiming convergence one more product recomputes ``r = b - A x``: ``residual`` is
      that value and ``converged`` means it met ``tol`` (``extras["recurrence_residual"]`` keeps
      the recurrence's value; a mismatch restarts the iteration from the true residual);
    * ``||A r|| ~ 0`` (relative to ``||A|| ||r||``, see
      :func:`~hypergrad.solvers.krylov.lstsq_rtols`) with ``||r||`` above ``tol`` means ``x``
      already minimises ``||Ax - b||``: the system is singular and ``b`` has a component outside
      the range of ``A`` (thresholds: :func:`~hypergrad.solvers.krylov.lstsq_rtols`). The
      iteration stops there (the next step would divide by a vanishing pivot and blow ``x`` up),
      or, when rounding hid it, falls back to that iterate at the end; it sets
      ``extras["singular"]``, ``extras["lstsq_residual"]`` (the least-squares floor) and warns
      with :class:`~hypergrad.SingularSystemWarning`. An operator whose first product is exactly
      zero also sets ``extras["zero_operator"]``.

    Args:
        maxiter: iteration cap, >= 1 (None: ``min(2 * numel, 1000)``).
        tol: relative residual tolerance, finite and >= 0.
        damping: added to the diagonal, finite and >= 0.

    Example:
        >>> A = torch.diag(torch.tensor([2.0, -1.0], dtype=torch.float64))
        >>> x, info = MINRES(tol=1e-10).solve(lambda v: (A @ v[0],),
        ...                                   (torch.ones(2, dtype=torch.float64),))
        >>> x[0]
        tensor([ 0.5000, -1.0000], dtype=torch.float64)
    """

    name = "minres"
    display = "MINRES"
    symmetric_only = True
    maxiter: int | None = count(None, minimum=1, why=" (zero iterations give no solution)")
    tol: float = number(1e-6)
    damping: float = number(0.0)

    def solve(
        self, matvec: MatVec, b: Tensors, x0: Tensors | None = None
    ) -> tuple[Tensors, SolveInfo]:
        """Solve ``(A + damping I) x = b`` for symmetric ``A`` by MINRES (what is reported is
        the class docstring's).

        Returns:
            ``(x, info)``.

        Raises:
            HypergradValueError: a product of the operator returned NaN/Inf.
        """
        op = damped(matvec, self.damping)
        maxiter = default_maxiter(b) if self.maxiter is None else self.maxiter
        info = SolveInfo(solver=self.name)
        tol = self.tol
        info.extras["singular"] = False
        started = start(op, b, x0, info, self.display)
        if started is None:
            return tree_zeros_like(b), info
        box, b_norm = list(started[:2]), started[2]
        del started  # the iteration takes x and r out of ``box``: nothing else keeps them alive

        run = _MINRESRun(self, op, b, info, b_norm)
        x = verified_krylov(run.iterate, op, b, box, b_norm, tol, maxiter, info, self.display)
        report_failure(info)
        return x, info


class _MINRESRun:
    """One :meth:`MINRES.solve`: its operator, report and thresholds, and :meth:`iterate`, the
    Lanczos + QR loop that :func:`~hypergrad.solvers.krylov.verified_krylov` runs."""

    def __init__(self, solver: MINRES, op: MatVec, b: Tensors, info: SolveInfo, b_norm: float):
        self.display, self.tol = solver.display, solver.tol
        self.op, self.b, self.info, self.b_norm = op, b, info, b_norm
        self.stop_rtol, self.suspect_rtol = lstsq_rtols(b)

    def iterate(self, box: list[Tensors], budget: int) -> tuple[str, Tensors, Candidate | None]:
        """Run at most ``budget`` iterations from ``box = [x, r]``: a stop and the iterate."""
        info, op, b_norm, tol = self.info, self.op, self.b_norm, self.tol
        x, r1 = box
        box.clear()
        # Lanczos + QR state (scalars on the host, vectors as flat pytrees).
        beta1 = as_float(tree_norm(r1))
        y, r2 = r1, r1
        old_beta, beta = 0.0, beta1
        dbar, epsln, phibar = 0.0, 0.0, beta1
        cs, sn = -1.0, 0.0
        a_norm = 0.0  # max_k ||A v_k||: a lower bound on ||A||
        w = tree_zeros_like(self.b)
        w2 = tree_zeros_like(self.b)
        candidate = None
        for k in range(1, budget + 1):
            v = tree_scale(1.0 / beta, y)
            av = op(v)
            info.matvecs += 1
            y = av if k == 1 else tree_axpy(-beta / old_beta, r1, av)
            alfa = as_float(tree_vdot(v, y))
            y = tree_axpy(-alfa / beta, r2, y)
            r1, r2 = r2, y
            beta_k = beta if k >= 2 else 0.0  # the off-diagonal entry above alfa in T_k
            old_beta, beta = beta, as_float(tree_norm(y))
            if not (math.isfinite(alfa) and math.isfinite(beta)):
                check_product(self.display, f"iteration {info.iterations + 1}", v, av)
                info.diverged = True
                warn_diverged(info, "NaN/Inf in the MINRES recurrence.")
                return "diverged", x, candidate
            # column k of the Lanczos matrix is (beta_k, alfa, beta): its norm is ||A v_k||
            a_norm = max(a_norm, math.sqrt(beta_k**2 + alfa**2 + beta**2))
            old_eps = epsln
            delta = cs * dbar + sn * alfa
            gbar = sn * dbar - cs * alfa
            epsln = sn * beta
            dbar = -cs * beta
            # ||A r|| of the current x is |phibar| * hypot(gbar, dbar) (Paige & Saunders):
            # when it vanishes relative to ||A|| ||r||, x minimises ||Ax - b|| and, as
            # ||r|| > tol, the system is inconsistent; the pivot gamma below would vanish too
            ar_over_r = math.hypot(gbar, dbar)  # ||A r|| / ||r||
            if ar_over_r <= self.stop_rtol * a_norm:
                self._singular(phibar, a_norm)
                return "singular", x, candidate
            if candidate is None and ar_over_r <= self.suspect_rtol * a_norm:
                candidate = (x, abs(phibar) / b_norm, info.iterations)
            gamma = math.hypot(gbar, beta)
            cs, sn = gbar / gamma, beta / gamma
            phi = cs * phibar
            phibar = sn * phibar
            w1, w2 = w2, w
            w = tree_scale(1.0 / gamma, tree_axpy(-delta, w2, tree_axpy(-old_eps, w1, v)))
            x = tree_axpy(phi, w, x)
            info.iterations += 1
            rel = abs(phibar) / b_norm
            info.residual = rel
            info.residuals.append(rel)
            if rel <= tol:
                return "claimed", x, candidate
            if beta == 0.0:  # Krylov space exhausted: x is the solution within it
                return "exhausted", x, candidate
        return "maxiter", x, candidate

    def _singular(self, phibar: float, a_norm: float) -> None:
        """Report the singular stop: ``x`` minimises ``||Ax - b||`` with ``||r||`` above tol."""
        info = self.info
        info.extras["singular"] = True
        info.extras["lstsq_residual"] = abs(phibar) / self.b_norm
        info.extras["lstsq_iteration"] = info.iterations
        if a_norm == 0.0:
            info.extras["zero_operator"] = True


@functional_form(MINRES)
def solve_minres(
    matvec: MatVec, b: Tensors, x0: Tensors | None = None, **settings: Any
) -> tuple[Tensors, SolveInfo]:
    """``MINRES(**settings).solve(matvec, b, x0)``: MINRES as a function (the settings are
    :class:`MINRES`'s, keyword-only and validated the same way).

    Example:
        >>> A = torch.tensor([[1.0, 2.0], [2.0, -3.0]], dtype=torch.float64)  # indefinite
        >>> x, info = solve_minres(lambda v: (A @ v[0],), (torch.ones(2, dtype=torch.float64),))
        >>> torch.allclose(A @ x[0], torch.ones(2, dtype=torch.float64))
        True
        >>> S = torch.diag(torch.tensor([2.0, 0.0], dtype=torch.float64))  # singular
        >>> import warnings
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")
        ...     x, info = solve_minres(lambda v: (S @ v[0],), (torch.ones(2, dtype=torch.float64),))
        >>> info.converged, info.extras["singular"], round(info.extras["lstsq_residual"], 4)
        (False, True, 0.7071)
    """
    return MINRES(**settings).solve(matvec, b, x0)
