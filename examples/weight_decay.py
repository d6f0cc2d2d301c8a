"""Per-feature L2 weight decay for logistic regression, tuned by implicit hypergradients.

Run: ``python examples/weight_decay.py`` (about 2 minutes on 2 shared CPU cores; ``--quick`` for a
smoke run). Data: scikit-learn's packaged ``breast_cancer`` (binary, 569 x 30) and ``digits``
(10 classes, 1797 x 64). Each is split 50/25/25 into train/validation/test (stratified, fixed by
``--seed``), features are standardised with the training mean/std and features that are
constant on the training split are dropped.

Inner problem (float64, solved by Newton's method with backtracking to ``||grad|| <= 1e-10``):

    min_{W,b}  mean_i CE(x_i W + b, y_i) + 1/2 sum_j exp(theta_j) ||W_j||^2

(``W_j`` is the row of feature j; binary: ``w`` in R^d and a scalar ``b``; multinomial: ``W`` in
R^{d x K} and ``K - 1`` free biases, the last class's bias fixed at 0, so that the problem is
strictly convex; the biases are not penalised). The hyperparameter is ``theta = log lambda``
(natural log). Outer problem: mean cross-entropy on the validation split.

(a) Scalar decay (``theta`` a 0-d tensor): gradient descent on ``theta`` with hypergradients from
    ``hg.implicit_grad(..., solver=hg.CG(tol=1e-12))`` (adaptive step: grow by 1.5 after an
    accepted step, halve and retry after a step that raises the validation loss), compared with
    the argmin of the validation loss over a grid of 60 values of log10(lambda) evenly spaced in
    [-6, 2] (natural-log spacing 0.31). Criterion (as in HOAG, Pedregosa 2016): the gradient
    solution is within 0.5 of the grid argmin in natural log lambda.
(b) One decay per feature (``theta`` in R^d), same gradient descent (100 hypergradients), started
    from the scalar optimum, ``theta`` kept in the grid's range [ln 1e-6, ln 1e2]; validation and
    test loss/accuracy are reported next to the best grid value. With many decays and a small
    validation set this overfits the validation set (see docs/examples.md). When CG does not
    reach its tolerance (tiny decays make the Hessian badly conditioned) the dense
    ``hg.Exact()`` solve is used instead and counted. ``--precond dense`` preconditions CG with
    the dense Hessian factor of an earlier step (``hg.DensePreconditioner``, kept across the
    steps), ``--solver exact``/``compiled-exact`` solve densely at every step.

A check: the scalar hypergradient at ln lambda = -2 against a central finite difference of the
Newton-solved validation loss.

Writes ``results.json``, ``weight_decay_grid.png`` (validation loss vs ln lambda, grid argmin
and gradient solution marked) and ``weight_decay_per_feature.png`` (validation and test loss
along the per-feature run) under ``--out`` (default ``runs/weight_decay``), and nowhere else
unless asked: ``--img-dir DIR`` also saves the plots in ``DIR``, and ``--update-docs-figures``
(full runs only) replaces the figures in ``docs/img/`` that ``docs/examples.md`` shows.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from _cli import add_adjoint_options, adjoint_starts, preconditioner
from sklearn.datasets import load_breast_cancer, load_digits
from sklearn.model_selection import train_test_split

import hypergrad as hg

DTYPE = torch.float64
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS_IMG = os.path.join(ROOT, "docs", "img")  # written only with --update-docs-figures
LOADERS = {"breast_cancer": load_breast_cancer, "digits": load_digits}
GRID_LOG10 = (-6.0, 2.0)
GRID_SIZE = 60
SOLVERS = ("cg", "exact", "compiled-exact")
HOAG_TOL = 0.5  # natural log lambda
BOX = (math.log(10.0) * GRID_LOG10[0], math.log(10.0) * GRID_LOG10[1])  # ln lambda range


@dataclass
class Task:
    """A standardised train/validation/test split and its model shape."""

    name: str
    xtr: torch.Tensor
    ytr: torch.Tensor
    xva: torch.Tensor
    yva: torch.Tensor
    xte: torch.Tensor
    yte: torch.Tensor
    classes: int
    compiled: dict = field(default_factory=dict)  # hg.compile_implicit_grad per solver

    @property
    def features(self) -> int:
        return self.xtr.shape[1]

    @property
    def binary(self) -> bool:
        return self.classes == 2

    # ---- parameters: a dict {"W", "b"} for hypergrad, a flat vector for Newton ------------
    def shapes(self) -> dict[str, tuple[int, ...]]:
        if self.binary:
            return {"W": (self.features,), "b": ()}
        return {"W": (self.features, self.classes), "b": (self.classes - 1,)}

    def zeros(self) -> dict[str, torch.Tensor]:
        return {k: torch.zeros(s, dtype=DTYPE) for k, s in self.shapes().items()}

    def flat(self, p: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([p["W"].reshape(-1), p["b"].reshape(-1)])

    def unflat(self, v: torch.Tensor) -> dict[str, torch.Tensor]:
        out, i = {}, 0
        for k, s in self.shapes().items():
            n = math.prod(s)
            out[k] = v[i : i + n].reshape(s)
            i += n
        return out

    # ---- losses ------------------------------------------------------------------------------
    def logits(self, p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        if self.binary:
            return x @ p["W"] + p["b"]
        return x @ p["W"] + torch.cat([p["b"], p["b"].new_zeros(1)])

    def ce(self, p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        z = self.logits(p, x)
        if self.binary:
            return F.binary_cross_entropy_with_logits(z, y.to(DTYPE))
        return F.cross_entropy(z, y)

    def accuracy(self, p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> float:
        z = self.logits(p, x)
        pred = (z > 0).long() if self.binary else z.argmax(1)
        return float((pred == y).to(DTYPE).mean())

    def inner(self, p: dict[str, torch.Tensor], theta: torch.Tensor) -> torch.Tensor:
        lam = theta.exp()
        w2 = p["W"] ** 2 if self.binary else (p["W"] ** 2).sum(1)
        return self.ce(p, self.xtr, self.ytr) + 0.5 * (lam * w2).sum()

    def outer(self, p: dict[str, torch.Tensor], theta: torch.Tensor) -> torch.Tensor:
        return self.ce(p, self.xva, self.yva)

    def test_loss(self, p: dict[str, torch.Tensor]) -> float:
        return float(self.ce(p, self.xte, self.yte))


def make_task(name: str, seed: int = 0) -> Task:
    """Stratified 50/25/25 split fixed by ``seed``; standardised with training statistics."""
    data = LOADERS[name]()
    x, y = data.data.astype(np.float64), data.target.astype(np.int64)
    idx = np.arange(len(y))
    tr, rest = train_test_split(idx, train_size=0.5, stratify=y, random_state=seed)
    va, te = train_test_split(rest, train_size=0.5, stratify=y[rest], random_state=seed)
    std = x[tr].std(0)
    keep = std > 1e-12  # digits has pixels that are always 0 on the training split
    mu, std = x[tr][:, keep].mean(0), std[keep]

    def prep(ix):
        return (
            torch.tensor((x[ix][:, keep] - mu) / std, dtype=DTYPE),
            torch.tensor(y[ix]),
        )

    (xtr, ytr), (xva, yva), (xte, yte) = prep(tr), prep(va), prep(te)
    return Task(name, xtr, ytr, xva, yva, xte, yte, int(y.max()) + 1)


def inner_hessian(task: Task, v: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """Closed-form Hessian of the inner loss in the flat parametrisation of :meth:`Task.flat`."""
    p = task.unflat(v)
    n, d = task.xtr.shape
    xa = torch.cat([task.xtr, task.xtr.new_ones(n, 1)], 1)  # features + intercept column
    lam = theta.exp() * torch.ones(d, dtype=DTYPE)
    if task.binary:
        s = torch.sigmoid(task.logits(p, task.xtr))
        h = xa.T @ (xa * (s * (1 - s))[:, None]) / n
        return h + torch.diag(torch.cat([lam, lam.new_zeros(1)]))
    k = task.classes
    pr = torch.softmax(task.logits(p, task.xtr), 1)  # (n, K)
    # d^2 CE / dz_k dz_m = p_k (delta_km - p_m); rows of V = [W; b_full] indexed (feature, class)
    curv = torch.diag_embed(pr) - pr[:, :, None] * pr[:, None, :]  # (n, K, K)
    h = torch.einsum("ij,ikm,il->jklm", xa, curv, xa) / n  # (d+1, K, d+1, K)
    h = h.reshape((d + 1) * k, (d + 1) * k)[:-1, :-1]  # drop the fixed last-class bias
    return h + torch.diag(torch.cat([lam.repeat_interleave(k), lam.new_zeros(k - 1)]))


def newton(
    task: Task,
    theta: torch.Tensor,
    p0: dict[str, torch.Tensor] | None = None,
    tol: float = 1e-10,
    maxiter: int = 100,
) -> tuple[dict[str, torch.Tensor], float, int]:
    """Minimise the inner loss by Newton's method (closed-form Hessian, autograd gradient) with
    Armijo backtracking, until ``||grad|| <= tol``.

    Returns ``(params, ||grad||, iterations)``; params are detached tensors.
    """
    theta = theta.detach()

    def f(v: torch.Tensor) -> torch.Tensor:
        return task.inner(task.unflat(v), theta)

    def grad(v: torch.Tensor) -> torch.Tensor:
        v = v.detach().requires_grad_(True)
        return torch.autograd.grad(f(v), v)[0]

    v = task.flat(task.zeros() if p0 is None else p0).detach().clone()
    for it in range(maxiter):
        g = grad(v)
        gnorm = float(g.norm())
        if gnorm <= tol:
            return task.unflat(v), gnorm, it
        step = torch.linalg.solve(inner_hessian(task, v, theta), -g)
        with torch.no_grad():
            fv, slope, t = float(f(v)), float(g @ step), 1.0
            # Armijo backtracking; once the predicted decrease is below the loss's rounding
            # error the test is meaningless and the full (quadratically convergent) step is taken
            if -slope > 1e-13 * max(1.0, abs(fv)):
                while t > 1e-10 and float(f(v + t * step)) > fv + 1e-4 * t * slope:
                    t *= 0.5
        v = (v + t * step).detach()
    return task.unflat(v), float(grad(v).norm()), it + 1


def val_loss_at(task: Task, theta: torch.Tensor, p0=None, tol=1e-10) -> tuple[float, dict]:
    p, _, _ = newton(task, theta, p0, tol)
    return float(task.outer(p, theta)), p


def hypergradient(
    task: Task,
    theta: torch.Tensor,
    p: dict[str, torch.Tensor],
    tol=1e-12,
    x0=None,
    precond: str | hg.DensePreconditioner | None = None,
    solver: str = "cg",
):
    """Implicit hypergradient d(val CE)/d(theta) at the inner solution ``p``.

    ``solver="exact"`` solves densely every time (``hg.Exact()``), ``"compiled-exact"`` does the
    same through ``hg.compile_implicit_grad`` (compiled on the first call for each shape of
    ``theta``; that call's time includes the compilation). The default ``"cg"``:

    CG first (from ``x0``, e.g. the previous step's adjoint, and with the ``precond``
    preconditioner when given: ``"hutchinson"`` or an ``hg.DensePreconditioner`` kept across
    the outer steps); when it does not reach ``tol`` (very small decays make the inner
    Hessian badly conditioned: CG stalls in floating point) the dense ``hg.Exact()`` solve is used
    instead and ``info.extras["fallback"]`` records it.
    """
    if solver == "exact":
        return hg.implicit_grad(task.inner, task.outer, p, theta.detach(), solver=hg.Exact())
    if solver == "compiled-exact":
        if solver not in task.compiled:
            task.compiled[solver] = hg.compile_implicit_grad(task.inner, task.outer)
        return task.compiled[solver](p, theta.detach())
    n = sum(v.numel() for v in p.values())
    krylov = hg.CG(maxiter=min(2 * n, 300), tol=tol, preconditioner=precond, probes=16)
    g, info = hg.implicit_grad(task.inner, task.outer, p, theta.detach(), solver=krylov, x0=x0)
    if not info.solve.converged:
        cg = info.solve
        g, info = hg.implicit_grad(task.inner, task.outer, p, theta.detach(), solver=hg.Exact())
        info.extras["fallback"] = {"cg_iterations": cg.iterations, "cg_residual": cg.residual}
    return g, info


def finite_difference_check(task: Task, log_lam: float = -2.0, eps: float = 1e-4) -> dict:
    """Scalar hypergradient at ``theta = log_lam`` against a central difference of the
    Newton-solved validation loss."""
    theta = torch.tensor(log_lam, dtype=DTYPE)
    p, gn, _ = newton(task, theta, tol=1e-13)
    g, info = hypergradient(task, theta, p)
    lp, _ = val_loss_at(task, theta + eps, p, tol=1e-13)
    lm, _ = val_loss_at(task, theta - eps, p, tol=1e-13)
    fd = (lp - lm) / (2 * eps)
    return {
        "log_lambda": log_lam,
        "implicit": float(g),
        "finite_difference": fd,
        "rel_error": abs(float(g) - fd) / max(abs(fd), 1e-300),
        "cg_iterations": info.solve.iterations,
        "cg_residual": info.solve.residual,
        "inner_grad_norm": gn,
    }


def grid_search(task: Task, size: int = GRID_SIZE) -> dict:
    """Validation/test loss of the Newton-solved model on a grid of scalar log lambda."""
    log_lams = np.log(10.0) * np.linspace(*GRID_LOG10, size)
    vals, tests, accs, p = [], [], [], None
    for ll in log_lams:  # warm start from large to small lambda would also do; order is kept
        theta = torch.tensor(float(ll), dtype=DTYPE)
        p, _, _ = newton(task, theta, p)
        vals.append(float(task.outer(p, theta)))
        tests.append(task.test_loss(p))
        accs.append(task.accuracy(p, task.xte, task.yte))
    best = int(np.argmin(vals))
    theta = torch.tensor(float(log_lams[best]), dtype=DTYPE)
    p, _, _ = newton(task, theta)
    return {
        "log_lambda": log_lams.tolist(),
        "val_loss": vals,
        "test_loss": tests,
        "test_acc": accs,
        "best_log_lambda": float(log_lams[best]),
        "best_val_loss": vals[best],
        "best_val_acc": task.accuracy(p, task.xva, task.yva),
        "best_test_loss": tests[best],
        "best_test_acc": accs[best],
    }


def gradient_descent(
    task: Task,
    theta0: torch.Tensor,
    steps: int,
    lr: float = 1.0,
    gtol: float = 1e-7,
    box: tuple[float, float] = BOX,
    warm_start: str | None = None,
    precond: str | None = None,
    solver: str = "cg",
) -> dict:
    """Projected gradient descent on ``theta`` with implicit hypergradients, adaptive step.

    After an accepted step (validation loss did not increase) the step size grows by 1.5; a
    rejected step halves it and retries from the same point. ``theta`` is kept in ``box`` (the
    grid's range). Stops after ``steps`` hypergradients or when the projected gradient's norm is
    ``<= gtol``.
    """
    theta = theta0.detach().clone()
    p, gn, _ = newton(task, theta)
    loss = float(task.outer(p, theta))
    history = []
    cg_iters, times, residuals, fallbacks = [], [], [], 0
    inner_gn = [gn]
    starts = adjoint_starts(warm_start)  # the kept CG adjoints start the next CG solve
    pre = preconditioner(precond or "none")  # a dense one keeps its factor across the steps
    for _ in range(steps):
        t0 = time.perf_counter()
        x0 = None if starts is None else starts.x0()
        g, info = hypergradient(task, theta, p, x0=x0, precond=pre, solver=solver)
        times.append(time.perf_counter() - t0)
        if starts is not None and "fallback" not in info.extras and info.solve.converged:
            starts.update(info)  # else keep the last ones
        cg_iters.append(info.extras.get("fallback", {}).get("cg_iterations", info.solve.iterations))
        fallbacks += "fallback" in info.extras
        residuals.append(info.solve.residual)
        gnorm = float((theta - (theta - g).clamp(*box)).norm())  # projected gradient
        history.append(
            {
                "theta": theta.tolist(),
                "val_loss": loss,
                "test_loss": task.test_loss(p),
                "grad_norm": gnorm,
                "hypergrad_time_s": times[-1],
                "cg_iterations": cg_iters[-1],
                "exact_fallback": "fallback" in info.extras,
            }
        )
        if gnorm <= gtol:
            break
        while lr > 1e-10:
            cand = (theta - lr * g).clamp(*box)
            pc, gnc, _ = newton(task, cand, p)
            lc = float(task.outer(pc, cand))
            if lc <= loss:
                theta, p, loss, lr = cand, pc, lc, lr * 1.5
                inner_gn.append(gnc)
                break
            lr *= 0.5
        else:
            break
    return {
        "theta": theta,
        "params": p,
        "val_loss": loss,
        "val_acc": task.accuracy(p, task.xva, task.yva),
        "test_loss": task.test_loss(p),
        "test_acc": task.accuracy(p, task.xte, task.yte),
        "hypergradients": len(history),
        "final_grad_norm": history[-1]["grad_norm"] if history else float("nan"),
        "history": history,
        "mean_cg_iterations": float(np.mean(cg_iters)) if cg_iters else 0.0,
        "max_cg_iterations": int(max(cg_iters)) if cg_iters else 0,
        "exact_fallbacks": fallbacks,
        "preconditioner_builds": getattr(pre, "builds", 0),  # hg.DensePreconditioner's
        "max_solve_residual": float(max(residuals)) if residuals else 0.0,
        "mean_hypergrad_time_s": float(np.mean(times)) if times else 0.0,
        "total_hypergrad_time_s": float(np.sum(times)),
        "total_cg_iterations": int(np.sum(cg_iters)),
        "max_inner_grad_norm": float(max(inner_gn)),
    }


def run_dataset(
    name: str,
    seed: int,
    steps_scalar: int,
    steps_feature: int,
    grid: int,
    warm_start: str | None = None,
    precond: str | None = None,
    solver: str = "cg",
) -> dict:
    task = make_task(name, seed)
    t0 = time.perf_counter()
    gs = grid_search(task, grid)
    t_grid = time.perf_counter() - t0
    t0 = time.perf_counter()
    kw = {"warm_start": warm_start, "precond": precond, "solver": solver}
    sc = gradient_descent(task, torch.tensor(0.0, dtype=DTYPE), steps_scalar, **kw)
    t_scalar = time.perf_counter() - t0
    theta_s = float(sc["theta"])
    t0 = time.perf_counter()
    pf = gradient_descent(
        task, torch.full((task.features,), theta_s, dtype=DTYPE), steps_feature, **kw
    )
    t_feature = time.perf_counter() - t0
    fd = finite_difference_check(task)
    lam_f = pf["theta"]
    strip = lambda r: {k: v for k, v in r.items() if k not in ("theta", "params")}  # noqa: E731
    return {
        "dataset": name,
        "solver": solver,
        "sizes": {"train": len(task.ytr), "val": len(task.yva), "test": len(task.yte)},
        "features": task.features,
        "classes": task.classes,
        "grid": gs,
        "grid_time_s": t_grid,
        "scalar": {**strip(sc), "log_lambda": theta_s, "time_s": t_scalar},
        "scalar_gap_to_grid": abs(theta_s - gs["best_log_lambda"]),
        "scalar_within_hoag_tol": abs(theta_s - gs["best_log_lambda"]) <= HOAG_TOL,
        "per_feature": {
            **strip(pf),
            "history": [{k: v for k, v in h.items() if k != "theta"} for h in pf["history"]],
            "log_lambda": lam_f.tolist(),
            "log_lambda_range": [float(lam_f.min()), float(lam_f.max())],
            "time_s": t_feature,
        },
        "finite_difference_check": fd,
    }


def plot(results: list[dict], paths: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), squeeze=False)
    for ax, r in zip(axes[0], results):
        g = r["grid"]
        ax.plot(g["log_lambda"], g["val_loss"], "-", color="C0", label="validation CE (grid)")
        ax.plot(g["log_lambda"], g["test_loss"], "--", color="C7", lw=1, label="test CE (grid)")
        ax.plot(
            g["best_log_lambda"],
            g["best_val_loss"],
            "o",
            ms=9,
            mfc="none",
            color="C3",
            label=f"grid argmin ln λ={g['best_log_lambda']:.2f}",
        )
        hist = [h["theta"] for h in r["scalar"]["history"]]
        hv = [h["val_loss"] for h in r["scalar"]["history"]]
        ax.plot(hist, hv, ".", color="C1", ms=4, alpha=0.6, label="gradient-descent iterates")
        ax.plot(
            r["scalar"]["log_lambda"],
            r["scalar"]["val_loss"],
            "*",
            ms=13,
            color="C2",
            label=f"hypergradient ln λ={r['scalar']['log_lambda']:.2f}",
        )
        ax.axhline(
            r["per_feature"]["val_loss"],
            color="C4",
            ls=":",
            lw=1.2,
            label=f"per-feature decay: val CE {r['per_feature']['val_loss']:.3f}",
        )
        ax.set_xlabel("ln λ (natural log)")
        ax.set_ylabel("cross-entropy")
        ax.set_title(f"{r['dataset']} (scalar L2 decay)")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    for path in paths:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_per_feature(results: list[dict], paths: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 3.6), squeeze=False)
    for ax, r in zip(axes[0], results):
        hist = r["per_feature"]["history"]
        ax.plot([h["val_loss"] for h in hist], color="C0", label="validation CE")
        ax.plot([h["test_loss"] for h in hist], color="C3", label="test CE")
        ax.axhline(r["grid"]["best_val_loss"], color="C0", ls=":", lw=1, label="grid best: val")
        ax.axhline(r["grid"]["best_test_loss"], color="C3", ls=":", lw=1, label="grid best: test")
        ax.set_xlabel("hypergradient step (per-feature decays, from the scalar optimum)")
        ax.set_ylabel("cross-entropy")
        ax.set_yscale("log")
        ax.set_title(f"{r['dataset']}: one decay per feature", fontsize=10)
        ax.legend(fontsize=7)
    fig.tight_layout()
    for path in paths:
        fig.savefig(path, dpi=110)
    plt.close(fig)


def solve_summary(r: dict) -> str:
    """How the per-feature run's adjoint systems were solved, for the summary line."""
    pf = r["per_feature"]
    if r.get("solver", "cg") != "cg":
        return f"--solver {r['solver']}: one dense solve each"
    builds = pf.get("preconditioner_builds", 0)
    return (
        f"mean CG iterations {pf['mean_cg_iterations']:.1f}, "
        f"{pf['exact_fallbacks']} dense Exact() fallbacks"
        + (f", {builds} dense preconditioner builds" if builds else "")
    )


def print_table(results: list[dict]) -> None:
    print(
        f"\n{'dataset':<14}{'method':<24}{'ln λ':>16}{'val CE':>9}{'val acc':>9}"
        f"{'test CE':>9}{'test acc':>9}"
    )
    for r in results:
        g, s, p = r["grid"], r["scalar"], r["per_feature"]
        lo, hi = p["log_lambda_range"]
        rows = [
            (
                "grid argmin (scalar)",
                f"{g['best_log_lambda']:.3f}",
                g["best_val_loss"],
                g["best_val_acc"],
                g["best_test_loss"],
                g["best_test_acc"],
            ),
            (
                "hypergradient scalar",
                f"{s['log_lambda']:.3f}",
                s["val_loss"],
                s["val_acc"],
                s["test_loss"],
                s["test_acc"],
            ),
            (
                "hypergradient per-feat.",
                f"[{lo:.1f}, {hi:.1f}]",
                p["val_loss"],
                p["val_acc"],
                p["test_loss"],
                p["test_acc"],
            ),
        ]
        for i, (m, ll, vl, va, tl, ta) in enumerate(rows):
            print(
                f"{r['dataset'] if i == 0 else '':<14}{m:<24}{ll:>16}{vl:>9.4f}{va:>9.4f}"
                f"{tl:>9.4f}{ta:>9.4f}"
            )
    print()
    for r in results:
        fd = r["finite_difference_check"]
        sc, pf = r["scalar"], r["per_feature"]
        verdict = "PASS" if r["scalar_within_hoag_tol"] else "FAIL"
        inner_gn = max(sc["max_inner_grad_norm"], pf["max_inner_grad_norm"])
        print(
            f"{r['dataset']}: |ln λ_grad - ln λ_grid| = {r['scalar_gap_to_grid']:.3f} "
            f"(HOAG criterion <= {HOAG_TOL}: {verdict}); "
            f"scalar GD {sc['hypergradients']} hypergradients, final |g| "
            f"{sc['final_grad_norm']:.1e}; per-feature GD {pf['hypergradients']}"
            f" hypergradients ({solve_summary(r)}); "
            f"max inner ||grad|| {inner_gn:.1e}"
        )
        print(
            f"{'':<{len(r['dataset'])}}  finite-difference check at ln λ={fd['log_lambda']}: "
            f"implicit {fd['implicit']:.10f} vs central FD {fd['finite_difference']:.10f} "
            f"(rel. error {fd['rel_error']:.1e})"
        )


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--datasets", nargs="+", default=list(LOADERS), choices=list(LOADERS))
    ap.add_argument("--quick", action="store_true", help="few steps, for tests")
    ap.add_argument("--steps", type=int, default=None, help="hypergradients for (a) (default 100)")
    ap.add_argument("--feature-steps", type=int, default=None, help="for (b) (default 100)")
    ap.add_argument("--grid", type=int, default=GRID_SIZE, help="grid size (default 60)")
    ap.add_argument("--seed", type=int, default=0)
    add_adjoint_options(ap)
    ap.add_argument(
        "--solver", choices=SOLVERS, default="cg",
        help="adjoint solve: CG with a dense fallback (default), hg.Exact every time, or "
        "hg.Exact through hg.compile_implicit_grad",
    )  # fmt: skip
    ap.add_argument("--out", default="runs/weight_decay")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--img-dir", default=None, help="also save the plots in this folder")
    ap.add_argument(
        "--update-docs-figures",
        action="store_true",
        help="also replace the figures in docs/img (full runs only; default: plots under --out)",
    )
    args = ap.parse_args(argv)
    if args.update_docs_figures and args.quick:
        ap.error("--update-docs-figures needs a full run: a --quick run's plots are not the docs'")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _main(args)
    finally:
        torch.set_num_threads(threads)


def _main(args: argparse.Namespace) -> list[dict]:
    steps = args.steps or (30 if args.quick else 100)
    fsteps = args.feature_steps or (20 if args.quick else 100)
    t0 = time.perf_counter()
    results = []
    for name in args.datasets:
        print(f"[{name}] grid ({args.grid} values), scalar GD ({steps}), per-feature GD ({fsteps})")
        precond = None if args.precond == "none" else args.precond
        results.append(
            run_dataset(
                name, args.seed, steps, fsteps, args.grid, args.warm_start, precond, args.solver
            )
        )
    wall = time.perf_counter() - t0
    print_table(results)
    print(f"wall time {wall:.1f} s")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"args": vars(args), "wall_time_s": wall, "results": results}, f, indent=1)
    dirs = [args.out] + ([args.img_dir] if args.img_dir else [])
    if args.update_docs_figures:
        dirs.append(DOCS_IMG)
    paths = [os.path.join(d, "weight_decay_grid.png") for d in dirs]
    plot(results, paths)
    paths_pf = [os.path.join(d, "weight_decay_per_feature.png") for d in dirs]
    plot_per_feature(results, paths_pf)
    print("saved", os.path.join(args.out, "results.json"), "and", ", ".join(paths + paths_pf))
    return results


if __name__ == "__main__":
    main()
