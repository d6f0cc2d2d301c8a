"""The whole outer loop (``benchmarks/suites/whole_loop.py``): the three problems and one runner
per implementation, each doing the same Adam steps on the hyperparameters.

Every runner is ``runner(P, o) -> Loop``: it does once what a user does once (building the
solver objects, ``jax.jit``), and ``Loop.step(state) -> (state, val_loss, inner_iterations)``
does one outer step: the inner solve warm-started from the previous step's solution, the
hypergradient of the validation loss by implicit differentiation, and the hand-written Adam
update (the same arithmetic in torch and in jax, so every implementation takes the same steps up
to its inner and adjoint tolerances). ``Loop.init()`` is the starting state (``theta0``, Adam's
moments at zero, the inner solution at zero).

Implementations (``IMPLS``):

* ``jaxopt``: ``jaxopt.LBFGS`` (smooth problems) / ``jaxopt.ProximalGradient(prox=prox_lasso)``
  (FISTA, fixed step ``1/L``) with ``implicit_diff=True``; the whole step (solve, ``jax.grad``
  through it, Adam) is one ``jax.jit`` function whose arguments are float64 arrays from the first
  call on (no recompilation; ``Loop.compiles`` reads the jit cache size).
* ``torch_user``: what a user writes today: ``torch.optim.LBFGS`` (strong Wolfe; one optimiser
  kept across outer steps, as a user would) or a hand-written FISTA (jaxopt's iteration: no
  restart, fixed step ``1/L``), then ``hg.implicit_grad(..., solver=hg.CG(...))`` or, for the
  lasso, ``hg.custom_fixed_point`` on ``hg.conditions.proximal_gradient`` (GMRES).
* ``hypergrad_newton`` / ``hypergrad_newton_reuse`` / ``hypergrad_lbfgs`` / ``hypergrad_fista``
  (/ ``_exact``): the library's inner solvers through the public API: ``w = solver.run(w_prev,
  hparams); outer(w).backward()``; Newton with ``hg.Exact()`` or with ``reuse_hessian=True`` (one
  Hessian factor kept across runs: the first Newton step and its default adjoint, a CG with tol
  1e-10 preconditioned by the factor), L-BFGS with ``hg.CG``, FISTA with ``hg.GMRES`` or
  ``hg.Exact``.
* ``hypergrad_fista_grad`` (/ ``_exact``): the same FISTA given the closed-form gradient the
  user loop writes, ``smooth_grad=lambda w, _: XᵀX w − Xᵀy`` (``/n``; no autograd in the
  iterations, checked against autograd once per solve).

Tolerances (``o["tol"]`` = τ, relative): hypergrad stops at ``||∇f(w)|| <= τ ||∇f(0)||``
(``||G_s(w)|| <= τ ||G_s(0)||`` for FISTA, ``G_s`` the gradient mapping). ``||∇f(0)||`` does not
depend on θ on the smooth problems, so jaxopt's absolute ``||∇f(w)||₂ <= tol`` gets ``tol =
τ ||∇f(0)||₂`` (the same test) and torch's L-BFGS ``max|∇f(w)| <= tolerance_grad`` the same
number (a test on the largest entry: looser by at most ``√d``; ``tolerance_change = 0`` so that
only the gradient stops it). On the lasso jaxopt's and the user's FISTA stop at
``||w_{k+1} − w_k|| / s <= τ ||G_s(0)||`` with ``G_s(0)`` at the current λ (computed inside the
step). The adjoint solves stop at a relative residual ``o["adjoint_tol"]`` (jaxopt's
``solve_cg`` / ``solve_gmres``, hg.CG / hg.GMRES; hg.Exact is a dense solve).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

PROBLEMS = ("logreg_groups", "ridge_features", "lasso_penalties")
SMOOTH = (
    "jaxopt",
    "torch_user",
    "torch_user_defaults",
    "hypergrad_newton",
    "hypergrad_newton_reuse",
    "hypergrad_lbfgs",
    "hypergrad_compiled_step_adam",  # benchmarks/peers/whole_loop_compiled.py
)
IMPLS = {
    "logreg_groups": SMOOTH,
    "ridge_features": SMOOTH,
    "lasso_penalties": ("jaxopt", "torch_user", "hypergrad_fista", "hypergrad_fista_exact",
                        "hypergrad_fista_grad", "hypergrad_fista_grad_exact"),
}  # fmt: skip
LABELS = {
    "jaxopt": {"smooth": "jaxopt LBFGS (jit)", "lasso": "jaxopt ProximalGradient (jit)"},
    "torch_user": {
        "smooth": "torch user loop (optim.LBFGS + hg.CG)",
        "lasso": "torch user loop (FISTA + hg.GMRES)",
    },  # fmt: skip
    "torch_user_defaults": "torch user loop, torch's defaults (one LBFGS, tolerance_change 1e-9)",
    "hypergrad_newton": "hypergrad inner.Newton + Exact",
    "hypergrad_newton_reuse": "hypergrad inner.Newton(reuse_hessian=True) + its CG",
    "hypergrad_lbfgs": "hypergrad inner.LBFGS + CG",
    "hypergrad_fista": "hypergrad inner.ProximalGradient + GMRES",
    "hypergrad_fista_exact": "hypergrad inner.ProximalGradient + Exact",
    "hypergrad_fista_grad": "hypergrad inner.ProximalGradient(smooth_grad) + GMRES",
    "hypergrad_fista_grad_exact": "hypergrad inner.ProximalGradient(smooth_grad) + Exact",
}
THETA0 = {"logreg_groups": -2.0, "ridge_features": -2.0, "lasso_penalties": -3.0}
ADAM = dict(b1=0.9, b2=0.999, eps=1e-8)
GROUPS = 10  # breast_cancer: feature j is statistic j // 10 of measurement j % 10


def label(impl: str, problem: str) -> str:
    lab = LABELS[impl]
    return (
        lab if isinstance(lab, str) else lab["lasso" if problem.startswith("lasso") else "smooth"]
    )


@dataclass
class Problem:
    """Arrays (numpy float64) and facts of one problem."""

    key: str
    X: np.ndarray  # training design (logreg: with the bias column last)
    y: np.ndarray
    Xv: np.ndarray
    yv: np.ndarray
    theta0: np.ndarray
    index: np.ndarray  # the hyperparameter of each weight (-1: unpenalised)
    step: float = 1.0  # 1/L of the smooth part (the lasso's fixed step)
    ref: float = 1.0  # ||∇f(0)|| of the smooth problems
    facts: dict = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return "lasso" if self.key.startswith("lasso") else "smooth"


def _split(X: np.ndarray, y: np.ndarray, seed: int = 0):
    perm = np.random.default_rng(seed).permutation(len(y))
    tr, va = perm[: len(y) // 2], perm[len(y) // 2 :]
    return X[tr], y[tr], X[va], y[va]


@functools.lru_cache(maxsize=4)
def problem(key: str) -> Problem:
    """The problem ``key``: data standardised (every row's statistics, as the other suites),
    split in halves by a seeded permutation (seed 0)."""
    from sklearn import datasets

    if key in ("logreg_groups", "ridge_features"):
        d = datasets.load_breast_cancer()
        X = (d.data - d.data.mean(0)) / d.data.std(0)
        y = d.target.astype(np.float64)
        if key == "logreg_groups":
            X = np.hstack([X, np.ones((len(y), 1))])  # the bias, unpenalised
            index = np.append(np.arange(30) % GROUPS, -1)
            nh = GROUPS
        else:
            y = (y - y.mean()) / y.std()  # no bias: the target centred (and scaled)
            index, nh = np.arange(30), 30
    elif key == "lasso_penalties":
        d = datasets.load_diabetes()
        X = (d.data - d.data.mean(0)) / d.data.std(0)
        y = (d.target - d.target.mean()) / d.target.std()
        index, nh = np.arange(10), 10
    else:
        raise KeyError(key)
    X, y, Xv, yv = _split(X, y)
    P = Problem(key, X, y, Xv, yv, np.full(nh, THETA0[key]), index)
    n = len(y)
    P.step = 1.0 / float(np.linalg.eigvalsh(X.T @ X / n).max())
    if key == "logreg_groups":
        P.ref = float(np.linalg.norm(X.T @ (0.5 - y) / n))
    else:
        P.ref = float(np.linalg.norm(X.T @ y / n))
    P.facts.update(n_train=n, n_val=len(yv), unknowns=X.shape[1], hparams=nh)
    P.facts.update(theta0=THETA0[key], grad_norm_at_origin=P.ref, lipschitz=1.0 / P.step)
    if key == "lasso_penalties":
        c = np.abs(X.T @ y / n)
        P.facts.update(lambda_max=float(c.max()), lambda0=math.exp(THETA0[key]))
    return P


# -- the losses, in torch ------------------------------------------------------------------


def torch_losses(P: Problem):
    """``(inner(w, theta), outer(w), smooth(w, _))`` as torch functions (float64 tensors)."""
    t = lambda a: torch.as_tensor(a, dtype=torch.float64)
    X, y, Xv, yv = t(P.X), t(P.y), t(P.Xv), t(P.yv)
    n = X.shape[0]
    if P.key == "logreg_groups":
        idx = torch.as_tensor(P.index[:-1])

        def inner(w, theta):
            z = X @ w
            return (F.softplus(z) - y * z).mean() + 0.5 * (theta.exp()[idx] * w[:-1] ** 2).sum()

        def outer(w, _=None):
            z = Xv @ w
            return (F.softplus(z) - yv * z).mean()

        return inner, outer, None

    def smooth(w, _=None):
        r = X @ w - y
        return 0.5 * (r @ r) / n

    def outer(w, _=None):
        r = Xv @ w - yv
        return (r @ r) / Xv.shape[0]

    if P.key == "ridge_features":
        return (lambda w, theta: smooth(w) + 0.5 * (theta.exp() * w**2).sum()), outer, smooth
    return None, outer, smooth


def adam_torch(theta, m, v, t, g, lr):
    """One Adam step (in place on ``theta``, ``m``, ``v``; ``t`` the new step count)."""
    b1, b2, eps = ADAM["b1"], ADAM["b2"], ADAM["eps"]
    m.mul_(b1).add_((1 - b1) * g)
    v.mul_(b2).add_((1 - b2) * g * g)
    mhat = m / (1 - b1**t)
    vhat = v / (1 - b2**t)
    theta.sub_(lr * mhat / (vhat.sqrt() + eps))


@dataclass
class Loop:
    init: Callable[[], Any]
    step: Callable[[Any], tuple[Any, float, int]]
    compiles: Callable[[], int | None] = lambda: None
    facts: dict = field(default_factory=dict)


def _torch_state(P: Problem):
    theta = torch.tensor(P.theta0, dtype=torch.float64)
    z = torch.zeros_like(theta)
    return dict(theta=theta, m=z.clone(), v=z.clone(), t=0, w=torch.zeros(P.X.shape[1],
                dtype=torch.float64))  # fmt: skip


def _adam_update(state, g, lr):
    state["t"] += 1
    with torch.no_grad():
        adam_torch(state["theta"], state["m"], state["v"], state["t"], g, lr)


def grad_mapping_origin(P: Problem, lam: torch.Tensor) -> float:
    """``||G_s(0)||`` of the lasso at penalties ``lam`` (s = 1/L)."""
    X, y, s = torch.as_tensor(P.X), torch.as_tensor(P.y), P.step
    u = s * (X.T @ y) / X.shape[0]
    return float((u.sign() * (u.abs() - s * lam).clamp_min(0)).norm() / s)


# -- hypergrad's inner solvers ---------------------------------------------------------------


def hypergrad_loop(P: Problem, o: dict, method: str) -> Loop:
    import hypergrad as hg

    inner, outer, smooth = torch_losses(P)
    tol, atol = o["tol"], o["adjoint_tol"]
    if method == "newton":
        solver = hg.inner.Newton(inner, tol=tol, maxiter=o["maxiter_newton"], solver=hg.Exact())
    elif method == "newton_reuse":  # its adjoint: CG(tol=1e-10) preconditioned by the kept factor
        solver = hg.inner.Newton(inner, tol=tol, maxiter=o["maxiter_newton"], reuse_hessian=True)
    elif method == "lbfgs":
        solver = hg.inner.LBFGS(inner, tol=tol, maxiter=o["maxiter"], history=10,
                                solver=hg.CG(tol=atol, maxiter=o["adjoint_maxiter"]))  # fmt: skip
    else:
        lin = hg.Exact() if method.endswith("_exact") else hg.GMRES(tol=atol)
        extra = {}
        if method.startswith("fista_grad"):  # the closed form the user loop writes
            X, y = torch.as_tensor(P.X), torch.as_tensor(P.y)
            XtX, Xty = X.T @ X / X.shape[0], X.T @ y / X.shape[0]
            extra["smooth_grad"] = lambda w, _: XtX @ w - Xty
        solver = hg.inner.ProximalGradient(smooth, hg.prox.prox_lasso, stepsize=P.step, tol=tol,
                                           maxiter=o["maxiter_fista"], solver=lin,
                                           **extra)  # fmt: skip

    def step(state):
        theta = state["theta"].detach().requires_grad_(True)
        hp = ((), theta.exp()) if P.kind == "lasso" else theta
        w = solver.run(state["w"], hp)
        loss = outer(w)
        loss.backward()
        state["w"] = w.detach()
        _adam_update(state, theta.grad, o["lr"])
        return state, float(loss.detach()), int(solver.last_info.iterations)

    return Loop(lambda: _torch_state(P), step)


# -- today's user loop -----------------------------------------------------------------------


def user_fista(smooth_grad, w0, lam, step, tol_abs, maxiter):
    """Plain FISTA with a fixed step (jaxopt's iteration), stopping at
    ``||w_{k+1} − w_k|| / s <= tol_abs``."""
    x, yk, t, k = w0, w0, 1.0, 0
    while k < maxiter:
        k += 1
        u = yk - step * smooth_grad(yk)
        x_new = u.sign() * (u.abs() - step * lam).clamp_min(0)
        t_new = 0.5 * (1 + math.sqrt(1 + 4 * t * t))
        diff = x_new - x
        yk = x_new + ((t - 1) / t_new) * diff
        x, t = x_new, t_new
        if float(diff.norm()) / step <= tol_abs:
            break
    return x, k


def user_loop(P: Problem, o: dict, o_extra: dict | None = None) -> Loop:
    import hypergrad as hg

    o = {**o, **(o_extra or {})}
    inner, outer, smooth = torch_losses(P)
    tol, atol = o["tol"], o["adjoint_tol"]
    if P.kind == "lasso":
        X, y = torch.as_tensor(P.X), torch.as_tensor(P.y)
        XtX, Xty = X.T @ X / X.shape[0], X.T @ y / X.shape[0]
        T = hg.conditions.proximal_gradient(smooth, hg.prox.prox_lasso, P.step)
        iters = [0]

        @hg.custom_fixed_point(T, solver=hg.GMRES(tol=atol))
        def lasso(h, w0):
            lam = h[1]
            tol_abs = tol * grad_mapping_origin(P, lam)
            grad = lambda w: XtX @ w - Xty  # noqa: E731 - the user's closed-form gradient
            w, iters[0] = user_fista(grad, w0, lam, P.step, tol_abs, o["maxiter_fista"])
            return w

        def step(state):
            theta = state["theta"].detach().requires_grad_(True)
            w = lasso(((), theta.exp()), state["w"])
            loss = outer(w)
            loss.backward()
            state["w"] = w.detach()
            _adam_update(state, theta.grad, o["lr"])
            return state, float(loss.detach()), iters[0]

        return Loop(lambda: _torch_state(P), step)

    keep = o.get("user_defaults", False)  # torch's defaults: one optimiser, tolerance_change 1e-9

    def make(param):
        extra = {} if keep else dict(tolerance_change=0.0)
        extra.update(max_iter=o["maxiter"], tolerance_grad=tol * P.ref, history_size=10)
        return torch.optim.LBFGS([param], lr=1, line_search_fn="strong_wolfe", **extra)

    def init():
        s = _torch_state(P)
        s["param"] = torch.nn.Parameter(s["w"].clone())
        s["opt"] = make(s["param"])
        return s

    def step(state):
        w, theta = state["param"], state["theta"]
        opt = state["opt"] if keep else make(w)  # a new L-BFGS per outer step: no stale pairs

        def closure():
            opt.zero_grad()
            loss = inner(w, theta)
            loss.backward()
            return loss

        before = opt.state[w].get("n_iter", 0) if w in opt.state else 0
        opt.step(closure)
        after = opt.state[w].get("n_iter", 0)
        th = theta.detach().requires_grad_(True)
        g, _ = hg.implicit_grad(inner, outer, w.detach(), th,
                                solver=hg.CG(tol=atol, maxiter=o["adjoint_maxiter"]))  # fmt: skip
        with torch.no_grad():
            loss = float(outer(w))
        state["w"] = w.detach().clone()
        _adam_update(state, g, o["lr"])
        return state, loss, after - before

    return Loop(init, step)


# -- jaxopt ----------------------------------------------------------------------------------


def jaxopt_loop(P: Problem, o: dict) -> Loop:
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import jaxopt

    ls = jaxopt.linear_solve
    X, y, Xv, yv = (jnp.asarray(a, jnp.float64) for a in (P.X, P.y, P.Xv, P.yv))
    n, lr = X.shape[0], o["lr"]
    b1, b2, eps = ADAM["b1"], ADAM["b2"], ADAM["eps"]
    tol, atol = o["tol"], o["adjoint_tol"]

    if P.key == "logreg_groups":
        idx = jnp.asarray(P.index[:-1])

        def inner(w, theta, X, y):
            z = X @ w
            return jnp.mean(jax.nn.softplus(z) - y * z) + 0.5 * jnp.sum(
                jnp.exp(theta)[idx] * w[:-1] ** 2
            )

        def outer(w, Xv, yv):
            z = Xv @ w
            return jnp.mean(jax.nn.softplus(z) - yv * z)

    else:

        def smooth(w, X, y):
            r = X @ w - y
            return 0.5 * (r @ r) / X.shape[0]

        def inner(w, theta, X, y):
            return smooth(w, X, y) + 0.5 * jnp.sum(jnp.exp(theta) * w**2)

        def outer(w, Xv, yv):
            r = Xv @ w - yv
            return (r @ r) / Xv.shape[0]

    if P.kind == "smooth":
        cg = functools.partial(ls.solve_cg, tol=atol, maxiter=o["adjoint_maxiter"])
        solver = jaxopt.LBFGS(fun=inner, tol=tol * P.ref, maxiter=o["maxiter"], history_size=10,
                              implicit_diff=True, implicit_diff_solve=cg)  # fmt: skip

        def val(theta, w0, X, y, Xv, yv):
            sol = solver.run(w0, theta, X, y)
            return outer(sol.params, Xv, yv), (sol.params, sol.state.iter_num)

    else:
        s = P.step
        gm = functools.partial(ls.solve_gmres, tol=atol, restart=X.shape[1])

        def val(theta, w0, X, y, Xv, yv):
            lam = jnp.exp(theta)
            u = s * (X.T @ y) / n  # ||G_s(0)||: the tolerance's scale at this λ
            soft = jnp.sign(u) * jnp.maximum(jnp.abs(u) - s * jax.lax.stop_gradient(lam), 0)
            ref = jnp.linalg.norm(soft) / s
            pg = jaxopt.ProximalGradient(
                fun=smooth, prox=jaxopt.prox.prox_lasso, stepsize=s, tol=tol * ref,
                maxiter=o["maxiter_fista"], acceleration=True, implicit_diff=True,
                implicit_diff_solve=gm,
            )  # fmt: skip
            sol = pg.run(w0, lam, X, y)
            return outer(sol.params, Xv, yv), (sol.params, sol.state.iter_num)

    def step(theta, m, v, t, w0, X, y, Xv, yv):
        (loss, (w, it)), g = jax.value_and_grad(val, has_aux=True)(theta, w0, X, y, Xv, yv)
        t = t + 1.0
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        mhat, vhat = m / (1 - b1**t), v / (1 - b2**t)
        theta = theta - lr * mhat / (jnp.sqrt(vhat) + eps)
        return theta, m, v, t, w, loss, it

    jstep = jax.jit(step)
    data = (X, y, Xv, yv)

    def init():
        theta = jnp.asarray(P.theta0, jnp.float64)
        z = jnp.zeros_like(theta)
        return (theta, z, z, jnp.asarray(0.0, jnp.float64), jnp.zeros(X.shape[1], jnp.float64))

    def run(state):
        *new, loss, it = jstep(*state, *data)
        loss = float(jax.block_until_ready(loss))
        return tuple(new), loss, int(it)

    return Loop(init, run, compiles=lambda: int(jstep._cache_size()))


RUNNERS = {
    "jaxopt": jaxopt_loop,
    "torch_user": user_loop,
    "torch_user_defaults": functools.partial(user_loop, o_extra=dict(user_defaults=True)),
    "hypergrad_newton": functools.partial(hypergrad_loop, method="newton"),
    "hypergrad_newton_reuse": functools.partial(hypergrad_loop, method="newton_reuse"),
    "hypergrad_lbfgs": functools.partial(hypergrad_loop, method="lbfgs"),
    "hypergrad_fista": functools.partial(hypergrad_loop, method="fista"),
    "hypergrad_fista_exact": functools.partial(hypergrad_loop, method="fista_exact"),
    "hypergrad_fista_grad": functools.partial(hypergrad_loop, method="fista_grad"),
    "hypergrad_fista_grad_exact": functools.partial(hypergrad_loop, method="fista_grad_exact"),
}


def _compiled_runner(name: str) -> Callable[[Problem, dict], Loop]:
    """A runner of ``whole_loop_compiled`` (imported on use: that module imports this one)."""

    def run(P: Problem, o: dict) -> Loop:
        from benchmarks.peers import whole_loop_compiled

        return whole_loop_compiled.RUNNERS[name](P, o)

    return run


RUNNERS["hypergrad_compiled_step_adam"] = _compiled_runner("hypergrad_compiled_step_adam")
LABELS["hypergrad_compiled_step_adam"] = "hypergrad compile_outer_step (one graph, Adam inside)"


def missing(impl: str) -> str | None:
    """Why ``impl`` cannot run here (None: it can)."""
    if impl.startswith("hypergrad_fista_grad"):
        import inspect

        import hypergrad as hg

        if "smooth_grad" not in inspect.signature(hg.inner.ProximalGradient).parameters:
            return "this hypergrad's inner.ProximalGradient has no smooth_grad option"
    if impl.startswith("hypergrad_compiled_step"):
        import hypergrad as hg

        if not hasattr(hg, "compile_outer_step"):
            return "this hypergrad has no compile_outer_step"
    if impl == "hypergrad_newton_reuse":
        import inspect

        import hypergrad as hg

        if "reuse_hessian" not in inspect.signature(hg.inner.Newton).parameters:
            return "this hypergrad's inner.Newton has no reuse_hessian option"
    if impl != "jaxopt":
        return None
    import importlib

    for name in ("jax", "jaxopt"):
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001
            return f"{name} is not installed/importable ({type(e).__name__}: {e})"
    return None


def _np(x) -> np.ndarray:
    return np.array(x.detach().numpy() if isinstance(x, torch.Tensor) else x, np.float64)


def theta_of(state) -> np.ndarray:
    return _np(state["theta"] if isinstance(state, dict) else state[0])


def w_of(state) -> np.ndarray:
    return _np(state["w"] if isinstance(state, dict) else state[4])


def residual(P: Problem, w: np.ndarray, theta: np.ndarray) -> float:
    """hypergrad's relative optimality measure at ``w`` (computed here, the same for every
    implementation): ``||∇f(w)|| / ||∇f(0)||``, or ``||G_s(w)|| / ||G_s(0)||`` (lasso, s = 1/L)."""
    X, y, n = P.X, P.y, len(P.y)
    if P.kind == "lasso":
        lam, s = np.exp(theta), P.step
        soft = lambda u: np.sign(u) * np.maximum(np.abs(u) - s * lam, 0)
        G = (w - soft(w - s * (X.T @ (X @ w - y)) / n)) / s
        G0 = soft(s * (X.T @ y) / n) / s
        return float(np.linalg.norm(G) / np.linalg.norm(G0))
    pen = np.where(P.index >= 0, np.exp(theta)[np.maximum(P.index, 0)], 0.0)
    if P.key == "logreg_groups":
        g = X.T @ (1 / (1 + np.exp(-(X @ w))) - y) / n + pen * w
    else:
        g = X.T @ (X @ w - y) / n + pen * w
    return float(np.linalg.norm(g) / P.ref)
