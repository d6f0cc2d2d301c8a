"""The one training loop that every BORT2 stage runs, and the registry of stages.

A stage (a step-1 method, the naive two-step model, Stage B or Stage C) is a :class:`Stage`
subclass registered under its name with :func:`register_stage`, in the spirit of Dassl's
trainer registry; the name must have a row in :data:`bort2.stages_index.SPECS` (its display
name, order and inputs). It says how to build its models and optimizer (:meth:`Stage.setup`,
with :meth:`Stage.optimize`), what one iteration does (:meth:`Stage.step`: a batch, then
``self.update(loss_fn, ...)``, then logs), which model is evaluated and what its final
checkpoint holds. :meth:`Stage.update` owns the update step (DDP rows, autocast, loss, finite
check, optimizer step through the precision's scaler) and :meth:`Stage.schedule` the cosine lr.
:func:`run_stage` owns everything else, once for all stages: skipping finished stages, seeding,
periodic checkpoints and exact resume, logging (history + TensorBoard), the progress bar,
evaluation every ``eval_every`` iterations, and the final metrics (final and
best-over-evaluations target accuracy).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .checkpoint import (
    StageCheckpoint,
    clear_stage,
    finished_metrics,
    stage_identity,
    write_final,
)
from .config import Config
from .data.base import Benchmark
from .dist import (
    DistEnv,
    barrier,
    call_loss,
    global_rows,
    mean_over_ranks,
    shard_rows,
    take,
    wrap_ddp,
)
from .errors import TrainingDiverged
from .evaluation import evaluate
from .models import DigitCNN, ResNetClassifier
from .progress import make_bar
from .stages_index import SPECS


# ----------------------------------------------------------------------------- helpers
def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU; ``cuda`` without CUDA is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda was requested but CUDA is not available")
    return torch.device(name)


def build_model(cfg: Config, num_classes: int, mixstyle: bool) -> nn.Module:
    """The classifier named by ``cfg.model``; with ``mixstyle``, MixStyle where the authors put
    it (DigitCNN: after the first block; ResNets: after layer1 and layer2)."""
    ms = {"p": cfg.model.mixstyle_p, "alpha": cfg.model.mixstyle_alpha} if mixstyle else None
    if cfg.model.arch == "digit_cnn":
        return DigitCNN(num_classes, cfg.model.width, ms, image_size=cfg.data.image_size)
    return ResNetClassifier(cfg.model.arch, num_classes, cfg.model.weights_path, ms)


AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    """Mixed precision of a stage (``amp``): autocast for the forward passes and losses, and a
    ``GradScaler`` for fp16 on CUDA (checkpointed with the stage).

    ``amp=off`` changes nothing; ``bf16`` autocasts on CPUs and GPUs (no scaler: bf16 has
    float32's exponent range); ``fp16`` needs CUDA.
    """

    def __init__(self, amp: str, device: torch.device):
        if amp == "fp16" and device.type != "cuda":
            raise ValueError(
                "amp=fp16 needs a CUDA device (float16 gradients need a GradScaler, which this "
                "pipeline runs on CUDA only); use amp=bf16 on CPUs"
            )
        self.amp, self.device = amp, device
        self.scaler = torch.amp.GradScaler("cuda") if amp == "fp16" else None

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward-pass context (a no-op with ``amp=off``)."""
        if self.amp == "off":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=AMP_DTYPES[self.amp])

    def step(self, loss: torch.Tensor, opt: torch.optim.Optimizer) -> None:
        """``zero_grad``, backward and optimizer step (through the scaler for fp16)."""
        opt.zero_grad(set_to_none=True)
        if self.scaler is None:
            loss.backward()
            opt.step()
            return
        self.scaler.scale(loss).backward()
        self.scaler.step(opt)
        self.scaler.update()


def cosine_lr(base: float, it: int, total: int) -> float:
    """Cosine decay from ``base`` at iteration 0 to 0 at ``total``."""
    return base * 0.5 * (1.0 + math.cos(math.pi * min(it, total) / max(total, 1)))


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr


def seeded(seed: int, salt: int) -> torch.Generator:
    """A CPU generator for one random stream of a stage (``salt`` names the stream)."""
    return torch.Generator().manual_seed(int(seed) * 1_000_003 + salt)


class Logger:
    """Scalars to TensorBoard (optional) and to an in-memory history saved with checkpoints.

    TensorBoard receives the scalars when :meth:`flush` runs (at every periodic checkpoint and
    at :meth:`close`); its event files are then recorded in the run folder's manifest
    (:func:`bort2.rundir.record`), so ``overwrite=true`` can prove them the pipeline's. The
    writer (and its event file) is made at the first flush.
    """

    def __init__(self, log_dir: Path, tensorboard: bool):
        self.history: dict[str, list[list[float]]] = {}
        self.log_dir = Path(log_dir)
        self.writer: Any = None
        self.pending: list[tuple[str, float, int]] = []
        self.files: set[Path] = set()
        self.tensorboard = False
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter  # noqa: F401

                self.tensorboard = True
            except ImportError:  # tensorboard not installed: history only
                self.tensorboard = False

    def log(self, step: int, **scalars: float) -> None:
        for k, v in scalars.items():
            v = float(v)
            self.history.setdefault(k, []).append([step, v])
            if self.tensorboard:
                self.pending.append((k, v, step))

    def flush(self) -> None:
        """Hand the pending scalars to TensorBoard, flush its file, record the event files."""
        if not self.tensorboard or (not self.pending and self.writer is None):
            return
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            before = self._event_files()
            self.writer = SummaryWriter(str(self.log_dir))
            self.writer.flush()
            self.files = self._event_files() - before
        for k, v, step in self.pending:
            self.writer.add_scalar(k, v, step)
        self.pending.clear()
        self.writer.flush()
        self._record()

    def _event_files(self) -> set[Path]:
        if not self.log_dir.is_dir():
            return set()
        return {p for p in self.log_dir.iterdir() if p.is_file() and not p.is_symlink()}

    def _record(self) -> None:
        from .rundir import record

        for path in sorted(self.files):
            if path.is_file():
                record(path)

    def close(self) -> None:
        self.flush()
        if self.writer is not None:
            self.writer.close()
            self._record()
            self.writer = None


# ----------------------------------------------------------------------------- stages
@dataclass
class StageContext:
    """What every stage needs: config, data, target, seed, device, its directory and inputs.

    ``inputs`` names the files of earlier stages this one starts from, by
    :func:`bort2.stages_index.input_key` of the stages in its spec's ``needs``
    (``"labeler"``: the step-1 checkpoint; a step-2 stage's name: that stage's ``final.pt``).
    """

    cfg: Config
    bench: Benchmark
    target: str
    seed: int
    device: torch.device
    stage_dir: Path
    stop_after_checkpoints: int = 0  # tests: raise after this many periodic checkpoints
    inputs: dict[str, Path] | None = None
    dist: DistEnv = field(default_factory=DistEnv)  # this process's rank under torchrun

    @property
    def sources(self) -> list[str]:
        return [d for d in self.bench.domains if d != self.target]

    def identity(self, stage: str, kind: str = "final") -> dict[str, Any]:
        """The identity record of this unit's ``stage`` file of ``kind`` (see
        :func:`bort2.checkpoint.stage_identity`): what the file says it is, and what loading it
        requires."""
        return stage_identity(self.cfg, stage, self.target, self.seed, kind)

    def input(self, name: str) -> Path:
        """The path of an earlier stage's file, with a clear error when it was not given.

        A step-2 stage's file may also be given under its method's name alone (older callers).
        """
        inputs = self.inputs or {}
        path = inputs.get(name, inputs.get(name.rpartition("/")[2]))
        if path is None:
            raise ValueError(f"stage {self.stage_dir.name} needs input {name!r}")
        return path


def check_finite(value: torch.Tensor, what: str, ctx: StageContext, stage: str, it: int, hint: str):
    """Stop a stage at the first non-finite loss (or hypergradient), before it reaches weights.

    Under torchrun the verdict is the ranks' together (one all-reduce of a flag): a loss that
    is not finite on one rank only stops every rank, each naming the ranks where it was not
    (a rank stopping alone would leave the others waiting in DDP's gradient all-reduce).

    Raises:
        TrainingDiverged: naming the stage, unit, iteration and a likely cause.
    """
    finite = bool(torch.isfinite(value).all())
    where = ""
    env = ctx.dist
    if env.active:
        flags = [0.0] * env.world
        flags[env.rank] = 0.0 if finite else 1.0
        bad = mean_over_ranks({str(r): f for r, f in enumerate(flags)}, env, value.device)
        ranks = [r for r in range(env.world) if bad[str(r)] > 0]
        finite = not ranks
        where = f" on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
    if not finite:
        raise TrainingDiverged(
            f"{stage} [target {ctx.target}, seed {ctx.seed}]: the {what} is not finite at "
            f"iteration {it + 1}{where}; nothing of this stage was written (its last periodic "
            f"state is kept). Likely cause: {hint}"
        )


class Stage:
    """One stage of the pipeline; subclasses fill in the hooks (see the module docstring).

    Attributes:
        name: registry name, also the ``stage`` field of the result rows.
        seed_salt: added to the run's seed for the global RNG of this stage.
    """

    name = "stage"
    seed_salt = 0

    def __init__(self, ctx: StageContext):
        self.ctx, self.cfg = ctx, ctx.cfg
        self.it = 0

    @property
    def spec(self):
        """This stage's row of :data:`bort2.stages_index.SPECS`."""
        return SPECS[self.name]

    @property
    def iters(self) -> int:
        raise NotImplementedError

    def setup(self) -> dict[str, Any]:
        """Build models, optimizers, loaders; return the objects to checkpoint by name."""
        raise NotImplementedError

    def optimize(self, net: nn.Module, lr: float, **sgd: Any) -> torch.optim.Optimizer:
        """Train ``net`` with SGD from base lr ``lr`` (cosine-annealed by :meth:`schedule`),
        through DDP under torchrun, in the run's mixed precision (``self.precision``)."""
        self.net = net
        self.ddp = wrap_ddp(net, self.ctx.dist, self.ctx.device)
        self.precision = Precision(self.cfg.amp, self.ctx.device)
        self.lr = lr
        self.opt = torch.optim.SGD(net.parameters(), lr=lr, **sgd)
        return self.opt

    def schedule(self, it: int) -> None:
        """Before iteration ``it``: the cosine lr from ``self.lr`` to 0 over :attr:`iters`."""
        self.it = it
        set_lr(self.opt, cosine_lr(self.lr, it, self.iters))

    def shard(
        self, n: int, *tensors: torch.Tensor | None, blocks: int = 1, what: str = "batch"
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """This rank's rows of an ``n``-row global batch of ``blocks`` equal blocks, and those
        rows of each tensor (``(None, tensors)`` in one process; see
        :func:`bort2.dist.shard_rows`)."""
        rows = shard_rows(n, blocks, self.ctx.dist, what)
        return rows, [take(t, rows) for t in tensors]

    def divergence_hint(self) -> str:
        """The likely cause named when the loss is not finite."""
        return "an lr too large for this model, or corrupt input data"

    def update(
        self,
        loss_fn: Callable[..., Any],
        *inputs: Any,
        rows: torch.Tensor | None = None,
        batch_rows: int = 0,
        after: Callable[[], None] | None = None,
    ) -> Any:
        """One optimizer step on ``loss_fn(net, *inputs)``; returns what ``loss_fn`` returned.

        The loss is computed through DDP (when under torchrun) under autocast; a non-finite loss
        stops the stage (:func:`check_finite`) before any weight changes; then ``zero_grad``,
        backward and step (through the GradScaler with fp16), then ``after()`` (e.g. an EMA
        teacher or a hyper step) under autocast. ``loss_fn`` returns the loss or a tuple whose
        first item is the loss.

        Args:
            rows: this rank's rows of the global batch of ``batch_rows`` rows (None in one
                process): random draws inside the forward passes (and ``after``) are made for
                the global batch, each rank keeping its rows (:func:`bort2.dist.global_rows`).
        """
        with global_rows(rows, batch_rows):
            with self.precision.autocast():
                out = call_loss(self.ddp, self.net, loss_fn, *inputs)
            loss = out[0] if isinstance(out, tuple) else out
            check_finite(
                loss.detach(), "loss", self.ctx, self.name, self.it, self.divergence_hint()
            )
            self.precision.step(loss, self.opt)
            if after is not None:
                with self.precision.autocast():
                    after()
        return out

    def step(self, it: int, log: bool) -> dict[str, float] | None:
        """Run iteration ``it``; return scalars to log when ``log`` (every 10 iterations)."""
        raise NotImplementedError

    def eval_model(self) -> nn.Module:
        """The model whose target accuracy the stage reports."""
        raise NotImplementedError

    def final_state(self) -> dict[str, Any]:
        """What ``final.pt`` holds (at least ``{"model": state_dict}``)."""
        return {"model": self.eval_model().state_dict()}

    def finish(self, history: dict[str, list[list[float]]], start: int) -> dict[str, Any]:
        """Extra metrics (and files) at the end; ``start``: the iteration this process began."""
        return {}


STAGES: dict[str, type[Stage]] = {}


def register_stage(name: str) -> Callable[[type[Stage]], type[Stage]]:
    """Class decorator: register a :class:`Stage` subclass under ``name``, which must have a
    row in :data:`bort2.stages_index.SPECS`."""

    def wrap(cls: type[Stage]) -> type[Stage]:
        if name not in SPECS:
            raise ValueError(
                f"stage {name!r} has no row in bort2.stages_index.SPECS; add one (display name, "
                "needs, order) before registering its class"
            )
        if name in STAGES:
            raise ValueError(f"stage {name!r} is registered twice")
        cls.name = name
        STAGES[name] = cls
        return cls

    return wrap


def run_stage(ctx: StageContext, name: str) -> dict[str, Any]:
    """Train the registered stage ``name``.

    With ``resume=true`` a finished stage (whose ``final.pt``, ``history.json`` and
    ``metrics.json`` verify and are this stage's: same stage, target, seed and configuration
    fingerprint) is reused and a killed one continues from its periodic state; without it,
    whatever an earlier attempt left in the stage's folder is cleared first, so nothing is ever
    reused by accident. A file of another stage, seed or run is refused (``CheckpointError``).
    """
    env = ctx.dist
    if ctx.cfg.resume:
        done = finished_metrics(ctx.stage_dir, ctx.identity(name, "final"))
        if done is not None:
            return done
    elif ctx.stage_dir.is_dir() and env.main:
        clear_stage(ctx.stage_dir)
    barrier(env)
    if name not in STAGES:
        raise ValueError(f"unknown stage {name!r}; registered: {', '.join(sorted(STAGES))}")
    cfg = ctx.cfg
    stage = STAGES[name](ctx)
    torch.manual_seed(ctx.seed + stage.seed_salt)
    objects = stage.setup()
    logger = Logger(ctx.stage_dir / "tb", cfg.tensorboard and env.main)
    ckpt = StageCheckpoint(
        ctx.stage_dir / "state.pt",
        cfg.checkpoint_every,
        logger,
        cfg.resume,
        ctx.stop_after_checkpoints,
        write=env.main,
        identity=ctx.identity(name, "state"),
        **objects,
    )
    start = ckpt.restore()
    total = stage.iters
    test = ctx.bench.split(ctx.target, "test")
    t0 = time.perf_counter()
    bar = make_bar(total, f"{name} [{ctx.target} s{ctx.seed}]", cfg.progress and env.main, start)
    try:
        for it in range(start, total):
            stage.schedule(it)
            logs = stage.step(it, log=(it + 1) % 10 == 0)
            bar.update(1)
            if logs:
                logger.log(it + 1, **logs)
                if "loss" in logs:
                    bar.set_postfix(loss=f"{logs['loss']:.3f}")
            if (it + 1) % cfg.eval_every == 0 and it + 1 < total:
                acc = evaluate(stage.eval_model(), test, ctx.device, cfg.data.max_test)
                logger.log(it + 1, target_acc=acc["acc"])
            ckpt.step(it + 1, total)
    finally:
        bar.close()
    acc = evaluate(stage.eval_model(), test, ctx.device, cfg.data.max_test)
    logger.log(total, target_acc=acc["acc"])
    evals = [v for _, v in logger.history["target_acc"]]
    metrics = {
        "stage": name,
        "target": ctx.target,
        "seed": ctx.seed,
        "iters": total,
        "time_s": time.perf_counter() - t0,
        **acc,
        "best_acc": max(evals),
        "n_evals": len(evals),
    }
    metrics.update(stage.finish(logger.history, start))
    logger.close()
    if env.main:  # one writer; the other ranks wait until the files exist
        write_final(ctx.stage_dir, stage.final_state(), metrics, logger.history, ctx.identity(name))
    barrier(env)
    return metrics
