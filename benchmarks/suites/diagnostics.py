"""Diagnostics behind docs/benchmarks.md's reading of the peer results, into ``peers/``: profiles
(spec ``problem/K/calls/lib:solver/...``), ``dot_precision.txt`` (other ``tree_vdot`` variants
monkeypatched into CG), ``gemm.txt`` (torch vs XLA) and ``memory_breakdown.txt``."""

from __future__ import annotations

import cProfile
import io
import pstats
import re

import torch

import hypergrad as hg
import hypergrad.solvers.cg as cg_module
from benchmarks import kit
from benchmarks.peers.hypergrad import make_solver
from benchmarks.suites.peers import make, problem

OPTIONS = dict(
    profiles=[
        "ridge_breast_cancer/20/50/hypergrad:cg/hypergrad:cg+compile/hypergrad:exact/"
        "hypergrad:exact+compile/torchopt:cg/jaxopt:cg/betty:neumann",
        "mlp_fashion/20/5/hypergrad:cg/torchopt:cg/jaxopt:cg",
        "unrolled_mlp/50/5/hypergrad:unrolled/torchopt:unrolled/higher:unrolled",
    ]
)
OPTIONS.update(dot_precision=True, memory_breakdown=True, gemm=True)
QUICK = dict(profiles=["ridge_breast_cancer/20/5/hypergrad:cg/torchopt:cg"])
STAGES = ["graph", "graph+5hvp", "cg5", "cg20", "neumann20"]


def profile_md(spec: str, quick: bool) -> str:
    key, K, calls, *confs = spec.split("/")
    K, calls, confs = int(K), int(calls), [tuple(c.split(":")) for c in confs]
    fns = {c: make(key, c[0], c[1], K, quick)[0] for c in confs}
    cpu = kit.timeit(fns, calls)
    P = problem(key, quick, K if key == "unrolled_mlp" else 0)[0]
    out = [
        f"# Profile: {key}, {'T' if key == 'unrolled_mlp' else 'K'} = {K}\n",
        f"{P.title}; {torch.get_num_threads()} thread(s); median CPU time over {calls} calls.\n",
    ]
    cpu_ms = {c: kit.median(t["cpu_s"]) * 1e3 for c, t in cpu.items()}
    out += [f"* {lib} {s}: {cpu_ms[(lib, s)]:.1f} ms CPU" for lib, s in confs]
    for (lib, s), fn in fns.items():
        if lib in ("jaxopt", "optimistix"):
            continue
        prof = cProfile.Profile()
        for _ in range(calls):
            prof.runcall(fn)
        st, buf = pstats.Stats(prof), io.StringIO()
        engine = sum(v[2] for k, v in st.stats.items() if "run_backward" in str(k))
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(12)
        top = "\n".join(buf.getvalue().strip().splitlines()[-18:])
        out += [
            f"\n## {lib} {s}: cProfile\n",
            f"total {st.total_tt / calls * 1e3:.1f} ms per call; inside autograd's backward "
            f"engine (products and gradients) {engine / st.total_tt:.0%}\n",
            f"```\n{top}\n```\n",
        ]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tp:
            fn()
        table = tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
        out += [
            f"## {lib} {s}: torch profiler (one call, top operators by self CPU)\n",
            f"```\n{table}\n```\n",
        ]
    return "\n".join(out)


def dot_precision(quick: bool) -> str:
    P, shipped, f = problem("mlp_fashion", quick)[0], cg_module.tree_vdot, lambda a: a.reshape(-1)
    variants = {
        "shipped tree_vdot": shipped,
        "sum(a * b) (pairwise)": lambda x, y: sum(torch.sum(a * b) for a, b in zip(x, y)),
        "float64 accumulation": lambda x, y: sum(
            torch.dot(f(a).double(), f(b).double()) for a, b in zip(x, y)
        ).to(x[0].dtype),
        "torch.dot (b123af6)": lambda x, y: sum(torch.dot(f(a), f(b)) for a, b in zip(x, y)),
    }
    lines, err = [], lambda K: P.rel_error(make("mlp_fashion", "hypergrad", "cg", K, quick)[0]())
    try:
        for name, fn in variants.items():
            cg_module.tree_vdot = fn
            errs = [err(20), err(50)]
            lines.append(f"{name:24s} K=20: {errs[0]:.3e}   K=50: {errs[1]:.3e}")
    finally:
        cg_module.tree_vdot = shipped
    return "\n".join(lines) + "\n"


def stage(what: str, quick: bool):
    """The measured call of one memory stage (for ``kit.probe``)."""
    P = problem("mlp_fashion", quick)[0]
    names = list(P.params)
    if what.startswith("graph"):

        def run():
            ps = tuple(p.detach().requires_grad_(True) for p in P.params.values())
            th = (P.theta.detach().requires_grad_(True),)
            op = hg.InnerOperator(lambda p, h: P.inner(dict(zip(names, p)), h[0]), ps, th)
            v = tuple(torch.ones_like(p) for p in ps)
            for _ in range(5 if what == "graph+5hvp" else 0):
                v = op.hvp(v)
            return op

        return run
    kind, K = re.fullmatch(r"([a-z]+)(\d+)", what).groups()
    s = make_solver(kind, int(K), alpha=P.alpha)
    return lambda: hg.implicit_grad(P.inner, P.outer, P.params, P.theta, solver=s)


def gemm_row(mm, m: int, k: int, n: int) -> str:
    """One ``(m x k) @ (k x n)`` float32 product in torch and in ``mm`` (``jax.jit``-ed)."""
    import jax

    a, b = torch.randn(m, k), torch.randn(k, n)
    ja, jb = jax.numpy.asarray(a.numpy()), jax.numpy.asarray(b.numpy())
    mm(ja, jb).block_until_ready()
    t = kit.timeit({"torch": lambda: a @ b, "jax": lambda: mm(ja, jb).block_until_ready()}, 20)
    tt, tj = (kit.median(t[x]["times_s"]) for x in ("torch", "jax"))
    gf = 2 * m * k * n / 1e9
    return (
        f"{m}x{k} @ {k}x{n}: torch {tt * 1e3:.2f} ms ({gf / tt:.0f} GFLOP/s), "
        f"XLA {tj * 1e3:.2f} ms ({gf / tj:.0f} GFLOP/s), torch / XLA {tt / tj:.2f}"
    )


def gemm(quick: bool) -> str:  # the same products in quick mode
    try:
        import jax
    except ImportError:  # the [bench] extra is not installed: nothing to compare against
        return "unsupported: jax is not installed (pip install -e '.[bench]')\n"

    mm = jax.jit(jax.numpy.matmul)
    shapes = [(256, 784, 1024), (256, 1024, 256), (784, 256, 1024)]
    return "\n".join(gemm_row(mm, *s) for s in shapes) + "\n"


def memory_breakdown(quick: bool) -> str:
    P, target = problem("mlp_fashion", quick)[0], "benchmarks.suites.diagnostics:stage"
    res = [kit.probe(target, [dict(what=w, quick=quick)], 3)[0] for w in STAGES]
    vec = P.numel * 4 / 2**20  # MiB of one parameter-sized float32 vector
    lines = [
        f"{w:12s} peak RSS growth {r['peak_mib'] or float('nan'):6.1f} MiB "
        f"(= {(r['peak_mib'] or float('nan')) / vec:.1f} parameter-sized float32 vectors)"
        for w, r in zip(STAGES, res)
    ]
    return "\n".join(lines) + "\n"


def measure(o: dict, out, name: str) -> None:
    (out / "peers").mkdir(parents=True, exist_ok=True)
    for spec in o["profiles"]:
        key, K = spec.split("/")[:2]
        (out / "peers" / f"profile_{key}_K{K}.md").write_text(profile_md(spec, o["quick"]))
        kit.log(f"profile {spec} written")
    texts = dict(gemm=gemm, dot_precision=dot_precision, memory_breakdown=memory_breakdown)
    for key, text in texts.items():
        if o[key]:
            (out / "peers" / f"{key}.txt").write_text(text(o["quick"]))
