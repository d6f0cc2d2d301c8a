"""torchopt: ``torchopt.diff.implicit.custom_root`` on the fixed-point residual ``F = x − T(x)``
(the proximal-gradient map of the lasso, ``tanh(W z + u)`` of the DEQ), solved by
``torchopt.linear_solve.solve_normal_cg`` (CG on the normal equations: ``F``'s Jacobian is not
symmetric, so ``solve_cg`` does not apply; 2 products per iteration) or ``solve_inv(ns=True,
alpha=1)`` (the Neumann series). torchopt has no inner solvers: the forward is hypergrad's plain
iteration (``solve`` of ``hg.inner.ProximalGradient`` / ``hg.inner.FixedPoint``, no
autograd), so these rows differ from hypergrad's only in the backward."""

from __future__ import annotations

import torch

import hypergrad as hg
from benchmarks.peers.roots import Unsupported, flat

DISTS, IMPORTS = ("torchopt",), ("torchopt",)
METHODS = {
    "lasso": ["fista+normal_cg", "fista+neumann"],
    "deq": ["anderson+normal_cg", "anderson+neumann"],
}


def linear_solver(name: str, kb: int, btol: float):
    import torchopt

    ls = torchopt.linear_solve
    if name == "normal_cg":
        return ls.solve_normal_cg(maxiter=kb, rtol=btol, atol=0.0)
    if name == "neumann":
        return ls.solve_inv(ns=True, maxiter=kb, alpha=1.0)
    raise Unsupported(f"torchopt has no solver {name!r} here")


def build(P, method: str, kf: int, kb: int, ftol: float, btol: float):
    import torchopt

    fwd, _, bwd = method.partition("+")
    solve = linear_solver(bwd, kb, btol)
    if P.kind == "lasso":
        X, y, s = P.X, P.y, P.step

        def T(w, lam):  # prox_{s λ|.|}(w − s ∇f(w)), ∇f(w) = Xᵀ(Xw − y)/n
            v = w - s * (X.T @ (X @ w - y)) / X.shape[0]
            return torch.sign(v) * torch.relu(v.abs() - s * lam)

        @torchopt.diff.implicit.custom_root(lambda w, lam: w - T(w, lam), argnums=1, solve=solve)
        def fit(w0, lam):
            w, _ = hg.inner.ProximalGradient(
                P.smooth, hg.prox.prox_lasso, stepsize=s, maxiter=kf, tol=ftol
            ).solve(w0, (None, lam))
            return w

        w0 = torch.zeros(X.shape[1], dtype=X.dtype)

        def run():
            lam = P.lam.detach().clone().requires_grad_(True)
            return flat(torch.autograd.grad(P.outer(fit(w0, lam)), lam))

        return run

    T = lambda z, W, u: torch.tanh(z @ W.T + u)

    @torchopt.diff.implicit.custom_root(lambda z, W, u: z - T(z, W, u), argnums=(1, 2), solve=solve)
    def fit(z0, W, u):
        z, _ = hg.inner.FixedPoint(
            lambda z, h: T(z, *h), method=fwd, maxiter=kf, tol=ftol, memory=5
        ).solve(z0, (W, u))
        return z

    z0 = torch.zeros(P.x.shape[0], P.W.shape[0], dtype=P.W.dtype)

    def run():
        W, U, b = (t.detach().clone().requires_grad_(True) for t in (P.W, P.U, P.b))
        z = fit(z0, W, P.x @ U.T + b)
        return flat(torch.autograd.grad(P.loss(z), (W, U, b)))

    return run
