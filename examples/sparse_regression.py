"""Sparse regression with learned per-group lasso / elastic-net penalties, against scikit-learn's
LassoCV and ElasticNetCV.

Run: ``python examples/sparse_regression.py`` (under a minute on 2 shared CPU cores; ``--quick``
for a smoke run). Data: scikit-learn's packaged ``diabetes`` (442 x 10, nothing to download),
expanded to its degree-2 polynomial features: the 10 base features, their 10 squares and 45
pairwise products, less ``sex^2`` (``sex`` takes two values, so its square is the same column
after standardisation): **64 features**. The split is 50/25/25 train/validation/test (seeded
by ``--seed``); features are standardised and the target centred and scaled with the training
statistics (mean squared errors are reported in the target's original units).

Groups: the base features fall into three blocks, ``demographic`` (age, sex), ``bmi_bp`` (bmi,
bp) and ``serum`` (s1-s6). Each feature belongs to one of **9 groups**: the main effects of
each block (3 groups) and the second-order terms of each pair of blocks (``demographic x
demographic``, ``demographic x bmi_bp``, ..., ``serum x serum``: 6 groups).

Inner problem (float64; the scaling of ``sklearn.linear_model.Lasso``, so that ``alpha`` and
``lambda`` are the same number):

    lasso:        min_w  1/(2n) ||X w - y||^2 + sum_j lambda_g(j) |w_j|
    elastic net:  min_w  1/(2n) ||X w - y||^2 + sum_j lambda_g(j) (|w_j| + gamma/2 w_j^2)

with ``lambda_g = exp(eta_g)`` (one eta for all groups in the single-lambda model) and
``gamma = exp(zeta)`` (sklearn's ``ElasticNet(alpha, l1_ratio)`` is ``lambda = alpha * l1_ratio``,
``gamma = (1 - l1_ratio) / l1_ratio``). It is solved by FISTA with the fixed step ``1/L``
(``hg.inner.ProximalGradient``, warm-started from the previous outer step) and differentiated
through the fixed point of the proximal-gradient map
``w = prox(w - s grad f(w), lambda, s)`` (``hg.custom_fixed_point``, GMRES). Outer problem: the
validation MSE; Adam on ``eta`` (and ``zeta``) for ``--steps`` steps, started from the values
that LassoCV / ElasticNetCV choose. The reported learned model is the last iterate.

Baselines (scikit-learn, same standardised data): the all-zero model (the training mean);
``LassoCV`` and ``ElasticNetCV`` (5-fold cross-validation on the training split, then refit on
it); and, for a fair comparison with the learned models, which see the validation split,
the lasso path and the elastic-net paths (one per l1_ratio) fitted on the training split and
scored on the validation split (the best alpha, or (alpha, l1_ratio), by validation MSE).

A check: the per-group hypergradient against central finite differences of re-solved lasso
problems (``hypergrad.testing.check_hypergrad``, every group's coordinate).

Writes ``results.json`` (the table, the learned penalties, the check) and ``history.json`` (the
validation and test MSE along the outer steps) and ``sparse_regression.png`` (those curves,
with the baselines as lines) under ``--out`` (default ``runs/sparse_regression``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from _cli import torch_threads
from sklearn.datasets import load_diabetes
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import ElasticNetCV, LassoCV, enet_path, lasso_path
from sklearn.model_selection import KFold, train_test_split

import hypergrad as hg
from hypergrad.testing import check_hypergrad

DTYPE = torch.float64
BLOCKS = {
    "demographic": ("age", "sex"),
    "bmi_bp": ("bmi", "bp"),
    "serum": ("s1", "s2", "s3", "s4", "s5", "s6"),
}
L1_RATIOS = (0.1, 0.3, 0.5, 0.7, 0.9, 0.95, 0.99)  # ElasticNetCV's grid (1.0 is the lasso)
N_ALPHAS = 100  # alphas per path (scikit-learn's default)
CV_FOLDS = 5
MODELS = ("lasso_single", "lasso_group", "enet_group")


# ---------------------------------------------------------------------------------------------
# data


@dataclass
class Problem:
    """Standardised splits (torch, float64), the feature groups and the target's scale."""

    xtr: torch.Tensor
    ytr: torch.Tensor
    xva: torch.Tensor
    yva: torch.Tensor
    xte: torch.Tensor
    yte: torch.Tensor
    names: list[str]
    groups: torch.Tensor  # group index of each feature
    group_names: list[str]
    y_scale: float  # training std of the target: MSE in original units = mse * y_scale**2
    lipschitz: float  # largest eigenvalue of X_tr^T X_tr / n

    @property
    def features(self) -> int:
        return self.xtr.shape[1]

    @property
    def n_groups(self) -> int:
        return len(self.group_names)

    def np(self, name: str) -> np.ndarray:
        return getattr(self, name).numpy()


def _block(feature: str) -> str:
    return next(b for b, members in BLOCKS.items() if feature in members)


def polynomial_features(x: np.ndarray, base: list[str]) -> tuple[np.ndarray, list[str], list]:
    """Degree-2 features without ``sex^2``: columns, names and the blocks each involves."""
    cols, names, blocks = [], [], []
    d = len(base)
    for i in range(d):
        cols.append(x[:, i])
        names.append(base[i])
        blocks.append((_block(base[i]),))
    for i in range(d):
        for j in range(i, d):
            if i == j and base[i] == "sex":
                continue  # binary: sex^2 is an affine function of sex
            cols.append(x[:, i] * x[:, j])
            names.append(f"{base[i]}^2" if i == j else f"{base[i]}*{base[j]}")
            order = list(BLOCKS)
            pair = sorted((_block(base[i]), _block(base[j])), key=order.index)
            blocks.append(tuple(pair))
    return np.stack(cols, axis=1), names, blocks


def make_problem(seed: int = 0, train_rows: int | None = None) -> Problem:
    """The 50/25/25 split of the degree-2 diabetes features (``train_rows`` keeps only the first
    rows of the training split, for small tests)."""
    data = load_diabetes()
    x, names, blocks = polynomial_features(data.data, list(data.feature_names))
    y = data.target.astype(np.float64)
    idx = np.arange(len(y))
    tr, rest = train_test_split(idx, train_size=0.5, random_state=seed)
    va, te = train_test_split(rest, train_size=0.5, random_state=seed)
    if train_rows is not None:
        tr = tr[:train_rows]
    mu, sd = x[tr].mean(0), x[tr].std(0)
    ym, ys = y[tr].mean(), y[tr].std()

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.tensor(a, dtype=DTYPE)

    def X(rows: np.ndarray) -> torch.Tensor:
        return t((x[rows] - mu) / sd)

    def Y(rows: np.ndarray) -> torch.Tensor:
        return t((y[rows] - ym) / ys)

    group_names: list[str] = []
    gid = []
    for b in blocks:
        gname = b[0] if len(b) == 1 else f"{b[0]} x {b[1]}"
        if gname not in group_names:
            group_names.append(gname)
        gid.append(group_names.index(gname))
    xtr = X(tr)
    lip = float(torch.linalg.eigvalsh(xtr.T @ xtr / len(tr)).max())
    return Problem(
        xtr, Y(tr), X(va), Y(va), X(te), Y(te), names, torch.tensor(gid), group_names,
        float(ys), lip,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# the bilevel problem


def smooth_loss(prob: Problem):
    """``f(w) = 1/(2n) ||X w - y||^2`` on the training split (sklearn's Lasso scaling)."""
    n = prob.xtr.shape[0]

    def f(w: torch.Tensor, _: object) -> torch.Tensor:
        r = prob.xtr @ w - prob.ytr
        return 0.5 * (r @ r) / n

    return f


def mse(prob: Problem, w: torch.Tensor, split: str) -> torch.Tensor:
    """Mean squared error on a split, in the standardised target's units."""
    x, y = (prob.xva, prob.yva) if split == "val" else (prob.xte, prob.yte)
    r = x @ w - y
    return (r @ r) / x.shape[0]


def prox_hparams(prob: Problem, model: str, h: dict[str, torch.Tensor]):
    """The ``hparams_prox`` of the prox operator from the log-penalties ``h``: the per-feature
    lambda vector (lasso) or the pair ``(lambda, gamma)`` (elastic net)."""
    eta = h["eta"]
    lam = eta.exp().expand(prob.features) if eta.dim() == 0 else eta.exp()[prob.groups]
    if model == "enet_group":
        return (lam, h["zeta"].exp())
    return lam


def prox_of(model: str):
    return hg.prox.prox_elastic_net if model == "enet_group" else hg.prox.prox_lasso


def inner_solver(
    prob: Problem, model: str, tol: float = 1e-10, maxiter: int = 20000
) -> hg.inner.ProximalGradient:
    """FISTA with the fixed step 1/L, differentiable by ``custom_fixed_point`` (GMRES)."""
    return hg.inner.ProximalGradient(
        smooth_loss(prob),
        prox_of(model),
        stepsize=1.0 / prob.lipschitz,
        maxiter=maxiter,
        tol=tol,
        solver=hg.GMRES(tol=1e-10, maxiter=500),
    )


def solve(prob: Problem, model: str, h: dict, w0=None, tol: float = 1e-10) -> torch.Tensor:
    """The inner solution at ``h`` (no derivative), for baselines, checks and tests."""
    w0 = torch.zeros(prob.features, dtype=DTYPE) if w0 is None else w0
    hd = {k: v.detach() for k, v in h.items()}
    with torch.no_grad():
        w, info = hg.inner.ProximalGradient(
            smooth_loss(prob),
            prox_of(model),
            stepsize=1.0 / prob.lipschitz,
            maxiter=200000,
            tol=tol,
        ).solve(w0, (None, prox_hparams(prob, model, hd)))
    return w


def hypergradient(prob: Problem, model: str, h: dict, w0=None, tol: float = 1e-10):
    """``(val MSE, d val MSE / d h, w)`` at ``h`` through the solver's fixed point."""
    hs = {k: v.detach().clone().requires_grad_(True) for k, v in h.items()}
    solver = inner_solver(prob, model, tol=tol, maxiter=200000)
    w0 = torch.zeros(prob.features, dtype=DTYPE) if w0 is None else w0
    w = solver.run(w0, ((), prox_hparams(prob, model, hs)))
    loss = mse(prob, w, "val")
    grads = torch.autograd.grad(loss, list(hs.values()))
    return loss.detach(), dict(zip(hs, grads)), w.detach()


def active_set_hypergradient(prob: Problem, eta: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The per-group lasso hypergradient from the closed form on the support ``S`` of ``w``:
    ``w_S = (X_S^T X_S / n)^(-1) (X_S^T y / n - lambda_S * sign(w_S))``, differentiated by
    autograd in ``eta`` (``lambda = exp(eta)[groups]``), ``w`` zero off ``S``."""
    n = prob.xtr.shape[0]
    S = w != 0
    xs = prob.xtr[:, S]
    e = eta.detach().clone().requires_grad_(True)
    lam = e.exp()[prob.groups][S]
    ws = torch.linalg.solve(xs.T @ xs / n, xs.T @ prob.ytr / n - lam * w[S].sign())
    full = torch.zeros(prob.features, dtype=DTYPE).index_put((S.nonzero()[:, 0],), ws)
    (g,) = torch.autograd.grad(mse(prob, full, "val"), e)
    return g


def check_group_hypergradient(prob: Problem, eta: torch.Tensor, eps: float = 1e-4, rtol=1e-5):
    """``check_hypergrad`` of the per-group lasso hypergradient at ``eta``: central differences
    of lasso problems re-solved along every group's coordinate (FISTA warm-started from the
    solution at ``eta``, to a relative residual of 1e-13). The 'inner loss' whose gradient must
    vanish is the squared proximal-gradient residual ``||w - T(w)||^2 / (2 s^2)`` (zero exactly
    at the lasso solution)."""
    h = {"eta": eta.detach()}
    _, g, w = hypergradient(prob, "lasso_group", h, tol=1e-13)
    s = 1.0 / prob.lipschitz
    T = hg.conditions.proximal_gradient(smooth_loss(prob), hg.prox.prox_lasso, s)

    def residual(w_, e):
        r = w_ - T(w_, ((), prox_hparams(prob, "lasso_group", {"eta": e})))
        return 0.5 * (r @ r) / s**2

    report = check_hypergrad(
        lambda e: solve(prob, "lasso_group", {"eta": e}, w0=w, tol=1e-13),
        residual,
        lambda w_, e: mse(prob, w_, "val"),
        h["eta"],
        g["eta"],
        eps=eps,
        rtol=rtol,
        atol=1e-10,
        inner_tol=1e-9,
    )
    return report, g["eta"], w


# ---------------------------------------------------------------------------------------------
# baselines


def _fit_time(fn):
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConvergenceWarning)
        out = fn()
    n_warn = sum(issubclass(c.category, ConvergenceWarning) for c in caught)
    return out, time.perf_counter() - t0, n_warn


def _row(prob: Problem, name: str, w: np.ndarray, seconds: float, **extra) -> dict:
    wt = torch.as_tensor(w, dtype=DTYPE)
    s2 = prob.y_scale**2
    return dict(
        method=name,
        val_mse=float(mse(prob, wt, "val")) * s2,
        test_mse=float(mse(prob, wt, "test")) * s2,
        nonzeros=int((wt != 0).sum()),
        wall_s=seconds,
        **extra,
    )


def baselines(prob: Problem, seed: int, max_iter: int = 100000) -> dict[str, dict]:
    """The all-zero model, LassoCV, ElasticNetCV and the paths scored on validation."""
    xtr, ytr, xva, yva = prob.np("xtr"), prob.np("ytr"), prob.np("xva"), prob.np("yva")
    cv = KFold(CV_FOLDS, shuffle=True, random_state=seed)
    rows = {"zero": _row(prob, "all-zero (training mean)", np.zeros(prob.features), 0.0)}

    m, sec, nw = _fit_time(lambda: LassoCV(cv=cv, alphas=N_ALPHAS, max_iter=max_iter).fit(xtr, ytr))
    rows["lasso_cv"] = _row(
        prob, "LassoCV (5-fold on train)", m.coef_, sec, alpha=float(m.alpha_), conv_warnings=nw
    )
    m, sec, nw = _fit_time(
        lambda: ElasticNetCV(
            l1_ratio=list(L1_RATIOS), cv=cv, alphas=N_ALPHAS, max_iter=max_iter
        ).fit(xtr, ytr)
    )
    rows["enet_cv"] = _row(
        prob, "ElasticNetCV (5-fold on train)", m.coef_, sec, alpha=float(m.alpha_),
        l1_ratio=float(m.l1_ratio_), conv_warnings=nw,
    )  # fmt: skip

    def best_on_val(l1_ratios):
        best = None
        for r in l1_ratios:
            path = lasso_path if r == 1.0 else enet_path
            kw = {} if r == 1.0 else {"l1_ratio": r}
            alphas, coefs, _ = path(xtr, ytr, alphas=N_ALPHAS, max_iter=max_iter, **kw)
            err = ((xva @ coefs - yva[:, None]) ** 2).mean(0)
            k = int(err.argmin())
            if best is None or err[k] < best[0]:
                best = (err[k], float(alphas[k]), r, coefs[:, k].copy())
        return best

    (_, a, _, coef), sec, nw = _fit_time(lambda: best_on_val([1.0]))
    rows["lasso_val"] = _row(prob, "lasso path, alpha by val", coef, sec, alpha=a, conv_warnings=nw)
    (_, a, r, coef), sec, nw = _fit_time(lambda: best_on_val(L1_RATIOS))
    rows["enet_val"] = _row(
        prob, "enet paths, (alpha, l1_ratio) by val", coef, sec, alpha=a, l1_ratio=r,
        conv_warnings=nw,
    )  # fmt: skip
    return rows


# ---------------------------------------------------------------------------------------------
# learned penalties


def initial_hparams(prob: Problem, model: str, base: dict[str, dict]) -> dict[str, torch.Tensor]:
    """Start from LassoCV's alpha (lasso) or ElasticNetCV's (alpha, l1_ratio) (elastic net)."""
    if model == "enet_group":
        a, r = base["enet_cv"]["alpha"], base["enet_cv"]["l1_ratio"]
        return {
            "eta": torch.full((prob.n_groups,), math.log(a * r), dtype=DTYPE),
            "zeta": torch.tensor(math.log((1 - r) / r), dtype=DTYPE),
        }
    eta0 = math.log(base["lasso_cv"]["alpha"])
    shape = () if model == "lasso_single" else (prob.n_groups,)
    return {"eta": torch.full(shape, eta0, dtype=DTYPE)}


class Adam:
    """Adam (Kingma and Ba 2015, torch.optim.Adam's defaults) on a list of leaf tensors, stepped
    with given gradients. Written out because building a ``torch.optim`` optimizer imports
    ``torch._dynamo`` (seconds of start-up for a one-minute example)."""

    def __init__(self, params, lr: float, betas=(0.9, 0.999), eps: float = 1e-8) -> None:
        self.params, self.lr, self.betas, self.eps, self.t = params, lr, betas, eps, 0
        self.m = [torch.zeros_like(p) for p in params]
        self.v = [torch.zeros_like(p) for p in params]

    @torch.no_grad()
    def step(self, grads) -> None:
        b1, b2 = self.betas
        self.t += 1
        for p, g, m, v in zip(self.params, grads, self.m, self.v):
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            mhat, vhat = m / (1 - b1**self.t), v / (1 - b2**self.t)
            p.sub_(self.lr * mhat / (vhat.sqrt() + self.eps))


def learn(prob: Problem, model: str, h0: dict, args, label: str) -> tuple[dict, list[dict]]:
    """Adam on the log-penalties with hypergradients through FISTA's fixed point."""
    h = {k: v.clone().requires_grad_(True) for k, v in h0.items()}
    opt = Adam(list(h.values()), lr=args.lr)
    solver = inner_solver(prob, model, tol=args.inner_tol, maxiter=args.inner_maxiter)
    w = torch.zeros(prob.features, dtype=DTYPE)
    s2 = prob.y_scale**2
    hist: list[dict] = []
    inner_its = gmres_its = 0
    worst_inner = worst_gmres = 0.0
    t0 = time.perf_counter()

    def record(step, w_, val):
        hist.append(
            dict(
                step=step,
                val_mse=float(val) * s2,
                test_mse=float(mse(prob, w_, "test")) * s2,
                nonzeros=int((w_ != 0).sum()),
                eta=h["eta"].detach().tolist(),
                **({"zeta": float(h["zeta"].detach())} if "zeta" in h else {}),
            )
        )

    for step in range(args.steps + 1):
        w = solver.run(w.detach(), ((), prox_hparams(prob, model, h)))
        info = solver.last_info
        inner_its += info.iterations
        worst_inner = max(worst_inner, info.residual)
        loss = mse(prob, w, "val")
        record(step, w.detach(), loss.detach())
        if step == args.steps:  # the last iterate: evaluated, not stepped
            break
        grads = torch.autograd.grad(loss, list(h.values()))
        rinfo = solver.last_implicit_info.solve
        gmres_its += rinfo.iterations
        worst_gmres = max(worst_gmres, rinfo.residual)
        opt.step(grads)
        if args.progress and (step % 10 == 0 or step == args.steps - 1):
            print(
                f"  [{label}] step {step:3d}  val MSE {hist[-1]['val_mse']:8.1f}  "
                f"test MSE {hist[-1]['test_mse']:8.1f}  nnz {hist[-1]['nonzeros']:2d}  "
                f"FISTA its {info.iterations:5d}",
                flush=True,
            )
    seconds = time.perf_counter() - t0
    eta = h["eta"].detach()
    row = _row(
        prob, label, w.detach().numpy(), seconds,
        log_lambda=eta.tolist(),
        inner_iterations=inner_its,
        max_inner_residual=worst_inner,
        gmres_iterations=gmres_its,
        max_gmres_residual=worst_gmres,
    )  # fmt: skip
    if "zeta" in h:
        row["gamma"] = float(h["zeta"].detach().exp())
    return row, hist


# ---------------------------------------------------------------------------------------------
# report


def print_table(rows: dict[str, dict]) -> None:
    print(f"\n{'method':44s} {'val MSE':>9s} {'test MSE':>9s} {'nnz':>4s} {'wall s':>7s}")
    for r in rows.values():
        print(
            f"{r['method']:44s} {r['val_mse']:9.1f} {r['test_mse']:9.1f} {r['nonzeros']:4d} "
            f"{r['wall_s']:7.2f}"
        )


def plot(histories: dict[str, list[dict]], rows: dict[str, dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, split in zip(axes, ("val", "test")):
        for model, hist in histories.items():
            ax.plot(
                [h["step"] for h in hist], [h[f"{split}_mse"] for h in hist],
                label=rows[model]["method"],
            )  # fmt: skip
        for key, style in (("lasso_cv", "k--"), ("enet_cv", "k:"), ("lasso_val", "r--")):
            ax.axhline(rows[key][f"{split}_mse"], ls=style[1:], color=style[0], lw=1,
                       label=rows[key]["method"])  # fmt: skip
        ax.set_xlabel("outer step (Adam)")
        ax.set_title(f"{'validation' if split == 'val' else 'test'} MSE")
    axes[0].set_ylabel("MSE (original units)")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="few outer steps, for tests")
    ap.add_argument("--steps", type=int, default=None, help="Adam steps (default 50; quick 8)")
    ap.add_argument("--lr", type=float, default=0.1, help="Adam learning rate on ln lambda")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--inner-tol", type=float, default=1e-9, help="FISTA relative residual")
    ap.add_argument("--inner-maxiter", type=int, default=20000)
    ap.add_argument("--no-check", action="store_true", help="skip the finite-difference check")
    ap.add_argument(
        "--seeds", type=int, nargs="+", default=[0],
        help="splits to run (default 0); with several, a mean (sd) table follows",
    )  # fmt: skip
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--out", default="runs/sparse_regression")
    ap.add_argument("--no-progress", dest="progress", action="store_false")
    args = ap.parse_args(argv)
    if args.steps is None:
        args.steps = 8 if args.quick else 50
    return args


def run_seed(seed: int, args: argparse.Namespace, check: bool) -> dict:
    """Baselines, learned penalties and (``check``) the hypergradient check on one split."""
    t_start = time.perf_counter()
    prob = make_problem(seed)
    print(
        f"seed {seed}: diabetes, degree-2 features: {prob.features} features in "
        f"{prob.n_groups} groups; train/val/test "
        f"{prob.xtr.shape[0]}/{prob.xva.shape[0]}/{prob.xte.shape[0]}",
        flush=True,
    )
    rows = baselines(prob, seed)
    histories = {}
    labels = {
        "lasso_single": "learned lasso, one lambda",
        "lasso_group": f"learned lasso, {prob.n_groups} group lambdas",
        "enet_group": f"learned enet, {prob.n_groups} group lambdas + gamma",
    }
    for model in args.models:
        h0 = initial_hparams(prob, model, rows)
        rows[model], histories[model] = learn(prob, model, h0, args, labels[model])
    report = None
    if check and "lasso_group" in args.models:
        eta = torch.tensor(rows["lasso_group"]["log_lambda"], dtype=DTYPE)
        t0 = time.perf_counter()
        rep, _, _ = check_group_hypergradient(prob, eta)
        report = dict(
            passed=rep.passed,
            # over the coordinates above atol (a group without support has a zero derivative)
            max_rel_err=max(
                (r.rel_err for r in rep.rows if r.direction not in rep.blind), default=0.0
            ),
            directions=len(rep.rows),
            zero_directions=len(rep.blind),
            seconds=time.perf_counter() - t0,
            reason=rep.reason,
        )
    print_table(rows)
    if "lasso_group" in rows:
        print("\nlearned group penalties ln lambda_g (LassoCV: "
              f"{math.log(rows['lasso_cv']['alpha']):.2f}):")  # fmt: skip
        for g, v in zip(prob.group_names, rows["lasso_group"]["log_lambda"]):
            print(f"  {g:28s} {v:7.2f}")
    if report is not None:
        print(
            f"\nhypergradient check (per-group lasso, at the learned penalties, central "
            f"differences of re-solved problems along {report['directions']} group "
            f"coordinates): {'PASSED' if report['passed'] else 'FAILED'}, max rel err "
            f"{report['max_rel_err']:.1e} ({report['zero_directions']} groups without support: "
            "zero in both)"
        )
    return dict(
        seed=seed,
        groups=prob.group_names,
        sizes=dict(train=prob.xtr.shape[0], val=prob.xva.shape[0], test=prob.xte.shape[0]),
        table=rows,
        check=report,
        histories=histories,
        wall_time_s=time.perf_counter() - t_start,
    )


def summarize(runs: list[dict]) -> dict[str, dict]:
    """Mean and standard deviation over seeds of each method's numbers."""
    out = {}
    for key, row in runs[0]["table"].items():
        rs = [r["table"][key] for r in runs]
        out[key] = dict(method=row["method"])
        for f in ("val_mse", "test_mse", "nonzeros", "wall_s"):
            v = np.array([r[f] for r in rs], dtype=float)
            out[key][f] = float(v.mean())
            out[key][f + "_sd"] = float(v.std(ddof=1)) if len(v) > 1 else 0.0
        out[key]["test_mse_per_seed"] = [r["test_mse"] for r in rs]
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    with torch_threads(args.threads):
        runs = [
            run_seed(s, args, check=not args.no_check and k == 0) for k, s in enumerate(args.seeds)
        ]
    summary = summarize(runs) if len(runs) > 1 else None
    if summary is not None:
        print(f"\nmean (sd) over seeds {args.seeds}:")
        print(f"{'method':44s} {'val MSE':>14s} {'test MSE':>14s} {'nnz':>5s} {'wall s':>6s}")
        for r in summary.values():
            print(
                f"{r['method']:44s} {r['val_mse']:7.1f} ({r['val_mse_sd']:4.0f}) "
                f"{r['test_mse']:7.1f} ({r['test_mse_sd']:4.0f}) {r['nonzeros']:5.1f} "
                f"{r['wall_s']:6.2f}"
            )
    wall = time.perf_counter() - t_start
    print(f"wall time {wall:.1f} s")
    os.makedirs(args.out, exist_ok=True)
    first = runs[0]
    result = dict(
        config=dict(vars(args), groups=first["groups"], sizes=first["sizes"]),
        seed=first["seed"],
        table=first["table"],
        check=first["check"],
        runs=[{k: v for k, v in r.items() if k != "histories"} for r in runs],
        summary=summary,
        wall_time_s=wall,
    )
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "history.json"), "w") as f:
        json.dump({str(r["seed"]): r["histories"] for r in runs}, f)
    if first["histories"]:
        plot(first["histories"], first["table"], os.path.join(args.out, "sparse_regression.png"))
    return result


if __name__ == "__main__":
    main()
