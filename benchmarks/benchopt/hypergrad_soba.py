"""hypergrad's SOBA as a benchopt solver of benchmark_bilevel (installed into a checkout's
``solvers/`` by ``python -m benchmarks benchopt``; loop: ``benchmark_utils/hypergrad_solver.py``).
"""

from benchmark_utils.hypergrad_solver import HypergradSolver
from benchopt import safe_import_context

with safe_import_context() as import_ctx:
    import hypergrad as hg


class Solver(HypergradSolver):
    name = "hg_SOBA"
    parameters = {
        'step_size': [.1],
        'outer_ratio': [1.],
        'batch_size': [64],
        **HypergradSolver.parameters,
    }

    def make_solver(self):
        return hg.stochastic.SOBA(step_inner=self.step_size,
                                  step_outer=self.step_size / self.outer_ratio)
