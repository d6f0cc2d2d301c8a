"""The adjoint routines over any :mod:`~hypergrad.implicit.linearization`: reverse mode
(``Aᵀ u = v``, returns ``−Bᵀ u``) and forward mode (``A w = −B t``), each with the checks every
implicit entry point makes once: the stationarity of the point (warned), the kinks of a
prox/projection condition (warned), the symmetry probe of a symmetric-only solver (decided by the
solver itself, :meth:`~hypergrad.solvers.base.Solver.assumes_symmetric`), the solve and its
unwarned failure, the mixed product."""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from .._core import (
    HypergradInfo,
    check_solver,
    warn_unwarned_failure,
)
from ..conditions import Condition, warn_if_nonstationary
from ..errors import (
    HypergradError,
    HypergradValueError,
    NonDifferentiableWarning,
    warn,
)
from ..solvers import CG, GMRES, SolveInfo, Solver
from ..solvers.base import DISPLAY_NAMES
from ..tree import (
    Tensors,
    tree_all_finite,
    tree_norm,
    tree_unflatten,
)
from .linearization import GradientLinearization, Linearization, Product, symmetry_rtol


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


def solve_reverse(
    lin: Linearization, cot: Tensors, solver: Solver, needs: tuple[bool, ...]
) -> tuple[Tensors, HypergradInfo]:
    """``−Bᵀ u`` with ``Aᵀ u = cot`` and the info of the solve."""
    t0 = time.perf_counter()
    stat = lin.stationarity()
    if not isinstance(lin, GradientLinearization) or lin.measure:
        warn_if_nonstationary(stat, lin.cond.name)
    extras: dict[str, Any] = {}
    _check_kinks(lin, stat, extras)
    _check_symmetry(lin, solver, extras)
    extras["condition_products"] = lin.products  # the solver's products are in sinfo
    u, sinfo = solver.solve(
        Product(lin.rmatvec, lin.rmatvec_batched, lin.cond.symmetric), cot, None
    )
    warn_unwarned_failure(solver, sinfo)
    _check_solution(u, sinfo)
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
    stat = lin.stationarity()
    warn_if_nonstationary(stat, lin.cond.name)
    extras: dict[str, Any] = {}
    _check_kinks(lin, stat, extras)
    _check_symmetry(lin, solver, extras)
    extras["condition_products"] = lin.products  # the solver's products are in sinfo
    w, sinfo = solver.solve(Product(lin.matvec, lin.matvec_batched, lin.cond.symmetric), rhs, None)
    warn_unwarned_failure(solver, sinfo)
    _check_solution(w, sinfo)
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


def _check_solution(x: Tensors, sinfo: SolveInfo) -> None:
    if not tree_all_finite(x):
        raise HypergradValueError(
            f"the {DISPLAY_NAMES.get(sinfo.solver, sinfo.solver)} solve produced NaN/Inf "
            f"(residual {sinfo.residual:.3g}); check the condition, or use another solver"
        )
