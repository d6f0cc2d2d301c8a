"""Errors and warnings raised by hypergrad.

Every bad input raises :class:`HypergradError` (or one of its subclasses, which are also
``TypeError``/``ValueError`` so generic handlers keep working) with a message that names the
argument and says what was expected.
"""

from __future__ import annotations

import dataclasses


class HypergradError(Exception):
    """Base class of every error hypergrad raises on purpose."""


class HypergradTypeError(HypergradError, TypeError):
    """An argument has the wrong type, dtype or structure."""


class HypergradValueError(HypergradError, ValueError):
    """An argument has the right type but a wrong value (shape, NaN/Inf, range)."""


class FrozenSettingError(HypergradError, dataclasses.FrozenInstanceError):
    """A solver's (or preconditioner's) setting was assigned after construction.

    Settings are validated once, when the object is built, and read by every solve (eager and
    compiled), so they cannot change afterwards: build a new object instead, e.g.
    ``solver.replace(tol=1e-8)``. Also an ``AttributeError`` (as ``dataclasses``' own
    ``FrozenInstanceError``).
    """


class HypergradWarning(UserWarning):
    """Something is numerically suspicious (e.g. a solver diverged or did not converge)."""


class SolverDivergedWarning(HypergradWarning):
    """A linear solver diverged; its result should not be trusted."""


class SingularSystemWarning(HypergradWarning):
    """The linear system is singular and ``b`` is not in the operator's range (or the operator
    is zero): no ``x`` reaches the tolerance. The solve stopped at a least-squares solution and
    reports the least-squares residual; the hypergradient is only defined up to the null space.
    """


class SolverStalledWarning(HypergradWarning):
    """An iteration stopped making progress (e.g. Neumann terms that no longer shrink, so the
    series grows without converging); its result is not a hypergradient.
    """


class NonStationaryWarning(HypergradWarning):
    """The point handed to an implicit entry point is far from satisfying its optimality
    condition: ``info.stationarity`` (see :mod:`hypergrad.conditions`) is above the threshold
    :data:`hypergrad.conditions.STATIONARITY_THRESHOLD`, so the implicit derivative computed
    there is not the derivative of the solution map. Solve the inner problem more tightly.
    """


class SolveFailedWarning(HypergradWarning):
    """A solve returned an ``x`` that is not a hypergradient for a reason without a more specific
    warning: its relative residual is above 1 (a worse answer than ``x = 0``) or not finite
    (``SolveInfo.failure`` says which).
    """
