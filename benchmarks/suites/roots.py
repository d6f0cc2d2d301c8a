"""Roots and fixed points: hypergradients through a lasso solution and through a deep-equilibrium
fixed point, hypergrad against jaxopt, torchopt and torchdeq (docs/benchmarks.md, "Roots and fixed
points against jaxopt, torchopt and torchdeq").

Problems (float64 everywhere, so that a 1e-6 relative error is reachable):

* ``lasso`` / ``lasso_features``: scikit-learn's diabetes data, standardised (features and
  target), split in halves; inner ``min_w ½‖X w − y‖²/n + Σ λ_j |w_j|`` (one λ, or one per
  feature), outer the validation MSE ``½‖X_v w − y_v‖²/n_v``. Reference: on the support ``S`` of a
  tight solve, ``w_S = (X_Sᵀ X_S)⁻¹ (X_Sᵀ y − n λ_S ∘ s_S)`` (``s = sign(w)``), so
  ``dL/dλ_S = −n s_S ∘ (X_Sᵀ X_S)⁻¹ ∇_{w_S} L`` and 0 off ``S`` (the sum over ``S`` for one λ);
  the strict-complementarity margin off ``S`` is recorded.
* ``deq``: ``z* = tanh(W z* + U x + b)`` on a batch of Fashion-MNIST images (random inputs with a
  fixed seed where the data set is absent), ``‖W‖₂ = 0.95`` (mostly symmetric, so the
  spectral radius of ``∂T/∂z`` comes near it), loss the cross-entropy of a linear
  readout; gradient w.r.t. ``(W, U, b)``. Reference: the fixed point by Picard iteration to
  rounding, then a dense solve ``(I − diag(1 − z_i²) W)ᵀ a_i = ∂L/∂z_i`` per example.

Measured per library and method (forward solver + backward linear solver): at equal iterations
(forward cap = backward cap = K over ``ks``; solvers stop earlier only at a negligible tolerance)
and to accuracy (per method, forward and backward tolerances walk down ``tols`` with generous caps
until the error reaches the tightest target; the first tolerance reaching each target is timed).
The "to accuracy" answer is each library's fastest timed configuration, from either set, whose
relative error ``‖g − g_ref‖ / ‖g_ref‖`` is at most the target. Times: median wall time of
interleaved calls after a warm-up call (jax: after compilation); memory: ``kit.probe`` (peak RSS
growth of one call in a fresh process per library).
"""

from __future__ import annotations

import functools
import math
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks import kit
from benchmarks.peers import Unsupported
from benchmarks.peers.roots import LIBS, build, methods, missing, versions

PROBLEMS = ["lasso", "lasso_features", "deq"]
OPTIONS = dict(problems=PROBLEMS, ks=[5, 20, 50, 100, 500], deq_ks=[5, 10, 20, 50, 100])
OPTIONS.update(tols=[10.0**-e for e in range(2, 13, 2)], targets=[1e-3, 1e-6], libs=list(LIBS))
OPTIONS.update(reps=5, min_time=0.2, max_reps=15, memory=True, memory_ks=[100], budget_s=5.0)
OPTIONS.update(width=64, batch=64)
QUICK = dict(ks=[5, 50], deq_ks=[5, 20], tols=[1e-3, 1e-7], reps=2, min_time=0.0, max_reps=2)
QUICK.update(memory=False, width=16, batch=8)
EQ_FTOL, EQ_BTOL = 1e-14, 1e-12  # equal K: stop earlier only once converged to rounding
CAPS = {"lasso": (20000, 1000), "deq": (2000, 1000)}  # forward, backward caps of the walk
LAM, LAM_FEATURES, KAPPA = 0.01, (0.01, 0.7, 3), 0.95


@dataclass
class Problem:
    key: str
    kind: str
    title: str
    tensors: dict = field(default_factory=dict)
    step: float = 1.0
    facts: dict = field(default_factory=dict)
    reference: np.ndarray | None = None

    def __getattr__(self, name):  # P.X, P.W, ...
        try:
            return self.__dict__["tensors"][name]
        except KeyError:
            raise AttributeError(name) from None

    # the lasso
    def smooth(self, w, _=None):
        return 0.5 * ((self.X @ w - self.y) ** 2).mean()

    def outer(self, w):
        return 0.5 * ((self.Xv @ w - self.yv) ** 2).mean()

    # the DEQ
    def loss(self, z):
        return F.cross_entropy(z @ self.R.T + self.c, self.labels)

    def rel_error(self, g) -> float:
        g = np.asarray(g, np.float64).ravel()
        if g.shape != self.reference.shape:
            return math.inf
        e = float(np.linalg.norm(g - self.reference) / np.linalg.norm(self.reference))
        return e if math.isfinite(e) else math.inf


def diabetes() -> tuple[torch.Tensor, ...]:
    from sklearn import datasets

    d = datasets.load_diabetes()
    X = (d.data - d.data.mean(0)) / d.data.std(0)
    y = (d.target - d.target.mean()) / d.target.std()
    perm = np.random.default_rng(0).permutation(len(y))
    tr, va = perm[: len(y) // 2], perm[len(y) // 2 :]
    t = lambda a: torch.tensor(a, dtype=torch.float64)
    return t(X[tr]), t(y[tr]), t(X[va]), t(y[va])


def lasso_reference(P: Problem) -> None:
    """The closed form on the support of a tight FISTA solve (module docstring), with its facts."""
    import hypergrad as hg

    X, y, lam = P.X, P.y, P.lam.expand(P.X.shape[1])
    n = X.shape[0]
    w, info = hg.inner.ProximalGradient(
        P.smooth, hg.prox.prox_lasso, stepsize=P.step, maxiter=200000, tol=1e-15
    ).solve(torch.zeros(X.shape[1], dtype=X.dtype), (None, P.lam))
    S = w.abs() > 1e-8 * w.abs().max()
    XS, s = X[:, S], torch.sign(w[S])
    w_S = torch.linalg.solve(XS.T @ XS, XS.T @ y - n * lam[S] * s)
    w_ref = torch.zeros_like(w)
    w_ref[S] = w_S
    grad_f = X.T @ (X @ w_ref - y) / n
    v = P.Xv.T @ (P.Xv @ w_ref - P.yv) / P.Xv.shape[0]
    g = torch.zeros_like(w)
    g[S] = -n * s * torch.linalg.solve(XS.T @ XS, v[S])
    g = g.sum() if P.lam.dim() == 0 else g
    P.reference = g.reshape(-1).numpy()
    off = ~S
    margin = float(((lam[off] - grad_f[off].abs()) / lam[off]).min()) if off.any() else None
    eig = torch.linalg.eigvalsh(XS.T @ XS / n)
    P.facts.update(support=int(S.sum()), features=int(X.shape[1]), margin=margin)
    P.facts.update(
        min_abs_w=float(w_S.abs().min()), signs_consistent=bool((torch.sign(w_S) == s).all())
    )
    P.facts.update(kappa_support=float(eig.max() / eig.min()), fista_gap=float((w - w_ref).norm()))
    P.facts.update(fista_iterations=info.iterations, samples=n, validation=int(P.Xv.shape[0]))


def deq_data(batch: int, width: int) -> tuple[torch.Tensor, torch.Tensor, str]:
    try:
        from benchmarks.problems import fashion_mnist

        x, y, _, _ = fashion_mnist(batch, 0, seed=0)
        return torch.tensor(x - 0.5, dtype=torch.float64), torch.tensor(y), "Fashion-MNIST"
    except Exception:  # noqa: BLE001 - the data set is an optional system package
        g = torch.Generator().manual_seed(0)
        x = torch.rand(batch, 784, generator=g, dtype=torch.float64) - 0.5
        return x, torch.randint(0, 10, (batch,), generator=g), "random inputs (seed 0)"


def deq_reference(P: Problem) -> None:
    """Picard iteration to rounding, then one dense adjoint solve per example (float64)."""
    W, u = P.W, P.x @ P.U.T + P.b
    z = torch.zeros(P.x.shape[0], W.shape[0], dtype=W.dtype)
    it = 0
    while it < 5000:
        it += 1
        z_new = torch.tanh(z @ W.T + u)
        delta = float((z_new - z).norm() / z_new.norm())
        z = z_new
        if delta < 1e-16:
            break
    zr = z.detach().requires_grad_(True)
    (v,) = torch.autograd.grad(P.loss(zr), zr)
    eye = torch.eye(W.shape[0], dtype=W.dtype)
    J = (1 - z**2)[:, :, None] * W[None]  # dT/dz per example: diag(1 − z²) W
    w = torch.linalg.solve((eye - J).transpose(1, 2), v[:, :, None])[:, :, 0]
    a = (1 - z**2) * w  # the cotangent of the pre-activation
    g = [a.T @ z, a.T @ P.x, a.sum(0)]  # dW, dU, db
    P.reference = torch.cat([t.reshape(-1) for t in g]).numpy()
    rho = max(float(torch.linalg.eigvals(J[i]).abs().max()) for i in range(len(J)))
    P.facts.update(picard_iterations=it, residual=delta, spectral_radius_max=rho)


@functools.lru_cache(maxsize=4)
def problem(key: str, width: int = 64, batch: int = 64, reference: bool = True) -> Problem:
    if key.startswith("lasso"):
        X, y, Xv, yv = diabetes()
        if key == "lasso":
            lam, what = torch.tensor(LAM, dtype=torch.float64), f"one λ = {LAM}"
        else:
            base, spread, seed = LAM_FEATURES
            z = np.random.default_rng(seed).standard_normal(X.shape[1])
            lam, what = (
                torch.tensor(base * np.exp(spread * z)),
                f"λ_j = {base}·exp({spread}·N(0,1))",
            )
        L = float(torch.linalg.eigvalsh(X.T @ X / X.shape[0]).max())
        title = f"Lasso on diabetes ({what}): dL_val/dλ through FISTA"
        P = Problem(key, "lasso", title, dict(X=X, y=y, Xv=Xv, yv=yv, lam=lam), step=1.0 / L)
        P.facts.update(lam=lam.tolist(), stepsize=P.step, hparams=lam.numel())
        if reference:
            lasso_reference(P)
        return P
    x, labels, source = deq_data(batch, width)
    g = torch.Generator().manual_seed(1)
    A = torch.randn(width, width, generator=g, dtype=torch.float64)
    V = (A + A.T) / 2 + 0.3 * (A - A.T) / 2  # mostly symmetric: spectral radius near the norm
    W = KAPPA * V / torch.linalg.matrix_norm(V, 2)
    U = torch.randn(width, 784, generator=g, dtype=torch.float64) / 784**0.5
    b = 0.1 * torch.randn(width, generator=g, dtype=torch.float64)
    R = torch.randn(10, width, generator=g, dtype=torch.float64) / width**0.5
    c = torch.zeros(10, dtype=torch.float64)
    title = f"DEQ z = tanh(Wz + Ux + b), width {width}, batch {batch} ({source}): dL/d(W, U, b)"
    tensors = dict(x=x, labels=labels, W=W, U=U, b=b, R=R, c=c)
    P = Problem(key, "deq", title, tensors)
    P.facts.update(width=width, batch=batch, inputs=source, W_norm=KAPPA)
    P.facts.update(hparams=W.numel() + U.numel() + b.numel())
    if reference:
        deq_reference(P)
    return P


def memory_build(key, lib, method, kf, kb, ftol, btol, width, batch):
    return build(lib, problem(key, width, batch, reference=False), method, kf, kb, ftol, btol)


def products(method: str, k: int) -> int:
    """Backward products (vector-Jacobian products of the condition) a configuration may spend."""
    return 2 * k if method.endswith("normal_cg") else k


def run_problem(key: str, o: dict) -> dict:
    t_start = time.perf_counter()
    P = problem(key, o["width"], o["batch"])
    kind, ks = P.kind, o["deq_ks"] if P.kind == "deq" else o["ks"]
    confs = [(lib, m) for lib in o["libs"] for m in methods(lib, kind)]
    records, fns = [], {}

    def attempt(rec: dict):
        """Build and call once (the warm-up, jax's compilation included): the error."""
        args = (rec["kf"], rec["kb"], rec["ftol"], rec["btol"])
        try:
            fn = build(rec["library"], P, rec["method"], *args)
            t0 = time.perf_counter()
            rec["rel_error"] = P.rel_error(fn())
            rec["first_call_s"] = rec["call_s"] = time.perf_counter() - t0
            if rec["first_call_s"] > 0.2:  # maybe compilation (jax): the walk's budget needs a call
                t0 = time.perf_counter()
                fn()
                rec["call_s"] = time.perf_counter() - t0
            return fn
        except Unsupported as e:
            rec.update(status="unsupported", error=str(e))
        except Exception as e:  # noqa: BLE001 - a peer failing is a result
            rec.update(status="error", error=kit.err_text(e))
            rec["traceback_tail"] = traceback.format_exc().strip().splitlines()[-6:]
        return None

    def new(lib, m, mode, kf, kb, ftol, btol, **extra):
        rec = dict(problem=key, library=lib, method=m, mode=mode, kf=kf, kb=kb, ftol=ftol)
        rec.update(btol=btol, products=products(m, kb), status="ok", error=None, rel_error=None)
        rec.update(median_s=None, median_cpu_s=None, times_s=[], peak_mib=None, **extra)
        records.append(rec)
        return rec

    for lib, m in confs:  # equal iterations
        for K in ks:
            rec = new(lib, m, "equal", K, K, EQ_FTOL, EQ_BTOL, K=K)
            fn = attempt(rec)
            if fn is not None:
                fns[len(records) - 1] = fn
            kit.log(f"{key} {lib} {m} K={K}: {rec['status']} err={rec['rel_error']} "
                    f"{rec['error'] or ''}"[:200])  # fmt: skip
            if rec["status"] == "unsupported":
                break
    kf, kb = CAPS[kind]
    targets = sorted(o["targets"], reverse=True)
    for lib, m in confs:  # to accuracy: tolerances walk down until the tightest target
        if missing(lib):
            continue
        left = list(targets)
        for tol in o["tols"]:
            rec = new(lib, m, "tol", kf, kb, tol, tol, tol=tol)
            fn = attempt(rec)
            kit.log(f"{key} {lib} {m} tol={tol:g}: {rec['status']} err={rec['rel_error']}")
            if fn is None:
                continue
            hit = [t for t in left if rec["rel_error"] <= t]
            if hit:
                fns[len(records) - 1] = fn
                rec["reached"] = hit
                left = [t for t in left if t not in hit]
            if not left or rec["call_s"] > o["budget_s"]:
                break
    timed = kit.timeit(fns, o["reps"], 0, o["min_time"], o["max_reps"])
    for i, t in timed.items():
        r = records[i]
        r.update(times_s=t["times_s"], cpu_s=t["cpu_s"], reps=len(t["times_s"]))
        r["median_s"] = kit.median(t["times_s"]) if t["times_s"] else None
        r["median_cpu_s"] = kit.median(t["cpu_s"]) if t["cpu_s"] else None
        if t["errors"]:
            r["timing_error"] = t["errors"][0]
    fns.clear()
    if o["memory"]:
        by_lib: dict = {}
        for r in records:
            keep = r["mode"] == "tol" and r.get("reached") or r.get("K") in o["memory_ks"]
            if r["status"] == "ok" and r["median_s"] is not None and keep:
                by_lib.setdefault(r["library"], []).append(r)
        for lib, recs in by_lib.items():
            kw = dict(key=key, lib=lib, width=o["width"], batch=o["batch"])
            cfgs = [dict(kw, method=r["method"], kf=r["kf"], kb=r["kb"], ftol=r["ftol"],
                         btol=r["btol"]) for r in recs]  # fmt: skip
            mem = kit.probe("benchmarks.suites.roots:memory_build", cfgs, 3, True, o["threads"])
            for r, m in zip(recs, mem):
                r.update(peak_mib=m["peak_mib"], memory_how=m.get("how"))
                if m.get("memory_error"):
                    r["memory_error"] = m["memory_error"]
        kit.log(f"{key}: memory done")
    best = {}
    for t in targets:
        for lib in o["libs"]:
            ok = [r for r in records if r["library"] == lib and r["median_s"] is not None]
            ok = [r for r in ok if r["rel_error"] is not None and r["rel_error"] <= t]
            if ok:
                best.setdefault(str(t), {})[lib] = min(ok, key=lambda r: r["median_cpu_s"])
    info = dict(
        title=P.title, kind=kind, facts=P.facts, reference_norm=float(np.linalg.norm(P.reference))
    )
    return dict(
        problem=key, info=info, records=records, best=best, wall_s=time.perf_counter() - t_start
    )


def measure(o: dict, out, name: str) -> None:
    meta = {"versions": versions(), **o, "eq_ftol": EQ_FTOL, "eq_btol": EQ_BTOL, "caps": CAPS}
    meta["missing"] = {lib: missing(lib) for lib in o["libs"] if missing(lib)}
    res = []
    for key in o["problems"]:
        kit.log(f"== {key}")
        res.append(run_problem(key, o))
        kit.save(Path(out) / f"{name}.json", {"meta": meta, "problems": res})


# -- report ----------------------------------------------------------------------------------

HEAD_BEST = (
    "target|library|method|configuration|rel. error|median CPU (ms)|median wall (ms)|peak MiB"
)
HEAD_BEST += "|CPU time / hypergrad's"
HEAD_EQ = (
    "K|library|method|backward products ≤|median CPU (ms)|median wall (ms)|peak MiB|rel. error"
)
HEAD_EQ += "|status"


def config_text(r: dict) -> str:
    if r["mode"] == "equal":
        return f"K = {r['K']}"
    return f"tol {r['tol']:g} (caps {r['kf']}/{r['kb']})"


def fact_text(facts: dict) -> str:
    from benchmarks.report import num

    show = lambda x: num(x, ".3g") if isinstance(x, float) else x
    return ", ".join(f"{k} {show(x)}" for k, x in facts.items() if k != "lam")


def best_rows(p: dict, meta: dict) -> list[list]:
    from benchmarks.report import err, ms, num

    rows = []
    for t, libs in p["best"].items():
        h = libs.get("hypergrad")
        for lib, r in sorted(libs.items(), key=lambda kv: kv[1]["median_cpu_s"]):
            ratio = num(r["median_cpu_s"] / h["median_cpu_s"], ".2f", "×") if h else "–"
            name = f"**{lib}**" if lib == "hypergrad" else lib
            rows.append([f"{float(t):g}", name, r["method"], config_text(r), err(r["rel_error"])])
            rows[-1] += [ms(r["median_cpu_s"]), ms(r["median_s"]), num(r.get("peak_mib"), ".1f")]
            rows[-1].append(ratio)
        ran = [lib for lib in meta["libs"] if lib not in meta.get("missing", {})]
        rows += [
            [f"{float(t):g}", lib, "–", "not reached"] + ["–"] * 5 for lib in ran if lib not in libs
        ]
    return rows


def report(d: dict, path: Path) -> str:
    """Markdown (per problem: the to-accuracy table, then the equal-iteration one) and one plot
    (CPU time against error per problem) from the suite's JSON."""
    from benchmarks.report import COLORS, err, figure, lines, ms, num, save, table

    COLORS.setdefault("torchdeq", "C2")  # (betty's colour; betty is not in this suite)
    meta, probs, m = d["meta"], d["problems"], d["machine"]
    v = meta["versions"]
    names = ("hypergrad", "torch", "jax", "jaxopt", "torchopt", "torchdeq")
    parts = [
        f"Machine: {m['cpu']}, {m.get('cpus_allowed')} CPU(s) allowed, {meta['threads']} "
        f"thread(s), load average at the end {tuple(round(x, 1) for x in m['loadavg'])}; "
        + ", ".join(f"{k} {v.get(k, '?')}" for k in names)
        + f". Run {d['created']}{' (**quick**)' if meta['quick'] else ''}."
    ]
    if meta.get("missing"):
        parts.append("Not run: " + "; ".join(f"{k} ({x})" for k, x in meta["missing"].items()))
    fig, axes = figure(len(probs), 5.2, 4.2, cols=min(len(probs), 3))
    for ax, p in zip(axes, probs):
        parts += ["", f"### {p['info']['title']}", ""]
        parts += [f"Problem `{p['problem']}`: {fact_text(p['info']['facts'])}. Wall time of this "
                  f"problem's run: {p['wall_s']:.0f} s.", ""]  # fmt: skip
        parts += ["To accuracy (each library's fastest configuration, by median CPU time, at or "
                  "below the target):", ""]  # fmt: skip
        parts += [table(HEAD_BEST.split("|"), best_rows(p, meta), "lllllrrrr"), ""]
        order = lambda r: (r["K"], r["library"] != "hypergrad", r["library"], r["method"])
        eq = sorted([r for r in p["records"] if r["mode"] == "equal"], key=order)
        rows = []
        for r in eq:
            status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r['error']}"
            name = f"**{r['library']}**" if r["library"] == "hypergrad" else r["library"]
            rows.append([r["K"], name, r["method"], r["products"], ms(r["median_cpu_s"])])
            rows[-1] += [ms(r["median_s"]), num(r.get("peak_mib"), ".1f"), err(r["rel_error"])]
            rows[-1].append(status.replace("|", "\\|")[:120])
        parts += ["At equal iterations (forward cap K, backward cap K):", ""]
        parts += [table(HEAD_EQ.split("|"), rows, "rllrrrrrl")]
        groups: dict = {}
        for r in [r for r in eq if r["median_cpu_s"] and r["rel_error"] is not None]:
            pt = (r["median_cpu_s"] * 1e3, min(max(r["rel_error"], 1e-16), 10.0))
            groups.setdefault((r["library"], r["method"]), []).append(pt)
        for t, libs in p["best"].items():
            ax.axhline(float(t), color="k", ls=":", lw=0.8)
            for lib, r in libs.items():
                pt = (r["median_cpu_s"] * 1e3, max(r["rel_error"], 1e-16))
                ax.plot(*pt, "*", ms=12, color=COLORS.get(lib, "C2"), mec="k", zorder=5)
        xlabel = "median CPU time per hypergradient (ms); stars: best to accuracy"
        lines(ax, groups, xlabel, "relative hypergradient error", p["info"]["title"])
    save(fig, path)
    return "\n".join(parts)


# -- profile ---------------------------------------------------------------------------------

PROFILED = [
    ("lasso", "fista+gmres", 200),
    ("deq", "anderson+gmres", 30),
    ("deq", "anderson+neumann", 30),
]


def profile(path: Path, top: int = 15) -> None:
    """cProfile of hypergrad's calls where it loses (docs/benchmarks.md, roots section):
    ``python -m benchmarks.suites.roots [PATH]`` (one thread, pinned like the suite)."""
    import cProfile
    import io
    import pstats

    kit.set_threads(1)
    out = []
    for key, m, k in PROFILED:
        fn = build("hypergrad", problem(key), m, k, k, EQ_FTOL, EQ_BTOL)
        fn()
        cpu = []
        for _ in range(5):
            c0 = time.process_time()
            fn()
            cpu.append(time.process_time() - c0)
        prof = cProfile.Profile()
        prof.enable()
        fn()
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
        out.append(
            f"=== {key}: hypergrad {m}, K = {k}: min CPU {min(cpu) * 1e3:.1f} ms over 5 calls"
        )
        out += [ln for ln in s.getvalue().splitlines() if ln.strip()] + [""]
    Path(path).write_text("\n".join(out))


if __name__ == "__main__":
    import sys

    profile(Path(sys.argv[1]) if len(sys.argv) > 1 else kit.RESULTS / "roots_profile.txt")
