"""Common interface of the step-1 (labeling function) multi-source domain adaptation methods.

A method wraps a classifier (``features``/``head``/``forward``, see :mod:`bort2.models`) and
turns one :class:`Step1Batch` into a scalar loss plus a dict of logged floats. Domains are
indexed ``0 .. num_domains - 1`` for the sources; the target is domain ``num_domains`` (this is
the label given to MixStyle's cross-domain pairing).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import nn

from ..models.mixstyle import set_mixstyle_domains


@dataclass
class Step1Batch:
    """One training batch of step 1.

    Attributes:
        src_x: Weak-augmented source images, float (N, 3, H, W).
        src_y: Source labels, int64 (N,).
        src_d: Source domain indices in ``[0, num_domains)``, int64 (N,).
        src_strong: Strong view of the same source images, float (N, 3, H, W), or None (needed
            by the official FixMatch-CM, which pseudo-labels and CutMixes the source too).
        tgt_weak: Weak view of unlabelled target images, float (M, 3, H, W), or None.
        tgt_strong: Strong view of the same target images, float (M, 3, H, W), or None.
    """

    src_x: torch.Tensor
    src_y: torch.Tensor
    src_d: torch.Tensor
    src_strong: torch.Tensor | None = None
    tgt_weak: torch.Tensor | None = None
    tgt_strong: torch.Tensor | None = None

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Step1Batch:
        """A copy with every tensor moved to ``device``."""
        kwargs = {}
        for f in fields(self):
            v = getattr(self, f.name)
            kwargs[f.name] = None if v is None else v.to(device, non_blocking=non_blocking)
        return Step1Batch(**kwargs)


class Step1Method(nn.Module):
    """Base class: owns ``model`` (and any auxiliary modules such as discriminators).

    Subclasses implement :meth:`loss`. ``parameters()`` covers the model and the auxiliary
    modules, so one optimizer over ``method.parameters()`` trains everything.

    What the pipeline needs to know about a method is declared on its class (and read by
    :class:`bort2.step1.stage.Step1Stage`, which never tests a method's name):

    Attributes:
        name: the method's name in ``step1.methods`` (its stage is ``step1/<name>``, with a row
            in :data:`bort2.stages_index.SPECS`).
        uses_mixstyle: the model is built with MixStyle.
        needs_strong_target: the batch carries a strong view of the target images.
        rows_of_single_pass: the loss is one forward pass over the source rows, whose random
            draws (dropout) are made for the global batch under torchrun.

    Args:
        model: Classifier with ``features(x)``, ``head(h)`` and ``feature_dim``.
        num_domains: Number of source domains K (the target is domain K).
    """

    name: str = ""
    uses_mixstyle: bool = False
    needs_strong_target: bool = False
    rows_of_single_pass: bool = False

    @classmethod
    def config_kwargs(cls, s1) -> dict:
        """Constructor settings from the ``step1`` config section (none by default)."""
        return {}

    @classmethod
    def from_config(cls, model: nn.Module, num_domains: int, s1) -> Step1Method:
        """The method on ``model`` with its settings from the ``step1`` config section."""
        return cls(model, num_domains, **cls.config_kwargs(s1))

    @property
    def needs_strong_source(self) -> bool:
        """The batch carries a strong view of the source images."""
        return False

    def __init__(self, model: nn.Module, num_domains: int):
        super().__init__()
        self.model = model
        self.num_domains = int(num_domains)
        self.progress = 0.0

    @property
    def target_domain(self) -> int:
        """Domain index used for target images."""
        return self.num_domains

    def set_progress(self, p: float) -> None:
        """Training progress in [0, 1] (used by schedules, e.g. DANN's reversal coefficient)."""
        self.progress = float(min(max(p, 0.0), 1.0))

    def _target_domains(self, m: int, like: torch.Tensor) -> torch.Tensor:
        return torch.full((m,), self.target_domain, dtype=torch.long, device=like.device)

    def features(self, x: torch.Tensor, domains: torch.Tensor | None = None) -> torch.Tensor:
        """``model.features(x)`` with ``domains`` given to the model's MixStyle modules."""
        set_mixstyle_domains(self.model, domains)
        try:
            return self.model.features(x)
        finally:
            set_mixstyle_domains(self.model, None)

    def logits(self, x: torch.Tensor, domains: torch.Tensor | None = None) -> torch.Tensor:
        """``model(x)`` with ``domains`` given to the model's MixStyle modules."""
        return self.model.head(self.features(x, domains))

    def loss(self, batch: Step1Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """Return the scalar training loss and a dict of logged floats."""
        raise NotImplementedError

    @torch.no_grad()
    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of the model in evaluation mode (the previous mode is restored)."""
        was_training = self.model.training
        self.model.eval()
        try:
            return self.model(x)
        finally:
            self.model.train(was_training)


def require_target(batch: Step1Batch, strong: bool = False) -> None:
    """Raise a clear error when a method needs target views the batch lacks."""
    if batch.tgt_weak is None or (strong and batch.tgt_strong is None):
        need = "tgt_weak and tgt_strong" if strong else "tgt_weak"
        raise ValueError(f"this step-1 method needs {need} in the batch")
