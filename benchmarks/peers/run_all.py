"""Side-by-side benchmark of hypergrad against torchopt, betty, higher and jaxopt.

Regenerates every table and plot of docs/benchmarks.md ("Peer libraries"):

    pip install -e ".[bench]"
    python benchmarks/peers/run_all.py            # full grid (hours on a 2-core CPU)
    python benchmarks/peers/run_all.py --quick    # K in {5, 20}, 3 repetitions, T in {10, 50}

Outputs go to ``benchmarks/results/peers/``: ``<problem>.json`` (every record), ``<problem>.png``
(error-vs-time Pareto plot), ``peers.md`` (all tables) and ``peers.json`` (machine, versions,
settings, summary). The block between the ``peers:begin``/``peers:end`` markers of
``docs/benchmarks.md`` is replaced by ``peers.md``.

Method
------
* Time: every configuration (library x solver x K) of a problem is built once (engines, decorated
  solvers, ``jax.jit``), called once as a warm-up, then timed ``--reps`` times; the repetitions
  are interleaved (rep 1 of every configuration, then rep 2, ... in alternating order) because the
  machine is shared. Reported: the median wall time. ``torch.manual_seed(0)`` precedes every call.
* Memory: each configuration runs in a fresh subprocess (``MALLOC_MMAP_THRESHOLD_=65536`` so every
  tensor buffer is its own mmap and is returned to the OS when freed). After building the problem
  and the configuration and one warm-up call, the worker records ``VmRSS`` as the baseline, resets
  the kernel's peak counter (``echo 5 > /proc/self/clear_refs``), makes one call, and reports
  ``VmHWM - baseline`` (MiB): the extra resident memory of one hypergradient.
* Accuracy: ``||g - g_ref|| / ||g_ref||`` against the problem's float64 reference (see
  ``problems.py``); every configuration is deterministic, so the warm-up call's output is used.
* Threads: ``--threads`` (default 1) for torch and XLA alike.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
OUT = ROOT / "benchmarks" / "results" / "peers"
DOC = ROOT / "docs" / "benchmarks.md"
for p in (str(HERE), str(ROOT)):
    if p not in sys.path:
        sys.path.insert(0, p)
if str(ROOT / "benchmarks") not in sys.path:  # after HERE: benchmarks/common.py
    sys.path.append(str(ROOT / "benchmarks"))

from common import proc_status_kb  # noqa: E402

IMPLICIT_PROBLEMS = [
    "ridge_breast_cancer",
    "ridge_diabetes",
    "logreg_breast_cancer",
    "mlp_fashion",
    "cnn_digit5",
]
UNROLLED_KEY = "unrolled_mlp"
UNROLLED_LR = 0.1
UNROLLED_K = 20
BEGIN, END = "<!-- peers:begin -->", "<!-- peers:end -->"


def set_threads(n: int) -> None:
    if n == 1:
        os.environ.setdefault(
            "XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
        )
    import torch

    torch.set_num_threads(n)


# ------------------------------------------------------------------------------ building configs


def unrolled_setup(T: int):
    """The unrolled problem: the MLP problem's data and decays, T SGD steps from a fixed init."""
    import problems as pr
    import torch

    P = pr.get("mlp_fashion")
    P.prox, P.prox_center = 0.0, None  # plain training loss: no proximal term when unrolling
    torch.manual_seed(1)
    m = pr.make_mlp()
    params0 = {n: p.detach().to(P.dtype) for n, p in m.named_parameters()}
    ref = unrolled_reference(P, params0, T)
    P.reference = ref
    P.reference_note = "plain torch.autograd loop through the T SGD steps in float64"
    return P, params0


def unrolled_reference(P, params0, T: int):
    """Float64 derivative through T SGD steps by a plain autograd loop (cached)."""
    import numpy as np
    import problems as pr
    import torch

    def build():
        Q = P.to(torch.float64)
        names = list(params0)
        theta = Q.theta.detach().clone().requires_grad_(True)
        ps = [params0[n].double().requires_grad_(True) for n in names]
        for _ in range(T):
            gs = torch.autograd.grad(Q.inner(dict(zip(names, ps)), theta), ps, create_graph=True)
            ps = [p - UNROLLED_LR * g for p, g in zip(ps, gs)]
        (g,) = torch.autograd.grad(Q.outer(dict(zip(names, ps)), theta), theta)
        return {"g": g.detach().numpy().ravel()}

    return np.asarray(pr._cached(f"unrolled_ref_T{T}_lr{UNROLLED_LR}", build)["g"])


def build_config(problem: str, lib: str, solver: str, K: int, cache: dict):
    """(callable, Problem) for one configuration; raises adapters.Unsupported or any error."""
    import adapters as ad
    import problems as pr

    if problem == UNROLLED_KEY:
        T = K
        if ("P", T) not in cache:
            cache[("P", T)] = unrolled_setup(T)
        P, params0 = cache[("P", T)]
        return ad.unrolled(lib, solver, P, T, UNROLLED_LR, UNROLLED_K, params0), P
    if "P" not in cache:
        cache["P"] = pr.get(problem)
    P = cache["P"]
    return ad.make(lib, solver, P, K), P


def grid(problem: str, ks: list[int], ts: list[int]) -> list[tuple[str, str, int]]:
    import adapters as ad

    if problem == UNROLLED_KEY:
        return [(lib, s, T) for T in ts for lib, s in ad.UNROLLED]
    return [(lib, s, K) for K in ks for lib, s in ad.IMPLICIT + ad.EXTRA.get(problem, [])]


def _err_text(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    first = msg[0] if msg else ""
    return f"{type(e).__name__}: {first[:400]}"


# ------------------------------------------------------------------------------ memory worker


def memory_worker(problem: str, lib: str, solver: str, ks: list[int], calls: int = 3) -> dict:
    """Peak RSS growth of one call per K, in this (fresh) process, K after K (max of ``calls``)."""
    import resource

    import torch

    warnings.filterwarnings("ignore")
    cache: dict = {}
    out = {}
    for i, K in enumerate(ks):
        try:
            fn, _ = build_config(problem, lib, solver, K, cache)
            if problem != UNROLLED_KEY or i == 0:
                torch.manual_seed(0)
                fn()  # warm-up: jit compilation, kernels, thread pools, lazy imports
            peaks = []
            for _ in range(calls):
                gc.collect()
                base = proc_status_kb("VmRSS")
                base_maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                try:
                    with open("/proc/self/clear_refs", "w") as f:
                        f.write("5")
                    how = "VmHWM after clear_refs reset minus VmRSS baseline"
                except OSError:
                    how = "ru_maxrss minus baseline (clear_refs unavailable)"
                torch.manual_seed(0)
                t0 = time.perf_counter()
                fn()
                dt = time.perf_counter() - t0
                hwm = proc_status_kb("VmHWM")
                if how.startswith("VmHWM") and hwm is not None and base is not None:
                    peaks.append((hwm - base) / 1024)
                else:
                    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                    peaks.append((rss - base_maxrss) / 1024)
            # the kernel occasionally under-counts one call (reclaim under memory pressure from
            # other jobs); the largest of the repeated measurements is reported
            peak = max(peaks)
            out[str(K)] = {
                "peak_mib": peak,
                "peak_mib_calls": peaks,
                "baseline_mib": (base or 0) / 1024,
                "how": how,
                "time_s": dt,
            }
            del fn
            gc.collect()
        except Exception as e:  # noqa: BLE001
            out[str(K)] = {"peak_mib": None, "memory_error": _err_text(e)}
    return out


def run_memory(
    problem: str, lib: str, solver: str, ks: list[int], threads: int, timeout: float
) -> dict:
    env = dict(os.environ)
    env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--threads",
        str(threads),
        "--memory-worker",
        problem,
        lib,
        solver,
        ",".join(map(str, ks)),
    ]
    try:
        out = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return {
            str(k): {"peak_mib": None, "memory_error": f"timed out after {timeout:.0f}s"}
            for k in ks
        }
    lines = [ln for ln in out.stdout.strip().splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        tail = (out.stderr or out.stdout).strip().splitlines()[-1:] or ["?"]
        return {str(k): {"peak_mib": None, "memory_error": tail[0][:300]} for k in ks}
    return json.loads(lines[-1])


# ------------------------------------------------------------------------------ timing


LEAKY_REPS = 3


def _time_interleaved(problem: str, keys: list, fns: dict, by_key: dict, reps: int, args) -> None:
    """Timed repetitions of ``keys``, interleaved in alternating order; appends to by_key."""
    import torch

    want = {k: reps for k in keys}
    r = 0
    while r < max(want.values(), default=0):
        if r == 1:  # the first repetition's time decides how many a configuration gets
            for k in keys:
                t1 = max(min(by_key[k]["times_s"] or [1.0]), 1e-5)
                want[k] = int(min(max(reps, math.ceil(args.min_time / t1)), args.max_reps))
        order = keys if r % 2 == 0 else keys[::-1]
        for k in order:
            if r >= want[k]:
                continue
            torch.manual_seed(0)
            c0, t0 = time.process_time(), time.perf_counter()
            try:
                fns[k]()
            except Exception as e:  # noqa: BLE001
                print(f"  rep {r} {k} failed: {_err_text(e)}")
                continue
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            by_key[k]["times_s"].append(dt)
            by_key[k]["cpu_s"].append(dc)
        if r < reps or r % 5 == 4:
            print(f"  [{problem}] repetition {r + 1} done ({len(keys)} configurations)", flush=True)
        r += 1


def run_problem(problem: str, args) -> dict:
    import adapters as ad
    import numpy as np
    import torch

    warnings.filterwarnings("ignore")
    t_start = time.perf_counter()
    ks, ts = args.ks, args.ts
    cache: dict = {}
    records, fns = [], {}
    P_any = None
    for lib, solver, K in grid(problem, ks, ts):
        rec = {
            "problem": problem,
            "library": lib,
            "solver": solver,
            "K": K,
            "products": UNROLLED_K
            if solver == "implicit_cg"
            else (K if problem == UNROLLED_KEY else ad.nominal_products(lib, solver, K)),
            "status": "ok",
            "error": None,
            "times_s": [],
            "cpu_s": [],
            "median_s": None,
            "median_cpu_s": None,
            "rel_error": None,
            "peak_mib": None,
        }
        if problem == UNROLLED_KEY:
            rec["T"] = K
            rec["K"] = UNROLLED_K if solver == "implicit_cg" else None
        try:
            fn, P = build_config(problem, lib, solver, K, cache)
            P_any = P
            torch.manual_seed(0)
            t0 = time.perf_counter()
            g = fn()
            rec["warmup_s"] = time.perf_counter() - t0
            if problem == UNROLLED_KEY and solver == "implicit_cg":
                rec["rel_error"] = None  # a different quantity (implicit, not unrolled)
                rec["rel_diff_to_unrolled"] = P.rel_error(g)
            else:
                rec["rel_error"] = P.rel_error(g)
            rec["hypergrad_norm"] = float(np.linalg.norm(g))
            fns[(lib, solver, K)] = fn
        except ad.Unsupported as e:
            rec["status"], rec["error"] = "unsupported", str(e)
        except Exception as e:  # noqa: BLE001 - a peer failing is a result
            rec["status"], rec["error"] = "error", _err_text(e)
            rec["traceback_tail"] = traceback.format_exc().strip().splitlines()[-6:]
        records.append(rec)
        kn = "T" if problem == UNROLLED_KEY else "K"
        print(
            f"  [{problem}] {lib:9s} {solver:11s} {kn}={K:<4d}"
            f" {rec['status']:11s} err={rec['rel_error']} {rec['error'] or ''}"[:240],
            flush=True,
        )
    # interleaved timed repetitions; cheap configurations get more repetitions (up to
    # --max-reps) so that each is timed for at least --min-time seconds in total
    by_key = {
        (x["library"], x["solver"], x["T"] if problem == UNROLLED_KEY else x["K"]): x
        for x in records
    }
    # betty's unrolled IterativeProblem keeps every call's graph alive (~570 MB per call at
    # T = 20, growing linearly; gc.collect() does not free it): timed after the others, so its
    # growing memory cannot slow their calls, and at most LEAKY_REPS times, so the process is
    # not killed for memory (it was, at the 4th repetition, on a 24 GiB machine)
    leaky = [k for k in fns if problem == UNROLLED_KEY and k[0] == "betty"]
    for group, reps in (
        ([k for k in fns if k not in leaky], args.reps),
        (leaky, min(args.reps, LEAKY_REPS)),
    ):
        _time_interleaved(problem, group, fns, by_key, reps, args)
    for rec in records:
        if rec["times_s"]:
            rec["median_s"] = statistics.median(rec["times_s"])
            rec["median_cpu_s"] = statistics.median(rec["cpu_s"])
            rec["reps"] = len(rec["times_s"])
    fns.clear()
    cache.clear()
    gc.collect()
    # memory: one fresh process per (library, solver), measuring each K in turn
    if not args.no_memory:
        groups: dict = {}
        for rec in records:
            if rec["status"] == "ok":
                k = rec["T"] if problem == UNROLLED_KEY else rec["K"]
                groups.setdefault((rec["library"], rec["solver"]), []).append((k, rec))
        for (lib, solver), items in groups.items():
            ks_ = [k for k, _ in items]
            m = run_memory(problem, lib, solver, ks_, args.threads, args.memory_timeout)
            for k, rec in items:
                mk = m.get(str(k), {})
                rec["peak_mib"] = mk.get("peak_mib")
                rec["memory_how"] = mk.get("how")
                if mk.get("memory_error"):
                    rec["memory_error"] = mk["memory_error"]
        print(f"  [{problem}] memory done", flush=True)
    info = {}
    if P_any is not None:
        info = {
            "title": P_any.title,
            "numel": P_any.numel,
            "theta_numel": int(P_any.theta.numel()),
            "dtype": str(P_any.dtype).replace("torch.", ""),
            "alpha": P_any.alpha,
            "reference_note": P_any.reference_note,
            "extras": P_any.extras,
        }
    if problem == UNROLLED_KEY:
        info["title"] = (
            "Unrolled: T SGD steps (lr 0.1) of the Fashion-MNIST MLP from a random "
            "init, reverse mode through all of them"
        )
        info["lr"] = UNROLLED_LR
    return {
        "problem": problem,
        "info": info,
        "records": records,
        "wall_s": time.perf_counter() - t_start,
    }


# ------------------------------------------------------------------------------ output


def machine() -> dict:
    import torch

    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = round(int(f.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "mem_gib": mem,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch_threads": torch.get_num_threads(),
        "loadavg": os.getloadavg(),
        "gpu": None,
    }


def _fmt_t(s):
    if s is None:
        return "–"
    ms = s * 1e3
    return f"{ms:.3g}" if ms < 1000 else f"{ms:,.0f}"


def _fmt_e(e):
    if e is None:
        return "–"
    if isinstance(e, float) and (math.isnan(e) or math.isinf(e)):
        return "**NaN/Inf**"
    return f"{e:.2e}"


def _fmt_m(m):
    return "–" if m is None else f"{m:.1f}"


def equal_error_floor(dtype: str) -> float:
    return 1e-8 if dtype == "float64" else 1e-5


def verdicts(res: dict) -> list[dict]:
    """Per (hypergrad solver, K): time and memory ratio to the fastest / leanest peer whose error is
    equal or better (within 10%, or both below the precision floor)."""
    recs = [r for r in res["records"] if r["status"] == "ok" and r["median_s"] is not None]
    out = []
    floor = equal_error_floor(res["info"].get("dtype", "float32"))
    for h in [r for r in recs if r["library"] == "hypergrad"]:
        if h["rel_error"] is None:
            continue
        bar = max(1.1 * h["rel_error"], floor)
        size = lambda r: r.get("T", r["K"])  # noqa: E731 - K, or T for the unrolled problem
        peers = (
            [
                r
                for r in recs
                if r["library"] != "hypergrad"
                and size(r) == size(h)
                and r["solver"] == h["solver"]
                and r["rel_error"] is not None
                and math.isfinite(r["rel_error"])
                and r["rel_error"] <= bar
            ]
            if "T" in h
            else [
                r
                for r in recs
                if r["library"] != "hypergrad"
                and r["K"] == h["K"]
                and r["rel_error"] is not None
                and math.isfinite(r["rel_error"])
                and r["rel_error"] <= bar
            ]
        )
        v = {
            "solver": h["solver"],
            "K": size(h),
            "hypergrad_s": h["median_s"],
            "hypergrad_err": h["rel_error"],
            "hypergrad_mib": h["peak_mib"],
            "peers": len(peers),
        }
        if peers:
            fastest = min(peers, key=lambda r: r["median_s"])
            v["fastest_peer"] = f"{fastest['library']} {fastest['solver']}"
            v["time_ratio"] = h["median_s"] / fastest["median_s"]
            cpus = [r for r in peers if r.get("median_cpu_s")]
            if cpus and h.get("median_cpu_s"):
                c = min(cpus, key=lambda r: r["median_cpu_s"])
                v["fastest_cpu_peer"] = f"{c['library']} {c['solver']}"
                v["cpu_ratio"] = h["median_cpu_s"] / c["median_cpu_s"]
            tpeers = [r for r in peers if r["library"] != "jaxopt" and r.get("median_cpu_s")]
            if tpeers and h.get("median_cpu_s"):
                c = min(tpeers, key=lambda r: r["median_cpu_s"])
                v["fastest_torch_peer"] = f"{c['library']} {c['solver']}"
                v["torch_cpu_ratio"] = h["median_cpu_s"] / c["median_cpu_s"]
            mems = [r for r in peers if r["peak_mib"] is not None]
            if mems and h["peak_mib"] is not None:
                lean = min(mems, key=lambda r: r["peak_mib"])
                v["leanest_peer"] = f"{lean['library']} {lean['solver']}"
                v["mem_ratio"] = (h["peak_mib"] + 1.0) / (lean["peak_mib"] + 1.0)
        out.append(v)
    return out


def table_md(res: dict) -> str:
    unrolled = res["problem"] == UNROLLED_KEY
    lines = []
    if unrolled:
        lines.append(
            "| T | library | method | median wall (ms) | median CPU (ms) | "
            "peak memory (MiB) | rel. error | status |"
        )
        lines.append("|---:|---|---|---:|---:|---:|---:|---|")
        recs = sorted(
            res["records"], key=lambda r: (r["T"], r["solver"] != "unrolled", r["library"])
        )
    else:
        lines.append(
            "| K | library | solver | products | median wall (ms) | median CPU (ms) | "
            "reps | peak memory (MiB) | rel. error | status |"
        )
        lines.append("|---:|---|---|---:|---:|---:|---:|---:|---:|---|")
        recs = sorted(
            res["records"],
            key=lambda r: (r["K"], r["library"] != "hypergrad", r["library"], r["solver"]),
        )
    for r in recs:
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r['error']}"
        status = status.replace("|", "\\|")
        if r.get("memory_error"):
            status += f" (memory run: {r['memory_error']})".replace("|", "\\|")
        if unrolled:
            method = (
                "unrolled"
                if r["solver"] == "unrolled"
                else f"implicit CG, K={UNROLLED_K} (after T plain steps)"
            )
            err = (
                _fmt_e(r["rel_error"])
                if r["solver"] == "unrolled"
                else f"({_fmt_e(r.get('rel_diff_to_unrolled'))} from unrolled)"
            )
            lines.append(
                f"| {r['T']} | {r['library']} | {method} | {_fmt_t(r['median_s'])} | "
                f"{_fmt_t(r.get('median_cpu_s'))} | {_fmt_m(r['peak_mib'])} | {err} | "
                f"{status} |"
            )
        else:
            name = f"**{r['library']}**" if r["library"] == "hypergrad" else r["library"]
            lines.append(
                f"| {r['K']} | {name} | {r['solver']} | {r['products']} | "
                f"{_fmt_t(r['median_s'])} | {_fmt_t(r.get('median_cpu_s'))} | "
                f"{r.get('reps', '–')} | {_fmt_m(r['peak_mib'])} | "
                f"{_fmt_e(r['rel_error'])} | {status} |"
            )
    return "\n".join(lines)


def verdict_md(res: dict) -> str:
    vs = verdicts(res)
    if not vs:
        return ""
    kname = "T" if res["problem"] == UNROLLED_KEY else "K"
    lines = [
        f"| hypergrad solver | {kname} | rel. error | wall (ms) | "
        "fastest peer at ≤ error (wall) | wall ratio | fastest peer (CPU) | CPU ratio | "
        "fastest PyTorch peer (CPU) | CPU ratio | leanest peer at ≤ error | memory ratio |",
        "|---|---:|---:|---:|---|---:|---|---:|---|---:|---|---:|",
    ]
    for v in vs:
        tr, cr, mr = v.get("time_ratio"), v.get("cpu_ratio"), v.get("mem_ratio")
        tc = v.get("torch_cpu_ratio")
        lines.append(
            f"| {v['solver']} | {v['K']} | {_fmt_e(v['hypergrad_err'])} | "
            f"{_fmt_t(v['hypergrad_s'])} | {v.get('fastest_peer', 'none reaches this error')} | "
            f"{'–' if tr is None else f'{tr:.2f}x'} | {v.get('fastest_cpu_peer', '–')} | "
            f"{'–' if cr is None else f'{cr:.2f}x'} | {v.get('fastest_torch_peer', '–')} | "
            f"{'–' if tc is None else f'{tc:.2f}x'} | {v.get('leanest_peer', '–')} | "
            f"{'–' if mr is None else f'{mr:.2f}x'} |"
        )
    return "\n".join(lines)


COLORS = {"hypergrad": "C3", "torchopt": "C0", "betty": "C2", "jaxopt": "C1", "higher": "C4"}
MARKERS = {
    "cg": "o",
    "neumann": "s",
    "normal_cg": "^",
    "minres": "v",
    "unrolled": "D",
    "implicit_cg": "o",
}


def _plot_vs_t(ax, points: list[tuple[dict, float]]) -> None:
    """One line per (library, solver) of the unrolled problem: value against T."""
    by: dict = {}
    for r, y in points:
        by.setdefault((r["library"], r["solver"]), []).append((r["T"], y))
    for (lib, solver), xs in sorted(by.items()):
        xs.sort()
        ax.plot(
            [a for a, _ in xs],
            [b for _, b in xs],
            marker=MARKERS.get(solver, "x"),
            color=COLORS.get(lib, "k"),
            ls="-" if solver == "unrolled" else ":",
            label=f"{lib} {solver if solver == 'unrolled' else 'implicit CG'}",
        )
    ax.set_xlabel("inner steps T")


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unrolled = res["problem"] == UNROLLED_KEY
    fig, axes = plt.subplots(1, 2 if unrolled else 1, figsize=(10.5 if unrolled else 6.4, 4.4))
    ax = axes[0] if unrolled else axes
    recs = [r for r in res["records"] if r["status"] == "ok" and r["median_s"]]
    tkey = "median_cpu_s" if all(r.get("median_cpu_s") for r in recs) else "median_s"
    time_label = f"median {'CPU' if tkey == 'median_cpu_s' else 'wall'} time per hypergradient (ms)"
    cap = 10.0
    groups: dict = {}
    for r in recs:
        err = r["rel_error"] if not unrolled else r["rel_error"]
        if err is None:
            continue
        groups.setdefault((r["library"], r["solver"]), []).append(
            (r["K"] if not unrolled else r["T"], r[tkey] * 1e3, err if math.isfinite(err) else cap)
        )
    pts = []
    for (lib, solver), xs in sorted(groups.items()):
        xs.sort()
        ys = [min(max(e, 1e-16), cap) for _, _, e in xs]
        ax.plot(
            [t for _, t, _ in xs],
            ys,
            marker=MARKERS.get(solver.split("+")[0], "x"),
            color=COLORS.get(lib, "k"),
            ls="-" if lib == "hypergrad" else "--",
            lw=2 if lib == "hypergrad" else 1,
            label=f"{lib} {solver}",
            alpha=0.9,
        )
        for k, t, e in xs:
            ax.annotate(
                str(k),
                (t, min(max(e, 1e-16), cap)),
                fontsize=6,
                alpha=0.7,
                xytext=(2, 2),
                textcoords="offset points",
            )
            pts.append((t, min(max(e, 1e-16), cap)))
    if pts and not unrolled:
        front, best = [], math.inf
        for t, e in sorted(pts):
            if e < best:
                front.append((t, e))
                best = e
        ax.step(
            [p[0] for p in front],
            [p[1] for p in front],
            where="post",
            color="0.3",
            lw=6,
            alpha=0.3,
            label="Pareto front",
            zorder=0,
        )
    if unrolled:  # errors are float32 round-off, identical across libraries: plot time vs T
        ax.clear()
        _plot_vs_t(ax, [(r, r[tkey] * 1e3) for r in recs])
        ax.set_ylabel(time_label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
        ax.set_title("time of one hypergradient vs T (MLP, 1.07M parameters)", fontsize=8)
    else:
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(time_label)
    if not unrolled:
        ax.set_ylabel("relative hypergradient error")
        ax.grid(alpha=0.3, which="both")
        ax.set_title((res["info"].get("title") or res["problem"])[:90], fontsize=8)
        ax.legend(fontsize=6, ncol=2)
    if unrolled:
        ax2 = axes[1]
        _plot_vs_t(ax2, [(r, r["peak_mib"]) for r in res["records"] if r["peak_mib"] is not None])
        ax2.set_ylabel("peak memory above baseline (MiB)")
        ax2.grid(alpha=0.3)
        ax2.legend(fontsize=6)
        ax2.set_title("peak RSS growth of one hypergradient vs T", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(results: list[dict], meta: dict) -> str:
    OUT.mkdir(parents=True, exist_ok=True)
    parts = ["<!-- generated by benchmarks/peers/run_all.py; do not edit by hand -->", ""]
    m = meta["machine"]
    parts.append(
        f"Machine: {m['cpu']}, {m['cores']} cores (shared with other jobs; load average "
        f"at start {tuple(round(x, 1) for x in m['loadavg'])}), {m['mem_gib']} GiB RAM, "
        f"no GPU; Python {m['python']}; {meta['threads']} thread(s) for torch and XLA."
    )
    parts.append("")
    parts.append("Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()) + ".")
    parts.append("")
    parts.append(
        f"Settings: K ∈ {meta['ks']}, T ∈ {meta['ts']}; after one warm-up call, at least "
        f"{meta['reps']} timed repetitions (interleaved across configurations; cheap "
        f"configurations get more, up to {meta.get('max_reps')}, so each is timed for "
        f"≥ {meta.get('min_time')} s), median wall and CPU (process) time reported; "
        "memory "
        + (
            "not measured."
            if meta["no_memory"]
            else "= peak RSS growth of one call in a fresh process (see method). "
        )
        + ("**Quick run (reduced grid).**" if meta["quick"] else "")
    )
    parts.append("")
    for res in results:
        info = res["info"]
        parts.append(f"### {info.get('title', res['problem'])}")
        parts.append("")
        desc = [f"problem `{res['problem']}`"]
        if info.get("numel"):
            desc.append(
                f"{info['numel']:,} inner parameters, {info.get('theta_numel')} "
                f"hyperparameters, run in {info.get('dtype')}"
            )
        if info.get("reference_note"):
            desc.append(f"reference: {info['reference_note']}")
        ex = info.get("extras") or {}
        if "condition_number" in ex:
            desc.append(f"Hessian condition number {ex['condition_number']:.3g}")
        if "reference_cg_iters" in ex:
            desc.append(
                f"reference CG iterations {ex['reference_cg_iters']} "
                f"(residual {ex['reference_residual']:.1e})"
            )
        if "oracle_agreement" in ex:
            desc.append(f"torchopt-CG oracle agrees to {ex['oracle_agreement']:.1e}")
        if res["problem"] != UNROLLED_KEY:
            desc.append(f"Neumann alpha = 1/lambda_max = {info.get('alpha', float('nan')):.4g}")
        rm = res.get("meta") or {}
        run_line = ""
        if rm:
            grid_ = rm.get("ts") if res["problem"] == UNROLLED_KEY else rm.get("ks")
            run_line = (
                f" Run {rm.get('created')} (hypergrad "
                f"{rm.get('versions', {}).get('hypergrad')}): K/T ∈ {grid_}, "
                f"≥ {rm.get('reps')} timed repetitions, load average at start "
                f"{tuple(round(x, 1) for x in rm['machine']['loadavg'])}."
            )
        parts.append(
            "; ".join(desc)
            + f". Wall time of this problem's run: {res['wall_s']:.0f} s."
            + run_line
        )
        parts.append("")
        parts.append(f"![{res['problem']}](../benchmarks/results/peers/{res['problem']}.png)")
        parts.append("")
        parts.append(table_md(res))
        parts.append("")
        vm = verdict_md(res)
        if vm:
            parts.append(
                "Targets (hypergrad vs the fastest / leanest peer with equal or better "
                "error at the same K; ratios < 1 mean hypergrad is better; memory ratio "
                "is (MiB + 1)/(MiB + 1)):"
            )
            parts.append("")
            parts.append(vm)
            parts.append("")
    md = "\n".join(parts)
    # peers.md sits next to the images; the docs copy links them from docs/
    (OUT / "peers.md").write_text(md.replace("](../benchmarks/results/peers/", "]("))
    return md


def update_doc(md: str) -> None:
    if not DOC.exists():
        return
    text = DOC.read_text()
    if BEGIN not in text or END not in text:
        return
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    DOC.write_text(
        head + BEGIN + "\n" + md.replace("](../benchmarks/", "](../benchmarks/") + "\n" + END + tail
    )


# ------------------------------------------------------------------------------ main


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="K in {5, 20}, T in {10, 50}, 3 reps")
    ap.add_argument(
        "--problems",
        nargs="+",
        default=None,
        help=f"subset of {IMPLICIT_PROBLEMS + [UNROLLED_KEY]}",
    )
    ap.add_argument("--ks", type=int, nargs="+", default=None, help="K values (default 5 10 20 50)")
    ap.add_argument("--ts", type=int, nargs="+", default=None, help="T values (default 10 50 100)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (default 5)")
    ap.add_argument(
        "--min-time",
        type=float,
        default=0.5,
        help="time each configuration for at least this many seconds in total",
    )
    ap.add_argument("--max-reps", type=int, default=25)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-memory", action="store_true", help="skip the fresh-process memory runs")
    ap.add_argument("--memory-timeout", type=float, default=1800.0)
    ap.add_argument("--no-doc", action="store_true", help="do not rewrite docs/benchmarks.md")
    ap.add_argument(
        "--report-only",
        action="store_true",
        help="rebuild tables, plots and docs from the JSON files without running",
    )
    ap.add_argument(
        "--memory-worker",
        nargs=4,
        metavar=("PROBLEM", "LIB", "SOLVER", "K"),
        help=argparse.SUPPRESS,
    )
    ap.add_argument(
        "--out",
        default=None,
        help="output folder (default benchmarks/results/peers; docs/benchmarks.md is only "
        "rewritten for the default)",
    )
    args = ap.parse_args(argv)
    set_threads(args.threads)
    global OUT
    custom_out = args.out is not None and Path(args.out).resolve() != OUT.resolve()
    if args.out is not None:
        OUT = Path(args.out).resolve()
    if args.memory_worker:
        p, lib, solver, k = args.memory_worker
        calls = 2 if p == UNROLLED_KEY else 3
        print(json.dumps(memory_worker(p, lib, solver, [int(x) for x in k.split(",")], calls)))
        return
    args.ks = args.ks or ([5, 20] if args.quick else [5, 10, 20, 50])
    args.ts = args.ts or ([10, 50] if args.quick else [10, 50, 100])
    args.reps = args.reps or (3 if args.quick else 5)
    problems = args.problems or IMPLICIT_PROBLEMS + [UNROLLED_KEY]
    import adapters as ad

    OUT.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": machine(),
        "versions": ad.versions(),
        "ks": args.ks,
        "ts": args.ts,
        "reps": args.reps,
        "threads": args.threads,
        "quick": args.quick,
        "no_memory": args.no_memory,
        "cg_tol": ad.CG_TOL,
        "min_time": args.min_time,
        "max_reps": args.max_reps,
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    print(json.dumps(meta, indent=1), flush=True)
    results = []
    if args.report_only:
        problems = []
        old = OUT / "peers.json"
        if old.exists():
            meta = json.loads(old.read_text())["meta"]
    for prob in problems:
        path = OUT / f"{prob}.json"
        print(f"== {prob}", flush=True)
        res = run_problem(prob, args)
        res["meta"] = meta
        path.write_text(json.dumps(res, indent=1, default=str))
        plot(res, OUT / f"{prob}.png")
        results.append(res)
    # keep the results of problems not re-run this time (e.g. --problems subset)
    done = {r["problem"] for r in results}
    allres = []
    for prob in IMPLICIT_PROBLEMS + [UNROLLED_KEY]:
        if prob in done:
            allres.append(next(r for r in results if r["problem"] == prob))
        elif (OUT / f"{prob}.json").exists():
            allres.append(json.loads((OUT / f"{prob}.json").read_text()))
            if args.report_only:
                plot(allres[-1], OUT / f"{prob}.png")
    md = write_outputs(allres, meta)
    summary = {"meta": meta, "verdicts": {r["problem"]: verdicts(r) for r in allres}}
    (OUT / "peers.json").write_text(json.dumps(summary, indent=1, default=str))
    if not args.no_doc and not custom_out:
        update_doc(md)
    print(md)


if __name__ == "__main__":
    main()
