"""From a loader's uint8 batch to the network's input: device, [0, 1] floats, views, normalisation.

:class:`Views` applies the weak and strong augmentations of the configured style
(``data.views``: ``official`` = the authors' Dassl digits recipe, ``legacy`` = this project's
earlier views; see :func:`bort2.data.transforms.weak_view`) and normalises the result.
"""

from __future__ import annotations

import torch

from .data.transforms import normalize, strong_view, to_float, weak_view

MEAN, STD = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
PHOTO_BENCHMARKS = ("pacs", "domainnet")


def prepare(images: torch.Tensor, device: torch.device) -> torch.Tensor:
    """uint8 images -> float in [0, 1] on ``device``."""
    return to_float(images.to(device, non_blocking=True))


def norm(x: torch.Tensor) -> torch.Tensor:
    """Normalise with the pipeline's mean and std (0.5 per channel, as Dassl's digits)."""
    return normalize(x, MEAN, STD)


class Views:
    """Normalised weak and strong views of [0, 1] batches, drawing from one generator.

    Args:
        style: ``"official"`` or ``"legacy"``.
        benchmark: the benchmark's name (photo benchmarks get flips in the weak view).
        generator: the stage's augmentation generator (checkpointed with the stage).
    """

    def __init__(self, style: str, benchmark: str, generator: torch.Generator):
        self.style, self.generator = style, generator
        self.photo = benchmark in PHOTO_BENCHMARKS

    def weak(self, x: torch.Tensor) -> torch.Tensor:
        """The weak view, normalised."""
        return norm(weak_view(x, self.generator, self.style, self.photo))

    def strong(self, x: torch.Tensor) -> torch.Tensor:
        """The strong view, normalised."""
        return norm(strong_view(x, self.generator, self.style, self.photo))
