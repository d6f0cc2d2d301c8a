"""Time of ``hg.implicit_grad`` over a hand-written loop doing the same products, the extra
parameter sweeps behind it and, above the 1.10 target, profiles (docs/performance.md, section 2).
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time
import warnings
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

import hypergrad as hg
from benchmarks import kit
from benchmarks.peers.hypergrad import make_solver
from benchmarks.problems import random_net
from hypergrad.tree import tree_all_finite, tree_axpy, tree_norm, tree_vdot

TARGET = 1.10
OPTIONS = dict(models=["mlp", "cnn"], mlp_ks=[5, 10, 20], cnn_ks=[2, 5], solvers=["neumann", "cg"])
OPTIONS.update(reps=7, cnn_reps=7, cnn_batch=64, alpha_mlp=1e-3, alpha_cnn=1e-5, damping_mlp=1.0)
OPTIONS.update(damping_cnn=100.0, count_cnn=True, profile=True, units_only=False)
QUICK = dict(mlp_ks=[5], cnn_ks=[2], reps=3, cnn_reps=1, cnn_batch=16, count_cnn=False)
QUICK.update(profile=False)  # quick timings are too noisy to profile the pairs above the target
RUNS = [("", {}), ("_mlp_reps25", dict(models=["mlp"], reps=25)), ("_units", dict(units_only=True))]
NO_DATA = set(  # aten ops that move no parameter-sized data
    "to detach view t transpose reshape as_strided expand alias empty empty_like empty_strided "
    "lift_fresh resolve_conj resolve_neg _reshape_alias unsqueeze squeeze permute".split()
)


def hand_call(P, kind: str, K: int, alpha: float, damping: float = 0.0):
    dot = lambda a, b: sum(torch.sum(x * y) for x, y in zip(a, b))  # noqa: E731
    psi = [p.detach().requires_grad_(True) for p in P.params.values()]
    th = P.theta.detach().requires_grad_(True)
    d = dict(zip(P.params, psi))
    *b, direct = torch.autograd.grad(P.outer(d, th), psi + [th], allow_unused=True)
    b = [torch.zeros_like(p) if g is None else g for g, p in zip(b, psi)]
    gi = torch.autograd.grad(P.inner(d, th), psi, create_graph=True)
    count = [0]

    def hvp(v):
        count[0] += 1
        return torch.autograd.grad(gi, psi, v, retain_graph=True)

    if kind == "neumann":
        v, acc = b, list(b)
        for _ in range(K):
            v = [vi - alpha * hi for vi, hi in zip(v, hvp(v))]
            acc = [a + vi for a, vi in zip(acc, v)]
        x = [alpha * a for a in acc]
    else:  # conjugate gradient, tol = 0, stops on non-positive curvature like the library
        x, r, p = [torch.zeros_like(q) for q in psi], b, b
        rs = dot(r, r)
        for _ in range(K):
            ap = [hi + damping * pi for hi, pi in zip(hvp(p), p)]
            pap = dot(p, ap)
            if not float(pap) > 0.0:
                break
            x = [xi + rs / pap * pi for xi, pi in zip(x, p)]
            r = [ri - rs / pap * api for ri, api in zip(r, ap)]
            rs, rs_old = dot(r, r), rs
            p = [ri + (rs / rs_old) * pi for ri, pi in zip(r, p)]
    mixed = torch.autograd.grad(gi, [th], x)[0]
    return (-mixed if direct is None else direct - mixed).detach(), {"hvps": count[0]}


def _sides(P, kind, K, alpha, damping):
    # damping belongs to CG only: hand_call's Neumann sums the series of H itself
    solver = make_solver(kind, K, alpha=alpha, tol=0.0, damping=damping if kind == "cg" else 0.0)

    def library():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            g, info = hg.implicit_grad(P.inner, P.outer, P.params, P.theta, solver=solver)
        return g, {"hvps": info.solve.matvecs, "diverged": info.solve.diverged}

    return {"library": library, "hand": lambda: hand_call(P, kind, K, alpha, damping)}


def _profiles(sides: dict, **kw) -> dict:
    """A ``torch.profiler`` run of one call of each side (seed 0 before each)."""
    out = {}
    for side, fn in sides.items():
        torch.manual_seed(0)
        with profile(activities=[ProfilerActivity.CPU], **kw) as out[side]:
            fn()
    return out


def profile_pair(P, kind, K, alpha, damping, path) -> str:
    buf = io.StringIO()
    for side, prof in _profiles(_sides(P, kind, K, alpha, damping)).items():
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        buf.write(f"===== torch.profiler, {side}, {path.stem}\n{table}\n")
    pr = cProfile.Profile()
    pr.runcall(_sides(P, kind, K, alpha, damping)["library"])
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(25)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(buf.getvalue())
    return path.name


def extra_work(P, kind, K, alpha, damping) -> dict:
    """Outermost aten ops on parameter-shaped inputs, per side (``record_shapes``): how many more
    sweeps over parameter-sized tensors the library makes than the hand loop."""
    shapes, sides = {tuple(p.shape) for p in P.params.values()}, {}
    for side, prof in _profiles(_sides(P, kind, K, alpha, damping), record_shapes=True).items():
        c, elems = Counter(), 0
        for e in prof.events():
            name, par = e.name, e.cpu_parent
            if not name.startswith("aten::") or name[6:] in NO_DATA or not e.input_shapes:
                continue
            while par is not None and not par.name.startswith("aten::"):
                par = par.cpu_parent
            shp = tuple(e.input_shapes[0] or ())
            if par is None and shp in shapes and shp:
                c[name] += 1
                elems += torch.Size(shp).numel()
        sides[side] = (c, elems)
    (cl, el), (ch, eh) = sides["library"], sides["hand"]
    diff = {k: cl[k] - ch[k] for k in sorted(set(cl) | set(ch)) if cl[k] != ch[k]}
    out = dict(extra_param_passes=(el - eh) / P.numel, kernel_count_diff=diff)
    out.update(library_param_passes=el / P.numel, hand_param_passes=eh / P.numel)
    out["extra_norms"] = diff.get("aten::sum", 0) / len(P.params)
    return {**out, "extra_finite_checks": diff.get("aten::isfinite", 0) / len(P.params)}


def unit_costs(P, reps: int = 15) -> dict:
    """Minimum wall time of the library's bookkeeping sweeps over all parameters, and of
    single-pass alternatives."""
    a, b = tuple(P.params.values()), tuple(p.clone() for p in P.params.values())
    vn = torch.linalg.vector_norm
    fns = {
        "finite_of_sums_s": lambda: bool(torch.isfinite(torch.stack([x.sum() for x in a])).all()),
        "tree_vdot_s": lambda: float(tree_vdot(a, b)),
        "flat_dot_s": lambda: float(
            sum(torch.dot(x.reshape(-1), y.reshape(-1)) for x, y in zip(a, b))
        ),
        "tree_axpy_s": lambda: tree_axpy(-1e-3, a, b),
        "fused_add_alpha_s": lambda: tuple(torch.add(y, x, alpha=-1e-3) for x, y in zip(a, b)),
        "norm_s": lambda: float(tree_norm(a)),
        "finite_check_s": lambda: tree_all_finite(a),
        "linalg_vector_norm_s": lambda: float(vn(torch.stack([vn(x) for x in a]))),
    }
    return {k: min(t["times_s"]) for k, t in kit.timeit(fns, reps).items()}


def measure_one(P, model: str, kind: str, K: int, o: dict, units: dict, out, name: str) -> dict:
    alpha, damping, med = o[f"alpha_{model}"], o[f"damping_{model}"], kit.median
    reps, res = o["cnn_reps"] if model == "cnn" else o["reps"], {}
    sides = _sides(P, kind, K, alpha, damping)
    t = kit.timeit({k: (lambda k=k, f=f: res.__setitem__(k, f())) for k, f in sides.items()}, reps)
    (gl, il), (gh, ih) = res["library"], res["hand"]
    (tl, cl), (th, ch) = ((t[s]["times_s"], t[s]["cpu_s"]) for s in ("library", "hand"))
    rec = dict(model=model, params=P.numel, solver=kind, K=K, reps=reps)
    rec.update(alpha=alpha if kind == "neumann" else None, batch=len(P.x_tr))
    rec.update(damping=damping if kind == "cg" else None, diverged=il["diverged"])
    rec.update(times_library_s=tl, times_hand_s=th, cpu_times_library_s=cl)
    rec.update(cpu_times_hand_s=ch, median_library_s=med(tl), median_hand_s=med(th))
    rec.update(ratio_of_medians=med(tl) / med(th), ratio_of_minima=min(tl) / min(th))
    rec.update(median_paired_ratio=med([x / y for x, y in zip(tl, th)]))
    rec.update(cpu_ratio_of_medians=med(cl) / med(ch), hvps_library=il["hvps"])
    rec.update(hvps_hand=ih["hvps"], hypergrad_rel_diff=float((gl - gh).norm() / gh.norm()))
    rec["meets_target"] = rec["ratio_of_medians"] <= TARGET
    if model == "mlp" or o["count_cnn"]:
        rec["extra_work"] = ew = extra_work(P, kind, K, alpha, damping)
        u = units.setdefault(model, unit_costs(P))
        extra = ew["extra_norms"] * u["norm_s"] + ew["extra_finite_checks"] * u["finite_check_s"]
        ew["predicted_extra_s"] = extra
        ew["predicted_ratio_vs_min_hand"] = 1 + extra / min(th)
    if not rec["meets_target"] and o["profile"]:
        path = out / f"overhead_profile{name[8:]}_{model}_{kind}_K{K}.txt"
        rec["profile"] = profile_pair(P, kind, K, alpha, damping, path)
    kit.log(
        f"{model} {kind} K={K}: library/hand {rec['ratio_of_medians']:.3f} "
        f"(paired {rec['median_paired_ratio']:.3f}), HVPs {il['hvps']}/{ih['hvps']}, "
        f"rel. diff {rec['hypergrad_rel_diff']:.1e}"
    )
    return rec


def measure(o: dict, out, name: str) -> None:
    probs = {m: random_net(m, o["cnn_batch"] if m == "cnn" else 256) for m in o["models"]}
    if o["units_only"]:
        units = {m: {k: v * 1e3 for k, v in unit_costs(P).items()} for m, P in probs.items()}
        kit.save(out / f"{name}.json", {"unit_costs_ms": units})
        return
    units, t_all = {}, time.perf_counter()
    records = [
        measure_one(P, model, kind, K, o, units, out, name)
        for model, P in probs.items()
        for kind in o["solvers"]
        for K in o[f"{model}_ks"]
    ]
    res = {"unit_costs": units, "target": TARGET, "quick": o["quick"], "records": records}
    kit.save(out / f"{name}.json", {**res, "total_time_s": time.perf_counter() - t_all})
