"""Training loops of both BORT2 steps, evaluation, atomic checkpoints, logging and progress.

Every stage (one step-1 method or one step-2 variant, for one target and seed) lives in its own
directory with ``state.pt`` (periodic, atomic: model, optimizers, loaders, every RNG) and, once
finished, ``final.pt`` + ``metrics.json``. A killed run restarted with ``resume=true`` continues
from the last ``state.pt`` and, because every random stream is restored, ends with the same
numbers as an uninterrupted run (on the same machine and thread count).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .config import Config
from .data.base import Benchmark
from .data.samplers import InfiniteLoader
from .data.transforms import normalize, strong, to_float, weak
from .models import DigitCNN, ResNetClassifier
from .step1 import METHODS, Step1Batch
from .step2 import (
    BilevelLabelUpdater,
    build_student,
    build_threshold,
    naive_loss,
    robust_loss,
    teacher_labels,
)

MEAN, STD = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)


# ----------------------------------------------------------------------------- checkpoints
def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save`` to a temporary file in the same folder, then ``os.replace``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def atomic_write_text(text: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def load_checkpoint(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=True)


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ----------------------------------------------------------------------------- helpers
def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda was requested but CUDA is not available")
    return torch.device(name)


def build_model(cfg: Config, num_classes: int, mixstyle: bool) -> nn.Module:
    """The classifier named by ``cfg.model`` (MixStyle after the first block when asked)."""
    ms = {"p": cfg.model.mixstyle_p, "alpha": cfg.model.mixstyle_alpha} if mixstyle else None
    if cfg.model.arch == "digit_cnn":
        return DigitCNN(num_classes, cfg.model.width, ms, image_size=cfg.data.image_size)
    return ResNetClassifier(cfg.model.arch, num_classes, cfg.model.weights_path, ms)


def cosine_lr(base: float, it: int, total: int) -> float:
    return base * 0.5 * (1.0 + math.cos(math.pi * min(it, total) / max(total, 1)))


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr


def prepare(images: torch.Tensor, device: torch.device) -> torch.Tensor:
    """uint8 images -> float in [0, 1] on ``device``."""
    return to_float(images.to(device, non_blocking=True))


def norm(x: torch.Tensor) -> torch.Tensor:
    return normalize(x, MEAN, STD)


@torch.no_grad()
def predict_dataset(
    model: nn.Module,
    dataset,
    device: torch.device,
    max_n: int = 0,
    batch: int = 512,
    with_features: bool = False,
) -> dict[str, torch.Tensor]:
    """Eval-mode logits (and optionally penultimate features) over a dataset, in order."""
    was = model.training
    model.eval()
    n = len(dataset) if max_n <= 0 else min(max_n, len(dataset))
    images = getattr(dataset, "images", None)
    logits, feats, labels = [], [], []
    for start in range(0, n, batch):
        idx = range(start, min(n, start + batch))
        if images is not None:
            xb = images[start : start + len(idx)]
            yb = dataset.labels[start : start + len(idx)]
        else:
            items = [dataset[i] for i in idx]
            xb = torch.stack([it[0] for it in items])
            yb = torch.tensor([it[1] for it in items])
        x = norm(prepare(xb, device))
        h = model.features(x)
        logits.append(model.head(h).float().cpu())
        if with_features:
            feats.append(h.float().cpu())
        labels.append(yb)
    model.train(was)
    out = {"logits": torch.cat(logits), "labels": torch.cat(labels)}
    if with_features:
        out["features"] = torch.cat(feats)
    return out


def accuracy_with_ci(correct: int, n: int) -> dict[str, float]:
    """Accuracy with a 95% Wilson score interval."""
    if n == 0:
        return {"acc": float("nan"), "ci_low": float("nan"), "ci_high": float("nan"), "n": 0}
    p, z = correct / n, 1.959964
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return {"acc": p, "ci_low": centre - half, "ci_high": centre + half, "n": n}


def evaluate(model: nn.Module, dataset, device: torch.device, max_n: int = 0) -> dict[str, float]:
    out = predict_dataset(model, dataset, device, max_n)
    correct = int((out["logits"].argmax(1) == out["labels"]).sum())
    return accuracy_with_ci(correct, len(out["labels"]))


class Logger:
    """Scalars to TensorBoard (optional) and to an in-memory history saved with checkpoints."""

    def __init__(self, log_dir: Path, tensorboard: bool):
        self.history: dict[str, list[list[float]]] = {}
        self.writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(log_dir))
            except ImportError:  # tensorboard not installed: history only
                self.writer = None

    def log(self, step: int, **scalars: float) -> None:
        for k, v in scalars.items():
            v = float(v)
            self.history.setdefault(k, []).append([step, v])
            if self.writer is not None:
                self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()


def progress_bar(total: int, initial: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        initial=initial,
        desc=desc,
        disable=not enabled,
        leave=False,
        dynamic_ncols=True,
        mininterval=1.0,
    )


# ----------------------------------------------------------------------------- stages
@dataclass
class StageContext:
    """What every stage needs: config, data, target, seed, device and its directory."""

    cfg: Config
    bench: Benchmark
    target: str
    seed: int
    device: torch.device
    stage_dir: Path
    stop_after_checkpoints: int = 0  # tests: raise after this many periodic checkpoints
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def sources(self) -> list[str]:
        return [d for d in self.bench.domains if d != self.target]


class StageInterrupted(RuntimeError):
    """Raised on purpose by ``stop_after_checkpoints`` (tests of resume)."""


def _finished(stage_dir: Path) -> dict[str, Any] | None:
    path = stage_dir / "metrics.json"
    if (stage_dir / "final.pt").is_file() and path.is_file():
        return json.loads(path.read_text())
    return None


def _finish(ctx: StageContext, model: nn.Module, metrics: dict[str, Any], history: dict) -> None:
    atomic_save({"model": model.state_dict()}, ctx.stage_dir / "final.pt")
    atomic_write_text(json.dumps({"history": history}), ctx.stage_dir / "history.json")
    atomic_write_text(json.dumps(metrics, indent=2), ctx.stage_dir / "metrics.json")
    state = ctx.stage_dir / "state.pt"
    if state.exists():
        state.unlink()


def _seeded(seed: int, salt: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed) * 1_000_003 + salt)


class StageCheckpoint:
    """The periodic ``state.pt`` of a stage: every stateful object it names, the global RNG, the
    logged history and the iteration, written atomically every ``checkpoint_every`` iterations.

    ``objects`` maps a key to anything with ``state_dict``/``load_state_dict`` (modules,
    optimizers, loaders, thresholds) or a ``torch.Generator``; ``None`` values are skipped.
    """

    def __init__(self, ctx: StageContext, logger: Logger, **objects: Any):
        self.ctx, self.logger, self.path = ctx, logger, ctx.stage_dir / "state.pt"
        self.objects = {k: v for k, v in objects.items() if v is not None}
        self.saved = 0

    def restore(self) -> int:
        """Load the saved state when resuming; returns the iteration to start from."""
        if not (self.ctx.cfg.resume and self.path.is_file()):
            return 0
        st = load_checkpoint(self.path)
        for key, obj in self.objects.items():
            if isinstance(obj, torch.Generator):
                obj.set_state(st[key])
            else:
                obj.load_state_dict(st[key])
        set_rng_state(st["rng"])
        self.logger.history = st["history"]
        return int(st["it"])

    def step(self, done: int, total: int, bar) -> None:
        """After ``done`` iterations: save if due; stop on purpose if a test asked to."""
        if done % self.ctx.cfg.checkpoint_every or done >= total:
            return
        st = {
            k: o.get_state() if isinstance(o, torch.Generator) else o.state_dict()
            for k, o in self.objects.items()
        }
        st.update(rng=rng_state(), history=self.logger.history, it=done)
        atomic_save(st, self.path)
        self.saved += 1
        if self.ctx.stop_after_checkpoints and self.saved >= self.ctx.stop_after_checkpoints:
            bar.close()
            raise StageInterrupted(f"stopped after checkpoint at iteration {done}")


def train_step1(ctx: StageContext, method_name: str) -> dict[str, Any]:
    """Train one step-1 method on the sources (+ unlabelled target); returns its metrics."""
    done = _finished(ctx.stage_dir)
    if done is not None:
        return done
    cfg, s1, dev = ctx.cfg, ctx.cfg.step1, ctx.device
    torch.manual_seed(ctx.seed)
    nc = ctx.bench.num_classes
    model = build_model(cfg, nc, mixstyle=method_name == "fixmatch_cm")
    kwargs: dict[str, Any] = {}
    if method_name in ("fixmatch", "fixmatch_cm"):
        kwargs = {"threshold": s1.threshold, "lambda_u": s1.lambda_u}
    elif method_name == "dann":
        kwargs = {"lambda_d": s1.lambda_d}
    elif method_name == "m3sda":
        kwargs = {"lambda_m": s1.lambda_m}
    method = METHODS[method_name](model, len(ctx.sources), **kwargs).to(dev)
    method.train()
    opt = torch.optim.SGD(
        method.parameters(),
        lr=s1.lr,
        momentum=s1.momentum,
        weight_decay=s1.weight_decay,
        nesterov=True,
    )
    src = InfiniteLoader(
        [ctx.bench.split(d, "train") for d in ctx.sources],
        s1.batch_per_domain,
        _seeded(ctx.seed, 1),
        num_workers=cfg.data.num_workers,
    )
    tgt = InfiniteLoader(
        [ctx.bench.split(ctx.target, "train")],
        s1.target_batch,
        _seeded(ctx.seed, 2),
        num_workers=cfg.data.num_workers,
    )
    aug = _seeded(ctx.seed, 3)
    logger = Logger(ctx.stage_dir / "tb", cfg.tensorboard)
    ckpt = StageCheckpoint(ctx, logger, method=method, opt=opt, src=src, tgt=tgt, aug=aug)
    start = ckpt.restore()
    needs_strong = method_name in ("fixmatch", "fixmatch_cm")
    t0 = time.perf_counter()
    bar = progress_bar(
        s1.iters, start, f"step1 {method_name} [{ctx.target} s{ctx.seed}]", cfg.progress
    )
    for it in range(start, s1.iters):
        set_lr(opt, cosine_lr(s1.lr, it, s1.iters))
        method.set_progress(it / max(1, s1.iters))
        xs, ys, ds = next(src)
        xt, _, _ = next(tgt)
        xs, xt = prepare(xs, dev), prepare(xt, dev)
        batch = Step1Batch(
            src_x=norm(weak(xs, aug)),
            src_y=ys.to(dev),
            src_d=ds.to(dev),
            tgt_weak=norm(weak(xt, aug)),
            tgt_strong=norm(strong(xt, aug)) if needs_strong else None,
        )
        loss, logs = method.loss(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        bar.update(1)
        if (it + 1) % 10 == 0:
            logger.log(it + 1, **{"loss": float(loss.detach()), **logs})
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}")
        if (it + 1) % cfg.eval_every == 0 and it + 1 < s1.iters:
            acc = evaluate(
                method.model, ctx.bench.split(ctx.target, "test"), dev, cfg.data.max_test
            )
            logger.log(it + 1, target_acc=acc["acc"])
        ckpt.step(it + 1, s1.iters, bar)
    bar.close()
    acc = evaluate(method.model, ctx.bench.split(ctx.target, "test"), dev, cfg.data.max_test)
    metrics = {
        "stage": f"step1/{method_name}",
        "target": ctx.target,
        "seed": ctx.seed,
        "iters": s1.iters,
        "time_s": time.perf_counter() - t0,
        **acc,
    }
    logger.log(s1.iters, target_acc=acc["acc"])
    logger.close()
    _finish(ctx, method.model, metrics, logger.history)
    return metrics


def load_labeler(cfg: Config, path: Path, num_classes: int, method_name: str) -> nn.Module:
    """A step-1 model from its ``final.pt`` (or any checkpoint holding a model state dict)."""
    if not path.is_file():
        raise FileNotFoundError(f"step-1 checkpoint {path} does not exist")
    st = load_checkpoint(path)
    state = st.get("model", st)
    model = build_model(cfg, num_classes, mixstyle=method_name == "fixmatch_cm")
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        raise ValueError(
            f"{path} does not fit model.arch={cfg.model.arch} width={cfg.model.width}: {exc}"
        ) from None
    return model


def _split_val(n: int, fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    perm = torch.randperm(n, generator=_seeded(seed, 7))
    k = max(1, int(round(fraction * n)))
    return perm[k:].sort().values, perm[:k].sort().values


class _Subset(torch.utils.data.Dataset):
    """A subset of an in-memory or on-disk domain that keeps fast tensor indexing."""

    def __init__(self, ds, idx: torch.Tensor):
        self.ds, self.idx = ds, idx
        if getattr(ds, "images", None) is not None:
            self.images, self.labels = ds.images[idx], ds.labels[idx]

    def __len__(self) -> int:
        return len(self.idx)

    def __getitem__(self, i: int):
        return self.ds[int(self.idx[i])]


def train_step2(ctx: StageContext, variant: str, labeler_path: Path, labeler_method: str) -> dict:
    """Train one step-2 variant (naive / robust / bort2) from a step-1 labeler checkpoint."""
    done = _finished(ctx.stage_dir)
    if done is not None:
        return done
    cfg, s2, dev = ctx.cfg, ctx.cfg.step2, ctx.device
    torch.manual_seed(ctx.seed + 17)
    nc = ctx.bench.num_classes
    labeler = load_labeler(cfg, labeler_path, nc, labeler_method).to(dev)
    labeler.eval()  # F_theta labels with its running statistics; bort2 still updates its weights
    student = build_student(labeler, variant, nc, s2.sigma_init).to(dev)
    student.train()
    for p in labeler.parameters():
        p.requires_grad_(variant == "bort2")
    threshold = build_threshold(s2.threshold, s2.fixed_tau, s2.ema_alpha, nc).to(dev)
    opt = torch.optim.SGD(
        student.parameters(),
        lr=s2.lr,
        momentum=s2.momentum,
        weight_decay=s2.weight_decay,
        nesterov=True,
    )
    updater = None
    if variant == "bort2":
        updater = BilevelLabelUpdater(
            student,
            labeler,
            s2.hinge_lambda,
            s2.hinge_margin,
            s2.temperature,
            s2.neumann_steps,
            s2.neumann_alpha,
            s2.hyper_lr,
            s2.hyper_clip,
        )
    train_ds = ctx.bench.split(ctx.target, "train")
    val_loader = None
    if s2.outer == "val":
        tr_idx, va_idx = _split_val(len(train_ds), s2.val_fraction, ctx.seed)
        val_loader = InfiniteLoader(
            [_Subset(train_ds, va_idx)], s2.batch_size, _seeded(ctx.seed, 8)
        )
        train_ds = _Subset(train_ds, tr_idx)
    loader = InfiniteLoader(
        [train_ds], s2.batch_size, _seeded(ctx.seed, 4), num_workers=cfg.data.num_workers
    )
    aug, gumbel = _seeded(ctx.seed, 5), _seeded(ctx.seed, 6)
    logger = Logger(ctx.stage_dir / "tb", cfg.tensorboard)
    ckpt = StageCheckpoint(
        ctx,
        logger,
        student=student,
        labeler=labeler,
        threshold=threshold,
        opt=opt,
        hyper_opt=updater.optimizer if updater is not None else None,
        loader=loader,
        val_loader=val_loader,
        aug=aug,
        gumbel=gumbel,
    )
    start = ckpt.restore()
    label_mode = "argmax" if variant == "naive" else s2.labels
    t0 = time.perf_counter()
    inner_time = hyper_time = 0.0
    hyper_steps = hyper_diverged = 0
    bar = progress_bar(s2.iters, start, f"step2 {variant} [{ctx.target} s{ctx.seed}]", cfg.progress)
    for it in range(start, s2.iters):
        ti = time.perf_counter()
        set_lr(opt, cosine_lr(s2.lr, it, s2.iters))
        xb, yb, _ = next(loader)  # yb: ground truth, used for analysis logs only
        x = prepare(xb, dev)
        x_weak = norm(weak(x, aug))
        x_student = norm(strong(x, aug)) if s2.student_view == "strong" else norm(weak(x, aug))
        with torch.no_grad():
            labels, conf, pred = teacher_labels(labeler, x_weak, label_mode, s2.temperature, gumbel)
            mask = threshold(conf, pred)
        labels = labels.detach()
        if variant == "naive":
            loss = naive_loss(student, x_student, labels, mask)
            sigma = None
        else:
            loss, sigma = robust_loss(
                student, x_student, labels, mask, s2.hinge_lambda, s2.hinge_margin
            )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        inner_time += time.perf_counter() - ti
        if (
            updater is not None
            and it + 1 >= s2.warmup
            and (it + 1 - s2.warmup) % s2.hyper_every == 0
        ):
            th = time.perf_counter()
            x_outer = None
            if val_loader is not None:
                xv, _, _ = next(val_loader)
                xv = prepare(xv, dev)
                x_outer = (
                    norm(strong(xv, aug)) if s2.student_view == "strong" else norm(weak(xv, aug))
                )
            info = updater(x_student, x_weak, mask.float(), x_outer, gumbel)
            hyper_time += time.perf_counter() - th
            hyper_steps += 1
            hyper_diverged += int(info.solve.diverged)
            logger.log(
                it + 1,
                hypergrad_norm=info.hypergrad_norm,
                hyper_clipped=float(info.clipped),
                hyper_direct_norm=info.direct_norm,
                hyper_indirect_norm=info.indirect_norm,
                hyper_residual=info.solve.residual,
                hyper_diverged=float(info.solve.diverged),
                hyper_outer_loss=info.outer_loss,
                hyper_time_s=info.time_s,
            )
        bar.update(1)
        if (it + 1) % 10 == 0:
            y = yb.to(dev)
            correct = pred == y
            m = mask.bool()
            logs = {
                "loss": float(loss.detach()),
                "mask_rate": float(m.float().mean()),
                "pseudo_acc": float(correct.float().mean()),
                "pseudo_acc_masked": float(correct[m].float().mean()) if m.any() else float("nan"),
                "tau": float(torch.nan_to_num(threshold.threshold.float(), nan=1.0).mean()),
            }
            if sigma is not None:
                s = sigma.detach().mean(1)
                if correct.any():
                    logs["sigma_correct"] = float(s[correct].mean())
                if (~correct).any():
                    logs["sigma_wrong"] = float(s[~correct].mean())
            logger.log(it + 1, **logs)
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}", mask=f"{logs['mask_rate']:.2f}")
        if (it + 1) % cfg.eval_every == 0 and it + 1 < s2.iters:
            acc = evaluate(student, ctx.bench.split(ctx.target, "test"), dev, cfg.data.max_test)
            logger.log(it + 1, target_acc=acc["acc"])
        ckpt.step(it + 1, s2.iters, bar)
    bar.close()
    test = ctx.bench.split(ctx.target, "test")
    acc = evaluate(student, test, dev, cfg.data.max_test)
    labeler_acc = evaluate(labeler, test, dev, cfg.data.max_test)
    run_iters = s2.iters - start
    timed_hyper_steps = hyper_steps
    hyper_log = logger.history.get("hyper_diverged", [])  # whole run, also across a resume
    hyper_steps, hyper_diverged = len(hyper_log), int(sum(v for _, v in hyper_log))
    metrics = {
        "stage": f"step2/{variant}",
        "target": ctx.target,
        "seed": ctx.seed,
        "iters": s2.iters,
        "time_s": time.perf_counter() - t0,
        "labeler_acc": labeler_acc["acc"],
        "inner_time_per_iter_s": inner_time / max(run_iters, 1),
        "hyper_time_per_step_s": hyper_time / timed_hyper_steps if timed_hyper_steps else 0.0,
        "hyper_steps": hyper_steps,
        "hyper_diverged_steps": hyper_diverged,
        **acc,
    }
    logger.log(s2.iters, target_acc=acc["acc"])
    logger.close()
    _finish(ctx, student, metrics, logger.history)
    if variant == "bort2":
        atomic_save({"model": labeler.state_dict()}, ctx.stage_dir / "labeler_final.pt")
    return metrics


def stage_fn(kind: str) -> Callable[..., dict[str, Any]]:
    return {"step1": train_step1, "step2": train_step2}[kind]
