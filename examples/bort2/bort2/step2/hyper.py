"""BORT2's hyper step: the bilevel update of the labeling function F_theta (Stage C).

Inner problem: M_psi minimises the robust loss (masked CE on sampled logits + lambda * hinge) on
labels ``Gumbel-softmax(F_theta(x_weak), tau=1, hard=True)``; outer problem: the mean log sigma
of M_psi (the authors: ``relu(mean log(sigma + 1e-7))``) on the same forward pass, or on a
held-out target split. The hypergradient of every F_theta parameter comes from
:class:`hypergrad.HyperStep`, is clipped at norm 50 and applied with SGD (lr 5e-5).

The authors' code makes three choices that a library would not; each is a switch here (a key of
``step2.hyper``, :class:`bort2.config.HyperConfig`, read as it is), and the defaults reproduce
the authors' update:

* ``convention="official"``: their Neumann code (from AuxiLearn) returns
  ``p = sum_{j=0..K} (I - alpha H)^j v`` **without** the factor alpha that the implicit-function
  theorem needs (:class:`AuthorsNeumann`), so their hypergradient is 1/alpha = 20,000 times the
  mathematically scaled one; its inner CE is written ``log(sum_c y_c p_c + 1e-10)``.
  ``"library"``: :class:`hypergrad.Neumann` (alpha-scaled, stops at a growing term) and the
  CE ``-sum_c y_c log p_c`` of :func:`hypergrad.soft_cross_entropy`.
* ``official_sign=True`` reproduces their ``+log p`` (a missing minus sign) in the inner CE
  of the hypergradient; the default ``False`` uses the true cross-entropy, which flips the
  direction of the update relative to theirs.
* ``outer_relu=True``: their outer loss has a ReLU; when mean log sigma <= 0 the outer loss and
  the hypergradient are exactly zero (counted by the pipeline). The paper's Eq. 7 has none.
* ``outer_reduction="mean"``: their outer loss averages log sigma over the feature dimensions;
  the paper's Eq. 7 sums over them (``1/|T| sum_i sum_d log sigma_id``): ``"sum"``.
  ``step2.hinge_reduction`` is the same choice for the hinge of the inner loss (the paper's
  Eq. 5).
* ``labeler_mode="train"``: their F_theta runs in train mode during the hyper step (BatchNorm on
  batch statistics, dropout active), and that step's forward passes update the running
  statistics of F_theta and M_psi once; ``"eval"`` keeps F_theta in eval mode and every buffer
  frozen.
* ``apply=False`` is a control, not the authors': the hypergradient is computed and reported but
  not applied, so F_theta changes only through the train-mode passes' BatchNorm statistics.

Random draws (dropout, the Gaussian sample, Gumbel noise) are shared by the inner and the outer
loss and by every Hessian-vector product: both losses replay the same seeds, as the authors'
single forward pass does.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import hypergrad as hg
from hypergrad.labels import gumbel_softmax_labels
from hypergrad.solvers.base import MatVec, SolveInfo, Solver
from hypergrad.tree import Tensors, tree_axpy, tree_norm, tree_zeros_like

from ..config import HyperConfig, Step2Config, check_fields
from ..dist import rowwise
from .losses import REDUCTIONS, hinge

LOG_EPS = 1e-7  # the authors' log(sigma + 1e-7) in the hinge and the outer loss


@dataclass
class AuthorsNeumann(Solver):
    """The authors' (AuxiLearn's) truncated Neumann series, kept for fidelity.

    Returns ``p = sum_{j=0..steps} (I - alpha A)^j b`` — the series **without** the factor
    ``alpha`` of :class:`hypergrad.Neumann`, so ``p ~ A^{-1} b / alpha`` — and sums every term
    even when they grow (the authors' code does). ``SolveInfo.diverged`` reports growth honestly;
    ``converged`` is always False (``p`` is not a solution of ``A x = b``), and ``residual`` is
    the relative norm of the last term.

    Args:
        steps: Hessian-vector products K (K + 1 terms; the authors use 3).
        alpha: step inside the series (the authors' ``METALEARN.LR``, 5e-5).
    """

    steps: int = 3
    alpha: float = 5e-5
    name = "neumann-auxilearn"

    def __post_init__(self) -> None:
        if not isinstance(self.steps, int) or self.steps < 0:
            raise ValueError(f"steps must be an int >= 0, got {self.steps!r}")
        if not (self.alpha > 0 and math.isfinite(self.alpha)):
            raise ValueError(f"alpha must be a finite number > 0, got {self.alpha!r}")

    def solve(
        self, matvec: MatVec, b: Tensors, x0: Tensors | None = None
    ) -> tuple[Tensors, SolveInfo]:
        if x0 is not None:
            raise ValueError("AuthorsNeumann takes no warm start")
        info = SolveInfo(solver=self.name, alpha=float(self.alpha))
        b_norm = float(tree_norm(b))
        info.extras.update(b_norm=b_norm, scale="1/alpha")
        if b_norm == 0.0:  # e.g. a zero outer loss under the ReLU: p = 0
            info.residual = 0.0
            return tree_zeros_like(b), info
        v, p, smallest = b, b, b_norm
        for _ in range(self.steps):
            v = tree_axpy(-self.alpha, matvec(v), v)
            p = tuple(pi + vi for pi, vi in zip(p, v))
            info.iterations += 1
            info.matvecs += 1
            norm = float(tree_norm(v))
            info.residuals.append(norm / b_norm)
            if not math.isfinite(norm) or norm > smallest * (1.0 + 1e-6):
                info.diverged = True
            smallest = min(smallest, norm)
        info.residual = info.residuals[-1] if info.residuals else 1.0
        return p, info


def hyper_solver(hyper: HyperConfig) -> Solver:
    """The Neumann solver of ``step2.hyper.convention``, ``steps`` Hessian-vector products."""
    if hyper.convention == "official":
        return AuthorsNeumann(steps=hyper.steps, alpha=hyper.alpha)
    return hg.Neumann(maxiter=hyper.steps, alpha=hyper.alpha)


@contextlib.contextmanager
def replay(seed: int, device: torch.device) -> Iterator[None]:
    """Run the block with the global RNG seeded by ``seed``, restoring the RNG afterwards."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def current_mask(threshold: nn.Module, conf: torch.Tensor, pred: torch.Tensor) -> torch.Tensor:
    """``conf >= tau`` with the threshold's current tau (not updated; per-class tau by ``pred``;
    a class without a tau yet is masked out)."""
    tau = threshold.threshold.to(conf.device)
    if tau.numel() > 1:
        tau = tau[pred]
    return conf >= tau.to(conf.dtype)


def authors_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, sign: float
) -> torch.Tensor:
    """``mean_i mask_i * sign * log(sum_c y_ic softmax(logits)_ic + 1e-10)``.

    ``sign=-1`` is the cross-entropy; ``sign=+1`` the authors' ``cross_entropy_bp_to_onehot``.
    """
    picked = (labels * logits.softmax(dim=1)).sum(dim=1)
    return (sign * torch.log(picked + 1e-10) * mask.to(logits.dtype)).mean()


def outer_log_sigma(sigma: torch.Tensor, relu: bool, reduction: str = "mean") -> torch.Tensor:
    """The outer loss: mean log(sigma + 1e-7), through a ReLU when ``relu`` (the authors').

    ``reduction="sum"`` sums over the feature dimensions and averages over the batch, the
    paper's Eq. 7 (``1/|T| sum_i sum_d log sigma_id``; D times the mean).
    """
    if reduction == "mean":
        value = torch.log(sigma + LOG_EPS).mean()
    elif reduction == "sum":
        value = torch.log(sigma + LOG_EPS).sum(dim=1).mean()
    else:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    return F.relu(value) if relu else value


def mean_log_sigma(sigma: torch.Tensor) -> float:
    """The outer loss before its ReLU (logged: it says how far from zero the loss is)."""
    return float(torch.log(sigma.detach() + LOG_EPS).mean())


class BilevelLabelUpdater:
    """Owns the :class:`hypergrad.HyperStep` and the SGD optimizer of F_theta.

    Args:
        student: M_psi (a stochastic classifier with ``forward_with_sigma``): the inner
            parameters.
        labeler: F_theta (all of its trainable parameters are the hyperparameters).
        threshold: the stage's threshold module; its current tau masks the hyper step's labels.
        s2: the ``step2`` configuration (:class:`~bort2.config.Step2Config`): its ``hyper``
            section, and the inner loss's ``hinge_lambda``, ``hinge_margin``,
            ``hinge_reduction`` and Gumbel ``temperature``; checked against the keys'
            declarations (a :class:`~bort2.config.ConfigError` names a bad value).
        distributed: ``"exact"`` under torchrun (every product all-reduced: the hypergradient of
            the global batch, see :mod:`hypergrad.distributed`), None in one process.
    """

    def __init__(
        self,
        student: nn.Module,
        labeler: nn.Module,
        threshold: nn.Module,
        s2: Step2Config,
        distributed: str | None = None,
    ):
        check_fields(s2, "step2")
        self.student, self.labeler, self.threshold = student, labeler, threshold
        self.s2, self.h = s2, s2.hyper
        self.last_mean_log_sigma = float("nan")  # the latest outer loss before the ReLU
        self.optimizer = torch.optim.SGD(labeler.parameters(), lr=self.h.lr)
        self.step = hg.HyperStep(
            inner=student,
            hyper=labeler,
            inner_loss=self._inner,
            outer_loss=self._outer,
            solver=hyper_solver(self.h),
            buffers="freeze",
            clip_norm=self.h.clip,
            on_diverged="write",  # the authors apply every hyper step; growth is counted instead
            distributed=distributed,
        )

    # -- the two losses, both replaying the seeds stored in the batch
    def _labels(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        with replay(batch["seed_f"], batch["x_weak"].device):
            logits = self.labeler(batch["x_weak"])
        conf, pred = logits.detach().softmax(1).max(1)
        mask = current_mask(self.threshold, conf, pred)
        gen = batch["generator"]
        if gen is not None:
            gen.set_state(batch["gumbel_state"])
        labels = rowwise(  # under torchrun: this rank's rows of the global batch's Gumbel draw
            logits,
            lambda z: gumbel_softmax_labels(z, self.s2.temperature, hard=True, generator=gen),
        )
        return labels, mask

    def _student(self, model: nn.Module, x: torch.Tensor, seed: int):
        with replay(seed, x.device):
            return model.forward_with_sigma(x)

    def _inner(self, model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        labels, mask = self._labels(batch)
        logits, sigma = self._student(model, batch["x"], batch["seed_m"])
        h, s2 = self.h, self.s2
        if h.convention == "official":
            ce = authors_cross_entropy(logits, labels, mask, 1.0 if h.official_sign else -1.0)
        else:
            ce = hg.soft_cross_entropy(logits, labels, mask)
            ce = -ce if h.official_sign else ce
        return ce + s2.hinge_lambda * hinge(sigma, s2.hinge_margin, LOG_EPS, s2.hinge_reduction)

    def _outer(self, model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        _, sigma = self._student(model, batch["x"], batch["seed_m"])
        self.last_mean_log_sigma = mean_log_sigma(sigma)
        return outer_log_sigma(sigma, self.h.outer_relu, self.h.outer_reduction)

    def batches(
        self,
        x: torch.Tensor,
        x_weak: torch.Tensor,
        generator: torch.Generator | None = None,
        x_outer: torch.Tensor | None = None,
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """The inner and outer batches of one hyper step: the inputs, and the seeds of the
        replayed forward passes drawn from ``generator`` (which then draws the Gumbel noise)."""
        seeds = torch.randint(0, 2**62, (3,), generator=generator).tolist()
        batch = {
            "x": x,
            "x_weak": x_weak,
            "seed_f": seeds[0],
            "seed_m": seeds[1],
            "generator": generator,
            "gumbel_state": None if generator is None else generator.get_state(),
        }
        outer_batch = None if x_outer is None else {"x": x_outer, "seed_m": seeds[2]}
        return batch, outer_batch

    def __call__(
        self,
        x: torch.Tensor,
        x_weak: torch.Tensor,
        generator: torch.Generator | None = None,
        x_outer: torch.Tensor | None = None,
    ) -> hg.HypergradInfo:
        """One hyper step on a batch (M_psi's input ``x``, F_theta's ``x_weak``).

        ``generator`` draws the Gumbel noise and the seeds of the replayed forward passes.
        Returns the hypergradient diagnostics; a growing or stalled Neumann series is not warned
        about at every step: it is in ``info.solve`` (``diverged``, ``extras["stalled"]``),
        logged and counted by the pipeline.
        """
        batch, outer_batch = self.batches(x, x_weak, generator, x_outer)
        train = self.h.labeler_mode == "train"
        was = self.labeler.training
        self.labeler.train(train)
        try:
            self.optimizer.zero_grad(set_to_none=True)
            with warnings.catch_warnings():  # in info.solve, logged and counted per stage
                warnings.simplefilter("ignore", hg.SolverDivergedWarning)
                warnings.simplefilter("ignore", hg.SolverStalledWarning)
                info = self.step(batch, outer_batch)
            if train:  # the authors' forward passes update the running statistics once
                with torch.no_grad():
                    with replay(batch["seed_f"], x_weak.device):
                        self.labeler(x_weak)
                    self._student(self.student, x, batch["seed_m"])
        finally:
            self.labeler.train(was)
        if self.h.apply:
            self.optimizer.step()
        return info
