"""Errors and warnings raised by hypergrad.

Every bad input raises :class:`HypergradError` (or one of its subclasses, which are also
``TypeError``/``ValueError`` so generic handlers keep working) with a message that names the
argument and says what was expected. Every warning is raised through :func:`warn`, which points
it at the user's line (the call into hypergrad), not at a line inside the library.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import types
import warnings


class HypergradError(Exception):
    """Base class of every error hypergrad raises on purpose."""


class HypergradTypeError(HypergradError, TypeError):
    """An argument has the wrong type, dtype or structure."""


class HypergradValueError(HypergradError, ValueError):
    """An argument has the right type but a wrong value (shape, NaN/Inf, range)."""


class FrozenSettingError(HypergradError, dataclasses.FrozenInstanceError):
    """A setting of a solver, preconditioner, compiled step, compiled optimizer or warm start
    was assigned after construction.

    Settings are validated once, when the object is built, and read by every solve (eager and
    compiled), so they cannot change afterwards: build a new object instead, e.g.
    ``solver.replace(tol=1e-8)``. Also an ``AttributeError`` (as ``dataclasses``' own
    ``FrozenInstanceError``).
    """


class HypergradWarning(UserWarning):
    """Something is numerically suspicious (e.g. a solver diverged or did not converge)."""


class SolverDivergedWarning(HypergradWarning):
    """A solver diverged (a linear solver's residual grew or went non-finite; an inner solver's
    iterates ran away, or Newton stopped at a saddle it could not leave); its result should not
    be trusted."""


class SingularSystemWarning(HypergradWarning):
    """The linear system is singular and ``b`` is not in the operator's range (or the operator
    is zero): no ``x`` reaches the tolerance. The solve stopped at a least-squares solution and
    reports the least-squares residual; the hypergradient is only defined up to the null space.
    """


class SolverStalledWarning(HypergradWarning):
    """An iteration stopped making progress (e.g. Neumann terms that no longer shrink, so the
    series grows without converging), or an inner solver stopped short of its tolerance
    (``InnerInfo.reason``: ``"maxiter"``, ``"stalled"`` or ``"line_search"``); its result is not
    the solution asked for.
    """


class NonStationaryWarning(HypergradWarning):
    """The point handed to an implicit entry point is far from satisfying its optimality
    condition: ``info.stationarity`` (see :mod:`hypergrad.conditions`) is above the threshold
    :data:`hypergrad.conditions.STATIONARITY_THRESHOLD`, so the implicit derivative computed
    there is not the derivative of the solution map. Solve the inner problem more tightly.
    """


class NonDifferentiableWarning(HypergradWarning):
    """The solution sits at a kink of a proximal or projection operator (a lasso coordinate at
    its threshold, a box coordinate at a bound, ...): the solution map is not differentiable
    there, and the implicit derivative returned is autograd's choice at the kink (one of the
    one-sided limits, or at an exact tie an average of them; another library may choose
    otherwise). ``info.extras["kinks"]`` counts the coordinates.
    """


class SolveFailedWarning(HypergradWarning):
    """A solve returned an ``x`` that is not a hypergradient for a reason without a more specific
    warning: its relative residual is above 1 (a worse answer than ``x = 0``) or not finite
    (``SolveInfo.failure`` says which).
    """


# -- where a warning points ------------------------------------------------------------------

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
# contextlib (a ``@contextmanager`` body) and functools (``wraps``, ``partial``, ``singledispatch``)
# stand between a caller and the library without being either
_STDLIB_FILES = frozenset(
    os.path.join(os.path.dirname(os.path.abspath(contextlib.__file__)), name)
    for name in ("contextlib.py", "functools.py")
)


def _torch_dir() -> str | None:
    torch = sys.modules.get("torch")
    file = getattr(torch, "__file__", None)
    return os.path.dirname(os.path.abspath(file)) + os.sep if file else None


def _is_library_frame(frame: types.FrameType, torch_dir: str | None) -> bool:
    """A frame of hypergrad, of torch (autograd runs a backward under torch's frames) or of the
    stdlib's contextlib/functools: not where a user called the library."""
    filename = frame.f_code.co_filename
    if filename.startswith(_PACKAGE_DIR) or filename in _STDLIB_FILES:
        return True
    if torch_dir is not None and filename.startswith(torch_dir):
        return True
    if filename == "<string>":  # code generated in a module's namespace (a dataclass __init__)
        module = frame.f_globals.get("__name__")
        return isinstance(module, str) and module.partition(".")[0] == "hypergrad"
    return False


def _skipped_by_warnings(filename: str) -> bool:
    # the frames warnings.warn itself passes over when it counts stacklevel (import machinery)
    return "importlib" in filename and "_bootstrap" in filename


def caller_stacklevel() -> int:
    """The ``stacklevel`` that makes a ``warnings.warn`` in the function calling this one point at
    the first frame outside hypergrad, torch and the stdlib's contextlib/functools: the user's
    line (2, the function's own caller, when the stack has no such frame)."""
    torch_dir = _torch_dir()
    # frame 1 is the function that will call warnings.warn: stacklevel 1
    frame: types.FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None:
        if not _skipped_by_warnings(frame.f_code.co_filename):
            if not _is_library_frame(frame, torch_dir):
                return level
            level += 1
        frame = frame.f_back
    return 2


def warn(message: str, category: type[Warning], stacklevel: int | None = None) -> None:
    """``warnings.warn(message, category)`` pointed at the user's line.

    Every warning hypergrad raises goes through here. With ``stacklevel=None`` (the default) the
    warning is attributed to the first frame, walking outward from the caller, whose file is not
    in hypergrad's package, in torch's (a warning raised in a backward pass points at the
    ``.backward()`` line) or the stdlib's ``contextlib.py``/``functools.py``: the line where the
    user called the library. Python's default filter then shows it once per such line, however
    many library lines lie in between. An int is used as given, counted as by ``warnings.warn``
    from the function calling this one (1: that function's own line, 2: its caller).
    """
    # caller_stacklevel counts from this frame (1), as warnings.warn below does
    level = caller_stacklevel() if stacklevel is None else stacklevel + 1
    warnings.warn(message, category, stacklevel=level)
