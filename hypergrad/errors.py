"""Errors and warnings raised by hypergrad.

Every bad input raises :class:`HypergradError` (or one of its subclasses, which are also
``TypeError``/``ValueError`` so generic handlers keep working) with a message that names the
argument and says what was expected.
"""

from __future__ import annotations


class HypergradError(Exception):
    """Base class of every error hypergrad raises on purpose."""


class HypergradTypeError(HypergradError, TypeError):
    """An argument has the wrong type, dtype or structure."""


class HypergradValueError(HypergradError, ValueError):
    """An argument has the right type but a wrong value (shape, NaN/Inf, range)."""


class HypergradWarning(UserWarning):
    """Something is numerically suspicious (e.g. a solver diverged or did not converge)."""


class SolverDivergedWarning(HypergradWarning):
    """A linear solver diverged; its result should not be trusted."""
