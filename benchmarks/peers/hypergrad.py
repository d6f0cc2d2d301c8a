"""hypergrad: ``hg.implicit_grad``, ``hg.compile_implicit_grad`` (``<solver>+compile``) and
``hg.unrolled_grad``; ``make_solver`` is the one place in ``benchmarks/`` that builds a solver."""

from __future__ import annotations

import torchopt

import hypergrad as hg
from benchmarks.peers import CG_TOL, Unsupported, flat

DISTS = ("hypergrad",)


def make_solver(kind: str, K: int | None = None, *, alpha=None, tol=CG_TOL, damping=0.0):
    """A hypergrad solver: ``cg``/``minres`` (K iterations, relative ``tol``), ``neumann`` (K
    terms, step ``alpha``; ``None`` = power-iteration estimate), ``exact`` (dense solve)."""
    if kind in ("cg", "minres"):
        return (hg.CG if kind == "cg" else hg.MINRES)(maxiter=K, tol=tol, damping=damping)
    if kind == "neumann":
        return hg.Neumann(maxiter=K, alpha=alpha, damping=damping)
    if kind == "exact":
        return hg.Exact(damping=damping)
    raise Unsupported(f"hypergrad has no solver {kind!r}")


def compilable(P) -> bool:
    """The small problems (compiled CG was slower than eager on the MLP, 594 vs 468 ms at K = 20;
    torch.func cannot trace the CNN's train-mode BatchNorm)."""
    return P.numel <= 20000


def solvers(P) -> list[str]:
    # on the networks also CG with engine="recompute" (the low-memory mode)
    extra = ["cg+recompute"] if P.loss_kind == "ce" else []
    return ["cg", "neumann"] + extra + (["cg+compile"] if compilable(P) else [])


def tta_solvers(P) -> list[str]:  # the dense Exact on the small problems only
    small = ["cg+compile", "exact", "exact+compile"] if compilable(P) else []
    return ["cg", "minres", "neumann"] + small


def implicit(P, solver: str, K: int):
    kind, _, engine = solver.partition("+")
    s = make_solver(kind, K, alpha=P.alpha)
    if engine == "compile":
        f = hg.compile_implicit_grad(P.inner, P.outer, solver=s)
        return lambda: flat(f(P.params, P.theta)[0])

    engine = engine or "reuse"
    return lambda: flat(
        hg.implicit_grad(P.inner, P.outer, P.params, P.theta, solver=s, engine=engine)[0]
    )


def unrolled(P, T: int, lr: float, params0: dict):
    def run():
        opt = torchopt.sgd(lr=lr)
        g, _ = hg.unrolled_grad(P.inner, P.outer, params0, P.theta, steps=T, optimizer=opt)
        return flat(g)

    return run
