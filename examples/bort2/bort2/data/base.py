"""The one data interface every benchmark module returns.

A benchmark is a :class:`Benchmark`: a name, class count, domain names and, for every domain,
a ``"train"`` and a ``"test"`` :class:`torch.utils.data.Dataset`. Every dataset item is
``(image, label)`` with ``image`` a ``torch.uint8`` tensor of shape ``(3, S, S)`` (RGB, the
benchmark's fixed size ``S``) and ``label`` a Python ``int``. Augmentation (weak/strong views)
works on batches of such tensors after conversion to float, so the same code serves small
in-memory digits and large on-disk photos.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils.data import Dataset


class ArrayDomain(Dataset):
    """An in-memory domain split: ``images`` uint8 ``(N, 3, S, S)``, ``labels`` int64 ``(N,)``."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(
                f"images must be uint8 (N, 3, S, S), got {images.dtype} {tuple(images.shape)}"
            )
        if labels.shape != (images.shape[0],):
            raise ValueError(
                f"labels must have shape ({images.shape[0]},), got {tuple(labels.shape)}"
            )
        self.images = images
        self.labels = labels.long()

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.images[i], int(self.labels[i])


class FileDomain(Dataset):
    """An on-disk domain split: image files decoded with PIL and resized to ``size``x``size``."""

    def __init__(self, items: Sequence[tuple[Path, int]], size: int):
        self.items = list(items)
        self.size = int(size)
        self.labels = torch.tensor([y for _, y in self.items], dtype=torch.long)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        path, label = self.items[i]
        with Image.open(path) as im:
            im = im.convert("RGB").resize((self.size, self.size), Image.BILINEAR)
            arr = torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8)
        return arr.view(self.size, self.size, 3).permute(2, 0, 1).contiguous(), int(label)


@dataclass
class Benchmark:
    """A multi-domain classification benchmark with train/test splits per domain."""

    name: str
    num_classes: int
    image_size: int
    splits: dict[str, dict[str, Dataset]] = field(default_factory=dict)

    @property
    def domains(self) -> list[str]:
        return list(self.splits)

    def split(self, domain: str, split: str) -> Dataset:
        if domain not in self.splits:
            raise KeyError(f"unknown domain {domain!r} for {self.name}; valid: {self.domains}")
        if split not in self.splits[domain]:
            raise KeyError(f"unknown split {split!r}; valid: {sorted(self.splits[domain])}")
        return self.splits[domain][split]
