"""The implicit hypergradient over flat leaves, shared by ``implicit/``, ``modules.py``,
``unrolled.py`` and ``testing/`` (private: the public entry points wrap it).

It owns the :class:`~hypergrad.HypergradInfo` record, the input checks every entry point applies
(leaves, solver, the ``distributed`` mode), the split of a decorated call into its
hyperparameters (:func:`bind_hparams`), the adjoint solve ``x = H^{-1} b`` with its mixed
product, the stationarity of the inner condition ``∇_psi L_in = 0`` (:func:`gradient_stationarity`),
and :func:`hypergradient_core`, which builds the Hessian operator of the inner loss and
returns ``dL_out/dtheta = direct - mixed(x)``. Under ``distributed="exact"`` the products are
all-reduced through a local ``matvec`` closure handed to the solver (jaxopt's ``root_vjp``
shape); the operator itself is never modified.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch._C._functorch import maybe_current_level

from .conditions import stationarity as relative_stationarity
from .distributed import all_reduce_mean
from .errors import (
    HypergradError,
    HypergradTypeError,
    HypergradValueError,
    HypergradWarning,
    SingularSystemWarning,
    SolverDivergedWarning,
    SolverStalledWarning,
    warn,
)
from .operators import InnerOperator, check_scalar_loss
from .solvers import CG, SOLVERS, SolveInfo, Solver
from .solvers.base import MatVec
from .tree import PyTree, Tensors, tree_all_finite, tree_norm, tree_sub

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


def bind_hparams(
    fit: Callable[..., PyTree], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[PyTree, Callable[[PyTree], PyTree]]:
    """Split a call of ``fit`` into its hyperparameters (first parameter) and the rest.

    Shared by ``@hg.implicit``, ``@hg.custom_root`` and ``@hg.custom_fixed_point``. The
    hyperparameters may be passed positionally or by keyword (by the name of ``fit``'s first
    parameter, or as ``hparams=``). Returns them and ``h -> fit(...)`` with them replaced by ``h``.
    """
    try:
        params = list(inspect.signature(fit).parameters.values())
    except (TypeError, ValueError):  # builtins and the like: fall back to positional
        params = []
    first = params[0] if params else None
    named = first is not None and first.kind in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.KEYWORD_ONLY,
    )
    # `first is not None` is implied by `named`; it is repeated for the type checker.
    if named and first is not None and not args and first.name in kwargs:
        rest = dict(kwargs)
        hparams = rest.pop(first.name)
        return hparams, lambda h: fit(*args, **{first.name: h}, **rest)
    if not args and "hparams" in kwargs:
        rest = dict(kwargs)
        hparams = rest.pop("hparams")
        if named and first is not None and first.kind is inspect.Parameter.KEYWORD_ONLY:
            return hparams, lambda h: fit(**{first.name: h}, **rest)
        return hparams, lambda h: fit(h, **rest)
    if not args:
        raise HypergradTypeError(
            f"{getattr(fit, '__name__', 'fit')} needs its hyperparameters: pass them as the first "
            "positional argument or by the name of its first parameter"
        )
    return args[0], lambda h: fit(h, *args[1:], **kwargs)


def inner_gradient(op: InnerOperator) -> Tensors:
    """``F = ∇_psi L_in`` at the operator's point, detached: the condition whose stationarity
    the implicit entry points report.

    Free with the ``"reuse"`` engine (the gradient graph every product differentiates is that
    gradient); one more gradient pass (with the same random draws) with ``"recompute"``.
    """
    # InnerOperator keeps its gradient graph private; it is read here, inside the package.
    grads = op._grads if op._grads is not None else op._gradient_graph()[1]
    return tuple(torch.zeros_like(p) if g is None else g.detach() for g, p in zip(grads, op.psi))


def stationarity_product(op: InnerOperator, gradient: Tensors) -> Tensors | None:
    """``H psi``, the product that scales :func:`gradient_stationarity` (one Hessian-vector
    product), or None when ``gradient`` is exactly zero (stationarity 0 needs no scale).

    Call it before the operator's graph is released (``op.mixed``).
    """
    if float(tree_norm(gradient)) == 0.0:
        return None
    return op.hvp(tuple(p.detach() for p in op.psi))


def gradient_stationarity(gradient: Tensors, h_psi: Tensors | None) -> float:
    """``||F|| / max(||H psi||, ||F − H psi||)`` for ``F = ∇_psi L_in``
    (:func:`hypergrad.conditions.stationarity` with the scales of a root): the two terms of the
    gradient's linearisation ``F(psi) − H psi + H y`` at ``psi``, so the ratio is dimensionless,
    invariant to rescaling the loss or the parameters, and exactly 0 at an exact stationary point
    (``h_psi`` None: ``F`` is exactly zero). For a quadratic ``L_in = ½ yᵀ H y − cᵀ y`` it is
    the relative residual ``||H psi − c|| / max(||H psi||, ||c||)`` of the normal equations.
    """
    if h_psi is None:
        return 0.0
    return relative_stationarity(gradient, h_psi, tree_sub(gradient, h_psi))


class _BatchableHVP:
    """``op.hvp`` as the solver's ``matvec``, with ``.batched`` (``op.hvp_batched``) for solvers
    that materialise columns (:func:`~hypergrad.solvers.base.dense_matrix`: Exact, Nystrom)."""

    symmetric = True  # a Hessian: what the solvers' advice reads

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
    warn(
        f"{type(solver).__name__}.solve returned a report with SolveInfo.failure set (diverged, "
        "singular, stalled, or a relative residual that is NaN/Inf or above 1): the result is not "
        "a hypergradient (the details are in the returned SolveInfo)",
        category,
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
    with explain_dtype_errors([(psi, psi_names), (theta, theta_names)]):
        return _hypergradient_core(
            inner, outer, psi, theta, solver, engine=engine, x0=x0, psi_names=psi_names,
            theta_names=theta_names, reduce=reduce, nonfinite=nonfinite, stationarity=stationarity,
        )  # fmt: skip


def _hypergradient_core(
    inner: FlatLoss,
    outer: FlatLoss,
    psi: Tensors,
    theta: Tensors,
    solver: Solver,
    *,
    engine: str,
    x0: Tensors | None,
    psi_names: list[str],
    theta_names: list[str],
    reduce: Reduce | None,
    nonfinite: str,
    stationarity: bool,
) -> tuple[Tensors, HypergradInfo]:
    t0 = time.perf_counter()
    with torch.enable_grad():
        lo = check_scalar_loss(outer(psi, theta), "outer_loss")
        grads = torch.autograd.grad(lo, psi + theta, allow_unused=True)
    g_psi = tuple(torch.zeros_like(p) if g is None else g for g, p in zip(grads[: len(psi)], psi))
    g_theta = list(grads[len(psi) :])
    op = InnerOperator(inner, psi, theta, engine=engine, psi_names=psi_names)
    gradient = inner_gradient(op) if stationarity else None
    matvec: MatVec | None = None  # op.hvp, batchable for the column-building solvers
    if reduce is not None:
        if gradient is None:
            g_psi = reduce(g_psi)
        else:  # one collective for both
            both = reduce(g_psi + gradient)
            g_psi, gradient = both[: len(psi)], both[len(psi) :]

        def matvec(v: Tensors) -> Tensors:
            return reduce(op.hvp(v))

        matvec.symmetric = True  # type: ignore[attr-defined]

    # H psi before the solve: the mixed product releases the reuse engine's graph
    h_psi = None if gradient is None else stationarity_product(op, gradient)
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
        if h_psi is None:
            direct = reduce(direct)
        else:  # one collective for both
            both = reduce(direct + h_psi)
            direct, h_psi = both[: len(theta)], both[len(theta) :]
        indirect = reduce(indirect)
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
        extras={"adjoint": x, "condition_products": int(h_psi is not None)},
        stationarity=float("nan") if gradient is None else gradient_stationarity(gradient, h_psi),
    )
    return hyper, info


def closure_leaves(outputs: Sequence[torch.Tensor], known: Sequence[torch.Tensor]) -> Tensors:
    """The leaf tensors that require grad, that ``outputs`` depend on, other than ``known``.

    One walk of the autograd graph of ``outputs`` (evaluated on ``known``, fresh leaves): what it
    finds reached the function by closure (a module's parameters, a tensor of the enclosing
    scope) instead of through its arguments. A tensor computed from such leaves (``2 * W``
    closed over) leads to its leaves, ``W``. In the order first met, each once.
    """
    known_ids = {id(t) for t in known}
    found: dict[int, torch.Tensor] = {}
    for o in outputs:
        if o.grad_fn is None and o.requires_grad and id(o) not in known_ids:
            found.setdefault(id(o), o)
    seen: dict[int, Any] = {}  # the nodes themselves are kept, so that no id is reused
    stack = [o.grad_fn for o in outputs if o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        var = getattr(node, "variable", None)
        if isinstance(var, torch.Tensor):
            if id(var) not in known_ids:
                found.setdefault(id(var), var)
            continue
        stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
    return tuple(found.values())


def outside_transforms() -> bool:
    """True outside every ``torch.func`` transform (``grad``, ``vjp``, ``vmap``...), where the
    decorators look for tensors captured by closure; inside one, ``torch.func`` itself treats
    closed-over tensors as constants."""
    return maybe_current_level() is None


def tensors_requiring_grad(value: Any, path: str) -> Iterator[str]:
    """The paths of the tensors in ``value`` (tuples, lists, dicts of them) that require grad."""
    if isinstance(value, torch.Tensor):
        if value.requires_grad:
            yield path
    elif isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            yield from tensors_requiring_grad(v, f"{path}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from tensors_requiring_grad(v, f"{path}[{k!r}]")


def refuse_differentiable_constants(
    fit: Callable[..., PyTree],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    hparams: Any,
    what: str,
) -> None:
    """Raise when an argument of ``fit`` other than its hyperparameters holds a tensor that
    requires grad: the decorators (``what``: ``@hg.implicit``, ``@hg.custom_root``, ...) treat
    those as constants, so it would silently get no gradient."""
    try:
        names = list(inspect.signature(fit).parameters)
    except (TypeError, ValueError):
        names = []
    given: list[tuple[str, Any]] = []
    for i, a in enumerate(args):
        if a is not hparams:
            given.append((names[i] if i < len(names) else f"args[{i}]", a))
    given += [(k, v) for k, v in kwargs.items() if v is not hparams]
    bad = [p for name, value in given for p in tensors_requiring_grad(value, name)]
    if bad:
        raise HypergradError(
            f"argument {', '.join(bad)} of {what} {getattr(fit, '__qualname__', 'fit')} "
            "requires grad, but only the hyperparameters (the first argument) are differentiated:"
            " it would silently get no gradient. Pass it detached (.detach(); e.g. a warm start, "
            "whose derivative is zero at a solution), or make it part of the hyperparameters"
        )
