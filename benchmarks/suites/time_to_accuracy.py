"""Time to accuracy: per problem and library, the fastest configuration reaching 1e-8 (float64) /
1e-3 (float32): K walks up the grid (one call for the error, one for the time) until the target
or ``budget_s``, then every solver's first K that reached it is timed, interleaved."""

from __future__ import annotations

import time

import torch

from benchmarks import kit, problems
from benchmarks.peers import LIBS, Unsupported, build, solvers, versions
from benchmarks.suites.peers import IMPLICIT

KS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000]
OPTIONS = dict(problems=IMPLICIT, ks=KS, reps=5, min_time=0.5, max_reps=25, budget_s=10.0)
OPTIONS["libs"] = list(LIBS)
# quick: a linear problem (with the compiled solvers) and the MLP; a coarser K grid (each K of a
# compiled solver compiles again)
QUICK = dict(problems=["ridge_breast_cancer", "mlp_fashion"], ks=[5, 50, 500, 5000], reps=3)
QUICK.update(min_time=0.05, max_reps=5, budget_s=1.0)
DIRECT = ("exact", "cholesky")  # dense solvers: no K


def target(P: problems.Problem) -> float:
    return 1e-8 if P.dtype == torch.float64 else 1e-3


def run_problem(key: str, o: dict, quick: bool) -> dict:
    P, t_start = problems.get(key, quick), time.perf_counter()
    walk, chosen = [], {}
    for lib in o["libs"]:
        for solver in solvers(lib, P, tta=True):
            for K in [0] if solver.split("+")[0] in DIRECT else o["ks"]:
                rec = {"library": lib, "solver": solver, "K": K, "status": "ok", "error": None}
                walk.append(rec)
                try:
                    fn = build(lib, "implicit", P, solver, K)
                    rec["rel_error"] = P.rel_error(fn())
                    t0 = time.perf_counter()
                    fn()
                    rec["time_1_s"] = time.perf_counter() - t0
                except Unsupported as e:
                    rec.update(status="unsupported", error=str(e))
                    break
                except Exception as e:  # noqa: BLE001 - e.g. lineax refusing an unconverged CG
                    rec.update(status="error", error=kit.err_text(e))
                    continue
                if rec["rel_error"] <= target(P):
                    chosen[(lib, solver)] = (fn, rec)
                    break
                if rec["time_1_s"] > o["budget_s"]:
                    break
            kit.log(
                f"{key} {lib} {solver}: K={rec['K']} {rec['status']} "
                f"err={rec.get('rel_error')} {rec['error'] or ''}"[:200]
            )
    fns = {k: f for k, (f, _) in chosen.items()}
    for k, t in kit.timeit(fns, o["reps"], 0, o["min_time"], o["max_reps"]).items():
        rec = chosen[k][1]
        rec.update(times_s=t["times_s"], reached=True)
        rec["median_s"] = kit.median(t["times_s"]) if t["times_s"] else None
    best = {}
    for rec in walk:
        lib = rec["library"]
        if rec.get("median_s") and (lib not in best or rec["median_s"] < best[lib]["median_s"]):
            best[lib] = rec
    info = {"title": P.title, "dtype": str(P.dtype).replace("torch.", ""), "numel": P.numel}
    res = dict(problem=key, info=info, target=target(P), walk=walk, best=best)
    return {**res, "wall_s": time.perf_counter() - t_start}


def measure(o: dict, out, name: str) -> None:
    res = []
    for key in o["problems"]:
        kit.log(f"== {key}")
        res.append(run_problem(key, o, o["quick"]))
        kit.save(out / f"{name}.json", {"options": o, "versions": versions(), "problems": res})
