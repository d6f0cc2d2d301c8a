"""hypertorch (github.com/prolearner/hypertorch): ``hg.CG`` / ``hg.neumann`` with a
``hg.GradientDescent`` fixed-point map (step 1 for CG, ``alpha`` for Neumann), ``hg.reverse`` for
unrolling; loaded from the checkout named by ``HYPERTORCH_SRC`` (docs/benchmarks.md)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from benchmarks.peers import Unsupported, flat

DISTS, SOLVERS = (), ["cg", "neumann"]
_MOD = None


def _load():
    """Import the checkout's ``hypergrad`` package without displacing ours in ``sys.modules``."""
    global _MOD
    if _MOD is None:
        src = os.environ.get("HYPERTORCH_SRC", "")
        if not (Path(src) / "hypergrad" / "hypergradients.py").is_file():
            raise Unsupported(
                "hypertorch is not on PyPI and installs as `hypergrad` (clashing with this "
                "package): set HYPERTORCH_SRC to a checkout of github.com/prolearner/hypertorch"
            )
        ours = {k: v for k, v in sys.modules.items() if k.split(".")[0] == "hypergrad"}
        for k in ours:
            del sys.modules[k]
        sys.path.insert(0, src)
        try:
            import hypergrad as theirs

            _MOD = theirs
        finally:
            sys.path.remove(src)
            for k in [k for k in sys.modules if k.split(".")[0] == "hypergrad"]:
                del sys.modules[k]
            sys.modules.update(ours)
    return _MOD


def missing() -> str | None:
    try:
        _load()
    except Unsupported as e:
        return str(e)
    return None


def version() -> str:
    src = Path(os.environ.get("HYPERTORCH_SRC", "."))
    if missing():
        return "not installed"
    setup = (src / "setup.py").read_text() if (src / "setup.py").exists() else ""
    v = re.search(r"version=['\"]([^'\"]+)", setup)
    git = ", git" if (src / ".git" / "HEAD").exists() else ""
    return f"{v.group(1) if v else '?'} (source {src}{git})"


def _losses(P, names):
    return tuple(lambda ps, hs, f=f: f(dict(zip(names, ps)), hs[0]) for f in (P.inner, P.outer))


def implicit(P, solver: str, K: int):
    hg = _load()
    if solver not in ("cg", "neumann"):
        raise Unsupported(solver)
    names = list(P.params)
    inner, outer = _losses(P, names)
    fp_map = hg.GradientDescent(inner, step_size=1.0 if solver == "cg" else P.alpha)
    method = hg.CG if solver == "cg" else hg.neumann
    params = list(P.params.values())

    def run():
        theta = [P.theta.detach().clone().requires_grad_(True)]
        return flat(method(params, theta, K=K, fp_map=fp_map, outer_loss=outer, set_grad=False))

    return run


def unrolled(P, T: int, lr: float, params0: dict):
    hg = _load()
    inner, outer = _losses(P, list(params0))
    fp_map = hg.GradientDescent(inner, step_size=lr)

    def run():
        theta = [P.theta.detach().clone().requires_grad_(True)]
        history = [[w.detach().requires_grad_(True) for w in params0.values()]]
        for _ in range(T):  # its inner loop: the documented differentiable-optimizer step
            history.append([w.detach().requires_grad_(True) for w in fp_map(history[-1], theta)])
        return flat(hg.reverse(history, theta, [fp_map] * T, outer, set_grad=False))

    return run
