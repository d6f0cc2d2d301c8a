"""What every linear solver shares: the :class:`SolveInfo` record, the :class:`Solver` base class
(settings declared as validated, frozen dataclass fields), argument checks and the failure warnings.

A solver solves ``(A + damping*I) x = b`` for an operator ``A`` given only as a ``matvec`` on
flat pytrees (tuples of tensors). It knows nothing about losses or modules. What the Krylov
solvers share is in :mod:`~hypergrad.solvers.krylov`, dense columns in
:mod:`~hypergrad.solvers.dense`.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch

from ..errors import (
    HypergradValueError,
    HypergradWarning,
    SingularSystemWarning,
    SolveFailedWarning,
    SolverDivergedWarning,
    SolverStalledWarning,
    warn,
)
from ..report_base import IterationReport
from ..settings import (
    FrozenSettings,
)
from ..tree import Tensors, tree_all_finite, tree_axpy
from .arguments import normalizing_solve

if TYPE_CHECKING:
    from .functional import Kernel

MatVec = Callable[[Tensors], Tensors]
_F = TypeVar("_F", bound=Callable[..., Any])
_S = TypeVar("_S", bound="FrozenSettings")

#: The solvers of :mod:`hypergrad.solvers` by name (``"cg"`` -> :class:`~hypergrad.CG`), filled
#: as each class is defined (:meth:`Solver.__init_subclass__`): the one list of every solver.
SOLVERS: dict[str, type[Solver]] = {}
#: How error messages name each solver (``SolveInfo.solver`` -> ``display``), from the classes.
DISPLAY_NAMES: dict[str, str] = {}


@dataclass
class SolveInfo(IterationReport):
    """Diagnostics of one linear solve.

    A report states only what was checked: ``converged`` is set only when a residual recomputed
    from the returned ``x`` (one extra operator product, ``b - (A + damping I) x``) met the
    tolerance; singular systems and stalled iterations are flagged in ``extras`` and warned about.

    Attributes:
        solver: the solver's ``name`` ("cg", "minres", ...: the keys of :data:`SOLVERS`).
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

    # solver, iterations, residual, converged, diverged, residuals, extras: IterationReport's
    matvecs: int = 0
    alpha: float | None = None

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


class Solver(FrozenSettings):
    """Base class of the solvers: the class *is* the algorithm.

    A solver is a keyword-only dataclass whose fields are its settings, declared with their checks
    (:func:`number`, :func:`count`, :func:`integer`, :func:`flag`, or :func:`setting` with any
    check) and validated once when it is built (``__post_init__``; :meth:`check` for rules that
    involve several settings). The settings are then frozen (:class:`FrozenSettings`:
    ``solver.tol = ...`` raises :class:`~hypergrad.errors.FrozenSettingError`;
    ``solver.replace(tol=...)`` builds a validated copy). :meth:`solve` holds the algorithm and
    reads ``self.<setting>``; the functional form is derived from the class
    (:func:`functional_form`). ``name`` is what :attr:`SolveInfo.solver` reports and ``display``
    how messages name the solver (the class name unless set). ``docs/solvers.md`` ("Writing a
    solver") has a worked example.

    A subclass that defines its own ``__post_init__`` without calling ``self._freeze()`` stays
    mutable.
    """

    name: ClassVar[str] = "solver"
    display: ClassVar[str] = "Solver"
    #: the algorithm assumes a symmetric operator (CG, MINRES, Nystrom): given a condition that
    #: is not known to be symmetric, ``custom_root`` probes its symmetry first (a new solver
    #: declares it here, in its own file; nothing else needs an edit)
    symmetric_only: ClassVar[bool] = False
    damping: float = 0.0

    def assumes_symmetric(self) -> str | None:
        """How messages name this solver's assumption of a symmetric operator (its display
        name), or None when it does not assume one. ``symmetric_only`` unless a setting decides
        (Neumann with ``alpha=None``, whose step comes from a symmetric power iteration)."""
        return self.display if self.symmetric_only else None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "display" not in cls.__dict__:
            cls.display = cls.__name__
        if "solve" in cls.__dict__:  # every solver takes what users pass (solvers/arguments.py)
            cls.solve = normalizing_solve(cls.__dict__["solve"])  # type: ignore[method-assign]
        if cls.__module__.startswith(f"{__package__}.") and "name" in cls.__dict__:
            SOLVERS[cls.name] = cls
            DISPLAY_NAMES[cls.name] = cls.display

    def solve(
        self, matvec: MatVec, b: Tensors, x0: Tensors | None = None
    ) -> tuple[Tensors, SolveInfo]:
        """Solve ``(A + damping I) x = b`` given ``matvec: v -> A v``, from ``x0`` (zeros when
        None); returns ``(x, info)``.

        ``b`` is a tensor or a tuple/list/dict (nested) of floating-point tensors, ``x0`` has its
        structure, shapes and dtypes, ``matvec`` takes and returns that structure (keeping the
        dtypes), and ``x`` comes back with the structure of ``b``. A subclass's ``solve`` is
        wrapped to check this once (:func:`~hypergrad.solvers.arguments.normalizing_solve`): its
        own body sees ``b`` and ``x0`` as flat tuples of tensors and a ``matvec`` on them.

        Raises:
            HypergradTypeError: ``b`` or ``x0`` is not a pytree of floating-point tensors,
                ``x0``'s structure or dtypes differ from ``b``'s, or ``matvec`` returned another
                structure or dtype.
            HypergradValueError: ``x0`` or a product has other shapes (or devices) than ``b``.
        """
        raise NotImplementedError

    def __call__(
        self, matvec: MatVec, b: Tensors, x0: Tensors | None = None
    ) -> tuple[Tensors, SolveInfo]:
        return self.solve(matvec, b, x0)

    def kernel(self) -> Kernel[Any] | None:
        """The solver as tensor code for :func:`~hypergrad.compile_implicit_grad`: an
        :class:`~hypergrad.solvers.functional.IterativeKernel` (a masked step) or a
        :class:`~hypergrad.solvers.functional.DenseKernel`, written beside :meth:`solve` in
        the solver's own file; None (the default): the solver is not compilable. Raises
        :class:`~hypergrad.HypergradValueError` for settings its kernel does not support."""
        return None


def functional_form(cls: type[Solver]) -> Callable[[_F], _F]:
    """Decorate ``solve_x(matvec, b, x0=None, **settings)``, the functional form of ``cls``, so
    that its signature (``inspect.signature``, the API reference) shows ``cls``'s settings as
    keyword-only parameters; the body is ``return cls(**settings).solve(matvec, b, x0)``, so the
    function validates its settings exactly as the class does."""

    def decorate(fn: _F) -> _F:
        own = list(inspect.signature(fn).parameters.values())[:3]
        settings = [
            p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
            for p in inspect.signature(cls).parameters.values()
        ]
        fn.__signature__ = inspect.signature(fn).replace(  # type: ignore[attr-defined]
            parameters=own + settings
        )
        return fn

    return decorate


def damped(matvec: MatVec, damping: float) -> MatVec:
    """Return ``v -> matvec(v) + damping * v`` (``matvec`` itself when damping is 0)."""
    if damping == 0.0:
        return matvec
    return lambda v: tree_axpy(damping, v, matvec(v))


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


#: The warning category of each :attr:`SolveInfo.failure`; any other failure (a relative residual
#: above 1 or not finite) warns :class:`~hypergrad.SolveFailedWarning` (:func:`failure_warning`).
FAILURE_CATEGORIES: dict[str, type[HypergradWarning]] = {
    "diverged": SolverDivergedWarning,
    "singular": SingularSystemWarning,
    "stalled": SolverStalledWarning,
}

#: The warnings that report a :attr:`SolveInfo.failure` (one of them is emitted for each).
FAILURE_WARNINGS: tuple[type[HypergradWarning], ...] = (
    *FAILURE_CATEGORIES.values(),
    SolveFailedWarning,
)


def failure_warning(
    failure: str, other: type[HypergradWarning] = SolveFailedWarning
) -> type[HypergradWarning]:
    """The warning class of a :attr:`SolveInfo.failure` (the one table of the library); a
    failure without a category of its own (a residual above 1 or not finite) gets ``other``."""
    return FAILURE_CATEGORIES.get(failure, other)


def emit(
    info: SolveInfo,
    message: str,
    category: type[HypergradWarning],
    stacklevel: int | None = None,
) -> None:
    """:func:`hypergrad.errors.warn` that records a failure warning's class in
    ``info.extras["warned"]``.

    The warning points at the user's line (``stacklevel=None``, see
    :func:`~hypergrad.errors.warn`); an int means what it means to a ``warnings.warn`` in the
    function calling ``emit`` (1: that function's own line).
    """
    if issubclass(category, FAILURE_WARNINGS):
        info.extras["warned"] = category.__name__
    warn(message, category, None if stacklevel is None else stacklevel + 1)


def _outer(stacklevel: int | None) -> int | None:
    # an explicit stacklevel counts from the caller of the function it was passed to
    return None if stacklevel is None else stacklevel + 1


def report_failure(
    info: SolveInfo, stacklevel: int | None = None, *, symmetric: bool | None = True
) -> None:
    """Warn when ``info.failure`` is set and no failure warning has been emitted for it yet.

    Every solver calls this last, so that a result that is not a hypergradient (in particular a
    residual above 1 or not finite with no more specific cause) is never returned silently. The
    text is fixed (see :func:`warn_diverged`). The warning points at the user's line
    (``stacklevel=None``; an int is counted as by ``warnings.warn`` from this function).
    ``symmetric`` (what the caller knows of the operator, see
    :mod:`~hypergrad.solvers.arguments`) picks the advice for a residual above 1: MINRES only for
    an operator known to be symmetric, GMRES for one that is not.
    """
    failure = info.failure
    if failure is None or info.extras.get("warned"):
        return
    if failure == "diverged":
        warn_diverged(info, "The returned x is not a solution.", _outer(stacklevel))
    elif failure == "singular":
        warn_singular(info, "the system is singular and inconsistent.", _outer(stacklevel))
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
            + _RESIDUAL_ADVICE[symmetric],
            SolveFailedWarning,
            stacklevel,
        )


#: The advice of :func:`report_failure` for a residual above 1, by what is known of symmetry.
_RESIDUAL_ADVICE: dict[bool | None, str] = {
    True: "Add damping, raise maxiter, or use MINRES.",
    False: "Add damping, raise maxiter, or use GMRES (the operator is not known to be symmetric).",
    None: "Add damping, raise maxiter, or use MINRES (symmetric operators) or GMRES (any).",
}


def warn_diverged(info: SolveInfo, hint: str, stacklevel: int | None = None) -> None:
    """Emit the standard divergence warning.

    The text is fixed per cause (no iteration counts, residuals or step sizes in it, those are in
    ``info``), so Python's default warning filter shows it once per call site instead of once per
    solve: a training loop is not flooded. ``hint`` must be a fixed string too. The warning points
    at the user's line (``stacklevel=None``; an int is counted as by ``warnings.warn`` from this
    function).
    """
    emit(
        info,
        f"{info.solver} solver diverged; the hypergradient is not reliable (iterations, residual "
        f"and growth are in the returned SolveInfo). {hint}",
        SolverDivergedWarning,
        stacklevel,
    )


def warn_singular(info: SolveInfo, detail: str, stacklevel: int | None = None) -> None:
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
