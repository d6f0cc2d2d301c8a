"""Inner solvers: fixed-point iteration (Picard, Anderson), proximal gradient (ISTA/FISTA),
Newton and L-BFGS, on pytrees, with honest diagnostics.

The functions :func:`fixed_point`, :func:`fista`, :func:`newton` and :func:`lbfgs` are the plain
iterations: they run without autograd (``hparams`` reach the user's functions detached) and
return ``(x, InnerInfo)``, where :class:`InnerInfo` reports the iterations, a relative
optimality residual **measured at the returned point**, ``converged`` (the residual meets
``tol`` there, with the checks each solver adds) and ``reason``, why the solve stopped
(``"converged"``, ``"maxiter"``, ``"stalled"``, ``"diverged"``, ``"line_search"``,
``"saddle"``); any stop but convergence is warned about.

The classes :class:`FixedPoint`, :class:`ProximalGradient`, :class:`Newton` and :class:`LBFGS`
wrap them: ``solver.run(x0, hparams)`` returns the solution **differentiable in hparams** by
implicit differentiation (:func:`~hypergrad.custom_fixed_point` /
:func:`~hypergrad.custom_root`), with the inner report in ``solver.last_info``.

The user guide is ``docs/inner.md``.
"""

from ._common import InnerInfo
from .differentiable import LBFGS, FixedPoint, Newton, ProximalGradient
from .fixed_points import fixed_point
from .proximal_gradient import fista
from .smooth import lbfgs, newton

__all__ = [
    "FixedPoint",
    "InnerInfo",
    "LBFGS",
    "Newton",
    "ProximalGradient",
    "fista",
    "fixed_point",
    "lbfgs",
    "newton",
]
