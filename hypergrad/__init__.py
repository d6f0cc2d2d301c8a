"""hypergrad: hypergradients for bilevel optimization in PyTorch.

Implicit differentiation (CG, MINRES, Neumann, dense exact, Nystrom), unrolled differentiation
through torchopt optimizers, a module-level ``HyperStep`` for deep networks, and Gumbel-softmax
label hyper-networks. The user guide is ``docs/guide.md`` (solvers: ``docs/solvers.md``; deep
networks: ``docs/modules.md``).
The submodule ``hypergrad.optim`` holds optimizers differentiable in their settings;
``hypergrad.testing`` checks hypergradients against finite differences.
"""

from . import conditions as conditions  # optimality conditions: hg.conditions.stationary
from . import inner as inner  # inner solvers: hg.inner.FixedPoint, ProximalGradient, Newton, LBFGS
from . import optim as optim  # differentiable SGD/Adam/AdamW: hg.optim.sgd(lr=tensor)
from . import prox as prox  # proximal operators and projections: hg.prox.prox_lasso
from . import stochastic as stochastic  # stochastic bilevel solvers: hg.stochastic.SOBA
from . import testing as testing  # the submodule hg.testing, like torch.testing
from .compiled import compile_implicit_grad
from .compiled_step import compile_outer_step
from .errors import (
    FrozenSettingError,
    HypergradError,
    HypergradTypeError,
    HypergradValueError,
    HypergradWarning,
    NonDifferentiableWarning,
    NonStationaryWarning,
    SingularSystemWarning,
    SolveFailedWarning,
    SolverDivergedWarning,
    SolverStalledWarning,
)
from .first_order import FirstOrderInfo
from .implicit import custom_fixed_point, custom_root, implicit, implicit_grad, root_jvp, root_vjp
from .labels import AdaptiveThreshold, GumbelLabeler, soft_cross_entropy
from .methods import FirstOrder, Implicit, SingleLoop, Unrolled, WarmStart
from .modules import HyperStep, frozen_buffers
from .operators import InnerOperator
from .report import HypergradInfo
from .single_loop import SingleLoopInfo
from .solvers import (
    CG,
    GMRES,
    MINRES,
    BiCGStab,
    DensePreconditioner,
    Exact,
    Neumann,
    Nystrom,
    SolveInfo,
    Solver,
)
from .unrolled import UnrolledInfo, unrolled_grad

__version__ = "0.1.0"

__all__ = [
    "AdaptiveThreshold",
    "BiCGStab",
    "CG",
    "DensePreconditioner",
    "GumbelLabeler",
    "MINRES",
    "Exact",
    "GMRES",
    "HyperStep",
    "FirstOrder",
    "FirstOrderInfo",
    "FrozenSettingError",
    "HypergradError",
    "HypergradInfo",
    "HypergradTypeError",
    "HypergradValueError",
    "HypergradWarning",
    "Implicit",
    "InnerOperator",
    "Neumann",
    "NonStationaryWarning",
    "Nystrom",
    "SingleLoop",
    "SingleLoopInfo",
    "SingularSystemWarning",
    "NonDifferentiableWarning",
    "SolveFailedWarning",
    "SolveInfo",
    "Solver",
    "SolverDivergedWarning",
    "SolverStalledWarning",
    "Unrolled",
    "UnrolledInfo",
    "WarmStart",
    "compile_implicit_grad",
    "compile_outer_step",
    "custom_fixed_point",
    "custom_root",
    "frozen_buffers",
    "implicit",
    "implicit_grad",
    "root_jvp",
    "root_vjp",
    "soft_cross_entropy",
    "unrolled_grad",
]
