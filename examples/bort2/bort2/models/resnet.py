"""torchvision ResNets split into ``features`` and ``head``, with optional MixStyle.

MixStyle (when asked for) follows ``layer1`` and ``layer2``, as in the BORT² authors'
``resnet*_ms`` backbones (Zhongying-Deng/BORT2, ``dassl/modeling/backbone/resnet_mixstyle.py``:
``ibn_cfg=('a', 'a', None, None)``, one MixStyle module after each of the first two stages);
``mixstyle_layers`` picks other stages.

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
from collections.abc import Sequence

import torch
import torchvision
from torch import nn

from .mixstyle import MixStyle, make_mixstyle

_ARCHS = ("resnet18", "resnet34", "resnet50", "resnet101")
_STAGES = ("layer1", "layer2", "layer3", "layer4")
#: where MixStyle goes by default: after layer1 and layer2 (the authors' ``resnet*_ms``)
MIXSTYLE_LAYERS: tuple[str, ...] = ("layer1", "layer2")


def load_state_dict_file(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Load a local state dict with ``weights_only=True``; clear error when it is missing."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"pretrained weights file not found: {path!r}. Nothing is downloaded at run time: "
            "save a torchvision ResNet state dict (e.g. ImageNet resnet18/resnet50 weights) to "
            "this path, or leave weights_path unset to train from scratch."
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # random bytes, a text file, a truncated zip, foreign pickles
        raise ValueError(
            f"{path!r} is not a PyTorch weights file ({_load_reason(exc)}); expected a state "
            "dict saved with torch.save, e.g. torchvision's resnet18-f37072fd.pth"
        ) from None
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise ValueError(
            f"{path!r} does not hold a state dict of tensors (got {type(state).__name__})"
        )
    return {k.removeprefix("module."): v for k, v in state.items()}


def _load_reason(exc: BaseException) -> str:
    """Why ``torch.load`` failed, in a few words (never its weights_only advice)."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    if "weights_only" in text or "Weights only load failed" in text:
        return "it holds Python objects that a weights-only load refuses to build"
    if isinstance(exc, (IndexError, KeyError, EOFError)) or not first:
        return f"unreadable as a torch.save file: {type(exc).__name__}"
    return f"{type(exc).__name__}: {first}"


def check_weights_file(path: str | os.PathLike, arch: str) -> None:
    """Raise ``ValueError`` (``FileNotFoundError``) with one line when ``path`` is not a
    weights file that :meth:`ResNetClassifier.load_weights` can load into ``arch``; what the
    command line checks before anything is written."""
    state = load_state_dict_file(path)
    head = state.get("head.weight")
    classes = int(head.shape[0]) if isinstance(head, torch.Tensor) and head.dim() == 2 else 1
    ResNetClassifier(arch, classes).load_state(state, path)


class ResNetClassifier(nn.Module):
    """A torchvision ResNet with a fresh linear head.

    Args:
        arch: ``"resnet18"``, ``"resnet34"``, ``"resnet50"`` or ``"resnet101"``.
        num_classes: Number of output classes.
        weights_path: Optional local state dict file (see the module docstring).
        mixstyle: MixStyle after the stages in ``mixstyle_layers``: ``None``/``False``,
            ``True``, a dict of MixStyle kwargs or a :class:`MixStyle` instance. One module
            (``self.mixstyle``) is applied at every listed stage; each application draws its
            own Bernoulli(p), partners and mixing weights, so this equals the authors' separate
            modules of the same settings in distribution.
        mixstyle_layers: the stages MixStyle follows, a subset of ``layer1`` .. ``layer4``
            (default :data:`MIXSTYLE_LAYERS`: ``layer1`` and ``layer2``).
    """

    def __init__(
        self,
        arch: str = "resnet18",
        num_classes: int = 7,
        weights_path: str | os.PathLike | None = None,
        mixstyle: MixStyle | bool | dict | None = None,
        mixstyle_layers: Sequence[str] = MIXSTYLE_LAYERS,
    ):
        super().__init__()
        if arch not in _ARCHS:
            raise ValueError(f"unknown arch {arch!r}; valid: {list(_ARCHS)}")
        bad = [name for name in mixstyle_layers if name not in _STAGES]
        if bad:
            raise ValueError(f"unknown mixstyle_layers {bad}; valid: {list(_STAGES)}")
        self.mixstyle_layers = tuple(name for name in _STAGES if name in mixstyle_layers)
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
        self.load_state(load_state_dict_file(path), path)

    def load_state(self, state: dict[str, torch.Tensor], path: str | os.PathLike) -> None:
        """Load ``state`` (read from ``path``, named in errors) as :meth:`load_weights` does.

        Raises:
            ValueError: the state is not this architecture's (missing or unexpected keys, or
                tensors of other shapes).
        """
        try:
            if any(k.startswith("backbone.") for k in state):
                self.load_state_dict(state, strict=True)
                return
            state = {k: v for k, v in state.items() if not k.startswith("fc.")}
            missing, unexpected = self.backbone.load_state_dict(state, strict=False)
        except RuntimeError as exc:
            lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
            detail = lines[1] if len(lines) > 1 else (lines[0] if lines else "")
            raise ValueError(
                f"{os.fspath(path)!r} is not a {self.arch} state dict ({detail})"
            ) from None
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
        for name in _STAGES:
            x = getattr(b, name)(x)
            if name in self.mixstyle_layers:
                x = self.mixstyle(x)
        return torch.flatten(b.avgpool(x), 1), x

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Globally pooled features (N, feature_dim) of images (N, 3, H, W)."""
        return self.features_with_map(x)[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits (N, num_classes)."""
        return self.head(self.features(x))
