"""What every linear solver shares: the :class:`SolveInfo` record, the solver protocol, argument
checks (and deprecated argument names), the common start of an iteration and dense columns.

A solver solves ``(A + damping*I) x = b`` for a symmetric operator ``A`` given only as a
``matvec`` on flat pytrees (tuples of tensors). It knows nothing about losses or modules.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, overload

import torch

from ..errors import (
    FrozenSettingError,
    HypergradValueError,
    HypergradWarning,
    SingularSystemWarning,
    SolveFailedWarning,
    SolverDivergedWarning,
    SolverStalledWarning,
)
from ..tree import (
    Tensors,
    tree_all_finite,
    tree_axpy,
    tree_norm,
    tree_numel,
    tree_ravel,
    tree_sub,
    tree_unravel,
    tree_zeros_like,
)

MatVec = Callable[[Tensors], Tensors]
_F = TypeVar("_F", bound=Callable[..., Any])
_S = TypeVar("_S", bound="FrozenSettings")

#: How error messages name each solver (``SolveInfo.solver`` -> display name).
DISPLAY_NAMES = {
    "cg": "CG",
    "minres": "MINRES",
    "neumann": "Neumann",
    "exact": "Exact",
    "nystrom": "Nystrom",
    "gmres": "GMRES",
    "bicgstab": "BiCGStab",
}


@dataclass
class SolveInfo:
    """Diagnostics of one linear solve.

    A report states only what was checked: ``converged`` is set only when a residual recomputed
    from the returned ``x`` (one extra operator product, ``b - (A + damping I) x``) met the
    tolerance; singular systems and stalled iterations are flagged in ``extras`` and warned about.

    Attributes:
        solver: solver name ("cg", "minres", "neumann", "exact", "nystrom").
        iterations: iterations performed.
        matvecs: operator products spent (power iterations and residual checks included).
        residual: relative residual ``||(A + damping I) x - b|| / ||b||``. Recomputed from ``x``
            whenever ``extras["residual_verified"]`` is True (always for Exact and Nystrom; for
            CG/MINRES when they claim convergence or stop on a singular system; for Neumann with
            ``exact_residual`` or a met ``tol``); otherwise the iteration's own estimate (CG and
            MINRES at ``maxiter``; Neumann's upper bound ``||v_K|| / ||b||``).
        converged: the recomputed residual met the requested tolerance.
        diverged: the iteration blew up (growing terms, NaN/Inf, or negative curvature in CG);
            the result must not be trusted.
        alpha: step size used (Neumann only).
        residuals: the iteration's own residual after each iteration (for convergence plots).
        extras: solver-specific details. Common keys: ``"b_norm"``; ``"residual_verified"``;
            ``"recurrence_residual"`` (the iteration's estimate, when ``residual`` was
            recomputed); ``"restarts"`` and ``"residual_mismatch"`` (CG/MINRES: the estimate met
            ``tol`` but the recomputed residual did not, even after restarting from it). MINRES:
            ``"singular"`` (the system is singular and ``b`` is not in the operator's range: ``x``
            is a least-squares solution and no ``x`` meets ``tol``), ``"lstsq_residual"`` (that
            least-squares floor), ``"lstsq_iteration"``, ``"zero_operator"`` (the product is
            exactly zero; also CG). CG: ``"negative_curvature"``. Neumann: ``"stalled"`` (the
            terms stopped shrinking), ``"contraction"`` (last ratio of term norms), ``"growth"``,
            ``"lambda_max"``, ``"residual_is_bound"``. Exact: ``"condition_number"`` (an
            estimate of the 1-norm condition number, never above it and almost always within a
            factor of 3; see :func:`~hypergrad.solvers.exact.condition_estimate`),
            ``"method"`` (``"lu"`` or ``"pinv"``), ``"numerical_rank"``, ``"singular"``.
    """

    solver: str
    iterations: int = 0
    matvecs: int = 0
    residual: float = float("nan")
    converged: bool = False
    diverged: bool = False
    alpha: float | None = None
    residuals: list[float] = field(default_factory=list)
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def failure(self) -> str | None:
        """Why the returned ``x`` is not the solution of a solvable system (None when it is one).

        The one definition of "not a hypergradient" that every entry point uses (the warnings of
        :func:`~hypergrad.implicit_grad`, ``HyperStep``'s ``on_diverged`` policy). In order:

        * ``"diverged"``: the iteration blew up (growing terms, negative curvature in CG, an
          iterate growing on an inconsistent system);
        * ``"singular"``: the system is singular and ``b`` is outside the operator's range, so no
          ``x`` solves it (``x`` is at best a least-squares point, defined up to the null space);
        * ``"stalled"``: the iteration stopped making progress (Neumann terms that no longer
          shrink);
        * ``"non-finite residual"``: the residual is NaN or Inf;
        * ``"residual above 1"``: ``||(A + damping I) x - b|| / ||b|| > RESIDUAL_LIMIT`` (1.0):
          ``x`` is a worse answer than ``x = 0``, so the indirect term is noise.

        A solve that merely stopped at ``maxiter`` with a residual below 1 (truncated CG,
        a short Neumann series) is an approximate hypergradient, not a failure: ``converged``
        says whether it met ``tol``.

        Every solver of :mod:`hypergrad.solvers` (and :func:`~hypergrad.compile_implicit_grad`)
        emits a :class:`~hypergrad.HypergradWarning` subclass whenever this is not None
        (:class:`~hypergrad.SolverDivergedWarning`, :class:`~hypergrad.SingularSystemWarning`,
        :class:`~hypergrad.SolverStalledWarning`, or
        :class:`~hypergrad.errors.SolveFailedWarning` for a residual above 1 or not finite);
        ``extras["warned"]`` names the class.
        """
        if self.diverged:
            return "diverged"
        if self.extras.get("singular"):
            return "singular"
        if self.extras.get("stalled"):
            return "stalled"
        if not math.isfinite(self.residual):
            return "non-finite residual"
        if self.residual > RESIDUAL_LIMIT:
            return "residual above 1"
        return None


#: A relative residual above this makes a solve's result "not a hypergradient"
#: (:attr:`SolveInfo.failure`): it is farther from solving the system than ``x = 0``.
RESIDUAL_LIMIT = 1.0


class FrozenSettings:
    """Mixin making a dataclass's settings read-only once :meth:`_freeze` has run.

    The settings (the dataclass's ``__init__`` fields) are validated once, in ``__post_init__``,
    which ends with ``self._freeze()``; afterwards assigning or deleting a setting, or adding a
    new public attribute, raises :class:`~hypergrad.errors.FrozenSettingError` (an
    ``AttributeError``): a setting changed later would not be validated (``tol = inf`` would
    report ``converged`` with the indirect term missing) and a compiled graph could keep a stale
    copy of it. Build a new object instead: :meth:`replace` returns a copy with some settings
    changed, validated like a new one. Attributes starting with ``_`` and non-``__init__``
    fields (state such as ``DensePreconditioner.builds``) stay writable.
    """

    _frozen: bool = False

    def _freeze(self) -> None:
        object.__setattr__(self, "_frozen", True)

    def _refuse(self, name: str) -> bool:
        if not self._frozen or name.startswith("_"):
            return False
        if dataclasses.is_dataclass(self):
            for f in dataclasses.fields(self):
                if f.name == name:
                    return f.init
        return True

    def _frozen_error(self, name: str) -> FrozenSettingError:
        cls = type(self).__name__
        return FrozenSettingError(
            f"{cls}.{name} cannot be changed after construction: settings are validated when "
            f"the {cls} is built and read by every solve (eager or compiled). Build a new one, "
            f"e.g. solver.replace({name}=...) (dataclasses.replace)"
        )

    def __setattr__(self, name: str, value: Any) -> None:
        if self._refuse(name):
            raise self._frozen_error(name)
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if self._refuse(name):
            raise self._frozen_error(name)
        object.__delattr__(self, name)

    def replace(self: _S, **changes: Any) -> _S:
        """A copy with ``changes`` applied, validated as a new object (``dataclasses.replace``).

        Example:
            >>> from hypergrad import CG
            >>> CG(tol=1e-6).replace(tol=1e-10).tol
            1e-10
        """
        if not dataclasses.is_dataclass(self):
            raise HypergradValueError(f"{type(self).__name__} is not a dataclass: no replace()")
        return dataclasses.replace(self, **changes)


class Solver(FrozenSettings):
    """Base class: a configured solver is called as ``solver.solve(matvec, b, x0)``.

    Subclasses hold their settings as keyword-only fields and forward them to their ``solve_*``
    function by keyword. The library's solvers freeze their settings after validating them
    (:class:`FrozenSettings`: ``solver.tol = ...`` raises
    :class:`~hypergrad.errors.FrozenSettingError`; ``solver.replace(tol=...)`` builds a new one);
    a subclass that never calls ``self._freeze()`` stays mutable.
    """

    name = "solver"
    damping: float = 0.0

    def solve(
        self, matvec: MatVec, b: Tensors, x0: Tensors | None = None
    ) -> tuple[Tensors, SolveInfo]:
        raise NotImplementedError

    def __call__(
        self, matvec: MatVec, b: Tensors, x0: Tensors | None = None
    ) -> tuple[Tensors, SolveInfo]:
        return self.solve(matvec, b, x0)


def damped(matvec: MatVec, damping: float) -> MatVec:
    """Return ``v -> matvec(v) + damping * v`` (``matvec`` itself when damping is 0)."""
    if damping == 0.0:
        return matvec
    return lambda v: tree_axpy(damping, v, matvec(v))


@overload
def check_number(
    name: str,
    value: Any,
    minimum: float = ...,
    strict: bool = ...,
    allow_none: Literal[False] = ...,
) -> float: ...
@overload
def check_number(
    name: str,
    value: Any,
    minimum: float = ...,
    strict: bool = ...,
    allow_none: bool = ...,
) -> float | None: ...
def check_number(
    name: str,
    value: Any,
    minimum: float = 0.0,
    strict: bool = False,
    allow_none: bool = False,
) -> float | None:
    """Validate a real setting of a solver and return it as a Python float.

    Python and NumPy reals are accepted; bools, non-numbers, NaN and infinities are refused (an
    infinite tolerance or step cannot give a hypergradient), and so are values below ``minimum``
    (``minimum`` itself too when ``strict``).

    Args:
        name: argument name for the message, e.g. ``"CG tol"``.
        value: the value to check.
        minimum: smallest accepted value.
        strict: refuse ``minimum`` itself (``value > minimum``).
        allow_none: accept None (returned as is).

    Raises:
        HypergradValueError: naming ``name`` and the valid range.
    """
    if value is None and allow_none:
        return None
    kind = f"> {minimum:g}" if strict else f">= {minimum:g}"
    tail = " (or None)" if allow_none else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise HypergradValueError(f"{name} must be a number {kind} and finite{tail}, got {value!r}")
    out = float(value)
    if not math.isfinite(out) or out < minimum or (strict and out == minimum):
        raise HypergradValueError(f"{name} must be {kind} and finite{tail}, got {value!r}")
    return out


@overload
def check_iters(
    name: str, value: Any, minimum: int = ..., *, allow_none: Literal[False], why: str = ...
) -> int: ...
@overload
def check_iters(
    name: str, value: Any, minimum: int = ..., allow_none: bool = ..., why: str = ...
) -> int | None: ...
def check_iters(
    name: str, value: Any, minimum: int = 0, allow_none: bool = True, why: str = ""
) -> int | None:
    """Validate an iteration count (Python or NumPy integer) and return it as a Python int.

    Args:
        name: argument name for the message, e.g. ``"CG maxiter"``.
        value: the value to check.
        minimum: smallest accepted value.
        allow_none: accept None (returned as is).
        why: appended to the message (why the range is what it is).

    Raises:
        HypergradValueError: naming ``name`` and the valid range.
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        low = f" >= {minimum}" if minimum > 0 else ""
        tail = " or None" if allow_none else ""
        raise HypergradValueError(
            f"{name} must be a non-negative int{low}{tail}{why}, got {value!r}"
        )
    return int(value)


def renamed_arguments(**renames: str) -> Callable[[_F], _F]:
    """Accept old keyword names as deprecated aliases of their new names.

    Decorates a function, or a class (its ``__init__``): each ``old=new`` pair lets callers pass
    ``old=value``, which is forwarded as ``new=value`` with a :class:`DeprecationWarning`.
    Passing both names raises. The decorated signature (``inspect.signature``) shows the new
    names only.

    Raises:
        HypergradValueError: both the old and the new name were passed.

    Example:
        >>> @renamed_arguments(steps="maxiter")
        ... def run(*, maxiter=10):
        ...     return maxiter
        >>> import warnings
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore", DeprecationWarning)
        ...     run(steps=3)
        3
    """

    def wrap(fn: Callable[..., Any], where: str) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            for old, new in renames.items():
                if old not in kwargs:
                    continue
                if new in kwargs:
                    raise HypergradValueError(
                        f"{where}: pass {new}= only; {old}= is its deprecated name, not a "
                        "second setting"
                    )
                warnings.warn(
                    f"{where}({old}=...) is deprecated: use {new}=... (the same setting)",
                    DeprecationWarning,
                    stacklevel=2,
                )
                kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return wrapper

    def decorate(obj: _F) -> _F:
        if isinstance(obj, type):
            obj.__init__ = wrap(obj.__init__, obj.__name__)  # type: ignore[misc]
            return obj
        return wrap(obj, obj.__name__)  # type: ignore[return-value]

    return decorate


def renamed_attribute(owner: str, old: str, new: str) -> property:
    """A property ``old`` that reads and writes attribute ``new`` with a DeprecationWarning."""

    def message() -> str:
        return f"{owner}.{old} is deprecated: use {owner}.{new} (the same setting)"

    def get(self: Any) -> Any:
        warnings.warn(message(), DeprecationWarning, stacklevel=2)
        return getattr(self, new)

    def put(self: Any, value: Any) -> None:
        warnings.warn(message(), DeprecationWarning, stacklevel=2)
        setattr(self, new, value)

    return property(get, put, doc=f"Deprecated alias of ``{new}``.")


def start(
    op: MatVec, b: Tensors, x0: Tensors | None, info: SolveInfo
) -> tuple[Tensors, Tensors, float] | None:
    """The common start of an iterative solve: ``(x, r, b_norm)``, or None when ``b = 0``.

    Records ``b_norm`` in ``info.extras``. A zero right-hand side has the solution 0: ``info``
    is marked converged with residual 0 and None is returned (the caller returns zeros). Otherwise
    ``x`` is ``x0`` (zeros when None) and ``r = b - op(x)``, recomputed with one product for a warm
    start (counted in ``info``; ``info.residual`` is its relative norm, 1 without a warm start).

    Raises:
        HypergradValueError: the product at the warm start returned NaN/Inf.
    """
    b_norm = as_float(tree_norm(b))
    info.extras["b_norm"] = b_norm
    if b_norm == 0.0:
        info.residual, info.converged = 0.0, True
        return None
    if x0 is None:
        info.residual = 1.0
        return tree_zeros_like(b), b, b_norm
    name = DISPLAY_NAMES.get(info.solver, info.solver)
    r, info.residual = recomputed_residual(op, b, x0, b_norm, info, name, "the warm start x0")
    return x0, r, b_norm


def dense_matrix(
    matvec: MatVec, like: Tensors, columns: Sequence[int] | None = None, solver: str = "dense"
) -> torch.Tensor:
    """Materialise columns of the operator as a dense float64 matrix over *all* leaves.

    Column ``j`` is ``matvec(e_j)`` (one product each), flattened over every leaf of ``like``:
    off-diagonal blocks between leaves are kept (a block-diagonal approximation would silently
    give wrong answers for coupled parameters). When ``matvec`` has a ``batched`` method
    (``V -> A V`` over a leading batch dimension, or None when it cannot batch), the columns after
    the first two come from batched products (chunks of :data:`COLUMN_CHUNK`) when a probe batch
    of :data:`PROBE_COLUMNS` columns beats as many single products (:func:`batching_pays`; the
    numbers agree with the one-by-one products to rounding).

    Args:
        matvec: ``v -> A v`` on flat pytrees shaped like ``like``.
        like: a flat pytree fixing the shapes, dtype and device of the unit vectors.
        columns: the indices ``j`` to compute, in order (None: all ``n``, the full matrix).
        solver: the caller's name for the error message.

    Returns:
        a float64 tensor of shape ``(n, len(columns))`` (``(n, n)`` for all columns).

    Raises:
        HypergradValueError: a column has NaN/Inf (the message names it).

    Example:
        >>> A = torch.tensor([[2.0, 1.0], [1.0, 3.0]])
        >>> dense_matrix(lambda v: (A @ v[0],), (torch.zeros(2),), columns=[1])
        tensor([[1.],
                [3.]], dtype=torch.float64)
    """
    n = tree_numel(like)
    ref = like[0]
    idx = list(range(n) if columns is None else [int(j) for j in columns])

    def column(j: int) -> torch.Tensor:
        e = torch.zeros(n, dtype=ref.dtype, device=ref.device)
        e[j] = 1.0
        return tree_ravel(matvec(tree_unravel(e, like)), torch.float64)

    cols: list[torch.Tensor] = []
    batched = getattr(matvec, "batched", None)
    if callable(batched) and len(idx) > 2 + PROBE_COLUMNS:
        cols.append(column(idx[0]))  # warms up
        _sync(ref)
        t0 = time.perf_counter()
        cols.append(column(idx[1]))
        t_one = _elapsed(t0, ref)
        t0 = time.perf_counter()
        probe = batched_columns(batched, like, idx[2 : 2 + PROBE_COLUMNS])
        t_batch = _elapsed(t0, ref)
        if probe is not None:
            cols.extend(probe.unbind(1))
            if batching_pays(t_one, t_batch, PROBE_COLUMNS):
                rest = batched_columns(batched, like, idx[len(cols) :])
                cols.extend(() if rest is None else rest.unbind(1))
    cols.extend(column(j) for j in idx[len(cols) :])
    mat = torch.stack(cols, dim=1) if cols else torch.zeros(n, 0, dtype=torch.float64)
    bad = (~torch.isfinite(mat)).any(dim=0).nonzero()
    if len(bad):
        j = idx[int(bad[0])]
        raise nonfinite_product_error(solver, f"column {j} (unit vector e_{j})")
    return mat


#: Columns per batched product in :func:`dense_matrix` (bounds the memory of one batch).
COLUMN_CHUNK = 256
#: Columns in :func:`dense_matrix`'s probe batch, which decides whether batching pays.
PROBE_COLUMNS = 8


def batching_pays(t_one: float, t_batch: float, k: int) -> bool:
    """Whether :func:`dense_matrix` builds the remaining columns in batches: a batch of ``k``
    columns took ``t_batch`` s against ``t_one`` s for one product.

    A batched backward pass saves the per-product overhead but can cost several times the flops
    of the products it replaces (``vmap`` expands some intermediates by the batch size): the 30
    columns of a ridge Hessian took 1.61 ms batched vs 2.28 ms one by one on 500 x 30 data, but
    100 ms vs 18 ms on 50,000 x 30 (one CPU thread; the table in docs/solvers.md). The numbers
    agree to rounding either way.
    """
    return t_batch < k * t_one


def _sync(ref: torch.Tensor) -> None:
    """Wait until the device of ``ref`` has finished its queued work (nothing on a CPU)."""
    if ref.is_cuda:
        torch.cuda.synchronize(ref.device)


def _elapsed(t0: float, ref: torch.Tensor) -> float:
    """Seconds since ``t0``, once the device of ``ref`` has finished its queued work."""
    _sync(ref)
    return time.perf_counter() - t0


def batched_columns(
    batched: Callable[[Tensors], Tensors | None], like: Tensors, idx: list[int]
) -> torch.Tensor | None:
    """Columns ``idx`` of the operator from batched products (``batched(V) -> A V`` over a
    leading batch dimension, or None when it cannot batch), in chunks of
    :data:`COLUMN_CHUNK`; None when the operator cannot batch."""
    n = tree_numel(like)
    ref = like[0]
    blocks = []
    for start in range(0, len(idx), COLUMN_CHUNK):
        chunk = idx[start : start + COLUMN_CHUNK]
        eye = torch.zeros(len(chunk), n, dtype=ref.dtype, device=ref.device)
        eye[torch.arange(len(chunk)), torch.tensor(chunk, dtype=torch.long)] = 1.0
        vs = []
        offset = 0
        for t in like:
            vs.append(eye[:, offset : offset + t.numel()].reshape(len(chunk), *t.shape))
            offset += t.numel()
        out = batched(tuple(vs))
        if out is None:
            return None
        flat = torch.cat([o.reshape(len(chunk), -1).to(torch.float64) for o in out], dim=1)
        blocks.append(flat.T)
    return torch.cat(blocks, dim=1) if blocks else torch.zeros(n, 0, dtype=torch.float64)


def nonfinite_product_error(solver: str, where: str) -> HypergradValueError:
    """The error for an operator product that returned NaN/Inf (``where``: e.g. "iteration 3")."""
    return HypergradValueError(
        f"{solver}: the Hessian-vector product at {where} returned NaN/Inf for a finite input "
        "vector: the inner loss's second derivatives are not finite at params (e.g. x ** 1.5, "
        "sqrt or log at 0, a division by zero), which no solver setting can fix; check the "
        "inner loss or evaluate it at another point"
    )


def check_product(solver: str, where: str, v: Tensors, av: Tensors) -> None:
    """Raise when an operator product ``av = A v`` is not finite although ``v`` is.

    Called only after a scalar derived from ``av`` came out NaN/Inf, so the common path costs
    nothing. A non-finite ``v`` means the solver's own recurrence overflowed: no error here,
    the caller reports divergence.

    Raises:
        HypergradValueError: the Hessian-vector product produced NaN/Inf, naming the solver and
            where (``where``, e.g. ``"iteration 3"``).
    """
    if tree_all_finite(av) or not tree_all_finite(v):
        return
    raise nonfinite_product_error(solver, where)


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
        recurrence = info.residual
        r, rel = recomputed_residual(op, b, x, b_norm, info, solver, "the residual check")
        info.extras["recurrence_residual"] = recurrence
        info.extras["residual_verified"] = True
        info.residual = rel
        if rel <= tol:
            info.converged = True
            if info.extras.get("singular"):  # a solution exists after all
                info.extras["singular"] = False
            return x
        if fallback is not None and status != "singular":
            x_c, rec_c, it_c = fallback
            fallback = None
            r_c, rel_c = recomputed_residual(op, b, x_c, b_norm, info, solver, "the residual check")
            if rel_c < rel or not math.isfinite(rel):
                x, r, rel, status = x_c, r_c, rel_c, "singular"
                info.residual = rel
                info.extras["recurrence_residual"] = rec_c
                info.extras.update(singular=True, lstsq_residual=rec_c, lstsq_iteration=it_c)
        if status == "singular":
            if info.extras.get("zero_operator"):
                detail = (
                    "the Hessian-vector product is exactly zero (an inner loss linear in the "
                    "parameters has no curvature)."
                )
            elif info.extras.get("singular_test"):  # CG
                detail = (
                    "the system is singular and inconsistent (or numerically singular): CG "
                    "met a search direction of numerically zero curvature or a residual growing "
                    "far above its minimum, where its iterate grows without bound; it stopped "
                    "and returned the iterate with the smallest residual."
                )
            else:
                detail = (
                    "the system is singular and inconsistent: the iteration reached a "
                    "least-squares solution (||H r|| = 0 up to rounding) with the residual "
                    "above tol."
                )
            warn_singular(info, detail)
            return x
        if not math.isfinite(rel):  # x overflowed
            info.diverged = True
            warn_diverged(info, "The iterate overflowed (NaN/Inf in x).")
            return x
        if status == "maxiter":
            return x
        stuck = last_rel is not None and rel > 0.5 * last_rel  # a restart did not help
        last_rel = rel
        if restarts >= MAX_RESTARTS or info.iterations >= maxiter or stuck:
            info.extras["residual_mismatch"] = True
            warnings.warn(
                f"{info.solver}: the recurrence residual met tol but the recomputed residual "
                "||Hx - b||/||b|| does not (both in SolveInfo: residual, "
                "extras['recurrence_residual'], extras['restarts']): the system is too "
                "ill-conditioned (or nearly singular) for this tolerance in this precision; "
                "loosen tol, add damping, or use float64",
                HypergradWarning,
                stacklevel=4,
            )
            return x
        restarts += 1
        info.extras["restarts"] = restarts
        box[:] = [x, r]
        del x, r


#: The warnings that report a :attr:`SolveInfo.failure` (one of them is emitted for each).
FAILURE_WARNINGS: tuple[type[HypergradWarning], ...] = (
    SolverDivergedWarning,
    SingularSystemWarning,
    SolverStalledWarning,
    SolveFailedWarning,
)


def emit(info: SolveInfo, message: str, category: type[HypergradWarning], stacklevel: int) -> None:
    """``warnings.warn`` that records a failure warning's class in ``info.extras["warned"]``."""
    if issubclass(category, FAILURE_WARNINGS):
        info.extras["warned"] = category.__name__
    warnings.warn(message, category, stacklevel=stacklevel + 1)


def report_failure(info: SolveInfo, stacklevel: int = 3) -> None:
    """Warn when ``info.failure`` is set and no failure warning has been emitted for it yet.

    Every solver calls this last, so that a result that is not a hypergradient (in particular a
    residual above 1 or not finite with no more specific cause) is never returned silently. The
    text is fixed (see :func:`warn_diverged`).
    """
    failure = info.failure
    if failure is None or info.extras.get("warned"):
        return
    if failure == "diverged":
        warn_diverged(info, "The returned x is not a solution.", stacklevel + 1)
    elif failure == "singular":
        warn_singular(info, "the system is singular and inconsistent.", stacklevel + 1)
    elif failure == "stalled":
        emit(
            info,
            f"{info.solver}: the iteration stalled; the hypergradient is not reliable.",
            SolverStalledWarning,
            stacklevel,
        )
    else:
        emit(
            info,
            f"{info.solver}: the returned x is not a hypergradient: its relative residual "
            "||Hx - b||/||b|| (SolveInfo.residual) is above 1 or not finite, so x is a worse "
            "answer than x = 0 (the Hessian may be singular, indefinite or very ill-conditioned). "
            "Add damping, raise maxiter, or use MINRES.",
            SolveFailedWarning,
            stacklevel,
        )


def warn_diverged(info: SolveInfo, hint: str, stacklevel: int = 3) -> None:
    """Emit the standard divergence warning.

    The text is fixed per cause (no iteration counts, residuals or step sizes in it, those are in
    ``info``), so Python's default warning filter shows it once per call site instead of once per
    solve: a training loop is not flooded. ``hint`` must be a fixed string too.
    """
    emit(
        info,
        f"{info.solver} solver diverged; the hypergradient is not reliable (iterations, residual "
        f"and growth are in the returned SolveInfo). {hint}",
        SolverDivergedWarning,
        stacklevel,
    )


def warn_singular(info: SolveInfo, detail: str, stacklevel: int = 3) -> None:
    """Emit the standard singular-system warning (fixed text, as :func:`warn_diverged`)."""
    emit(
        info,
        f"{info.solver}: {detail} The relative residual cannot reach tol (SolveInfo.residual is "
        "that of the returned x; MINRES and Exact also give the least-squares floor in "
        "SolveInfo.extras['lstsq_residual']): the Hessian is singular and the hypergradient is "
        "not determined. Add damping, or make the inner loss depend on every parameter it is "
        "differentiated for.",
        SingularSystemWarning,
        stacklevel,
    )


def as_float(t: torch.Tensor | float) -> float:
    return float(t.item()) if isinstance(t, torch.Tensor) else float(t)
