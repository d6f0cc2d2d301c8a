"""optimistix + lineax: ``optx.minimise`` (gradient descent started at the stored solution,
where it stops after two steps) with ``adjoint=optx.ImplicitAdjoint(linear_solver=...)`` and the
Hessian tagged positive semidefinite, under ``eqx.filter_jit(jax.grad(...))``, on the JAX twins
of the losses.

Linear solvers: ``lx.CG(rtol, atol=0, max_steps=K)`` (rtol 1e-10; 1e-6 in float32) and, on
problems of at most 20,000 unknowns, ``lx.Cholesky()`` (dense). lineax raises when CG has not
converged after ``max_steps`` (``throw`` cannot be switched off through ``ImplicitAdjoint``), so
an equal-K row below convergence is an error, by design of the library. Open: on the MLP the
adjoint CG returns NaN in float32 and does not converge in float64 within 500 steps, where lineax
CG on the same Hessian alone converges in 149 (not diagnosed yet).
"""

from __future__ import annotations

import numpy as np
import torch

from benchmarks.peers import CG_TOL, Unsupported, quiet_import
from benchmarks.peers.jaxopt import NO_TWIN
from benchmarks.problems import jax_twin

DISTS = ("optimistix", "lineax", "equinox")


def missing() -> str | None:
    return quiet_import("optimistix") or quiet_import("lineax")


def solvers(P) -> list[str]:
    return ["cg"]


def tta_solvers(P) -> list[str]:
    return ["cg"] + (["cholesky"] if P.numel <= 20000 else [])


def implicit(P, solver: str, K: int):
    import equinox as eqx
    import jax
    import lineax as lx
    import optimistix as optx

    twin = jax_twin(P)
    if twin is None:
        raise Unsupported(NO_TWIN)
    if solver == "cg":
        rtol = CG_TOL if P.dtype == torch.float64 else 1e-6  # float32: 1e-10 breaks down to NaN
        linear = lx.CG(rtol=rtol, atol=0.0, max_steps=K)
    elif solver == "cholesky":
        linear = lx.Cholesky()
    else:
        raise Unsupported(solver)
    params, theta, inner, outer = twin
    adjoint = optx.ImplicitAdjoint(linear_solver=linear)
    # gradient descent from the stored solution stops after two steps (moving it by ~lr * grad);
    # optx.LBFGS fails on float32 under jax_enable_x64 (0.1.0: scan carry dtypes differ)
    gd = optx.GradientDescent(learning_rate=1e-3, rtol=1e-6, atol=1e-6)
    tags = frozenset({lx.positive_semidefinite_tag})

    def loss(th, sol):
        s = optx.minimise(inner, gd, sol, args=th, adjoint=adjoint, tags=tags, throw=False)
        return outer(s.value, th)

    hypergrad_fn = eqx.filter_jit(jax.grad(loss))  # equinox's jit, as optimistix documents

    def run():
        try:
            return np.asarray(jax.block_until_ready(hypergrad_fn(theta, params)), np.float64)
        except Exception as e:  # noqa: BLE001 - lineax's message is deep inside the traceback
            lines = str(e).splitlines()
            msg = next((ln for ln in lines if "EquinoxRuntimeError: " in ln), lines[0])
            raise RuntimeError(f"lineax: {msg.strip()[:300]}") from None

    return run
