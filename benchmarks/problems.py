"""The benchmark problems (docs/benchmarks.md, "Method"): ``theta`` are log weight decays, one per
feature or per weight matrix; ``PEER_PROBLEMS`` (``ridge_tiny``: the tests'), and ``random_net``
for the overhead / HVP-cost / memory suites. Inner solutions and references are ``cached``."""

from __future__ import annotations

import copy
import hashlib
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from benchmarks import kit
from benchmarks.peers import Unsupported
from hypergrad.solvers import power_iteration

CACHE_VERSION = "v3"  # v3: tensors and plain containers only, loaded with weights_only=True
LOG_WD = float(np.log(1e-2))  # the networks' initial log weight decay
NO_TWIN = "the CNN is a torch nn.Module (BatchNorm in train mode) with no JAX twin here"
FASHION = os.environ.get("FASHION_MNIST_DIR", "/usr/share/datasets/fashion-mnist")
_NDARRAY = "__ndarray__"  # marks a NumPy array stored as a tensor in a cache file


class UnsafeCacheError(RuntimeError):
    """A cache file that does not load as plain data (tensors, numbers, strings, containers)."""


def _to_plain(obj: Any) -> Any:
    """``obj`` with NumPy arrays as ``{_NDARRAY: tensor}`` and NumPy scalars as Python numbers,
    so that ``torch.load(weights_only=True)`` reads it back without unpickling any class."""
    if isinstance(obj, np.ndarray):
        return {_NDARRAY: torch.from_numpy(np.ascontiguousarray(obj))}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {k: _to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_plain(v) for v in obj)
    if obj is None or isinstance(obj, (torch.Tensor, bool, int, float, str)):
        return obj
    raise TypeError(f"cannot cache a {type(obj).__name__} (tensors, arrays, numbers only)")


def _from_plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {_NDARRAY}:
            return obj[_NDARRAY].numpy()
        return {k: _from_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_from_plain(v) for v in obj)
    return obj


def load_cache(path: Path) -> dict:
    """A cache file read with ``torch.load(weights_only=True)``: tensors, numbers, strings and
    containers only. The folder is named by an environment variable, so a file there is not
    trusted: anything else (a pickle of some class, whose ``__reduce__`` could run code) is
    refused without being executed."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # UnpicklingError for foreign globals, zip errors for garbage
        raise UnsafeCacheError(
            f"{path} is not a hypergrad benchmark cache (plain tensors and numbers): refused "
            f"without running it ({type(exc).__name__}). Delete it to rebuild the cache."
        ) from exc
    if not isinstance(obj, dict):
        raise UnsafeCacheError(f"{path} holds a {type(obj).__name__}, not a cache dict")
    return dict(_from_plain(obj))


def cached(name: str, build: Callable[[], dict]) -> dict:
    """``build()``, kept in ``$HYPERGRAD_PEERS_CACHE`` (default ``~/.cache/hypergrad-peers``) as
    plain data read back with ``weights_only=True`` (see :func:`load_cache`)."""
    d = Path(os.environ.get("HYPERGRAD_PEERS_CACHE", Path.home() / ".cache" / "hypergrad-peers"))
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{name}-{CACHE_VERSION}.pt"
    if path.exists():
        return load_cache(path)
    t0 = time.perf_counter()
    obj = {**build(), "build_s": time.perf_counter() - t0}
    torch.save(_to_plain(obj), path.with_suffix(".tmp"))
    os.replace(path.with_suffix(".tmp"), path)
    return load_cache(path)


def fashion_mnist(n_train: int, n_val: int, seed: int = 0) -> tuple[np.ndarray, ...]:
    """Two disjoint random subsets of the Fashion-MNIST training set, (n, 784) in [0, 1]."""
    from examples._fashion_mnist import load  # the examples' validated IDX reader

    d = load(FASHION)
    x, y = d["train_images"].astype(np.float32) / 255.0, d["train_labels"].astype(np.int64)
    perm = np.random.default_rng(seed).permutation(len(y))
    tr, va = perm[:n_train], perm[n_train : n_train + n_val]
    return x[tr], y[tr], x[va], y[va]


class FixedMaskDropout(nn.Module):
    """Dropout (p = 0.5) whose mask is the same at every forward (private generator, seed 1234)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        gen = torch.Generator(device=x.device).manual_seed(1234)
        keep = torch.rand(x.shape, generator=gen, device=x.device) >= 0.5
        return x * keep.to(x.dtype) / (1.0 - 0.5)


class DigitFiveCNN(nn.Module):
    """The Digit-Five CNN of M3SDA (Peng et al. 2019) at ``width`` times its channels / units
    (docs/performance.md), with ``FixedMaskDropout`` or ``nn.Dropout``."""

    def __init__(self, width: float = 1.0, fixed_dropout: bool = False):
        super().__init__()
        c1, c2, c3, f1, f2 = (max(1, round(c * width)) for c in (64, 64, 128, 3072, 2048))
        convs = []
        for cin, cout, pool in ((3, c1, True), (c1, c2, True), (c2, c3, False)):
            convs += [nn.Conv2d(cin, cout, 5, padding=2), nn.BatchNorm2d(cout), nn.ReLU()]
            convs += [nn.MaxPool2d(3, stride=2, padding=1)] if pool else []
        drop = FixedMaskDropout() if fixed_dropout else nn.Dropout(0.5)
        fc = [nn.Flatten(), nn.Linear(c3 * 8 * 8, f1), nn.BatchNorm1d(f1), nn.ReLU(), drop]
        self.features = nn.Sequential(*convs, *fc, nn.Linear(f1, f2), nn.BatchNorm1d(f2), nn.ReLU())
        self.head = nn.Linear(f2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def make_mlp(sizes: tuple[int, ...] = (784, 1024, 256, 10)) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers += [nn.Linear(sizes[i], sizes[i + 1])] + ([nn.ReLU()] if i < len(sizes) - 2 else [])
    return nn.Sequential(*layers)


@dataclass
class Problem:
    key: str
    title: str
    model: nn.Module
    params: dict[str, torch.Tensor]  # the inner solution (or the starting point)
    theta: torch.Tensor  # log decays
    x_tr: torch.Tensor
    y_tr: torch.Tensor
    x_va: torch.Tensor
    y_va: torch.Tensor
    loss_kind: str  # "mse" | "bce" | "ce"
    decay: str  # "feature" (theta_j on weight[0, j]) | "layer" (theta_l on decayed[l])
    decayed: list[str]
    reference: np.ndarray | None  # float64 reference hypergradient
    alpha: float  # Neumann step 1 / lambda_max(H), shared by every Neumann implementation
    dtype: torch.dtype
    reference_note: str = ""
    extras: dict[str, Any] = field(default_factory=dict)
    prox: float = 0.0  # proximal term 0.5 * prox * ||psi - prox_center||^2 in L_in
    prox_center: dict[str, torch.Tensor] | None = None

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params.values())

    def data_loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.loss_kind == "mse":
            return 0.5 * ((out.squeeze(-1) - y) ** 2).mean()
        if self.loss_kind == "bce":
            return F.binary_cross_entropy_with_logits(out.squeeze(-1), y)
        return F.cross_entropy(out, y)

    def reg(self, params: dict[str, torch.Tensor], theta: torch.Tensor) -> torch.Tensor:
        if self.decay == "feature":
            r = 0.5 * (torch.exp(theta) * params[self.decayed[0]][0] ** 2).sum()
        else:
            c = torch.exp(theta)
            r = 0.5 * sum(c[i] * (params[n] ** 2).sum() for i, n in enumerate(self.decayed))
        if self.prox:
            c = self.prox_center
            r = r + 0.5 * self.prox * sum(((params[n] - c[n]) ** 2).sum() for n in c)
        return r

    def inner(self, params: dict[str, torch.Tensor], theta: torch.Tensor) -> torch.Tensor:
        out = functional_call(self.model, params, (self.x_tr,))
        return self.data_loss(out, self.y_tr) + self.reg(params, theta)

    def outer(self, params: dict[str, torch.Tensor], theta: torch.Tensor) -> torch.Tensor:
        return self.data_loss(functional_call(self.model, params, (self.x_va,)), self.y_va)

    def module_inner(self, model: nn.Module, theta: torch.Tensor) -> torch.Tensor:
        """The inner loss of a live module (betty, higher)."""
        reg = self.reg(dict(model.named_parameters()), theta)
        return self.data_loss(model(self.x_tr), self.y_tr) + reg

    def module_outer(self, model: nn.Module) -> torch.Tensor:
        return self.data_loss(model(self.x_va), self.y_va)

    def fresh_model(self, params: dict[str, torch.Tensor] | None = None) -> nn.Module:
        """A copy of the model holding ``params`` (default: the inner solution)."""
        m = copy.deepcopy(self.model)
        with torch.no_grad():
            for n, p in m.named_parameters():
                p.copy_((params or self.params)[n])
        return m

    def rel_error(self, g: np.ndarray, ref: np.ndarray | None = None) -> float:
        ref = self.reference if ref is None else ref
        g = np.asarray(g, dtype=np.float64).ravel()
        if g.shape != ref.shape:
            return float("inf")
        return float(np.linalg.norm(g - ref) / np.linalg.norm(ref))

    def to(self, dtype: torch.dtype) -> Problem:
        """The same problem at another precision (the reference is kept)."""
        q, cast = copy.copy(self), lambda d: {n: p.to(dtype) for n, p in d.items()}
        q.model, q.params = copy.deepcopy(self.model).to(dtype), cast(self.params)
        q.theta = self.theta.to(dtype)
        q.prox_center = None if self.prox_center is None else cast(self.prox_center)
        q.x_tr, q.x_va, q.dtype = self.x_tr.to(dtype), self.x_va.to(dtype), dtype
        if self.loss_kind != "ce":
            q.y_tr, q.y_va = self.y_tr.to(dtype), self.y_va.to(dtype)
        return q


def jax_twin(P: Problem) -> tuple[dict, Any, Callable, Callable]:
    """JAX versions ``(params, theta, inner, outer)`` of the ridge, logistic and MLP problems."""
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp

    if P.key.startswith("cnn"):
        raise Unsupported(NO_TWIN)
    npdt = np.float64 if P.dtype == torch.float64 else np.float32
    j = lambda t: jnp.asarray(t.detach().cpu().numpy().astype(npdt))  # noqa: E731
    jy = (lambda t: jnp.asarray(t.numpy())) if P.loss_kind == "ce" else j
    xtr, xva, ytr, yva = j(P.x_tr), j(P.x_va), jy(P.y_tr), jy(P.y_va)
    center = {n: j(p) for n, p in (P.prox_center or {}).items()}
    layers = sorted({int(n.split(".")[0]) for n in P.params if n[0].isdigit()})

    def forward(p, x):
        if not layers:  # linear model: weight (1, d), optional bias (1,)
            return x @ p["weight"][0] + (p["bias"][0] if "bias" in p else 0.0)
        for k, i in enumerate(layers):
            x = x @ p[f"{i}.weight"].T + p[f"{i}.bias"]
            x = jax.nn.relu(x) if k < len(layers) - 1 else x
        return x

    def data_loss(out, y):
        if P.loss_kind == "mse":
            return 0.5 * jnp.mean((out - y) ** 2)
        if P.loss_kind == "bce":
            return jnp.mean(jax.nn.softplus(out) - y * out)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(out), y[:, None], axis=1))

    def inner(p, th):
        if P.decay == "feature":
            r = 0.5 * jnp.sum(jnp.exp(th) * p[P.decayed[0]][0] ** 2)
        else:
            r = 0.5 * sum(jnp.exp(th)[i] * jnp.sum(p[n] ** 2) for i, n in enumerate(P.decayed))
        r = r + 0.5 * P.prox * sum(jnp.sum((p[n] - center[n]) ** 2) for n in center)
        return data_loss(forward(p, xtr), ytr) + r

    def outer(p, th):
        return data_loss(forward(p, xva), yva)

    return {n: j(p) for n, p in P.params.items()}, j(P.theta), inner, outer


def spectrum(P: Problem, iters: int = 100) -> tuple[float, float]:
    """(lambda_max, lambda_min) of the inner Hessian by power iteration (on lambda_max I - H)."""
    ps = tuple(p.detach().requires_grad_(True) for p in P.params.values())
    gs = torch.autograd.grad(P.inner(dict(zip(P.params, ps)), P.theta), ps, create_graph=True)
    hvp = lambda v: tuple(h.detach() for h in torch.autograd.grad(gs, ps, v, retain_graph=True))
    lam_max = power_iteration(hvp, ps, iters)[0]
    shifted = lambda v: tuple(lam_max * a - b for a, b in zip(v, hvp(v)))
    return lam_max, lam_max - power_iteration(shifted, ps, iters)[0]


def cg_reference(P: Problem) -> dict:
    """The implicit hypergradient with hypergrad's CG to a relative residual of 1e-11."""
    import hypergrad as hg
    from benchmarks.peers.hypergrad import make_solver

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = make_solver("cg", 5000, tol=1e-11)
        g, info = hg.implicit_grad(P.inner, P.outer, P.params, P.theta, solver=s)
    s = info.solve
    out = dict(g=g.detach().double().numpy().ravel(), iters=s.iterations, residual=s.residual)
    return {**out, "converged": s.converged, "diverged": s.diverged}


def _lbfgs(P: Problem, iters: int, tol: float) -> dict:
    names, ps = list(P.params), [p.detach().clone().requires_grad_(True) for p in P.params.values()]
    kw = dict(lr=1.0, history_size=50, tolerance_change=0.0, line_search_fn="strong_wolfe")
    opt = torch.optim.LBFGS(ps, max_iter=iters, tolerance_grad=tol, **kw)

    def closure():
        opt.zero_grad()
        loss = P.inner(dict(zip(names, ps)), P.theta)
        loss.backward()
        return loss

    opt.step(closure)
    g = torch.autograd.grad(P.inner(dict(zip(names, ps)), P.theta), ps)
    out = dict(params={n: p.detach() for n, p in zip(names, ps)})
    out["grad_norm"] = float(torch.sqrt(sum((a**2).sum() for a in g)))
    return {**out, "lbfgs_evals": opt.state[opt._params[0]]["func_evals"]}


def _solve_net(P: Problem, iters32: int, iters64: int) -> dict:
    """L-BFGS in float32 then float64; then the proximal ``delta`` and the CG reference (for the
    MLP cross-checked with torchopt's CG, independent code)."""
    from benchmarks.peers import torchopt

    log = lambda m: kit.log(f"{P.key}: {m}")
    log("inner solution (L-BFGS)")
    q = P.to(torch.float32)
    q.params = _lbfgs(q, iters32, 1e-7)["params"]
    P.params = {n: p.double() for n, p in q.params.items()}
    sol = _lbfgs(P, iters64, 1e-10)
    P.params = sol["params"]
    lam_max, lam_min = spectrum(P)
    log(f"grad norm {sol['grad_norm']:.2e}, lambda_max {lam_max:.4g}, lambda_min {lam_min:.4g}")
    P.prox_center = {n: p.clone() for n, p in P.params.items()}
    for delta in [0.0] + [m * 10.0**e for e in range(-3, 2) for m in (1, 2, 5)]:
        if delta < 2 * max(-lam_min, 0.0):
            continue
        P.prox = delta
        ref = cg_reference(P)
        log(f"delta {delta:g}: CG {ref['iters']} its, residual {ref['residual']:.1e}")
        if ref["converged"]:
            mlp = P.key.startswith("mlp")
            alt = torchopt.implicit(P, "cg", 20000, tol=1e-11)() if mlp else None
            sol.update(ref=ref, alt=alt, delta=delta, lambda_max=lam_max + delta)
            return {**sol, "lambda_min_H": lam_min, "lambda_max_H": lam_max}
    raise RuntimeError(f"{P.key}: no proximal delta made the CG reference converge")


def _t(a: Any) -> torch.Tensor:
    return torch.tensor(a, dtype=torch.float64)


def linear(loss: str, dataset: str) -> Problem:
    """Ridge (``loss="mse"``) or logistic regression (``"bce"``), one log decay per feature; Newton
    to ``||grad|| < 1e-13`` and the dense reference, in float64."""
    if dataset == "tiny":  # 80 x 5, decay 1: condition number ~2 (unrolled GD converges fast)
        rng = np.random.default_rng(0)
        X, y, theta = rng.standard_normal((80, 5)), rng.standard_normal(80), np.zeros(5)
    else:  # standardised; the regression target too
        from sklearn import datasets

        d = getattr(datasets, f"load_{dataset}")()
        X = (d.data - d.data.mean(0)) / np.where(d.data.std(0) > 0, d.data.std(0), 1.0)
        y = d.target.astype(np.float64)
        y = y if dataset == "breast_cancer" else (y - y.mean()) / y.std()
        rng = np.random.default_rng(2 if loss == "bce" else 1)
        theta = np.log(1e-2) + rng.standard_normal(X.shape[1])
    perm = np.random.default_rng(0).permutation(len(y))
    tr, va = perm[: len(y) // 2], perm[len(y) // 2 :]
    d, bias = X.shape[1], loss == "bce"
    X1 = np.hstack([X, np.ones((len(y), 1))]) if bias else X
    lam = np.append(np.exp(theta), 0.0) if bias else np.exp(theta)

    def grad_hess(z, idx):
        out = X1[idx] @ z
        p = 1 / (1 + np.exp(-out)) if bias else out
        curv = p * (1 - p) if bias else np.ones_like(out)
        H = (X1[idx] * curv[:, None]).T @ X1[idx] / len(idx) + np.diag(lam)
        return X1[idx].T @ (p - y[idx]) / len(idx), H

    z, it = np.zeros(X1.shape[1]), 0
    for it in range(100):  # noqa: B007
        g, H = grad_hess(z, tr)
        if np.linalg.norm(g + lam * z) < 1e-13:
            break
        z = z - np.linalg.solve(H, g + lam * z)
    eig = np.linalg.eigvalsh(H)
    ref = -(np.exp(theta) * z[:d]) * np.linalg.solve(H, grad_hess(z, va)[0])[:d]
    key, name = ("ridge", "Ridge") if loss == "mse" else ("logreg", "Logistic regression")
    params = {"weight": _t(z[:d][None, :])} | ({"bias": _t(z[d:])} if bias else {})
    note = "dense float64 Hessian solve at a Newton-converged solution"
    note = note if bias else "closed form: -(exp(theta) * w) * (H^-1 grad_w L_out), float64"
    extras = dict(newton_iters=it, condition_number=float(eig[-1] / eig[0]))
    extras.update(lambda_max=float(eig[-1]), lambda_min=float(eig[0]), n_train=len(tr))
    title = f"{name}, per-feature decay, {dataset}" + ("" if bias else f" ({len(y)}x{d})")
    data = [_t(a) for a in (X[tr], y[tr], X[va], y[va])]
    model, alpha = nn.Linear(d, 1, bias=bias).double(), float(1.0 / eig[-1])
    extras["n_val"] = len(va)
    spec = (loss, "feature", ["weight"], ref, alpha, torch.float64, note, extras)
    return Problem(f"{key}_{dataset}", title, model, params, _t(theta), *data, *spec)


def _net(key, title, model, data, log_wd=LOG_WD, dtype=torch.float64, ref=True) -> Problem:
    """A network problem, one log decay per weight matrix; ``data`` = (x_tr, y_tr, x_va, y_va)."""
    model = model.to(dtype).train()
    decayed = [n for n, p in model.named_parameters() if p.ndim >= 2]
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    theta = torch.full((len(decayed),), log_wd, dtype=dtype)
    data = [torch.as_tensor(a, dtype=dtype if i % 2 == 0 else None) for i, a in enumerate(data)]
    note = "hypergrad CG to relative residual 1e-11 in float64"
    note += ", cross-checked with torchopt's CG (float64, same tolerance)" if ref else ""
    spec = ("ce", "layer", decayed, None, 1.0, dtype, note)
    return Problem(key, title, model, params, theta, *data, *spec)


def _finish_net(P: Problem, name: str, iters: tuple[int, int]) -> Problem:
    """``P`` at its cached inner solution, with the proximal term and the reference."""
    c = cached(name, lambda: _solve_net(P, *iters))
    P.params, P.reference, P.alpha = c["params"], c["ref"]["g"], 1.0 / c["lambda_max"]
    P.prox, P.prox_center = c["delta"], {n: p.clone() for n, p in c["params"].items()}
    ref = c["ref"]
    P.extras.update(inner_grad_norm=c["grad_norm"], lbfgs_evals=c["lbfgs_evals"])
    P.extras.update(reference_cg_iters=ref["iters"], reference_residual=ref["residual"])
    P.extras.update(reference_converged=ref["converged"], lambda_max=c["lambda_max"])
    P.extras.update(prox_delta=c["delta"], lambda_min_H_estimate=c["lambda_min_H"])
    P.extras["build_s"] = c.get("build_s")
    if c.get("alt") is not None:
        P.extras["oracle_agreement"] = P.rel_error(c["alt"])
    return P


def mlp(sizes=(784, 1024, 256, 10), n_train=256, n_val=256) -> Problem:
    xtr, ytr, xva, yva = fashion_mnist(n_train, n_val, seed=0)
    mu, sd = xtr.mean(), xtr.std()
    torch.manual_seed(0)
    model = make_mlp(sizes)
    size = f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters"
    title = f"MLP {'-'.join(map(str, sizes))} ({size}) on Fashion-MNIST ({n_train} inner / "
    title += f"{n_val} outer images)"
    P = _net("mlp_fashion", title, model, ((xtr - mu) / sd, ytr, (xva - mu) / sd, yva))
    tag = "_".join(map(str, sizes[1:-1]))
    return _finish_net(P, f"mlp_fashion_{tag}_{n_train}_{n_val}_{LOG_WD:.3f}", (600, 200))


def cnn(width: float = 0.125, batch: int = 32) -> Problem:
    xtr, ytr, xva, yva = fashion_mnist(batch, batch, seed=1)

    def img(a):  # 28x28 -> 32x32x3, standardised
        a = np.pad((a.reshape(-1, 28, 28) - 0.2860) / 0.3530, ((0, 0), (2, 2), (2, 2)))
        return np.repeat(a[:, None], 3, axis=1)

    torch.manual_seed(0)
    model = DigitFiveCNN(width, fixed_dropout=True)
    title = f"Digit-Five CNN (width x{width}), BatchNorm in train mode, batch {batch}"
    P = _net("cnn_digit5", title, model, (img(xtr), ytr, img(xva), yva), ref=False)
    P.extras.update(width=width, batch=batch)
    tag = hashlib.sha1(f"{batch}-{width}-{LOG_WD}".encode()).hexdigest()[:8]
    return _finish_net(P, f"cnn_digit5_{tag}", (400, 100))


def random_net(kind: str, batch: int) -> Problem:
    """MLP 784-1024-256-10 (1.07M parameters) or the full-width Digit-Five CNN (31.8M) at their
    random initialisation on random data (float32, log decays -4): overhead, HVP cost, memory."""
    torch.manual_seed(0)
    model, shape = (make_mlp(), (784,)) if kind == "mlp" else (DigitFiveCNN(), (3, 32, 32))
    x = [torch.randn(batch, *shape) for _ in range(2)]
    y = [torch.randint(0, 10, (batch,)) for _ in range(2)]
    title = f"{kind} ({sum(p.numel() for p in model.parameters()):,} parameters), batch {batch}"
    return _net(kind, title, model, (x[0], y[0], x[1], y[1]), -4.0, torch.float32, ref=False)


# precision the libraries run at (the reference is float64); quick: smaller networks
PEER_PROBLEMS: dict[str, tuple[Callable[[bool], Problem], torch.dtype]] = {
    "ridge_breast_cancer": (lambda q: linear("mse", "breast_cancer"), torch.float64),
    "ridge_diabetes": (lambda q: linear("mse", "diabetes"), torch.float64),
    "logreg_breast_cancer": (lambda q: linear("bce", "breast_cancer"), torch.float64),
    "mlp_fashion": (lambda q: mlp((784, 32, 10), 64, 64) if q else mlp(), torch.float32),
    "cnn_digit5": (lambda q: cnn(1 / 32, 16) if q else cnn(), torch.float32),
    "ridge_tiny": (lambda q: linear("mse", "tiny"), torch.float64),
}


def get(key: str, quick: bool = False) -> Problem:
    build, dtype = PEER_PROBLEMS[key]
    P = build(quick)
    return P if P.dtype == dtype else P.to(dtype)
