"""Inner solvers: fixed-point iteration (Picard, Anderson), proximal gradient (ISTA/FISTA),
Newton and L-BFGS, on pytrees, with honest diagnostics.

One class per solver, one file each, as the linear solvers of :mod:`hypergrad.solvers`:
:class:`FixedPoint` (``fixed_points.py``), :class:`ProximalGradient`
(``proximal_gradient.py``), :class:`Newton` (``damped_newton.py``) and :class:`LBFGS`
(``quasi_newton.py``), over the :class:`~hypergrad.inner.base.InnerSolver` base
(``base.py``). The user's functions and the settings are the class's fields, validated once
and frozen (``solver.replace(tol=...)`` builds a validated copy). ``solver.solve(x0,
hparams)`` is the plain iteration: it runs without autograd (``hparams`` reach the user's
functions detached) and returns ``(x, InnerInfo)``, where :class:`InnerInfo` reports the
iterations, a relative optimality residual **measured at the returned point**, ``converged``
(the residual meets ``tol`` there, with the checks each solver adds) and ``reason``, why the
solve stopped (``"converged"``, ``"maxiter"``, ``"stalled"``, ``"diverged"``,
``"line_search"``, ``"saddle"``); any stop but convergence is warned about.
``solver.run(x0, hparams)`` returns the solution **differentiable in hparams** by implicit
differentiation (:func:`~hypergrad.custom_fixed_point` / :func:`~hypergrad.custom_root`),
with the inner report in ``solver.last_info``. The class is the one form of each solver (there
is no separate function): ``hg.inner.FixedPoint(T, tol=1e-10).solve(x0, hparams)``.

The user guide is ``docs/inner.md``.
"""

from ._common import InnerInfo
from .damped_newton import Newton
from .fixed_points import FixedPoint
from .proximal_gradient import ProximalGradient
from .quasi_newton import LBFGS

__all__ = [
    "FixedPoint",
    "InnerInfo",
    "LBFGS",
    "Newton",
    "ProximalGradient",
]
