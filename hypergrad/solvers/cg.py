"""Conjugate gradient for symmetric positive-definite systems ``(A + damping I) x = b``."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ..errors import HypergradTypeError, HypergradValueError
from ..settings import count, integer, number
from ..tree import Tensors, tree_axpy, tree_vdot, tree_zeros_like
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
    warn_singular,
)
from .functional import IterativeKernel, Op, Stats, axpy, dot, select
from .krylov import default_maxiter, singular_limits, start, verified_krylov
from .precond import DensePreconditioner

Preconditioner = Callable[[Tensors], Tensors] | str | DensePreconditioner


@dataclass(kw_only=True)
class CG(Solver):
    """Conjugate gradient: the default for convex inner problems (SPD Hessian).

    Needs about sqrt(condition number) iterations. Use :class:`MINRES` when the Hessian may be
    indefinite (non-convex inner problem), or add ``damping``. Settings are fixed at
    construction: ``solver.replace(tol=...)`` builds a changed copy.

    The iteration stops when the recurrence residual is ``<= tol * ||b||``; one more product then
    recomputes ``r = b - A x``, and that value is ``info.residual`` and alone decides
    ``info.converged`` (see :func:`~hypergrad.solvers.krylov.verified_krylov`). A negative
    curvature ``p^T A p < 0`` means the operator is not positive definite: the iteration stops,
    ``diverged`` is set and a warning suggests MINRES or damping (CG would otherwise return
    garbage silently).

    A singular system whose right-hand side has a component outside the operator's range (a
    parameter absent from the inner batch but present in the outer one) has no solution, and
    CG's iterate grows without bound along the null space. Two tests stop it
    (:func:`~hypergrad.solvers.krylov.singular_limits`): a search direction of numerically zero
    curvature (``|p^T A p| <= 100 eps ||A|| ||p||^2``), or a residual more than
    ``(100 eps)^-1/2`` times above its minimum (6.7e6 in float64), neither possible for an SPD
    operator with condition number below ``1 / (100 eps)``. CG then returns the iterate with the
    smallest recurrence residual (``extras["best_iteration"]``, 0 for the start), recomputes its
    residual and, unless that meets ``tol`` (a consistent system after all), sets
    ``extras["singular"]`` (``extras["singular_test"]`` says which test fired) and warns with
    :class:`~hypergrad.SingularSystemWarning`.

    Args:
        maxiter: iteration cap, >= 1 (None: ``min(2 * numel, 1000)``).
        tol: relative residual tolerance, finite and >= 0.
        damping: added to the diagonal, i.e. solves ``(H + damping I) x = b`` (finite, >= 0).
        preconditioner: None; a callable ``r -> M r`` applying a symmetric positive-definite
            approximation ``M`` of ``(A + damping I)^-1`` to a pytree like ``b``;
            ``"hutchinson"``: Jacobi preconditioning with the diagonal of ``A + damping I``
            estimated from ``probes`` Rademacher products per solve (Hutchinson's estimator,
            seeded by ``seed``; see :func:`hutchinson_diagonal`); or a
            :class:`~hypergrad.DensePreconditioner` (the dense factor of an earlier solve's
            operator, reused while it keeps the iterations cheap: for outer loops, where the
            Hessian drifts slowly). Preconditioning changes the number of iterations, never the
            solution: convergence is judged on the true residual
            ``||b - (A + damping I) x|| / ||b||``. It is set up at the first iteration (a warm
            start that already meets ``tol`` costs no preconditioner products).
        probes: products spent on the ``"hutchinson"`` estimate (counted in ``info.matvecs``).
        seed: seed of the Hutchinson probes.

    Example:
        >>> solver = CG(maxiter=50, tol=1e-8)
        >>> A = torch.eye(3, dtype=torch.float64) * 2
        >>> x, info = solver.solve(lambda v: (A @ v[0],), (torch.ones(3, dtype=torch.float64),))
        >>> x[0]
        tensor([0.5000, 0.5000, 0.5000], dtype=torch.float64)
    """

    name = "cg"
    display = "CG"
    symmetric_only = True
    maxiter: int | None = count(None, minimum=1, why=" (zero iterations give no solution)")
    tol: float = number(1e-6)
    damping: float = number(0.0)
    preconditioner: Preconditioner | None = None
    probes: int = count(16, minimum=1, allow_none=False)
    seed: int = integer(0)

    def check(self) -> None:
        if self.preconditioner is not None and not (
            callable(self.preconditioner)
            or isinstance(self.preconditioner, DensePreconditioner)
            or self.preconditioner == "hutchinson"
        ):
            raise HypergradTypeError(
                "CG preconditioner must be None, a callable r -> M r, 'hutchinson' or a "
                f"DensePreconditioner, got {self.preconditioner!r}"
            )

    def solve(
        self, matvec: MatVec, b: Tensors, x0: Tensors | None = None
    ) -> tuple[Tensors, SolveInfo]:
        """Solve ``(A + damping I) x = b`` by (preconditioned) conjugate gradient: the stopping
        rule, the curvature checks and the singular-system stop are the class docstring's.

        Returns:
            ``(x, info)``; ``info.extras["preconditioner"]`` names the preconditioner.

        Raises:
            HypergradValueError: a product of the operator returned NaN/Inf, or the
                preconditioner is not positive definite (``r^T M r <= 0``).
        """
        op = damped(matvec, self.damping)
        maxiter = default_maxiter(b) if self.maxiter is None else self.maxiter
        info = SolveInfo(solver=self.name)
        started = start(op, b, x0, info, self.display)
        if started is None:
            return tree_zeros_like(b), info
        box, b_norm = list(started[:2]), started[2]
        del started  # the iteration takes x and r out of ``box``: nothing else keeps them alive
        run = _CGRun(self, op, b, info, b_norm)
        x = verified_krylov(run.iterate, op, b, box, b_norm, self.tol, maxiter, info, self.display)
        report_failure(info)
        return x, info

    def kernel(self) -> CGKernel:
        """:meth:`solve`'s iteration as a masked kernel (:class:`CGKernel`), for
        :func:`~hypergrad.compile_implicit_grad`.

        Raises:
            HypergradValueError: a preconditioner (the kernel has none).
        """
        if self.preconditioner is not None:
            raise HypergradValueError(
                "compile_implicit_grad does not support CG preconditioners; use hg.implicit_grad"
            )
        return CGKernel(self)


@functional_form(CG)
def solve_cg(
    matvec: MatVec, b: Tensors, x0: Tensors | None = None, **settings: Any
) -> tuple[Tensors, SolveInfo]:
    """``CG(**settings).solve(matvec, b, x0)``: conjugate gradient as a function (the settings
    are :class:`CG`'s, keyword-only and validated the same way).

    Example:
        >>> A = torch.tensor([[4.0, 1.0], [1.0, 3.0]], dtype=torch.float64)
        >>> x, info = solve_cg(lambda v: (A @ v[0],), (torch.ones(2, dtype=torch.float64),))
        >>> bool(info.converged)
        True
    """
    return CG(**settings).solve(matvec, b, x0)


class CGState(NamedTuple):
    """What the CG kernel carries from one step to the next (:meth:`CG.solve`'s locals)."""

    x: Tensors  # the iterate
    r: Tensors  # the recurrence residual b - (H + damping I) x
    p: Tensors  # the search direction
    rs: torch.Tensor  # r . r
    stop: torch.Tensor  # (tol ||b||)^2: stop once rs is at or below it
    done: torch.Tensor  # bool: no further iteration runs
    negative_curvature: torch.Tensor  # bool: a direction of negative (or NaN) curvature
    singular: torch.Tensor  # 0, or 1 for the curvature test and 2 for the growth test
    best_x: Tensors  # the iterate with the smallest residual, returned on a singular stop
    best_rs: torch.Tensor  # its rs
    a_norm: torch.Tensor  # the running estimate of ||A|| of the singular tests
    iterations: torch.Tensor


class CGKernel(IterativeKernel[CG, CGState]):
    """:meth:`CG.solve` without a preconditioner, masked (:mod:`~hypergrad.solvers.functional`):
    the same steps and tests (negative curvature, the two singular-system tests and the best
    iterate) on tensors; no restart when the recurrence residual and the recomputed one disagree
    (the recomputed residual still decides ``converged``)."""

    vectors = ("x", "r", "p", "best_x")
    fields = ("singular",)

    def init(self, b: Tensors, r: Tensors, x0: Tensors) -> CGState:
        false, zero = torch.zeros((), dtype=torch.bool), torch.zeros((), dtype=torch.int64)
        rs = dot(r, r)
        stop = self.solver.tol**2 * dot(b, b)
        return CGState(
            x=x0, r=r, p=r, rs=rs, stop=stop, done=rs <= stop, negative_curvature=false,
            singular=zero, best_x=x0, best_rs=rs, a_norm=torch.zeros_like(rs), iterations=zero,
        )  # fmt: skip

    def step(self, op: Op, state: CGState, active: torch.Tensor) -> CGState:
        x, r, p, rs, stop, done = state.x, state.r, state.p, state.rs, state.stop, state.done
        negc, sing, its = state.negative_curvature, state.singular, state.iterations
        best_x, best_rs, a_norm = state.best_x, state.best_rs, state.a_norm
        crtol, glimit = singular_limits(x)
        ap = op(p)
        pap, pp, apap = dot(p, ap), dot(p, p), dot(ap, ap)
        broken = ~(torch.isfinite(pap) & torch.isfinite(apap)) | ((apap == 0) & (pap == 0))
        neg = active & broken
        a_norm = torch.where(active & ~broken, torch.maximum(a_norm, (apap / pp).sqrt()), a_norm)
        flat = active & ~broken & (pap.abs() <= crtol * a_norm * pp)
        neg = neg | (active & ~broken & ~flat & (pap < 0))
        sing = torch.where(flat & (sing == 0), torch.ones_like(sing), sing)
        negc, active = negc | neg, active & ~neg & ~flat
        a = torch.where(active, rs / pap, torch.zeros_like(rs))
        x, r = axpy(a, p, x), axpy(-a, ap, r)
        rs_new = dot(r, r)
        claimed = active & (rs_new <= stop)
        better = active & ~claimed & (rs_new < best_rs)
        grew = active & ~claimed & ~better & (rs_new > glimit**2 * best_rs)
        sing = torch.where(grew & (sing == 0), torch.full_like(sing, 2), sing)
        best_x = select(better, x, best_x)
        best_rs = torch.where(better, rs_new, best_rs)
        beta = torch.where(active, rs_new / rs, torch.zeros_like(rs))
        p = tuple(torch.where(active, ri + (beta * pi).to(pi.dtype), pi) for ri, pi in zip(r, p))
        rs = torch.where(active, rs_new, rs)
        its = its + active.long()
        done = done | neg | flat | grew | claimed
        return CGState(
            x=x, r=r, p=p, rs=rs, stop=stop, done=done, negative_curvature=negc, singular=sing,
            best_x=best_x, best_rs=best_rs, a_norm=a_norm, iterations=its,
        )  # fmt: skip

    def answer(self, state: CGState, x0: Tensors) -> tuple[Tensors, dict[str, torch.Tensor]]:
        # a singular stop returns the iterate with the smallest residual
        x = select(state.singular > 0, state.best_x, state.x)
        return x, {"singular": state.singular, "diverged": state.negative_curvature}

    def diagnose(
        self, info: SolveInfo, st: Stats, own: dict[str, float], dtype: torch.dtype
    ) -> None:
        if info.diverged:
            info.extras["negative_curvature"] = True
            warn_diverged(info, "The operator is not positive definite: use MINRES or damping.")
        info.extras["singular"] = bool(own["singular"]) and not info.converged
        if info.extras["singular"]:
            info.extras["singular_test"] = "curvature" if own["singular"] == 1 else "growth"
            warn_singular(
                info,
                "the system is singular and inconsistent (or numerically singular): CG "
                "met a search direction of numerically zero curvature or a residual growing "
                "far above its minimum, where its iterate grows without bound; it stopped "
                "and returned the iterate with the smallest residual.",
            )


def _best(info: SolveInfo, x: Tensors, rel: float, iteration: int) -> tuple[str, Tensors, None]:
    """The "singular" stop of CG: return the iterate with the smallest recurrence residual."""
    info.residual = rel
    info.extras["best_iteration"] = iteration
    return "singular", x, None


class _CGRun:
    """One :meth:`CG.solve`: its settings and report, and :meth:`iterate`, the (preconditioned)
    conjugate gradient loop that :func:`~hypergrad.solvers.krylov.verified_krylov` runs."""

    def __init__(self, solver: CG, op: MatVec, b: Tensors, info: SolveInfo, b_norm: float):
        self.solver, self.op, self.b, self.info, self.b_norm = solver, op, b, info, b_norm
        self.preconditioner = solver.preconditioner
        self.curvature_rtol, self.growth_limit = singular_limits(b)
        # set up on the first iteration: a warm start that meets tol costs one product, no more
        self.applies: list[Callable[[Tensors], Tensors]] = []
        self.a_norm = 0.0  # max ||A p|| / ||p|| so far: a lower bound on ||A||

    def iterate(self, box: list[Tensors], budget: int) -> tuple[str, Tensors, None]:
        op, info, preconditioner = self.op, self.info, self.preconditioner
        x, r = box
        box.clear()
        if not self.applies:
            s = self.solver
            self.applies.append(_preconditioner(preconditioner, op, self.b, info, s.probes, s.seed))
        apply = self.applies[0]
        z = apply(r)
        p = z
        rs = _positive(tree_vdot(r, z), preconditioner)
        self.a_norm = 0.0
        # the iterate with the smallest recurrence residual (a reference: no copy until x moves on)
        best: tuple[Tensors, float, int] = (x, info.residual, info.iterations)
        for _ in range(budget):
            ap = op(p)
            info.matvecs += 1
            pap = tree_vdot(p, ap)
            # the residual's step is taken on the device before the checks below read it: one
            # host sync per iteration (the scalars travel together); x moves only after the
            # checks (a failed check returns it as it was), so no extra parameter-sized vector
            # is alive at the peak
            alpha = rs / pap
            r_new = tree_axpy(-alpha, ap, r)
            rr = tree_vdot(r_new, r_new)
            scalars = torch.stack([pap, tree_vdot(p, p), tree_vdot(ap, ap), rr.to(pap.dtype)])
            pap_f, pp, apap, rr_f = scalars.tolist()
            stop = self._curvature(p, ap, pap_f, pp, apap, x, best)
            if stop is not None:
                return stop
            r = r_new
            del r_new
            x = tree_axpy(alpha, p, x)
            stop, best = self._advance(x, rr_f, best)
            if stop is not None:
                return stop
            if preconditioner is None:  # M = I: r^T M r is the residual's square norm
                z, rs_new = r, rr
            else:
                z = apply(r)
                rs_new = _positive(tree_vdot(r, z), preconditioner)
            p = tree_axpy(rs_new / rs, p, z)
            rs = rs_new
        return "maxiter", x, None

    def _curvature(
        self,
        p: Tensors,
        ap: Tensors,
        pap_f: float,
        pp: float,
        apap: float,
        x: Tensors,
        best: tuple[Tensors, float, int],
    ) -> tuple[str, Tensors, None] | None:
        """The checks of ``p^T A p`` before the step (overflow, a zero operator, numerically
        zero and negative curvature): the stop they call for, or None."""
        info = self.info
        if not (math.isfinite(pap_f) and math.isfinite(apap)):
            check_product(self.solver.display, f"iteration {info.iterations + 1}", p, ap)
            info.diverged = True
            warn_diverged(info, "NaN/Inf in the CG recurrence (overflow).")
            return "diverged", x, None
        if apap == 0.0 and pap_f == 0.0:
            info.diverged = True
            info.extras["negative_curvature"] = pap_f
            info.extras["zero_operator"] = True
            warn_diverged(
                info,
                "The Hessian-vector product is exactly zero (no curvature in this "
                "direction, e.g. an inner loss linear in the parameters): the operator is "
                "not positive definite; add damping.",
            )
            return "diverged", x, None
        self.a_norm = max(self.a_norm, math.sqrt(apap / pp))
        # p is numerically in the null space
        if abs(pap_f) <= self.curvature_rtol * self.a_norm * pp:
            info.extras.update(singular=True, singular_test="curvature")
            return _best(info, *best)
        if pap_f < 0.0:
            info.diverged = True
            info.extras["negative_curvature"] = pap_f
            warn_diverged(info, "The operator is not positive definite: use MINRES or damping.")
            return "diverged", x, None
        return None

    def _advance(
        self, x: Tensors, rr_f: float, best: tuple[Tensors, float, int]
    ) -> tuple[tuple[str, Tensors, None] | None, tuple[Tensors, float, int]]:
        """Record the step to ``x`` (residual ``sqrt(rr_f)``): the stop it calls for (NaN,
        converged, or the singular growth test) or None, and the best iterate so far."""
        info = self.info
        info.iterations += 1
        rel = math.sqrt(rr_f) / self.b_norm if rr_f >= 0.0 else math.nan
        info.residuals.append(rel)
        info.residual = rel
        if rel != rel:
            info.diverged = True
            warn_diverged(info, "NaN in the residual.")
            return ("diverged", x, None), best
        if rel <= self.solver.tol:
            return ("claimed", x, None), best
        if rel < best[1]:
            best = (x, rel, info.iterations)
        elif rel > self.growth_limit * best[1]:  # impossible for SPD A with cond < 1/rtol
            info.extras.update(singular=True, singular_test="growth")
            return _best(info, *best), best
        return None, best


def hutchinson_diagonal(matvec: MatVec, like: Tensors, probes: int = 16, seed: int = 0) -> Tensors:
    """Hutchinson's estimate of the diagonal of a symmetric operator: ``mean_k z_k * (A z_k)``
    over ``probes`` Rademacher vectors ``z_k`` (entries +-1), drawn by a private generator.

    Unbiased; its error shrinks like ``1/sqrt(probes)`` times the size of the off-diagonal
    entries of each row. Costs ``probes`` products.

    Example:
        >>> A = torch.tensor([[4.0, 1.0], [1.0, 2.0]], dtype=torch.float64)
        >>> d = hutchinson_diagonal(lambda v: (A @ v[0],), (torch.zeros(2, dtype=torch.float64),),
        ...                         probes=2000)
        >>> [round(float(t), 1) for t in d[0]]
        [4.0, 2.0]
    """
    gen = torch.Generator().manual_seed(int(seed))
    acc = tree_zeros_like(like)
    for _ in range(probes):
        z = tuple(
            (torch.randint(0, 2, t.shape, generator=gen) * 2 - 1).to(t.dtype).to(t.device)
            for t in like
        )
        acc = tuple(a + zi * ai for a, zi, ai in zip(acc, z, matvec(z)))
    return tuple(a / probes for a in acc)


def _preconditioner(
    preconditioner: Preconditioner | None,
    op: MatVec,
    b: Tensors,
    info: SolveInfo,
    probes: int,
    seed: int,
) -> Callable[[Tensors], Tensors]:
    if preconditioner is None:
        info.extras["preconditioner"] = None
        return lambda r: r
    if isinstance(preconditioner, DensePreconditioner):
        return preconditioner.setup(op, b, info)
    if callable(preconditioner):
        info.extras["preconditioner"] = "callable"
        return preconditioner
    if preconditioner != "hutchinson":
        raise HypergradValueError(
            "preconditioner must be None, a callable r -> M r, 'hutchinson' or a "
            f"DensePreconditioner, got {preconditioner!r}"
        )
    diag = hutchinson_diagonal(op, b, probes, seed)
    info.matvecs += probes
    # a noisy estimate can be tiny or negative where the true diagonal is small: clamp it to a
    # fraction of its mean magnitude so that M stays positive definite and well scaled
    floor = 1e-3 * as_float(sum(d.abs().sum() for d in diag)) / max(1, sum(d.numel() for d in diag))
    if not floor > 0:
        info.extras["preconditioner"] = "hutchinson (zero estimate: none)"
        return lambda r: r
    inv = tuple(1.0 / d.clamp(min=floor) for d in diag)
    info.extras.update(preconditioner="hutchinson", preconditioner_matvecs=probes)
    return lambda r: tuple(ri * di for ri, di in zip(r, inv))


def _positive(rz: torch.Tensor, preconditioner: Preconditioner | None) -> torch.Tensor:
    """``r^T M r``, which a positive-definite preconditioner keeps > 0 for ``r != 0``."""
    if preconditioner is not None and not as_float(rz) > 0:
        raise HypergradValueError(
            f"CG: the preconditioner gave r^T M r = {as_float(rz):.3g} <= 0 for a nonzero "
            "residual: it must be symmetric positive definite"
        )
    return rz
