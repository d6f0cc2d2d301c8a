"""torchvision ResNets split into ``features`` and ``head``, with optional MixStyle after layer1.

Networks are always built with ``weights=None`` (nothing is downloaded). Pretrained weights
come from a local file given as ``weights_path``: either a torchvision ResNet state dict (e.g.
the ImageNet checkpoint ``resnet18-f37072fd.pth``; its ``fc.*`` entries are dropped because the
head is re-created for ``num_classes``) or a state dict saved from a
:class:`ResNetClassifier` itself (keys starting with ``backbone.``/``head.``). A ``module.``
prefix (DataParallel checkpoints) is stripped.

:meth:`ResNetClassifier.features_with_map` also returns the ``layer4`` feature map, the input
of BORT²'s official sigma branch.
"""

from __future__ import annotations

import os

import torch
import torchvision
from torch import nn

from .mixstyle import MixStyle, make_mixstyle

_ARCHS = ("resnet18", "resnet34", "resnet50", "resnet101")


def load_state_dict_file(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Load a local state dict with ``weights_only=True``; clear error when it is missing."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"pretrained weights file not found: {path!r}. Nothing is downloaded at run time: "
            "save a torchvision ResNet state dict (e.g. ImageNet resnet18/resnet50 weights) to "
            "this path, or leave weights_path unset to train from scratch."
        )
    state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise ValueError(f"{path!r} does not hold a state dict (got {type(state).__name__})")
    return {k.removeprefix("module."): v for k, v in state.items()}


class ResNetClassifier(nn.Module):
    """A torchvision ResNet with a fresh linear head.

    Args:
        arch: ``"resnet18"``, ``"resnet34"``, ``"resnet50"`` or ``"resnet101"``.
        num_classes: Number of output classes.
        weights_path: Optional local state dict file (see the module docstring).
        mixstyle: MixStyle after ``layer1``: ``None``/``False``, ``True``, a dict of MixStyle
            kwargs or a :class:`MixStyle` instance.
    """

    def __init__(
        self,
        arch: str = "resnet18",
        num_classes: int = 7,
        weights_path: str | os.PathLike | None = None,
        mixstyle: MixStyle | bool | dict | None = None,
    ):
        super().__init__()
        if arch not in _ARCHS:
            raise ValueError(f"unknown arch {arch!r}; valid: {list(_ARCHS)}")
        self.arch = arch
        self.num_classes = int(num_classes)
        backbone = getattr(torchvision.models, arch)(weights=None)
        self.feature_dim = int(backbone.fc.in_features)
        backbone.fc = nn.Identity()
        self.backbone = backbone
        self.mixstyle = make_mixstyle(mixstyle)
        self.head = nn.Linear(self.feature_dim, num_classes)
        if weights_path is not None:
            self.load_weights(weights_path)

    def load_weights(self, path: str | os.PathLike) -> None:
        """Load a torchvision ResNet or ResNetClassifier state dict from a local file."""
        state = load_state_dict_file(path)
        if any(k.startswith("backbone.") for k in state):
            self.load_state_dict(state, strict=True)
            return
        state = {k: v for k, v in state.items() if not k.startswith("fc.")}
        missing, unexpected = self.backbone.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(
                f"{os.fspath(path)!r} is not a {self.arch} state dict: "
                f"missing {missing[:5]}..., unexpected {unexpected[:5]}..."
            )

    def features_with_map(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Globally pooled features and the ``layer4`` feature map they are pooled from.

        Args:
            x: Images (N, 3, H, W).

        Returns:
            ``(h, fmap)``: ``h`` (N, feature_dim) as :meth:`features` returns it, and ``fmap``
            (N, feature_dim, H', W'), the output of ``layer4`` (7x7 for 224-px input).
        """
        b = self.backbone
        x = b.maxpool(b.relu(b.bn1(b.conv1(x))))
        x = self.mixstyle(b.layer1(x))
        fmap = b.layer4(b.layer3(b.layer2(x)))
        return torch.flatten(b.avgpool(fmap), 1), fmap

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Globally pooled features (N, feature_dim) of images (N, 3, H, W)."""
        return self.features_with_map(x)[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits (N, num_classes)."""
        return self.head(self.features(x))
