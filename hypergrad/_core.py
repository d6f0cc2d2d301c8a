"""The implicit hypergradient over flat leaves, shared by ``implicit.py``, ``modules.py``,
``unrolled.py`` and ``testing.py`` (private: the public entry points wrap it).

It owns the :class:`~hypergrad.HypergradInfo` record, the input checks every entry point applies
(leaves, solver, the ``distributed`` mode), the adjoint solve ``x = H^{-1} b`` with its mixed
product, and :func:`hypergradient_core`, which builds the Hessian operator of the inner loss and
returns ``dL_out/dtheta = direct - mixed(x)``. Under ``distributed="exact"`` the products are
all-reduced through a local ``matvec`` closure handed to the solver (jaxopt's ``root_vjp``
shape); the operator itself is never modified.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from .distributed import all_reduce_mean
from .errors import (
    HypergradError,
    HypergradTypeError,
    HypergradValueError,
    HypergradWarning,
    SingularSystemWarning,
    SolverDivergedWarning,
    SolverStalledWarning,
)
from .operators import InnerOperator, check_scalar_loss
from .solvers import CG, SolveInfo, Solver
from .solvers.base import MatVec
from .tree import PyTree, Tensors, tree_all_finite, tree_norm

Loss = Callable[[PyTree, PyTree], torch.Tensor]
FlatLoss = Callable[[Tensors, Tensors], torch.Tensor]
Reduce = Callable[[Tensors], Tensors]


@dataclass
class HypergradInfo:
    """Diagnostics of one hypergradient.

    Attributes:
        solve: the linear solver's :class:`~hypergrad.SolveInfo`.
        inner_loss: value of the inner loss at the given point.
        outer_loss: value of the outer loss (NaN for ``@implicit``, which never sees it).
        outer_grad_norm: ``||dL_out/dpsi||`` (the right-hand side).
        direct_norm: ``||dL_out/dtheta||`` through the explicit dependence (NaN for
            ``@implicit``: autograd handles that part outside the decorator).
        indirect_norm: ``||(d^2 L_in/dtheta dpsi) x||`` through the inner solution.
        hypergrad_norm: norm of the returned hypergradient (before any clipping); for
            ``@implicit`` the norm of the gradient it passes to the hyperparameters.
        clipped: whether :class:`~hypergrad.HyperStep` clipped it.
        skipped: whether :class:`~hypergrad.HyperStep` (``on_diverged="skip"``) left ``.grad``
            unwritten because the result was not a hypergradient (``solve.failure`` set, or
            NaN/Inf entries; under ``distributed=...`` on any rank).
        skip_reason: why it was skipped (None when it was not), e.g. ``"the cg solve diverged"``;
            under ``distributed=...`` prefixed by the rank(s) that failed
            (``"rank 1: the cg solve diverged"``).
        time_s: wall time of the whole computation.
        extras: entry-point-specific details (``"adjoint"``: the solution ``x`` of the adjoint
            system, a warm start for the next call).
    """

    solve: SolveInfo
    inner_loss: float = float("nan")
    outer_loss: float = float("nan")
    outer_grad_norm: float = float("nan")
    direct_norm: float = float("nan")
    indirect_norm: float = float("nan")
    hypergrad_norm: float = float("nan")
    clipped: bool = False
    skipped: bool = False
    skip_reason: str | None = None
    time_s: float = 0.0
    extras: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> SolveInfo:
        """Deprecated: ``fit.last_info["info"]`` (a dict once) is ``fit.last_info.solve``."""
        if key != "info":
            raise KeyError(key)
        warnings.warn(
            'fit.last_info["info"] is deprecated: fit.last_info is now a HypergradInfo; use '
            "fit.last_info.solve (the same SolveInfo)",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.solve


def check_leaves(leaves: list[torch.Tensor], names: list[str], what: str) -> None:
    """Raise on an empty list, integer/complex tensors, non-leaf tensors and NaN/Inf values."""
    if not leaves:
        raise HypergradValueError(f"{what} is empty: it must contain at least one tensor")
    for t, n in zip(leaves, names):
        if not t.is_floating_point():
            kind = "complex" if t.is_complex() else "integer/bool"
            raise HypergradTypeError(
                f"{n} is a {kind} tensor ({t.dtype}); hypergradients need real floating-point "
                "tensors"
            )
        if t.grad_fn is not None:
            raise HypergradTypeError(
                f"{n} is a non-leaf tensor (it has a grad_fn {type(t.grad_fn).__name__}); pass "
                "detached values (.detach()) — a graph behind them would be cut silently"
            )
        if not tree_all_finite((t.detach(),)):
            raise HypergradValueError(f"{n} contains NaN or Inf")


def check_solver(solver: Any) -> Solver:
    """The solver to use: ``hg.CG()`` for None; raise for anything without ``solve``."""
    if solver is None:
        return CG()
    if not hasattr(solver, "solve"):
        raise HypergradTypeError(
            "solver must be a hypergrad solver such as hg.CG(), hg.MINRES(), hg.Neumann(), "
            f"hg.Exact() or hg.Nystrom(), got {type(solver).__name__}"
        )
    # Duck-typed at run time (anything with solve() is used as one); typed as the API's Solver.
    return cast(Solver, solver)


def average_if_local(hyper: Tensors, distributed: str | None) -> Tensors:
    """The mean of the per-process hypergradients under ``distributed="local"``."""
    return all_reduce_mean(hyper) if distributed == "local" else hyper


def fresh(leaves: list[torch.Tensor] | Tensors) -> Tensors:
    """Detached copies of ``leaves`` that require grad (new graph leaves)."""
    return tuple(t.detach().requires_grad_(True) for t in leaves)


class _BatchableHVP:
    """``op.hvp`` as the solver's ``matvec``, with ``.batched`` (``op.hvp_batched``) for solvers
    that materialise columns (:func:`~hypergrad.solvers.base.dense_matrix`: Exact, Nystrom)."""

    def __init__(self, op: InnerOperator):
        self.op = op

    def __call__(self, v: Tensors) -> Tensors:
        return self.op.hvp(v)

    def batched(self, vs: Tensors) -> Tensors | None:
        return self.op.hvp_batched(vs)


#: The warning category for each :attr:`SolveInfo.failure <hypergrad.SolveInfo.failure>`.
FAILURE_WARNINGS: dict[str, type[HypergradWarning]] = {
    "diverged": SolverDivergedWarning,
    "singular": SingularSystemWarning,
    "stalled": SolverStalledWarning,
}


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
    (:data:`FAILURE_WARNINGS`, :class:`~hypergrad.HypergradWarning` for a residual) is emitted and
    ``info.extras["warned"]`` set. The text is fixed per solver class (the numbers are in
    ``info``), so Python's default filter shows it once per call site.
    """
    failure = info.failure
    if failure is None or info.extras.get("warned") or warns_itself(solver):
        return
    category = FAILURE_WARNINGS.get(failure, HypergradWarning)
    info.extras["warned"] = category.__name__
    warnings.warn(
        f"{type(solver).__name__}.solve returned a report with SolveInfo.failure set (diverged, "
        "singular, stalled, or a relative residual that is NaN/Inf or above 1): the result is not "
        "a hypergradient (the details are in the returned SolveInfo)",
        category,
        stacklevel=4,
    )


def solve_adjoint(
    op: InnerOperator,
    b: Tensors,
    solver: Solver,
    x0: Tensors | None = None,
    matvec: MatVec | None = None,
    *,
    nonfinite: str = "raise",
) -> tuple[Tensors, SolveInfo, list[torch.Tensor | None]]:
    """Solve ``H x = b`` and return ``x``, the solve info and ``mixed(x)``.

    A report with :attr:`SolveInfo.failure` set has been warned about when this returns (by the
    solver, or here for a solver that does not promise to: :func:`warn_unwarned_failure`).

    Args:
        op: the inner loss's operator (its ``mixed`` product is applied to ``x``).
        b: right-hand side ``dL_out/dpsi``.
        solver: the linear solver.
        x0: warm start.
        matvec: the product handed to the solver (default ``op.hvp``; e.g. an all-reduced one).
        nonfinite: ``"raise"`` (default) or ``"return"``: hand a NaN/Inf ``x`` on (its mixed
            product is NaN/Inf too) for the caller's own policy (``HyperStep``'s
            ``on_diverged``).

    Raises:
        HypergradValueError: the solve returned NaN/Inf (with ``nonfinite="raise"``).
    """
    x, info = solver.solve(_BatchableHVP(op) if matvec is None else matvec, b, x0)
    warn_unwarned_failure(solver, info)
    if nonfinite == "raise" and not tree_all_finite(x):
        raise HypergradValueError(
            f"the {info.solver} solve produced NaN/Inf (residual {info.residual:.3g}); check the "
            "inner loss, add damping, or use another solver"
        )
    return x, info, op.mixed(x)


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
) -> tuple[Tensors, HypergradInfo]:
    """The implicit hypergradient over flat leaves that already require grad.

    Shared by :func:`~hypergrad.implicit_grad` and :class:`~hypergrad.HyperStep`. ``reduce``
    (optional, e.g. :func:`~hypergrad.distributed.make_reducer`'s all-reduce) post-processes the
    right-hand side, every Hessian-vector product, and the direct and mixed terms.
    ``nonfinite="return"`` returns a NaN/Inf adjoint or hypergradient instead of raising, for a
    caller that applies its own policy (``HyperStep``'s ``on_diverged``).

    Raises:
        HypergradError: hyperparameters that influence neither the inner solution nor the outer
            loss; a hypergradient with NaN/Inf (with ``nonfinite="raise"``).
    """
    t0 = time.perf_counter()
    theta_names = theta_names or [f"hparams[{i}]" for i in range(len(theta))]
    with torch.enable_grad():
        lo = check_scalar_loss(outer(psi, theta), "outer_loss")
        grads = torch.autograd.grad(lo, psi + theta, allow_unused=True)
    g_psi = tuple(torch.zeros_like(p) if g is None else g for g, p in zip(grads[: len(psi)], psi))
    g_theta = list(grads[len(psi) :])
    op = InnerOperator(inner, psi, theta, engine=engine, psi_names=psi_names)
    matvec: MatVec | None = None  # op.hvp, batchable for the column-building solvers
    if reduce is not None:
        g_psi = reduce(g_psi)

        def matvec(v: Tensors) -> Tensors:
            return reduce(op.hvp(v))

    x, sinfo, mixed = solve_adjoint(op, g_psi, solver, x0, matvec, nonfinite=nonfinite)
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
        direct, indirect = reduce(direct), reduce(indirect)
    hyper = tuple(d - m for d, m in zip(direct, indirect))
    if nonfinite == "raise" and not tree_all_finite(hyper):
        raise HypergradValueError("the hypergradient contains NaN/Inf")
    info = HypergradInfo(
        solve=sinfo,
        inner_loss=op.loss_value,
        outer_loss=float(lo.detach()),
        outer_grad_norm=float(sinfo.extras.get("b_norm", tree_norm(g_psi))),
        direct_norm=float(tree_norm(direct)),
        indirect_norm=float(tree_norm(indirect)),
        hypergrad_norm=float(tree_norm(hyper)),
        time_s=time.perf_counter() - t0,
        extras={"adjoint": x},
    )
    return hyper, info
