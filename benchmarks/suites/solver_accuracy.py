"""Hypergradient error against iterations on quadratics of known condition number
(docs/performance.md, section 1). The implicit solvers share one ``hg.InnerOperator``; Neumann
curves continue by warm starts; both shortcuts are checked against ``hg.implicit_grad``."""

from __future__ import annotations

import math
import time
import warnings

import numpy as np
import torch
import torchopt

import hypergrad as hg
from benchmarks import kit
from benchmarks.peers.hypergrad import make_solver

DT, TARGET = torch.float64, 1e-6
METHODS = ["CG", "MINRES", "Neumann (alpha=1/lmax)", "Neumann (alpha=None)", "Unrolled GD"]
EXPECTED = dict(zip(METHODS, [0.5, 0.5, 1.0, 1.0, 1.0]))
OPTIONS = dict(kappas=[10.0, 100.0, 1000.0, 10000.0], n=100, spectrum="log", max_iter=300000)
OPTIONS.update(unrolled_budget=1200.0, per_decade=12, methods=METHODS)
QUICK = dict(kappas=[10.0, 100.0, 1000.0], max_iter=20000, unrolled_budget=10.0, per_decade=8)
RUNS = [("", {}), ("_chebyshev_n1000", dict(n=1000, spectrum="chebyshev", methods=METHODS[:2]))]


class Quadratic:
    """``L_in = 1/2 w'Hw - w'B theta``, ``L_out = 1/2 ||w - w_target||^2``, ``H = Q diag(eigs) Q'``
    (eigenvalues log-spaced or at Chebyshev nodes in [1, kappa]); the exact hypergradient
    ``B' H^-1 (w* - w_target)`` through the eigendecomposition."""

    def __init__(self, kappa: float, n: int = 100, m: int = 10, spectrum: str = "log"):
        g = torch.Generator().manual_seed(0)
        q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=DT))
        if spectrum == "log":
            eigs = torch.logspace(0.0, math.log10(kappa), n, dtype=DT)
        else:  # Chebyshev nodes of [1, kappa]: dense at both ends, CG's sqrt(kappa) bound is tight
            nodes = torch.cos(math.pi * (2 * torch.arange(n, dtype=DT) + 1) / (2 * n))
            eigs = 1.0 + (nodes - nodes.min()) * (kappa - 1) / (nodes.max() - nodes.min())
        self.H = q @ torch.diag(eigs) @ q.T
        self.H = 0.5 * (self.H + self.H.T)
        self.B = torch.randn(n, m, generator=g, dtype=DT)
        self.theta = torch.randn(m, generator=g, dtype=DT)
        self.w_target = torch.randn(n, generator=g, dtype=DT)
        self.lam_max, self.n = float(eigs.max()), n
        hinv = q @ torch.diag(1.0 / eigs) @ q.T
        self.w_star = hinv @ (self.B @ self.theta)
        self.g_star = self.B.T @ (hinv @ (self.w_star - self.w_target))
        psi = (self.w_star.clone().requires_grad_(True),)
        th = (self.theta.clone().requires_grad_(True),)
        self.op = hg.InnerOperator(lambda p, h: self.inner(p[0], h[0]), psi, th)
        with torch.enable_grad():
            self.b = (torch.autograd.grad(self.outer(psi[0], th[0]), psi[0])[0],)

    def inner(self, w, th):
        return 0.5 * w @ (self.H @ w) - w @ (self.B @ th)

    def outer(self, w, th):
        return 0.5 * ((w - self.w_target) ** 2).sum()

    def err(self, g: torch.Tensor) -> float:
        return float((g - self.g_star).norm() / self.g_star.norm())

    def solve_err(self, solver, x0=None) -> tuple[float, tuple]:
        """Error of the hypergradient from ``solver`` on the shared operator (direct part 0)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            x, _ = solver.solve(self.op.hvp, self.b, x0)
        return self.err(-self.op.mixed(x, release=False)[0]), x


def grid(kmax: int, per_decade: int) -> list[int]:
    pts = np.geomspace(1, kmax, int(per_decade * math.log10(kmax)) + 2)
    return [int(p) for p in np.unique(np.round(pts))]


def curve(prob: Quadratic, method: str, ks: list[int], stop: float):
    """(iterations, errors, iterations to TARGET) of one method."""
    alpha = 1.0 / prob.lam_max if "1/lmax" in method else None
    extra = 20 if method == "Neumann (alpha=None)" else 0  # power-iteration products

    def step(k, state=None):  # (error, state) at k iterations; Neumann continues from state
        if method.startswith("Neumann"):
            if state is None:
                return prob.solve_err(make_solver("neumann", k, alpha=alpha))
            k0, x = state
            return prob.solve_err(make_solver("neumann", k - k0 - 1, alpha=alpha), x0=x)
        return prob.solve_err(make_solver(method.lower(), k, tol=0.0))

    xs, errs, states = [], [], [None]
    for k in ks:
        e, x = step(k, states[-1])
        xs, errs, states = xs + [k], errs + [e], states + [(k, x)]
        if e < stop:
            break
    states = states[1:]
    crossing = float("nan")
    i = next((i for i, e in enumerate(errs) if e <= TARGET), None)
    if i is not None:  # bisection between the bracketing grid points
        lo, hi, st = (xs[i - 1], xs[i], states[i - 1]) if i else (0, xs[0], None)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            e, x = step(mid, st if method.startswith("Neumann") else None)
            lo, hi, st = (lo, mid, st) if e <= TARGET else (mid, hi, (mid, x))
        crossing = float(hi)
    return [k + extra for k in xs], errs, crossing + extra


def unrolled_curve(prob: Quadratic, ks: list[int], stop: float, budget: float):
    xs, errs, t0 = [], [], time.perf_counter()
    opt = torchopt.sgd(lr=1.0 / prob.lam_max)
    for k in ks:
        w0 = torch.zeros(prob.n, dtype=DT)
        g, _ = hg.unrolled_grad(prob.inner, prob.outer, w0, prob.theta, steps=k, optimizer=opt)
        xs, errs = xs + [k], errs + [prob.err(g)]
        if errs[-1] < stop or time.perf_counter() - t0 > budget:
            break
    cross = float("nan")
    for i, (k, e) in enumerate(zip(xs, errs)):
        if e <= TARGET:  # log-linear interpolation between grid points
            e0, k0 = (errs[i - 1], xs[i - 1]) if i else (e, k)
            f = math.log(e0 / TARGET) / math.log(e0 / e) if i and e0 > 0 < e else 1.0
            cross = float(k0 + f * (k - k0))
            break
    return xs, errs, cross


def cross_check(prob: Quadratic, curves: dict) -> float:
    """Largest |error of the shortcut - error of a full hg.implicit_grad call| on a few points."""
    worst = 0.0
    for m, c in curves.items():
        if m == "Unrolled GD":
            continue
        offset = 20 if m == "Neumann (alpha=None)" else 0
        picks = [k for k in c["iters"] if offset < k <= 2000]
        for k in picks[:: max(1, len(picks) // 4)][:5]:
            kind, alpha = m.split(" ")[0].lower(), (1.0 / prob.lam_max if "1/lmax" in m else None)
            s = make_solver(kind, k - offset, alpha=alpha, tol=0.0)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                g, _ = hg.implicit_grad(prob.inner, prob.outer, prob.w_star, prob.theta, solver=s)
            worst = max(worst, abs(prob.err(g) - c["rel_err"][c["iters"].index(k)]))
    return worst


def measure(o: dict, out, name: str) -> None:
    res = {"target": TARGET, "n": o["n"], "m": 10, "spectrum": o["spectrum"], "quick": o["quick"]}
    res["per_kappa"], t_all = {}, time.perf_counter()
    for kappa in o["kappas"]:
        t0, prob = time.perf_counter(), Quadratic(kappa, n=o["n"], spectrum=o["spectrum"])
        ks = grid(o["max_iter"], o["per_decade"])
        curves = {}
        for m in o["methods"]:
            if m in ("CG", "MINRES"):
                it = curve(prob, m, [k for k in ks if k <= 20 * o["n"]], 1e-11)
            elif m.startswith("Neumann"):
                it = curve(prob, m, ks, 1e-9)
            else:
                it = unrolled_curve(prob, grid(o["max_iter"], 6), 3e-7, o["unrolled_budget"])
            curves[m] = dict(zip(("iters", "rel_err", "iters_to_target"), it))
            kit.log(f"kappa={kappa:g} {m}: {it[2]} iterations to {TARGET:g}")
        r = dict(kappa=kappa, lambda_max=prob.lam_max, curves=curves)
        r["cross_check_max_abs_diff"] = cross_check(prob, curves)
        res["per_kappa"][str(int(kappa))] = {**r, "time_s": time.perf_counter() - t0}
    res["slopes"], res["expected_slopes"] = {}, {m: EXPECTED[m] for m in o["methods"]}
    for m in o["methods"]:  # log-log slope of iterations to the target against kappa
        pts = [(r["kappa"], r["curves"][m]["iters_to_target"]) for r in res["per_kappa"].values()]
        pts = [(k, i) for k, i in pts if i == i and i > 0]
        res["slopes"][m] = float(np.polyfit(*np.log10(pts).T, 1)[0] if len(pts) >= 2 else "nan")
    kit.save(out / f"{name}.json", {**res, "total_time_s": time.perf_counter() - t_all})
