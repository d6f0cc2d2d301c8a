"""The bilevel test problems of the peer benchmark (torch side, plus JAX twins for jaxopt).

Every problem is ``min_theta L_out(psi*(theta))`` with ``psi*(theta) = argmin_psi L_in(psi,
theta)`` and ``theta`` a vector of *log* weight decays:

* ``ridge_breast_cancer``, ``ridge_diabetes``: linear least squares with one decay per feature,
  ``L_in = 0.5 mean((Xw - y)^2) + 0.5 sum_j exp(theta_j) w_j^2`` on half of scikit-learn's data
  set, ``L_out`` the same squared error on the other half. The inner solution and the
  hypergradient are closed-form (float64 linear algebra).
* ``logreg_breast_cancer``: logistic regression (weights + unpenalised bias) with one decay per
  feature. Inner solution by Newton's method in float64 to ``||grad|| < 1e-13``; reference by a
  dense float64 Hessian solve at that point.
* ``mlp_fashion``: 784-1024-256-10 ReLU MLP (1,068,810 parameters) on 256
  Fashion-MNIST training images (inner, full batch) and 256 other ones (outer), one log decay per
  weight matrix. Inner solution by L-BFGS (float32, then float64); the libraries run in float32
  at that point. L-BFGS stalls (ReLU kinks) where the Hessian is indefinite, so the inner loss
  gets a proximal term ``0.5 delta ||psi - psi_bar||^2`` around that point (``psi_bar`` = the
  point; as in iMAML) with the smallest ``delta`` that makes float64 CG converge (see
  ``_make_positive_definite``); it is part of the problem, so every library sees it. Reference: CG
  run to convergence in float64 (hypergrad's CG, cross-checked with torchopt's).
* ``cnn_digit5``: the Digit-Five CNN of M3SDA (conv5x5 64-64-128 + BN + ReLU + maxpool, FC
  8192-3072-2048 + BN1d, dropout, linear head) at a reduced width (``CNN_WIDTH``) on
  Fashion-MNIST images padded to 32x32x3, BatchNorm in train mode (batch statistics), one log decay
  per conv kernel / weight matrix (batch 32 + 32), the same proximal term as the MLP. The dropout
  mask is fixed (drawn from a private generator with a constant seed at every forward), so the
  bilevel problem is a deterministic function that every library sees identically; with the
  global RNG each library consumes draws in a different order and the "error" would measure RNG,
  not the solver. Reference: float64 CG to convergence.

Each :class:`Problem` carries the torch module, the functional inner/outer losses over a dict of
parameters, the inner solution, the reference hypergradient, the Neumann step ``alpha`` (one over
the largest Hessian eigenvalue, shared by every Neumann implementation) and, for jaxopt, JAX twins
of the losses. Inner solutions and references are cached on disk (``cache_dir()``).
"""

from __future__ import annotations

import gzip
import hashlib
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

_BENCHMARKS = str(Path(__file__).resolve().parents[1])
if _BENCHMARKS not in sys.path:  # benchmarks/common.py (appended: peers/ modules come first)
    sys.path.append(_BENCHMARKS)
from common import make_mlp  # noqa: E402

CACHE_VERSION = "v1"
FASHION = Path(os.environ.get("FASHION_MNIST_DIR", "/usr/share/datasets/fashion-mnist"))
MLP_SIZES = (784, 1024, 256, 10)
CNN_WIDTH = 0.125  # fraction of the original Digit-Five CNN widths (see cnn_digit5)


def cache_dir() -> Path:
    d = Path(os.environ.get("HYPERGRAD_PEERS_CACHE", Path.home() / ".cache" / "hypergrad-peers"))
    d.mkdir(parents=True, exist_ok=True)
    return d


# --------------------------------------------------------------------------------------- data


def _standardize(x: np.ndarray) -> np.ndarray:
    mu, sd = x.mean(0), x.std(0)
    return (x - mu) / np.where(sd > 0, sd, 1.0)


def _split(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    perm = np.random.default_rng(seed).permutation(n)
    return perm[: n // 2], perm[n // 2 :]


def sklearn_data(name: str) -> tuple[np.ndarray, np.ndarray]:
    from sklearn import datasets

    if name == "breast_cancer":
        d = datasets.load_breast_cancer()
        return _standardize(d.data), d.target.astype(np.float64)
    if name == "diabetes":
        d = datasets.load_diabetes()
        y = d.target.astype(np.float64)
        return _standardize(d.data), (y - y.mean()) / y.std()
    raise ValueError(name)


def _read_idx(path: Path) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        raw = f.read()
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def fashion_mnist(n_train: int, n_val: int, seed: int = 0) -> tuple[np.ndarray, ...]:
    """Two disjoint random subsets of the Fashion-MNIST training set, pixels scaled to [0, 1]."""
    img = FASHION / "train-images-idx3-ubyte.gz"
    lab = FASHION / "train-labels-idx1-ubyte.gz"
    if not img.exists():
        raise FileNotFoundError(
            f"{img} not found: install Debian's dataset-fashion-mnist (apt-get install "
            "dataset-fashion-mnist) or set FASHION_MNIST_DIR"
        )
    x = _read_idx(img).astype(np.float32) / 255.0
    y = _read_idx(lab).astype(np.int64)
    perm = np.random.default_rng(seed).permutation(len(y))
    tr, va = perm[:n_train], perm[n_train : n_train + n_val]
    return x[tr], y[tr], x[va], y[va]


# --------------------------------------------------------------------------------------- models


class FixedMaskDropout(nn.Module):
    """Dropout whose mask is the same at every forward (private generator, constant seed)."""

    def __init__(self, p: float = 0.5, seed: int = 1234):
        super().__init__()
        self.p, self.seed = p, seed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        gen = torch.Generator(device=x.device).manual_seed(self.seed)
        keep = torch.rand(x.shape, generator=gen, device=x.device) >= self.p
        return x * keep.to(x.dtype) / (1.0 - self.p)


class DigitFiveCNN(nn.Module):
    """Digit-Five CNN of M3SDA at ``width`` times its channel / unit counts (1.0 = original).

    conv5x5 3->64w + BN + ReLU + maxpool(3,2,1); conv5x5 64w->64w + BN + ReLU + maxpool(3,2,1);
    conv5x5 64w->128w + BN + ReLU; flatten (128w*8*8); FC ->3072w + BN1d + ReLU + dropout(0.5);
    FC ->2048w + BN1d + ReLU; head ->10.
    """

    def __init__(self, width: float = 1.0, num_classes: int = 10):
        super().__init__()
        c1, c2, c3 = (max(1, round(c * width)) for c in (64, 64, 128))
        f1, f2 = (max(1, round(f * width)) for f in (3072, 2048))
        self.features = nn.Sequential(
            nn.Conv2d(3, c1, 5, padding=2),
            nn.BatchNorm2d(c1),
            nn.ReLU(),
            nn.MaxPool2d(3, stride=2, padding=1),
            nn.Conv2d(c1, c2, 5, padding=2),
            nn.BatchNorm2d(c2),
            nn.ReLU(),
            nn.MaxPool2d(3, stride=2, padding=1),
            nn.Conv2d(c2, c3, 5, padding=2),
            nn.BatchNorm2d(c3),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(c3 * 8 * 8, f1),
            nn.BatchNorm1d(f1),
            nn.ReLU(),
            FixedMaskDropout(0.5),
            nn.Linear(f1, f2),
            nn.BatchNorm1d(f2),
            nn.ReLU(),
        )
        self.head = nn.Linear(f2, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


# --------------------------------------------------------------------------------------- problem


@dataclass
class Problem:
    key: str
    title: str
    model: nn.Module
    params: dict[str, torch.Tensor]  # inner solution, in ``dtype``
    theta: torch.Tensor  # log decays, in ``dtype``
    x_tr: torch.Tensor
    y_tr: torch.Tensor
    x_va: torch.Tensor
    y_va: torch.Tensor
    loss_kind: str  # "mse" | "bce" | "ce"
    decay: str  # "feature" (theta_j on weight[0, j]) | "layer" (theta_l on decayed[l])
    decayed: list[str]
    reference: np.ndarray  # float64 reference hypergradient
    alpha: float  # Neumann step, 1 / lambda_max(H)
    dtype: torch.dtype
    reference_note: str = ""
    extras: dict[str, Any] = field(default_factory=dict)
    jax: Any = None  # JaxTwin or None
    prox: float = 0.0  # optional proximal term 0.5 * prox * ||psi - prox_center||^2 in L_in
    prox_center: dict[str, torch.Tensor] | None = None

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params.values())

    # --- losses over a dict of parameters (the functional form every library can use) ---
    def data_loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.loss_kind == "mse":
            return 0.5 * ((out.squeeze(-1) - y) ** 2).mean()
        if self.loss_kind == "bce":
            return F.binary_cross_entropy_with_logits(out.squeeze(-1), y)
        return F.cross_entropy(out, y)

    def reg(self, params: dict[str, torch.Tensor], theta: torch.Tensor) -> torch.Tensor:
        if self.decay == "feature":
            w = params[self.decayed[0]]
            r = 0.5 * (torch.exp(theta) * w[0] ** 2).sum()
        else:
            coef = torch.exp(theta)
            r = 0.5 * sum(coef[i] * (params[n] ** 2).sum() for i, n in enumerate(self.decayed))
        if self.prox:
            c = self.prox_center
            r = r + 0.5 * self.prox * sum(((params[n] - c[n]) ** 2).sum() for n in c)
        return r

    def inner(self, params: dict[str, torch.Tensor], theta: torch.Tensor) -> torch.Tensor:
        out = functional_call(self.model, params, (self.x_tr,))
        return self.data_loss(out, self.y_tr) + self.reg(params, theta)

    def outer(self, params: dict[str, torch.Tensor], theta: torch.Tensor) -> torch.Tensor:
        return self.data_loss(functional_call(self.model, params, (self.x_va,)), self.y_va)

    # --- module form (betty, higher): the loss of the live module ---
    def module_inner(self, model: nn.Module, theta: torch.Tensor) -> torch.Tensor:
        return self.data_loss(model(self.x_tr), self.y_tr) + self.reg(
            dict(model.named_parameters()), theta
        )

    def module_outer(self, model: nn.Module) -> torch.Tensor:
        return self.data_loss(model(self.x_va), self.y_va)

    def fresh_model(self) -> nn.Module:
        """A deep copy of the model holding the inner solution as its parameters."""
        import copy

        m = copy.deepcopy(self.model)
        with torch.no_grad():
            for n, p in m.named_parameters():
                p.copy_(self.params[n])
        return m

    def rel_error(self, g: np.ndarray) -> float:
        g = np.asarray(g, dtype=np.float64).ravel()
        if g.shape != self.reference.shape or not np.all(np.isfinite(g)):
            return float("nan") if g.shape == self.reference.shape else float("inf")
        return float(np.linalg.norm(g - self.reference) / np.linalg.norm(self.reference))

    def to(self, dtype: torch.dtype) -> Problem:
        """The same problem at another float precision (the reference is kept)."""
        import copy

        q = copy.copy(self)
        q.model = copy.deepcopy(self.model).to(dtype)
        q.params = {n: p.to(dtype) for n, p in self.params.items()}
        q.theta = self.theta.to(dtype)
        if self.prox_center is not None:
            q.prox_center = {n: p.to(dtype) for n, p in self.prox_center.items()}
        cast = lambda t: t.to(dtype)  # noqa: E731
        q.x_tr, q.x_va = cast(self.x_tr), cast(self.x_va)
        if self.loss_kind != "ce":
            q.y_tr, q.y_va = cast(self.y_tr), cast(self.y_va)
        q.dtype = dtype
        return q


# --------------------------------------------------------------------------------------- JAX twins


@dataclass
class JaxTwin:
    """JAX versions of the inner/outer losses over a dict of arrays (jaxopt's oracle)."""

    params: dict[str, Any]
    theta: Any
    inner: Callable
    outer: Callable


def jax_twin(P: Problem) -> JaxTwin | None:
    """Build the JAX twin of ``P`` (ridge, logistic, MLP); None for the CNN."""
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp

    if P.key.startswith("cnn"):
        return None
    npdt = np.float64 if P.dtype == torch.float64 else np.float32
    to_j = lambda t: jnp.asarray(t.detach().cpu().numpy().astype(npdt))  # noqa: E731
    params = {n: to_j(p) for n, p in P.params.items()}
    theta = to_j(P.theta)
    xtr, xva = to_j(P.x_tr), to_j(P.x_va)
    if P.loss_kind == "ce":
        ytr, yva = jnp.asarray(P.y_tr.numpy()), jnp.asarray(P.y_va.numpy())
    else:
        ytr, yva = to_j(P.y_tr), to_j(P.y_va)

    if P.key.startswith(("ridge", "logreg")):
        wn = P.decayed[0]
        bn = "bias" if "bias" in params else None

        def forward(p, x):
            out = x @ p[wn][0]
            return out + p[bn][0] if bn else out

    else:  # MLP: Sequential of Linear/ReLU, names "<i>.weight"
        lin = sorted({int(n.split(".")[0]) for n in params})

        def forward(p, x):
            h = x
            for k, i in enumerate(lin):
                h = h @ p[f"{i}.weight"].T + p[f"{i}.bias"]
                if k < len(lin) - 1:
                    h = jax.nn.relu(h)
            return h

    def data_loss(out, y):
        if P.loss_kind == "mse":
            return 0.5 * jnp.mean((out - y) ** 2)
        if P.loss_kind == "bce":
            return jnp.mean(jax.nn.softplus(out) - y * out)
        logp = jax.nn.log_softmax(out, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))

    center = {n: to_j(p) for n, p in P.prox_center.items()} if P.prox_center is not None else None

    def reg(p, th):
        if P.decay == "feature":
            r = 0.5 * jnp.sum(jnp.exp(th) * p[P.decayed[0]][0] ** 2)
        else:
            c = jnp.exp(th)
            r = 0.5 * sum(c[i] * jnp.sum(p[n] ** 2) for i, n in enumerate(P.decayed))
        if P.prox:
            r = r + 0.5 * P.prox * sum(jnp.sum((p[n] - center[n]) ** 2) for n in center)
        return r

    def inner(p, th):
        return data_loss(forward(p, xtr), ytr) + reg(p, th)

    def outer(p, th):
        return data_loss(forward(p, xva), yva)

    return JaxTwin(params, theta, inner, outer)


# --------------------------------------------------------------------------------------- helpers


def _flat(ts) -> np.ndarray:
    return np.concatenate([np.asarray(t.detach().cpu(), dtype=np.float64).ravel() for t in ts])


def _cached(name: str, build: Callable[[], dict]) -> dict:
    path = cache_dir() / f"{name}-{CACHE_VERSION}.pt"
    if path.exists():
        return torch.load(path, weights_only=False)
    t0 = time.perf_counter()
    obj = build()
    obj["build_s"] = time.perf_counter() - t0
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)
    return obj


def lambda_max(hvp: Callable, like: list[torch.Tensor], iters: int = 100) -> float:
    """Largest Hessian eigenvalue by power iteration (private generator, float64 dot products)."""
    gen = torch.Generator().manual_seed(0)
    v = [torch.randn(t.shape, generator=gen, dtype=t.dtype) for t in like]
    nrm = torch.sqrt(sum((a.double() ** 2).sum() for a in v))
    v = [a / nrm for a in v]
    lam = 0.0
    for _ in range(iters):
        hv = hvp(v)
        lam = float(sum((a.double() * b.double()).sum() for a, b in zip(v, hv)))
        nrm = torch.sqrt(sum((a.double() ** 2).sum() for a in hv))
        v = [a / nrm for a in hv]
    return lam


def make_hvp(P: Problem) -> Callable:
    """Plain double-backward Hessian-vector product of ``P.inner`` at ``P.params``."""
    names = list(P.params)
    ps = [P.params[n].detach().requires_grad_(True) for n in names]
    loss = P.inner(dict(zip(names, ps)), P.theta)
    gs = torch.autograd.grad(loss, ps, create_graph=True)

    def hvp(v):
        return [h.detach() for h in torch.autograd.grad(gs, ps, v, retain_graph=True)]

    return hvp


def converged_cg_reference(
    P: Problem, tol: float = 1e-11, maxiter: int = 20000, solver: str = "cg"
) -> dict:
    """Float64 implicit hypergradient with hypergrad's CG (or MINRES) run to convergence."""
    import warnings

    import hypergrad as hg

    S = hg.CG if solver == "cg" else hg.MINRES
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g, info = hg.implicit_grad(
            P.inner, P.outer, P.params, P.theta, solver=S(maxiter=maxiter, tol=tol)
        )
    return {
        "g": g.detach().double().numpy().ravel(),
        "iters": info.solve.iterations,
        "solver": solver,
        "residual": info.solve.residual,
        "converged": info.solve.converged,
        "diverged": info.solve.diverged,
    }


def torchopt_cg_reference(P: Problem, tol: float = 1e-11, maxiter: int = 20000) -> np.ndarray:
    """Float64 cross-check of the reference with torchopt's own CG (independent code)."""
    import torchopt

    names = list(P.params)

    def stationary(ps, theta):
        return torch.func.grad(lambda q, t: P.inner(dict(zip(names, q)), t))(ps, theta)

    sol = tuple(P.params[n].detach() for n in names)
    solve = torchopt.linear_solve.solve_cg(maxiter=maxiter, rtol=tol, atol=0.0)

    @torchopt.diff.implicit.custom_root(stationary, argnums=1, solve=solve)
    def fit(init, theta):
        return sol

    theta = P.theta.detach().clone().requires_grad_(True)
    out = fit(sol, theta)
    (g,) = torch.autograd.grad(P.outer(dict(zip(names, out)), theta), theta)
    return g.double().numpy().ravel()


# --------------------------------------------------------------------------------------- builders


def _theta_init(d: int, center: float, spread: float, seed: int) -> np.ndarray:
    return center + spread * np.random.default_rng(seed).standard_normal(d)


def ridge(dataset: str) -> Problem:
    X, y = sklearn_data(dataset)
    tr, va = _split(len(y))
    Xtr, ytr, Xva, yva = X[tr], y[tr], X[va], y[va]
    d = X.shape[1]
    theta = _theta_init(d, np.log(1e-2), 1.0, seed=1)
    lam = np.exp(theta)
    n = len(ytr)
    H = Xtr.T @ Xtr / n + np.diag(lam)
    w = np.linalg.solve(H, Xtr.T @ ytr / n)
    g_out = Xva.T @ (Xva @ w - yva) / len(yva)
    v = np.linalg.solve(H, g_out)
    ref = -(lam * w) * v  # d/dtheta_j: mixed term exp(theta_j) w_j, times -H^{-1} g
    eig = np.linalg.eigvalsh(H)
    model = nn.Linear(d, 1, bias=False).double()
    params = {"weight": torch.tensor(w[None, :])}
    t = lambda a: torch.tensor(a, dtype=torch.float64)  # noqa: E731
    P = Problem(
        key=f"ridge_{dataset}",
        title=f"Ridge, per-feature decay, {dataset} ({len(y)}x{d})",
        model=model,
        params=params,
        theta=t(theta),
        x_tr=t(Xtr),
        y_tr=t(ytr),
        x_va=t(Xva),
        y_va=t(yva),
        loss_kind="mse",
        decay="feature",
        decayed=["weight"],
        reference=ref,
        alpha=float(1.0 / eig[-1]),
        dtype=torch.float64,
        reference_note="closed form: -(exp(theta) * w) * (H^-1 grad_w L_out), float64",
        extras={
            "condition_number": float(eig[-1] / eig[0]),
            "lambda_max": float(eig[-1]),
            "lambda_min": float(eig[0]),
            "n_train": len(tr),
            "n_val": len(va),
        },
    )
    return P


def logreg(dataset: str = "breast_cancer") -> Problem:
    X, y = sklearn_data(dataset)
    tr, va = _split(len(y))
    d = X.shape[1]
    theta = _theta_init(d, np.log(1e-2), 1.0, seed=2)
    t = lambda a: torch.tensor(a, dtype=torch.float64)  # noqa: E731
    model = nn.Linear(d, 1).double()
    P = Problem(
        key=f"logreg_{dataset}",
        title=f"Logistic regression, per-feature decay, {dataset}",
        model=model,
        params={},
        theta=t(theta),
        x_tr=t(X[tr]),
        y_tr=t(y[tr]),
        x_va=t(X[va]),
        y_va=t(y[va]),
        loss_kind="bce",
        decay="feature",
        decayed=["weight"],
        reference=np.zeros(d),
        alpha=1.0,
        dtype=torch.float64,
        reference_note="dense float64 Hessian solve at a Newton-converged solution",
    )

    # Newton's method in float64 on the analytic gradient / Hessian (bias unpenalised)
    Xtr1 = np.hstack([X[tr], np.ones((len(tr), 1))])
    Xva1 = np.hstack([X[va], np.ones((len(va), 1))])
    lam = np.append(np.exp(theta), 0.0)
    sig = lambda a: 1.0 / (1.0 + np.exp(-a))  # noqa: E731

    def grad_hess(z):
        p = sig(Xtr1 @ z)
        g = Xtr1.T @ (p - y[tr]) / len(tr) + lam * z
        Hm = (Xtr1 * (p * (1 - p))[:, None]).T @ Xtr1 / len(tr) + np.diag(lam)
        return g, Hm

    z = np.zeros(d + 1)
    it = 0
    for it in range(100):  # noqa: B007 - reported below
        g, Hm = grad_hess(z)
        if np.linalg.norm(g) < 1e-13:
            break
        z = z - np.linalg.solve(Hm, g)
    g, Hm = grad_hess(z)
    g_out = Xva1.T @ (sig(Xva1 @ z) - y[va]) / len(va)
    v = np.linalg.solve(Hm, g_out)
    P.params = {"weight": t(z[:d][None, :]), "bias": t(z[d:])}
    P.reference = -(np.exp(theta) * z[:d]) * v[:d]
    eig = np.linalg.eigvalsh(Hm)
    P.alpha = float(1.0 / eig[-1])
    P.extras = {
        "newton_iters": it,
        "grad_norm": float(np.linalg.norm(g)),
        "condition_number": float(eig[-1] / eig[0]),
        "lambda_max": float(eig[-1]),
        "lambda_min": float(eig[0]),
        "n_train": len(tr),
        "n_val": len(va),
    }
    return P


def _lbfgs(P: Problem, iters: int, tol: float) -> dict:
    names = list(P.params)
    ps = [P.params[n].detach().clone().requires_grad_(True) for n in names]
    opt = torch.optim.LBFGS(
        ps,
        lr=1.0,
        max_iter=iters,
        history_size=50,
        tolerance_grad=tol,
        tolerance_change=0.0,
        line_search_fn="strong_wolfe",
    )

    def closure():
        opt.zero_grad()
        loss = P.inner(dict(zip(names, ps)), P.theta)
        loss.backward()
        return loss

    opt.step(closure)
    g = torch.autograd.grad(P.inner(dict(zip(names, ps)), P.theta), ps)
    return {
        "params": {n: p.detach() for n, p in zip(names, ps)},
        "grad_norm": float(torch.sqrt(sum((a**2).sum() for a in g))),
        "lbfgs_evals": opt.state[opt._params[0]]["func_evals"],
    }


def _solve_inner(P: Problem, iters32: int, iters64: int) -> dict:
    """Inner solution: L-BFGS in float32, then an L-BFGS polish in float64."""
    q = P.to(torch.float32)
    q.params = _lbfgs(q, iters=iters32, tol=1e-7)["params"]
    P.params = {n: p.double() for n, p in q.params.items()}
    return _lbfgs(P, iters=iters64, tol=1e-10)


def _log(msg: str) -> None:
    import sys

    print(f"[problems {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def lambda_min(hvp: Callable, like: list[torch.Tensor], lam_max: float, iters: int = 150) -> float:
    """Smallest Hessian eigenvalue estimate: power iteration on ``lam_max I - H``."""
    shifted = lambda v: [lam_max * a - b for a, b in zip(v, hvp(v))]  # noqa: E731
    return lam_max - lambda_max(shifted, like, iters)


def _make_positive_definite(P: Problem, name: str) -> dict:
    """Add the proximal term ``0.5 delta ||psi - psi_bar||^2`` (psi_bar = the inner solution) with
    the smallest ``delta`` in {0, 1e-3, 2e-3, 5e-3, 1e-2, ...} above ``2 |lambda_min(H)|`` that lets
    float64 CG converge; returns the reference and the spectrum estimates."""
    lam_max = lambda_max(make_hvp(P), list(P.params.values()), 60)
    lam_min = lambda_min(make_hvp(P), list(P.params.values()), lam_max)
    _log(f"{name}: lambda_max {lam_max:.4g}, lambda_min estimate {lam_min:.4g}")
    grid = [0.0] + [m * 10.0**e for e in range(-3, 2) for m in (1, 2, 5)]
    P.prox_center = {n: p.detach().clone() for n, p in P.params.items()}
    for delta in [d for d in grid if d >= 2 * max(-lam_min, 0.0)]:
        P.prox = delta
        ref = converged_cg_reference(P, tol=1e-11, maxiter=5000)
        _log(
            f"{name}: delta {delta:g}: CG {ref['iters']} its, residual {ref['residual']:.1e}, "
            f"diverged {ref['diverged']}"
        )
        if ref["converged"]:
            return {"ref": ref, "delta": delta, "lambda_max_H": lam_max, "lambda_min_H": lam_min}
    raise RuntimeError(f"{name}: no damping in {grid} made the CG reference converge")


def mlp(n_train: int = 256, n_val: int = 256, log_wd: float = float(np.log(1e-2))) -> Problem:
    xtr, ytr, xva, yva = fashion_mnist(n_train, n_val, seed=0)
    mu, sd = xtr.mean(), xtr.std()
    f = lambda a: torch.tensor(((a - mu) / sd).reshape(len(a), -1), dtype=torch.float64)  # noqa
    torch.manual_seed(0)
    model = make_mlp().double()
    decayed = [n for n, p in model.named_parameters() if p.ndim >= 2]
    P = Problem(
        key="mlp_fashion",
        title=f"MLP 784-1024-256-10 (1.07M parameters) on Fashion-MNIST ({n_train} inner / "
        f"{n_val} outer images)",
        model=model,
        params={n: p.detach().clone() for n, p in model.named_parameters()},
        theta=torch.full((len(decayed),), log_wd, dtype=torch.float64),
        x_tr=f(xtr),
        y_tr=torch.tensor(ytr),
        x_va=f(xva),
        y_va=torch.tensor(yva),
        loss_kind="ce",
        decay="layer",
        decayed=decayed,
        reference=np.zeros(len(decayed)),
        alpha=1.0,
        dtype=torch.float64,
        reference_note="hypergrad CG to relative residual 1e-11 in float64, cross-checked "
        "with torchopt's CG (float64, same tolerance)",
    )

    def build():
        _log("mlp: inner solution (L-BFGS)")
        sol = _solve_inner(P, 600, 200)
        P.params = sol["params"]
        _log(f"mlp: inner grad norm {sol['grad_norm']:.2e}; spectrum and reference (float64)")
        pd = _make_positive_definite(P, "mlp")
        _log("mlp: torchopt cross-check of the reference")
        alt = torchopt_cg_reference(P)
        lam = lambda_max(make_hvp(P), list(P.params.values()))
        return {
            "params": P.params,
            "ref": pd["ref"],
            "alt": alt,
            "lambda_max": lam,
            "delta": pd["delta"],
            "lambda_min_H": pd["lambda_min_H"],
            "lambda_max_H": pd["lambda_max_H"],
            "grad_norm": sol["grad_norm"],
            "lbfgs_evals": sol["lbfgs_evals"],
        }

    c = _cached(f"mlp_fashion_{n_train}_{n_val}_{log_wd:.3f}", build)
    P.params, P.reference, P.alpha = c["params"], c["ref"]["g"], 1.0 / c["lambda_max"]
    P.prox, P.prox_center = c["delta"], {n: p.clone() for n, p in c["params"].items()}
    P.extras = {
        "inner_grad_norm": c["grad_norm"],
        "lbfgs_evals": c["lbfgs_evals"],
        "reference_cg_iters": c["ref"]["iters"],
        "reference_residual": c["ref"]["residual"],
        "reference_converged": c["ref"]["converged"],
        "lambda_max": c["lambda_max"],
        "prox_delta": c["delta"],
        "lambda_min_H_estimate": c["lambda_min_H"],
        "oracle_agreement": float(
            np.linalg.norm(c["alt"] - c["ref"]["g"]) / np.linalg.norm(c["ref"]["g"])
        ),
        "build_s": c.get("build_s"),
    }
    return P


def cnn(batch: int = 32, width: float = CNN_WIDTH, log_wd: float = float(np.log(1e-2))) -> Problem:
    xtr, ytr, xva, yva = fashion_mnist(batch, batch, seed=1)

    def img(a):
        a = np.pad((a - 0.2860) / 0.3530, ((0, 0), (2, 2), (2, 2)))
        return torch.tensor(np.repeat(a[:, None], 3, axis=1), dtype=torch.float64)

    torch.manual_seed(0)
    model = DigitFiveCNN(width).double().train()
    decayed = [n for n, p in model.named_parameters() if p.ndim >= 2]
    P = Problem(
        key="cnn_digit5",
        title=f"Digit-Five CNN (width x{width}), BatchNorm in train mode, batch {batch}",
        model=model,
        params={n: p.detach().clone() for n, p in model.named_parameters()},
        theta=torch.full((len(decayed),), log_wd, dtype=torch.float64),
        x_tr=img(xtr),
        y_tr=torch.tensor(ytr),
        x_va=img(xva),
        y_va=torch.tensor(yva),
        loss_kind="ce",
        decay="layer",
        decayed=decayed,
        reference=np.zeros(len(decayed)),
        alpha=1.0,
        dtype=torch.float64,
        reference_note="hypergrad CG to relative residual 1e-11 in float64",
    )

    def build():
        _log("cnn: inner solution (L-BFGS)")
        sol = _solve_inner(P, 400, 100)
        P.params = sol["params"]
        _log(f"cnn: inner grad norm {sol['grad_norm']:.2e}; spectrum and reference (float64)")
        pd = _make_positive_definite(P, "cnn")
        lam = lambda_max(make_hvp(P), list(P.params.values()))
        return {
            "params": P.params,
            "ref": pd["ref"],
            "lambda_max": lam,
            "delta": pd["delta"],
            "lambda_min_H": pd["lambda_min_H"],
            "lambda_max_H": pd["lambda_max_H"],
            "grad_norm": sol["grad_norm"],
            "lbfgs_evals": sol["lbfgs_evals"],
        }

    tag = hashlib.sha1(f"{batch}-{width}-{log_wd}".encode()).hexdigest()[:8]
    c = _cached(f"cnn_digit5_{tag}", build)
    P.params, P.reference, P.alpha = c["params"], c["ref"]["g"], 1.0 / c["lambda_max"]
    P.prox, P.prox_center = c["delta"], {n: p.clone() for n, p in c["params"].items()}
    P.extras = {
        "inner_grad_norm": c["grad_norm"],
        "lbfgs_evals": c["lbfgs_evals"],
        "reference_cg_iters": c["ref"]["iters"],
        "reference_residual": c["ref"]["residual"],
        "reference_converged": c["ref"]["converged"],
        "reference_diverged": c["ref"]["diverged"],
        "lambda_max": c["lambda_max"],
        "prox_delta": c["delta"],
        "lambda_min_H_estimate": c["lambda_min_H"],
        "width": width,
        "batch": batch,
        "build_s": c.get("build_s"),
    }
    return P


BUILDERS: dict[str, Callable[[], Problem]] = {
    "ridge_breast_cancer": lambda: ridge("breast_cancer"),
    "ridge_diabetes": lambda: ridge("diabetes"),
    "logreg_breast_cancer": lambda: logreg("breast_cancer"),
    "mlp_fashion": mlp,
    "cnn_digit5": cnn,
}
# precision the libraries run at (the reference is always float64)
RUN_DTYPE = {
    "ridge_breast_cancer": torch.float64,
    "ridge_diabetes": torch.float64,
    "logreg_breast_cancer": torch.float64,
    "mlp_fashion": torch.float32,
    "cnn_digit5": torch.float32,
}


def get(key: str, dtype: torch.dtype | None = None) -> Problem:
    P = BUILDERS[key]()
    dtype = dtype or RUN_DTYPE[key]
    return P if dtype == P.dtype else P.to(dtype)
