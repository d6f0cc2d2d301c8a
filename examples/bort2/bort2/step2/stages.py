"""The step-2 stages: naive two-step, Stage B (BORT2 w/o bi-level) and Stage C (BORT2).

All three share one iteration (:class:`Step2Stage`): a target batch, F_theta's labels on the
weak view (argmax by default), the threshold's mask, one SGD step of M_psi on the student view
(:meth:`~bort2.trainer.Stage.update`). They differ in the student's loss and in what happens
after the step:

* :class:`NaiveStage`: a plain copy of F_theta, masked CE; F_theta frozen.
* :class:`RobustStage` (Stage B): the stochastic layer and the hinge; after every step F_theta
  becomes an EMA of M_psi (``step2.teacher_ema``, the authors' mean teacher; 0 = frozen).
* :class:`Bort2Stage` (Stage C): F_theta and M_psi both start from the stage
  ``step2.bort2_init`` names (:data:`bort2.stages_index.BORT2_INITS`: Stage B's target model by
  default, or the step-1 labeler), F_theta is frozen between hyper steps, and every
  ``hyper_every`` iterations :class:`~bort2.step2.BilevelLabelUpdater` updates it.

Names, display names and inputs of the stages are their rows of
:data:`bort2.stages_index.SPECS`; a new step-2 method is a :class:`Step2Stage` subclass
registered under ``"step2/<name>"`` plus its row there.

M_psi's optimizer is the authors': SGD, momentum 0.9, weight decay 5e-4, no Nesterov, lr
``step2.lr`` (default 0.1 x the step-1 lr), cosine-annealed over the stage.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import hypergrad as hg

from ..checkpoint import IDENTITY_KEY, atomic_save, load_checkpoint
from ..config import first_hyper_step, step2_lr
from ..data.samplers import InfiniteLoader
from ..dist import (
    broadcast_buffers,
    convert_batchnorm,
    gather_rows,
    mean_over_ranks,
    shard_rows,
    take,
)
from ..errors import CheckpointError, TrainingDiverged
from ..evaluation import evaluate
from ..inputs import Views, prepare
from ..stages_index import LABELER, SPECS, bort2_start
from ..trainer import Stage, StageContext, build_model, register_stage, seeded
from .hyper import LOG_EPS, BilevelLabelUpdater
from .losses import build_student, build_threshold, naive_loss, robust_loss, teacher_labels


def load_labeler(
    cfg,
    path: Path,
    num_classes: int,
    method_name: str | None = None,
    key: str = "model",
    *,
    expect: dict[str, Any] | None = None,
) -> nn.Module:
    """A plain classifier from a checkpoint (``final.pt`` of step 1, or Stage B's ``key`` entry).

    The returned model has no MixStyle (a step-1 multi-source device; it holds no state, so a
    FixMatch-CM checkpoint loads as it is). ``method_name`` is accepted for older callers.
    ``expect``: the identity record the file must carry when it has one (see
    :func:`bort2.checkpoint.load_checkpoint`).
    """
    # CheckpointError (naming the file) if missing, corrupt, or another stage's/seed's/run's
    st = load_checkpoint(path, expect)
    state = st.get(key, st)
    model = build_model(cfg, num_classes, mixstyle=False)
    try:
        model.load_state_dict(state)
    except RuntimeError:
        raise CheckpointError(
            f"{path} does not fit model.arch={cfg.model.arch} width={cfg.model.width} (a "
            "checkpoint of another network or width)"
        ) from None
    return model


@torch.no_grad()
def ema_update(labeler: nn.Module, student: nn.Module, decay: float) -> None:
    """``labeler <- decay * labeler + (1 - decay) * M_psi`` over the labeler's whole state.

    Weights and floating-point buffers (BatchNorm running statistics) are averaged, as in the
    authors' ``ema_model_update``; M_psi's sigma branch has no counterpart and is left out
    (``student.classifier_state()`` maps M_psi to the labeler's keys). Integer buffers
    (``num_batches_tracked``) are kept.
    """
    source = student.classifier_state()
    for key, value in labeler.state_dict().items():
        if value.is_floating_point():
            value.mul_(decay).add_(source[key].to(value.dtype), alpha=1.0 - decay)


class Step2Stage(Stage):
    """What the three step-2 stages share (see the module docstring).

    Attributes:
        uses_outer_split: draws the outer batches of its hyper steps from the held-out split
            of ``step2.outer=val`` (every step-2 stage trains without that split).
    """

    seed_salt = 17
    uses_outer_split = False

    def __init__(self, ctx: StageContext):
        super().__init__(ctx)
        self.s2 = self.cfg.step2
        self.nc = ctx.bench.num_classes

    @property
    def iters(self) -> int:
        return self.s2.iters

    @property
    def label_mode(self) -> str:
        return self.s2.labels

    def labeler_identity(self) -> dict[str, Any] | None:
        """What the step-1 labeler's ``final.pt`` must be: a step-1 model of this unit trained
        with this run's step-1 settings (any step-1 method: which one is the caller's choice).
        None with ``step1.checkpoint``: the user's file is taken as it is."""
        if self.cfg.step1.checkpoint:
            return None
        return self.ctx.identity("step1/*")

    def build_models(self) -> tuple[nn.Module, nn.Module]:
        """``(labeler, student)``; by default both from the step-1 labeler (Stage C overrides)."""
        cfg = self.cfg
        labeler = load_labeler(
            cfg, self.ctx.input(LABELER), self.nc, expect=self.labeler_identity()
        )
        return labeler, self.new_student(labeler)

    def new_student(self, labeler: nn.Module) -> nn.Module:
        """M_psi as a copy of F_theta (plain or stochastic, as the stage's spec says)."""
        plain = self.spec.plain_student
        return build_student(labeler, plain, self.nc, self.s2.sigma_init, self.cfg.model.sigma_head)

    def setup(self) -> dict[str, Any]:
        ctx, s2, dev = self.ctx, self.s2, self.ctx.device
        labeler, student = self.build_models()
        self.env = ctx.dist
        if self.cfg.model.sync_bn and self.env.active:
            convert_batchnorm(labeler)
            convert_batchnorm(student)
        self.labeler, self.student = labeler.to(dev).eval(), student.to(dev).train()
        for p in self.labeler.parameters():
            p.requires_grad_(False)
        self.threshold = build_threshold(s2.threshold, s2.fixed_tau, s2.ema_alpha, self.nc).to(dev)
        self.optimize(
            self.student,
            step2_lr(self.cfg),
            momentum=s2.momentum,
            weight_decay=s2.weight_decay,
            nesterov=s2.nesterov,
        )
        train_ds = ctx.bench.split(ctx.target, "train")
        self.val_loader = None
        if s2.outer == "val":  # every variant trains without the held-out outer split
            tr_idx, va_idx = split_val(len(train_ds), s2.val_fraction, ctx.seed)
            if self.uses_outer_split:
                self.val_loader = InfiniteLoader(
                    [Subset(train_ds, va_idx)], s2.batch_size, seeded(ctx.seed, 8)
                )
            train_ds = Subset(train_ds, tr_idx)
        self.loader = InfiniteLoader(
            [train_ds], s2.batch_size, seeded(ctx.seed, 4), num_workers=self.cfg.data.num_workers
        )
        self.aug, self.gumbel = seeded(ctx.seed, 5), seeded(ctx.seed, 6)
        self.views = Views(self.cfg.data.views, self.cfg.data.benchmark, self.aug)
        self.more_setup()
        return {
            "student": self.student,
            "labeler": self.labeler,
            "threshold": self.threshold,
            "opt": self.opt,
            "hyper_opt": getattr(getattr(self, "updater", None), "optimizer", None),
            "loader": self.loader,
            "val_loader": self.val_loader,
            "aug": self.aug,
            "gumbel": self.gumbel,
            "scaler": self.precision.scaler,
        }

    def more_setup(self) -> None:
        """Hook: stage-specific objects (built after the models, before checkpoint restore)."""

    def student_view(self, x: torch.Tensor) -> torch.Tensor:
        return self.views.strong(x) if self.s2.student_view == "strong" else self.views.weak(x)

    def loss(self, model: nn.Module, x: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor):
        """``(loss, sigma or None)`` of the student ``model`` on one batch."""
        s2 = self.s2
        return robust_loss(
            model, x, labels, mask, s2.hinge_lambda, s2.hinge_margin, LOG_EPS, s2.hinge_reduction
        )

    def sync_labeler(self) -> None:
        """Under torchrun without ``model.sync_bn``: rank 0's labeler running statistics
        everywhere (each rank updated them from its own rows)."""
        if self.env.active and not self.cfg.model.sync_bn:
            broadcast_buffers(self.labeler, self.env)

    def after_step(self, it: int, x: torch.Tensor, x_weak: torch.Tensor) -> None:
        """Hook: run after M_psi's optimizer step (EMA teacher, hyper step)."""

    def divergence_hint(self) -> str:
        return f"the step-2 lr ({self.lr:g}) too large, or a labeler that already diverged"

    def step(self, it: int, log: bool) -> dict[str, float] | None:
        dev = self.ctx.device
        xb, yb, _ = next(self.loader)  # yb: ground truth, used for analysis logs only
        x = prepare(xb, dev)
        x_weak = self.views.weak(x)
        x_student = self.student_view(x)
        with torch.no_grad():  # on the global batch (every rank): tau and masks agree everywhere
            labels, conf, pred = teacher_labels(
                self.labeler, x_weak, self.label_mode, self.s2.temperature, self.gumbel
            )
            mask = self.threshold(conf, pred)
        # this rank's rows under torchrun (rows is None in one process); ``mask`` stays the
        # global batch's (identical on every rank), the logs below use it
        rows, (x_student, x_weak, labels_local, mask_local) = self.shard(
            len(x), x_student, x_weak, labels, mask, what="step-2 batch"
        )
        loss, sigma = self.update(
            self.loss, x_student, labels_local.detach(), mask_local,
            rows=rows, batch_rows=len(x), after=lambda: self.after_step(it, x_student, x_weak),
        )  # fmt: skip
        if not log:
            return None
        return self.step_logs(loss, sigma, pred, yb.to(dev), mask, rows)

    def step_logs(
        self,
        loss: torch.Tensor,
        sigma: torch.Tensor | None,
        pred: torch.Tensor,
        truth: torch.Tensor,
        mask: torch.Tensor,
        rows: torch.Tensor | None,
    ) -> dict[str, float]:
        """The logged scalars of one iteration, each of the **global** batch.

        ``pred``, ``truth`` and ``mask`` are the global batch's (every rank computes them);
        ``loss`` and ``sigma`` are this rank's rows under torchrun: the loss is averaged over
        the ranks (a mean over equal-sized local batches) and sigma gathered back into the
        global order (:func:`bort2.dist.gather_rows`), so under torchrun every value is the
        one-process value (to rounding), and a local tensor is never indexed by a global mask.
        """
        correct = pred == truth
        m = mask.bool()
        logs = {
            "loss": mean_over_ranks({"loss": float(loss.detach())}, self.env, self.ctx.device)[
                "loss"
            ],
            "mask_rate": float(m.float().mean()),
            "pseudo_acc": float(correct.float().mean()),
            "pseudo_acc_masked": float(correct[m].float().mean()) if m.any() else float("nan"),
            "tau": float(torch.nan_to_num(self.threshold.threshold.float(), nan=1.0).mean()),
        }
        if sigma is not None:
            sigma = gather_rows(sigma.detach(), rows, len(pred), self.env)
            # mean_d log(sigma + 1e-7) of M_psi's step (train mode, student view): the outer
            # loss's argument, logged in Stages B and C alike
            logs["mean_log_sigma"] = float(torch.log(sigma + LOG_EPS).mean())
            s = sigma.mean(1)
            if correct.any():
                logs["sigma_correct"] = float(s[correct].mean())
            if (~correct).any():
                logs["sigma_wrong"] = float(s[~correct].mean())
        return logs

    def eval_model(self) -> nn.Module:
        return self.student

    def finish(self, history: dict[str, list[list[float]]], start: int) -> dict[str, Any]:
        test = self.ctx.bench.split(self.ctx.target, "test")
        acc = evaluate(self.labeler, test, self.ctx.device, self.cfg.data.max_test)
        return {"labeler_acc": acc["acc"], "hyper_steps": 0}


@register_stage("step2/naive")
class NaiveStage(Step2Stage):
    """Naive two-step: a plain copy of F_theta on argmax labels of the frozen F_theta."""

    @property
    def label_mode(self) -> str:
        return "argmax"

    def loss(self, model, x, labels, mask):
        return naive_loss(model, x, labels, mask), None


@register_stage("step2/robust")
class RobustStage(Step2Stage):
    """Stage B, "BORT2 w/o bi-level": robust training with an EMA labeler (mean teacher)."""

    def after_step(self, it, x, x_weak) -> None:
        if self.s2.teacher_ema > 0:
            ema_update(self.labeler, self.student, self.s2.teacher_ema)
            self.sync_labeler()

    def final_state(self) -> dict[str, Any]:
        return {
            "model": self.student.state_dict(),
            "classifier": self.student.classifier_state(),
            "labeler": self.labeler.state_dict(),
        }


@register_stage("step2/bort2")
class Bort2Stage(Step2Stage):
    """Stage C, BORT2: robust training of M_psi with bilevel updates of F_theta."""

    uses_outer_split = True

    @property
    def label_mode(self) -> str:
        """``step2.bort2_labels`` when set (the paper's Gumbel labels in the bilevel inner loop,
        Sec. 3.3.2), else ``step2.labels``."""
        return self.s2.bort2_labels or self.s2.labels

    def build_models(self) -> tuple[nn.Module, nn.Module]:
        start = bort2_start(self.cfg)  # step2.bort2_init: Stage B, or the step-1 labeler
        if SPECS[start].step == "step1":
            return super().build_models()
        path = self.ctx.input(start)
        expect = self.ctx.identity(start)  # that stage's final.pt of this unit and run
        labeler = load_labeler(self.cfg, path, self.nc, key="classifier", expect=expect)
        student = self.new_student(labeler)
        student.load_state_dict(load_checkpoint(path, expect)["model"])
        return labeler, student

    def more_setup(self) -> None:
        for p in self.labeler.parameters():
            p.requires_grad_(True)
        self.first_hyper = first_hyper_step(self.cfg)
        self.updater = BilevelLabelUpdater(
            self.student,
            self.labeler,
            self.threshold,
            self.s2,
            distributed="exact" if self.env.active else None,
        )
        self.hyper_time = 0.0
        self.hyper_timed = 0

    def after_step(self, it, x, x_weak) -> None:
        done, s2 = it + 1, self.s2
        if done < self.first_hyper or (done - self.first_hyper) % s2.hyper.every:
            return
        x_outer = None
        if self.val_loader is not None:
            xv, _, _ = next(self.val_loader)
            x_outer = self.student_view(prepare(xv, self.ctx.device))
            x_outer = take(x_outer, shard_rows(len(x_outer), 1, self.env, "outer batch"))
        try:
            info = self.updater(x, x_weak, self.gumbel, x_outer)
            self.sync_labeler()
        except hg.HypergradError as exc:  # e.g. a NaN hypergradient: name the stage and step
            raise TrainingDiverged(
                f"{self.name} [target {self.ctx.target}, seed {self.ctx.seed}]: the hyper step "
                f"at iteration {done} failed ({exc}); nothing of this stage was written. Likely "
                "cause: step2.hyper.lr or step2.hyper.alpha too large"
            ) from None
        self.hyper_time += info.time_s
        self.hyper_timed += 1
        # the outer loss and mean log sigma are this rank's rows' values: averaged over the
        # ranks (the global batch's mean log sigma; the outer loss the hypergradient averaged,
        # which is the global one unless step2.hyper.outer_relu clips a rank's half)
        local = mean_over_ranks(
            {"outer": info.outer_loss, "logsig": self.updater.last_mean_log_sigma},
            self.env,
            self.ctx.device,
        )
        self.pending_hyper_logs = {
            "hypergrad_norm": info.hypergrad_norm,
            "hyper_clipped": float(info.clipped),
            "hyper_direct_norm": info.direct_norm,
            "hyper_indirect_norm": info.indirect_norm,
            "hyper_residual": info.solve.residual,
            "hyper_diverged": float(info.solve.diverged),
            "hyper_stalled": float(bool(info.solve.extras.get("stalled", False))),
            "hyper_outer_loss": local["outer"],
            "hyper_outer_zero": float(local["outer"] == 0.0),
            "hyper_mean_log_sigma": local["logsig"],
            "hyper_time_s": info.time_s,
        }

    def step(self, it: int, log: bool) -> dict[str, float] | None:
        self.pending_hyper_logs = None
        logs = super().step(it, log)
        if self.pending_hyper_logs:
            logs = {**(logs or {}), **self.pending_hyper_logs}
        return logs

    def final_state(self) -> dict[str, Any]:
        return {"model": self.student.state_dict(), "labeler": self.labeler.state_dict()}

    def finish(self, history, start) -> dict[str, Any]:
        out = super().finish(history, start)
        diverged = [v for _, v in history.get("hyper_diverged", [])]  # whole run, across resumes
        zero = [v for _, v in history.get("hyper_outer_zero", [])]
        norms = [v for _, v in history.get("hypergrad_norm", [])]
        logsig = [v for _, v in history.get("hyper_mean_log_sigma", [])]
        out.update(
            labeler_init=self.s2.bort2_init,
            hyper_steps=len(diverged),
            hyper_diverged_steps=int(sum(diverged)),
            hyper_zero_outer_steps=int(sum(zero)),
            hypergrad_norm_median=float(np.median(norms)) if norms else None,
            mean_log_sigma_median=float(np.median(logsig)) if logsig else None,
            hyper_time_per_step_s=self.hyper_time / self.hyper_timed if self.hyper_timed else 0.0,
        )
        if self.env.main:
            atomic_save(
                {
                    "model": self.labeler.state_dict(),
                    IDENTITY_KEY: self.ctx.identity(self.name, "labeler_final"),
                },
                self.ctx.stage_dir / "labeler_final.pt",
            )
        return out


def split_val(n: int, fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of the training part and of the held-out outer split (seeded)."""
    perm = torch.randperm(n, generator=seeded(seed, 7))
    k = max(1, int(round(fraction * n)))
    return perm[k:].sort().values, perm[:k].sort().values


class Subset(torch.utils.data.Dataset):
    """A subset of an in-memory or on-disk domain that keeps fast tensor indexing."""

    def __init__(self, ds, idx: torch.Tensor):
        self.ds, self.idx = ds, idx
        if getattr(ds, "images", None) is not None:
            self.images, self.labels = ds.images[idx], ds.labels[idx]

    def __len__(self) -> int:
        return len(self.idx)

    def __getitem__(self, i: int):
        return self.ds[int(self.idx[i])]
