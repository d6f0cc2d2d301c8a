"""Two diagnostics behind the "hypergrad weaknesses" of docs/benchmarks.md (MLP problem).

python benchmarks/peers/diagnostics.py dot-precision
    float32 CG error at K = 20, 50 with hypergrad's tree_vdot as shipped (pairwise sums over
    256k-element chunks added in float64, since commit 7016e49) vs one pairwise sum of the
    full elementwise product vs float64 accumulation vs one BLAS dot per leaf (torch.dot,
    float32 accumulation: what commit b123af6 shipped) — monkeypatched here, hypergrad itself
    is not modified.

python benchmarks/peers/diagnostics.py memory-breakdown
    peak RSS growth (fresh process per stage, same method as run_all.py) of: building the
    inner gradient graph only; graph + 5 Hessian-vector products; full implicit_grad with
    CG K = 5 and K = 20; Neumann K = 20.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
for p in (str(HERE), str(HERE.parents[1])):
    if p not in sys.path:
        sys.path.insert(0, p)


def dot_precision() -> None:
    import torch

    torch.set_num_threads(1)
    import adapters as ad
    import problems as pr

    import hypergrad.solvers.cg as cg_module
    import hypergrad.tree as tree

    P = pr.get("mlp_fashion")
    shipped = cg_module.tree_vdot

    def pairwise(x, y):
        return sum(torch.sum(a * b) for a, b in zip(x, y))

    def blas(x, y):
        return sum(torch.dot(a.reshape(-1), b.reshape(-1)) for a, b in zip(x, y))

    def f64(x, y):
        return sum(
            torch.dot(a.reshape(-1).double(), b.reshape(-1).double()) for a, b in zip(x, y)
        ).to(x[0].dtype)

    print(f"hypergrad tree_vdot source: {tree.__file__}")
    for name, fn in [
        ("shipped tree_vdot", shipped),
        ("sum(a * b) (pairwise)", pairwise),
        ("float64 accumulation", f64),
        ("torch.dot (b123af6)", blas),
    ]:
        cg_module.tree_vdot = fn
        errs = [P.rel_error(ad.make("hypergrad", "cg", P, K)()) for K in (20, 50)]
        print(f"{name:24s} K=20: {errs[0]:.3e}   K=50: {errs[1]:.3e}")
    cg_module.tree_vdot = shipped


def _kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def stage(what: str) -> None:
    import torch

    torch.set_num_threads(1)
    import problems as pr

    import hypergrad as hg
    from hypergrad.operators import InnerOperator

    P = pr.get("mlp_fashion")
    names = list(P.params)

    def run():
        if what in ("graph", "graph+5hvp"):
            ps = tuple(P.params[n].detach().requires_grad_(True) for n in names)
            th = (P.theta.detach().requires_grad_(True),)
            op = InnerOperator(lambda p, h: P.inner(dict(zip(names, p)), h[0]), ps, th)
            if what == "graph+5hvp":
                v = tuple(torch.ones_like(p) for p in ps)
                for _ in range(5):
                    v = op.hvp(v)
            return op
        solver = {
            "cg5": hg.CG(maxiter=5, tol=1e-10),
            "cg20": hg.CG(maxiter=20, tol=1e-10),
            "neumann20": hg.Neumann(steps=20, alpha=P.alpha),
        }[what]
        return hg.implicit_grad(P.inner, P.outer, P.params, P.theta, solver=solver)

    run()
    peaks = []
    for _ in range(3):
        gc.collect()
        base = _kb("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        out = run()
        peaks.append((_kb("VmHWM") - base) / 1024)
        del out
    print(
        f"{what:12s} peak RSS growth {max(peaks):6.1f} MiB "
        f"(= {max(peaks) / (P.numel * 4 / 2**20):.1f} parameter-sized float32 vectors)"
    )


def memory_breakdown() -> None:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    for what in ["graph", "graph+5hvp", "cg5", "cg20", "neumann20"]:
        out = subprocess.run(
            [sys.executable, __file__, "_stage", what],
            env=env,
            text=True,
            capture_output=True,
            check=False,
        )
        print((out.stdout or out.stderr).strip().splitlines()[-1])


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    cmd = sys.argv[1] if len(sys.argv) > 1 else "dot-precision"
    if cmd == "dot-precision":
        dot_precision()
    elif cmd == "memory-breakdown":
        memory_breakdown()
    elif cmd == "_stage":
        stage(sys.argv[2])
    else:
        raise SystemExit(__doc__)
