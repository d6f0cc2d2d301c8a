"""Relative hypergradient error vs iterations on quadratic bilevel problems of known condition.

Problem (float64, n = 100 inner parameters, m = 10 hyperparameters)::

    H = Q diag(eigs) Q^T,  eigs log-spaced in [1, kappa]        (lambda_max = kappa, known)
    L_in(w, theta)  = 1/2 w^T H w - w^T (B theta)               => w*(theta) = H^-1 B theta
    L_out(w, theta) = 1/2 ||w - w_target||^2

    dL_out/dtheta = (dw*/dtheta)^T (w* - w_target) = B^T H^-1 (w* - w_target)   (exact)

(The library returns ``direct - mixed(x)`` with ``x = H^-1 dL_out/dw`` and
``mixed(x) = d^2 L_in/dtheta dw . x = -B^T x``, i.e. the same ``B^T x``.)

Methods and their "iterations" axis:

* CG, MINRES (``tol=0``, ``maxiter=k``): k Hessian-vector products.
* Neumann with ``alpha = 1/lambda_max`` (exact) and ``alpha=None`` (power iteration): k series
  products; for ``alpha=None`` the axis counts the 20 power-iteration products too.
* Unrolled gradient descent (``hg.unrolled_grad``, ``torchopt.sgd(lr=1/lambda_max)``, T steps from
  ``w0 = 0``, full backpropagation): k = T.

The implicit solvers run on one shared :class:`hypergrad.InnerOperator` (the "reuse" engine, graph
kept between solves) with ``solver.solve`` followed by ``op.mixed`` -- exactly what
``hg.implicit_grad`` does (``hypergrad.implicit.solve_adjoint``). Neumann curves are extended by
warm starts: ``solve(b, x0=x_K)`` with ``steps=M`` returns exactly the ``K + M + 1``-step iterate
(``x_K = A^-1 (I - R^{K+1}) b`` with ``R = I - alpha A``). Both shortcuts are checked against
``hg.implicit_grad`` at several points (printed as "cross-check"). Iterations needed for a 1e-6
relative error are found by bisection on the exact iterates for CG, MINRES and Neumann and by
log-linear interpolation between grid points for unrolled GD (each T is a full run).

CG's ``sqrt(kappa)`` iteration count is a worst-case (Chebyshev) bound; on the log-spaced spectrum
CG does better (it resolves the sparse extreme eigenvalues early). ``--spectrum chebyshev`` puts
the eigenvalues at the Chebyshev nodes of ``[1, kappa]`` (dense at both ends), where the bound is
nearly attained; with ``--n 1000`` the sqrt(kappa) scaling is not cut off by the dimension.

Usage::

    python benchmarks/solver_accuracy.py [--quick] [--kappas 10 100 1000 10000]
    python benchmarks/solver_accuracy.py --n 1000 --spectrum chebyshev --methods CG MINRES \
        --tag _chebyshev_n1000
"""

from __future__ import annotations

import argparse
import math
import time
import warnings

import common  # noqa: F401  (puts the repository root on sys.path)
import numpy as np
import torch
import torchopt
from common import RESULTS, format_table, machine_info, machine_line, save_json

import hypergrad as hg
from hypergrad.implicit import implicit_grad

DT = torch.float64
METHODS = ("CG", "MINRES", "Neumann (alpha=1/lmax)", "Neumann (alpha=None)", "Unrolled GD")
TARGET = 1e-6


class Quadratic:
    """The quadratic bilevel problem of condition number ``kappa`` (see module docstring)."""

    def __init__(
        self, kappa: float, n: int = 100, m: int = 10, seed: int = 0, spectrum: str = "log"
    ):
        g = torch.Generator().manual_seed(seed)
        q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=DT))
        if spectrum == "log":
            self.eigs = torch.logspace(0.0, math.log10(kappa), n, dtype=DT)
        else:  # Chebyshev nodes on [1, kappa]: dense at both ends, CG's sqrt(kappa) bound is tight
            i = torch.arange(n, dtype=DT)
            nodes = torch.cos(math.pi * (2 * i + 1) / (2 * n))
            self.eigs = 0.5 * (kappa + 1) + 0.5 * (kappa - 1) * nodes
            self.eigs = 1.0 + (self.eigs - self.eigs.min()) * (kappa - 1) / (
                self.eigs.max() - self.eigs.min()
            )
        h = q @ torch.diag(self.eigs) @ q.T
        self.H = 0.5 * (h + h.T)
        self.B = torch.randn(n, m, generator=g, dtype=DT)
        self.theta = torch.randn(m, generator=g, dtype=DT)
        self.w_target = torch.randn(n, generator=g, dtype=DT)
        self.kappa, self.lam_max, self.n = kappa, float(self.eigs.max()), n
        # exact quantities through the eigendecomposition (no solver involved)
        hinv = q @ torch.diag(1.0 / self.eigs) @ q.T
        self.w_star = hinv @ (self.B @ self.theta)
        self.g_star = self.B.T @ (hinv @ (self.w_star - self.w_target))

    def inner(self, w: torch.Tensor, th: torch.Tensor) -> torch.Tensor:
        return 0.5 * w @ (self.H @ w) - w @ (self.B @ th)

    def outer(self, w: torch.Tensor, th: torch.Tensor) -> torch.Tensor:
        return 0.5 * ((w - self.w_target) ** 2).sum()

    def rel_err(self, g: torch.Tensor) -> float:
        return float((g - self.g_star).norm() / self.g_star.norm())


class AdjointRunner:
    """Implicit hypergradients for many solver settings on one operator (no graph rebuilds)."""

    def __init__(self, prob: Quadratic):
        self.prob = prob
        psi = (prob.w_star.clone().requires_grad_(True),)
        theta = (prob.theta.clone().requires_grad_(True),)
        self.op = hg.InnerOperator(lambda p, h: prob.inner(p[0], h[0]), psi, theta)
        with torch.enable_grad():
            lo = prob.outer(psi[0], theta[0])
            self.b = (torch.autograd.grad(lo, psi[0])[0],)

    def hypergrad(self, x: tuple[torch.Tensor, ...]) -> torch.Tensor:
        mixed = self.op.mixed(x, release=False)[0]
        return -mixed  # direct part is zero: L_out does not depend on theta

    def solve(self, solver, x0=None):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            x, info = solver.solve(self.op.hvp, self.b, x0)
        return x, info


def geom_grid(kmax: int, per_decade: int, start: int = 1) -> list[int]:
    pts = np.unique(
        np.round(np.geomspace(start, kmax, int(per_decade * math.log10(kmax / start)) + 2))
    )
    return [int(p) for p in pts if p >= start]


def loglin_cross(ks: list[int], errs: list[float], tgt: float) -> float:
    """First k where the error reaches tgt, log-linearly interpolated between grid points."""
    for i, (k, e) in enumerate(zip(ks, errs)):
        if e <= tgt:
            if i == 0:
                return float(k)
            k0, e0 = ks[i - 1], errs[i - 1]
            if not (e0 > 0 and e > 0):
                return float(k)
            f = (math.log(e0) - math.log(tgt)) / (math.log(e0) - math.log(e))
            return float(k0 + f * (k - k0))
    return float("nan")


# --------------------------------------------------------------------------- methods


def krylov_curve(runner: AdjointRunner, cls, grid: list[int], stop: float):
    """Independent runs with maxiter=k, tol=0 (the k-th iterate of one long run)."""
    prob = runner.prob
    cache: dict[int, float] = {}

    def err_at(k: int) -> float:
        if k not in cache:
            x, _ = runner.solve(cls(maxiter=k, tol=0.0))
            cache[k] = prob.rel_err(runner.hypergrad(x))
        return cache[k]

    ks, errs = [], []
    for k in grid:
        ks.append(k)
        errs.append(err_at(k))
        if errs[-1] < stop:
            break
    # exact first crossing of TARGET by bisection between bracketing grid points
    crossing = float("nan")
    for i, e in enumerate(errs):
        if e <= TARGET:
            lo, hi = (ks[i - 1] if i else 0), ks[i]
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if err_at(mid) <= TARGET:
                    hi = mid
                else:
                    lo = mid
            crossing = float(hi)
            break
    return ks, errs, crossing


def neumann_curve(runner: AdjointRunner, alpha: float | None, grid: list[int], stop: float):
    """Neumann iterates for every k in grid by warm-start chaining (exact continuation)."""
    prob = runner.prob
    extra = 0 if alpha is not None else 20  # power-iteration products of alpha=None

    def first(k: int):
        return runner.solve(hg.Neumann(steps=k, alpha=alpha))[0]

    def advance(x, k_from: int, k_to: int):
        # x_{k_from} -> x_{k_to}: one residual product + (k_to - k_from - 1) series steps
        return runner.solve(hg.Neumann(steps=k_to - k_from - 1, alpha=alpha), x0=x)[0]

    ks, errs, states = [], [], []
    x, k_prev = None, None
    for k in grid:
        x = first(k) if x is None else advance(x, k_prev, k)
        k_prev = k
        ks.append(k)
        errs.append(prob.rel_err(runner.hypergrad(x)))
        states.append(x)
        if errs[-1] < stop:
            break
    crossing = float("nan")
    for i, e in enumerate(errs):
        if e <= TARGET:
            if i == 0:
                crossing = float(ks[0])
                break
            lo, x_lo, hi = ks[i - 1], states[i - 1], ks[i]
            while hi - lo > 1:
                mid = (lo + hi) // 2
                x_mid = advance(x_lo, lo, mid)
                if prob.rel_err(runner.hypergrad(x_mid)) <= TARGET:
                    hi = mid
                else:
                    lo, x_lo = mid, x_mid
            crossing = float(hi)
            break
    return [k + extra for k in ks], errs, crossing + extra


def unrolled_err(prob: Quadratic, steps: int) -> float:
    g, _ = hg.unrolled_grad(
        prob.inner,
        prob.outer,
        torch.zeros(prob.n, dtype=DT),
        prob.theta,
        steps=steps,
        optimizer=torchopt.sgd(lr=1.0 / prob.lam_max),
    )
    return prob.rel_err(g)


def unrolled_curve(prob: Quadratic, grid: list[int], stop: float, budget_s: float):
    ks, errs = [], []
    t0 = time.perf_counter()
    for k in grid:
        ks.append(k)
        errs.append(unrolled_err(prob, k))
        if errs[-1] < stop or time.perf_counter() - t0 > budget_s:
            break
    return ks, errs, loglin_cross(ks, errs, TARGET)


def cross_check(prob: Quadratic, curves: dict, kmax_check: int) -> float:
    """Max |rel. error (shortcut) - rel. error (hg.implicit_grad run)| at a few k per method."""
    worst = 0.0
    solvers = {
        "CG": lambda k: hg.CG(maxiter=k, tol=0.0),
        "MINRES": lambda k: hg.MINRES(maxiter=k, tol=0.0),
        "Neumann (alpha=1/lmax)": lambda k: hg.Neumann(steps=k, alpha=1.0 / prob.lam_max),
        "Neumann (alpha=None)": lambda k: hg.Neumann(steps=k - 20, alpha=None),
    }
    for name, make in solvers.items():
        if name not in curves:
            continue
        ks, errs = curves[name]["iters"], curves[name]["rel_err"]
        picks = [
            i
            for i, k in enumerate(ks)
            if k <= kmax_check and (name != "Neumann (alpha=None)" or k >= 21)
        ]
        for i in picks[:: max(1, len(picks) // 4)][:5]:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                g, _ = implicit_grad(
                    prob.inner, prob.outer, prob.w_star, prob.theta, solver=make(ks[i])
                )
            worst = max(worst, abs(prob.rel_err(g) - errs[i]))
    return worst


# --------------------------------------------------------------------------- main


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--quick", action="store_true", help="kappa in {10,100,1000}, short iteration axis"
    )
    ap.add_argument("--kappas", type=float, nargs="+", default=None, help="condition numbers")
    ap.add_argument("--n", type=int, default=100, help="inner dimension")
    ap.add_argument(
        "--spectrum",
        choices=["log", "chebyshev"],
        default="log",
        help="eigenvalues log-spaced in [1, kappa] (default) or at Chebyshev nodes of [1, kappa] "
        "(dense near both ends: the spectrum on which CG needs ~sqrt(kappa) iterations)",
    )
    ap.add_argument(
        "--max-iter", type=int, default=None, help="iteration axis limit (default 3e5; quick 2e4)"
    )
    ap.add_argument(
        "--unrolled-budget",
        type=float,
        default=None,
        help="seconds of unrolled runs per kappa before giving up (default 1200; quick 60)",
    )
    ap.add_argument(
        "--methods",
        nargs="+",
        default=list(METHODS),
        choices=list(METHODS),
        metavar="METHOD",
        help=f"subset of {', '.join(METHODS)}",
    )
    ap.add_argument("--tag", default="", help="suffix of the output file names")
    ap.add_argument("--threads", type=int, default=None, help="torch threads")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    kappas = args.kappas or (
        [10.0, 100.0, 1000.0] if args.quick else [10.0, 100.0, 1000.0, 10000.0]
    )
    kmax = args.max_iter or (20_000 if args.quick else 300_000)
    ubudget = args.unrolled_budget or (60.0 if args.quick else 1200.0)
    per_decade = 8 if args.quick else 12
    info = machine_info()
    print(machine_line(info))
    t_all = time.perf_counter()
    results: dict = {
        "target": TARGET,
        "n": args.n,
        "m": 10,
        "spectrum": args.spectrum,
        "quick": args.quick,
        "per_kappa": {},
    }
    for kappa in kappas:
        t0 = time.perf_counter()
        prob = Quadratic(kappa, n=args.n, spectrum=args.spectrum)
        runner = AdjointRunner(prob)
        grid = geom_grid(kmax, per_decade)
        curves = {}
        krylov_grid = [k for k in grid if k <= 20 * args.n]
        for m in args.methods:
            if m == "CG":
                ks, es, c = krylov_curve(runner, hg.CG, krylov_grid, 1e-11)
            elif m == "MINRES":
                ks, es, c = krylov_curve(runner, hg.MINRES, krylov_grid, 1e-11)
            elif m == "Neumann (alpha=1/lmax)":
                ks, es, c = neumann_curve(runner, 1.0 / prob.lam_max, grid, 1e-9)
            elif m == "Neumann (alpha=None)":
                ks, es, c = neumann_curve(runner, None, grid, 1e-9)
            else:
                ks, es, c = unrolled_curve(prob, geom_grid(kmax, 6), 3e-7, ubudget)
            curves[m] = {"iters": ks, "rel_err": es, "iters_to_target": c}
            print(
                f"  kappa={kappa:g} {m}: {c} iterations to {TARGET:g} "
                f"[{time.perf_counter() - t0:.0f}s]",
                flush=True,
            )
        worst = cross_check(prob, curves, 2000)
        results["per_kappa"][str(int(kappa))] = {
            "kappa": kappa,
            "lambda_max": prob.lam_max,
            "curves": curves,
            "cross_check_max_abs_diff": worst,
            "time_s": time.perf_counter() - t0,
        }
        print(
            f"kappa={kappa:g}: done in {time.perf_counter() - t0:.1f}s "
            f"(cross-check vs hg.implicit_grad: max |difference of rel. errors| {worst:.1e})"
        )
    methods = list(next(iter(results["per_kappa"].values()))["curves"])
    rows = []
    for kk, r in results["per_kappa"].items():
        rows.append([kk] + [r["curves"][m]["iters_to_target"] for m in methods])
    print(
        f"\nIterations (Hessian-vector products; unrolled: steps T) to reach relative error "
        f"{TARGET:g}:"
    )
    print(format_table(["kappa"] + methods, rows))
    slopes = {}
    for m in methods:
        pts = [
            (r["kappa"], r["curves"][m]["iters_to_target"]) for r in results["per_kappa"].values()
        ]
        pts = [(k, it) for k, it in pts if it == it and it > 0]
        if len(pts) >= 2:
            x = np.log10([p[0] for p in pts])
            y = np.log10([p[1] for p in pts])
            slopes[m] = float(np.polyfit(x, y, 1)[0])
        else:
            slopes[m] = float("nan")
    results["slopes"] = slopes
    expected = {
        "CG": 0.5,
        "MINRES": 0.5,
        "Neumann (alpha=1/lmax)": 1.0,
        "Neumann (alpha=None)": 1.0,
        "Unrolled GD": 1.0,
    }
    results["expected_slopes"] = {m: expected[m] for m in methods}
    print(
        "\nLog-log slope of iterations-to-target vs kappa (expected: CG/MINRES 0.5, Neumann/GD 1):"
    )
    print(
        format_table(
            ["method", "slope", "expected"],
            [[m, slopes[m], results["expected_slopes"][m]] for m in methods],
        )
    )
    results["total_time_s"] = time.perf_counter() - t_all
    name = ("solver_accuracy_quick" if args.quick else "solver_accuracy") + args.tag
    path = save_json(name, results)
    print(f"\nwrote {path}")
    if not args.no_plot:
        plot(results, RESULTS / f"{name}.png")
        print(f"wrote {RESULTS / (name + '.png')}")
    return results


def plot(results: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per = results["per_kappa"]
    fig, axes = plt.subplots(1, len(per), figsize=(4.2 * len(per), 3.8), sharey=True)
    axes = np.atleast_1d(axes)
    styles = {
        "CG": "C0-",
        "MINRES": "C1--",
        "Neumann (alpha=1/lmax)": "C2-",
        "Neumann (alpha=None)": "C3:",
        "Unrolled GD": "C4-.",
    }
    for ax, (kk, r) in zip(axes, per.items()):
        for m, c in r["curves"].items():
            ks = np.array(c["iters"], dtype=float)
            es = np.maximum(np.array(c["rel_err"], dtype=float), 1e-16)
            ax.loglog(ks, es, styles.get(m, "-"), label=m, lw=1.5)
        ax.axhline(results["target"], color="gray", lw=0.8, ls=":")
        ax.set_title(f"kappa = {kk}")
        ax.set_xlabel("iterations (HVPs; unrolled: steps T)")
        ax.grid(True, which="major", alpha=0.3)
        ax.set_ylim(1e-12, 3)
    axes[0].set_ylabel("relative hypergradient error")
    axes[0].legend(fontsize=7, loc="lower left")
    fig.suptitle(
        f"Hypergradient error vs iterations, quadratic bilevel problem (n={results['n']}, "
        f"{results.get('spectrum', 'log')}-spaced eigenvalues, float64)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
