"""One hypergradient per library, used the way each library's documentation shows.

``make(lib, solver, P, K)`` returns a zero-argument callable computing the hypergradient of problem
``P`` at its stored inner solution with ``K`` solver iterations, as a flat float64 numpy array.
Everything a user would do once (building an ``Engine``, decorating a solver, ``jax.jit``) happens
in ``make``; the callable does the per-hypergradient work only. A library that cannot express a
problem raises :class:`Unsupported` from ``make`` with the reason.

Implicit (problems 1-4), at equal K:

=========  ===============  ===========================================================  ========
library    solver           call                                                         products
=========  ===============  ===========================================================  ========
hypergrad  cg               ``hg.implicit_grad(..., solver=hg.CG(maxiter=K, tol=1e-10))``  <= K
hypergrad  neumann          ``hg.implicit_grad(..., solver=hg.Neumann(steps=K, alpha=a))``  K
torchopt   cg               ``custom_root(..., solve=solve_cg(maxiter=K, rtol=1e-10))``    <= K
torchopt   normal_cg        ``custom_root(..., solve=solve_normal_cg(maxiter=K, ...))``    2K + 1
torchopt   neumann          ``custom_root(..., solve=solve_inv(ns=True, maxiter=K, alpha=a))`` K
betty      cg / neumann     ``ImplicitProblem`` + ``Engine``, one outer step                  K
jaxopt     cg / normal_cg   ``implicit_diff.custom_root(..., solve=partial(solve_cg, ...))``,
                            under ``jax.jit(jax.grad(...))``                              <= K, 2K+1
=========  ===============  ===========================================================  ========

Unrolled (problem 5): ``hg.unrolled_grad``, torchopt's functional ``torchopt.sgd`` loop,
``higher.innerloop_ctx``, betty's ``IterativeProblem``, plus the implicit comparators (T plain SGD
steps, then hypergrad / torchopt CG with ``K`` products at the last iterate).
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
from collections.abc import Callable

import numpy as np
import torch
from problems import Problem
from torch import nn

CG_TOL = 1e-10

IMPLICIT = [
    ("hypergrad", "cg"),
    ("hypergrad", "neumann"),
    ("torchopt", "cg"),
    ("torchopt", "normal_cg"),
    ("torchopt", "neumann"),
    ("betty", "cg"),
    ("betty", "neumann"),
    ("jaxopt", "cg"),
    ("jaxopt", "normal_cg"),
]
# torchopt's custom_root cannot run a model whose BatchNorm updates running statistics in place
# (functorch transform); the CNN also gets torchopt with PyTorch's documented workaround,
# torch.func.replace_all_batch_norm_modules_ (running statistics off; train-mode BatchNorm uses
# batch statistics either way, so the function is unchanged)
# On the two networks hypergrad also runs CG with engine="recompute" (rebuilds the gradient
# graph for every product instead of retaining it: its low-memory mode).
EXTRA: dict[str, list[tuple[str, str]]] = {
    "mlp_fashion": [("hypergrad", "cg+recompute")],
    "cnn_digit5": [
        ("hypergrad", "cg+recompute"),
        ("torchopt", "cg+bnpatch"),
        ("torchopt", "normal_cg+bnpatch"),
        ("torchopt", "neumann+bnpatch"),
    ],
}
UNROLLED = [
    ("hypergrad", "unrolled"),
    ("torchopt", "unrolled"),
    ("higher", "unrolled"),
    ("betty", "unrolled"),
    ("hypergrad", "implicit_cg"),
    ("torchopt", "implicit_cg"),
]


class Unsupported(Exception):
    """The library cannot express this problem (reason in the message)."""


def nominal_products(lib: str, solver: str, K: int) -> int:
    """Hessian(-transpose)-vector products the configuration may spend."""
    return 2 * K + 1 if solver.startswith("normal_cg") else K


def _flat(ts) -> np.ndarray:
    if isinstance(ts, torch.Tensor):
        ts = [ts]
    return np.concatenate([np.asarray(t.detach().cpu(), dtype=np.float64).ravel() for t in ts])


def versions() -> dict[str, str | None]:
    """Installed versions of torch, hypergrad and the peers (``not installed`` otherwise)."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for dist in [
        "torch",
        "hypergrad",
        "torchopt",
        "betty-ml",
        "higher",
        "jax",
        "jaxlib",
        "jaxopt",
        "numpy",
        "scikit-learn",
    ]:
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "not installed"
    for mod, dist in [("betty", "betty-ml"), ("higher", "higher"), ("jaxopt", "jaxopt")]:
        if out[dist] != "not installed":
            try:
                __import__(mod)
            except Exception as e:  # noqa: BLE001
                out[dist] += f" (import fails: {type(e).__name__}: {e})"
    try:
        import subprocess
        from pathlib import Path

        root = Path(__file__).resolve().parents[2]
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=root,
            text=True,
            capture_output=True,
            check=False,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "hypergrad"],
            cwd=root,
            text=True,
            capture_output=True,
            check=False,
        ).stdout.strip()
        if head:
            out["hypergrad"] = f"{out['hypergrad']} (git {head}{', modified' if dirty else ''})"
    except Exception:  # noqa: BLE001
        pass
    return out


# ------------------------------------------------------------------------------------ hypergrad


def hypergrad_implicit(P: Problem, solver: str, K: int) -> Callable[[], np.ndarray]:
    import hypergrad as hg

    solver, _, engine = solver.partition("+")
    engine = engine or "reuse"
    if solver == "cg":
        s = hg.CG(maxiter=K, tol=CG_TOL)
    elif solver == "neumann":
        s = hg.Neumann(steps=K, alpha=P.alpha)
    elif solver == "minres":
        s = hg.MINRES(maxiter=K, tol=CG_TOL)
    else:
        raise Unsupported(solver)
    params, theta = P.params, P.theta

    def run():
        g, _ = hg.implicit_grad(P.inner, P.outer, params, theta, solver=s, engine=engine)
        return _flat(g)

    return run


# ------------------------------------------------------------------------------------ torchopt


def torchopt_implicit(P: Problem, solver: str, K: int) -> Callable[[], np.ndarray]:
    import copy

    import torchopt

    if solver.endswith("+bnpatch"):
        solver = solver.split("+")[0]
        P = copy.copy(P)
        P.model = torch.func.replace_all_batch_norm_modules_(copy.deepcopy(P.model))

    if solver == "cg":
        solve = torchopt.linear_solve.solve_cg(maxiter=K, rtol=CG_TOL, atol=0.0)
    elif solver == "normal_cg":
        solve = torchopt.linear_solve.solve_normal_cg(maxiter=K, rtol=CG_TOL, atol=0.0)
    elif solver == "neumann":
        solve = torchopt.linear_solve.solve_inv(ns=True, maxiter=K, alpha=P.alpha)
    else:
        raise Unsupported(solver)
    names = list(P.params)

    def inner_t(ps, theta):
        return P.inner(dict(zip(names, ps)), theta)

    # torchopt's documented optimality condition: the gradient of the inner objective
    stationary = torch.func.grad(inner_t, argnums=0)
    sol = tuple(P.params[n].detach() for n in names)

    @torchopt.diff.implicit.custom_root(stationary, argnums=1, solve=solve)
    def fit(init_params, theta):
        return sol  # the inner solver; here the stored solution

    def run():
        theta = P.theta.detach().clone().requires_grad_(True)
        out = fit(sol, theta)
        loss = P.outer(dict(zip(names, out)), theta)
        (g,) = torch.autograd.grad(loss, theta)
        return _flat(g)

    return run


# ------------------------------------------------------------------------------------ betty


class _ThetaModule(nn.Module):
    def __init__(self, theta: torch.Tensor):
        super().__init__()
        self.theta = nn.Parameter(theta.detach().clone())


@contextlib.contextmanager
def _quiet():
    """Betty logs every step to stdout; silence it for the benchmark."""
    logging.disable(logging.INFO)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        logging.disable(logging.NOTSET)


def betty_implicit(P: Problem, solver: str, K: int) -> Callable[[], np.ndarray]:
    from betty.configs import Config, EngineConfig
    from betty.engine import Engine
    from betty.problems import ImplicitProblem

    if solver == "cg":
        cfg = Config(type="cg", cg_iterations=K, cg_alpha=1.0, unroll_steps=1)
    elif solver == "neumann":
        cfg = Config(type="neumann", neumann_iterations=K, neumann_alpha=P.alpha, unroll_steps=1)
    else:
        raise Unsupported(solver)
    captured: dict[str, list[torch.Tensor]] = {}
    prob = P

    class Inner(ImplicitProblem):
        def training_step(self, batch):
            return prob.module_inner(self.module, self.outer.module.theta)

    class Outer(ImplicitProblem):
        def training_step(self, batch):
            return prob.module_outer(self.inner.module)

        def custom_optimizer_step(self, *args, **kwargs):
            # read the hypergradient Betty put in .grad (Betty deletes it right after the step)
            captured["g"] = [p.grad.detach().clone() for p in self.trainable_parameters()]

    model = P.fresh_model()
    # lr=0: the inner step Betty runs before each outer step leaves the inner solution unchanged
    inner_opt = torch.optim.SGD(model.parameters(), lr=0.0)
    data = [(torch.zeros(1),)]  # the losses read the data by closure; Betty needs a loader
    with _quiet():
        inner = Inner(
            name="inner",
            module=model,
            optimizer=inner_opt,
            train_data_loader=data,
            config=cfg,
            device="cpu",
        )
        outer = Outer(
            name="outer",
            module=_ThetaModule(P.theta),
            optimizer=None,
            train_data_loader=data,
            config=Config(),
            device="cpu",
        )
        engine = Engine(
            problems=[outer, inner],
            config=EngineConfig(train_iters=1, valid_step=10**9, logger_type="none"),
            dependencies={"u2l": {outer: [inner]}, "l2u": {inner: [outer]}},
        )

    def run():
        captured.clear()
        with _quiet():
            engine.run()
        return _flat(captured["g"])

    return run


# ------------------------------------------------------------------------------------ jaxopt


def jaxopt_implicit(P: Problem, solver: str, K: int) -> Callable[[], np.ndarray]:
    import jax

    jax.config.update("jax_enable_x64", True)
    import jaxopt
    from problems import jax_twin

    tw = jax_twin(P)
    if tw is None:
        raise Unsupported(
            "jaxopt differentiates JAX functions; this problem is a torch nn.Module (BatchNorm in "
            "train mode) with no JAX twin in this benchmark"
        )
    if solver == "cg":
        solve = functools.partial(jaxopt.linear_solve.solve_cg, maxiter=K, tol=CG_TOL)
    elif solver == "normal_cg":
        solve = functools.partial(jaxopt.linear_solve.solve_normal_cg, maxiter=K, tol=CG_TOL)
    else:
        raise Unsupported(solver)
    optimality = jax.grad(tw.inner, argnums=0)

    @jaxopt.implicit_diff.custom_root(optimality, solve=solve)
    def fit(init_params, theta):
        return init_params  # the inner solver; here it is handed the stored solution

    # solution and hyperparameters are arguments of the jitted function, not closure constants
    # (XLA would otherwise constant-fold the products with the solution at compile time)
    @jax.jit
    def hypergrad_fn(theta, sol):
        return jax.grad(lambda th: tw.outer(fit(sol, th), th))(theta)

    theta, sol = tw.theta, tw.params

    def run():
        g = hypergrad_fn(theta, sol)
        return np.asarray(jax.block_until_ready(g), dtype=np.float64).ravel()

    return run


# ------------------------------------------------------------------------------------ unrolled


def _sgd_steps(P: Problem, params0: dict, T: int, lr: float) -> dict:
    names = list(params0)
    ps = [params0[n].detach().clone() for n in names]
    for _ in range(T):
        q = [p.requires_grad_(True) for p in ps]
        with torch.enable_grad():
            gs = torch.autograd.grad(P.inner(dict(zip(names, q)), P.theta), q)
        with torch.no_grad():
            ps = [(p - lr * g).detach() for p, g in zip(q, gs)]
    return dict(zip(names, ps))


def unrolled(
    lib: str, solver: str, P: Problem, T: int, lr: float, K: int, params0: dict[str, torch.Tensor]
) -> Callable[[], np.ndarray]:
    """Hypergradient through T SGD steps from ``params0`` (or implicit at the T-th iterate)."""
    require(lib)
    names = list(params0)
    if (lib, solver) == ("hypergrad", "unrolled"):
        import torchopt

        import hypergrad as hg

        def run():
            g, _ = hg.unrolled_grad(
                P.inner, P.outer, params0, P.theta, steps=T, optimizer=torchopt.sgd(lr=lr)
            )
            return _flat(g)

        return run
    if (lib, solver) == ("torchopt", "unrolled"):
        import torchopt

        def run():
            theta = P.theta.detach().clone().requires_grad_(True)
            opt = torchopt.sgd(lr=lr)
            params = tuple(params0[n].detach().clone().requires_grad_(True) for n in names)
            state = opt.init(params)
            for _ in range(T):
                loss = P.inner(dict(zip(names, params)), theta)
                grads = torch.autograd.grad(loss, params, create_graph=True)
                updates, state = opt.update(grads, state, inplace=False)
                params = torchopt.apply_updates(params, updates, inplace=False)
            (g,) = torch.autograd.grad(P.outer(dict(zip(names, params)), theta), theta)
            return _flat(g)

        return run
    if (lib, solver) == ("higher", "unrolled"):
        import higher

        model = P.fresh_model()
        init = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(params0[n])

        def run():
            theta = P.theta.detach().clone().requires_grad_(True)
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(params0[n])
            with higher.innerloop_ctx(model, opt, copy_initial_weights=True) as (fmodel, diffopt):
                for _ in range(T):
                    diffopt.step(P.module_inner(fmodel, theta))
                (g,) = torch.autograd.grad(P.module_outer(fmodel), theta)
            return _flat(g)

        del init
        return run
    if (lib, solver) == ("betty", "unrolled"):
        return _betty_unrolled(P, T, lr, params0)
    if solver == "implicit_cg":
        if lib == "hypergrad":
            import hypergrad as hg

            def run():
                psi = _sgd_steps(P, params0, T, lr)
                g, _ = hg.implicit_grad(
                    P.inner, P.outer, psi, P.theta, solver=hg.CG(maxiter=K, tol=CG_TOL)
                )
                return _flat(g)

            return run
        if lib == "torchopt":
            import torchopt

            solve = torchopt.linear_solve.solve_cg(maxiter=K, rtol=CG_TOL, atol=0.0)

            def inner_t(ps, theta):
                return P.inner(dict(zip(names, ps)), theta)

            @torchopt.diff.implicit.custom_root(torch.func.grad(inner_t), argnums=1, solve=solve)
            def fit(init, theta):
                psi = _sgd_steps(P, dict(zip(names, init)), T, lr)
                return tuple(psi[n] for n in names)

            def run():
                theta = P.theta.detach().clone().requires_grad_(True)
                out = fit(tuple(params0[n] for n in names), theta)
                (g,) = torch.autograd.grad(P.outer(dict(zip(names, out)), theta), theta)
                return _flat(g)

            return run
    raise Unsupported(f"{lib}/{solver}")


def _betty_unrolled(P: Problem, T: int, lr: float, params0: dict) -> Callable[[], np.ndarray]:
    from betty.configs import Config, EngineConfig
    from betty.engine import Engine
    from betty.problems import ImplicitProblem, IterativeProblem

    captured: dict[str, list[torch.Tensor]] = {}
    prob = P

    class Inner(IterativeProblem):
        def training_step(self, batch):
            theta = self.outer.module.theta
            out = self.forward(prob.x_tr)
            reg = prob.reg(dict(zip(self._names, self.params)), theta)
            return prob.data_loss(out, prob.y_tr) + reg

        def forward(self, x):
            return self.fmodule(self.params, self.buffers, x)

    class Outer(ImplicitProblem):
        def training_step(self, batch):
            return prob.data_loss(self.inner(prob.x_va), prob.y_va)

        def custom_optimizer_step(self, *args, **kwargs):
            captured["g"] = [p.grad.detach().clone() for p in self.trainable_parameters()]

    model = P.fresh_model()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(params0[n])
    hyper = _ThetaModule(P.theta)
    data = [(torch.zeros(1),)]
    with _quiet():
        inner = Inner(
            name="inner",
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=lr),
            train_data_loader=data,
            config=Config(type="darts", unroll_steps=T, retain_graph=True),
            device="cpu",
        )
        inner._names = [n for n, _ in model.named_parameters()]
        outer = Outer(
            name="outer",
            module=hyper,
            optimizer=None,
            train_data_loader=data,
            config=Config(first_order=False, retain_graph=True),
            device="cpu",
        )
        engine = Engine(
            problems=[outer, inner],
            config=EngineConfig(train_iters=T, valid_step=10**9, logger_type="none"),
            dependencies={"u2l": {outer: [inner]}, "l2u": {inner: [outer]}},
        )
    start = [params0[n].detach().clone() for n in inner._names]

    def run():
        captured.clear()
        inner.params = tuple(p.clone().requires_grad_(True) for p in start)
        with _quiet():
            engine.run()
        return _flat(captured["g"])

    return run


# ------------------------------------------------------------------------------------ registry


def require(lib: str) -> None:
    """Raise :class:`Unsupported` when a peer library is not importable."""
    mod = {"betty": "betty", "jaxopt": "jaxopt", "higher": "higher", "torchopt": "torchopt"}
    if lib in mod:
        try:
            __import__(mod[lib])
        except Exception as e:  # noqa: BLE001
            raise Unsupported(f"{lib} is not installed/importable ({type(e).__name__}: {e})") from e


def make(lib: str, solver: str, P: Problem, K: int) -> Callable[[], np.ndarray]:
    require(lib)
    if lib == "hypergrad":
        return hypergrad_implicit(P, solver, K)
    if lib == "torchopt":
        return torchopt_implicit(P, solver, K)
    if lib == "betty":
        return betty_implicit(P, solver, K)
    if lib == "jaxopt":
        return jaxopt_implicit(P, solver, K)
    raise Unsupported(lib)
