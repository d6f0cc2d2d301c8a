"""jaxopt: ``jaxopt.implicit_diff.custom_root`` with ``solve_cg`` / ``solve_normal_cg`` under
``jax.jit(jax.grad(...))``, on JAX twins of the losses (``problems.jax_twin``; none for the CNN).
"""

from __future__ import annotations

import functools

import numpy as np

from benchmarks.peers import CG_TOL, Unsupported, quiet_import
from benchmarks.problems import jax_twin

DISTS = ("jax", "jaxlib", "jaxopt")
NO_TWIN = "the CNN is a torch nn.Module (BatchNorm in train mode) with no JAX twin here"


def missing() -> str | None:
    return quiet_import("jaxopt")


def solvers(P) -> list[str]:
    return ["cg", "normal_cg"]


def implicit(P, solver: str, K: int):
    import jax
    import jaxopt

    twin = jax_twin(P)
    if twin is None:
        raise Unsupported(NO_TWIN)
    if solver not in ("cg", "normal_cg"):
        raise Unsupported(solver)
    solve = functools.partial(
        getattr(jaxopt.linear_solve, f"solve_{solver}"), maxiter=K, tol=CG_TOL
    )
    params, theta, inner, outer = twin

    @jaxopt.implicit_diff.custom_root(jax.grad(inner, argnums=0), solve=solve)
    def fit(init_params, theta):
        return init_params  # the inner solver; here it is handed the stored solution

    # solution and hyperparameters are arguments, not closure constants (XLA would fold them)
    hypergrad_fn = jax.jit(lambda th, sol: jax.grad(lambda t: outer(fit(sol, t), t))(th))
    return lambda: np.asarray(jax.block_until_ready(hypergrad_fn(theta, params)), np.float64)
