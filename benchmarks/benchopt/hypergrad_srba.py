"""hypergrad's SRBA as a benchopt solver of benchmark_bilevel (installed into a checkout's
``solvers/`` by ``python -m benchmarks benchopt``; loop: ``benchmark_utils/hypergrad_solver.py``).
The refresh period is the benchmark's: ``(n_inner + n_outer) * period_frac / batch_size``.
"""

from benchmark_utils.hypergrad_solver import HypergradSolver
from benchopt import safe_import_context

with safe_import_context() as import_ctx:
    import hypergrad as hg


class Solver(HypergradSolver):
    name = "hg_SRBA"
    parameters = {
        'step_size': [.1],
        'outer_ratio': [1.],
        'batch_size': [64],
        'period_frac': [.5],
        **HypergradSolver.parameters,
    }

    def make_solver(self):
        return hg.stochastic.SRBA(
            step_inner=self.step_size, step_outer=self.step_size / self.outer_ratio,
            period=max(1, int((self.problem.inner_sampler.n + self.problem.outer_sampler.n)
                              * self.period_frac / self.batch_size)))
