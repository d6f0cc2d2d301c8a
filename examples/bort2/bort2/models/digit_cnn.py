"""The Digit-Five CNN of M3SDA (Peng et al., ICCV 2019) as Dassl defines it.

At ``width=1.0`` and 32x32 input the layers are exactly those of M3SDA/Dassl's
``cnn_digit5_m3sda``::

    conv5x5(3->64, pad 2) + BN + ReLU + maxpool(3, stride 2, pad 1)      -> 64 x 16 x 16
    [MixStyle, optional]
    conv5x5(64->64, pad 2) + BN + ReLU + maxpool(3, stride 2, pad 1)     -> 64 x 8 x 8
    conv5x5(64->128, pad 2) + BN + ReLU                                  -> 128 x 8 x 8
    flatten (8192) -> FC 3072 + BN1d + ReLU + dropout 0.5 -> FC 2048 + BN1d + ReLU   (features)
    head: Linear(2048, num_classes)

``width`` scales every channel and unit count (rounded, at least 1). Parameter counts with
10 classes and 32x32 input: width=1.0 -> 31,805,898; width=0.5 -> 7,961,834;
width=0.25 -> 1,995,642 (the fast CPU variant).

:meth:`DigitCNN.features_with_fc1` also returns the post-dropout activation of the first fully
connected layer (``fc1_dim`` units), the input of BORT²'s official sigma branch.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..dist import RowDropout
from .mixstyle import MixStyle, make_mixstyle


def _scaled(n: int, width: float) -> int:
    return max(1, int(round(n * width)))


# ``fc[:_FC1_END]`` = flatten, FC1, BN1d, ReLU, dropout; ``fc[_FC1_END:]`` = FC2, BN1d, ReLU.
_FC1_END = 5


def _conv_block(c_in: int, c_out: int, pool: bool) -> nn.Sequential:
    layers: list[nn.Module] = [
        nn.Conv2d(c_in, c_out, kernel_size=5, stride=1, padding=2),
        nn.BatchNorm2d(c_out),
        nn.ReLU(inplace=True),
    ]
    if pool:
        layers.append(nn.MaxPool2d(kernel_size=3, stride=2, padding=1))
    return nn.Sequential(*layers)


class DigitCNN(nn.Module):
    """M3SDA's Digit-Five CNN, split into ``features`` and ``head``.

    Args:
        num_classes: Number of output classes.
        width: Multiplier of every channel/unit count (1.0 = the published network).
        mixstyle: MixStyle after the first conv block: ``None``/``False`` (none), ``True``
            (default MixStyle), a dict of MixStyle kwargs or a :class:`MixStyle` instance.
        image_size: Input side S; the flattened size is ``128 * width * ceil(S/4)**2``.
        dropout: Dropout probability after the first fully connected layer.
    """

    def __init__(
        self,
        num_classes: int = 10,
        width: float = 1.0,
        mixstyle: MixStyle | bool | dict | None = None,
        image_size: int = 32,
        dropout: float = 0.5,
    ):
        super().__init__()
        c1, c2, c3 = _scaled(64, width), _scaled(64, width), _scaled(128, width)
        f1, f2 = _scaled(3072, width), _scaled(2048, width)
        side = math.ceil(math.ceil(image_size / 2) / 2)
        self.num_classes = int(num_classes)
        self.width = float(width)
        self.image_size = int(image_size)
        self.block1 = _conv_block(3, c1, pool=True)
        self.mixstyle = make_mixstyle(mixstyle)
        self.block2 = _conv_block(c1, c2, pool=True)
        self.block3 = _conv_block(c2, c3, pool=False)
        self.fc = nn.Sequential(
            nn.Flatten(),
            nn.Linear(c3 * side * side, f1),
            nn.BatchNorm1d(f1),
            nn.ReLU(inplace=True),
            RowDropout(dropout),
            nn.Linear(f1, f2),
            nn.BatchNorm1d(f2),
            nn.ReLU(inplace=True),
        )
        self.fc1_dim = f1
        self.feature_dim = f2
        self.head = nn.Linear(f2, num_classes)

    def features_with_fc1(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Penultimate features and the first FC layer's post-dropout activation.

        Args:
            x: Images (N, 3, S, S).

        Returns:
            ``(h, a1)``: ``h`` (N, feature_dim) exactly as :meth:`features` computes it (same
            operations, same dropout draw), and ``a1`` (N, fc1_dim), the output of
            FC1 + BN1d + ReLU + dropout, i.e. the input of the second linear layer.
        """
        x = self.block1(x)
        x = self.mixstyle(x)
        x = self.block3(self.block2(x))
        a1 = x
        for layer in self.fc[:_FC1_END]:
            a1 = layer(a1)
        h = a1
        for layer in self.fc[_FC1_END:]:
            h = layer(h)
        return h, a1

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Penultimate features (N, feature_dim) of images (N, 3, S, S)."""
        return self.features_with_fc1(x)[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits (N, num_classes)."""
        return self.head(self.features(x))
