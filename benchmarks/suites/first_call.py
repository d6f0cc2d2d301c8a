"""The first call of ``hg.compile_implicit_grad`` (docs/performance.md, "First call"): in fresh
processes, the import time, the first call's time and the steady time per call, with inductor's
on-disk cache cold (a new ``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR``) and warm (the
same folder again, in a new process), against the eager ``hg.implicit_grad`` with the same
solver; and the break-even number of calls
``(first compiled call - first eager call) / (eager per call - compiled per call)``.

Paths (``paths``), each in its own process per repetition:

* ``eager``: ``hg.implicit_grad`` (no compilation), the reference;
* ``compiled``: ``hg.compile_implicit_grad`` as shipped (CG and Neumann on the dense Hessian in
  one graph with a compiled loop, kept by inductor's caches; ``cpp_wrapper``);
* ``compiled_hvp``: the former graphs (``DENSE_MAX = 0``: Hessian-vector products in chunks of
  16 unrolled iterations; inductor's default options: no ``cpp_wrapper``), for the before/after
  comparison;
* ``auto``: ``compile="auto"`` (eager until the calls have taken ``compile_after`` seconds).

Each compiled path runs cold (a new cache folder) then warm (the same folder, a new process);
``caches`` may add ``used``: a new folder where another process first compiled one small
unrelated function (inductor's once-per-folder checks of the CPU's vector instructions done: the
first call of a new problem on a machine that has compiled before). ``fresh_tmpdir`` also gives
the cold process a new ``TMPDIR``, where inductor keeps its precompiled header
(``$TMPDIR/torchinductor_$USER/precompiled_headers``, outside the cache folder), so that it is
rebuilt too. Times are wall seconds on one pinned core (the process's first allowed CPU), with
the process's CPU time (its own and its compiler subprocesses') beside them, since the wall time
on a shared machine includes waiting for the core.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OPTIONS = dict(
    problem="ridge_breast_cancer",
    solvers=["cg", "neumann", "exact"],
    K=20,
    paths=["eager", "compiled", "compiled_hvp", "auto"],
    reps=3,
    calls=200,
    caches=["cold", "warm"],
    fresh_tmpdir=False,
    timeout_s=3600,
)
OPTIONS.update(sizes=[], size_reps=60)  # sizes: the dense-vs-HVP per-call comparison instead
QUICK = dict(solvers=["exact"], paths=["eager", "compiled"], reps=1, calls=20)
#: the variant of a full run: compiled CG per call on the dense Hessian against Hessian-vector
#: products, on ridge problems of n unknowns (what DENSE_MAX is set from)
RUNS = [("", {}), ("_dense_max", {"sizes": [30, 128, 256, 512]})]
#: the compile_times() entries kept (wall seconds, summed over the graphs)
PHASES = {
    "dynamo": "_compile.compile_inner",
    "aot_autograd": "create_aot_dispatcher_function",
    "inductor": "compile_fx_inner",
    "lowering": "GraphLowering.run",
    "codegen": "GraphLowering.codegen",
    "cpp_compile": "compile_file",
    "load": "PyCodeCache.load_by_key_path",
}


def _solver(name: str, K: int, alpha: float):  # type: ignore[no-untyped-def]
    import hypergrad as hg

    if name == "cg":
        return hg.CG(maxiter=K, tol=1e-10)
    if name == "neumann":
        return hg.Neumann(maxiter=K, alpha=alpha)
    return hg.Exact()


def child(spec: dict) -> dict:
    """One fresh process: import, build the problem, time the first and the steady calls."""
    import resource

    t0 = time.perf_counter()
    import torch

    import hypergrad as hg
    from hypergrad import compiled

    import_s = time.perf_counter() - t0  # torch and hypergrad (this module imports neither)
    from benchmarks import kit, problems

    kit.set_threads(1)

    P = problems.get(spec["problem"])
    solver = _solver(spec["solver"], spec["K"], P.alpha)
    path = spec["path"]
    c0, t0 = time.process_time(), time.perf_counter()  # the first call includes the set-up
    if path == "eager":
        f = lambda: hg.implicit_grad(P.inner, P.outer, P.params, P.theta, solver=solver)  # noqa: E731
    else:
        if path == "compiled_hvp":
            compiled.DENSE_MAX = 0
        former = {"cpp_wrapper": False, "unsafe_marked_cacheable_functions": {}}  # inductor's
        opts = former if path == "compiled_hvp" else None
        mode = "auto" if path == "auto" else True
        fc = hg.compile_implicit_grad(P.inner, P.outer, solver=solver, compile=mode, options=opts)
        f = lambda: fc(P.params, P.theta)  # noqa: E731
    g, info = f()
    first_s, first_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    times, cpu = [], []
    for _ in range(spec["calls"]):
        c0, t0 = time.process_time(), time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    g_eager, _ = hg.implicit_grad(P.inner, P.outer, P.params, P.theta, solver=solver)
    ref = torch.as_tensor(P.reference)
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    out = dict(import_s=import_s, first_s=first_s, first_cpu_s=first_cpu_s)
    out.update(
        compiler_cpu_s=children.ru_utime + children.ru_stime, per_call_s=statistics.median(times)
    )
    out["per_call_cpu_s"] = statistics.median(cpu)
    out.update(rel_to_eager=rel(g, g_eager), rel_to_reference=rel(g.reshape(-1), ref.reshape(-1)))
    out.update(iterations=info.solve.iterations, compiled=info.solve.extras.get("compiled"))
    if path != "eager":
        from torch._dynamo.utils import compile_times, counters

        rows = compile_times(repr="str", aggregate=True).splitlines()[1:]
        ct = dict(r.rsplit(", ", 1) for r in rows if ", " in r)
        out["phases_s"] = {k: float(ct[v]) for k, v in PHASES.items() if v in ct}
        keep = ("stats", "aot_autograd", "inductor")
        out["counters"] = {k: dict(v) for k, v in counters.items() if k in keep}
        out["options"] = getattr(fc, "options", None)
    return out


def sizes_child(spec: dict) -> dict:
    """One process: a ridge problem with ``n`` unknowns and ``max(2n, 300)`` rows per size; CG
    (K = 20) compiled on the dense Hessian and on Hessian-vector products (``DENSE_MAX`` set per
    call) and eager, the CPU time per call interleaved (median of ``size_reps``)."""
    import torch

    import hypergrad as hg
    from benchmarks import kit
    from hypergrad import compiled

    kit.set_threads(1)
    f64, out = torch.float64, []
    for n in map(int, spec["sizes"]):  # --set gives text
        g, m = torch.Generator().manual_seed(0), max(2 * n, 300)
        X, y, Xv, yv = (torch.randn(*s, generator=g, dtype=f64) for s in [(m, n), (m,)] * 2)
        lam = torch.full((n,), -2.0, dtype=f64)
        inner = lambda w, lam: 0.5 * ((X @ w - y) ** 2).mean() + 0.5 * (lam.exp() * w**2).sum()  # noqa: E731,B023
        outer = lambda w, lam: 0.5 * ((Xv @ w - yv) ** 2).mean()  # noqa: E731,B023
        w = torch.linalg.solve(X.T @ X / m + torch.diag(lam.exp()), X.T @ y / m)
        solver = hg.CG(maxiter=spec["K"], tol=1e-10)
        fs = {k: hg.compile_implicit_grad(inner, outer, solver=solver) for k in ("dense", "hvp")}

        def call(k):  # noqa: ANN001,ANN202
            if k == "eager":
                return hg.implicit_grad(inner, outer, w, lam, solver=solver)  # noqa: B023
            compiled.DENSE_MAX = 10**9 if k == "dense" else 0
            return fs[k](w, lam)  # noqa: B023

        row = dict(n=n, rows=m)
        for k in fs:
            t0 = time.perf_counter()
            call(k)
            row[f"{k}_first_s"] = time.perf_counter() - t0
        keys, cpu = ["dense", "hvp", "eager"], {"dense": [], "hvp": [], "eager": []}
        for r in range(spec["size_reps"]):
            for k in keys if r % 2 else keys[::-1]:
                c0 = time.process_time()
                call(k)
                cpu[k].append(time.process_time() - c0)
        row.update({f"{k}_cpu_s": statistics.median(v) for k, v in cpu.items()})
        row["dense_over_hvp"] = row["dense_cpu_s"] / row["hvp_cpu_s"]
        ge = call("eager")[0]
        for k in fs:
            row[f"{k}_rel_to_eager"] = float((call(k)[0] - ge).norm() / ge.norm())
        out.append(row)
    return {"sizes": out}


def run_child(spec: dict, env: dict, timeout_s: int) -> dict:
    from benchmarks import kit

    cmd = [sys.executable, "-m", "benchmarks.suites.first_call", json.dumps(spec)]
    try:
        p = subprocess.run(
            cmd, cwd=kit.ROOT, env=env, capture_output=True, text=True, timeout=timeout_s
        )
        return json.loads(p.stdout.strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s} s"}
    except (IndexError, json.JSONDecodeError):
        return {"error": ((p.stderr or p.stdout).strip().splitlines()[-1:] or ["?"])[0][:300]}


def _median(runs: list[dict], key: str) -> float | None:
    xs = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(xs) if xs else None


def summarise(records: list[dict]) -> list[dict]:
    """Medians per (solver, path, cache) and the break-even against eager."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        if "error" not in r:
            groups.setdefault((r["solver"], r["path"], r["cache"]), []).append(r)
    rows = []
    for (solver, path, cache), runs in groups.items():
        row = dict(solver=solver, path=path, cache=cache, n=len(runs))
        for k in ("import_s", "first_s", "first_cpu_s", "compiler_cpu_s", "per_call_s"):
            row[k] = _median(runs, k)
        row["per_call_cpu_s"] = _median(runs, "per_call_cpu_s")
        row["rel_to_eager"] = max(r["rel_to_eager"] for r in runs)
        rows.append(row)
    for row in rows:
        eager = next(
            (e for e in rows if e["solver"] == row["solver"] and e["path"] == "eager"), None
        )
        row["break_even_calls"] = row["break_even_calls_cpu"] = None
        if eager is None or row["path"] in ("eager", "auto"):
            continue  # auto: its measured calls are eager ones (compile_after not reached)
        saved = eager["per_call_s"] - row["per_call_s"]
        extra = row["first_s"] - eager["first_s"]
        row["break_even_calls"] = extra / saved if saved > 0 else float("inf")
        saved = eager["per_call_cpu_s"] - row["per_call_cpu_s"]
        cost = lambda r: r["first_cpu_s"] + r["compiler_cpu_s"]  # noqa: E731
        extra = cost(row) - cost(eager)
        row["break_even_calls_cpu"] = extra / saved if saved > 0 else float("inf")
    return rows


def measure(o: dict, out: Path, name: str) -> None:
    from benchmarks import kit

    if o["sizes"]:  # the dense-vs-HVP comparison, in one fresh process (inductor's cache as it is)
        spec = dict(sizes=o["sizes"], size_reps=o["size_reps"], K=o["K"], child="sizes")
        r = run_child(spec, dict(os.environ, PYTHONPATH=str(kit.ROOT)), o["timeout_s"])
        for row in r.get("sizes", []):
            kit.log(f"n = {row['n']}: dense / HVP per call {row['dense_over_hvp']:.2f}")
        kit.save(out / f"{name}.json", dict(options=dict(o), **r))
        return
    records = []
    for solver in o["solvers"]:
        for rep in range(o["reps"]):
            for path in o["paths"]:
                spec = dict(problem=o["problem"], solver=solver, K=o["K"], path=path)
                spec["calls"] = o["calls"]
                base = dict(os.environ, PYTHONPATH=str(kit.ROOT))
                caches = ["none"] if path == "eager" else o["caches"]
                if path == "auto":
                    caches = [c for c in caches if c != "used"]
                root = Path(tempfile.mkdtemp(prefix="first_call_"))
                roots = [root]
                env = dict(base, TORCHINDUCTOR_CACHE_DIR=str(root / "inductor"))
                env["TRITON_CACHE_DIR"] = str(root / "triton")
                if o["fresh_tmpdir"]:
                    (root / "tmp").mkdir()
                    env["TMPDIR"] = str(root / "tmp")
                for cache in caches:
                    if cache == "used":  # a new folder where another program compiled before
                        root = Path(tempfile.mkdtemp(prefix="first_call_"))
                        roots.append(root)
                        env = dict(env, TORCHINDUCTOR_CACHE_DIR=str(root / "inductor"))
                        env["TRITON_CACHE_DIR"] = str(root / "triton")
                        run_child(dict(child="primer"), env, o["timeout_s"])
                    r = run_child(spec, env if path != "eager" else base, o["timeout_s"])
                    r.update(solver=solver, path=path, cache=cache, rep=rep)
                    records.append(r)
                    first = r.get("first_s")
                    kit.log(
                        f"{solver} {path} {cache} rep {rep}: first "
                        + (f"{first:.2f} s" if first is not None else r.get("error", "?"))
                        + (
                            f", per call {r['per_call_s'] * 1e3:.3f} ms"
                            if "per_call_s" in r
                            else ""
                        )
                    )
                for folder in set(roots):  # the caches measured, not kept
                    shutil.rmtree(folder, ignore_errors=True)
    res = dict(options={k: v for k, v in o.items()}, records=records, summary=summarise(records))
    kit.save(out / f"{name}.json", res)


def primer_child() -> dict:
    """Compile one small unrelated function (a cache folder another program has used: inductor's
    per-folder checks of the CPU's vector instructions are done)."""
    import torch

    t0 = time.perf_counter()
    torch.compile(lambda x: (x * 2 + 1).sin().sum())(torch.ones(8, dtype=torch.float64))
    return {"primer_s": time.perf_counter() - t0}


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    kind = {"sizes": sizes_child, "primer": lambda s: primer_child()}.get(spec.get("child"), child)
    print(json.dumps(kind(spec)))


PATHS = {
    "eager": "`hg.implicit_grad` (eager)",
    "compiled": "compiled (dense, one graph)",
    "compiled_hvp": "compiled, former graphs (HVP chunks)",
    "auto": '`compile="auto"` (eager until `compile_after`)',
}


def report(d: dict, path: Path) -> str:
    """The summary as a markdown table (no plot): per solver and path, the medians; or the
    dense-vs-HVP table of the ``sizes`` variant."""
    from benchmarks.report import num, table

    if "sizes" in d:
        head = ["n", "rows", "dense (ms)", "HVP chunks (ms)", "eager (ms)", "dense / HVP",
                "first call dense (s)", "first call HVP (s)"]  # fmt: skip
        rows = [
            [r["n"], r["rows"], *(num(r[f"{k}_cpu_s"] * 1e3, ".2f") for k in ("dense", "hvp")),
             num(r["eager_cpu_s"] * 1e3, ".2f"), num(r["dense_over_hvp"], ".2f"),
             num(r["dense_first_s"], ".1f"), num(r["hvp_first_s"], ".1f")]
            for r in d["sizes"]
        ]  # fmt: skip
        note = (
            f"Compiled CG, K = {d['options']['K']}, per call CPU time (median of "
            f"{d['options']['size_reps']} interleaved calls); first calls in one process, "
            "inductor's cache as it was."
        )
        return table(head, rows, "r" * len(head)) + "\n\n" + note

    rows = []
    order = {p: i for i, p in enumerate(PATHS)}
    summary = sorted(d["summary"], key=lambda r: (r["solver"], order.get(r["path"], 9), r["cache"]))
    for r in summary:
        cpu = (r["first_cpu_s"] or 0) + (r["compiler_cpu_s"] or 0)
        be = r["break_even_calls"]
        be_cpu = r["break_even_calls_cpu"]
        rows.append([
            r["solver"], PATHS.get(r["path"], r["path"]), r["cache"], r["n"],
            num(r["import_s"], ".1f"), num(r["first_s"], ".2f"), num(cpu, ".2f"),
            num(r["per_call_s"] * 1e3, ".3f"), num(r["per_call_cpu_s"] * 1e3, ".3f"),
            "–" if be is None else ("never" if be == float("inf") else f"{be:,.0f}"),
            "–" if be_cpu is None else ("never" if be_cpu == float("inf") else f"{be_cpu:,.0f}"),
            f"{r['rel_to_eager']:.1e}",
        ])  # fmt: skip
    head = ["solver", "path", "cache", "runs", "import (s)", "first call (s)",
            "first call CPU (s)", "per call (ms)", "per call CPU (ms)", "break-even (calls)",
            "break-even, CPU (calls)", "rel. diff. to eager"]  # fmt: skip
    o = d["options"]
    note = (
        f"{o['problem']}, K = {o['K']} (CG, Neumann), medians of {o['reps']} fresh processes per "
        f"row; per call: median of {o['calls']} calls after the first; CPU: the process's own "
        "and its compiler subprocesses'; cold: a new inductor cache folder, warm: the same again, "
        "used: a new folder in which another process compiled one small function first; "
        "break-even: (first call - eager first call) / (eager per call - per call), against "
        "the eager row of the same file."
    )
    return table(head, rows, "lllrrrrrrrrr") + "\n\n" + note
