"""Data hyper-cleaning (Franceschi et al., ICML 2017) on Fashion-MNIST with implicit hypergradients.

Run: ``python examples/hyper_cleaning.py`` (``--quick`` for a small smoke run). Needs the Debian
package ``dataset-fashion-mnist`` (``apt-get install dataset-fashion-mnist``); without it the
script exits with code 2 and says so.

Protocol (all randomness from ``--seed``):

* data: the first 20,000 official training images are shuffled; the first 5,000 of the shuffled
  order are the training set, the next 5,000 the validation set (the other 10,000 are unused);
  the test set is the official 10,000-image test set (``--quick``: 1,000 / 1,000 and a random
  2,000 of the test set). Pixels are scaled to [0, 1] and centred by
  the training-set mean pixel vector (``--no-center`` keeps raw [0, 1] pixels).
* corruption: half of the training labels (2,500) are replaced by a different class drawn
  uniformly from the 9 others; validation and test labels are clean.
* model: linear softmax classifier ``z = x W + b`` (7,850 parameters), float64.
* coordinates: the solvers work with ``W = T A``, ``T = V S``, where ``V`` holds the
  eigenvectors of the training pixel covariance ``C`` and ``S = diag(c_j / 10 + l2)^(-1/2)``
  (``c_j`` the eigenvalues; 1/10 is the softmax curvature at uniform predictions). The penalty is
  rewritten accordingly, ``||W||^2 = sum_j S_jj^2 ||A_j||^2``, so the optimisation problem, its
  solution ``W`` and the hypergradient (which does not depend on the inner coordinates) are
  exactly those of the pixel-space model; only the conditioning improves (about 4x fewer L-BFGS
  and CG iterations at the start). The script checks this at step 0 by also computing the
  hypergradient in pixel coordinates (cosine reported); ``--no-whiten`` solves in pixel
  coordinates throughout.
* hyperparameters: one logit ``h_i`` per training example, weight ``gamma_i = sigmoid(h_i)``,
  ``h`` initialised at 0 (``gamma = 0.5``).
* inner problem: ``sum_i gamma_i CE_i / n + l2/2 (||W||^2 + ||b||^2)`` with ``l2 = 1e-3``
  (``--l2``). Penalising the bias too makes the problem ``l2``-strongly convex (the softmax is
  invariant to shifting all logits, so the unpenalised loss has flat directions). Solved by
  L-BFGS warm-started from the previous outer step's solution until ``||grad|| <= 1e-5``
  (Euclidean norm of the gradient in the solver's coordinates; ``--inner-tol``).
* outer problem: mean cross-entropy on the validation set, minimised over ``h`` by Adam
  (lr 0.1, 60 steps) with hypergradients from ``hg.implicit_grad(..., solver=hg.CG(tol=1e-5))``.
* comparison: at the first, middle and last outer step the hypergradient is also computed by
  ``hg.unrolled_grad`` (gradient descent with step 1/L from the current inner solution, T
  steps, backpropagating through the last K); the time per hypergradient and the cosine
  similarity to the implicit one are reported.
* evaluation (test accuracy; every model below minimises ``sum_i w_i CE_i / sum_i w_i +
  l2/2 ||(W, b)||^2`` to ``||grad|| <= 1e-6``):
    - baseline: corrupted training set + validation set, all weights 1;
    - oracle: the 2,500 uncorrupted training examples + validation set;
    - cleaner (the reported result): training set with weights ``gamma`` (learned) + validation
      set with weights 1;
    - also reported: the inner solution itself (training set only, weights ``gamma``), and a hard
      filter (training examples not flagged + validation set).
  An example is *flagged* as corrupted when ``gamma_i < 0.5``; precision/recall/F1 of the flags
  against the true corruption mask are reported.

Outputs under ``--out`` (default ``runs/hyper_cleaning``): ``results.json``, ``history.json``
and the two plots (``hyper_cleaning_weights.png``, ``hyper_cleaning_curves.png``). The script
writes nowhere else unless asked: ``--img-dir DIR`` also saves the plots in ``DIR``, and
``--update-docs-figures`` (full runs only) replaces the figures in ``docs/img/`` that
``docs/examples.md`` shows.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import torchopt

import hypergrad as hg

try:
    from tqdm.auto import tqdm
except ImportError:  # progress bar is optional
    tqdm = None

import _fashion_mnist as fm
from _cli import add_adjoint_options, adjoint_starts, preconditioner

DTYPE = torch.float64
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS_IMG = os.path.join(ROOT, "docs", "img")  # written only with --update-docs-figures
FULL_SIZES = (5000, 5000, 10000)
QUICK_SIZES = (1000, 1000, 2000)


# ---------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------
def load_data(
    data_dir: str,
    seed: int,
    sizes: tuple[int, int, int] = FULL_SIZES,
    center: bool = True,
    corrupt_frac: float = 0.5,
) -> dict[str, torch.Tensor]:
    """Train/validation split of the first 20,000 training images, test = official test set.

    Returns float64 ``xtr, xva, xte`` and int64 ``ytr`` (corrupted), ``ytr_clean``, ``yva``,
    ``yte``, and the bool mask ``corrupted``.
    """
    n_tr, n_va, n_te = sizes
    if n_tr + n_va > 20000:
        raise ValueError("train + validation must fit in the first 20,000 training images")
    raw = fm.load(data_dir)
    rng = np.random.default_rng(seed)
    perm = rng.permutation(20000)
    tr, va = perm[:n_tr], perm[n_tr : n_tr + n_va]
    te = np.arange(n_te) if n_te == 10000 else rng.permutation(10000)[:n_te]

    def pix(a: np.ndarray) -> torch.Tensor:
        return torch.tensor(a, dtype=DTYPE) / 255.0

    xtr, xva = pix(raw["train_images"][tr]), pix(raw["train_images"][va])
    xte = pix(raw["test_images"][te])
    if center:
        mu = xtr.mean(0)
        xtr, xva, xte = xtr - mu, xva - mu, xte - mu
    ytr_clean = torch.tensor(raw["train_labels"][tr].astype(np.int64))
    n_bad = int(round(corrupt_frac * n_tr))
    bad = rng.permutation(n_tr)[:n_bad]
    shift = rng.integers(1, 10, size=n_bad)  # 1..9: always a different class
    ytr = ytr_clean.clone()
    ytr[bad] = (ytr_clean[bad] + torch.tensor(shift)) % 10
    corrupted = torch.zeros(n_tr, dtype=torch.bool)
    corrupted[bad] = True
    return {
        "xtr": xtr,
        "ytr": ytr,
        "ytr_clean": ytr_clean,
        "corrupted": corrupted,
        "xva": xva,
        "yva": torch.tensor(raw["train_labels"][va].astype(np.int64)),
        "xte": xte,
        "yte": torch.tensor(raw["test_labels"][te].astype(np.int64)),
    }


# ---------------------------------------------------------------------------------------------
# model, losses, solvers
# ---------------------------------------------------------------------------------------------
def whiten(data: dict[str, torch.Tensor], l2: float, classes: int = 10, enabled: bool = True):
    """Add ``ztr, zva, zte`` (features in the solver's coordinates), ``pen`` (per-row penalty
    weights, ``||W||^2 = sum_j pen_j ||A_j||^2``) and the map ``T`` (``W = T A``) to ``data``."""
    x = data["xtr"]
    d = x.shape[1]
    if enabled:
        evals, vecs = torch.linalg.eigh(x.T @ x / x.shape[0])
        scale = (evals.clamp_min(0.0) / classes + l2).rsqrt()
        t, pen = vecs * scale, scale**2
    else:
        t, pen = torch.eye(d, dtype=DTYPE), torch.ones(d, dtype=DTYPE)
    data.update(T=t, pen=pen, ztr=x @ t, zva=data["xva"] @ t, zte=data["xte"] @ t)
    return data


def zeros_params(d: int = 784, k: int = 10) -> dict[str, torch.Tensor]:
    return {"W": torch.zeros(d, k, dtype=DTYPE), "b": torch.zeros(k, dtype=DTYPE)}


def logits(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return x @ p["W"] + p["b"]


def accuracy(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> float:
    return float((logits(p, x).argmax(1) == y).to(DTYPE).mean())


def sq_norm(p: dict[str, torch.Tensor], pen: torch.Tensor) -> torch.Tensor:
    """``||W||^2 + ||b||^2`` of the pixel-space model (``pen`` converts from ``A``)."""
    return (pen[:, None] * p["W"] ** 2).sum() + (p["b"] ** 2).sum()


def make_losses(data: dict[str, torch.Tensor], l2: float, pixel_space: bool = False):
    """Inner and outer losses ``(params, h) -> scalar`` of the bilevel problem, over the solver's
    coordinates ``{"W": A, "b": b}`` (pixel coordinates when ``pixel_space``)."""
    if pixel_space:
        xtr, xva, pen = data["xtr"], data["xva"], torch.ones(data["xtr"].shape[1], dtype=DTYPE)
    else:
        xtr, xva, pen = data["ztr"], data["zva"], data["pen"]
    ytr, yva = data["ytr"], data["yva"]
    n = len(ytr)

    def inner(p, h):
        ce = F.cross_entropy(logits(p, xtr), ytr, reduction="none")
        return (torch.sigmoid(h) * ce).sum() / n + 0.5 * l2 * sq_norm(p, pen)

    def outer(p, h):
        return F.cross_entropy(logits(p, xva), yva)

    return inner, outer


def weighted_objective(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, l2: float, pen):
    """``sum_i w_i CE_i / sum_i w_i + l2/2 ||(W, b)||^2`` (used for every evaluated model)."""
    total = float(w.sum())

    def f(p):
        ce = F.cross_entropy(logits(p, x), y, reduction="none")
        return (w * ce).sum() / total + 0.5 * l2 * sq_norm(p, pen)

    return f


def lbfgs(
    f,
    p0: dict[str, torch.Tensor],
    tol: float = 1e-6,
    max_iter: int = 3000,
    history: int = 20,
    chunk: int = 5,
) -> tuple[dict[str, torch.Tensor], float, int]:
    """Minimise ``f(params)`` by L-BFGS (strong Wolfe line search) from ``p0`` until the
    gradient's Euclidean norm is ``<= tol``. Returns ``(params, ||grad||, iterations)``.

    torch's LBFGS stops on ``max |grad|``; here it runs in chunks of ``chunk`` iterations (its
    curvature history persists between calls) and the Euclidean norm is checked in between.
    """
    p = {k: v.detach().clone().requires_grad_(True) for k, v in p0.items()}
    leaves = list(p.values())
    opt = torch.optim.LBFGS(
        leaves,
        lr=1.0,
        max_iter=chunk,
        tolerance_grad=1e-300,
        tolerance_change=1e-300,
        history_size=history,
        line_search_fn="strong_wolfe",
    )

    def closure():
        opt.zero_grad()
        loss = f(p)
        loss.backward()
        return loss

    def gnorm() -> float:
        with torch.enable_grad():
            g = torch.autograd.grad(f(p), leaves)
        return float(torch.sqrt(sum((gi**2).sum() for gi in g)))

    gn, iters = gnorm(), 0
    while gn > tol and iters < max_iter:
        opt.step(closure)
        new_iters = opt.state[opt._params[0]]["n_iter"]
        if new_iters == iters:  # no progress possible (line search failed)
            break
        iters = new_iters
        gn = float(torch.sqrt(sum((v.grad**2).sum() for v in leaves)))  # grad at the last eval
        if gn <= tol:
            gn = gnorm()  # the last closure may have been a line-search trial point
    return {k: v.detach() for k, v in p.items()}, gn, iters


def lipschitz(inner, p: dict[str, torch.Tensor], h: torch.Tensor, iters: int = 30) -> float:
    """Largest Hessian eigenvalue of the inner loss at ``p`` by power iteration (HVPs from
    :class:`hypergrad.InnerOperator`)."""
    keys = list(p)
    psi = tuple(p[k].detach().requires_grad_(True) for k in keys)
    op = hg.InnerOperator(
        lambda ps, hs: inner(dict(zip(keys, ps)), hs[0]), psi, (h.detach().requires_grad_(True),)
    )
    gen = torch.Generator().manual_seed(0)
    v = tuple(torch.randn(t.shape, generator=gen, dtype=t.dtype) for t in psi)
    lam = 0.0
    for _ in range(iters):
        nv = math.sqrt(sum(float((t**2).sum()) for t in v))
        v = tuple(t / nv for t in v)
        hv = op.hvp(v)
        lam = sum(float((a * b).sum()) for a, b in zip(v, hv))
        v = hv
    return lam


def to_pixel_space(data, p: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"W": data["T"] @ p["W"], "b": p["b"]}


def pixel_grad_norm(data, l2: float, p: dict[str, torch.Tensor], h: torch.Tensor) -> float:
    """Euclidean norm of the inner gradient w.r.t. the pixel-space ``(W, b)`` at ``p``."""
    inner_px, _ = make_losses(data, l2, pixel_space=True)
    q = {k: v.detach().requires_grad_(True) for k, v in to_pixel_space(data, p).items()}
    with torch.enable_grad():
        g = torch.autograd.grad(inner_px(q, h), list(q.values()))
    return float(torch.sqrt(sum((gi**2).sum() for gi in g)))


def check_pixel_space(data, args, p, h, solver) -> dict:
    """Hypergradient with the inner variables in pixel coordinates (same solution, mapped back)
    against the one in the whitened coordinates: they must agree (cosine ~ 1)."""
    inner, outer = make_losses(data, args.l2)
    inner_px, outer_px = make_losses(data, args.l2, pixel_space=True)
    g, info = hg.implicit_grad(inner, outer, p, h, solver=solver)
    q, gn, _ = lbfgs(lambda r: inner_px(r, h), to_pixel_space(data, p), tol=args.inner_tol)
    g_px, info_px = hg.implicit_grad(inner_px, outer_px, q, h, solver=solver)
    return {
        "cosine": cosine(g, g_px),
        "rel_diff": float((g - g_px).norm() / g_px.norm()),
        "cg_iterations_whitened": info.solve.iterations,
        "cg_iterations_pixel": info_px.solve.iterations,
        "time_s_whitened": info.time_s,
        "time_s_pixel": info_px.time_s,
        "pixel_inner_grad_norm": gn,
    }


def flag_scores(gamma: torch.Tensor, corrupted: torch.Tensor, threshold: float = 0.5) -> dict:
    """Precision/recall/F1 of ``gamma < threshold`` as a detector of corrupted labels."""
    flagged = gamma < threshold
    tp = int((flagged & corrupted).sum())
    fp = int((flagged & ~corrupted).sum())
    fn = int((~flagged & corrupted).sum())
    prec = tp / (tp + fp) if tp + fp else 0.0
    rec = tp / (tp + fn) if tp + fn else 0.0
    f1 = 2 * prec * rec / (prec + rec) if prec + rec else 0.0
    return {"precision": prec, "recall": rec, "f1": f1, "flagged": int(flagged.sum())}


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a * b).sum() / (a.norm() * b.norm()).clamp_min(1e-300))


# ---------------------------------------------------------------------------------------------
# experiment
# ---------------------------------------------------------------------------------------------
def fit_eval(data, x, y, w, l2, p0, tol) -> dict:
    p, gn, it = lbfgs(weighted_objective(x, y, w, l2, data["pen"]), p0, tol=tol)
    return {
        "test_acc": accuracy(p, data["zte"], data["yte"]),
        "grad_norm": gn,
        "lbfgs_iterations": it,
        "n_examples": len(y),
        "total_weight": float(w.sum()),
    }


def unrolled_comparison(inner, outer, p, h, g_impl, t_impl, lr, configs) -> list[dict]:
    """``hg.unrolled_grad`` (GD with step ``lr`` from the inner solution ``p``) per (T, K)."""
    rows = []
    for steps, trunc in configs:
        c0 = time.process_time()
        g, info = hg.unrolled_grad(
            inner, outer, p, h, steps=steps, optimizer=torchopt.sgd(lr=lr), truncate=trunc
        )
        rows.append(
            {
                "steps": steps,
                "truncate": trunc,
                "time_s": info.time_s,
                "cpu_s": time.process_time() - c0,
                "cosine_to_implicit": cosine(g, g_impl),
                "norm_ratio": float(g.norm() / g_impl.norm()),
                "implicit_time_s": t_impl[0],
                "implicit_cpu_s": t_impl[1],
            }
        )
    return rows


@dataclass
class Setup:
    """What :func:`setup` prepares for the outer loop: the data and losses, the solver, the
    hyperparameters with their optimiser, and the first inner solution."""

    data: dict[str, torch.Tensor]
    sizes: tuple[int, int, int]
    inner: Callable
    outer: Callable
    solver: hg.CG
    starts: Any  # the adjoint warm starts of --warm-start (None: every solve starts at 0)
    h: torch.Tensor  # one logit per training example, optimised by ``opt``
    opt: torch.optim.Optimizer
    p: dict[str, torch.Tensor]  # the inner solution at the current h
    gn: float  # its gradient norm
    it: int  # its L-BFGS iterations
    p_init: dict[str, torch.Tensor]  # the inner solution at the initial h (the baseline's start)
    lip: float  # the Hessian's largest eigenvalue there (the unrolled step is 1 / lip)
    pixel_check: dict | None
    t_start: float
    cpu_start: float


@dataclass
class Loop:
    """What :func:`outer_loop` records."""

    history: list[dict]  # one row per outer step
    comparisons: list[dict]  # the unrolled hypergradients against the implicit one
    hg_times: list[tuple[float, float]]  # (wall, CPU) seconds per implicit hypergradient
    t_loop: float  # wall seconds from the start of setup to the end of the loop


def setup(args: argparse.Namespace) -> Setup:
    """Data, losses, solver and the first inner solve; the step-0 pixel-coordinates check."""
    torch.manual_seed(args.seed)
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    t_start, cpu_start = time.perf_counter(), time.process_time()
    data = load_data(args.data_dir, args.seed, sizes, center=not args.no_center)
    whiten(data, args.l2, enabled=not args.no_whiten)
    inner, outer = make_losses(data, args.l2)
    n = len(data["ytr"])
    solver = hg.CG(
        maxiter=args.cg_maxiter, tol=args.cg_tol,
        preconditioner=preconditioner(args.precond), probes=args.probes,
    )  # fmt: skip
    starts = adjoint_starts(args.warm_start)  # --warm-start: the adjoints start the next solve

    h = torch.full((n,), args.h_init, dtype=DTYPE, requires_grad=True)
    opt = torch.optim.Adam([h], lr=args.lr)
    p, gn, it = lbfgs(lambda q: inner(q, h.detach()), zeros_params(), tol=args.inner_tol)
    lip = lipschitz(inner, p, h)
    pixel_check = None
    if not args.no_whiten and not args.no_pixel_check:
        pixel_check = check_pixel_space(data, args, p, h.detach(), solver)
    return Setup(
        data, sizes, inner, outer, solver, starts, h, opt, p, gn, it, p, lip, pixel_check,
        t_start, cpu_start,
    )  # fmt: skip


def outer_loop(args: argparse.Namespace, s: Setup) -> Loop:
    """``args.steps`` Adam steps on ``s.h`` with implicit hypergradients, re-solving the inner
    problem after each (``s.h``, ``s.p``, ``s.gn`` and ``s.it`` are updated in place); the
    unrolled comparison at the first, middle and last step."""
    data, inner, outer, corrupted = s.data, s.inner, s.outer, s.data["corrupted"]
    h, starts = s.h, s.starts
    unroll_lr = 1.0 / s.lip
    check_at = sorted({0, args.steps // 2, args.steps - 1})
    history, comparisons, hg_times = [], [], []
    bar = (
        tqdm(range(args.steps), desc="outer steps", disable=args.no_progress)
        if tqdm is not None
        else range(args.steps)
    )
    for step in bar:
        hd = h.detach()
        c0 = time.process_time()
        x0 = None if starts is None else starts.x0()
        g, info = hg.implicit_grad(inner, outer, s.p, hd, solver=s.solver, x0=x0)
        cpu_hg = time.process_time() - c0
        if starts is not None:  # keeps converged solves' adjoints only; forgets on the others
            starts.update(info if info.solve.converged else None)
        hg_times.append((info.time_s, cpu_hg))
        gamma = torch.sigmoid(hd)
        rec = {
            "step": step,
            "val_loss": info.outer_loss,
            "val_acc": accuracy(s.p, data["zva"], data["yva"]),
            **{f"flag_{k}": v for k, v in flag_scores(gamma, corrupted).items()},
            "inner_grad_norm": s.gn,
            "lbfgs_iterations": s.it,
            "cg_iterations": info.solve.iterations,
            "cg_matvecs": info.solve.matvecs,
            "cg_residual": info.solve.residual,
            "cg_converged": bool(info.solve.converged),
            "hypergrad_norm": info.hypergrad_norm,
            "hypergrad_time_s": info.time_s,
            "hypergrad_cpu_s": cpu_hg,
            "mean_gamma_clean": float(gamma[~corrupted].mean()),
            "mean_gamma_corrupted": float(gamma[corrupted].mean()),
        }
        history.append(rec)
        if step in check_at and not args.no_unrolled:
            rows = unrolled_comparison(
                inner, outer, s.p, hd, g, (info.time_s, cpu_hg), unroll_lr, args.unrolled
            )
            for r in rows:
                r["outer_step"] = step
            comparisons.extend(rows)
        if tqdm is not None and hasattr(bar, "set_postfix"):
            bar.set_postfix(
                val=f"{rec['val_loss']:.4f}", f1=f"{rec['flag_f1']:.3f}", cg=rec["cg_iterations"]
            )
        s.opt.zero_grad()
        h.grad = g
        s.opt.step()
        s.p, s.gn, s.it = lbfgs(lambda q: inner(q, h.detach()), s.p, tol=args.inner_tol)
    return Loop(history, comparisons, hg_times, time.perf_counter() - s.t_start)


def evaluate_models(args: argparse.Namespace, s: Setup, gamma: torch.Tensor) -> dict:
    """Test accuracy of the baseline, oracle, cleaner, hard filter and the inner solution.

    The baseline starts from the initial inner solution, the others from the final one; the
    objectives are strongly convex, so the start only affects the time needed."""
    data, p, corrupted = s.data, s.p, s.data["corrupted"]
    xtr, ytr, xva, yva = data["ztr"], data["ytr"], data["zva"], data["yva"]
    ones_va = torch.ones(len(yva), dtype=DTYPE)
    x_all, y_all = torch.cat([xtr, xva]), torch.cat([ytr, yva])
    tol = args.eval_tol
    return {
        "baseline": fit_eval(
            data, x_all, y_all, torch.ones(len(y_all), dtype=DTYPE), args.l2, s.p_init, tol
        ),
        "oracle": fit_eval(
            data,
            torch.cat([xtr[~corrupted], xva]),
            torch.cat([ytr[~corrupted], yva]),
            torch.ones(int((~corrupted).sum()) + len(yva), dtype=DTYPE),
            args.l2,
            p,
            tol,
        ),
        "cleaner": fit_eval(data, x_all, y_all, torch.cat([gamma, ones_va]), args.l2, p, tol),
        "cleaner_hard_filter": fit_eval(
            data,
            torch.cat([xtr[gamma >= 0.5], xva]),
            torch.cat([ytr[gamma >= 0.5], yva]),
            torch.ones(int((gamma >= 0.5).sum()) + len(yva), dtype=DTYPE),
            args.l2,
            p,
            tol,
        ),
        "inner_solution": {
            "test_acc": accuracy(p, data["zte"], data["yte"]),
            "grad_norm": s.gn,
            "n_examples": len(ytr),
            "total_weight": float(gamma.sum()),
        },
    }


def unrolled_summary(args: argparse.Namespace, comparisons: list[dict]) -> dict:
    """Per unrolled configuration: mean time and the cosines to the implicit hypergradient."""
    summary = {}
    for steps, trunc in args.unrolled:
        rows = [r for r in comparisons if r["steps"] == steps and r["truncate"] == trunc]
        if rows:
            summary[f"T={steps},K={trunc}"] = {
                "mean_time_s": float(np.mean([r["time_s"] for r in rows])),
                "mean_cpu_s": float(np.mean([r["cpu_s"] for r in rows])),
                "implicit_mean_cpu_s_same_steps": float(
                    np.mean([r["implicit_cpu_s"] for r in rows])
                ),
                "cosines": [r["cosine_to_implicit"] for r in rows],
                "outer_steps": [r["outer_step"] for r in rows],
            }
    return summary


def results(args: argparse.Namespace, s: Setup, loop: Loop) -> dict:
    """The final state evaluated: models, flags, solver statistics and timings, as one dict."""
    data, p, corrupted, history = s.data, s.p, s.data["corrupted"], loop.history
    hd = s.h.detach()
    gamma = torch.sigmoid(hd)
    final_val = float(s.outer(p, hd))
    flags = flag_scores(gamma, corrupted)
    models = evaluate_models(args, s, gamma)
    wall, cpu = time.perf_counter() - s.t_start, time.process_time() - s.cpu_start
    comp_summary = unrolled_summary(args, loop.comparisons)
    hg_times = loop.hg_times
    return {
        "config": {
            **{k: v for k, v in vars(args).items() if k != "unrolled"},
            "unrolled": [list(c) for c in args.unrolled],
            "sizes": {"train": s.sizes[0], "val": s.sizes[1], "test": len(data["yte"])},
            "corrupted": int(corrupted.sum()),
            "torch_threads": torch.get_num_threads(),
        },
        "test_accuracy": {k: v["test_acc"] for k, v in models.items()},
        "models": models,
        "flags": flags,
        "final_val_loss": final_val,
        "initial_val_loss": history[0]["val_loss"],
        "mean_gamma_clean": float(gamma[~corrupted].mean()),
        "mean_gamma_corrupted": float(gamma[corrupted].mean()),
        "implicit": {
            "mean_time_s": float(np.mean([t[0] for t in hg_times])),
            "mean_cpu_s": float(np.mean([t[1] for t in hg_times])),
            "mean_cg_iterations": float(np.mean([r["cg_iterations"] for r in history])),
            "total_time_s": float(np.sum([t[0] for t in hg_times])),
            "total_cpu_s": float(np.sum([t[1] for t in hg_times])),
            "total_matvecs": int(np.sum([r["cg_matvecs"] for r in history])),
            "warm_start": args.warm_start,
            "preconditioner": args.precond,
            "max_cg_residual": float(max(r["cg_residual"] for r in history)),
            "all_cg_converged": all(r["cg_converged"] for r in history),
            "max_inner_grad_norm": float(max(r["inner_grad_norm"] for r in history)),
            "final_inner_grad_norm": s.gn,
            "mean_lbfgs_iterations_warm": float(
                np.mean([r["lbfgs_iterations"] for r in history[1:]] or [0])
            ),
            "hessian_lmax": s.lip,
            "final_inner_grad_norm_pixel_space": pixel_grad_norm(data, args.l2, p, hd),
        },
        "pixel_space_check": s.pixel_check,
        "unrolled": comp_summary,
        "unrolled_rows": loop.comparisons,
        "loop_wall_s": loop.t_loop,
        "wall_s": wall,
        "cpu_s": cpu,
        "gamma": gamma.tolist(),
        "corrupted_mask": corrupted.tolist(),
        "history": history,
    }


def run(args: argparse.Namespace) -> dict:
    """The whole experiment: :func:`setup`, :func:`outer_loop`, then :func:`results`."""
    s = setup(args)
    loop = outer_loop(args, s)
    return results(args, s, loop)


# ---------------------------------------------------------------------------------------------
# reporting
# ---------------------------------------------------------------------------------------------
def plot(res: dict, paths_weights: list[str], paths_curves: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gamma = np.array(res["gamma"])
    bad = np.array(res["corrupted_mask"], dtype=bool)
    fig, ax = plt.subplots(figsize=(6, 3.8))
    bins = np.linspace(0, 1, 41)
    ax.hist(gamma[~bad], bins=bins, alpha=0.65, label=f"clean ({(~bad).sum()})", color="C0")
    ax.hist(gamma[bad], bins=bins, alpha=0.65, label=f"corrupted ({bad.sum()})", color="C3")
    ax.axvline(0.5, color="k", ls=":", lw=1, label="flag threshold γ < 0.5")
    ax.set_xlabel("learned weight γ = sigmoid(h)")
    ax.set_ylabel("training examples")
    f = res["flags"]
    ax.set_title(
        f"Hyper-cleaning weights (P={f['precision']:.3f}, R={f['recall']:.3f}, F1={f['f1']:.3f})",
        fontsize=10,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    for path in paths_weights:
        fig.savefig(path, dpi=110)
    plt.close(fig)

    hist = res["history"]
    steps = [r["step"] for r in hist]
    fig, ax1 = plt.subplots(figsize=(6, 3.8))
    ax1.plot(steps, [r["val_loss"] for r in hist], color="C0", label="validation CE")
    ax1.set_xlabel("outer step")
    ax1.set_ylabel("validation cross-entropy", color="C0")
    ax2 = ax1.twinx()
    ax2.plot(steps, [r["flag_f1"] for r in hist], color="C3", label="F1 of flags (γ < 0.5)")
    ax2.plot(
        steps, [r["flag_precision"] for r in hist], color="C3", ls=":", lw=1, label="precision"
    )
    ax2.plot(steps, [r["flag_recall"] for r in hist], color="C3", ls="--", lw=1, label="recall")
    ax2.set_ylabel("flagging scores", color="C3")
    ax2.set_ylim(0, 1)
    lines = ax1.get_lines() + ax2.get_lines()
    ax1.legend(lines, [ln.get_label() for ln in lines], fontsize=8, loc="center right")
    ax1.set_title("Hyper-cleaning: outer optimisation", fontsize=10)
    fig.tight_layout()
    for path in paths_curves:
        fig.savefig(path, dpi=110)
    plt.close(fig)


def report(res: dict) -> None:
    acc = res["test_accuracy"]
    cfg = res["config"]
    s = cfg["sizes"]
    print(
        f"\nData: {s['train']} train ({cfg['corrupted']} labels corrupted) / {s['val']} val / "
        f"{s['test']} test; l2={cfg['l2']:g}; {cfg['steps']} outer steps (Adam lr {cfg['lr']})"
    )
    print(f"{'model':<44}{'test acc':>10}")
    names = {
        "baseline": "baseline (corrupted train + val)",
        "oracle": "oracle (clean half of train + val)",
        "cleaner": "cleaner (train weighted by γ + val)",
        "cleaner_hard_filter": "cleaner, hard filter (γ >= 0.5 + val)",
        "inner_solution": "inner solution at learned γ (train only)",
    }
    for k, name in names.items():
        print(f"{name:<44}{acc[k]:>10.4f}")
    f = res["flags"]
    print(
        f"flagged (γ < 0.5): {f['flagged']}  precision {f['precision']:.4f}  recall "
        f"{f['recall']:.4f}  F1 {f['f1']:.4f};  mean γ clean {res['mean_gamma_clean']:.3f}, "
        f"corrupted {res['mean_gamma_corrupted']:.3f}"
    )
    print(f"validation CE {res['initial_val_loss']:.4f} -> {res['final_val_loss']:.4f}")
    im = res["implicit"]
    print(
        f"implicit (CG): {im['mean_time_s']:.2f} s wall / {im['mean_cpu_s']:.2f} s CPU per "
        f"hypergradient, {im['mean_cg_iterations']:.1f} "
        f"CG iterations on average, max residual {im['max_cg_residual']:.1e}; inner L-BFGS "
        f"{im['mean_lbfgs_iterations_warm']:.1f} warm-started iterations/step, max final "
        f"||grad|| {im['max_inner_grad_norm']:.1e}; Hessian λmax {im['hessian_lmax']:.3f}"
    )
    pc = res["pixel_space_check"]
    if pc:
        print(
            f"step-0 check, hypergradient in whitened vs pixel coordinates: cosine "
            f"{pc['cosine']:.8f}, rel. diff {pc['rel_diff']:.1e}; CG iterations "
            f"{pc['cg_iterations_whitened']} vs {pc['cg_iterations_pixel']}, time "
            f"{pc['time_s_whitened']:.2f} s vs {pc['time_s_pixel']:.2f} s"
        )
    print(
        f"final inner ||grad|| in pixel coordinates {im['final_inner_grad_norm_pixel_space']:.1e}"
    )
    for name, c in res["unrolled"].items():
        cs = ", ".join(f"{x:.3f}" for x in c["cosines"])
        print(
            f"unrolled ({name}, GD lr 1/λmax from the inner solution): {c['mean_time_s']:.2f} s "
            f"wall / {c['mean_cpu_s']:.2f} s CPU per hypergradient (implicit at the same steps: "
            f"{c['implicit_mean_cpu_s_same_steps']:.2f} s CPU); cosine to implicit at outer steps "
            f"{c['outer_steps']}: {cs}"
        )
    print(f"wall time {res['wall_s']:.1f} s, process CPU time {res['cpu_s']:.1f} s")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Data hyper-cleaning on Fashion-MNIST")
    ap.add_argument("--quick", action="store_true", help="1000/1000/2000 subset, for tests")
    ap.add_argument("--steps", type=int, default=None, help="outer steps (default 60; quick 30)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-dir", default=fm.DEFAULT_DIR)
    ap.add_argument("--out", default="runs/hyper_cleaning")
    ap.add_argument("--img-dir", default=None, help="also save the plots in this folder")
    ap.add_argument(
        "--update-docs-figures",
        action="store_true",
        help="also replace the figures in docs/img (full runs only; default: plots under --out)",
    )
    ap.add_argument("--l2", type=float, default=1e-3, help="inner L2 on W and b")
    ap.add_argument("--lr", type=float, default=0.1, help="Adam learning rate on h")
    ap.add_argument("--h-init", type=float, default=0.0)
    ap.add_argument("--inner-tol", type=float, default=1e-5, help="L-BFGS ||grad|| tolerance")
    ap.add_argument(
        "--eval-tol", type=float, default=1e-6, help="||grad|| tolerance of the evaluated models"
    )
    ap.add_argument("--cg-tol", type=float, default=1e-5, help="CG relative residual")
    ap.add_argument("--cg-maxiter", type=int, default=500)
    add_adjoint_options(ap)
    ap.add_argument("--no-center", action="store_true", help="keep raw [0, 1] pixels")
    ap.add_argument("--no-whiten", action="store_true", help="solve in pixel coordinates")
    ap.add_argument(
        "--no-pixel-check", action="store_true", help="skip the step-0 pixel-coordinates check"
    )
    ap.add_argument("--no-unrolled", action="store_true", help="skip the unrolled comparison")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (default 1: fastest on shared cores)"
    )
    ap.add_argument(
        "--unrolled",
        default=None,
        help="unrolled configs T:K[,T:K...] (inner steps : truncation); default 100:10,100:100",
    )
    args = ap.parse_args(argv)
    if args.update_docs_figures and args.quick:
        ap.error("--update-docs-figures needs a full run: a --quick run's plots are not the docs'")
    if args.steps is None:
        args.steps = 30 if args.quick else 60
    spec = args.unrolled or ("20:5,20:20" if args.quick else "100:10,100:100")
    args.unrolled = [tuple(int(v) for v in c.split(":")) for c in spec.split(",")]
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _main(args)
    finally:
        torch.set_num_threads(threads)


def _main(args: argparse.Namespace) -> dict:
    if not fm.available(args.data_dir):
        print(
            fm.INSTALL_HINT.format(
                dir=args.data_dir, files=", ".join(fm.missing_files(args.data_dir))
            ),
            file=sys.stderr,
        )
        raise SystemExit(2)
    res = run(args)
    report(res)
    os.makedirs(args.out, exist_ok=True)
    hist = res.pop("history")
    with open(os.path.join(args.out, "history.json"), "w") as f:
        json.dump(hist, f)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(
            {k: v for k, v in res.items() if k not in ("gamma", "corrupted_mask")}, f, indent=1
        )
    res["history"] = hist
    names = ("hyper_cleaning_weights.png", "hyper_cleaning_curves.png")
    dirs = [args.out] + ([args.img_dir] if args.img_dir else [])
    if args.update_docs_figures:
        dirs.append(DOCS_IMG)
    for d in dirs:
        os.makedirs(d, exist_ok=True)
    plot(res, [os.path.join(d, names[0]) for d in dirs], [os.path.join(d, names[1]) for d in dirs])
    print("saved", os.path.join(args.out, "results.json"), "and plots in", ", ".join(dirs))
    return res


if __name__ == "__main__":
    main()
