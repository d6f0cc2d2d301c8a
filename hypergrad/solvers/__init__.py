"""Linear solvers for ``(A + damping I) x = b`` given only ``matvec``; one solver per file.

Each solver is one class (:class:`Solver`: settings as validated, frozen keyword-only fields,
the algorithm in ``solve``) and a functional form derived from it (``solve_cg(matvec, b, x0,
**settings)`` is ``CG(**settings).solve(matvec, b, x0)``). :data:`SOLVERS` lists them all by
name; ``docs/solvers.md`` ("Writing a solver") says how to add one.
"""

from .base import SOLVERS, MatVec, SolveInfo, Solver
from .bicgstab import BiCGStab, solve_bicgstab
from .cg import CG, hutchinson_diagonal, solve_cg
from .dense import dense_matrix
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
    "MatVec",
    "Neumann",
    "Nystrom",
    "SOLVERS",
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
