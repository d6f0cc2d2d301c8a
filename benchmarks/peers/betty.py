"""betty (betty-ml): ``ImplicitProblem`` + ``Engine`` (``type="cg"`` / ``"neumann"``, one outer
step, the inner problem at SGD lr 0, the hypergradient read in ``custom_optimizer_step``) and
``IterativeProblem`` (``type="darts"``) for unrolling; betty's logging is silenced."""

from __future__ import annotations

import contextlib
import io
import logging

import torch
from torch import nn

from benchmarks.peers import Unsupported, flat

DISTS, IMPORTS, SOLVERS = ("betty-ml",), ("betty",), ["cg", "neumann"]


class _Theta(nn.Module):
    def __init__(self, theta: torch.Tensor):
        super().__init__()
        self.theta = nn.Parameter(theta.detach().clone())


@contextlib.contextmanager
def _quiet():
    logging.disable(logging.INFO)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        logging.disable(logging.NOTSET)


def _engine(inner_cls, outer_loss, model, lr, cfg_in, cfg_out, iters, P):
    """(engine, inner problem): ``inner_cls`` (SGD at ``lr``) under an outer problem on theta that
    keeps its hypergradient in ``captured``."""
    from betty.configs import EngineConfig
    from betty.engine import Engine
    from betty.problems import ImplicitProblem

    class Outer(ImplicitProblem):
        def training_step(self, batch):
            return outer_loss(self)

        def custom_optimizer_step(self, *args, **kwargs):
            self.captured = [p.grad.detach().clone() for p in self.trainable_parameters()]

    # the losses read the data by closure; betty needs a loader
    kw = dict(train_data_loader=[(torch.zeros(1),)], device="cpu")
    with _quiet():
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        inner = inner_cls(name="inner", module=model, config=cfg_in, optimizer=opt, **kw)
        outer = Outer(name="outer", module=_Theta(P.theta), optimizer=None, config=cfg_out, **kw)
        cfg = EngineConfig(train_iters=iters, valid_step=10**9, logger_type="none")
        deps = {"u2l": {outer: [inner]}, "l2u": {inner: [outer]}}
        engine = Engine(problems=[outer, inner], config=cfg, dependencies=deps)
    return engine, inner


def implicit(P, solver: str, K: int):
    from betty.configs import Config
    from betty.problems import ImplicitProblem

    if solver == "cg":
        cfg = Config(type="cg", cg_iterations=K, cg_alpha=1.0, unroll_steps=1)
    elif solver == "neumann":
        cfg = Config(type="neumann", neumann_iterations=K, neumann_alpha=P.alpha, unroll_steps=1)
    else:
        raise Unsupported(solver)

    class Inner(ImplicitProblem):
        def training_step(self, batch):
            return P.module_inner(self.module, self.outer.module.theta)

    outer_loss = lambda self: P.module_outer(self.inner.module)
    engine, inner = _engine(Inner, outer_loss, P.fresh_model(), 0.0, cfg, Config(), 1, P)

    def run():
        with _quiet():
            engine.run()
        return flat(inner.outer.captured)

    return run


def unrolled(P, T: int, lr: float, params0: dict):
    from betty.configs import Config
    from betty.problems import IterativeProblem

    names = list(params0)

    class Inner(IterativeProblem):
        def forward(self, x):
            return self.fmodule(self.params, self.buffers, x)

        def training_step(self, batch):
            reg = P.reg(dict(zip(names, self.params)), self.outer.module.theta)
            return P.data_loss(self(P.x_tr), P.y_tr) + reg

    outer_loss = lambda self: P.data_loss(self.inner(P.x_va), P.y_va)
    cfg_in = Config(type="darts", unroll_steps=T, retain_graph=True)
    cfg_out = Config(first_order=False, retain_graph=True)
    engine, inner = _engine(Inner, outer_loss, P.fresh_model(params0), lr, cfg_in, cfg_out, T, P)

    def run():
        inner.params = tuple(p.clone().requires_grad_(True) for p in params0.values())
        with _quiet():
            engine.run()
        return flat(inner.outer.captured)

    return run
