"""Classifiers of the BORT² example, all split as ``features(x) -> (N, D)`` + ``head``.

- :class:`DigitCNN`: M3SDA's Digit-Five CNN (``width`` scales it down for CPU runs).
- :class:`ResNetClassifier`: torchvision ResNets (local weights only).
- :class:`MixStyle`: feature-statistics mixing, optional in both networks.
- :class:`StochasticClassifier` / :class:`StochasticLayer` / :func:`entropy_hinge`: BORT²'s
  stochastic target model and robustness term.
"""

from .digit_cnn import DigitCNN
from .mixstyle import MixStyle, has_mixstyle, make_mixstyle, sample_beta, set_mixstyle_domains
from .resnet import ResNetClassifier, load_state_dict_file
from .stochastic import StochasticClassifier, StochasticLayer, entropy_hinge

__all__ = [
    "DigitCNN",
    "MixStyle",
    "ResNetClassifier",
    "StochasticClassifier",
    "StochasticLayer",
    "entropy_hinge",
    "has_mixstyle",
    "load_state_dict_file",
    "make_mixstyle",
    "sample_beta",
    "set_mixstyle_domains",
]
