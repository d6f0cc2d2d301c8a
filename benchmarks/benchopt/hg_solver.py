"""The base of hypergrad's benchopt solvers (installed as ``benchmark_utils/hypergrad_solver.py``
of a ``benchmark_bilevel`` checkout by ``python -m benchmarks benchopt``).

``set_objective`` rebuilds the problem in torch from the arrays of the objective's closures
(``hypergrad_problems.build``), checks the torch losses against ``f_inner`` / ``f_outer`` at
random points (appended to the JSON-lines file ``$HG_RACE_CHECKS``), and warms up with
``run_once(2)`` as the benchmark's own solvers do. ``run`` steps a ``hypergrad.stochastic``
solver ``eval_freq`` iterations between two callbacks; ``get_result`` hands the iterates back
as float32 numpy arrays, which the benchmark's metrics read.
"""

import json
import os
import warnings

from benchopt import BaseSolver, safe_import_context
from benchopt.stopping_criterion import SufficientProgressCriterion

with safe_import_context() as import_ctx:
    import numpy as np
    import torch
    from benchmark_utils import constants
    from benchmark_utils.hypergrad_problems import BlockSampler, build, check_losses

    import hypergrad as hg

_CHECKED = set()


def to_torch(a):
    return torch.as_tensor(np.array(a, dtype=np.float32))


class HypergradSolver(BaseSolver):
    """A ``hypergrad.stochastic`` solver: subclasses set ``name``, ``parameters`` and
    ``make_solver()``."""

    requirements = ["pip:torch", "pip:hypergrad"]
    stopping_criterion = SufficientProgressCriterion(
        patience=constants.PATIENCE, strategy="callback"
    )
    parameters = {"eval_freq": [128], "random_state": [1]}

    @staticmethod
    def get_next(stop_val):
        return stop_val + 1

    def make_solver(self):
        raise NotImplementedError

    def set_objective(self, f_inner, f_outer, n_inner_samples, n_outer_samples,
                      inner_var0, outer_var0):
        torch.set_num_threads(1)
        self.tp = build(f_inner, f_outer)
        key = (self.tp.kind, n_inner_samples, n_outer_samples)
        if key not in _CHECKED and os.environ.get("HG_RACE_CHECKS"):
            _CHECKED.add(key)
            worst = check_losses(self.tp, f_inner, f_outer, np.asarray(inner_var0),
                                 np.asarray(outer_var0))
            with open(os.environ["HG_RACE_CHECKS"], "a") as out:
                out.write(json.dumps({"kind": self.tp.kind, "n_inner": n_inner_samples,
                                      "n_outer": n_outer_samples, **worst}) + "\n")
        bs = getattr(self, "batch_size", 64)
        seed = 1000 * int(self.random_state)
        self.problem = hg.stochastic.Bilevel(
            self.tp.inner_loss, self.tp.outer_loss,
            BlockSampler(n_inner_samples, bs, seed=seed + 1),
            BlockSampler(n_outer_samples, bs, seed=seed + 2),
        )
        self.z0, self.x0 = to_torch(inner_var0), to_torch(outer_var0)
        self.solver = self.make_solver()
        self.run_once(2)

    def run(self, callback):
        state = self.solver.init(self.z0, self.x0)
        self.inner_var, self.outer_var = self.z0, self.x0
        step = self.solver.step
        while callback():
            for _ in range(self.eval_freq):
                state = step(state, self.problem)
            self.inner_var, self.outer_var = state.z[0], state.x[0]
            if not (torch.isfinite(self.outer_var).all() and torch.isfinite(self.inner_var).all()):
                break  # the objective raises on NaN: benchopt records the divergence

    def get_result(self):
        return dict(inner_var=self.inner_var.detach().numpy().astype(np.float32),
                    outer_var=self.outer_var.detach().numpy().astype(np.float32))


class HypergradImplicit(BaseSolver):
    """Solve, then differentiate (deterministic): full-batch inner L-BFGS warm started from the
    previous inner solution, ``hg.implicit_grad`` with CG warm started from the previous
    adjoint, and one outer step per callback: ``torch.optim.LBFGS`` (strong Wolfe) or gradient
    descent with a fixed step (jaxopt_GD's outer loop)."""

    name = "hg_implicit"
    requirements = ["pip:torch", "pip:hypergrad"]
    stopping_criterion = SufficientProgressCriterion(
        patience=constants.PATIENCE, strategy="callback"
    )
    parameters = {
        "outer": ["lbfgs"],
        "step_size_outer": [1.0],
        "inner_tol": [1e-6],
        "n_inner_steps": [100],
        "cg_tol": [1e-6],
    }

    @staticmethod
    def get_next(stop_val):
        return stop_val + 1

    def set_objective(self, f_inner, f_outer, n_inner_samples, n_outer_samples,
                      inner_var0, outer_var0):
        torch.set_num_threads(1)
        # a loose inner solve or CG stop is warned about: expected between outer steps here
        warnings.filterwarnings("ignore", category=hg.HypergradWarning)
        self.tp = build(f_inner, f_outer)
        self.z0, self.x0 = to_torch(inner_var0), to_torch(outer_var0)
        self.inner = hg.inner.LBFGS(self.tp.full_inner, maxiter=self.n_inner_steps,
                                    tol=self.inner_tol)
        self.cg = hg.CG(tol=self.cg_tol, maxiter=200)
        self.run_once(2)

    def _value_and_hypergrad(self, x):
        z, _ = self.inner.solve(self.z, x.detach())
        self.z = z.detach()
        g, info = hg.implicit_grad(self.tp.full_inner, self.tp.full_outer, self.z, x.detach(),
                                   solver=self.cg, x0=self.adjoint)
        self.adjoint = info.adjoint
        return float(info.outer_loss), g

    def run(self, callback):
        self.z, self.adjoint = self.z0.clone(), None
        x = self.x0.clone().requires_grad_(True)
        self.inner_var, self.outer_var = self.z, x.detach()
        if self.outer == "lbfgs":
            opt = torch.optim.LBFGS([x], lr=self.step_size_outer, max_iter=1, history_size=20,
                                    line_search_fn="strong_wolfe")

            def closure():
                value, g = self._value_and_hypergrad(x)
                x.grad = g.detach().clone()
                return torch.tensor(value)
        while callback():
            if self.outer == "lbfgs":
                opt.step(closure)  # the line search's last point need not be the new x:
                self.z, _ = self.inner.solve(self.z, x.detach())  # z at the new x, timed
            else:
                _, g = self._value_and_hypergrad(x)
                with torch.no_grad():
                    x -= self.step_size_outer * g
            self.inner_var, self.outer_var = self.z, x.detach().clone()
            if not torch.isfinite(self.outer_var).all():
                break

    def get_result(self):
        return dict(inner_var=self.inner_var.detach().numpy().astype(np.float32),
                    outer_var=self.outer_var.detach().numpy().astype(np.float32))


