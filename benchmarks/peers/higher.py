"""higher: ``higher.innerloop_ctx`` around ``torch.optim.SGD`` (unrolled only)."""

from __future__ import annotations

import torch

from benchmarks.peers import flat

DISTS, IMPORTS = ("higher",), ("higher",)
SOLVERS: list[str] = []  # higher differentiates through unrolled loops only


def unrolled(P, T: int, lr: float, params0: dict):
    import higher

    model = P.fresh_model(params0)
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def run():
        theta = P.theta.detach().clone().requires_grad_(True)
        with higher.innerloop_ctx(model, opt, copy_initial_weights=True) as (fmodel, diffopt):
            for _ in range(T):
                diffopt.step(P.module_inner(fmodel, theta))
            (g,) = torch.autograd.grad(P.module_outer(fmodel), theta)
        return flat(g)

    return run
