"""Stochastic single-loop, two-loop and first-order bilevel solvers (``hg.stochastic``).

For ``min_x h(x) = F(z*(x), x)``, ``z*(x) = argmin_z G(z, x)``, given minibatch losses
``inner_loss(z, x, batch)`` and ``outer_loss(z, x, batch)`` over pytrees and samplers of their
batches (:class:`Bilevel`), these solvers move ``z``, the adjoint ``v`` and ``x`` on minibatches,
a few oracle calls per iteration, instead of solving the inner problem and then the adjoint
system (``hg.implicit_grad``). Single loop: :class:`SOBA`, :class:`SABA`, :class:`SRBA`; two
loops, warm started: :class:`StocBiO`, :class:`AmIGO`; first order (no Hessian products):
:class:`F2SA`, :class:`BOME`. Each is a frozen settings dataclass with ``init`` and ``step``;
:func:`run` loops with an iteration budget, held-out diagnostics, divergence and stall checks
and an optional tolerance (``StochasticReport.reason``).
``docs/stochastic.md`` compares their costs and assumptions.

Example:
    >>> import torch, hypergrad as hg
    >>> a = torch.linspace(1.0, 2.0, 8, dtype=torch.float64)
    >>> inner = lambda z, x, i: (0.5 * a[i] * z**2 - z * x).mean()
    >>> outer = lambda z, x, i: 0.5 * (z - 1.0) ** 2 + 0.0 * x
    >>> full = hg.stochastic.IndexSampler(8)
    >>> problem = hg.stochastic.Bilevel(inner, outer, full, full)
    >>> x, report = hg.stochastic.run(hg.stochastic.SOBA(step_inner=0.5, step_outer=0.5),
    ...                               problem, torch.zeros(()), torch.zeros(()), iterations=400)
    >>> round(float(x), 6), report.diverged  # z*(x) = x / mean(a) = 1 at x = 1.5
    (1.5, False)
"""

from .base import Diagnostics, StochasticReport, StochasticSolver, StochasticState, run
from .first_order import BOME, F2SA
from .oracles import Bilevel, IndexSampler, Linearization, gradients
from .single_loop import SABA, SOBA
from .srba import SRBA
from .two_loop import AmIGO, StocBiO

__all__ = [
    "AmIGO",
    "BOME",
    "Bilevel",
    "Diagnostics",
    "F2SA",
    "IndexSampler",
    "Linearization",
    "SABA",
    "SOBA",
    "SRBA",
    "StocBiO",
    "StochasticReport",
    "StochasticSolver",
    "StochasticState",
    "gradients",
    "run",
]
