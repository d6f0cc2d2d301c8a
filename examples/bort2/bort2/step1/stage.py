"""Step 1 as a pipeline stage: any registered step-1 method trained on the sources + target."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..data.samplers import InfiniteLoader
from ..dist import call_loss, convert_batchnorm, global_rows, shard_rows, take, wrap_ddp
from ..inputs import Views, prepare
from ..trainer import (
    Precision,
    Stage,
    StageContext,
    build_model,
    check_finite,
    cosine_lr,
    register_stage,
    seeded,
    set_lr,
)
from . import METHODS, Step1Batch


def method_kwargs(name: str, cfg) -> dict[str, Any]:
    """Constructor settings of step-1 method ``name`` from ``cfg.step1``."""
    s1 = cfg.step1
    if name == "fixmatch":
        return {"threshold": s1.threshold, "lambda_u": s1.lambda_u}
    if name == "fixmatch_cm":
        return {"threshold": s1.threshold, "lambda_u": s1.lambda_u, "variant": s1.cm_variant}
    if name == "dann":
        return {"lambda_d": s1.lambda_d}
    if name == "m3sda":
        return {"lambda_m": s1.lambda_m}
    return {}


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
        ctx, s1, name = self.ctx, self.s1, self.method_name
        model = build_model(self.cfg, ctx.bench.num_classes, mixstyle=name == "fixmatch_cm")
        self.method = METHODS[name](model, len(ctx.sources), **method_kwargs(name, self.cfg))
        if self.cfg.model.sync_bn and ctx.dist.active:
            convert_batchnorm(self.method)
        self.method.to(ctx.device).train()
        self.ddp = wrap_ddp(self.method, ctx.dist, ctx.device)
        self.precision = Precision(self.cfg.amp, ctx.device)
        self.opt = torch.optim.SGD(
            self.method.parameters(),
            lr=s1.lr,
            momentum=s1.momentum,
            weight_decay=s1.weight_decay,
            nesterov=True,
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
        self.needs_strong = name in ("fixmatch", "fixmatch_cm")
        self.src_strong = name == "fixmatch_cm" and s1.cm_variant == "official"
        return {
            "method": self.method,
            "opt": self.opt,
            "src": self.src,
            "tgt": self.tgt,
            "aug": self.aug,
            "scaler": self.precision.scaler,
        }

    def step(self, it: int, log: bool) -> dict[str, float] | None:
        dev, v = self.ctx.device, self.views
        set_lr(self.opt, cosine_lr(self.s1.lr, it, self.s1.iters))
        self.method.set_progress(it / max(1, self.s1.iters))
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
            tgt_strong=take(v.strong(xt), tgt) if self.needs_strong else None,
            src_strong=take(v.strong(xs), src) if self.src_strong else None,
        )
        # source-only runs one forward pass (the source rows): its dropout masks are drawn for
        # the global batch; the other methods' passes draw per rank (see docs/distributed.md)
        rows = src if self.method_name == "source_only" else None
        with global_rows(rows, len(xs)), self.precision.autocast():
            loss, logs = call_loss(self.ddp, self.method, _method_loss, batch)
        hint = f"step1.lr={self.s1.lr:g} too large for this model, or corrupt input data"
        check_finite(loss.detach(), "loss", self.ctx, self.name, it, hint)
        self.precision.step(loss, self.opt)
        if not log:
            return None
        return {"loss": float(loss.detach()), **logs}

    def eval_model(self) -> nn.Module:
        return self.method.model


def _method_loss(method: nn.Module, batch: Step1Batch):
    return method.loss(batch)


def _register() -> None:
    for name in METHODS:
        cls = type(f"Step1Stage_{name}", (Step1Stage,), {"method_name": name})
        register_stage(f"step1/{name}")(cls)


_register()
