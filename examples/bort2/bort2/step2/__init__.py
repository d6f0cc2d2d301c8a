"""Step 2 of BORT2: train a target model M_psi on pseudo-labelled target data only.

* ``naive``: hard pseudo-labels from the frozen step-1 model, confidence threshold, a plain copy
  of the network (:func:`naive_loss`).
* ``robust`` (Stage B, the paper's "BORT2 w/o bi-level optimization"): the stochastic Gaussian
  layer and the entropy hinge (:func:`robust_loss`), labels from a labeler that becomes an EMA
  of M_psi after every step (``step2.teacher_ema``).
* ``bort2`` (Stage C): started from Stage B's target model, robust training plus bilevel
  updates of the labeling function F_theta (:class:`BilevelLabelUpdater`).

The stages themselves (:mod:`bort2.step2.stages`) register with :mod:`bort2.trainer`.
"""

from .hyper import (
    AuthorsNeumann,
    BilevelLabelUpdater,
    authors_cross_entropy,
    current_mask,
    hyper_solver,
    outer_log_sigma,
)
from .losses import (
    build_student,
    build_threshold,
    naive_loss,
    plain_copy,
    robust_loss,
    teacher_labels,
)

__all__ = [
    "AuthorsNeumann",
    "BilevelLabelUpdater",
    "authors_cross_entropy",
    "build_student",
    "build_threshold",
    "current_mask",
    "hyper_solver",
    "naive_loss",
    "outer_log_sigma",
    "plain_copy",
    "robust_loss",
    "teacher_labels",
]
