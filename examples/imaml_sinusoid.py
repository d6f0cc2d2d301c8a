"""iMAML on sinusoid regression: meta-learning an initialisation with implicit gradients.

Run: ``python examples/imaml_sinusoid.py`` (about 4 minutes on one CPU thread; ``--quick`` for a
run of a few seconds). Writes ``results.json`` and ``imaml_sinusoid.png`` under ``--out``
(default ``runs/imaml_sinusoid``), nothing else.

Problem (the sinusoid benchmark of Finn, Abbeel & Levine, "Model-Agnostic Meta-Learning for Fast
Adaptation of Deep Networks", ICML 2017): a task is ``y = A sin(x - phase)`` with
``A ~ U[0.1, 5]``, ``phase ~ U[0, pi]``, ``x ~ U[-5, 5]``; K = 10 support and 10 query points per
task; the model is an MLP 1-40-40-1 written as plain matrix products over a dict of parameter
tensors; the loss is the mean squared error.

Activation: **tanh** by default, ReLU (the benchmark's) with ``--activation relu``. With ReLU the
regularised support loss below is only piecewise smooth and its minimiser typically lies on a
kink (a hidden pre-activation exactly 0 at a support point), where it has neither gradient nor
Hessian and the implicit function theorem does not apply: on the check problem L-BFGS stalls at
``||grad|| = 0.4-0.8`` (seeds 0-2; seed 0: pre-activations of 1e-7 to 1e-11 at support points),
and ``check_hypergrad`` cannot pass (seeds 0-2, lam = 2 and 100). ReLU still meta-trains with the
defaults, the implicit gradient then using the Hessian of the active piece (test query MSE
0.33 against 0.22 with tanh, full default runs; docs/examples.md).

Algorithm (iMAML: Rajeswaran, Finn, Kakade & Levine, "Meta-Learning with Implicit Gradients",
NeurIPS 2019). For a task with support loss ``L_s`` the adapted parameters are

    phi*(theta) = argmin_phi  L_s(phi) + lam/2 ||phi - theta||^2,

solved approximately from ``phi = theta`` by 50 heavy-ball gradient steps (step 0.005, momentum
0.9) inside a function decorated with ``@hg.implicit(inner_loss, solver=hg.CG(maxiter=10,
tol=1e-3))``. The meta-loss is the query MSE at ``phi*(theta)``, averaged over a meta-batch of 25
tasks; its gradient comes from ``meta_loss.backward()`` through the decorated solver, i.e. from
the implicit function theorem,

    d L_q(phi*) / d theta = lam (Hess L_s(phi*) + lam I)^-1 grad L_q(phi*),

with one truncated CG solve (no back-propagation through the inner steps). ``theta`` is updated
by Adam (step 1e-3, as in MAML), 2000 outer steps.

``lam = 2.0`` is the value of the authors' reference implementation's example command
(github.com/aravindr93/imaml_dev, ``examples/README.md``: ``--lam 2.0 --cg_steps 5
--n_steps 16``); lam = 5 gave about the same validation error in our tuning (0.188 vs 0.176).

CG is truncated at 10 iterations, like the reference implementation's 5 (median residual 0.39 in
the full run). In our tuning (2000 steps, 500 validation tasks of seed 7, one seed each) more
accurate adjoint solves meta-learned *worse*: 5 / 10 / 20 / 30 iterations gave a validation MSE
of 0.170 / 0.176 / 0.344 / 0.98, and CG met negative curvature in 1 / 3 / 82 (30: not recorded)
of the 2000 steps. The inner problems are solved to ~5% of their initial gradient norm, where the
Hessian can have small or negative eigenvalues: an accurate solve amplifies them, a truncated
one damps them (our reading of these numbers, not a proof).

The meta-batch is solved as ONE inner problem over the stacked per-task parameters ``phi[b]``:
the inner loss is the sum of the per-task losses, which is separable, so its minimiser is the
per-task minimisers, the gradient steps are exactly the per-task ones, its Hessian is block
diagonal and the implicit gradient is the sum of the per-task ones. Every operation is batched
over tasks (25 separate solves would cost 25 times the Python overhead). One difference: the
joint CG solve shares its Krylov space and stopping rule across the tasks, and it stops (flagged
``diverged``, with a ``SolverDivergedWarning``, returning its iterate so far) at the first
direction of non-positive curvature of any task; such steps are counted in the results.

Meta-test on held-out tasks (drawn with a fixed seed, independent of ``--seed``): every method is
adapted with the same inner procedure (same ``lam``, steps and step size) and scored by the query
MSE after adaptation, mean and 95% interval over the test tasks (normal approximation), plus the
paired difference to iMAML over the same tasks:

* ``imaml``: the meta-learned initialisation;
* ``pretrained``: the same MLP trained jointly on all tasks (Adam on the pooled support + query
  MSE of meta-batches of tasks, the same number of steps and tasks), then fine-tuned;
* ``random init``: the initialisation iMAML started from, fine-tuned.

Correctness checks (run first, ``--no-checks`` skips them; also
``tests/examples/test_example_imaml.py``), in float64, with the inner problem solved tightly by
``solve_tight`` (L-BFGS, then Newton steps) through the same ``make_fit`` / ``meta_loss_and_grad``
code as training:

* ``closed_form_check``: a model linear in its parameters, ``f(x) = features(x) . w`` with 16
  random Fourier features. Then ``phi* = (2 F'F/K + lam I)^-1 (2 F'y/K + lam theta)`` exactly
  (the 2 because the loss is the MSE, not half of it) and the meta-gradient is
  ``lam (2 F'F/K + lam I)^-1 2 Fq'(Fq phi* - yq)/Kq``; the ``@hg.implicit`` meta-gradient (CG to
  1e-12) must match it to 1e-8 relative error.
* ``mlp_check``: the 1-40-40-1 **tanh** MLP (the ReLU one has no derivative at its inner
  solution, see above) on one task with the training ``lam = 2``, inner problem solved to
  ``||grad|| <= 1e-11``: ``hypergrad.testing.check_hypergrad`` compares the ``@hg.implicit``
  meta-gradient with central differences of the re-solved problem along 8 random directions.
  The regularised problem is not convex in general; at this solution the smallest eigenvalue of
  its Hessian (dense, 1761 x 1761, computed on full runs) is positive, so it is a strict local
  minimum and the re-solves at theta +- eps d stay in its basin.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Callable

import torch
from _cli import torch_threads

import hypergrad as hg
from hypergrad.testing import check_hypergrad

HIDDEN = 40
K_SHOT = 10  # support points per task
K_QUERY = 10  # query points per task
AMP = (0.1, 5.0)
PHASE = (0.0, math.pi)
XRANGE = (-5.0, 5.0)
TEST_SEED = 2019  # held-out test tasks: fixed, independent of --seed
LAYERS = ("W1", "b1", "W2", "b2", "W3", "b3")

Params = dict[str, torch.Tensor]


# ----------------------------------------------------------------------------------------------
# tasks and model
# ----------------------------------------------------------------------------------------------


def sample_tasks(gen: torch.Generator, n: int, k: int = K_SHOT, kq: int = K_QUERY, dtype=None):
    """``n`` sinusoid tasks: support ``(xs, ys)`` and query ``(xq, yq)``, shapes ``(n, k, 1)``."""
    dtype = dtype or torch.float32

    def uniform(shape, lo, hi):
        return lo + (hi - lo) * torch.rand(shape, generator=gen, dtype=dtype)

    amp = uniform((n, 1, 1), *AMP)
    phase = uniform((n, 1, 1), *PHASE)
    x = uniform((n, k + kq, 1), *XRANGE)
    y = amp * torch.sin(x - phase)
    return {
        "xs": x[:, :k],
        "ys": y[:, :k],
        "xq": x[:, k:],
        "yq": y[:, k:],
        "amp": amp.flatten(),
        "phase": phase.flatten(),
    }


def init_mlp(gen: torch.Generator, dtype=torch.float32) -> Params:
    """PyTorch's ``nn.Linear`` default initialisation: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""

    def linear(fan_in, fan_out):
        bound = 1.0 / math.sqrt(fan_in)
        w = (2 * torch.rand(fan_out, fan_in, generator=gen, dtype=dtype) - 1) * bound
        b = (2 * torch.rand(fan_out, generator=gen, dtype=dtype) - 1) * bound
        return w, b

    p: Params = {}
    p["W1"], p["b1"] = linear(1, HIDDEN)
    p["W2"], p["b2"] = linear(HIDDEN, HIDDEN)
    p["W3"], p["b3"] = linear(HIDDEN, 1)
    return p


def make_mlp(act: Callable[[torch.Tensor], torch.Tensor] = torch.relu):
    """The 1-40-40-1 MLP with activation ``act``: ``model(p, x)`` with ``x`` of shape
    ``(..., k, 1)`` and parameters with or without a leading task dimension (``W1``:
    ``(B, 40, 1)`` or ``(40, 1)``)."""

    def model(p: Params, x: torch.Tensor) -> torch.Tensor:
        h = act(x @ p["W1"].transpose(-1, -2) + p["b1"].unsqueeze(-2))
        h = act(h @ p["W2"].transpose(-1, -2) + p["b2"].unsqueeze(-2))
        return h @ p["W3"].transpose(-1, -2) + p["b3"].unsqueeze(-2)

    return model


ACTIVATIONS = {"tanh": torch.tanh, "relu": torch.relu}


def mse(model, p: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-task mean squared error, shape ``(B,)``."""
    return ((model(p, x) - y) ** 2).mean(dim=(-2, -1))


def tile(theta: Params, n: int) -> Params:
    """``theta`` repeated along a new leading task dimension of size ``n`` (a copy)."""
    return {k: v.detach().unsqueeze(0).repeat(n, *([1] * v.dim())) for k, v in theta.items()}


# ----------------------------------------------------------------------------------------------
# the inner problem and the implicit meta-gradient
# ----------------------------------------------------------------------------------------------


def make_inner_loss(model, xs: torch.Tensor, ys: torch.Tensor, lam: float):
    """``(phi, theta) -> sum_b [L_s,b(phi[b]) + lam/2 ||phi[b] - theta||^2]``: the meta-batch's
    inner problems as one separable problem over the stacked task parameters ``phi``."""

    def inner_loss(phi: Params, theta: Params) -> torch.Tensor:
        prox = sum(((phi[k] - theta[k]) ** 2).sum() for k in theta)
        return mse(model, phi, xs, ys).sum() + 0.5 * lam * prox

    return inner_loss


def adapt(
    model,
    theta: Params,
    xs: torch.Tensor,
    ys: torch.Tensor,
    lam: float,
    steps: int,
    lr: float,
    momentum: float,
) -> tuple[Params, dict]:
    """The inner solver: ``steps`` heavy-ball gradient steps on every task's regularised support
    loss, from ``phi = theta`` (the same steps whether the tasks are stacked or not: the loss is
    separable). Returns ``phi`` (detached, leading task dimension) and per-task norms of the
    inner gradient at the start (``grad_norm0``) and at the returned point (``grad_norm``).

    ``@hg.implicit`` calls the solver with autograd disabled, so the gradient steps run under
    ``torch.enable_grad()`` on fresh leaves; the returned tensors carry no graph."""
    inner = make_inner_loss(model, xs, ys, lam)
    theta = {k: v.detach() for k, v in theta.items()}
    phi = tile(theta, xs.shape[0])
    vel = {k: torch.zeros_like(v) for k, v in phi.items()}
    norms = []
    with torch.enable_grad():
        for it in range(steps + 1):
            leaves = {k: v.detach().requires_grad_(True) for k, v in phi.items()}
            grads = torch.autograd.grad(inner(leaves, theta), list(leaves.values()))
            if it in (0, steps):
                norms.append(torch.sqrt(sum((g**2).flatten(1).sum(1) for g in grads)))
            if it == steps:  # the last pass only measures the gradient
                break
            for k, g in zip(leaves, grads):
                vel[k] = momentum * vel[k] + g
                phi[k] = phi[k] - lr * vel[k]
    return phi, {"grad_norm0": norms[0], "grad_norm": norms[-1]}


def solve_tight(model, theta: Params, xs, ys, lam: float, tol: float = 1e-11) -> Params:
    """The inner problem solved to ``||grad|| <= tol``: L-BFGS (strong Wolfe) from
    ``phi = theta``, then Newton steps (the Newton system solved by CG on Hessian-vector
    products). For the checks (float64), not for training.

    L-BFGS alone stalls near ``||grad|| ~ 1e-7`` here: its line search compares loss values,
    whose changes fall below float64 resolution; Newton steps need only gradients. A Newton step
    is kept only if it lowers ``||grad||``: away from a smooth strict minimum (a ReLU kink, an
    indefinite Hessian) the solve stops where L-BFGS did, and the checks report it as such.
    """
    inner = make_inner_loss(model, xs, ys, lam)
    theta = {k: v.detach() for k, v in theta.items()}
    phi = {k: v.requires_grad_(True) for k, v in tile(theta, xs.shape[0]).items()}
    opt = torch.optim.LBFGS(
        list(phi.values()),
        max_iter=2000,
        history_size=50,
        tolerance_grad=tol,
        tolerance_change=0.0,
        line_search_fn="strong_wolfe",
    )

    def closure():
        opt.zero_grad()
        loss = inner(phi, theta)
        loss.backward()
        return loss

    def grad_norm(p: Params) -> float:
        leaves = {k: v.detach().requires_grad_(True) for k, v in p.items()}
        g = torch.autograd.grad(inner(leaves, theta), list(leaves.values()))
        return float(torch.sqrt(sum((x**2).sum() for x in g)))

    with torch.enable_grad():
        opt.step(closure)
        phi = {k: v.detach() for k, v in phi.items()}
        gnorm = grad_norm(phi)
        for _ in range(5):  # Newton steps, each kept only if it lowers ||grad||
            if gnorm <= tol:
                break
            leaves = {k: v.requires_grad_(True) for k, v in phi.items()}
            ps = list(leaves.values())
            g = torch.autograd.grad(inner(leaves, theta), ps, create_graph=True)

            def hvp(v, g=g, ps=ps):
                return torch.autograd.grad(g, ps, v, retain_graph=True)

            d = _cg(hvp, [-x for x in g])
            trial = {k: (v + dk).detach() for (k, v), dk in zip(phi.items(), d)}
            trial_norm = grad_norm(trial)
            if not trial_norm < gnorm:  # not near a smooth minimum (e.g. a ReLU kink)
                break
            phi, gnorm = trial, trial_norm
    return {k: v.detach() for k, v in phi.items()}


def _cg(matvec, b: list[torch.Tensor], tol: float = 1e-13, maxiter: int = 2000):
    """Plain conjugate gradient on lists of tensors (for the Newton steps of ``solve_tight``)."""

    def dot(u, v):
        return sum((a * c).sum() for a, c in zip(u, v))

    x = [torch.zeros_like(t).detach() for t in b]
    r = [t.detach() for t in b]
    p, rs = r, dot(r, r)
    stop = tol**2 * rs
    for _ in range(maxiter):
        if rs <= stop:
            break
        ap = [t.detach() for t in matvec(p)]
        pap = dot(p, ap)
        if pap <= 0:  # not positive definite here: keep the iterate so far
            break
        alpha = rs / pap
        x = [a + alpha * c for a, c in zip(x, p)]
        r = [a - alpha * c for a, c in zip(r, ap)]
        rs_new = dot(r, r)
        p = [a + (rs_new / rs) * c for a, c in zip(r, p)]
        rs = rs_new
    return x


def make_fit(model, xs, ys, lam: float, solver: hg.solvers.Solver, solve: Callable, stats=None):
    """``theta -> phi*(theta)`` for one meta-batch, differentiable by implicit differentiation.

    ``solve(theta) -> phi`` is any inner solver (``adapt`` for training, ``solve_tight`` for the
    checks). The data are constants captured by the closure, so a new ``fit`` is made per batch.
    """
    inner_loss = make_inner_loss(model, xs, ys, lam)

    @hg.implicit(inner_loss, solver=solver)
    def fit(theta: Params) -> Params:
        out = solve(theta)
        if isinstance(out, tuple):  # adapt also returns the inner gradient norms
            out, norms = out
            if stats is not None:
                stats.update(norms)
        return out

    return fit


def meta_loss_and_grad(model, theta: Params, batch, lam: float, solver, solve, stats=None):
    """Query MSE at ``phi*(theta)`` (mean over the meta-batch) and its gradient w.r.t. ``theta``
    by ``backward()`` through the ``@hg.implicit`` solver. Returns ``(loss, grad, fit)``."""
    leaves = {k: v.detach().requires_grad_(True) for k, v in theta.items()}
    fit = make_fit(model, batch["xs"], batch["ys"], lam, solver, solve, stats)
    loss = mse(model, fit(leaves), batch["xq"], batch["yq"]).mean()
    loss.backward()
    return loss.detach(), {k: v.grad for k, v in leaves.items()}, fit


# ----------------------------------------------------------------------------------------------
# training
# ----------------------------------------------------------------------------------------------


def progress(total: int, desc: str, enabled: bool):
    """A tqdm bar if tqdm is installed (``pip install -e ".[examples]"``), else a plain
    counter that prints every 10%."""
    if not enabled:
        return _Plain(total, desc, every=None)
    try:
        from tqdm import tqdm
    except ImportError:
        return _Plain(total, desc, every=max(1, total // 10))
    return tqdm(total=total, desc=desc, leave=False, mininterval=1.0)


class _Plain:
    def __init__(self, total, desc, every):
        self.total, self.desc, self.every, self.n = total, desc, every, 0

    def update(self, n=1):
        self.n += n
        if self.every and (self.n % self.every == 0 or self.n == self.total):
            print(f"  {self.desc}: {self.n}/{self.total}", flush=True)

    def set_postfix_str(self, s):
        pass

    def close(self):
        pass


def train_imaml(theta0: Params, gen: torch.Generator, args) -> tuple[Params, dict]:
    """iMAML: Adam on ``theta`` with the implicit meta-gradient of each meta-batch."""
    theta = {k: v.clone().requires_grad_(True) for k, v in theta0.items()}
    opt = torch.optim.Adam(list(theta.values()), lr=args.meta_lr)
    solver = hg.CG(maxiter=args.cg_iters, tol=args.cg_tol)
    keys = ("meta_loss", "inner_rel_grad", "cg_iterations", "cg_residual", "cg_diverged")
    hist: dict = {k: [] for k in keys}
    bar = progress(args.meta_steps, "iMAML", args.progress)
    for step in range(args.meta_steps):
        batch = sample_tasks(gen, args.meta_batch)
        stats: dict = {}

        def solve(th, batch=batch):
            return adapt(args.model, th, batch["xs"], batch["ys"], args.lam, *args.inner)

        loss, grad, fit = meta_loss_and_grad(
            args.model, theta, batch, args.lam, solver, solve, stats
        )
        info = fit.last_info.solve  # the SolveInfo of this backward's CG solve
        for k, v in theta.items():
            v.grad = grad[k]
        opt.step()
        hist["meta_loss"].append(float(loss))
        hist["inner_rel_grad"].append(float((stats["grad_norm"] / stats["grad_norm0"]).median()))
        hist["cg_iterations"].append(info.iterations)
        hist["cg_residual"].append(float(info.residual))
        hist["cg_diverged"].append(bool(info.diverged))
        bar.update()
        if step % 25 == 0:
            recent = hist["meta_loss"][-50:]
            bar.set_postfix_str(f"query MSE {sum(recent) / len(recent):.3f}")
    bar.close()
    return {k: v.detach() for k, v in theta.items()}, hist


def train_pretrained(theta0: Params, gen: torch.Generator, args) -> tuple[Params, dict]:
    """The joint baseline: one model fitted to all tasks (support and query points pooled), Adam
    with the meta-learning rate, as many steps and tasks per step as iMAML."""
    theta = {k: v.clone().requires_grad_(True) for k, v in theta0.items()}
    opt = torch.optim.Adam(list(theta.values()), lr=args.meta_lr)
    hist: dict = {"loss": []}
    bar = progress(args.meta_steps, "pretrained", args.progress)
    for _ in range(args.meta_steps):
        b = sample_tasks(gen, args.meta_batch)
        x, y = torch.cat([b["xs"], b["xq"]], 1), torch.cat([b["ys"], b["yq"]], 1)
        opt.zero_grad()
        loss = mse(args.model, theta, x, y).mean()
        loss.backward()
        opt.step()
        hist["loss"].append(loss.item())
        bar.update()
    bar.close()
    return {k: v.detach() for k, v in theta.items()}, hist


def evaluate(theta: Params, tasks, args, chunk: int = 250) -> dict:
    """Per-task query MSE before and after adaptation with the training inner procedure, and
    the predictions on a grid for the first ``args.plot_tasks`` tasks."""
    pre, post, rel = [], [], []
    grid = torch.linspace(*XRANGE, 200).reshape(1, -1, 1)
    n_plot = args.plot_tasks
    for i in range(0, tasks["xs"].shape[0], chunk):
        xs, ys, xq, yq = (tasks[k][i : i + chunk] for k in ("xs", "ys", "xq", "yq"))
        phi, norms = adapt(args.model, theta, xs, ys, args.lam, *args.inner)
        with torch.no_grad():
            pre.append(mse(args.model, theta, xq, yq))
            post.append(mse(args.model, phi, xq, yq))
            if i == 0:
                before = args.model(tile(theta, n_plot), grid.expand(n_plot, -1, -1))
                after = args.model({k: v[:n_plot] for k, v in phi.items()}, grid)
        rel.append(norms["grad_norm"] / norms["grad_norm0"])
    return {
        "pre": torch.cat(pre),
        "post": torch.cat(post),
        "inner_rel_grad": torch.cat(rel),
        "grid": grid[0, :, 0],
        "preds": (before, after),
    }


def summary(v: torch.Tensor) -> dict:
    v = v.double()
    half = 1.96 * float(v.std()) / math.sqrt(v.numel())
    m = float(v.mean())
    return {"mean": m, "ci95": [m - half, m + half], "half_width": half, "n": v.numel()}


# ----------------------------------------------------------------------------------------------
# correctness checks (float64)
# ----------------------------------------------------------------------------------------------


def fourier_model(omega: torch.Tensor, bias: torch.Tensor):
    """``f(x) = sum_j w_j cos(omega_j x + bias_j)``: linear in its parameters ``{"w": (B, D)}``."""

    def features(x):
        return torch.cos(x * omega + bias)  # (..., k, D)

    def model(p, x):
        return (features(x) * p["w"].unsqueeze(-2)).sum(-1, keepdim=True)

    return model, features


def closed_form_check(seed: int = 0, lam: float = 2.0, n_features: int = 16) -> dict:
    """The ``@hg.implicit`` meta-gradient of a linear-in-parameters model against its closed form.

    Returns the relative error ``||g_implicit - g_exact|| / ||g_exact||`` and the two gradients.
    """
    dt = torch.float64
    gen = torch.Generator().manual_seed(seed)
    omega = torch.randn(n_features, generator=gen, dtype=dt)
    bias = 2 * math.pi * torch.rand(n_features, generator=gen, dtype=dt)
    model, features = fourier_model(omega, bias)
    batch = sample_tasks(gen, 1, dtype=dt)
    theta = {"w": torch.randn(n_features, generator=gen, dtype=dt)}

    # closed form: phi* = (2 F'F/K + lam I)^-1 (2 F'y/K + lam theta)
    F, Fq = features(batch["xs"][0]), features(batch["xq"][0])
    ys, yq = batch["ys"][0, :, 0], batch["yq"][0, :, 0]
    A = 2 * F.T @ F / F.shape[0] + lam * torch.eye(n_features, dtype=dt)
    phi = torch.linalg.solve(A, 2 * F.T @ ys / F.shape[0] + lam * theta["w"])
    dq = 2 * Fq.T @ (Fq @ phi - yq) / Fq.shape[0]  # grad of the query MSE at phi*
    exact = lam * torch.linalg.solve(A, dq)  # A is symmetric: (d phi*/d theta)^T = lam A^-1

    def solve(th):
        return solve_tight(model, th, batch["xs"], batch["ys"], lam, tol=1e-13)

    solver = hg.CG(tol=1e-12)
    _, grad, _ = meta_loss_and_grad(model, theta, batch, lam, solver, solve)
    g = grad["w"]
    rel = float((g - exact).norm() / exact.norm())
    return {"rel_err": rel, "implicit": g, "exact": exact}


def mlp_check(
    seed: int = 0, lam: float = 2.0, directions: int = 8, eigen: bool = True, act=torch.tanh
) -> dict:
    """``hypergrad.testing.check_hypergrad`` on the MLP (one task, float64, tight inner solves).

    Returns the report, the smallest eigenvalue of the regularised inner Hessian at the solution
    (None with ``eigen=False``) and the final inner gradient norm.
    """
    dt = torch.float64
    gen = torch.Generator().manual_seed(seed)
    theta = init_mlp(gen, dt)
    batch = sample_tasks(gen, 1, dtype=dt)
    mlp = make_mlp(act)
    inner_loss = make_inner_loss(mlp, batch["xs"], batch["ys"], lam)

    def solve(th):
        return solve_tight(mlp, th, batch["xs"], batch["ys"], lam)

    def outer_loss(phi, th):
        return mse(mlp, phi, batch["xq"], batch["yq"]).mean()

    _, grad, _ = meta_loss_and_grad(mlp, theta, batch, lam, hg.CG(tol=1e-12), solve)
    report = check_hypergrad(solve, inner_loss, outer_loss, theta, grad, directions=directions)
    phi = solve(theta)
    with torch.enable_grad():
        leaves = {k: v.detach().requires_grad_(True) for k, v in phi.items()}
        g = torch.autograd.grad(inner_loss(leaves, theta), list(leaves.values()))
    gnorm = float(torch.sqrt(sum((x**2).sum() for x in g)))
    min_eig = None
    if eigen:
        shapes = {k: v.shape for k, v in phi.items()}
        flat = torch.cat([v.flatten() for v in phi.values()])

        def f(z):
            p, i = {}, 0
            for k, s in shapes.items():
                p[k] = z[i : i + math.prod(s)].reshape(s)
                i += math.prod(s)
            return inner_loss(p, theta)

        hess = torch.func.hessian(f)(flat)
        min_eig = float(torch.linalg.eigvalsh(hess)[0])
    return {"report": report, "min_eig": min_eig, "inner_grad_norm": gnorm}


# ----------------------------------------------------------------------------------------------
# output
# ----------------------------------------------------------------------------------------------


def plot(path: str, test, evals: dict, n: int) -> bool:
    """A few test tasks (columns) for every initialisation (rows): the true curve, the support
    points, and the predictions before and after adaptation."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e '.[examples]')")
        return False
    fig, axes = plt.subplots(len(evals), n, figsize=(3.2 * n, 2.5 * len(evals)), squeeze=False)
    for r, (name, ev) in enumerate(evals.items()):
        grid, (before, after) = ev["grid"], ev["preds"]
        for c in range(n):
            ax = axes[r, c]
            truth = test["amp"][c] * torch.sin(grid - test["phase"][c])
            ax.plot(grid, truth, "k-", lw=1.5, label="true")
            ax.plot(grid, before[c, :, 0], "C0--", lw=1, label="before adaptation")
            ax.plot(grid, after[c, :, 0], "C3-", lw=1.2, label="after adaptation")
            ax.plot(test["xs"][c, :, 0], test["ys"][c, :, 0], "k^", ms=5, label="support")
            ax.set_ylim(-6, 6)
            if c == 0:
                ax.set_ylabel(name)
            if r == 0:
                ax.set_title(f"test task {c}")
    axes[0, 0].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------

FULL = {"meta_steps": 2000, "meta_batch": 25, "test_tasks": 1000}
QUICK = {"meta_steps": 100, "meta_batch": 10, "test_tasks": 200}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny run (a few seconds), for tests")
    ap.add_argument("--seed", type=int, default=0, help="initialisation and training tasks")
    ap.add_argument("--out", default="runs/imaml_sinusoid", help="folder for results.json/plot")
    ap.add_argument("--meta-steps", type=int, default=None, help="outer steps (2000; quick 100)")
    ap.add_argument("--meta-batch", type=int, default=None, help="tasks per step (25; quick 10)")
    ap.add_argument("--meta-lr", type=float, default=1e-3, help="Adam step on theta (1e-3)")
    ap.add_argument("--activation", choices=sorted(ACTIVATIONS), default="tanh")
    ap.add_argument("--lam", type=float, default=2.0, help="proximal regularisation (2.0)")
    ap.add_argument("--inner-steps", type=int, default=50, help="inner gradient steps (50)")
    ap.add_argument("--inner-lr", type=float, default=0.005, help="inner step size (0.005)")
    ap.add_argument("--inner-momentum", type=float, default=0.9, help="heavy ball (0.9)")
    ap.add_argument("--cg-iters", type=int, default=10, help="CG iteration cap (10)")
    ap.add_argument("--cg-tol", type=float, default=1e-3, help="CG relative residual (1e-3)")
    ap.add_argument("--test-tasks", type=int, default=None, help="held-out tasks (1000; 200)")
    ap.add_argument("--plot-tasks", type=int, default=4, help="test tasks in the plot")
    ap.add_argument("--no-checks", dest="checks", action="store_false", help="skip the checks")
    ap.add_argument("--no-progress", dest="progress", action="store_false")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = ap.parse_args(argv)
    for k, v in (QUICK if args.quick else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.inner = (args.inner_steps, args.inner_lr, args.inner_momentum)
    args.model = make_mlp(ACTIVATIONS[args.activation])
    return args


def main(argv=None) -> dict:
    """Run the example; returns the results (also written to ``<out>/results.json``)."""
    args = parse_args(argv)
    with torch_threads(args.threads):
        return _main(args)


def _mean(v: list) -> float:
    return sum(v) / len(v)


def _main(args) -> dict:
    t_start, cpu_start = time.time(), time.process_time()
    os.makedirs(args.out, exist_ok=True)
    res: dict = {"args": {k: v for k, v in vars(args).items() if k not in ("inner", "model")}}

    if args.checks:
        t = time.time()
        cf = closed_form_check(args.seed)
        mc = mlp_check(args.seed, eigen=not args.quick)
        rep = mc["report"]
        res["checks"] = {
            "closed_form_rel_err": cf["rel_err"],
            "check_hypergrad_passed": rep.passed,
            "check_hypergrad_max_rel_err": rep.max_rel_err,
            "check_hypergrad_directions": len(rep.rows),
            "mlp_inner_grad_norm": mc["inner_grad_norm"],
            "mlp_min_hessian_eig": mc["min_eig"],
            "seconds": time.time() - t,
        }
        print(f"check 1: closed-form meta-gradient (linear model), rel err {cf['rel_err']:.1e}")
        eig = ""
        if mc["min_eig"] is not None:
            eig = f"; min eigenvalue of the inner Hessian {mc['min_eig']:.3f}"
        print(
            f"check 2: check_hypergrad on the tanh MLP: {'PASSED' if rep.passed else 'FAILED'}, "
            f"max rel err {rep.max_rel_err:.1e} over {len(rep.rows)} directions{eig}"
        )
        if not rep.passed:
            print(rep)

    theta0 = init_mlp(torch.Generator().manual_seed(args.seed))
    t = time.time()
    theta_imaml, hist = train_imaml(theta0, torch.Generator().manual_seed(args.seed + 1), args)
    t_imaml = time.time() - t
    t = time.time()
    theta_pre, hist_pre = train_pretrained(
        theta0, torch.Generator().manual_seed(args.seed + 2), args
    )
    t_pre = time.time() - t

    test = sample_tasks(torch.Generator().manual_seed(TEST_SEED), args.test_tasks)
    evals = {
        "imaml": evaluate(theta_imaml, test, args),
        "pretrained": evaluate(theta_pre, test, args),
        "random init": evaluate(theta0, test, args),
    }
    res["test"] = {}
    for name, ev in evals.items():
        res["test"][name] = {
            "post": summary(ev["post"]),
            "pre": summary(ev["pre"]),
            "inner_rel_grad_median": float(ev["inner_rel_grad"].median()),
        }
    for name in ("pretrained", "random init"):  # paired over the same test tasks
        diff = evals[name]["post"] - evals["imaml"]["post"]
        res["test"][name]["post_minus_imaml"] = summary(diff)
    k = max(1, min(100, args.meta_steps // 5))  # steps averaged at the start and the end
    res["train"] = {
        "imaml_seconds": t_imaml,
        "pretrained_seconds": t_pre,
        "meta_loss_first": _mean(hist["meta_loss"][:k]),
        "meta_loss_last": _mean(hist["meta_loss"][-k:]),
        "pretrained_loss_last": _mean(hist_pre["loss"][-k:]),
        "inner_rel_grad_last": _mean(hist["inner_rel_grad"][-k:]),
        "cg_iterations_mean": _mean(hist["cg_iterations"]),
        "cg_residual_median": sorted(hist["cg_residual"])[len(hist["cg_residual"]) // 2],
        "cg_negative_curvature_steps": sum(hist["cg_diverged"]),
        "history": hist,
    }

    print(
        f"\nmeta-test: {args.test_tasks} held-out tasks (seed {TEST_SEED}), K = {K_SHOT} support "
        f"and {K_QUERY} query points; adaptation: {args.inner_steps} heavy-ball steps (lr "
        f"{args.inner_lr}, momentum {args.inner_momentum}) on L_s + {args.lam}/2 ||phi - theta||^2"
    )
    print(f"{'initialisation':<15} {'query MSE before':>17} {'query MSE after [95% CI]':>28}")
    for name, r in res["test"].items():
        p, q = r["pre"], r["post"]
        ci = f"{q['mean']:.3f} [{q['ci95'][0]:.3f}, {q['ci95'][1]:.3f}]"
        print(f"{name:<15} {p['mean']:>17.3f} {ci:>28}")
    for name in ("pretrained", "random init"):
        d = res["test"][name]["post_minus_imaml"]
        print(
            f"paired difference after adaptation, {name} - imaml: {d['mean']:.3f} "
            f"[{d['ci95'][0]:.3f}, {d['ci95'][1]:.3f}]"
        )
    tr = res["train"]
    print(
        f"iMAML training: {t_imaml:.1f} s, {args.meta_steps} steps x {args.meta_batch} tasks; "
        f"query MSE {tr['meta_loss_first']:.3f} (first {k} steps) -> {tr['meta_loss_last']:.3f} "
        f"(last {k}); inner |grad|/|grad at theta| {tr['inner_rel_grad_last']:.3f} (median, last "
        f"{k}); CG {tr['cg_iterations_mean']:.1f} iterations, median residual "
        f"{tr['cg_residual_median']:.1e}, negative curvature in "
        f"{tr['cg_negative_curvature_steps']} steps. Pretrained baseline: {t_pre:.1f} s."
    )

    png = os.path.join(args.out, "imaml_sinusoid.png")
    res["plot"] = png if plot(png, test, evals, args.plot_tasks) else None
    res["seconds"] = time.time() - t_start
    res["cpu_seconds"] = time.process_time() - cpu_start
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {os.path.join(args.out, 'results.json')}{' and the plot' if res['plot'] else ''}")
    print(f"total {res['seconds']:.1f} s wall, {res['cpu_seconds']:.1f} s CPU")
    return res


if __name__ == "__main__":
    main()
