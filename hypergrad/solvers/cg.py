"""Conjugate gradient for symmetric positive-definite systems ``(A + damping I) x = b``."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import HypergradTypeError, HypergradValueError
from ..tree import Tensors, tree_axpy, tree_vdot, tree_zeros_like
from .base import (
    MatVec,
    SolveInfo,
    Solver,
    as_float,
    check_iters,
    check_number,
    check_product,
    damped,
    default_maxiter,
    report_failure,
    start,
    verified_krylov,
    warn_diverged,
)
from .precond import DensePreconditioner


def solve_cg(
    matvec: MatVec,
    b: Tensors,
    x0: Tensors | None = None,
    *,
    maxiter: int | None = None,
    tol: float = 1e-6,
    damping: float = 0.0,
    preconditioner: Preconditioner | None = None,
    probes: int = 16,
    seed: int = 0,
) -> tuple[Tensors, SolveInfo]:
    """Solve ``(A + damping I) x = b`` by (preconditioned) conjugate gradient.

    Stops when the recurrence residual is ``<= tol * ||b||``; one more product then recomputes
    ``r = b - A x``, and that value is ``info.residual`` and alone decides ``converged`` (see
    :func:`~hypergrad.solvers.base.verified_krylov`). A negative curvature ``p^T A p < 0``
    means the operator is not positive definite: the iteration stops, ``diverged`` is set and a
    warning suggests MINRES or damping (CG would otherwise return garbage silently).

    A singular system whose right-hand side has a component outside the operator's range (a
    parameter absent from the inner batch but present in the outer one) has no solution, and
    CG's iterate grows without bound along the null space. Two tests stop it
    (:func:`singular_limits`): a search direction of numerically zero curvature
    (``|p^T A p| <= 100 eps ||A|| ||p||^2``), or a residual more than ``(100 eps)^-1/2`` times
    above its minimum (6.7e6 in float64), neither possible for an SPD operator with condition
    number below ``1 / (100 eps)``. CG then returns the iterate with the smallest recurrence
    residual (``extras["best_iteration"]``, 0 for the start), recomputes its residual and, unless
    that meets ``tol`` (a consistent system after all), sets ``extras["singular"]``
    (``extras["singular_test"]`` says which test fired) and warns with
    :class:`~hypergrad.SingularSystemWarning`.

    Args:
        matvec: ``v -> A v`` on flat pytrees.
        b: right-hand side.
        x0: initial guess (zeros when None).
        maxiter: iteration cap; None gives ``min(2 * numel(b), 1000)``.
        tol: relative residual tolerance.
        damping: Tikhonov damping added to the diagonal.
        preconditioner: None; a callable ``r -> M r`` applying a symmetric positive-definite
            approximation ``M`` of ``(A + damping I)^-1`` to a pytree like ``b``; or
            ``"hutchinson"``: Jacobi preconditioning with the diagonal of ``A + damping I``
            estimated from ``probes`` Rademacher products (Hutchinson's estimator, seeded by
            ``seed``; see :func:`hutchinson_diagonal`); or a
            :class:`~hypergrad.DensePreconditioner` (a dense factor kept across solves).
            Preconditioning changes the number of
            iterations, never the solution: convergence is judged on the true residual
            ``||b - (A + damping I) x|| / ||b||``.
        probes: products spent on the ``"hutchinson"`` estimate (counted in ``info.matvecs``).
        seed: seed of the Hutchinson probes.

    Returns:
        ``(x, info)``; ``info.extras["preconditioner"]`` names the preconditioner.

    Raises:
        HypergradValueError: a product of the operator returned NaN/Inf, or the preconditioner
            is not positive definite (``r^T M r <= 0``).

    Example:
        >>> A = torch.tensor([[4.0, 1.0], [1.0, 3.0]], dtype=torch.float64)
        >>> x, info = solve_cg(lambda v: (A @ v[0],), (torch.ones(2, dtype=torch.float64),))
        >>> bool(info.converged)
        True
    """
    op = damped(matvec, damping)
    maxiter = default_maxiter(b) if maxiter is None else maxiter
    info = SolveInfo(solver="cg")
    started = start(op, b, x0, info)
    if started is None:
        return tree_zeros_like(b), info
    box, b_norm = list(started[:2]), started[2]
    del started  # the iteration takes x and r out of ``box``: nothing else keeps them alive
    apply = _preconditioner(preconditioner, op, b, info, probes, seed)

    curvature_rtol, growth_limit = singular_limits(b)

    def iterate(box: list[Tensors], budget: int) -> tuple[str, Tensors, None]:
        x, r = box
        box.clear()
        z = apply(r)
        p = z
        rs = _positive(tree_vdot(r, z), preconditioner)
        a_norm = 0.0  # max ||A p|| / ||p|| so far: a lower bound on ||A||
        # the iterate with the smallest recurrence residual (a reference: no copy until x moves on)
        best_x, best_rel, best_it = x, info.residual, info.iterations
        for _ in range(budget):
            ap = op(p)
            info.matvecs += 1
            pap = tree_vdot(p, ap)
            pap_f, pp, apap = torch.stack([pap, tree_vdot(p, p), tree_vdot(ap, ap)]).tolist()
            if not (math.isfinite(pap_f) and math.isfinite(apap)):
                check_product("CG", f"iteration {info.iterations + 1}", p, ap)
                info.diverged = True
                warn_diverged(info, "NaN/Inf in the CG recurrence (overflow).")
                return "diverged", x, None
            if apap == 0.0 and pap_f == 0.0:
                info.diverged = True
                info.extras["negative_curvature"] = pap_f
                info.extras["zero_operator"] = True
                warn_diverged(
                    info,
                    "The Hessian-vector product is exactly zero (no curvature in this direction, "
                    "e.g. an inner loss linear in the parameters): the operator is not positive "
                    "definite; add damping.",
                )
                return "diverged", x, None
            a_norm = max(a_norm, math.sqrt(apap / pp))
            if abs(pap_f) <= curvature_rtol * a_norm * pp:  # p is numerically in the null space
                info.extras.update(singular=True, singular_test="curvature")
                return _best(info, best_x, best_rel, best_it)
            if pap_f < 0.0:
                info.diverged = True
                info.extras["negative_curvature"] = pap_f
                warn_diverged(info, "The operator is not positive definite: use MINRES or damping.")
                return "diverged", x, None
            alpha = rs / pap
            x = tree_axpy(alpha, p, x)
            r = tree_axpy(-alpha, ap, r)
            info.iterations += 1
            rr = tree_vdot(r, r)
            rel = as_float(rr.sqrt()) / b_norm
            info.residuals.append(rel)
            info.residual = rel
            if rel != rel:
                info.diverged = True
                warn_diverged(info, "NaN in the residual.")
                return "diverged", x, None
            if rel <= tol:
                return "claimed", x, None
            if rel < best_rel:
                best_x, best_rel, best_it = x, rel, info.iterations
            elif rel > growth_limit * best_rel:  # impossible for SPD A with cond < 1/rtol
                info.extras.update(singular=True, singular_test="growth")
                return _best(info, best_x, best_rel, best_it)
            if preconditioner is None:  # M = I: r^T M r is the residual's square norm
                z, rs_new = r, rr
            else:
                z = apply(r)
                rs_new = _positive(tree_vdot(r, z), preconditioner)
            p = tree_axpy(rs_new / rs, p, z)
            rs = rs_new
        return "maxiter", x, None

    x = verified_krylov(iterate, op, b, box, b_norm, tol, maxiter, info, "CG")
    report_failure(info)
    return x, info


Preconditioner = Callable[[Tensors], Tensors] | str | DensePreconditioner

#: Relative curvature ``p^T A p / (||p||^2 ||A||)`` at or below which (times the machine epsilon
#: of ``b``'s least precise dtype) CG treats a search direction as lying in the null space.
CURVATURE_RTOL_EPS = 100


def singular_limits(b: Tensors) -> tuple[float, float]:
    """CG's two tests for a singular, inconsistent system: ``(curvature_rtol, growth_limit)``.

    ``curvature_rtol = 100 eps`` (``eps`` of the least precise dtype of ``b``, as MINRES's
    least-squares test): a search direction ``p`` with ``|p^T A p| <= curvature_rtol * ||A|| *
    ||p||^2`` (``||A||`` estimated by ``max ||A p|| / ||p||`` over the iteration) has numerically
    zero curvature: the step ``alpha = r^T z / p^T A p`` would divide by rounding noise. For a
    nonsingular SPD ``A`` the ratio is at least ``1 / cond(A)``, so the test only fires when
    ``cond(A) > 1 / curvature_rtol`` (4.5e13 in float64, 8.4e4 in float32).

    ``growth_limit = curvature_rtol ** -1/2``: for SPD ``A`` the (preconditioned or not) CG
    residual never exceeds ``sqrt(cond(A))`` times an earlier one (``||r_k||^2 <= lambda_max
    ||e_k||_A^2 <= lambda_max ||e_j||_A^2 <= cond(A) ||r_j||^2``, as the ``A``-norm of the error
    does not increase), so a residual that grows more than ``growth_limit`` times above its
    minimum proves the same ``cond(A) > 1 / curvature_rtol``.

    On a singular system whose right-hand side has a component outside the range (an
    inconsistent system) CG's iterate grows without bound along the null space (the
    least-squares residual cannot reach ``tol``); one of the two tests fires as it does.
    """
    eps = max(torch.finfo(t.dtype).eps for t in b)
    rtol = CURVATURE_RTOL_EPS * eps
    return rtol, rtol**-0.5


def _best(info: SolveInfo, x: Tensors, rel: float, iteration: int) -> tuple[str, Tensors, None]:
    """The "singular" stop of CG: return the iterate with the smallest recurrence residual."""
    info.residual = rel
    info.extras["best_iteration"] = iteration
    return "singular", x, None


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


@dataclass(kw_only=True)
class CG(Solver):
    """Conjugate gradient: the default for convex inner problems (SPD Hessian).

    Needs about sqrt(condition number) iterations. Use :class:`MINRES` when the Hessian may be
    indefinite (non-convex inner problem), or add ``damping``.

    ``info.converged`` is verified with one recomputed residual (one product more than the
    iterations when the iteration claims convergence). A singular system whose right-hand side
    is outside the Hessian's range is stopped, reported (``extras["singular"]``) and warned about
    (:class:`~hypergrad.SingularSystemWarning`), with the best iterate returned (see
    :func:`~hypergrad.solvers.solve_cg`). Settings are fixed at construction:
    ``solver.replace(tol=...)`` builds a changed copy.

    Args:
        maxiter: iteration cap, >= 1 (None: ``min(2 * numel, 1000)``).
        tol: relative residual tolerance, finite and >= 0.
        damping: added to the diagonal, i.e. solves ``(H + damping I) x = b`` (finite, >= 0).
        preconditioner: None, a callable ``r -> M r`` (``M`` symmetric positive definite,
            approximating the inverse), ``"hutchinson"`` (Jacobi with a Hutchinson estimate
            of the diagonal from ``probes`` products per solve), or a
            :class:`~hypergrad.DensePreconditioner` (the dense factor of an earlier solve's
            operator, reused while it keeps the iterations cheap: for outer loops, where the
            Hessian drifts slowly); see :func:`solve_cg`.
        probes: products for the ``"hutchinson"`` diagonal.
        seed: seed of the Hutchinson probes.

    Example:
        >>> solver = CG(maxiter=50, tol=1e-8)
        >>> A = torch.eye(3, dtype=torch.float64) * 2
        >>> x, info = solver.solve(lambda v: (A @ v[0],), (torch.ones(3, dtype=torch.float64),))
        >>> x[0]
        tensor([0.5000, 0.5000, 0.5000], dtype=torch.float64)
    """

    maxiter: int | None = None
    tol: float = 1e-6
    damping: float = 0.0
    preconditioner: Preconditioner | None = None
    probes: int = 16
    seed: int = 0
    name = "cg"

    def __post_init__(self) -> None:
        self.maxiter = check_iters(
            "CG maxiter", self.maxiter, minimum=1, why=" (zero iterations give no solution)"
        )
        self.tol = check_number("CG tol", self.tol)
        self.damping = check_number("CG damping", self.damping)
        if self.preconditioner is not None and not (
            callable(self.preconditioner)
            or isinstance(self.preconditioner, DensePreconditioner)
            or self.preconditioner == "hutchinson"
        ):
            raise HypergradTypeError(
                "CG preconditioner must be None, a callable r -> M r, 'hutchinson' or a "
                f"DensePreconditioner, got {self.preconditioner!r}"
            )
        self.probes = check_iters("CG probes", self.probes, minimum=1, allow_none=False)
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral):
            raise HypergradTypeError(f"CG seed must be an int, got {self.seed!r}")
        self.seed = int(self.seed)
        self._freeze()

    def solve(
        self, matvec: MatVec, b: Tensors, x0: Tensors | None = None
    ) -> tuple[Tensors, SolveInfo]:
        return solve_cg(
            matvec, b, x0, maxiter=self.maxiter, tol=self.tol, damping=self.damping,
            preconditioner=self.preconditioner, probes=self.probes, seed=self.seed,
        )  # fmt: skip
