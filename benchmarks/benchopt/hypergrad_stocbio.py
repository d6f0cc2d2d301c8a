"""hypergrad's StocBiO as a benchopt solver of benchmark_bilevel (installed into a checkout's
``solvers/`` by ``python -m benchmarks benchopt``; loop: ``benchmark_utils/hypergrad_solver.py``).
"""

from benchmark_utils.hypergrad_solver import HypergradSolver
from benchopt import safe_import_context

with safe_import_context() as import_ctx:
    import hypergrad as hg


class Solver(HypergradSolver):
    name = "hg_StocBiO"
    parameters = {
        'step_size': [.1],
        'outer_ratio': [1.],
        'batch_size': [64],
        'n_inner_steps': [10],
        'n_shia_steps': [10],
        **HypergradSolver.parameters,
    }

    def make_solver(self):
        return hg.stochastic.StocBiO(
            step_inner=self.step_size, inner_steps=self.n_inner_steps,
            neumann_steps=self.n_shia_steps, neumann_step=self.step_size,
            step_outer=self.step_size / self.outer_ratio)
