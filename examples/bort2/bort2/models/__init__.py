"""Classifiers of the BORT² example, all split as ``features(x) -> (N, D)`` + ``head``.

- :class:`DigitCNN`: M3SDA's Digit-Five CNN (``width`` scales it down for CPU runs).
- :class:`ResNetClassifier`: torchvision ResNets (local weights only).
- :class:`MixStyle`: feature-statistics mixing, optional in both networks.
- :class:`OfficialStochasticClassifier` (the authors' sigma branch) and
  :class:`StochasticClassifier` / :class:`StochasticLayer` (linear mu/sigma heads): BORT²'s
  stochastic target models, built by :func:`build_stochastic` for a kind in
  :data:`SIGMA_HEADS`; :func:`entropy_hinge`: the robustness term.
"""

from .digit_cnn import DigitCNN
from .mixstyle import MixStyle, has_mixstyle, make_mixstyle, sample_beta, set_mixstyle_domains
from .resnet import ResNetClassifier, load_state_dict_file
from .stochastic import (
    SIGMA_HEADS,
    OfficialStochasticClassifier,
    StochasticClassifier,
    StochasticLayer,
    build_stochastic,
    entropy_hinge,
)

__all__ = [
    "SIGMA_HEADS",
    "DigitCNN",
    "MixStyle",
    "OfficialStochasticClassifier",
    "ResNetClassifier",
    "StochasticClassifier",
    "StochasticLayer",
    "build_stochastic",
    "entropy_hinge",
    "has_mixstyle",
    "load_state_dict_file",
    "make_mixstyle",
    "sample_beta",
    "set_mixstyle_domains",
]
