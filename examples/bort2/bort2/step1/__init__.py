"""Step 1 of BORT²: train a labeling function with a one-step MSDA method.

Every method is a :class:`Step1Method` with ``loss(batch) -> (loss, logs)`` and
``predict(x) -> logits``: :class:`SourceOnly`, :class:`FixMatch`, :class:`FixMatchCM` (the
default; ``variant="official"`` is the authors' loss, ``"mixed"`` this project's earlier one),
:class:`DANN` and :class:`M3SDA`. :mod:`bort2.step1.stage` turns each into a pipeline stage.
"""

from .base import Step1Batch, Step1Method
from .cutmix import CutMixResult, cutmix
from .dann import DANN, GradReverse, grad_reverse, grl_schedule
from .fixmatch import FixMatch, FixMatchCM
from .m3sda import M3SDA, moment_distance
from .source_only import SourceOnly

#: every step-1 method by its name (each class declares its own ``name``)
METHODS: dict[str, type[Step1Method]] = {
    cls.name: cls for cls in (SourceOnly, FixMatch, FixMatchCM, DANN, M3SDA)
}

__all__ = [
    "DANN",
    "M3SDA",
    "METHODS",
    "CutMixResult",
    "FixMatch",
    "FixMatchCM",
    "GradReverse",
    "SourceOnly",
    "Step1Batch",
    "Step1Method",
    "cutmix",
    "grad_reverse",
    "grl_schedule",
    "moment_distance",
]
