"""What the Krylov solvers share: the common start of an iterative solve, the recomputed
residual, the verified run with residual replacement (restarts), and the singular-system
thresholds of CG (:func:`singular_limits`) and MINRES/GMRES/BiCGStab (:func:`lstsq_rtols`)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..errors import HypergradWarning, warn
from ..tree import Tensors, tree_norm, tree_numel, tree_sub, tree_zeros_like
from .base import MatVec, SolveInfo, as_float, check_product, warn_diverged, warn_singular


def start(
    op: MatVec, b: Tensors, x0: Tensors | None, info: SolveInfo, solver: str
) -> tuple[Tensors, Tensors, float] | None:
    """The common start of an iterative solve: ``(x, r, b_norm)``, or None when ``b = 0``.

    Records ``b_norm`` in ``info.extras``. A zero right-hand side has the solution 0: ``info``
    is marked converged with residual 0 and None is returned (the caller returns zeros). Otherwise
    ``x`` is ``x0`` (zeros when None) and ``r = b - op(x)``, recomputed with one product for a warm
    start (counted in ``info``; ``info.residual`` is its relative norm, 1 without a warm start).

    Raises:
        HypergradValueError: the product at the warm start returned NaN/Inf (``solver``, the
            display name, names the solver in the message).
    """
    b_norm = as_float(tree_norm(b))
    info.extras["b_norm"] = b_norm
    if b_norm == 0.0:
        info.residual, info.converged = 0.0, True
        return None
    if x0 is None:
        info.residual = 1.0
        return tree_zeros_like(b), b, b_norm
    r, info.residual = recomputed_residual(op, b, x0, b_norm, info, solver, "the warm start x0")
    return x0, r, b_norm


def default_maxiter(b: Tensors, cap: int = 1000) -> int:
    """Default iteration budget of the Krylov solvers: 2 * numel(b), capped at ``cap``."""
    return max(1, min(2 * tree_numel(b), cap))


def recomputed_residual(
    op: MatVec, b: Tensors, x: Tensors, b_norm: float, info: SolveInfo, solver: str, where: str
) -> tuple[Tensors, float]:
    """``r = b - op(x)`` and ``||r|| / ||b||``, with the operator product counted in ``info``.

    Raises:
        HypergradValueError: the product returned NaN/Inf for a finite ``x`` (see
            :func:`check_product`; ``solver`` and ``where`` name it).
    """
    r = tree_sub(b, op(x))
    info.matvecs += 1
    rel = as_float(tree_norm(r)) / b_norm
    if not math.isfinite(rel):
        check_product(solver, where, x, r)
    return r, rel


#: Restarts of CG/MINRES from the recomputed residual when the recurrence claimed convergence
#: but the recomputed residual missed ``tol`` (residual replacement).
MAX_RESTARTS = 2

#: What one run of a Krylov iteration returns: a status, the iterate and an optional
#: least-squares candidate ``(x, recurrence residual, iteration)``. Statuses: "claimed" (the
#: recurrence residual met tol), "maxiter", "singular" (a least-squares solution of an
#: inconsistent system was reached), "exhausted" (the Krylov space is invariant), "diverged".
Candidate = tuple[Tensors, float, int]
#: ``iterate(box, budget)``: ``box`` is the list ``[x, r]`` to start from, which ``iterate`` empties
#: (``x, r = box; box.clear()``) so that it holds the only references: the start's vectors are
#: freed as soon as the iteration replaces them (a caller frame holding them would keep one or
#: two parameter-sized vectors alive through the whole solve).
Iterate = Callable[[list[Tensors], int], tuple[str, Tensors, "Candidate | None"]]


def verified_krylov(
    iterate: Iterate,
    op: MatVec,
    b: Tensors,
    box: list[Tensors],
    b_norm: float,
    tol: float,
    maxiter: int,
    info: SolveInfo,
    solver: str,
) -> Tensors:
    """Run ``iterate`` and verify its claim of convergence with a recomputed residual.

    ``box`` is ``[x, r]`` as :func:`start` returned them (the caller keeps no other reference;
    see :data:`Iterate`), ``info.residual`` the start's: a start that already meets ``tol`` (a
    warm start, whose residual :func:`start` recomputed, or ``tol >= 1``) is returned at once as
    converged, without iterating.

    When the run stops with "claimed", "singular" or "exhausted", one more product computes
    ``r = b - A x``; that value becomes ``info.residual`` (the iteration's own value is kept in
    ``extras["recurrence_residual"]``) and alone decides ``converged``. If the recurrence claimed
    convergence but the recomputed residual misses ``tol``, the iteration restarts from the
    recomputed residual (at most :data:`MAX_RESTARTS` times, within ``maxiter``, and only while
    each restart at least halves the recomputed residual: at the precision floor restarting is
    futile); if it still misses, ``extras["residual_mismatch"]`` is set and a
    :class:`~hypergrad.HypergradWarning` is emitted. A "singular" stop warns with
    :class:`~hypergrad.SingularSystemWarning`.

    A least-squares candidate (an earlier iterate whose residual looked orthogonal to the range
    of the operator, but not clearly enough to stop there) is checked too when the final
    iterate misses ``tol``: if its recomputed residual is smaller, it is returned and the system
    is reported singular (the iteration went on past the least-squares point and lost accuracy).

    A run that ends at ``maxiter`` without a candidate reports the recurrence residual
    (``extras["residual_verified"]`` False), so fixed-budget solves cost no extra product.

    Returns:
        the final iterate; ``info`` is updated in place.
    """
    if info.residual <= tol:
        info.converged = True
        info.extras["residual_verified"] = True
        return box[0]
    restarts = 0
    last_rel: float | None = None
    fallback: Candidate | None = None
    while True:
        status, x, candidate = iterate(box, maxiter - info.iterations)
        if fallback is None:
            fallback = candidate
        if status == "diverged":
            return x
        if status == "maxiter" and fallback is None:
            info.extras["residual_verified"] = False
            return x
        r, rel = _verify(op, b, x, b_norm, info, solver)
        if rel <= tol:
            info.converged = True
            if info.extras.get("singular"):  # a solution exists after all
                info.extras["singular"] = False
            return x
        if fallback is not None and status != "singular":
            better = _candidate(fallback, op, b, b_norm, info, solver, rel)
            fallback = None
            if better is not None:
                x, r, rel = better
                status = "singular"
        if _final(status, rel, info):
            return x
        stuck = last_rel is not None and rel > 0.5 * last_rel  # a restart did not help
        last_rel = rel
        if restarts >= MAX_RESTARTS or info.iterations >= maxiter or stuck:
            _warn_mismatch(info)
            return x
        restarts += 1
        info.extras["restarts"] = restarts
        box[:] = [x, r]
        del x, r


def _verify(
    op: MatVec, b: Tensors, x: Tensors, b_norm: float, info: SolveInfo, solver: str
) -> tuple[Tensors, float]:
    """Recompute ``r = b - A x``: its relative norm becomes ``info.residual``, the iteration's
    own value ``extras["recurrence_residual"]``."""
    recurrence = info.residual
    r, rel = recomputed_residual(op, b, x, b_norm, info, solver, "the residual check")
    info.extras["recurrence_residual"] = recurrence
    info.extras["residual_verified"] = True
    info.residual = rel
    return r, rel


def _candidate(
    fallback: Candidate,
    op: MatVec,
    b: Tensors,
    b_norm: float,
    info: SolveInfo,
    solver: str,
    rel: float,
) -> tuple[Tensors, Tensors, float] | None:
    """The least-squares candidate ``(x, r, rel)`` when its recomputed residual is below the final
    iterate's ``rel`` (or that is not finite), reported singular; else None."""
    x_c, rec_c, it_c = fallback
    r_c, rel_c = recomputed_residual(op, b, x_c, b_norm, info, solver, "the residual check")
    if rel_c < rel or not math.isfinite(rel):
        info.residual = rel_c
        info.extras["recurrence_residual"] = rec_c
        info.extras.update(singular=True, lstsq_residual=rec_c, lstsq_iteration=it_c)
        return x_c, r_c, rel_c
    return None


def _final(status: str, rel: float, info: SolveInfo) -> bool:
    """Whether a run whose recomputed residual ``rel`` misses tol ends here: a "singular" stop
    (warned), an overflowed iterate (diverged, warned) or "maxiter"; else it may restart."""
    if status == "singular":
        warn_singular(info, _singular_detail(info))
        return True
    if not math.isfinite(rel):  # x overflowed
        info.diverged = True
        warn_diverged(info, "The iterate overflowed (NaN/Inf in x).")
        return True
    return status == "maxiter"


def _singular_detail(info: SolveInfo) -> str:
    """What the :class:`~hypergrad.SingularSystemWarning` of a "singular" stop says."""
    if info.extras.get("zero_operator"):
        return (
            "the Hessian-vector product is exactly zero (an inner loss linear in the "
            "parameters has no curvature)."
        )
    if info.extras.get("singular_test"):  # CG
        return (
            "the system is singular and inconsistent (or numerically singular): CG "
            "met a search direction of numerically zero curvature or a residual growing "
            "far above its minimum, where its iterate grows without bound; it stopped "
            "and returned the iterate with the smallest residual."
        )
    return (
        "the system is singular and inconsistent: the iteration reached a "
        "least-squares solution (||H r|| = 0 up to rounding) with the residual "
        "above tol."
    )


def _warn_mismatch(info: SolveInfo) -> None:
    """The recurrence met tol, the recomputed residual does not, and restarting is over."""
    info.extras["residual_mismatch"] = True
    warn(
        f"{info.solver}: the recurrence residual met tol but the recomputed residual "
        "||Hx - b||/||b|| does not (both in SolveInfo: residual, "
        "extras['recurrence_residual'], extras['restarts']): the system is too "
        "ill-conditioned (or nearly singular) for this tolerance in this precision; "
        "loosen tol, add damping, or use float64",
        HypergradWarning,
    )


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


def lstsq_rtols(b: Tensors) -> tuple[float, float]:
    """Thresholds on ``||A r|| / (||A|| ||r||)`` for MINRES's least-squares test.

    Returns ``(stop, suspect)`` for the coarsest dtype among the leaves of ``b`` (machine
    epsilon ``eps``). For a nonsingular ``A`` the ratio is at least ``1 / cond(A)``; for an
    inconsistent singular system it drops to rounding once ``x`` is a least-squares solution.

    * ``stop = 100 eps``: the residual is orthogonal to the range up to rounding; MINRES stops,
      since the next step would divide by a vanishing pivot. Condition numbers below ~4e13
      (float64) or ~8e4 (float32) never reach it.
    * ``suspect = sqrt(eps)``: Lanczos rounding can keep the ratio above ``stop`` (seen at
      ~1e-13 on dense float64 matrices), so an iterate below ``suspect`` is remembered and
      returned if the iteration does worse afterwards.
    """
    eps = max(torch.finfo(t.dtype).eps for t in b)
    return 100 * eps, math.sqrt(eps)
