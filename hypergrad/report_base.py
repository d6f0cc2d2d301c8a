"""The fields every iterative solve reports: :class:`IterationReport`, the base of the linear
solvers' :class:`~hypergrad.SolveInfo` and the inner solvers'
:class:`~hypergrad.inner.InnerInfo`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class IterationReport:
    """What one iterative solve did, as measured.

    Attributes:
        solver: the solver's name (``"cg"``, ``"fista"``, ...).
        iterations: iterations performed.
        residual: the relative residual the solver reports (each report says of what).
        converged: the reported residual met the tolerance (each report says where it was
            measured).
        diverged: the iteration blew up; the result must not be trusted.
        residuals: the residual after each iteration it was measured at (for plots).
        extras: solver-specific details.
    """

    solver: str
    iterations: int = 0
    residual: float = float("nan")
    converged: bool = False
    diverged: bool = False
    residuals: list[float] = field(default_factory=list)
    extras: dict[str, Any] = field(default_factory=dict)
