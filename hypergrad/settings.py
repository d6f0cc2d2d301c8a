"""Settings declared once: the :class:`FrozenSettings` mixin (a dataclass's ``__init__`` fields
validated when it is built, then read-only; ``replace()`` builds a validated copy) and the field
helpers that declare each setting with its check (:func:`setting`, :func:`number`,
:func:`count`, :func:`integer`, :func:`flag`, :func:`choice`) and the checks themselves
(:func:`check_number`, :func:`check_iters`, :func:`check_int`, :func:`check_bool`,
:func:`check_choice`). The linear solvers, the inner solvers, the stochastic solvers, the
compiled step, the method objects (``hg.Implicit``, ``hg.Unrolled``) and the options of
:mod:`hypergrad.testing`'s checks declare their settings with them; :mod:`hypergrad.optim`'s
differentiable optimizers, whose settings may be tensors that change in place, share the scalar
check (:func:`check_number`) only (its docstring says why)."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Callable
from dataclasses import field
from typing import Any, Literal, TypeVar, overload

from .errors import FrozenSettingError, HypergradTypeError, HypergradValueError

_S = TypeVar("_S", bound="FrozenSettings")


class FrozenSettings:
    """Mixin making a dataclass's settings read-only once :meth:`_freeze` has run.

    The settings (the dataclass's ``__init__`` fields) are validated once, in ``__post_init__``
    (each field declared with :func:`setting` by its own check, then :meth:`check`), which ends
    with ``self._freeze()``; afterwards assigning or deleting a setting, or adding a
    new public attribute, raises :class:`~hypergrad.errors.FrozenSettingError` (an
    ``AttributeError``): a setting changed later would not be validated (``tol = inf`` would
    report ``converged`` with the indirect term missing) and a compiled graph could keep a stale
    copy of it. Build a new object instead: :meth:`replace` returns a copy with some settings
    changed, validated like a new one. Attributes starting with ``_`` and non-``__init__``
    fields (state such as ``DensePreconditioner.builds``) stay writable.
    """

    _frozen: bool = False
    #: how the :class:`~hypergrad.errors.FrozenSettingError` message names an instance
    #: (``solver.replace(tol=...)``)
    _instance_name: str = "solver"
    #: what reads the settings, for that message
    _read_by: str = "every solve (eager or compiled)"

    def __post_init__(self) -> None:
        """Validate every setting declared by :func:`setting` (and :func:`number`,
        :func:`count`, :func:`integer`, :func:`flag`), then :meth:`check`, then freeze."""
        owner = getattr(self, "display", type(self).__name__)
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            check = f.metadata.get("check")
            if check is not None:
                object.__setattr__(self, f.name, check(f"{owner} {f.name}", getattr(self, f.name)))
        self.check()
        self._freeze()

    def check(self) -> None:
        """Checks that involve several settings, run after each setting's own (none here)."""

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
            f"the {cls} is built and read by {self._read_by}. Build a new one, "
            f"e.g. {self._instance_name}.replace({name}=...) (dataclasses.replace)"
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


def setting(default: Any, check: Callable[[str, Any], Any] | None = None) -> Any:
    """A setting of a :class:`FrozenSettings` dataclass: a field with ``default`` whose value is
    replaced by ``check(label, value)`` when the object is built (``label``: e.g. ``"CG tol"``
    for the messages; ``check`` raises on a bad value and returns the normalised one)."""
    return field(default=default, metadata={"check": check})


def number(
    default: float | None, *, minimum: float = 0.0, strict: bool = False, allow_none: bool = False
) -> Any:
    """A real setting checked by :func:`check_number` (finite, ``>= minimum`` or ``> minimum``)."""
    check = functools.partial(check_number, minimum=minimum, strict=strict, allow_none=allow_none)
    return setting(default, check)


def count(default: int | None, *, minimum: int = 0, allow_none: bool = True, why: str = "") -> Any:
    """An iteration count or size checked by :func:`check_iters` (an int ``>= minimum``)."""
    return setting(
        default, functools.partial(check_iters, minimum=minimum, allow_none=allow_none, why=why)
    )


def integer(default: int) -> Any:
    """An int setting of any sign (a seed)."""
    return setting(default, check_int)


def flag(default: bool) -> Any:
    """A bool setting."""
    return setting(default, check_bool)


def choice(default: str, options: tuple[str, ...]) -> Any:
    """A setting that is one of the strings ``options`` (checked by :func:`check_choice`)."""
    return setting(default, functools.partial(check_choice, options=options))


def check_choice(name: str, value: Any, options: tuple[str, ...]) -> str:
    """One of the strings ``options``, as is.

    Raises:
        HypergradValueError: anything else, naming ``name`` and the options.
    """
    if not isinstance(value, str) or value not in options:
        raise HypergradValueError(f"{name} must be one of {options}, got {value!r}")
    return value


def check_int(name: str, value: Any) -> int:
    """An int (Python or NumPy, not a bool) as a Python int.

    Raises:
        HypergradTypeError: anything else.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise HypergradTypeError(f"{name} must be an int, got {value!r}")
    return int(value)


def check_bool(name: str, value: Any) -> bool:
    """A bool, as is.

    Raises:
        HypergradValueError: anything else.
    """
    if not isinstance(value, bool):
        raise HypergradValueError(f"{name} must be a bool, got {value!r}")
    return value


@overload
def check_number(
    name: str,
    value: Any,
    minimum: float = ...,
    strict: bool = ...,
    allow_none: Literal[False] = ...,
    *,
    maximum: float = ...,
    closed: bool = ...,
) -> float: ...
@overload
def check_number(
    name: str,
    value: Any,
    minimum: float = ...,
    strict: bool = ...,
    allow_none: bool = ...,
    *,
    maximum: float = ...,
    closed: bool = ...,
) -> float | None: ...
def check_number(
    name: str,
    value: Any,
    minimum: float = 0.0,
    strict: bool = False,
    allow_none: bool = False,
    *,
    maximum: float = math.inf,
    closed: bool = True,
) -> float | None:
    """Validate a real setting of a solver and return it as a Python float.

    Python and NumPy reals are accepted; bools, non-numbers, NaN and infinities are refused (an
    infinite tolerance or step cannot give a hypergradient), and so are values below ``minimum``
    (``minimum`` itself too when ``strict``) or above ``maximum`` (``maximum`` itself too unless
    ``closed``).

    Args:
        name: argument name for the message, e.g. ``"CG tol"``.
        value: the value to check.
        minimum: smallest accepted value.
        strict: refuse ``minimum`` itself (``value > minimum``).
        allow_none: accept None (returned as is).
        maximum: largest accepted value (none by default).
        closed: accept ``maximum`` itself.

    Raises:
        HypergradValueError: naming ``name`` and the valid range.
    """
    if value is None and allow_none:
        return None
    if math.isfinite(maximum):
        kind = f"in {'(' if strict else '['}{minimum:g}, {maximum:g}{']' if closed else ')'}"
    else:
        kind = f"> {minimum:g}" if strict else f">= {minimum:g}"
    tail = " (or None)" if allow_none else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise HypergradValueError(f"{name} must be a number {kind} and finite{tail}, got {value!r}")
    out = float(value)
    if (
        not math.isfinite(out)
        or out < minimum
        or (strict and out == minimum)
        or out > maximum
        or (not closed and out == maximum)
    ):
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
        kind = {0: "a non-negative int", 1: "a positive int (>= 1)"}.get(
            minimum, f"an int >= {minimum}"
        )
        tail = " or None" if allow_none else ""
        raise HypergradValueError(f"{name} must be {kind}{tail}{why}, got {value!r}")
    return int(value)
