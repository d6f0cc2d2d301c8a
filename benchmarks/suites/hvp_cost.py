"""Cost of one Hessian-vector product relative to one gradient (docs/performance.md, section 3);
HVP timings are of ``products`` consecutive products, divided by ``products``."""

from __future__ import annotations

import torch
from torch.func import grad as fgrad
from torch.func import jvp

import hypergrad as hg
from benchmarks import kit
from benchmarks.problems import random_net

TARGET_REUSE = 2.2
OPTIONS = dict(models=["mlp", "cnn"], reps=7, cnn_reps=7, mlp_products=5, cnn_products=2)
OPTIONS.update(cnn_batch=64, fwd=True)
QUICK = dict(reps=3, cnn_reps=1, cnn_batch=16)


def measure_model(P, reps: int, n: int, fwd: bool) -> dict:
    names = list(P.params)
    psi = tuple(p.detach().requires_grad_(True) for p in P.params.values())
    th = (P.theta.detach().requires_grad_(True),)
    gen = torch.Generator().manual_seed(1)
    v = tuple(torch.randn(p.shape, generator=gen) for p in psi)

    def flat_inner(ps, hs):
        return P.inner(dict(zip(names, ps)), hs[0])

    reuse = hg.InnerOperator(flat_inner, psi, th, engine="reuse")
    recompute = hg.InnerOperator(flat_inner, psi, th, engine="recompute")
    g = torch.autograd.grad(flat_inner(psi, th), psi, create_graph=True)
    pd, vd = {n: p.detach() for n, p in zip(names, psi)}, dict(zip(names, v))
    loss_of = lambda d: P.inner(d, P.theta.detach())  # noqa: E731
    fns = {
        "gradient": lambda: torch.autograd.grad(flat_inner(psi, th), psi),
        "reuse_setup": lambda: hg.InnerOperator(flat_inner, psi, th, engine="reuse"),
        "reuse_hvp": lambda: [reuse.hvp(v) for _ in range(n)],
        "raw_hvp": lambda: [torch.autograd.grad(g, psi, v, retain_graph=True) for _ in range(n)],
        "recompute_hvp": lambda: [recompute.hvp(v) for _ in range(n)],
        "fwd_over_rev_hvp": lambda: [jvp(fgrad(loss_of), (pd,), (vd,)) for _ in range(n)],
    }
    if not fwd:
        del fns["fwd_over_rev_hvp"]
    t = kit.timeit(fns, reps)
    per = {k: [x / (n if k.endswith("hvp") else 1) for x in r["times_s"]] for k, r in t.items()}
    med = {k: kit.median(x) if x else float("nan") for k, x in per.items()}
    errors = {k: r["errors"][0] for k, r in t.items() if r["errors"]}  # e.g. BatchNorm under jvp
    ratios = {k: m / med["gradient"] for k, m in med.items() if k != "gradient"}
    return {"times_s": per, "median_s": med, "ratio_to_gradient": ratios, "errors": errors}


def measure(o: dict, out, name: str) -> None:
    models = {}
    for m in o["models"]:
        batch = o["cnn_batch"] if m == "cnn" else 256
        P, n = random_net(m, batch), o[f"{m}_products"]
        reps = o["cnn_reps"] if m == "cnn" else o["reps"]
        r = models[m] = measure_model(P, reps, n, o["fwd"])
        r.update(params=P.numel, reps=reps, products=n, batch=batch)
        r["reuse_meets_target"] = r["ratio_to_gradient"]["reuse_hvp"] <= TARGET_REUSE
        kit.log(f"{m}: " + ", ".join(f"{k} {x:.2f}x" for k, x in r["ratio_to_gradient"].items()))
    res = {"target_reuse": TARGET_REUSE, "quick": o["quick"], "models": models}
    kit.save(out / f"{name}.json", res)
