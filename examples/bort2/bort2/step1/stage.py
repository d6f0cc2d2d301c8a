"""Step 1 as a pipeline stage: any registered step-1 method trained on the sources + target."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..data.samplers import InfiniteLoader
from ..dist import convert_batchnorm, mean_over_ranks, shard_rows, take
from ..inputs import Views, prepare
from ..trainer import Stage, StageContext, build_model, register_stage, seeded
from . import METHODS, Step1Batch


class Step1Stage(Stage):
    """Train one step-1 method: SGD (Nesterov) with a per-iteration cosine schedule."""

    method_name = ""

    def __init__(self, ctx: StageContext):
        super().__init__(ctx)
        self.s1 = self.cfg.step1

    @property
    def iters(self) -> int:
        return self.s1.iters

    def setup(self) -> dict[str, Any]:
        ctx, s1, cls = self.ctx, self.s1, METHODS[self.method_name]
        model = build_model(self.cfg, ctx.bench.num_classes, mixstyle=cls.uses_mixstyle)
        self.method = cls.from_config(model, len(ctx.sources), s1)
        if self.cfg.model.sync_bn and ctx.dist.active:
            convert_batchnorm(self.method)
        self.method.to(ctx.device).train()
        self.optimize(
            self.method, s1.lr, momentum=s1.momentum, weight_decay=s1.weight_decay, nesterov=True
        )
        workers = self.cfg.data.num_workers
        self.src = InfiniteLoader(
            [ctx.bench.split(d, "train") for d in ctx.sources],
            s1.batch_per_domain,
            seeded(ctx.seed, 1),
            num_workers=workers,
        )
        self.tgt = InfiniteLoader(
            [ctx.bench.split(ctx.target, "train")],
            s1.target_batch,
            seeded(ctx.seed, 2),
            num_workers=workers,
        )
        self.aug = seeded(ctx.seed, 3)
        self.views = Views(self.cfg.data.views, self.cfg.data.benchmark, self.aug)
        return {
            "method": self.method,
            "opt": self.opt,
            "src": self.src,
            "tgt": self.tgt,
            "aug": self.aug,
            "scaler": self.precision.scaler,
        }

    def divergence_hint(self) -> str:
        return f"step1.lr={self.s1.lr:g} too large for this model, or corrupt input data"

    def step(self, it: int, log: bool) -> dict[str, float] | None:
        dev, v, m = self.ctx.device, self.views, self.method
        m.set_progress(it / max(1, self.s1.iters))
        xs, ys, ds = next(self.src)
        xt, _, _ = next(self.tgt)
        xs, xt = prepare(xs, dev), prepare(xt, dev)
        # under torchrun: views of the global batch (the same draws on every rank), then this
        # rank's rows of every per-domain block
        src = shard_rows(len(xs), len(self.ctx.sources), self.ctx.dist, "source batch")
        tgt = shard_rows(len(xt), 1, self.ctx.dist, "target batch")
        batch = Step1Batch(
            src_x=take(v.weak(xs), src),
            src_y=take(ys.to(dev), src),
            src_d=take(ds.to(dev), src),
            tgt_weak=take(v.weak(xt), tgt),
            tgt_strong=take(v.strong(xt), tgt) if m.needs_strong_target else None,
            src_strong=take(v.strong(xs), src) if m.needs_strong_source else None,
        )
        # a method of one forward pass (the source rows) draws its dropout masks for the global
        # batch; the other methods' passes draw per rank (see docs/distributed.md)
        rows = src if m.rows_of_single_pass else None
        loss, logs = self.update(_method_loss, batch, rows=rows, batch_rows=len(xs))
        if not log:
            return None
        # each rank's values are of its own rows: averaged over the ranks (means over
        # equal-sized local batches, so the global batch's; for a loss that is not a mean over
        # rows, e.g. M3SDA's moment distance, the mean of the ranks' losses that DDP descends)
        return mean_over_ranks(
            {"loss": float(loss.detach()), **logs}, self.ctx.dist, self.ctx.device
        )

    def eval_model(self) -> nn.Module:
        return self.method.model


def _method_loss(method: nn.Module, batch: Step1Batch):
    return method.loss(batch)


def _register() -> None:
    """One stage class per step-1 method (``step1/<name>``)."""
    for name in METHODS:
        cls = type(f"Step1Stage_{name}", (Step1Stage,), {"method_name": name})
        register_stage(f"step1/{name}")(cls)


_register()
