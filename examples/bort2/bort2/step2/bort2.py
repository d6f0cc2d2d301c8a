"""BORT2's bilevel update of the labeling function F_theta through ``hypergrad.HyperStep``.

Inner problem: the target model M_psi minimises the robust loss on labels
``Gumbel-softmax(F_theta(x_weak), tau=1, hard=True)``; outer problem: the mean log sigma of M_psi
(on the same batch, or on a held-out target split). The hypergradient of every F_theta parameter
is computed by a truncated Neumann series (3 terms, alpha=5e-5), clipped at norm 50 and applied
with SGD (lr 5e-5) every 30 inner iterations after the warm-up.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

import hypergrad as hg

from .losses import robust_loss, teacher_labels


def outer_log_sigma(student: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The outer loss: mean log sigma of the stochastic layer (the model's uncertainty)."""
    _, sigma = student.forward_with_sigma(x)
    return sigma.log().mean()


class BilevelLabelUpdater:
    """Owns the HyperStep and the SGD optimizer of F_theta.

    Args:
        student: M_psi (a StochasticClassifier) — the inner parameters.
        labeler: F_theta — the hyperparameters (all of its trainable parameters).
        hinge_lambda, margin: the robust loss's weight and margin.
        temperature: Gumbel-softmax temperature.
        neumann_steps, neumann_alpha: the Neumann solver.
        lr: SGD learning rate of F_theta.
        clip: hypergradient norm clip.
    """

    def __init__(
        self,
        student: nn.Module,
        labeler: nn.Module,
        hinge_lambda: float = 0.1,
        margin: float = 4.0,
        temperature: float = 1.0,
        neumann_steps: int = 3,
        neumann_alpha: float = 5e-5,
        lr: float = 5e-5,
        clip: float = 50.0,
    ):
        self.labeler = labeler
        self.optimizer = torch.optim.SGD(labeler.parameters(), lr=lr)

        def inner(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
            labels, _, _ = teacher_labels(
                labeler, batch["x_weak"], "gumbel", temperature, batch.get("generator")
            )
            return robust_loss(model, batch["x"], labels, batch["mask"], hinge_lambda, margin)[0]

        def outer(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
            return outer_log_sigma(model, batch["x"])

        self.step = hg.HyperStep(
            inner=student,
            hyper=labeler,
            inner_loss=inner,
            outer_loss=outer,
            solver=hg.Neumann(steps=neumann_steps, alpha=neumann_alpha),
            buffers="freeze",
            clip_norm=clip,
        )

    def __call__(
        self,
        x: torch.Tensor,
        x_weak: torch.Tensor,
        mask: torch.Tensor,
        x_outer: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> hg.HypergradInfo:
        """One hyper step on a batch; returns the hypergradient diagnostics.

        A diverging Neumann series (the step-2 Hessian is not positive definite in general) is
        not warned about at every step: it is reported in ``info.solve.diverged`` and logged
        (``hyper_diverged``) by the engine, which also counts such steps in its metrics.
        """
        batch = {"x": x, "x_weak": x_weak, "mask": mask, "generator": generator}
        outer_batch = None if x_outer is None else {"x": x_outer}
        self.optimizer.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", hg.SolverDivergedWarning)
            info = self.step(batch, outer_batch)
        self.optimizer.step()
        return info
