"""jaxopt: ``jaxopt.implicit_diff.custom_root`` with ``solve_cg`` / ``solve_normal_cg`` under
``jax.jit(jax.grad(...))``, on JAX twins of the losses (``problems.jax_twin``; none for the CNN).
"""

from __future__ import annotations

import functools

import numpy as np

from benchmarks.peers import CG_TOL, Unsupported
from benchmarks.problems import jax_twin

DISTS, IMPORTS, SOLVERS = ("jax", "jaxlib", "jaxopt"), ("jaxopt",), ["cg", "normal_cg"]


def implicit(P, solver: str, K: int):
    import jax
    import jaxopt

    params, theta, inner, outer = jax_twin(P)
    if solver not in ("cg", "normal_cg"):
        raise Unsupported(solver)
    linear_solve = getattr(jaxopt.linear_solve, f"solve_{solver}")
    solve = functools.partial(linear_solve, maxiter=K, tol=CG_TOL)

    @jaxopt.implicit_diff.custom_root(jax.grad(inner, argnums=0), solve=solve)
    def fit(init_params, theta):
        return init_params  # the inner solver; here it is handed the stored solution

    # solution and hyperparameters are arguments, not closure constants (XLA would fold them)
    hypergrad_fn = jax.jit(lambda th, sol: jax.grad(lambda t: outer(fit(sol, t), t))(th))
    return lambda: np.asarray(jax.block_until_ready(hypergrad_fn(theta, params)), np.float64)
