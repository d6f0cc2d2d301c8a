"""Step 2 of BORT2: train a target model M_psi on pseudo-labelled target data only.

* ``naive``: hard pseudo-labels from the frozen step-1 model, confidence threshold, a plain copy
  of the network (:func:`naive_loss`).
* ``robust``: the stochastic Gaussian layer and the entropy hinge, no bilevel updates — the
  paper's "BORT2 w/o bi-level optimization" (:func:`robust_loss`).
* ``bort2``: robust training plus bilevel updates of the labeling function F_theta through
  :class:`hypergrad.HyperStep` (:class:`BilevelLabelUpdater`).
"""

from .bort2 import BilevelLabelUpdater, outer_log_sigma
from .losses import (
    build_student,
    build_threshold,
    naive_loss,
    robust_loss,
    teacher_labels,
)

__all__ = [
    "BilevelLabelUpdater",
    "build_student",
    "build_threshold",
    "naive_loss",
    "outer_log_sigma",
    "robust_loss",
    "teacher_labels",
]
