"""Cost of one Hessian-vector product relative to one gradient, for both operator engines.

Measured on the two models of ``common.py`` (MLP 1.07M parameters, batch 256; Digit-Five CNN
31.8M parameters, batch 64), inner loss = cross-entropy + per-layer weight decay:

* ``gradient``: one forward + backward, ``torch.autograd.grad(loss, params)`` (the unit);
* ``reuse setup``: ``hg.InnerOperator(..., engine="reuse")`` -- one forward and one
  ``create_graph`` backward, paid once per hypergradient;
* ``reuse HVP``: one ``op.hvp(v)`` on that operator (a ``retain_graph`` vjp of the gradient
  graph), timed as the mean over ``--products`` consecutive products;
* ``recompute HVP``: one ``op.hvp(v)`` with ``engine="recompute"``, i.e. forward +
  ``create_graph`` backward + vjp for every product (plus the RNG replay);
* ``raw torch HVP``: the same vjp written directly with ``torch.autograd.grad`` on a retained
  graph (shows what the library adds per product);
* ``fwd-over-rev HVP`` (reference only, not a library engine): ``torch.func.jvp`` of
  ``torch.func.grad`` with ``functional_call``, which recomputes forward+backward per product.

All are interleaved within each repetition; medians over ``--reps`` repetitions after a warm-up.
Ratios are (median time of one product) / (median time of one gradient). Target for the reuse
engine: <= 2.2.

Usage::

    python benchmarks/hvp_cost.py [--quick] [--models mlp cnn] [--reps 7]
"""

from __future__ import annotations

import argparse
import time
import warnings

import common  # noqa: F401
import torch
from common import (
    PROBLEMS,
    RESULTS,
    Problem,
    format_table,
    machine_info,
    machine_line,
    median,
    save_json,
)
from torch.func import grad as fgrad
from torch.func import jvp

import hypergrad as hg

TARGET_REUSE = 2.2
warnings.filterwarnings("ignore", message=".*torch.jit.script.*", category=FutureWarning)


def build(P: Problem):
    names = list(P.params)
    psi = tuple(P.params[n].detach().requires_grad_(True) for n in names)
    th = (P.theta.detach().requires_grad_(True),)

    def flat_inner(ps, hs):
        return P.inner(dict(zip(names, ps)), hs[0])

    gen = torch.Generator().manual_seed(1)
    v = tuple(torch.randn(p.shape, generator=gen) for p in psi)
    return names, psi, th, flat_inner, v


def measure(P: Problem, reps: int, products: int, with_fwd: bool) -> dict:
    names, psi, th, flat_inner, v = build(P)
    theta_c = P.theta.detach()

    def t_gradient():
        torch.manual_seed(0)
        t0 = time.perf_counter()
        loss = flat_inner(psi, th)
        torch.autograd.grad(loss, psi)
        return time.perf_counter() - t0

    def t_reuse():
        torch.manual_seed(0)
        t0 = time.perf_counter()
        op = hg.InnerOperator(flat_inner, psi, th, engine="reuse")
        t1 = time.perf_counter()
        for _ in range(products):
            op.hvp(v)
        t2 = time.perf_counter()
        return t1 - t0, (t2 - t1) / products

    def t_raw():
        torch.manual_seed(0)
        loss = flat_inner(psi, th)
        g = torch.autograd.grad(loss, psi, create_graph=True)
        t1 = time.perf_counter()
        for _ in range(products):
            torch.autograd.grad(g, psi, v, retain_graph=True)
        return (time.perf_counter() - t1) / products

    def t_recompute():
        torch.manual_seed(0)
        op = hg.InnerOperator(flat_inner, psi, th, engine="recompute")
        t1 = time.perf_counter()
        for _ in range(products):
            op.hvp(v)
        return (time.perf_counter() - t1) / products

    pdict = {n: p.detach() for n, p in zip(names, psi)}
    vdict = dict(zip(names, v))

    def loss_of(pd):
        return P.inner(pd, theta_c)

    def t_fwd():
        torch.manual_seed(0)
        t1 = time.perf_counter()
        for _ in range(products):
            jvp(fgrad(loss_of), (pdict,), (vdict,))
        return (time.perf_counter() - t1) / products

    fwd_ok = with_fwd
    if fwd_ok:
        try:
            t_fwd()
        except Exception as e:  # forward-mode AD may not cover every op
            print(f"  fwd-over-rev unavailable: {type(e).__name__}: {e}")
            fwd_ok = False
    # warm-up
    t_gradient(), t_reuse(), t_raw(), t_recompute()
    res: dict[str, list[float]] = {
        k: []
        for k in (
            "gradient",
            "reuse_setup",
            "reuse_hvp",
            "raw_hvp",
            "recompute_hvp",
            "fwd_over_rev_hvp",
        )
    }
    for r in range(reps):
        steps = ["g", "reuse", "raw", "rec"] + (["fwd"] if fwd_ok else [])
        if r % 2:
            steps = steps[::-1]
        for s in steps:
            if s == "g":
                res["gradient"].append(t_gradient())
            elif s == "reuse":
                a, b = t_reuse()
                res["reuse_setup"].append(a)
                res["reuse_hvp"].append(b)
            elif s == "raw":
                res["raw_hvp"].append(t_raw())
            elif s == "rec":
                res["recompute_hvp"].append(t_recompute())
            else:
                res["fwd_over_rev_hvp"].append(t_fwd())
    med = {k: (median(x) if x else float("nan")) for k, x in res.items()}
    g = med["gradient"]
    ratios = {k: med[k] / g for k in med if k != "gradient"}
    return {"times_s": res, "median_s": med, "ratio_to_gradient": ratios}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="3 reps on the MLP, 1 on a batch-16 CNN")
    ap.add_argument("--models", nargs="+", default=["mlp", "cnn"], choices=sorted(PROBLEMS))
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 7; quick 3)")
    ap.add_argument(
        "--cnn-reps", type=int, default=None, help="repetitions for the CNN (default --reps)"
    )
    ap.add_argument("--products", type=int, default=None, help="HVPs per timing (MLP 5, CNN 2)")
    ap.add_argument("--cnn-batch", type=int, default=None, help="CNN batch (default 64; quick 16)")
    ap.add_argument("--no-fwd", action="store_true", help="skip the forward-over-reverse reference")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    reps = args.reps or (3 if args.quick else 7)
    cnn_reps = args.cnn_reps or (1 if args.quick else reps)
    cnn_batch = args.cnn_batch or (16 if args.quick else 64)
    print(machine_line(machine_info()))
    out: dict = {"target_reuse": TARGET_REUSE, "quick": args.quick, "models": {}}
    rows = []
    t_all = time.perf_counter()
    for model in args.models:
        t0 = time.perf_counter()
        if model == "cnn":
            P = PROBLEMS[model](batch=cnn_batch)
            n_prod, n_reps = args.products or 2, cnn_reps
        else:
            P = PROBLEMS[model]()
            n_prod, n_reps = args.products or 5, reps
        print(f"\n[{model}] {P.numel:,} parameters, {n_reps} reps x {n_prod} products")
        m = measure(P, n_reps, n_prod, with_fwd=not args.no_fwd)
        m.update(
            {
                "params": P.numel,
                "reps": n_reps,
                "products": n_prod,
                "batch": cnn_batch if model == "cnn" else 256,
                "time_s": time.perf_counter() - t0,
            }
        )
        m["reuse_meets_target"] = m["ratio_to_gradient"]["reuse_hvp"] <= TARGET_REUSE
        out["models"][model] = m
        med, rat = m["median_s"], m["ratio_to_gradient"]
        rows.append(
            [
                model,
                med["gradient"],
                rat["reuse_setup"],
                rat["reuse_hvp"],
                rat["raw_hvp"],
                rat["recompute_hvp"],
                rat["fwd_over_rev_hvp"],
            ]
        )
        print(
            f"  gradient {med['gradient']:.4f}s; reuse HVP {rat['reuse_hvp']:.2f}x, "
            f"recompute HVP {rat['recompute_hvp']:.2f}x  [{time.perf_counter() - t0:.0f}s]"
        )
    print(f"\nCost per product / cost of one gradient (medians; target reuse <= {TARGET_REUSE}):")
    print(
        format_table(
            [
                "model",
                "gradient s",
                "reuse setup",
                "reuse HVP",
                "raw torch HVP",
                "recompute HVP",
                "fwd-over-rev",
            ],
            rows,
        )
    )
    out["total_time_s"] = time.perf_counter() - t_all
    name = "hvp_cost_quick" if args.quick else "hvp_cost"
    path = save_json(name, out)
    print(f"wrote {path}")
    if not args.no_plot:
        plot(out, RESULTS / f"{name}.png")
        print(f"wrote {RESULTS / (name + '.png')}")
    return out


def plot(out: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    keys = ["reuse_setup", "reuse_hvp", "raw_hvp", "recompute_hvp", "fwd_over_rev_hvp"]
    labels = [
        "reuse setup\n(fwd+create_graph bwd)",
        "reuse HVP",
        "raw torch HVP",
        "recompute HVP",
        "fwd-over-rev\n(reference)",
    ]
    models = list(out["models"])
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    w = 0.8 / max(1, len(models))
    x = np.arange(len(keys))
    for i, m in enumerate(models):
        vals = [out["models"][m]["ratio_to_gradient"][k] for k in keys]
        vals = [v if v == v else 0.0 for v in vals]
        ax.bar(x + (i - (len(models) - 1) / 2) * w, vals, w, label=m)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.axhline(
        out["target_reuse"], color="red", ls="--", lw=1, label=f"reuse target {out['target_reuse']}"
    )
    ax.set_xticks(x)
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("time / time(one gradient)")
    ax.legend(fontsize=8)
    ax.set_title(
        "Cost of one Hessian-vector product relative to one gradient (medians)", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
