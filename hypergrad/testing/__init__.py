"""Gradient checks for hypergradients, as :func:`torch.autograd.gradcheck` is for autograd.

:func:`check_hypergrad` compares a hypergradient ``dL_out/dtheta`` with central finite
differences of the *re-solved* bilevel problem. Along each direction ``d`` it solves the inner
problem again at ``theta + eps d`` and ``theta - eps d`` and forms

    fd = (L_out(psi*(theta + eps d), theta + eps d) - L_out(psi*(theta - eps d), theta - eps d))
         / (2 eps),

the derivative of the *total* outer loss (its direct dependence on ``theta`` included), and
compares it with ``<grad, d>``. A direction passes when
``|fd - <grad, d>| <= atol + rtol * max(|fd|, |<grad, d>|)``.

A direction in which both ``|fd|`` and ``|<grad, d>|`` are at most ``atol`` cannot tell a right
hypergradient from a wrong one (zero would pass too). When that is so in *every* direction the
check is **inconclusive**: ``report.passed`` is False, ``report.inconclusive`` True and the verdict
says ``INCONCLUSIVE`` with the numbers; lower ``atol`` or rescale the problem. Directions must be
non-zero, finite and large enough that ``theta +- eps d`` differ from ``theta`` by more than
rounding, else :class:`~hypergrad.HypergradValueError`.

Finite differences of a re-solved problem are only as good as the inner solves, so every solve
is checked too: at each point the gradient ``g = dL_in/dpsi`` of the inner loss is computed and,
with ``x = H^{-1} dL_out/dpsi`` the adjoint of the implicit hypergradient, ``|<x, g>|`` estimates
(to first order) how far the outer loss at the returned parameters is from its value at the exact
inner solution. When the inner solves move the finite differences by more than half the
comparison tolerance the report says the *inner solve* failed (``inner_ok=False``), not the
hypergradient. See ``docs/testing.md``.

:func:`check_unrolled` checks an *unrolled* hypergradient (:func:`~hypergrad.unrolled_grad`, or
backpropagation through T optimizer steps): the finite differences re-run the same procedure, and
no stationarity check applies, since its result is T steps, not a minimiser.
:func:`check_hyperstep` is the check for :class:`~hypergrad.HyperStep` users (modules instead of
pytrees); the ``assert_*`` forms raise an ``AssertionError`` carrying the report's table when a
check fails.
"""

from __future__ import annotations

from ._hyperstep import assert_hyperstep_close, check_hyperstep
from ._pytree import assert_hypergrad_close, assert_unrolled_close, check_hypergrad, check_unrolled
from ._report import HypergradCheckReport, HypergradCheckRow
from ._settings import ALL_COORDINATES_UP_TO as ALL_COORDINATES_UP_TO
from ._settings import DEFAULT_RANDOM_DIRECTIONS as DEFAULT_RANDOM_DIRECTIONS
from ._settings import INNER_BUDGET as INNER_BUDGET

__all__ = [
    "HypergradCheckReport",
    "HypergradCheckRow",
    "assert_hypergrad_close",
    "assert_hyperstep_close",
    "assert_unrolled_close",
    "check_hypergrad",
    "check_hyperstep",
    "check_unrolled",
]
