"""The adjoint routines over any :mod:`~hypergrad.implicit.linearization`: reverse mode
(``Aᵀ u = v``, returns ``−Bᵀ u``) and forward mode (``A w = −B t``), each with the checks every
implicit entry point makes once: the stationarity of the point (warned), the kinks of a
prox/projection condition (warned), the symmetry probe of a symmetric-only solver (decided by the
solver itself, :meth:`~hypergrad.solvers.base.Solver.assumes_symmetric`), the solve and its
unwarned failure, the mixed product. :func:`hypergradient_core` (``implicit_grad``,
``HyperStep``) is the reverse mode of a :class:`GradientLinearization` through the same checked
solve, with the outer loss's direct term, a warm start and a distributed run's collectives."""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from ..conditions import Condition, stationary, warn_if_nonstationary
from ..errors import (
    HypergradError,
    HypergradValueError,
    HypergradWarning,
    NonDifferentiableWarning,
    warn,
)
from ..operators import InnerOperator, check_scalar_loss
from ..report import FlatLoss, HypergradInfo, Reduce, check_solver, explain_dtype_errors
from ..solvers import CG, GMRES, SolveInfo, Solver
from ..solvers.base import DISPLAY_NAMES, failure_warning
from ..tree import (
    Tensors,
    tree_all_finite,
    tree_norm,
    tree_unflatten,
)
from .linearization import (
    GradientLinearization,
    Linearization,
    Product,
    symmetry_rtol,
)


def _default_solver(cond: Condition) -> Solver:
    """CG for a symmetric condition (what ``@hg.implicit`` uses), else GMRES."""
    return CG() if cond.symmetric else GMRES()


def pick_solver(solver: Any, cond: Condition) -> Solver:
    return _default_solver(cond) if solver is None else check_solver(solver)


def _symmetric_only(solver: Solver) -> str | None:
    """How messages name ``solver`` when it assumes a symmetric operator, else None: the solver
    says so itself (:meth:`~hypergrad.solvers.base.Solver.assumes_symmetric`); a solver object
    that is not hypergrad's is taken at its word (``symmetric_only`` attribute, default False)."""
    assumes = getattr(solver, "assumes_symmetric", None)
    if callable(assumes):
        named = assumes()
        return named if isinstance(named, str) else None
    return type(solver).__name__ if getattr(solver, "symmetric_only", False) else None


def _check_symmetry(lin: Linearization, solver: Solver, extras: dict[str, Any]) -> None:
    """Run the symmetry probe when ``solver`` assumes a symmetric operator and the condition is
    not known to be symmetric; raise when it is clearly not."""
    name = _symmetric_only(solver)
    if name is None or lin.cond.symmetric:
        return
    asym = lin.asymmetry()
    extras["asymmetry"] = asym
    rtol = symmetry_rtol(lin.value[0].dtype)
    if not asym <= rtol:
        raise HypergradValueError(
            f"{name} assumes a symmetric system, but ∂{lin.cond.name}/∂params is not symmetric "
            f"(||A r - A^T r|| / ||A r|| = {asym:.2g} > {rtol:.1g} for a random r): it would "
            "converge to a wrong answer. Use hg.GMRES(), hg.BiCGStab() or hg.Exact(); or, for "
            "a gradient condition, hg.conditions.stationary(inner_loss)"
        )


def _check_kinks(lin: Linearization, stat: float, extras: dict[str, Any]) -> None:
    """``extras["kinks"]``: for a condition on a prox/projection operator, the coordinates of
    the operator's input at one of its kinks (within ``max(sqrt(eps), stationarity)`` relative:
    the point's own accuracy); a :class:`~hypergrad.NonDifferentiableWarning` when there are."""
    if lin.cond.kinks is None:
        return
    rtol = math.sqrt(torch.finfo(lin.value[0].dtype).eps)
    if math.isfinite(stat):
        rtol = max(rtol, stat)
    x = tree_unflatten(lin.p_spec, [t.detach() for t in lin.xs])
    theta = tree_unflatten(lin.h_spec, [t.detach() for t in lin.ts])
    count = lin.cond.kinks(x, theta, rtol)
    extras["kinks"] = count
    if count:
        warn(
            f"{count} coordinate(s) of the solution sit at a kink of the proximal/projection "
            f"operator (its input within {rtol:.1g} relative of a threshold or bound): the "
            "solution map is not differentiable there, and the derivative returned is "
            "autograd's choice at the kink (a one-sided limit, or at an exact tie an average "
            "of them), not a derivative: a small change of the hyperparameters moves those "
            "coordinates across the kink. The count is in info.extras['kinks']",
            NonDifferentiableWarning,
        )


def _checked_solve(
    lin: Linearization,
    solver: Solver,
    product: Product,
    rhs: Tensors,
    x0: Tensors | None = None,
    nonfinite: str = "raise",
) -> tuple[Tensors, SolveInfo, float, dict[str, Any]]:
    """The solve of either mode with the checks every derivative makes once: the stationarity
    of the point (warned when the linearization says so), the kinks, the symmetry probe, the
    solve itself (from ``x0``), its unwarned failure and a non-finite answer (raised, or with
    ``nonfinite="return"`` handed on for the caller's own policy). Returns the answer, the
    solve's report, the stationarity and the extras so far."""
    stat = lin.stationarity()
    if lin.warn_stationarity:
        warn_if_nonstationary(stat, lin.cond.name)
    extras: dict[str, Any] = {}
    _check_kinks(lin, stat, extras)
    _check_symmetry(lin, solver, extras)
    extras["condition_products"] = lin.products  # the solver's products are in sinfo
    x, sinfo = solver.solve(product, rhs, x0)
    warn_unwarned_failure(solver, sinfo)
    if nonfinite == "raise":
        _check_solution(x, sinfo, lin.hint)
    return x, sinfo, stat, extras


def solve_reverse(
    lin: Linearization, cot: Tensors, solver: Solver, needs: tuple[bool, ...]
) -> tuple[Tensors, HypergradInfo]:
    """``−Bᵀ u`` with ``Aᵀ u = cot`` and the info of the solve."""
    t0 = time.perf_counter()
    product = Product(lin.rmatvec, lin.rmatvec_batched, lin.cond.symmetric)
    u, sinfo, stat, extras = _checked_solve(lin, solver, product, cot)
    mixed = lin.mixed_t(u)
    # θ's leaves, then the captured tensors (their needs are not checked: one that F reaches
    # only outside x's dependence has a zero derivative, which is the true one)
    unused = [n for n, m, need in zip(lin.h_names, mixed, needs) if m is None and need]
    if unused:
        raise HypergradError(
            f"{lin.cond.name} does not depend on {', '.join(unused)}: the gradient through the "
            "solution would be silently zero. Check that the condition uses these "
            "hyperparameters without detaching them"
        )
    out = tuple(
        torch.zeros_like(t) if m is None else -m for m, t in zip(mixed, lin.ts + lin.captured)
    )
    if not tree_all_finite(out):
        raise HypergradValueError("the derivative through the root contains NaN/Inf")
    norm = float(tree_norm(out))
    extras.update(adjoint=u, stationarity=stat)
    info = HypergradInfo(
        solve=sinfo,
        inner_loss=lin.loss_value,
        # the norm the solver measured when it did (the same number: b is cot)
        outer_grad_norm=float(sinfo.extras.get("b_norm", tree_norm(cot))),
        indirect_norm=norm,
        hypergrad_norm=norm,
        time_s=time.perf_counter() - t0,
        extras=extras,
        stationarity=stat,
    )
    return out, info


def solve_forward(
    lin: Linearization, tangents: tuple[torch.Tensor | None, ...], solver: Solver
) -> tuple[Tensors, HypergradInfo]:
    """``w`` with ``A w = −B t`` and the info of the solve."""
    t0 = time.perf_counter()
    rhs = tuple(-b for b in lin.mixed(tangents))
    product = Product(lin.matvec, lin.matvec_batched, lin.cond.symmetric)
    w, sinfo, stat, extras = _checked_solve(lin, solver, product, rhs)
    norm = float(tree_norm(w))
    extras.update(tangent=w, stationarity=stat)
    info = HypergradInfo(
        solve=sinfo,
        outer_grad_norm=float(tree_norm(rhs)),
        indirect_norm=norm,
        hypergrad_norm=norm,
        time_s=time.perf_counter() - t0,
        extras=extras,
        stationarity=stat,
    )
    return w, info


def _check_solution(x: Tensors, sinfo: SolveInfo, hint: str) -> None:
    if not tree_all_finite(x):
        raise HypergradValueError(
            f"the {DISPLAY_NAMES.get(sinfo.solver, sinfo.solver)} solve produced NaN/Inf "
            f"(residual {sinfo.residual:.3g}); {hint}"
        )


def warns_itself(solver: Any) -> bool:
    """Whether ``solver`` is one of hypergrad's own solvers, which warn (a
    :class:`~hypergrad.HypergradWarning`) whenever their report has ``failure`` set.

    A duck-typed solver (any object with ``solve``, or a :class:`~hypergrad.Solver` subclass
    defined outside :mod:`hypergrad.solvers`) gives no such promise: :func:`solve_adjoint` warns
    for it.
    """
    return type(solver).__module__.startswith("hypergrad.solvers.")


def warn_unwarned_failure(solver: Any, info: SolveInfo) -> None:
    """Warn when ``info`` is a failure (:attr:`SolveInfo.failure`) that nobody warned about: a
    result that is not a hypergradient is never handed to the user without a warning, and never
    with two for one cause.

    Nothing is emitted when ``info.failure`` is None, when ``info.extras["warned"]`` is set (a
    solver records there that it has warned) or when ``solver`` is one of hypergrad's own
    (:func:`warns_itself`). Otherwise one warning of the failure's class
    (:func:`~hypergrad.solvers.base.failure_warning`; :class:`~hypergrad.HypergradWarning` for
    a residual, as this warning says only that the solver's own report is a failure) is emitted
    and
    ``info.extras["warned"]`` set. The text is fixed per solver class (the numbers are in
    ``info``), so Python's default filter shows it once per call site.
    """
    failure = info.failure
    if failure is None or info.extras.get("warned") or warns_itself(solver):
        return
    category = failure_warning(failure, HypergradWarning)
    info.extras["warned"] = category.__name__
    warn(
        f"{type(solver).__name__}.solve returned a report with SolveInfo.failure set (diverged, "
        "singular, stalled, or a relative residual that is NaN/Inf or above 1): the result is not "
        "a hypergradient (the details are in the returned SolveInfo)",
        category,
    )


def hypergradient_core(
    inner: FlatLoss,
    outer: FlatLoss,
    psi: Tensors,
    theta: Tensors,
    solver: Solver,
    *,
    engine: str = "reuse",
    x0: Tensors | None = None,
    psi_names: list[str] | None = None,
    theta_names: list[str] | None = None,
    reduce: Reduce | None = None,
    nonfinite: str = "raise",
    stationarity: bool = True,
) -> tuple[Tensors, HypergradInfo]:
    """The implicit hypergradient over flat leaves that already require grad.

    Shared by :func:`~hypergrad.implicit_grad` and :class:`~hypergrad.HyperStep`. ``reduce``
    (optional, e.g. :func:`~hypergrad.distributed.make_reducer`'s all-reduce) post-processes the
    right-hand side, every Hessian-vector product, and the direct and mixed terms.
    ``nonfinite="return"`` returns a NaN/Inf adjoint or hypergradient instead of raising, for a
    caller that applies its own policy (``HyperStep``'s ``on_diverged``).

    With ``stationarity=True`` the report's ``stationarity`` is measured
    (:func:`gradient_stationarity`: the inner gradient, free with the reuse engine, and one
    Hessian-vector product ``H psi``; none when the gradient is exactly zero); nothing warns here,
    the caller decides. Under ``reduce`` the gradient travels in the right-hand side's reduce call
    and ``H psi`` in the direct term's, so the measure is that of the global inner loss and costs
    no extra collective.

    Raises:
        HypergradError: hyperparameters that influence neither the inner solution nor the outer
            loss; a hypergradient with NaN/Inf (with ``nonfinite="raise"``).
    """
    theta_names = theta_names or [f"hparams[{i}]" for i in range(len(theta))]
    psi_names = psi_names or [f"params[{i}]" for i in range(len(psi))]
    t0 = time.perf_counter()
    with explain_dtype_errors([(psi, psi_names), (theta, theta_names)]):
        with torch.enable_grad():  # the outer loss first: its random draws come first
            lo = check_scalar_loss(outer(psi, theta), "outer_loss")
            grads = torch.autograd.grad(lo, psi + theta, allow_unused=True)
        op = InnerOperator(inner, psi, theta, engine=engine, psi_names=psi_names)
        lin = GradientLinearization(
            stationary(inner), op, None, None, theta_names, measure=stationarity, warn=False,
            reduce=reduce,
        )  # fmt: skip
        return _with_direct_term(lin, solver, x0, nonfinite, lo, grads, t0)


def _with_direct_term(
    lin: GradientLinearization,
    solver: Solver,
    x0: Tensors | None,
    nonfinite: str,
    lo: torch.Tensor,
    grads: tuple[torch.Tensor | None, ...],
    t0: float,
) -> tuple[Tensors, HypergradInfo]:
    """:func:`hypergradient_core` past the linearization: the adjoint solve on the outer loss's
    gradient ``grads`` (over params, then hparams), the mixed product and the direct term."""
    psi, theta, reduce, theta_names = lin.xs, lin.ts, lin.reduce, lin.h_names
    g_psi = tuple(torch.zeros_like(p) if g is None else g for g, p in zip(grads[: len(psi)], psi))
    g_theta = list(grads[len(psi) :])
    g_psi = lin.reduce_rhs(g_psi)
    product = Product(lin.rmatvec, lin.rmatvec_batched, True)
    x, sinfo, stat, extras = _checked_solve(lin, solver, product, g_psi, x0, nonfinite)
    mixed = lin.mixed_t(x)
    unused = [n for n, m, d in zip(theta_names, mixed, g_theta) if m is None and d is None]
    if unused:
        raise HypergradError(
            f"{', '.join(unused)} influence neither the inner solution nor the outer loss: the "
            "hypergradient would be silently zero. Check that the inner loss uses these "
            "hyperparameters without detaching them"
        )
    direct = tuple(torch.zeros_like(t) if d is None else d.detach() for d, t in zip(g_theta, theta))
    indirect = tuple(torch.zeros_like(t) if m is None else m for m, t in zip(mixed, theta))
    if reduce is not None:
        direct, stat = lin.reduce_with_scale(direct)  # H x travels with the direct term
        indirect = reduce(indirect)
    hyper = tuple(d - m for d, m in zip(direct, indirect))
    if nonfinite == "raise" and not tree_all_finite(hyper):
        raise HypergradValueError("the hypergradient contains NaN/Inf")
    info = HypergradInfo(
        solve=sinfo,
        inner_loss=lin.loss_value,
        outer_loss=float(lo.detach()),
        outer_grad_norm=float(sinfo.extras.get("b_norm", tree_norm(g_psi))),
        direct_norm=float(tree_norm(direct)),
        indirect_norm=float(tree_norm(indirect)),
        hypergrad_norm=float(tree_norm(hyper)),
        time_s=time.perf_counter() - t0,
        extras={"adjoint": x, **extras},
        stationarity=stat,
    )
    return hyper, info
