"""The record every implicit entry point returns (:class:`HypergradInfo`) and the input checks
they all apply: the leaves of params and hparams, the solver, the dtypes of a loss that fails on
a mix, and the fresh graph leaves the derivatives are taken on."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from .distributed import all_reduce_mean
from .errors import HypergradTypeError, HypergradValueError
from .solvers import CG, SOLVERS, SolveInfo, Solver
from .tree import PyTree, Tensors, tree_all_finite

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
        adjoint: (property) the solution ``x`` of the adjoint system, shaped like ``params``
            (a warm start for the next call: ``x0=info.adjoint``, or
            :class:`~hypergrad.WarmStart`); None where there was no solve.
        extras: entry-point-specific details (``"adjoint"``: what ``adjoint`` reads;
            ``"condition_products"``: products of the condition's Jacobian spent outside the
            solver, e.g. the one of ``stationarity``).
        stationarity: how far the given point is from satisfying its optimality condition
            ``F = 0``, a relative norm that is exactly 0 at an exact solution (definition in
            :mod:`hypergrad.conditions`): for the implicit entry points, whose condition is
            ``F = ∇_params L_in``, ``||F|| / max(||H params||, ||F − H params||)`` (``H`` the
            Hessian: one Hessian-vector product); for :func:`~hypergrad.custom_root` /
            :func:`~hypergrad.root_vjp` the same with ``∂F/∂params``; for a fixed point
            ``||T(x) − x|| / ||x||``. Above
            :data:`~hypergrad.conditions.STATIONARITY_THRESHOLD` the entry points warn
            (:class:`~hypergrad.NonStationaryWarning`), except :class:`~hypergrad.HyperStep`,
            which only reports it. NaN where it was not measured (``stationarity=False``,
            :func:`~hypergrad.compile_implicit_grad`).
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
    stationarity: float = float("nan")

    @property
    def adjoint(self) -> Any:
        """The solution ``x`` of the adjoint system, shaped like ``params`` (None where there was
        no solve): the warm start of the next call (``x0=info.adjoint``, or
        :meth:`WarmStart.update(info) <hypergrad.WarmStart.update>`)."""
        return self.extras.get("adjoint")

    @adjoint.setter
    def adjoint(self, value: Any) -> None:
        self.extras["adjoint"] = value


_DTYPE_ERROR = re.compile(
    r"dtype|scalar type|can't be cast|(Float|Double|Half|BFloat16).*(Float|Double|Half|BFloat16)"
)


@contextlib.contextmanager
def explain_dtype_errors(
    groups: Sequence[tuple[Sequence[torch.Tensor], Sequence[str]]],
) -> Iterator[None]:
    """Turn torch's dtype errors raised inside the block into a
    :class:`~hypergrad.HypergradTypeError` naming two leaves of different dtypes.

    ``groups`` are ``(leaves, names)`` pairs (params, hparams, ...). Mixed dtypes are not refused
    up front: a loss that promotes (``lam * (w ** 2).sum()`` with float64 ``lam`` and float32
    ``w``) works, and ``torch.autocast`` keeps every leaf float32. Only when the leaves do mix
    dtypes and the block raises a ``RuntimeError`` about dtypes (``expected m1 and m2 to have the
    same dtype``) is the error replaced (the original chained as its cause).
    """
    try:
        yield
    except RuntimeError as err:
        first: dict[torch.dtype, str] = {}
        for leaves, names in groups:
            for t, n in zip(leaves, names):
                first.setdefault(t.dtype, n)
        if len(first) < 2 or not _DTYPE_ERROR.search(str(err)):
            raise
        (da, na), (db, nb) = list(first.items())[:2]
        raise HypergradTypeError(
            f"{na} is {da} but {nb} is {db}, and the loss failed on the mix ({err}). Give "
            f"params and hparams one dtype (e.g. {nb}.to({da}))"
        ) from err


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
        names = ", ".join(f"hg.{cls.__name__}()" for cls in SOLVERS.values())
        raise HypergradTypeError(
            "solver must be a hypergrad solver (an object with solve(matvec, b, x0)) such as "
            f"{names}; got {type(solver).__name__}"
        )
    # Duck-typed at run time (anything with solve() is used as one); typed as the API's Solver.
    return cast(Solver, solver)


def average_if_local(hyper: Tensors, distributed: str | None) -> Tensors:
    """The mean of the per-process hypergradients under ``distributed="local"``."""
    return all_reduce_mean(hyper) if distributed == "local" else hyper


def fresh(leaves: list[torch.Tensor] | Tensors) -> Tensors:
    """Detached copies of ``leaves`` that require grad (new graph leaves)."""
    return tuple(t.detach().requires_grad_(True) for t in leaves)
