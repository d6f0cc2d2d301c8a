"""Wall-time overhead of ``hg.implicit_grad`` over a minimal hand-written autograd loop.

For each model and each solver setting, two functions compute the same hypergradient with the
same Hessian-vector products:

* **library**: ``hg.implicit_grad(inner, outer, params, theta, solver=..., engine="reuse")``
  with ``hg.Neumann(steps=K, alpha=a)`` (a = 1e-3 for the MLP, 1e-5 for the CNN) or
  ``hg.CG(maxiter=K, tol=0, damping=d)`` (d = 1 for the MLP, 100 for the CNN: the Hessians at
  these random initialisations are indefinite and undamped CG would stop at the first negative
  curvature after 1-2 products; with the CNN's curvature a larger Neumann alpha makes a term
  grow, and the library then stops the series early);
* **hand loop**: one outer forward + gradient, one inner forward, one ``create_graph`` backward,
  K ``retain_graph`` vector-Jacobian products (the HVPs) with the same vector arithmetic as the
  solver (Neumann: ``v <- v - alpha*Hv; acc <- acc + v``; CG: the textbook recurrence with
  ``Ap = Hp + damping*p``, stopping on non-positive curvature like the library), one mixed
  vjp, and ``direct - mixed``.

Runs are interleaved (library, hand, hand, library, ...), ``torch.manual_seed`` is reset before
each so dropout masks agree, and after one warm-up pair each side is timed ``--reps`` times.
Reported: medians, the ratio of medians and the median of per-repetition ratios, and the
relative difference between the two hypergradients (they must agree). When a ratio exceeds the
1.10 target the script profiles one call of each side (``torch.profiler`` operator table +
``cProfile`` of the Python side) and writes the tables to ``results/overhead_profile_*.txt``.

Models (see ``common.py``): (a) 784-1024-256-10 MLP (1.07M parameters, batch 256, random
Fashion-MNIST-sized data); (b) the Digit-Five CNN (31.8M parameters, batch 64 of 32x32x3). The
hyperparameters are per-layer log weight decays (3 for the MLP, 6 for the CNN). The full run
uses K in {5, 10, 20} for the MLP but only K in {2, 5} for the CNN (2 shared CPU cores: one CNN
HVP takes several seconds), 7 repetitions each. On a machine shared with other jobs, run with
``--threads 1``: with 2 OpenMP threads per process and a load average of ~10 on 2 cores, every
parallel region waits for a descheduled partner thread and calls become 10-20x slower and erratic.

Usage::

    python benchmarks/overhead.py [--quick] [--models mlp cnn] [--reps 7]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
import warnings

import common  # noqa: F401
import torch
from common import (
    PROBLEMS,
    RESULTS,
    Problem,
    format_table,
    interleaved_times,
    machine_info,
    machine_line,
    median,
    paired_ratio,
    save_json,
)

import hypergrad as hg

TARGET = 1.10


# --------------------------------------------------------------------------- the two sides


def library_call(P: Problem, solver) -> tuple[torch.Tensor, dict]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g, info = hg.implicit_grad(
            P.inner, P.outer, P.params, P.theta, solver=solver, engine="reuse"
        )
    return g, {"hvps": info.solve.matvecs, "diverged": info.solve.diverged}


def _dot(a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:
    return sum(torch.sum(x * y) for x, y in zip(a, b))


def hand_call(
    P: Problem, kind: str, K: int, alpha: float, damping: float = 0.0
) -> tuple[torch.Tensor, dict]:
    names = list(P.params)
    psi = [P.params[n].detach().requires_grad_(True) for n in names]
    th = P.theta.detach().requires_grad_(True)
    d = dict(zip(names, psi))
    lo = P.outer(d, th)
    grads = torch.autograd.grad(lo, psi + [th], allow_unused=True)
    b = [torch.zeros_like(p) if g is None else g for g, p in zip(grads[:-1], psi)]
    direct = grads[-1]
    loss = P.inner(d, th)
    gi = torch.autograd.grad(loss, psi, create_graph=True)

    count = [0]

    def hvp(v):
        count[0] += 1
        return torch.autograd.grad(gi, psi, v, retain_graph=True)

    if kind == "neumann":
        v, acc = b, list(b)
        for _ in range(K):
            hv = hvp(v)
            v = [vi - alpha * hi for vi, hi in zip(v, hv)]
            acc = [a + vi for a, vi in zip(acc, v)]
        x = [alpha * a for a in acc]
    else:  # conjugate gradient, tol = 0
        x = [torch.zeros_like(p) for p in psi]
        r, p = b, b
        rs = _dot(r, r)
        for _ in range(K):
            ap = hvp(p)
            if damping:
                ap = [hi + damping * pi for hi, pi in zip(ap, p)]
            pap = _dot(p, ap)
            if not float(pap) > 0.0:
                break
            a = rs / pap
            x = [xi + a * pi for xi, pi in zip(x, p)]
            r = [ri - a * api for ri, api in zip(r, ap)]
            rs_new = _dot(r, r)
            p = [ri + (rs_new / rs) * pi for ri, pi in zip(r, p)]
            rs = rs_new
    mixed = torch.autograd.grad(gi, [th], x)[0]
    hyper = -mixed if direct is None else direct - mixed
    return hyper.detach(), {"hvps": count[0]}


def make_solver(kind: str, K: int, alpha: float, damping: float = 0.0):
    if kind == "neumann":
        return hg.Neumann(steps=K, alpha=alpha)
    return hg.CG(maxiter=K, tol=0.0, damping=damping)


# --------------------------------------------------------------------------- profiling


def profile_pair(P: Problem, kind: str, K: int, alpha: float, damping: float, tag: str) -> str:
    from torch.profiler import ProfilerActivity, profile

    out = io.StringIO()
    solver = make_solver(kind, K, alpha, damping)
    for side, fn in (
        ("library", lambda: library_call(P, solver)),
        ("hand", lambda: hand_call(P, kind, K, alpha, damping)),
    ):
        torch.manual_seed(0)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        out.write(f"===== torch.profiler, {side}, {tag}\n")
        out.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        out.write("\n")
    torch.manual_seed(0)
    pr = cProfile.Profile()
    pr.enable()
    library_call(P, solver)
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    out.write(f"===== cProfile, library, {tag}\n{s.getvalue()}\n")
    path = RESULTS / f"overhead_profile_{tag}.txt"
    RESULTS.mkdir(parents=True, exist_ok=True)
    path.write_text(out.getvalue())
    return str(path.relative_to(RESULTS.parent.parent))


_NO_DATA = {
    "aten::to",
    "aten::detach",
    "aten::view",
    "aten::t",
    "aten::transpose",
    "aten::reshape",
    "aten::as_strided",
    "aten::expand",
    "aten::alias",
    "aten::empty",
    "aten::empty_like",
    "aten::empty_strided",
    "aten::lift_fresh",
    "aten::resolve_conj",
    "aten::resolve_neg",
    "aten::_reshape_alias",
    "aten::unsqueeze",
    "aten::squeeze",
    "aten::permute",
}


def extra_work(P: Problem, kind: str, K: int, alpha: float, damping: float) -> dict:
    """Load-independent comparison: leaf aten kernels run on parameter-shaped inputs.

    Profiles one call of each side with ``record_shapes`` and counts, per side, the outermost
    aten ops (not nested in another aten op; metadata-only ops such as views excluded) whose first
    input has the shape of one of the parameter tensors. ``extra_param_passes`` is the difference
    in input elements divided by the parameter count: how many more sweeps over parameter-sized
    tensors the library makes (an op such as ``isfinite`` counts once although its kernels read
    the tensor more than once).
    """
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    shapes = {tuple(p.shape) for p in P.params.values()}
    solver = make_solver(kind, K, alpha, damping)
    sides = {}
    for side, fn in (
        ("library", lambda: library_call(P, solver)),
        ("hand", lambda: hand_call(P, kind, K, alpha, damping)),
    ):
        torch.manual_seed(0)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            fn()
        c: Counter = Counter()
        elems = 0
        for e in prof.events():
            # outermost aten op of each call chain (its own kernels are not counted again)
            if not e.name.startswith("aten::") or e.name in _NO_DATA or not e.input_shapes:
                continue
            par, nested = e.cpu_parent, False
            while par is not None:
                if par.name.startswith("aten::"):
                    nested = True
                    break
                par = par.cpu_parent
            if nested:
                continue
            shp = tuple(e.input_shapes[0]) if e.input_shapes[0] else ()
            if shp in shapes and len(shp) > 0:
                c[e.name] += 1
                n = 1
                for d in shp:
                    n *= d
                elems += n
        sides[side] = (c, elems)
    (cl, el), (ch, eh) = sides["library"], sides["hand"]
    diff = {k: cl[k] - ch[k] for k in sorted(set(cl) | set(ch)) if cl[k] != ch[k]}
    n_leaves = len(P.params)
    return {
        "extra_param_passes": (el - eh) / P.numel,
        "kernel_count_diff": diff,
        "library_param_passes": el / P.numel,
        "hand_param_passes": eh / P.numel,
        # sum() over every leaf = one norm/dot over the parameters; isfinite = one finiteness check
        "extra_norms": diff.get("aten::sum", 0) / n_leaves,
        "extra_finite_checks": diff.get("aten::isfinite", 0) / n_leaves,
    }


def unit_costs(P: Problem, reps: int = 15) -> dict:
    """Minimum wall time of the library's bookkeeping sweeps over the parameters.

    ``tree_norm`` (what the Neumann divergence check and the info norms run) and
    ``tree_all_finite`` (the finiteness checks), on the parameter tuple; the minimum over ``reps``
    calls is robust to other load on the machine. For comparison, single-pass alternatives
    (``torch.linalg.vector_norm``, ``torch.dot`` of flattened leaves vs ``tree_vdot``, finiteness
    of per-leaf sums) and the solvers' ``tree_axpy`` against a fused ``torch.add(y, x, alpha=a)``.
    """
    from hypergrad.tree import tree_all_finite, tree_axpy, tree_norm, tree_vdot

    leaves = tuple(P.params.values())
    other = tuple(a.clone() for a in leaves)
    out = {}
    for name, fn in (
        (
            "finite_of_sums_s",
            lambda: bool(torch.isfinite(torch.stack([a.sum() for a in leaves])).all()),
        ),
        ("tree_vdot_s", lambda: float(tree_vdot(leaves, other))),
        (
            "flat_dot_s",
            lambda: float(
                sum(torch.dot(a.reshape(-1), b.reshape(-1)) for a, b in zip(leaves, other))
            ),
        ),
        ("tree_axpy_s", lambda: tree_axpy(-1e-3, leaves, other)),
        (
            "fused_add_alpha_s",
            lambda: tuple(torch.add(b, a, alpha=-1e-3) for a, b in zip(leaves, other)),
        ),
        ("norm_s", lambda: float(tree_norm(leaves))),
        ("finite_check_s", lambda: tree_all_finite(leaves)),
        (
            "linalg_vector_norm_s",
            lambda: float(
                torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(a) for a in leaves]))
            ),
        ),
    ):
        fn()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        out[name] = min(ts)
    return out


# --------------------------------------------------------------------------- main


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--quick", action="store_true", help="short run: MLP K=5 (3 reps), CNN batch 16 K=2 (1 rep)"
    )
    ap.add_argument("--models", nargs="+", default=["mlp", "cnn"], choices=sorted(PROBLEMS))
    ap.add_argument(
        "--mlp-ks", type=int, nargs="+", default=None, help="K values for the MLP (5 10 20)"
    )
    ap.add_argument(
        "--cnn-ks",
        type=int,
        nargs="+",
        default=None,
        help="K values for the CNN (default 2 5: one CNN HVP takes seconds on 2 shared CPU cores)",
    )
    ap.add_argument("--solvers", nargs="+", default=["neumann", "cg"], choices=["neumann", "cg"])
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per side (default 7)")
    ap.add_argument(
        "--cnn-reps", type=int, default=None, help="repetitions for the CNN (default --reps)"
    )
    ap.add_argument(
        "--cnn-batch", type=int, default=None, help="CNN batch size (default 64; quick 16)"
    )
    ap.add_argument("--alpha-mlp", type=float, default=1e-3, help="fixed Neumann alpha, MLP")
    ap.add_argument(
        "--alpha-cnn",
        type=float,
        default=1e-5,
        help="fixed Neumann alpha, CNN (1e-3 makes the library stop at the first growing "
        "term: the CNN Hessian is strongly indefinite)",
    )
    ap.add_argument(
        "--damping-mlp",
        type=float,
        default=1.0,
        help="CG damping for the MLP, both sides (its Hessian at init is indefinite: "
        "without damping CG stops at the first negative curvature)",
    )
    ap.add_argument(
        "--damping-cnn",
        type=float,
        default=100.0,
        help="CG damping for the CNN (curvature down to about -3e6 along the first CG "
        "directions; 10 is not enough)",
    )
    ap.add_argument("--tag", default="", help="suffix of the output file names")
    ap.add_argument(
        "--units-only",
        action="store_true",
        help="only time the bookkeeping sweeps (unit_costs) on each model, in this fresh process, "
        "and write overhead_units.json",
    )
    ap.add_argument(
        "--count-cnn",
        action="store_true",
        help="also count kernels on the CNN (two more CNN calls)",
    )
    ap.add_argument(
        "--no-profile", action="store_true", help="do not profile configurations above target"
    )
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    reps = args.reps or (3 if args.quick else 7)
    ks = {
        "mlp": args.mlp_ks or ([5] if args.quick else [5, 10, 20]),
        "cnn": args.cnn_ks or ([2] if args.quick else [2, 5]),
    }
    model_reps = {"mlp": reps, "cnn": args.cnn_reps or (1 if args.quick else reps)}
    cnn_batch = args.cnn_batch or (16 if args.quick else 64)
    if args.units_only:
        units = {}
        for model in args.models:
            P = PROBLEMS[model](batch=cnn_batch) if model == "cnn" else PROBLEMS[model]()
            units[model] = {k: v * 1e3 for k, v in unit_costs(P).items()}
            print(
                f"[{model}] ms: " + ", ".join(f"{k[:-2]} {v:.2f}" for k, v in units[model].items())
            )
        return {"path": str(save_json("overhead_units", {"unit_costs_ms": units}))}
    print(machine_line(machine_info()))
    units: dict = {}
    rows, records = [], []
    t_all = time.perf_counter()
    for model in args.models:
        P = PROBLEMS[model](batch=cnn_batch) if model == "cnn" else PROBLEMS[model]()
        damping = args.damping_cnn if model == "cnn" else args.damping_mlp
        alpha = args.alpha_cnn if model == "cnn" else args.alpha_mlp
        print(f"\n[{model}] {P.numel:,} parameters, {P.theta.numel()} hyperparameters")
        for kind in args.solvers:
            for K in ks[model]:
                t0 = time.perf_counter()
                solver = make_solver(kind, K, alpha, damping)
                out: dict = {}

                def lib(P=P, solver=solver, out=out):
                    out["lib"] = library_call(P, solver)

                def hand(P=P, kind=kind, K=K, alpha=alpha, damping=damping, out=out):
                    out["hand"] = hand_call(P, kind, K, alpha, damping)

                times = interleaved_times(
                    {"library": lib, "hand": hand}, reps=model_reps[model], warmup=1
                )
                g_lib, i_lib = out["lib"]
                g_hand, i_hand = out["hand"]
                diff = float((g_lib - g_hand).norm() / g_hand.norm().clamp_min(1e-30))
                t_lib, t_hand = median(times["library"]), median(times["hand"])
                rec = {
                    "model": model,
                    "params": P.numel,
                    "solver": kind,
                    "K": K,
                    "alpha": alpha if kind == "neumann" else None,
                    "damping": damping if kind == "cg" else None,
                    "reps": model_reps[model],
                    "times_library_s": times["library"],
                    "times_hand_s": times["hand"],
                    "cpu_times_library_s": times["library_cpu"],
                    "cpu_times_hand_s": times["hand_cpu"],
                    "median_library_s": t_lib,
                    "median_hand_s": t_hand,
                    "ratio_of_medians": t_lib / t_hand,
                    "median_paired_ratio": paired_ratio(times["library"], times["hand"]),
                    "ratio_of_minima": min(times["library"]) / min(times["hand"]),
                    "cpu_ratio_of_medians": median(times["library_cpu"])
                    / median(times["hand_cpu"]),
                    "hvps_library": i_lib["hvps"],
                    "hvps_hand": i_hand["hvps"],
                    "diverged": i_lib.get("diverged", False),
                    "hypergrad_rel_diff": diff,
                    "batch": cnn_batch if model == "cnn" else 256,
                }
                rec["meets_target"] = rec["ratio_of_medians"] <= TARGET
                if rec["diverged"] or i_lib["hvps"] != i_hand["hvps"]:
                    print(
                        f"    WARNING: library solve diverged={rec['diverged']}, HVPs "
                        f"{i_lib['hvps']} vs {i_hand['hvps']}: the two sides did not do the same "
                        "work"
                    )
                if model == "mlp" or args.count_cnn:
                    rec["extra_work"] = ew = extra_work(P, kind, K, alpha, damping)
                    if model not in units:
                        units[model] = unit_costs(P)
                    u = units[model]
                    ew["predicted_extra_s"] = (
                        ew["extra_norms"] * u["norm_s"]
                        + ew["extra_finite_checks"] * u["finite_check_s"]
                    )
                    ew["predicted_ratio_vs_min_hand"] = 1 + ew["predicted_extra_s"] / min(
                        times["hand"]
                    )
                    print(
                        f"    extra sweeps over the parameters (library - hand): "
                        f"{rec['extra_work']['extra_param_passes']:.1f} of "
                        f"{rec['extra_work']['hand_param_passes']:.1f}; kernels "
                        f"{rec['extra_work']['kernel_count_diff']}; predicted cost "
                        f"{ew['predicted_extra_s'] * 1e3:.1f} ms -> ratio "
                        f"{ew['predicted_ratio_vs_min_hand']:.3f}",
                        flush=True,
                    )
                if not rec["meets_target"] and not args.no_profile:
                    prefix = ("quick_" if args.quick else "") + (
                        args.tag.strip("_") + "_" if args.tag else ""
                    )
                    rec["profile"] = profile_pair(
                        P, kind, K, alpha, damping, f"{prefix}{model}_{kind}_K{K}"
                    )
                records.append(rec)
                rows.append(
                    [
                        model,
                        kind,
                        K,
                        f"{i_lib['hvps']}/{i_hand['hvps']}",
                        t_lib,
                        t_hand,
                        rec["ratio_of_medians"],
                        rec["median_paired_ratio"],
                        rec["ratio_of_minima"],
                        rec["cpu_ratio_of_medians"],
                        diff,
                    ]
                )
                print(
                    f"  {kind} K={K}: library {t_lib:.4f}s hand {t_hand:.4f}s ratio "
                    f"{rec['ratio_of_medians']:.3f} (paired {rec['median_paired_ratio']:.3f}, "
                    f"minima {rec['ratio_of_minima']:.3f}, cpu {rec['cpu_ratio_of_medians']:.3f}), "
                    f"|g_lib-g_hand|/|g| = {diff:.1e}  [{time.perf_counter() - t0:.0f}s]",
                    flush=True,
                )
    header = [
        "model",
        "solver",
        "K",
        "HVPs lib/hand",
        "library s",
        "hand s",
        "ratio",
        "paired",
        "minima",
        "cpu",
        "rel diff",
    ]
    print(
        f"\nOverhead of hg.implicit_grad vs hand-written loop (median of {reps} interleaved reps, "
        f"target ratio <= {TARGET}):"
    )
    print(format_table(header, rows))
    name = ("overhead_quick" if args.quick else "overhead") + args.tag
    payload = {
        "unit_costs": units,
        "target": TARGET,
        "quick": args.quick,
        "records": records,
        "total_time_s": time.perf_counter() - t_all,
    }
    path = save_json(name, payload)
    print(f"wrote {path}")
    if not args.no_plot:
        plot(records, RESULTS / f"{name}.png")
        print(f"wrote {RESULTS / (name + '.png')}")
    return payload


def plot(records: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    labels = [f"{r['model']}\n{r['solver']} K={r['K']}" for r in records]
    ratios = [r["ratio_of_medians"] for r in records]
    lo = [
        np.percentile(np.array(r["times_library_s"]) / np.array(r["times_hand_s"]), 25)
        for r in records
    ]
    hi = [
        np.percentile(np.array(r["times_library_s"]) / np.array(r["times_hand_s"]), 75)
        for r in records
    ]
    fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(records)), 3.6))
    x = np.arange(len(records))
    ax.bar(x, ratios, color=["C0" if r["model"] == "mlp" else "C1" for r in records])
    ax.errorbar(
        x,
        ratios,
        yerr=[np.maximum(0, np.array(ratios) - lo), np.maximum(0, np.array(hi) - ratios)],
        fmt="none",
        ecolor="k",
        capsize=3,
        lw=1,
    )
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.axhline(TARGET, color="red", lw=1, ls="--", label=f"target {TARGET}")
    ax.set_xticks(x)
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("time(library) / time(hand loop)")
    ax.set_ylim(0.8, max(1.3, max(hi) + 0.05))
    ax.legend(fontsize=8)
    ax.set_title("hg.implicit_grad overhead (median; whiskers: IQR of paired ratios)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
