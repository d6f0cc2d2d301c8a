"""What every inner solver shares: the :class:`InnerSolver` base (the user's functions and the
settings as validated, frozen dataclass fields, with the field helpers of
:mod:`hypergrad.solvers.base`) and the checks the inner settings add to them."""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..errors import FrozenSettingError, HypergradTypeError, HypergradValueError
from ..settings import FrozenSettings, check_number, setting
from ..tree import PyTree
from ._common import InnerInfo


def check_callable(name: str, value: Any) -> Any:
    """A callable, as is (``HypergradTypeError`` otherwise)."""
    if not callable(value):
        raise HypergradTypeError(f"{name} must be a callable, got {type(value).__name__}")
    return value


def function() -> Any:
    """A user's function (the map, loss or prox): a positional field, checked callable."""
    return field(metadata={"check": check_callable, "function": True})


def check_real(
    name: str, value: Any, minimum: float, strict: bool, high: float, allow_none: bool
) -> float | None:
    """:func:`~hypergrad.solvers.base.check_number`, with a non-number refused by
    ``HypergradTypeError`` and an upper bound ``high`` (inclusive)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise HypergradTypeError(f"{name} must be a real number, got {value!r}")
    out = check_number(name, value, minimum=minimum, strict=strict)
    if out > high:
        raise HypergradValueError(f"{name} must be in ({minimum:g}, {high:g}], got {value!r}")
    return out


def real(
    default: float | None,
    *,
    minimum: float = 0.0,
    strict: bool = False,
    high: float = math.inf,
    allow_none: bool = False,
) -> Any:
    """A finite real setting, ``>= minimum`` (``> minimum`` when ``strict``), ``<= high``."""
    check = functools.partial(
        check_real, minimum=minimum, strict=strict, high=high, allow_none=allow_none
    )
    return setting(default, check)


def instance(default: Any, cls: type, what: str, *, run_only: bool = False) -> Any:
    """A setting that is None or an instance of ``cls`` (``HypergradTypeError`` naming
    ``what`` otherwise); ``run_only``: read by :meth:`InnerSolver.run` only, not by the
    iteration of :meth:`InnerSolver.solve`."""

    def check(name: str, value: Any) -> Any:
        if value is not None and not isinstance(value, cls):
            raise HypergradTypeError(f"{name} must be {what}, got {type(value).__name__}")
        return value

    return field(default=default, metadata={"check": check, "run_only": run_only})


def run_setting(default: Any, check: Callable[[str, Any], Any] | None = None) -> Any:
    """A setting read by :meth:`InnerSolver.run` only (the implicit derivative's linear
    solver), not by the iteration of :meth:`InnerSolver.solve`."""
    return field(default=default, metadata={"check": check, "run_only": True})


@dataclass(eq=False)
class InnerSolver(FrozenSettings):
    """Base class of the inner solvers: the class *is* the algorithm.

    A subclass is a dataclass whose fields are the user's functions (positional, declared with
    :func:`function`) and the settings (keyword-only, declared with the field helpers), validated
    once when it is built and then frozen (assigning one raises
    :class:`~hypergrad.FrozenSettingError`; :meth:`replace` builds a validated copy).
    :meth:`solve` holds the iteration (no autograd) and returns ``(x, InnerInfo)``;
    :meth:`run` returns ``x`` differentiable in ``hparams`` through the implicit decorator of
    :meth:`_differentiable`, and records the report in ``last_info``.
    """

    #: how messages name the solver (``hg.inner.<display>``)
    display: ClassVar[str] = "InnerSolver"

    last_info: InnerInfo | None = field(default=None, init=False, repr=False)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "display" not in cls.__dict__:
            cls.display = cls.__name__

    def __post_init__(self) -> None:
        self._decorated: Any = None
        super().__post_init__()

    def _frozen_error(self, name: str) -> FrozenSettingError:
        cls = type(self).__name__
        return FrozenSettingError(
            f"{cls}.{name} is a setting, fixed at construction (validated then): build a new "
            f"hg.inner.{cls}(...) instead, e.g. solver.replace({name}=...)"
        )

    def solve(self, x0: PyTree, hparams: PyTree) -> tuple[PyTree, InnerInfo]:
        """The solution from ``x0`` without autograd, and its :class:`InnerInfo`."""
        raise NotImplementedError

    def _differentiable(self) -> Callable[[PyTree, PyTree], PyTree]:
        """``(hparams, x0) -> x`` through the implicit decorator (kept in ``_decorated``)."""
        raise NotImplementedError

    def _recorded(self, hparams: PyTree, x0: PyTree) -> PyTree:
        """:meth:`solve` with its report kept in ``last_info`` (what the decorator runs)."""
        x, info = self.solve(x0, hparams)
        self.last_info = info
        return x

    def run(self, x0: PyTree, hparams: PyTree) -> PyTree:
        """The solution from ``x0``, differentiable in ``hparams`` (a pytree of tensors)."""
        return self._differentiable()(hparams, x0)

    @property
    def last_implicit_info(self) -> Any:
        """The :class:`~hypergrad.HypergradInfo` of the most recent derivative through this
        solver's last ``run`` (None before one): the linear solve and ``stationarity``."""
        return None if self._decorated is None else self._decorated.last_info
