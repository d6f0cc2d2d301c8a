"""jaxopt: ``jaxopt.ProximalGradient(fun, prox=prox_lasso, implicit_diff=True)`` (FISTA, the same
fixed step ``1/L``) and ``jaxopt.AndersonAcceleration(implicit_diff=True)`` (history 5), with
``implicit_diff_solve`` = ``solve_normal_cg`` (jaxopt's default for these non-symmetric
conditions) or ``solve_gmres`` (``restart = min(kb, 30)`` Krylov vectors, as hypergrad's GMRES,
and ``ceil(kb / restart)`` cycles: at most about ``kb`` products), all under
``jax.jit(jax.grad(...))`` in float64. jaxopt's tolerances are absolute: the FISTA one on
``||x − prox(x − s∇f)|| / s``, the Anderson one on ``||T(z) − z||``."""

from __future__ import annotations

import functools
import math

import numpy as np

from benchmarks.peers.roots import Unsupported

DISTS, IMPORTS = ("jax", "jaxlib", "jaxopt"), ("jax", "jaxopt")
METHODS = {
    "lasso": ["fista+normal_cg", "fista+gmres"],
    "deq": ["anderson+normal_cg", "anderson+gmres"],
}


def linear_solver(name: str, kb: int, btol: float):
    import jaxopt

    ls = jaxopt.linear_solve
    if name == "normal_cg":
        return functools.partial(ls.solve_normal_cg, maxiter=kb, tol=btol)
    if name == "gmres":
        restart = min(kb, 30)
        return functools.partial(ls.solve_gmres, maxiter=math.ceil(kb / restart), restart=restart,
                                 tol=btol)  # fmt: skip
    raise Unsupported(f"jaxopt has no solver {name!r} here")


def build(P, method: str, kf: int, kb: int, ftol: float, btol: float):
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import jaxopt

    fwd, _, bwd = method.partition("+")
    solve = linear_solver(bwd, kb, btol)
    j = lambda t: jnp.asarray(t.detach().cpu().numpy())
    if P.kind == "lasso":
        X, y, Xv, yv, lam = map(j, (P.X, P.y, P.Xv, P.yv, P.lam))
        fun = lambda w, X, y: 0.5 * jnp.mean((X @ w - y) ** 2)
        pg = jaxopt.ProximalGradient(
            fun=fun, prox=jaxopt.prox.prox_lasso, stepsize=P.step, maxiter=kf, tol=ftol,
            acceleration=True, implicit_diff=True, implicit_diff_solve=solve,
        )  # fmt: skip

        def outer(lam, X, y, Xv, yv):
            w = pg.run(jnp.zeros(X.shape[1]), lam, X, y).params
            return 0.5 * jnp.mean((Xv @ w - yv) ** 2)

        g = jax.jit(jax.grad(outer))  # data as arguments, not constants XLA would fold
        return lambda: np.asarray(jax.block_until_ready(g(lam, X, y, Xv, yv)), np.float64)

    if fwd != "anderson":
        raise Unsupported(fwd)
    T = lambda z, W, u: jnp.tanh(z @ W.T + u)
    aa = jaxopt.AndersonAcceleration(
        fixed_point_fun=T, history_size=5, maxiter=kf, tol=ftol, implicit_diff=True,
        implicit_diff_solve=solve,
    )  # fmt: skip
    x, labels, W, U, b, R, c = map(j, (P.x, P.labels, P.W, P.U, P.b, P.R, P.c))

    def loss(W, U, b, x, labels, R, c):
        u = x @ U.T + b
        z = aa.run(jnp.zeros((x.shape[0], W.shape[0]), x.dtype), W, u).params
        logp = jax.nn.log_softmax(z @ R.T + c)
        return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))

    g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    def run():
        gs = jax.block_until_ready(g(W, U, b, x, labels, R, c))
        return np.concatenate([np.asarray(t, np.float64).ravel() for t in gs])

    return run
