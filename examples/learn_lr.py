"""Learning SGD's and Adam's learning rate (and SGD's momentum) by differentiating through the
training run: ``hg.unrolled_grad`` with the optimizer written as a function of the
hyperparameters.

Run: ``python examples/learn_lr.py`` (seconds on one CPU thread; ``--quick`` for a smaller grid
and fewer outer steps). Writes ``results.json`` and ``learn_lr.png`` under ``--out`` (default
``runs/learn_lr``), nothing else.

Idea: the validation loss after ``T`` steps of an optimizer is a differentiable function of the
optimizer's settings, so its gradient w.r.t. ``log lr`` can be computed by reverse-mode
differentiation through the ``T`` updates (Maclaurin, Duvenaud & Adams, "Gradient-based
Hyperparameter Optimization through Reversible Learning", ICML 2015) and the learning rate tuned
by gradient descent, as "hypergradient descent" does online (Baydin, Cornish, Martinez Rubio,
Schmidt & Wood, "Online Learning Rate Adaptation with Hypergradient Descent", ICLR 2018). Here the
whole run of ``T`` steps is differentiated (no truncation, no online approximation).

Problem (float64): logistic regression on scikit-learn's ``breast_cancer`` (569 x 30, shipped with
the package), split 50/25/25 into train/validation/test (stratified, seeded by ``--seed``),
features standardised with the training statistics. The inner run is ``T`` (default 20)
full-batch steps on the mean training cross-entropy from ``w = 0, b = 0``; the outer loss is the
validation cross-entropy of the parameters after those ``T`` steps. Three optimizers:

* ``sgd``: ``hg.optim.sgd(lr=exp(h["log_lr"]), momentum=0.9)`` (heavy ball, as
  ``torch.optim.SGD``);
* ``adam``: ``hg.optim.adam(lr=exp(h["log_lr"]))`` (betas 0.9, 0.999);
* ``sgd_mom``: ``hg.optim.sgd(lr=exp(h["log_lr"]), momentum=sigmoid(h["logit_momentum"]))``,
  learning the momentum too.

The hypergradient is ``hg.unrolled_grad(inner, outer, params0, h, steps=T,
optimizer=lambda h: hg.optim.sgd(lr=h["log_lr"].exp(), momentum=0.9))``: the function receives the
hyperparameter tensors being differentiated. ``log lr`` starts at ``ln 1e-3`` (momentum 0.5 for
``sgd_mom``) and is updated by Adam (``--outer-lr`` 0.1) for ``--iters`` (300) outer steps; the
learned setting is the last iterate.

Why ``log lr`` and a momentum logit: they keep the settings in range whatever the outer steps do.
A learning rate learned directly can be stepped below zero, and then the inner steps *ascend* the
training loss; ``exp`` keeps it positive (and makes the outer steps relative), ``sigmoid`` keeps
the momentum in (0, 1). ``hg.optim`` refuses a negative or non-finite setting when the optimizer
is built, and warns (``hg.optim.OptimizerSettingWarning``, once) if a tensor setting it was built
from leaves its range later; the parameterisation makes both impossible.

Comparison: the validation loss after ``T`` steps on a grid of ``--grid`` (40) values of
``log lr`` evenly spaced in [-7, 2] (natural log; for ``sgd_mom`` a 40 x 15 grid with momentum in
[0, 0.98]); the learned setting should reach the grid's best validation loss (it may do slightly
better: it is not restricted to the grid).

Check (``finite_difference_check``, also used by ``tests/examples/test_example_learn_lr.py``): the
unrolled hypergradient w.r.t. ``log lr`` (and the momentum logit) against central finite
differences (``eps = 1e-5``) of the validation loss after ``T`` steps of ``torch.optim.SGD`` /
``torch.optim.Adam`` run in float64 with the setting moved by ``+-eps``: an independent
implementation of the optimizers. It runs at the starting point and at ``ln lr = -3`` (momentum
0.8 for ``sgd_mom``), where the slope is far from zero, not at the optimum, where the
hypergradient vanishes and a relative error would mean nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from _cli import torch_threads
from sklearn.datasets import load_breast_cancer
from sklearn.model_selection import train_test_split

import hypergrad as hg

DTYPE = torch.float64
GRID_RANGE = (-7.0, 2.0)  # natural log of the learning rate
MOMENTUM_GRID = (0.0, 0.98)
START_LOG_LR = math.log(1e-3)
START_MOMENTUM = 0.5
OPTIMIZERS = ("sgd", "adam", "sgd_mom")
LABELS = {
    "sgd": "SGD, momentum 0.9",
    "adam": "Adam",
    "sgd_mom": "SGD, learned momentum",
}
Params = dict[str, torch.Tensor]


# ----------------------------------------------------------------------------------------------
# the problem
# ----------------------------------------------------------------------------------------------


def make_problem(seed: int = 0) -> dict[str, torch.Tensor]:
    """Stratified 50/25/25 split of ``breast_cancer``, standardised with training statistics."""
    d = load_breast_cancer()
    x, y = d.data.astype(np.float64), d.target.astype(np.float64)
    idx = np.arange(len(y))
    tr, rest = train_test_split(idx, train_size=0.5, stratify=y, random_state=seed)
    va, te = train_test_split(rest, train_size=0.5, stratify=y[rest], random_state=seed)
    mu, sd = x[tr].mean(0), x[tr].std(0)
    out = {}
    for name, ix in (("train", tr), ("val", va), ("test", te)):
        out[f"x_{name}"] = torch.tensor((x[ix] - mu) / sd, dtype=DTYPE)
        out[f"y_{name}"] = torch.tensor(y[ix], dtype=DTYPE)
    return out


def bce(p: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(x @ p["w"] + p["b"], y)


def params0(prob: dict) -> Params:
    """The fixed initialisation: zeros."""
    return {
        "w": torch.zeros(prob["x_train"].shape[1], dtype=DTYPE),
        "b": torch.zeros((), dtype=DTYPE),
    }


def losses(prob: dict) -> tuple[Callable, Callable]:
    """``inner(params, h)``: training cross-entropy; ``outer(params, h)``: validation
    cross-entropy (neither uses ``h`` directly: the settings act through the optimizer)."""

    def inner(p: Params, h) -> torch.Tensor:
        return bce(p, prob["x_train"], prob["y_train"])

    def outer(p: Params, h) -> torch.Tensor:
        return bce(p, prob["x_val"], prob["y_val"])

    return inner, outer


def settings(kind: str, h: dict[str, torch.Tensor], momentum: float = 0.9) -> dict:
    """The optimizer's settings as functions of the hyperparameter tensors."""
    lr = h["log_lr"].exp()
    if kind == "sgd":
        return {"lr": lr, "momentum": momentum}
    if kind == "sgd_mom":
        return {"lr": lr, "momentum": torch.sigmoid(h["logit_momentum"])}
    if kind == "adam":
        return {"lr": lr}
    raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {kind!r}")


def make_optimizer(kind: str, momentum: float = 0.9) -> Callable:
    """``h -> hypergrad.optim`` optimizer, differentiable in ``h``."""

    def build(h):
        s = settings(kind, h, momentum)
        return hg.optim.adam(**s) if kind == "adam" else hg.optim.sgd(**s)

    return build


def initial_hparams(kind: str) -> dict[str, torch.Tensor]:
    h = {"log_lr": torch.tensor(START_LOG_LR, dtype=DTYPE)}
    if kind == "sgd_mom":
        p = START_MOMENTUM
        h["logit_momentum"] = torch.tensor(math.log(p / (1 - p)), dtype=DTYPE)
    return h


def check_point(kind: str) -> dict[str, torch.Tensor]:
    """A second point for the finite-difference check, between the start and the optimum (at
    the optimum the hypergradient vanishes and a relative error means nothing)."""
    h = {"log_lr": torch.tensor(-3.0, dtype=DTYPE)}
    if kind == "sgd_mom":
        h["logit_momentum"] = torch.tensor(math.log(0.8 / 0.2), dtype=DTYPE)
    return h


def hypergradient(prob: dict, kind: str, h: dict, steps: int, momentum: float = 0.9):
    """``(d val loss / d h, info)`` through ``steps`` optimizer updates from :func:`params0`."""
    inner, outer = losses(prob)
    return hg.unrolled_grad(
        inner, outer, params0(prob), h, steps=steps, optimizer=make_optimizer(kind, momentum)
    )


def torch_optim_run(
    prob: dict, kind: str, lr: float, momentum: float, steps: int
) -> tuple[float, Params]:
    """Validation loss after ``steps`` of ``torch.optim.SGD``/``Adam`` (the reference)."""
    p = {k: v.clone().requires_grad_(True) for k, v in params0(prob).items()}
    if kind == "adam":
        opt = torch.optim.Adam(p.values(), lr=lr)
    else:
        opt = torch.optim.SGD(p.values(), lr=lr, momentum=momentum)
    inner, outer = losses(prob)
    for _ in range(steps):
        opt.zero_grad()
        inner(p, None).backward()
        opt.step()
    with torch.no_grad():
        return float(outer(p, None)), {k: v.detach() for k, v in p.items()}


def val_loss_at(prob: dict, kind: str, h: dict, steps: int, momentum: float = 0.9) -> float:
    """Validation loss after ``steps`` of the torch.optim optimizer at the settings ``h``."""
    mom = float(torch.sigmoid(h["logit_momentum"])) if kind == "sgd_mom" else momentum
    return torch_optim_run(prob, kind, float(h["log_lr"].exp()), mom, steps)[0]


# ----------------------------------------------------------------------------------------------
# the check, the grid and the outer optimisation
# ----------------------------------------------------------------------------------------------


def finite_difference_check(
    prob: dict, kind: str, h: dict, steps: int, momentum: float = 0.9, eps: float = 1e-5
) -> list[dict]:
    """The unrolled hypergradient, coordinate by coordinate, against central differences of the
    validation loss after ``steps`` of ``torch.optim`` (float64) at ``h +- eps e_k``."""
    g, _ = hypergradient(prob, kind, h, steps, momentum)
    rows = []
    for name in h:
        vals = []
        for sign in (1.0, -1.0):
            hs = {k: v.clone() for k, v in h.items()}
            hs[name] = hs[name] + sign * eps
            vals.append(val_loss_at(prob, kind, hs, steps, momentum))
        fd = (vals[0] - vals[1]) / (2 * eps)
        an = float(g[name])
        rows.append(
            {
                "hparam": name,
                "at": float(h[name]),
                "unrolled": an,
                "finite_difference": fd,
                "rel_err": abs(an - fd) / max(abs(fd), abs(an), 1e-300),
            }
        )
    return rows


def grid_search(prob: dict, kind: str, steps: int, size: int, momentum: float = 0.9) -> dict:
    """Validation loss after ``steps`` on a grid of ``log lr`` (x momentum for ``sgd_mom``)."""
    log_lrs = np.linspace(*GRID_RANGE, size)
    moms = np.linspace(*MOMENTUM_GRID, max(3, (15 * size) // 40)) if kind == "sgd_mom" else None
    if moms is None:
        vals = np.array(
            [torch_optim_run(prob, kind, math.exp(a), momentum, steps)[0] for a in log_lrs]
        )
        best = int(np.nanargmin(vals))
        return {
            "log_lr": log_lrs.tolist(),
            "val_loss": vals.tolist(),
            "best_log_lr": float(log_lrs[best]),
            "best_val_loss": float(vals[best]),
        }
    vals = np.array(
        [[torch_optim_run(prob, "sgd", math.exp(a), m, steps)[0] for a in log_lrs] for m in moms]
    )
    i, j = np.unravel_index(int(np.nanargmin(vals)), vals.shape)
    return {
        "log_lr": log_lrs.tolist(),
        "momentum": moms.tolist(),
        "val_loss": vals.tolist(),
        "best_log_lr": float(log_lrs[j]),
        "best_momentum": float(moms[i]),
        "best_val_loss": float(vals[i, j]),
    }


def learn(
    prob: dict, kind: str, steps: int, iters: int, outer_lr: float, momentum: float = 0.9
) -> dict:
    """Adam on the hyperparameters with unrolled hypergradients; returns the trajectory."""
    h = {k: v.clone().requires_grad_(True) for k, v in initial_hparams(kind).items()}
    opt = torch.optim.Adam(h.values(), lr=outer_lr)
    traj: dict[str, list] = {"val_loss": [], "grad_norm": []}
    traj.update({k: [] for k in h})
    t0 = time.perf_counter()
    for _ in range(iters):
        g, info = hypergradient(prob, kind, {k: v.detach() for k, v in h.items()}, steps, momentum)
        for k, v in h.items():
            traj[k].append(float(v.detach()))
            v.grad = g[k].clone()
        traj["val_loss"].append(info.outer_loss)
        traj["grad_norm"].append(info.hypergrad_norm)
        opt.step()
    seconds = time.perf_counter() - t0
    final = {k: v.detach() for k, v in h.items()}
    _, info = hypergradient(prob, kind, final, steps, momentum)
    for k, v in final.items():
        traj[k].append(float(v))
    traj["val_loss"].append(info.outer_loss)
    mom = float(torch.sigmoid(final["logit_momentum"])) if kind == "sgd_mom" else momentum
    out = {
        "log_lr": float(final["log_lr"]),
        "lr": math.exp(float(final["log_lr"])),
        "momentum": None if kind == "adam" else mom,
        "val_loss": info.outer_loss,
        "trajectory": traj,
        "seconds": seconds,
        "seconds_per_hypergradient": seconds / max(iters, 1),
    }
    p = info.params
    out["test_loss"] = float(bce(p, prob["x_test"], prob["y_test"]))
    out["test_acc"] = accuracy(p, prob["x_test"], prob["y_test"])
    return out


def accuracy(p: Params, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float(((x @ p["w"] + p["b"] > 0).to(DTYPE) == y).to(DTYPE).mean())


def grid_test_metrics(prob: dict, kind: str, grid: dict, steps: int, momentum: float) -> dict:
    mom = grid.get("best_momentum", momentum)
    _, p = torch_optim_run(prob, kind, math.exp(grid["best_log_lr"]), mom, steps)
    return {
        "test_loss": float(bce(p, prob["x_test"], prob["y_test"])),
        "test_acc": accuracy(p, prob["x_test"], prob["y_test"]),
    }


# ----------------------------------------------------------------------------------------------
# reporting
# ----------------------------------------------------------------------------------------------


def plot(path: str, res: dict) -> bool:
    """Validation loss vs log lr (grid) with the learned trajectory; the 2-D grid for sgd_mom."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    kinds = list(res["optimizers"])
    fig, axes = plt.subplots(1, len(kinds), figsize=(5.3 * len(kinds), 4), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        r = res["optimizers"][kind]
        g, lr_ = r["grid"], r["learned"]
        tr = lr_["trajectory"]
        if kind != "sgd_mom":
            ax.plot(g["log_lr"], g["val_loss"], "-", color="C0", label="grid (T steps)")
            ax.plot(tr["log_lr"], tr["val_loss"], ".", color="C1", ms=4, alpha=0.6,
                    label="outer iterates")  # fmt: skip
            ax.plot(g["best_log_lr"], g["best_val_loss"], "o", mfc="none", ms=10, color="C3",
                    label=f"grid best {g['best_val_loss']:.4f}")  # fmt: skip
            ax.plot(lr_["log_lr"], lr_["val_loss"], "*", ms=13, color="C2",
                    label=f"learned {lr_['val_loss']:.4f}")  # fmt: skip
            ax.set_yscale("log")
            ax.set_ylabel("validation cross-entropy after T steps")
        else:
            vals = np.log10(np.array(g["val_loss"]))
            cs = ax.contourf(g["log_lr"], g["momentum"], vals, levels=30, cmap="viridis")
            fig.colorbar(cs, ax=ax, label="log10 validation CE")
            mom = 1 / (1 + np.exp(-np.array(tr["logit_momentum"])))
            ax.plot(tr["log_lr"], mom, ".-", color="w", ms=3, lw=0.8, label="outer iterates")
            ax.plot(g["best_log_lr"], g["best_momentum"], "o", mfc="none", ms=10, color="C3",
                    label=f"grid best {g['best_val_loss']:.4f}")  # fmt: skip
            ax.plot(lr_["log_lr"], lr_["momentum"], "*", ms=13, color="C1",
                    label=f"learned {lr_['val_loss']:.4f}")  # fmt: skip
            ax.set_ylabel("momentum")
        ax.set_xlabel("ln learning rate")
        ax.set_title(f"{LABELS[kind]} (T = {res['steps']})")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller grid, fewer outer steps")
    ap.add_argument("--seed", type=int, default=0, help="train/validation/test split")
    ap.add_argument("--out", default="runs/learn_lr", help="folder for results.json and the plot")
    ap.add_argument(
        "--iters", type=int, default=None, help="outer Adam steps (default 300; quick 100)"
    )
    ap.add_argument("--steps", type=int, default=20, help="inner optimizer steps T")
    ap.add_argument("--outer-lr", type=float, default=None, help="outer Adam lr (default 0.1)")
    ap.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (sgd)")
    ap.add_argument("--grid", type=int, default=None, help="grid size in log lr (default 40)")
    ap.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=list(OPTIMIZERS))
    ap.add_argument("--no-progress", dest="progress", action="store_false")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = ap.parse_args(argv)
    if args.iters is None:
        args.iters = 100 if args.quick else 300
    if args.outer_lr is None:
        args.outer_lr = 0.2 if args.quick else 0.1
    if args.grid is None:
        args.grid = 16 if args.quick else 40
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    with torch_threads(args.threads):
        return _main(args)


def _main(args: argparse.Namespace) -> dict:
    t_start = time.time()
    os.makedirs(args.out, exist_ok=True)
    prob = make_problem(args.seed)
    res: dict = {
        "args": vars(args),
        "steps": args.steps,
        "sizes": {k: len(prob[f"y_{k}"]) for k in ("train", "val", "test")},
        "optimizers": {},
    }
    for kind in args.optimizers:
        t = time.time()
        check = finite_difference_check(
            prob, kind, initial_hparams(kind), args.steps, args.momentum
        )
        grid = grid_search(prob, kind, args.steps, args.grid, args.momentum)
        grid.update(grid_test_metrics(prob, kind, grid, args.steps, args.momentum))
        learned = learn(prob, kind, args.steps, args.iters, args.outer_lr, args.momentum)
        check_mid = finite_difference_check(
            prob, kind, check_point(kind), args.steps, args.momentum
        )
        res["optimizers"][kind] = {
            "grid": grid,
            "learned": learned,
            "gap_to_grid_best": learned["val_loss"] - grid["best_val_loss"],
            "finite_difference_check": check + check_mid,
            "max_rel_err": max(r["rel_err"] for r in check + check_mid),
            "seconds": time.time() - t,
        }
        if args.progress:
            print(f"{LABELS[kind]}: done in {time.time() - t:.1f} s")

    n = res["sizes"]
    print(
        f"\nbreast_cancer logistic regression ({n['train']} train / {n['val']} val / {n['test']} "
        f"test), T = {args.steps} full-batch steps from zero; outer: Adam (lr {args.outer_lr}) on "
        f"ln lr from {START_LOG_LR:.2f}, {args.iters} steps; grid: {args.grid} values of ln lr "
        f"in [{GRID_RANGE[0]}, {GRID_RANGE[1]}]"
    )
    print(
        f"{'optimizer':<24}{'':<10}{'ln lr':>8}{'momentum':>10}{'val CE':>10}{'test CE':>10}"
        f"{'test acc':>10}"
    )
    for kind, r in res["optimizers"].items():
        g, lr_ = r["grid"], r["learned"]
        gm = g.get("best_momentum", None if kind == "adam" else args.momentum)
        rows = [
            ("grid best", g["best_log_lr"], gm, g["best_val_loss"], g["test_loss"], g["test_acc"]),
            ("learned", lr_["log_lr"], lr_["momentum"], lr_["val_loss"], lr_["test_loss"],
             lr_["test_acc"]),
        ]  # fmt: skip
        for i, (name, a, m, v, tl, ta) in enumerate(rows):
            ms = "-" if m is None else f"{m:.3f}"
            print(
                f"{LABELS[kind] if i == 0 else '':<24}{name:<10}{a:>8.3f}{ms:>10}{v:>10.5f}"
                f"{tl:>10.5f}{ta:>10.4f}"
            )
    print()
    for kind, r in res["optimizers"].items():
        print(
            f"{LABELS[kind]}: learned - grid best val CE = {r['gap_to_grid_best']:+.2e}; "
            f"unrolled vs torch.optim central differences: max rel err {r['max_rel_err']:.1e} "
            f"({len(r['finite_difference_check'])} checks); "
            f"{r['learned']['seconds_per_hypergradient'] * 1e3:.1f} ms per hypergradient"
        )
    png = os.path.join(args.out, "learn_lr.png")
    res["plot"] = png if plot(png, res) else None
    res["seconds"] = time.time() - t_start
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {args.out}/results.json{' and ' + png if res['plot'] else ''}")
    print(f"total {res['seconds']:.1f} s")
    return res


if __name__ == "__main__":
    main()
