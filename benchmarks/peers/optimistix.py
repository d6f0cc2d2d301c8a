"""optimistix + lineax: ``optx.minimise`` handed the stored solution (``max_steps=0``; jaxopt's
adapter likewise returns it) with ``adjoint=optx.ImplicitAdjoint(linear_solver=...)`` and the
Hessian tagged positive semidefinite, under ``eqx.filter_jit(jax.grad(...))``, on the JAX twins
of the losses. (Two gradient-descent steps from it, as before, left a 4.4e-4 error floor on the
float64 MLP; ``optx.LBFGS`` fails on float32 under ``jax_enable_x64``: 0.1.0's two-loop scan
carry turns float64.)

Linear solvers: ``lx.CG(rtol, atol=rtol * max|b|, max_steps=K)`` with ``b = dL_out/dpsi`` (rtol
1e-10; 1e-5 in float32, where 1e-6 stalls on the quick MLP) and, on problems of at most 20,000
unknowns, ``lx.Cholesky()`` (dense). lineax raises when CG has not converged after ``max_steps``
(``throw`` cannot be switched off through ``ImplicitAdjoint``), so an equal-K row below
convergence is an error, by design of the library. lineax tests ``|r_i| <= atol + rtol |b_i|``
elementwise: on the MLP ``b`` has exact zeros (75 ReLU units silent on the validation set, 76,815
of 1,068,810 entries), and with atol=0 the 0/0 = NaN made CG stop after one step reporting
success (rel. error 0.96 on the float64 MLP; now 6.75e-8 from K=150, as jaxopt).

The float32 MLP fails by design of lineax 0.1.1's CG: it sets the step to NaN unless
``p'Hp > 100 * rcond * r'r`` with ``rcond = 2 eps n``, 25.5 in float32 for n = 1,068,810, above
lambda_max(H) = 12.7, so the first step is NaN at every K (quick MLP, n = 25,450: from K=20).
With that guard patched out (evidence only) it reaches 2.5e-6 at K=200 (jaxopt: 4.6e-6).
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
    if solver not in ("cg", "cholesky"):
        raise Unsupported(solver)
    params, theta, inner, outer = twin
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
