"""Equal K: every library's solvers with K iterations on the peer problems, and T unrolled SGD
steps of the MLP (``unrolled_mlp``); writes ``peers/<problem>.json`` (docs/benchmarks.md)."""

from __future__ import annotations

import copy
import functools
import gc
import time
import traceback

import numpy as np
import torch

from benchmarks import kit, problems
from benchmarks.peers import CG_TOL, LIBS, Unsupported, build, module, products, solvers, versions

IMPLICIT = "ridge_breast_cancer ridge_diabetes logreg_breast_cancer mlp_fashion cnn_digit5".split()
UNROLLED = "unrolled_mlp"
OPTIONS = dict(problems=IMPLICIT + [UNROLLED], ks=[5, 10, 20, 50], ts=[10, 50, 100], reps=5)
OPTIONS.update(min_time=0.5, max_reps=25, memory=True, libs=list(LIBS))
# quick: one K and one T, no memory probes (each compiles again in a fresh process), one
# problem of each kind (linear with the compiled solvers, MLP, CNN, unrolled)
QUICK = dict(problems=["ridge_breast_cancer", "mlp_fashion", "cnn_digit5", UNROLLED], ks=[20])
QUICK.update(ts=[10], reps=3, min_time=0.05, max_reps=5, memory=False)
LR, IMPLICIT_K, LEAKY_REPS = 0.1, 20, 3
TITLE = f"Unrolled: T SGD steps (lr {LR}) of the Fashion-MNIST MLP from a random init, reverse "
TITLE += "mode through all of them"


@functools.lru_cache(maxsize=8)
def problem(key: str, quick: bool = False, T: int = 0) -> tuple[problems.Problem, dict | None]:
    """The problem, and for ``unrolled_mlp`` the random start (reference: float64 autograd loop
    through the T steps, cached)."""
    if key != UNROLLED:
        return problems.get(key, quick), None
    P = copy.copy(problems.get("mlp_fashion", quick))
    P.prox, P.prox_center = 0.0, None  # the plain training loss when unrolling
    torch.manual_seed(1)
    sizes = [P.model[0].in_features] + [m.out_features for m in P.model if hasattr(m, "bias")]
    params0 = {n: p.detach().to(P.dtype) for n, p in problems.make_mlp(sizes).named_parameters()}

    def reference():
        Q, names = P.to(torch.float64), list(params0)
        theta = Q.theta.detach().clone().requires_grad_(True)
        ps = [p.double().requires_grad_(True) for p in params0.values()]
        for _ in range(T):
            gs = torch.autograd.grad(Q.inner(dict(zip(names, ps)), theta), ps, create_graph=True)
            ps = [p - LR * g for p, g in zip(ps, gs)]
        (g,) = torch.autograd.grad(Q.outer(dict(zip(names, ps)), theta), theta)
        return {"g": g.detach().numpy().ravel()}

    tag = "_".join(map(str, sizes))
    P.reference = problems.cached(f"unrolled_ref_T{T}_lr{LR}_{tag}", reference)["g"]
    P.reference_note = "plain torch.autograd loop through the T SGD steps in float64"
    return P, params0


def make(key: str, lib: str, solver: str, K: int, quick: bool = False):
    """(callable, problem) of one configuration; K is T on ``unrolled_mlp``."""
    P, params0 = problem(key, quick, K if key == UNROLLED else 0)
    if key != UNROLLED:
        return build(lib, "implicit", P, solver, K), P
    if solver == "unrolled":
        return build(lib, "unrolled", P, K, LR, params0), P
    module(lib)

    def run():  # implicit CG at the T-th iterate, the T plain SGD steps included in the call
        Q, ps = copy.copy(P), {n: p.detach().clone() for n, p in params0.items()}
        for _ in range(K):
            q = {n: p.requires_grad_(True) for n, p in ps.items()}
            gs = torch.autograd.grad(P.inner(q, P.theta), list(q.values()))
            ps = {n: (p - LR * g).detach() for (n, p), g in zip(q.items(), gs)}
        Q.params = ps
        return build(lib, "implicit", Q, "cg", IMPLICIT_K)()

    return run, P


def memory_build(key: str, lib: str, solver: str, K: int, quick: bool):
    fn, P = make(key, lib, solver, K, quick)
    if key == UNROLLED:  # warm-up: one gradient (not a T-step call)
        ps = {n: p.detach().requires_grad_(True) for n, p in P.params.items()}
        torch.autograd.grad(P.inner(ps, P.theta), list(ps.values()))
    return fn


def grid(key: str, o: dict, quick: bool) -> list[tuple[str, str, int]]:
    if key == UNROLLED:
        libs = [lib for lib in o["libs"] if hasattr(module(lib), "unrolled")]
        extra = [("hypergrad", "implicit_cg"), ("torchopt", "implicit_cg")]
        return [(lib, s, T) for T in o["ts"] for lib, s in [(x, "unrolled") for x in libs] + extra]
    P = problem(key, quick)[0]
    confs = [(lib, s) for lib in o["libs"] for s in solvers(lib, P)]
    return [(lib, s, K) for K in o["ks"] for lib, s in confs]


def run_problem(key: str, o: dict, quick: bool) -> dict:
    t_start, unrolled = time.perf_counter(), key == UNROLLED
    records, fns = [], {}
    for lib, solver, K in grid(key, o, quick):
        k_cg = IMPLICIT_K if solver == "implicit_cg" else None
        rec = dict(problem=key, library=lib, solver=solver, K=K, status="ok", error=None)
        rec.update(times_s=[], cpu_s=[], median_s=None, median_cpu_s=None, rel_error=None)
        rec.update(peak_mib=None, products=k_cg or products(solver, K))
        if unrolled:
            rec.update(T=K, K=k_cg)
        try:
            fn, P = make(key, lib, solver, K, quick)
            torch.manual_seed(0)
            t0 = time.perf_counter()
            g = fn()
            rec.update(warmup_s=time.perf_counter() - t0, hypergrad_norm=float(np.linalg.norm(g)))
            rec["rel_diff_to_unrolled" if solver == "implicit_cg" else "rel_error"] = P.rel_error(g)
            fns[(lib, solver, K)] = fn
        except Unsupported as e:
            rec["status"], rec["error"] = "unsupported", str(e)
        except Exception as e:  # noqa: BLE001 - a peer failing is a result
            rec["status"], rec["error"] = "error", kit.err_text(e)
            rec["traceback_tail"] = traceback.format_exc().strip().splitlines()[-6:]
        records.append(rec)
        kit.log(
            f"{key} {lib} {solver} {'T' if unrolled else 'K'}={K} {rec['status']} "
            f"err={rec['rel_error']} {rec['error'] or ''}"[:240]
        )
    by_key = {(r["library"], r["solver"], r.get("T") or r["K"]): r for r in records}
    leaky = [k for k in fns if unrolled and k[0] == "betty"]
    short, rest = min(o["reps"], LEAKY_REPS), [k for k in fns if k not in leaky]
    for keys, reps, most in ((rest, o["reps"], o["max_reps"]), (leaky, short, short)):
        times = kit.timeit({k: fns[k] for k in keys}, reps, 0, o["min_time"], most)
        for k, t in times.items():
            r = by_key[k]
            r.update(times_s=t["times_s"], cpu_s=t["cpu_s"], reps=len(t["times_s"]))
            if t["times_s"]:
                r["median_s"], r["median_cpu_s"] = kit.median(t["times_s"]), kit.median(t["cpu_s"])
            if t["errors"]:
                r["timing_error"] = t["errors"][0]
    fns.clear()
    gc.collect()
    if o["memory"]:  # one fresh process per library, configuration by configuration
        groups: dict = {}
        for r in [r for r in records if r["status"] == "ok"]:
            groups.setdefault(r["library"], []).append(r)
        for lib, recs in groups.items():
            kw = dict(key=key, lib=lib, quick=quick)
            confs = [dict(kw, solver=r["solver"], K=r.get("T") or r["K"]) for r in recs]
            target, threads = "benchmarks.suites.peers:memory_build", torch.get_num_threads()
            mem = kit.probe(target, confs, 2 if unrolled else 3, not unrolled, threads)
            for r, m in zip(recs, mem):
                r.update(peak_mib=m["peak_mib"], memory_how=m.get("how"))
                if m.get("memory_error"):
                    r["memory_error"] = m["memory_error"]
        kit.log(f"{key}: memory done")
    P = problem(key, quick, o["ts"][0] if unrolled else 0)[0]
    info = dict(title=P.title, numel=P.numel, theta_numel=P.theta.numel(), alpha=P.alpha)
    info.update(dtype=str(P.dtype)[6:], reference_note=P.reference_note, extras=P.extras)
    if unrolled:
        info.update(lr=LR, title=TITLE)
    return dict(problem=key, info=info, records=records, wall_s=time.perf_counter() - t_start)


def measure(o: dict, out, name: str) -> None:
    quick = o["quick"]
    meta = {"versions": versions(), "cg_tol": CG_TOL, **o}
    for key in o["problems"]:
        kit.log(f"== {key}")
        res = run_problem(key, o, quick)
        kit.save(out / "peers" / f"{key}.json", {**res, "meta": {**meta, "machine": kit.machine()}})
