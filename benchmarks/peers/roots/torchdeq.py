"""torchdeq: ``torchdeq.get_deq(ift=True)`` — Anderson forward (memory 5, as hypergrad's and
jaxopt's) and the implicit backward by its ``fixed_point_iter`` (the adjoint fixed-point
iteration, torchdeq's default) or ``anderson``; stop mode ``"rel"``. torchdeq solves every batch
row as its own system (per-example stopping and Anderson mixing); the lasso is one row, its map
the proximal-gradient step."""

from __future__ import annotations

import torch

from benchmarks.peers.roots import flat

DISTS, IMPORTS = ("torchdeq",), ("torchdeq",)
SOLVERS = {"fp_iter": "fixed_point_iter", "anderson": "anderson"}
METHODS = {"lasso": ["anderson+fp_iter"], "deq": ["anderson+fp_iter", "anderson+anderson"]}


def build(P, method: str, kf: int, kb: int, ftol: float, btol: float):
    import torchdeq

    fwd, _, bwd = method.partition("+")
    deq = torchdeq.get_deq(
        core="indexing", ift=True, f_solver=fwd, b_solver=SOLVERS[bwd], f_max_iter=kf,
        b_max_iter=kb, f_tol=ftol, b_tol=btol, f_stop_mode="rel", b_stop_mode="rel",
    )  # fmt: skip
    deq.train()
    kw = dict(solver_kwargs={"m": 5}) if fwd == "anderson" else {}
    if P.kind == "lasso":
        X, y, s = P.X, P.y, P.step
        w0 = torch.zeros(1, X.shape[1], dtype=X.dtype)

        def run():
            lam = P.lam.detach().clone().requires_grad_(True)

            def T(w):  # one row: prox_{s λ|.|}(w − s ∇f(w))
                v = w - s * ((w @ X.T - y) @ X) / X.shape[0]
                return torch.sign(v) * torch.relu(v.abs() - s * lam)

            zs, _ = deq(T, w0, **kw)
            return flat(torch.autograd.grad(P.outer(zs[-1][0]), lam))

        return run

    z0 = torch.zeros(P.x.shape[0], P.W.shape[0], dtype=P.W.dtype)

    def run():
        W, U, b = (t.detach().clone().requires_grad_(True) for t in (P.W, P.U, P.b))
        u = P.x @ U.T + b
        zs, _ = deq(lambda z: torch.tanh(z @ W.T + u), z0, **kw)
        return flat(torch.autograd.grad(P.loss(zs[-1]), (W, U, b)))

    return run
