"""How :class:`~hypergrad.HyperStep` differentiates, as objects, and the warm-start rule.

* :class:`Implicit` (``solver``, ``engine``, ``warm_start``): the implicit function theorem at the
  current inner parameters, one linear solve per hypergradient.
* :class:`Unrolled` (``optimizer``, ``steps``, ``truncate``): reverse mode through ``steps``
  look-ahead optimizer updates.
* :class:`WarmStart`: the start of each adjoint solve from the previous ones (``"previous"`` or
  ``"extrapolate"``), the rule ``HyperStep`` applies, public for loops over
  :func:`~hypergrad.implicit_grad`::

      starts = hg.WarmStart("extrapolate")
      for batch in batches:
          g, info = hg.implicit_grad(inner, outer, w, lam, x0=starts.x0())
          starts.update(info)

Each method object validates its own settings when it is made (optimistix passes its
``adjoint=`` the same way); the two objects are frozen: change one with
:func:`dataclasses.replace`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from ._core import HypergradInfo, check_solver
from .errors import FrozenSettingError, HypergradTypeError, HypergradValueError
from .operators import check_engine
from .solvers import Solver
from .tree import PyTree, tree_all_finite, tree_flatten, tree_unflatten
from .unrolled import OptimizerArg, check_optimizer

#: The kinds of :class:`WarmStart`.
WARM_START_KINDS = ("previous", "extrapolate")


def warm_start_kind(value: object) -> str | None:
    """``value`` as a :data:`WARM_START_KINDS` entry (None: off).

    ``False`` is off, ``True`` is ``"previous"`` (the old ``HyperStep(warm_start=True)``);
    anything else raises.
    """
    if value is False:
        return None
    if value is True:
        return "previous"
    if isinstance(value, str) and value in WARM_START_KINDS:
        return value
    raise HypergradValueError(
        f"warm_start must be one of {(False, True, *WARM_START_KINDS)}, got {value!r}"
    )


class WarmStart:
    """The warm start of successive adjoint solves: from zero, then from the last good adjoint
    (``kind="previous"``), or from ``2 x_k - x_{k-1}``, the linear extrapolation of the last two
    (``kind="extrapolate"``; the last one alone until two are kept).

    Across outer steps the inner parameters and the hyperparameters move little, so the previous
    adjoint is close to the next one and the solver needs fewer iterations; the converged answer
    is the same (a solve is judged on its recomputed residual). The adjoint of a failed solve
    (:attr:`SolveInfo.failure <hypergrad.SolveInfo.failure>` set) or one with NaN/Inf entries is
    never kept: :meth:`update` forgets everything instead, so the next solve starts from zero.

    This is the rule :class:`~hypergrad.HyperStep` applies for ``hg.Implicit(warm_start=...)``;
    with :func:`~hypergrad.implicit_grad` a loop applies it itself.

    Args:
        kind: ``"previous"`` (default) or ``"extrapolate"``.

    Example:
        >>> import torch, hypergrad as hg
        >>> X = torch.randn(20, 3, dtype=torch.float64)
        >>> inner = lambda w, lam: 0.5 * ((X @ w - 1.0) ** 2).sum() + 0.5 * lam * (w ** 2).sum()
        >>> outer = lambda w, lam: (w ** 2).sum()
        >>> starts = hg.WarmStart("extrapolate")
        >>> for lam in (0.5, 0.51, 0.52):
        ...     lam = torch.tensor(lam, dtype=torch.float64)
        ...     A = X.T @ X + lam * torch.eye(3, dtype=torch.float64)
        ...     w = torch.linalg.solve(A, X.sum(0))
        ...     g, info = hg.implicit_grad(inner, outer, w, lam, solver=hg.CG(tol=1e-10),
        ...                                x0=starts.x0())
        ...     kept = starts.update(info)
        >>> kept, starts.kept
        (True, 2)
    """

    def __init__(self, kind: str = "previous") -> None:
        if kind not in WARM_START_KINDS:
            raise HypergradValueError(
                f"WarmStart kind must be one of {WARM_START_KINDS}, got {kind!r}"
            )
        self._kind = kind
        self.last: PyTree | None = None
        self.previous: PyTree | None = None

    @property
    def kind(self) -> str:
        """``"previous"`` or ``"extrapolate"``: a setting, fixed at construction (a new
        ``WarmStart`` takes another)."""
        return self._kind

    @kind.setter
    def kind(self, value: object) -> None:
        raise FrozenSettingError(
            f"WarmStart.kind is fixed at construction (it is {self._kind!r}): build a new "
            f"hg.WarmStart({value!r}) instead"
        )

    def __repr__(self) -> str:
        return f"WarmStart({self.kind!r}, kept={self.kept})"

    @property
    def kept(self) -> int:
        """How many adjoints are kept (0, 1 or 2)."""
        return (self.last is not None) + (self.previous is not None)

    def x0(self) -> PyTree | None:
        """The start of the next solve (None: from zero), shaped like the kept adjoints."""
        if self.last is None:
            return None
        if self.kind != "extrapolate" or self.previous is None:
            return self.last
        last, spec = tree_flatten(self.last, "adjoint")
        previous, _ = tree_flatten(self.previous, "adjoint")
        return tree_unflatten(spec, [2 * a - b for a, b in zip(last, previous)])

    def update(self, info: HypergradInfo | None) -> bool:
        """Keep ``info.adjoint`` when its solve succeeded; otherwise forget every kept adjoint.

        Args:
            info: the report of the solve just made (:func:`~hypergrad.implicit_grad`'s,
                ``fit.last_info`` of ``@hg.implicit``, ...), or None to forget (e.g. a solve the
                caller does not trust).

        Returns:
            Whether the adjoint was kept.

        Raises:
            HypergradTypeError: ``info`` is not a :class:`~hypergrad.HypergradInfo` (e.g. the
                adjoint itself, or ``info.solve``: the adjoint is ``info.adjoint``).
        """
        if info is None:
            self.reset()
            return False
        if not isinstance(info, HypergradInfo):
            raise HypergradTypeError(
                "WarmStart.update takes the HypergradInfo of the solve (e.g. implicit_grad's "
                f"info), or None to forget, got {type(info).__name__}; the adjoint it keeps is "
                "info.adjoint"
            )
        adjoint = info.adjoint
        good = (
            info.solve.failure is None
            and adjoint is not None
            and tree_all_finite(tuple(tree_flatten(adjoint, "adjoint")[0]))
        )
        if not good:
            self.reset()
            return False
        self.previous, self.last = self.last, adjoint
        return True

    def reset(self) -> None:
        """Forget the kept adjoints: the next solve starts from zero (e.g. when the model or the
        batch changes completely)."""
        self.last = self.previous = None


class _Method:
    """What both method objects share: the old string name (they compare equal to it, so code
    that tested ``step.method == "implicit"`` keeps working) and the ``distributed`` modes."""

    name: ClassVar[str]
    distributed_modes: ClassVar[tuple[str | None, ...]]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):
            return other == self.name
        if type(other) is not type(self):
            return NotImplemented
        return all(
            getattr(self, f.name) is getattr(other, f.name)
            or getattr(self, f.name) == getattr(other, f.name)
            for f in dataclasses.fields(self)  # type: ignore[arg-type]
        )

    def __hash__(self) -> int:
        return id(self)

    def check_distributed(self, distributed: str | None) -> None:
        """Raise when this method cannot run under ``distributed``."""


@dataclass(frozen=True, eq=False)
class Implicit(_Method):
    """The implicit method of :class:`~hypergrad.HyperStep`: the inner parameters at their
    current values are taken as an approximate inner solution and the adjoint system
    ``H x = dL_out/dpsi`` is solved.

    Args:
        solver: the linear solver (default ``hg.CG()``).
        engine: ``"reuse"`` (one gradient graph, fastest) or ``"recompute"`` (lowest memory).
        warm_start: ``False`` (default), ``"previous"`` (or ``True``) or ``"extrapolate"``: start
            each solve from the previous call's adjoint, by :class:`WarmStart`'s rule (the
            ``HyperStep`` keeps its own :class:`WarmStart`, ``step.warm``).

    Example:
        >>> import hypergrad as hg
        >>> hg.Implicit(solver=hg.CG(maxiter=20), warm_start="extrapolate").warm_start
        'extrapolate'
    """

    name: ClassVar[str] = "implicit"
    distributed_modes: ClassVar[tuple[str | None, ...]] = (None, "exact", "local")

    solver: Solver | None = None
    engine: str = "reuse"
    warm_start: bool | str = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "solver", check_solver(self.solver))
        check_engine(self.engine)
        if isinstance(self.warm_start, WarmStart):
            raise HypergradTypeError(
                f"Implicit(warm_start=...) takes the kind, e.g. warm_start={self.warm_start.kind!r}"
                " (each HyperStep keeps its own WarmStart), not a WarmStart object"
            )
        warm_start_kind(self.warm_start)

    @property
    def warm_start_kind(self) -> str | None:
        """``warm_start`` as a :data:`WARM_START_KINDS` entry (None: off)."""
        return warm_start_kind(self.warm_start)


@dataclass(frozen=True, eq=False)
class Unrolled(_Method):
    """The unrolled method of :class:`~hypergrad.HyperStep`: reverse mode through ``steps``
    look-ahead updates ``psi_{t+1} = psi_t + optimizer.update(grad inner_loss)`` from the current
    parameters (one step: the look-ahead of Meta-Weight-Net and second-order DARTS), then through
    ``outer_loss`` at ``psi_steps``; the model's own parameters are not changed.

    Args:
        optimizer: a functional optimizer (``hg.optim.sgd(lr=0.1)``, torchopt's), or a function
            of the hyper tensors (a tuple, in ``hyper``'s parameter order) returning one, to learn
            its settings.
        steps: look-ahead updates (default 1).
        truncate: differentiate through the last ``truncate`` steps only (None: all of them).

    Under ``distributed=...`` only ``"local"`` (the average of the per-process hypergradients) is
    supported.

    Example:
        >>> import hypergrad as hg
        >>> hg.Unrolled(hg.optim.sgd(lr=0.1), steps=3).truncate
        3
    """

    name: ClassVar[str] = "unrolled"
    distributed_modes: ClassVar[tuple[str | None, ...]] = (None, "local")

    optimizer: OptimizerArg = None
    steps: int = 1
    truncate: int | None = None  # None: resolved to steps when made

    def __post_init__(self) -> None:
        if self.optimizer is None:
            raise HypergradValueError(
                "Unrolled needs optimizer=..., e.g. hg.optim.sgd(lr=0.1) (the look-ahead update; "
                "use the model's own learning rate for a Meta-Weight-Net step)"
            )
        check_optimizer(self.optimizer)
        steps = self.steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise HypergradValueError(f"steps must be a positive int, got {steps!r}")
        truncate = steps if self.truncate is None else self.truncate
        if (
            isinstance(truncate, bool)
            or not isinstance(truncate, int)
            or not 1 <= truncate <= steps
        ):
            raise HypergradValueError(
                f"truncate must be an int in [1, steps={steps}], got {self.truncate!r}"
            )
        object.__setattr__(self, "truncate", truncate)

    def check_distributed(self, distributed: str | None) -> None:
        if distributed == "exact":
            raise HypergradValueError(
                "the unrolled method supports distributed=None or 'local'; 'exact' all-reduces "
                "the implicit method's products (wrap the inner model in DDP to reduce look-ahead "
                "gradients instead)"
            )


Method = Implicit | Unrolled

#: HyperStep keywords that moved into a method object (kept one release, with a warning).
IMPLICIT_KEYWORDS = ("engine", "warm_start")
UNROLLED_KEYWORDS = ("steps", "optimizer", "truncate")


def method_from_keywords(
    method: Any, solver: Any, old: dict[str, Any]
) -> tuple[Implicit | Unrolled, list[str]]:
    """The method object of a ``HyperStep(...)`` call, and the deprecated keywords it used.

    ``method`` is an :class:`Implicit`/:class:`Unrolled` object, None (implicit), or the old
    string; ``solver`` the shorthand for ``method=hg.Implicit(solver=...)`` (not deprecated);
    ``old`` the deprecated keywords given (``engine``, ``warm_start``, ``steps``, ``optimizer``,
    ``truncate``).
    """
    unknown = sorted(set(old) - set(IMPLICIT_KEYWORDS + UNROLLED_KEYWORDS))
    if unknown:
        raise TypeError(f"HyperStep() got an unexpected keyword argument {unknown[0]!r}")
    deprecated = [f"{k}=" for k in old]
    if isinstance(method, (Implicit, Unrolled)):
        if old:
            raise HypergradValueError(
                f"{', '.join(old)} given both as HyperStep keywords and in method="
                f"{type(method).__name__}(...): set them in the method object only"
            )
        if solver is not None:
            raise HypergradValueError(
                "solver= given with method=hg.Implicit(...): pass it once, as "
                "hg.Implicit(solver=...)"
                if isinstance(method, Implicit)
                else "the unrolled method takes no solver (it solves no system)"
            )
        return method, deprecated
    if method is None:
        name = "implicit"
    elif isinstance(method, str) and method in ("implicit", "unrolled"):
        name = method
        deprecated.insert(0, f"method={method!r}")
    else:
        raise HypergradValueError(
            "method must be one of hg.Implicit(...), hg.Unrolled(...) (or the deprecated strings "
            f"'implicit' and 'unrolled'), got {method!r}"
        )
    if name == "implicit":
        given = [k for k in UNROLLED_KEYWORDS if old.get(k) is not None]
        if given:
            raise HypergradValueError(
                f"{', '.join(given)} belong to method='unrolled': pass "
                "method=hg.Unrolled(optimizer=..., steps=..., truncate=...)"
            )
        kwargs = {k: v for k, v in old.items() if k in IMPLICIT_KEYWORDS}
        return Implicit(solver=solver, **kwargs), deprecated
    if solver is not None:
        raise HypergradValueError("the unrolled method takes no solver (it solves no system)")
    if old.get("warm_start"):
        raise HypergradValueError("warm_start applies to the implicit method (it has a solve)")
    kwargs = {k: v for k, v in old.items() if k in UNROLLED_KEYWORDS and v is not None}
    return Unrolled(**kwargs), deprecated
