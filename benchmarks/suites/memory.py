"""Peak memory of one hypergradient against the inner steps T, each configuration in a fresh
process (docs/performance.md, section 4)."""

from __future__ import annotations

import numpy as np
import torch
import torchopt

import hypergrad as hg
from benchmarks import kit
from benchmarks.peers.hypergrad import make_solver
from benchmarks.problems import random_net

METHODS = ("implicit", "unrolled", "truncated")
OPTIONS = dict(steps=[10, 50, 100], repeats=2, lr=0.05, truncate=10, cg_iters=20, damping=1.0)
QUICK = dict(steps=[5, 10, 20], repeats=1)


def build(method: str, T: int, lr: float, truncate: int, cg_iters: int, damping: float):
    """The measured call; the model, the data and one warm-up gradient are in the baseline."""
    P = random_net("mlp", 256)
    ps = {n: p.clone().requires_grad_(True) for n, p in P.params.items()}
    torch.autograd.grad(P.inner(ps, P.theta), list(ps.values()))
    solver = make_solver("cg", cg_iters, tol=0.0, damping=damping)
    if method == "hand_loop":
        from benchmarks.suites.overhead import hand_call

        return lambda: hand_call(P, "cg", cg_iters, 0.0, damping)
    if method in ("implicit", "implicit_only"):

        def implicit():
            w = dict(P.params)
            for _ in range(T if method == "implicit" else 0):
                wg = {n: p.detach().requires_grad_(True) for n, p in w.items()}
                gs = torch.autograd.grad(P.inner(wg, P.theta), list(wg.values()))
                w = {n: (p - lr * g).detach() for (n, p), g in zip(wg.items(), gs)}
            return hg.implicit_grad(P.inner, P.outer, w, P.theta, solver=solver)

        return implicit
    cut = truncate if method == "truncated" else None
    opt = torchopt.sgd(lr=lr)
    return lambda: hg.unrolled_grad(
        P.inner, P.outer, P.params, P.theta, steps=T, optimizer=opt, truncate=cut
    )


def measure(o: dict, out, name: str) -> None:
    kw = {k: o[k] for k in ("lr", "truncate", "cg_iters", "damping")}
    target, threads = "benchmarks.suites.memory:build", torch.get_num_threads()

    def peak(method, T):
        conf = [dict(method=method, T=T, **kw)]
        runs = [
            kit.probe(target, conf, warmup=False, threads=threads)[0] for _ in range(o["repeats"])
        ]
        if runs[0]["peak_mib"] is None:
            raise RuntimeError(f"{method} T={T}: {runs[0]['memory_error']}")
        rec = {**runs[0], "method": method, "T": T, "peak_mib_runs": [r["peak_mib"] for r in runs]}
        rec["peak_mib"] = kit.median(rec["peak_mib_runs"])
        rec["time_s"] = kit.median([r["time_s"] for r in runs])
        kit.log(f"T={T} {method}: peak +{rec['peak_mib']:.1f} MiB ({rec['peak_mib_runs']})")
        return rec

    recs = [
        peak(m, T) for T in o["steps"] for m in METHODS if m != "truncated" or T >= o["truncate"]
    ]
    ref = {m: peak(m, 0)["peak_mib"] for m in ("implicit_only", "hand_loop")}
    fits = {}
    for m in METHODS:
        pts = [(r["T"], r["peak_mib"]) for r in recs if r["method"] == m]
        if len(pts) >= 2:
            slope, icpt = np.polyfit(*zip(*pts), 1)
            fits[m] = {"mib_per_step": float(slope), "intercept_mib": float(icpt)}
    res = {"quick": o["quick"], "method": recs[0]["how"], **kw, "malloc_mmap_threshold": 65536}
    res.update(repeats=o["repeats"], records=recs, fits=fits, implicit_alone_vs_hand_mib=ref)
    kit.save(out / f"{name}.json", res)
