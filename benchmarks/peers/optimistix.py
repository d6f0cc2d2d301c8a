"""optimistix + lineax: ``optx.minimise`` handed the stored solution (``max_steps=0``) with
``ImplicitAdjoint(lx.CG(rtol, atol=rtol * max|b|, max_steps=K))`` or ``lx.Cholesky()``, the
Hessian tagged PSD, under ``eqx.filter_jit(jax.grad(...))``; its failures: docs/benchmarks.md."""

from __future__ import annotations

import numpy as np
import torch

from benchmarks.peers import CG_TOL, Unsupported
from benchmarks.problems import jax_twin

DISTS, IMPORTS, SOLVERS = ("optimistix", "lineax", "equinox"), ("optimistix", "lineax"), ["cg"]


def tta_solvers(P) -> list[str]:
    return ["cg"] + (["cholesky"] if P.numel <= 20000 else [])


def implicit(P, solver: str, K: int):
    import equinox as eqx
    import jax
    import lineax as lx
    import optimistix as optx

    params, theta, inner, outer = jax_twin(P)
    if solver not in ("cg", "cholesky"):
        raise Unsupported(solver)
    linear = lx.Cholesky()
    if solver == "cg":
        rtol = CG_TOL if P.dtype == torch.float64 else 1e-5
        atol = rtol * float(optx.max_norm(jax.grad(outer)(params, theta)))  # b's exact zeros
        linear = lx.CG(rtol=rtol, atol=atol, max_steps=K)
    adjoint = optx.ImplicitAdjoint(linear_solver=linear)
    gd = optx.GradientDescent(learning_rate=1e-3, rtol=1e-6, atol=1e-6)  # takes no step
    tags = frozenset({lx.positive_semidefinite_tag})

    def loss(th, sol):
        s = optx.minimise(inner, gd, sol, th, adjoint=adjoint, tags=tags, max_steps=0, throw=False)
        return outer(s.value, th)

    hypergrad_fn = eqx.filter_jit(jax.grad(loss))  # equinox's jit, as optimistix documents
    guard = 200 * np.finfo(np.float32).eps * P.numel  # lineax CG's breakdown threshold, float32

    def run():
        try:
            return np.asarray(jax.block_until_ready(hypergrad_fn(theta, params)), np.float64)
        except Exception as e:  # noqa: BLE001 - lineax's message is deep inside the traceback
            lines = str(e).splitlines()
            msg = next((ln for ln in lines if "EquinoxRuntimeError: " in ln), lines[0]).strip()
            if solver == "cg" and P.dtype == torch.float32 and "non-finite" in msg:
                msg = (
                    f"CG step set to NaN by lineax's breakdown guard p'Hp > {guard:.3g} r'r "
                    f"(100 * 2 eps n, n = {P.numel}; lambda_max(H) = "
                    f"{P.extras.get('lambda_max', float('nan')):.3g})"
                )
            raise RuntimeError(f"lineax: {msg[:300]}") from None

    return run
