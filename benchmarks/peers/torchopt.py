"""torchopt: ``custom_root`` with ``solve_cg``, ``solve_normal_cg`` (2K + 1 products) and
``solve_inv(ns=True)``; the ``torchopt.sgd`` loop for unrolling. ``+bnpatch`` (the CNN):
``torch.func.replace_all_batch_norm_modules_``, without which ``custom_root`` refuses BatchNorm."""

from __future__ import annotations

import copy

import torch

from benchmarks.peers import CG_TOL, Unsupported, flat

DISTS = IMPORTS = ("torchopt",)


def solvers(P) -> list[str]:
    base = ["cg", "normal_cg", "neumann"]
    return base + ([s + "+bnpatch" for s in base] if P.key.startswith("cnn") else [])


def implicit(P, solver: str, K: int, tol: float = CG_TOL):
    import torchopt

    solver, _, patch = solver.partition("+")
    if patch:
        P = copy.copy(P)
        P.model = torch.func.replace_all_batch_norm_modules_(copy.deepcopy(P.model))
    ls = torchopt.linear_solve
    if solver in ("cg", "normal_cg"):
        solve = getattr(ls, f"solve_{solver}")(maxiter=K, rtol=tol, atol=0.0)
    elif solver == "neumann":
        solve = ls.solve_inv(ns=True, maxiter=K, alpha=P.alpha)
    else:
        raise Unsupported(solver)
    names = list(P.params)
    sol = tuple(P.params.values())

    def stationary(ps, theta):  # the documented optimality condition: the inner gradient
        return torch.func.grad(lambda q, t: P.inner(dict(zip(names, q)), t))(ps, theta)

    @torchopt.diff.implicit.custom_root(stationary, argnums=1, solve=solve)
    def fit(init_params, theta):
        return sol  # the inner solver; here the stored solution

    def run():
        theta = P.theta.detach().clone().requires_grad_(True)
        (g,) = torch.autograd.grad(P.outer(dict(zip(names, fit(sol, theta))), theta), theta)
        return flat(g)

    return run


def unrolled(P, T: int, lr: float, params0: dict):
    import torchopt

    names = list(params0)

    def run():
        theta = P.theta.detach().clone().requires_grad_(True)
        opt = torchopt.sgd(lr=lr)
        params = tuple(p.detach().clone().requires_grad_(True) for p in params0.values())
        state = opt.init(params)
        for _ in range(T):
            loss = P.inner(dict(zip(names, params)), theta)
            grads = torch.autograd.grad(loss, params, create_graph=True)
            updates, state = opt.update(grads, state, inplace=False)
            params = torchopt.apply_updates(params, updates, inplace=False)
        (g,) = torch.autograd.grad(P.outer(dict(zip(names, params)), theta), theta)
        return flat(g)

    return run
