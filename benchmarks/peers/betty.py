"""betty (betty-ml): ``ImplicitProblem`` + ``Engine`` with ``type="cg"`` / ``"neumann"``, one outer
step; ``IterativeProblem`` (``type="darts"``) for unrolling.

The inner problem steps with SGD at lr 0 so the stored solution is not moved; the hypergradient
is read in ``custom_optimizer_step`` (betty deletes ``.grad`` right after), so the time includes
betty's one inner gradient step. betty logs every step to stdout; that is silenced.
"""

from __future__ import annotations

import contextlib
import io
import logging

import torch
from torch import nn

from benchmarks.peers import Unsupported, flat, quiet_import

DISTS = ("betty-ml",)


def missing() -> str | None:
    return quiet_import("betty")


def solvers(P) -> list[str]:
    return ["cg", "neumann"]


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


def _engine(inner_cls, outer_cls, model, lr, cfg_in, cfg_out, iters, P):
    from betty.configs import EngineConfig
    from betty.engine import Engine

    data = [(torch.zeros(1),)]  # the losses read the data by closure; betty needs a loader
    with _quiet():
        inner = inner_cls(
            name="inner",
            module=model,
            train_data_loader=data,
            config=cfg_in,
            optimizer=torch.optim.SGD(model.parameters(), lr=lr),
            device="cpu",
        )
        outer = outer_cls(
            name="outer",
            module=_Theta(P.theta),
            optimizer=None,
            train_data_loader=data,
            config=cfg_out,
            device="cpu",
        )
        engine = Engine(
            problems=[outer, inner],
            config=EngineConfig(train_iters=iters, valid_step=10**9, logger_type="none"),
            dependencies={"u2l": {outer: [inner]}, "l2u": {inner: [outer]}},
        )
    return engine, inner


def _outer_cls(loss):
    from betty.problems import ImplicitProblem

    class Outer(ImplicitProblem):
        def training_step(self, batch):
            return loss(self)

        def custom_optimizer_step(self, *args, **kwargs):
            self.captured = [p.grad.detach().clone() for p in self.trainable_parameters()]

    return Outer


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

    Outer = _outer_cls(lambda self: P.module_outer(self.inner.module))
    engine, inner = _engine(Inner, Outer, P.fresh_model(), 0.0, cfg, Config(), 1, P)

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

    Outer = _outer_cls(lambda self: P.data_loss(self.inner(P.x_va), P.y_va))
    cfg_in = Config(type="darts", unroll_steps=T, retain_graph=True)
    cfg_out = Config(first_order=False, retain_graph=True)
    engine, inner = _engine(Inner, Outer, P.fresh_model(params0), lr, cfg_in, cfg_out, T, P)

    def run():
        inner.params = tuple(p.clone().requires_grad_(True) for p in params0.values())
        with _quiet():
            engine.run()
        return flat(inner.outer.captured)

    return run
