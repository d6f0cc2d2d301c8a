"""Peak memory of implicit vs unrolled hypergradients as the number of inner steps T grows.

Problem: the 784-1024-256-10 MLP of ``common.py`` (1.07M parameters, batch 256, per-layer log
weight decays as hyperparameters), inner optimizer SGD (lr 0.05), T in {10, 50, 100}:

* ``implicit``: T plain SGD steps (no graph kept) then ``hg.implicit_grad`` with
  ``hg.CG(maxiter=20, tol=0, damping=1.0)`` at the final iterate (the damping keeps CG from stopping
  early on the non-convex Hessian, so all 20 products run);
* ``unrolled``: ``hg.unrolled_grad(..., steps=T, optimizer=torchopt.sgd(lr), truncate=None)``;
* ``truncated``: the same with ``truncate=10`` (graph of the last 10 steps only).

Method (CPU; tracemalloc does not see torch's allocations): every configuration runs in a fresh
subprocess started with ``MALLOC_MMAP_THRESHOLD_=65536`` so that every tensor buffer is its own
``mmap`` and is returned to the OS when freed (otherwise glibc's heap can keep freed memory and
hide re-use). After the model, data and one warm-up gradient (thread pools, kernels) exist, the
subprocess records its resident set ``VmRSS`` as the baseline and resets the kernel's peak-RSS
counter (``echo 5 > /proc/self/clear_refs``); after the hypergradient it reads ``VmHWM`` (peak
RSS since the reset). Reported: ``VmHWM - baseline`` in MiB. Where ``clear_refs`` is not writable
the script falls back to ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` minus the baseline taken
the same way (an under-estimate if anything before the baseline peaked higher). Every
configuration is run ``--repeats`` times (fresh processes) and the median is reported.

Expected: implicit flat in T; full unrolled linear in T; truncated flat (~ the T=10 value).
As a reference the script also measures ``hg.implicit_grad`` alone (no inner steps) against the
minimal hand-written CG loop of ``overhead.py`` doing the same products: the library should not
need more memory than the hand loop.

Usage::

    python benchmarks/memory.py [--quick] [--steps 10 50 100] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import common  # noqa: F401
from common import proc_status_kb

HERE = Path(__file__).resolve().parent
METHODS = ("implicit", "unrolled", "truncated")


def worker(method: str, T: int, lr: float, truncate: int, cg_iters: int, damping: float) -> dict:
    import torch
    import torchopt
    from common import make_mlp_problem

    import hypergrad as hg

    P = make_mlp_problem()
    params = {n: p.detach().clone() for n, p in P.params.items()}
    theta = P.theta.clone()
    # warm-up: one ordinary gradient (loads kernels, starts thread pools); freed afterwards
    ps = {n: p.clone().requires_grad_(True) for n, p in params.items()}
    torch.autograd.grad(P.inner(ps, theta), list(ps.values()))
    del ps
    base_rss = proc_status_kb("VmRSS")
    base_maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        how = "VmHWM after clear_refs reset, minus VmRSS baseline"
    except OSError:
        how = "ru_maxrss minus baseline (clear_refs unavailable)"
    t0 = time.perf_counter()
    extra: dict = {}
    if method in ("implicit_only", "hand_loop"):
        # the hypergradient alone at the initial point, library vs the hand loop of overhead.py
        from overhead import hand_call, make_solver

        if method == "implicit_only":
            g = hg.implicit_grad(
                P.inner, P.outer, params, theta, solver=make_solver("cg", cg_iters, 0.0, damping)
            )[0]
        else:
            g = hand_call(P, "cg", cg_iters, 0.0, damping)[0]
    elif method == "implicit":
        w = {n: p.clone() for n, p in params.items()}
        for _ in range(T):
            wg = {n: p.requires_grad_(True) for n, p in w.items()}
            gs = torch.autograd.grad(P.inner(wg, theta), list(wg.values()))
            with torch.no_grad():
                w = {n: (p - lr * g).detach() for (n, p), g in zip(wg.items(), gs)}
        g, info = hg.implicit_grad(
            P.inner, P.outer, w, theta, solver=hg.CG(maxiter=cg_iters, tol=0.0, damping=damping)
        )
        extra = {"cg_iterations": info.solve.iterations, "cg_diverged": info.solve.diverged}
    else:
        g, info = hg.unrolled_grad(
            P.inner,
            P.outer,
            params,
            theta,
            steps=T,
            optimizer=torchopt.sgd(lr=lr),
            truncate=truncate if method == "truncated" else None,
        )
        extra = {"truncate": info.truncate}
    elapsed = time.perf_counter() - t0
    hwm = proc_status_kb("VmHWM")
    if how.startswith("VmHWM") and hwm is not None and base_rss is not None:
        peak_mib = (hwm - base_rss) / 1024
    else:
        peak_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_maxrss) / 1024
        how = "ru_maxrss minus baseline"
    return {
        "method": method,
        "T": T,
        "peak_mib": peak_mib,
        "baseline_rss_mib": (base_rss or 0) / 1024,
        "how": how,
        "time_s": elapsed,
        "hypergrad_norm": float(g.norm()),
        "params": P.numel,
        **extra,
    }


def run_config(method: str, T: int, args) -> dict:
    env = dict(os.environ)
    env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    cmd = [
        sys.executable,
        str(HERE / "memory.py"),
        "--worker",
        method,
        str(T),
        "--lr",
        str(args.lr),
        "--truncate",
        str(args.truncate),
        "--cg-iters",
        str(args.cg_iters),
        "--damping",
        str(args.damping),
    ]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"worker {method} T={T} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="T in {5, 10, 20}, one repeat")
    ap.add_argument(
        "--steps", type=int, nargs="+", default=None, help="values of T (default 10 50 100)"
    )
    ap.add_argument(
        "--repeats", type=int, default=None, help="fresh-process repeats per config (default 2)"
    )
    ap.add_argument("--lr", type=float, default=0.05, help="inner SGD learning rate")
    ap.add_argument("--truncate", type=int, default=10, help="K of the truncated unrolled variant")
    ap.add_argument(
        "--cg-iters", type=int, default=20, help="CG iterations of the implicit variant"
    )
    ap.add_argument("--damping", type=float, default=1.0, help="CG damping of the implicit variant")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--worker", nargs=2, metavar=("METHOD", "T"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.worker:
        res = worker(
            args.worker[0], int(args.worker[1]), args.lr, args.truncate, args.cg_iters, args.damping
        )
        print(json.dumps(res))
        return res

    from common import RESULTS, format_table, machine_info, machine_line, median, save_json

    steps = args.steps or ([5, 10, 20] if args.quick else [10, 50, 100])
    repeats = args.repeats or (1 if args.quick else 2)
    print(machine_line(machine_info()))
    t_all = time.perf_counter()
    records = []
    for T in steps:
        for method in METHODS:
            if method == "truncated" and T < args.truncate:
                continue
            runs = [run_config(method, T, args) for _ in range(repeats)]
            rec = dict(runs[0])
            rec["peak_mib_runs"] = [r["peak_mib"] for r in runs]
            rec["peak_mib"] = median(rec["peak_mib_runs"])
            rec["time_s"] = median([r["time_s"] for r in runs])
            records.append(rec)
            print(
                f"  T={T:4d} {method:9s}: peak +{rec['peak_mib']:8.1f} MiB "
                f"(runs {rec['peak_mib_runs']}) {rec['time_s']:.1f}s"
            )
    # the implicit hypergradient alone: library vs the minimal hand-written loop (no inner steps)
    reference = {}
    for method in ("implicit_only", "hand_loop"):
        runs = [run_config(method, 0, args) for _ in range(repeats)]
        reference[method] = median([r["peak_mib"] for r in runs])
    print(
        f"  implicit_grad alone (CG {args.cg_iters}): library "
        f"+{reference['implicit_only']:.1f} MiB, hand-written loop "
        f"+{reference['hand_loop']:.1f} MiB"
    )
    # linear fits: MiB per inner step
    import numpy as np

    fits = {}
    for method in METHODS:
        pts = [(r["T"], r["peak_mib"]) for r in records if r["method"] == method]
        if len(pts) >= 2:
            slope, icpt = np.polyfit([p[0] for p in pts], [p[1] for p in pts], 1)
            fits[method] = {"mib_per_step": float(slope), "intercept_mib": float(icpt)}
    rows = []
    for T in steps:
        row = [T]
        for method in METHODS:
            r = [x for x in records if x["T"] == T and x["method"] == method]
            row.append(r[0]["peak_mib"] if r else float("nan"))
        rows.append(row)
    print("\nPeak memory above baseline (MiB), MLP 1.07M params, batch 256:")
    print(
        format_table(
            ["T", "implicit (CG 20)", "unrolled (full)", f"truncated (K={args.truncate})"], rows
        )
    )
    print(
        "Linear fit MiB/step: " + ", ".join(f"{m} {f['mib_per_step']:.2f}" for m, f in fits.items())
    )
    name = "memory_quick" if args.quick else "memory"
    payload = {
        "quick": args.quick,
        "method": records[0]["how"] if records else None,
        "malloc_mmap_threshold": 65536,
        "lr": args.lr,
        "truncate": args.truncate,
        "cg_iters": args.cg_iters,
        "damping": args.damping,
        "repeats": repeats,
        "records": records,
        "fits": fits,
        "implicit_alone_vs_hand_mib": reference,
        "total_time_s": time.perf_counter() - t_all,
    }
    path = save_json(name, payload)
    print(f"wrote {path}")
    if not args.no_plot:
        plot(payload, RESULTS / f"{name}.png")
        print(f"wrote {RESULTS / (name + '.png')}")
    return payload


def plot(payload: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.2, 3.6))
    labels = {
        "implicit": f"implicit (CG {payload['cg_iters']} its)",
        "unrolled": "unrolled (full)",
        "truncated": f"unrolled, truncated K={payload['truncate']}",
    }
    for i, m in enumerate(METHODS):
        pts = sorted((r["T"], r["peak_mib"]) for r in payload["records"] if r["method"] == m)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=f"C{i}", label=labels[m])
    ax.set_xlabel("inner steps T")
    ax.set_ylabel("peak memory above baseline (MiB)")
    ax.set_title("Peak RSS of one hypergradient (MLP, 1.07M params, CPU)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
