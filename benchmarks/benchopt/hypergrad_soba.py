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
        # decreasing steps, as the benchmark's SOBA (its k^-1/2 on both): hypergrad's paper
        # rule, rho k^-2/5 and gamma k^-3/5 (constant steps of this size diverge)
        return hg.stochastic.SOBA(step_inner=self.step_size,
                                  step_outer=self.step_size / self.outer_ratio, decay=True)
