"""hypergrad: ``hg.inner.ProximalGradient`` (FISTA, fixed step ``1/L``) and ``hg.inner.FixedPoint``
(Anderson, memory 5), both differentiated by ``hg.custom_fixed_point`` with ``hg.GMRES`` (the
default), ``hg.Exact`` (dense, lasso) or ``hg.Neumann(alpha=1)`` (DEQ: the adjoint fixed-point
iteration ``u <- v + (dT/dz)^T u``)."""

from __future__ import annotations

import torch

import hypergrad as hg
from benchmarks.peers.roots import Unsupported, flat

DISTS, IMPORTS = ("hypergrad",), ("hypergrad",)
METHODS = {"lasso": ["fista+gmres", "fista+exact"], "deq": ["anderson+gmres", "anderson+neumann"]}


def linear_solver(name: str, kb: int, btol: float):
    if name == "gmres":
        return hg.GMRES(maxiter=kb, tol=btol)
    if name == "exact":
        return hg.Exact()
    if name == "neumann":  # tol: stop once the series' residual bound is below it
        return hg.Neumann(alpha=1.0, maxiter=kb, tol=btol or None)
    raise Unsupported(f"hypergrad has no solver {name!r} here")


def build(P, method: str, kf: int, kb: int, ftol: float, btol: float):
    fwd, _, bwd = method.partition("+")
    solver = linear_solver(bwd, kb, btol)
    if P.kind == "lasso":
        lasso = hg.inner.ProximalGradient(
            P.smooth, hg.prox.prox_lasso, stepsize=P.step, maxiter=kf, tol=ftol, solver=solver
        )
        w0 = torch.zeros(P.X.shape[1], dtype=P.X.dtype)

        def run():
            lam = P.lam.detach().clone().requires_grad_(True)
            w = lasso.run(w0, ((), lam))
            return flat(torch.autograd.grad(P.outer(w), lam))

        return run

    T = lambda z, h: torch.tanh(z @ h[0].T + h[1])  # h = (W, u), u = U x + b (the injection)
    layer = hg.inner.FixedPoint(T, method=fwd, maxiter=kf, tol=ftol, memory=5, solver=solver)
    z0 = torch.zeros(P.x.shape[0], P.W.shape[0], dtype=P.W.dtype)

    def run():
        W, U, b = (t.detach().clone().requires_grad_(True) for t in (P.W, P.U, P.b))
        z = layer.run(z0, (W, P.x @ U.T + b))
        return flat(torch.autograd.grad(P.loss(z), (W, U, b)))

    return run
