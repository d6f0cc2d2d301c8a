"""Linear solvers for ``(A + damping I) x = b`` given only ``matvec``; one solver per file."""

from .base import SolveInfo, Solver, dense_matrix
from .bicgstab import BiCGStab, solve_bicgstab
from .cg import CG, hutchinson_diagonal, solve_cg
from .exact import Exact, solve_exact
from .gmres import GMRES, solve_gmres
from .minres import MINRES, solve_minres
from .neumann import Neumann, power_iteration, solve_neumann
from .nystrom import Nystrom, solve_nystrom
from .precond import DensePreconditioner

__all__ = [
    "BiCGStab",
    "CG",
    "DensePreconditioner",
    "MINRES",
    "Exact",
    "GMRES",
    "Neumann",
    "Nystrom",
    "SolveInfo",
    "Solver",
    "dense_matrix",
    "hutchinson_diagonal",
    "power_iteration",
    "solve_cg",
    "solve_bicgstab",
    "solve_exact",
    "solve_gmres",
    "solve_minres",
    "solve_neumann",
    "solve_nystrom",
]
