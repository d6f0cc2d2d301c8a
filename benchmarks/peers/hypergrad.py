"""hypergrad: ``hg.implicit_grad`` (CG, Neumann, MINRES, Exact), ``hg.compile_implicit_grad``
(``<solver>+compile``: the same solvers compiled by ``torch.compile``; the warm-up call, which
compiles, is recorded as ``warmup_s``) and ``hg.unrolled_grad``.

``make_solver`` is the only place in ``benchmarks/`` that constructs a hypergrad solver.
"""

from __future__ import annotations

import torchopt

import hypergrad as hg
from benchmarks.peers import CG_TOL, Unsupported, flat

DISTS = ("hypergrad",)


def missing() -> str | None:
    return None


def make_solver(kind: str, K: int | None = None, *, alpha=None, tol=CG_TOL, damping=0.0):
    """A hypergrad solver: ``cg``/``minres`` (K iterations, relative ``tol``), ``neumann`` (K
    terms, step ``alpha``; ``None`` = power-iteration estimate), ``exact`` (dense solve)."""
    if kind == "cg":
        return hg.CG(maxiter=K, tol=tol, damping=damping)
    if kind == "minres":
        return hg.MINRES(maxiter=K, tol=tol, damping=damping)
    if kind == "neumann":
        return hg.Neumann(maxiter=K, alpha=alpha, damping=damping)
    if kind == "exact":
        return hg.Exact(damping=damping)
    raise Unsupported(f"hypergrad has no solver {kind!r}")


def compilable(P) -> bool:
    """The small problems: on the 1M-parameter MLP compiled CG was slower than eager (594 vs
    468 ms at K = 20, after 122 s of compiling; the time is in the matrix products, which
    compiling does not change), and torch.func cannot trace the CNN's train-mode BatchNorm."""
    return P.numel <= 20000


def solvers(P) -> list[str]:
    # on the networks also CG with engine="recompute" (the low-memory mode)
    extra = ["cg+recompute"] if P.loss_kind == "ce" else []
    return ["cg", "neumann"] + extra + (["cg+compile"] if compilable(P) else [])


def tta_solvers(P) -> list[str]:
    dense = ["exact"] + (["exact+compile"] if compilable(P) else []) if P.numel <= 20000 else []
    return ["cg", "minres", "neumann"] + (["cg+compile"] if compilable(P) else []) + dense


def implicit(P, solver: str, K: int):
    kind, _, engine = solver.partition("+")
    s = make_solver(kind, K, alpha=P.alpha)
    if engine == "compile":
        f = hg.compile_implicit_grad(P.inner, P.outer, solver=s)
        return lambda: flat(f(P.params, P.theta)[0])

    def run():
        g, _ = hg.implicit_grad(
            P.inner, P.outer, P.params, P.theta, solver=s, engine=engine or "reuse"
        )
        return flat(g)

    return run


def unrolled(P, T: int, lr: float, params0: dict):
    def run():
        opt = torchopt.sgd(lr=lr)
        g, _ = hg.unrolled_grad(P.inner, P.outer, params0, P.theta, steps=T, optimizer=opt)
        return flat(g)

    return run
