"""Digit-Five loader: the five ``.mat`` files of the M3SDA release -> in-memory ``Benchmark``.

Owns reading ``mnist_data.mat``, ``mnistm_with_label.mat``, ``svhn_{train,test}_32x32.mat``,
``syn_number.mat`` and ``usps_28x28.mat``, normalising their differing array layouts and label
encodings, the M3SDA per-domain sample caps (25,000 train / 9,000 test; USPS whole), and the
conversion to uint8 RGB ``(N, 3, S, S)`` :class:`~bort2.data.base.ArrayDomain` splits.
The conventions are listed in ``docs/datasets.md``.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .base import ArrayDomain, Benchmark

__all__ = ["DIGIT5_DOMAINS", "DIGIT5_FILES", "load_digit5"]

DIGIT5_DOMAINS: tuple[str, ...] = ("mnist", "mnistm", "svhn", "syn", "usps")

#: Files each domain needs, relative to the Digit-Five folder.
DIGIT5_FILES: dict[str, tuple[str, ...]] = {
    "mnist": ("mnist_data.mat",),
    "mnistm": ("mnistm_with_label.mat",),
    "svhn": ("svhn_train_32x32.mat", "svhn_test_32x32.mat"),
    "syn": ("syn_number.mat",),
    "usps": ("usps_28x28.mat",),
}

LAYOUT = """\
<root>/                        (or <root>/Digit-Five/)
  mnist_data.mat               train_32, label_train, test_32, label_test
  mnistm_with_label.mat        train, label_train, test, label_test
  svhn_train_32x32.mat         X (32, 32, 3, N), y (N, 1) with 10 meaning digit 0
  svhn_test_32x32.mat          X, y
  syn_number.mat               train_data, train_label, test_data, test_label
  usps_28x28.mat               dataset: [[train_images, train_labels],
                                         [test_images,  test_labels]]"""

_CHUNK = 4096


def _layout_error(problem: str) -> str:
    return f"Digit-Five: {problem}\nExpected layout:\n{LAYOUT}"


def _find_folder(root: Path) -> Path:
    """Return the folder holding the ``.mat`` files: ``root`` or ``root/Digit-Five``."""
    if not root.is_dir():
        raise FileNotFoundError(_layout_error(f"data root {root} does not exist."))
    for cand in (root, root / "Digit-Five", root / "digit5", root / "Digit5"):
        if cand.is_dir() and any((cand / f).is_file() for fs in DIGIT5_FILES.values() for f in fs):
            return cand
    return root


def _loadmat(path: Path, keys: Sequence[str]) -> dict:
    from scipy.io import loadmat

    if not path.is_file():
        raise FileNotFoundError(_layout_error(f"missing file {path}."))
    try:
        data = loadmat(str(path))
    except Exception as err:  # scipy raises several types for corrupt files
        raise ValueError(_layout_error(f"cannot read {path} as a .mat file ({err}).")) from err
    missing = [k for k in keys if k not in data]
    if missing:
        found = sorted(k for k in data if not k.startswith("__"))
        raise ValueError(_layout_error(f"{path} lacks key(s) {missing}; it has {found}."))
    return data


def _labels(raw: np.ndarray, n: int | None, where: str) -> np.ndarray:
    """Integer digit labels from a one-hot matrix or an integer vector; 10 means digit 0."""
    y = np.asarray(raw)
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    elif y.ndim == 2 and y.shape[0] == 1 and (n is None or y.shape[1] == n):
        y = y[0]
    elif y.ndim == 2 and y.shape[1] in (10, 11) and (n is None or y.shape[0] == n):
        y = y.argmax(axis=1)  # one-hot rows
    elif y.ndim == 2 and y.shape[0] in (10, 11) and (n is None or y.shape[1] == n):
        y = y.argmax(axis=0)  # one-hot columns
    if y.ndim != 1:
        raise ValueError(_layout_error(f"{where}: cannot read labels of shape {raw.shape}."))
    y = y.astype(np.int64)
    y[y == 10] = 0
    if y.size and (y.min() < 0 or y.max() > 9):
        raise ValueError(_layout_error(f"{where}: labels outside 0..9 (or 10 for digit 0)."))
    return y


def _images_nhwc(raw: np.ndarray, n: int, where: str) -> np.ndarray:
    """Bring an image array with ``n`` samples to ``(N, H, W, C)``, ``C`` in {1, 3}."""
    x = np.asarray(raw)
    if x.ndim >= 2 and x.shape[0] != n and x.shape[-1] == n:
        x = np.moveaxis(x, -1, 0)  # (H, W[, C], N) -> (N, H, W[, C])
    if x.shape[0] != n:
        raise ValueError(_layout_error(f"{where}: {x.shape} images for {n} labels."))
    if x.ndim == 2:  # flattened square greyscale images
        side = int(round(x.shape[1] ** 0.5))
        if side * side != x.shape[1]:
            raise ValueError(_layout_error(f"{where}: cannot unflatten images {x.shape}."))
        x = x.reshape(n, side, side, 1)
    elif x.ndim == 3:
        x = x[..., None]
    elif x.ndim == 4 and x.shape[-1] not in (1, 3) and x.shape[1] in (1, 3):
        x = np.moveaxis(x, 1, -1)  # (N, C, H, W) -> (N, H, W, C)
    if x.ndim != 4 or x.shape[-1] not in (1, 3):
        raise ValueError(_layout_error(f"{where}: unsupported image array shape {raw.shape}."))
    return x


def _to_uint8(x: np.ndarray) -> np.ndarray:
    """Pixel values as uint8: floats in [0, 1] are scaled by 255, others rounded and clipped."""
    if x.dtype == np.uint8:
        return x
    x = x.astype(np.float64)
    if x.size and float(x.max()) <= 1.0:
        x = x * 255.0
    return np.clip(np.rint(x), 0, 255).astype(np.uint8)


def _to_tensor(x: np.ndarray, size: int) -> torch.Tensor:
    """``(N, H, W, C)`` uint8 -> ``(N, 3, size, size)`` uint8 (grey repeated, bilinear resize)."""
    t = torch.from_numpy(np.ascontiguousarray(x)).permute(0, 3, 1, 2)
    if t.shape[1] == 1:
        t = t.expand(-1, 3, -1, -1)
    if t.shape[-2:] == (size, size):
        return t.contiguous()
    out = torch.empty((t.shape[0], 3, size, size), dtype=torch.uint8)
    for s in range(0, t.shape[0], _CHUNK):
        chunk = t[s : s + _CHUNK].float()
        chunk = F.interpolate(
            chunk, size=(size, size), mode="bilinear", align_corners=False, antialias=True
        )
        out[s : s + _CHUNK] = chunk.round_().clamp_(0, 255).to(torch.uint8)
    return out


def _subset(n: int, cap: int | None, seed: int, domain: str, split: str) -> np.ndarray | None:
    """Sorted indices of a seeded random subset of ``cap`` items, or ``None`` for all."""
    if cap is None or n <= cap:
        return None
    tag = zlib.crc32(f"{domain}/{split}".encode())
    rng = np.random.default_rng([int(seed), tag])
    return np.sort(rng.permutation(n)[:cap])


def _read_domain(folder: Path, domain: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Raw ``{"train"/"test": (images NHWC, labels)}`` of one domain, as stored."""
    raw: dict[str, tuple[np.ndarray, np.ndarray, str]] = {}
    if domain == "mnist":
        path = folder / "mnist_data.mat"
        from scipy.io import whosmat

        keys = {k for k, _, _ in whosmat(str(path))} if path.is_file() else set()
        img = "{}_32" if "train_32" in keys or "train_28" not in keys else "{}_28"
        d = _loadmat(path, [img.format("train"), "label_train", img.format("test"), "label_test"])
        for split in ("train", "test"):
            raw[split] = (d[img.format(split)], d[f"label_{split}"], f"{path}[{split}]")
    elif domain == "mnistm":
        path = folder / "mnistm_with_label.mat"
        d = _loadmat(path, ["train", "label_train", "test", "label_test"])
        for split in ("train", "test"):
            raw[split] = (d[split], d[f"label_{split}"], f"{path}[{split}]")
    elif domain == "svhn":
        for split in ("train", "test"):
            path = folder / f"svhn_{split}_32x32.mat"
            d = _loadmat(path, ["X", "y"])
            raw[split] = (d["X"], d["y"], str(path))
    elif domain == "syn":
        path = folder / "syn_number.mat"
        d = _loadmat(path, ["train_data", "train_label", "test_data", "test_label"])
        for split in ("train", "test"):
            raw[split] = (d[f"{split}_data"], d[f"{split}_label"], f"{path}[{split}]")
    elif domain == "usps":
        path = folder / "usps_28x28.mat"
        ds = _loadmat(path, ["dataset"])["dataset"]
        try:
            for i, split in enumerate(("train", "test")):
                raw[split] = (ds[i][0], ds[i][1], f"{path}[dataset][{i}]")
        except (IndexError, TypeError) as err:
            raise ValueError(
                _layout_error(f"{path}: 'dataset' is not a 2x2 cell array ({err}).")
            ) from err
    else:
        raise ValueError(f"unknown Digit-Five domain {domain!r}; valid: {list(DIGIT5_DOMAINS)}")
    out = {}
    for split, (images, labels, where) in raw.items():
        images = np.asarray(images)
        labels = np.asarray(labels)
        if domain == "svhn" and images.ndim == 4 and images.shape[2] == 3:
            images = images.transpose(3, 0, 1, 2)  # (H, W, 3, N) -> (N, H, W, 3)
        y = _labels(labels, None, where)
        x = _images_nhwc(images, y.shape[0], where)
        out[split] = (x, y)
    return out


def load_digit5(
    root: str | Path,
    image_size: int = 32,
    max_train: int | None = 25000,
    max_test: int | None = 9000,
    domains: Sequence[str] | None = None,
    seed: int = 0,
) -> Benchmark:
    """Load Digit-Five (MNIST, MNIST-M, SVHN, SynDigits, USPS) from the M3SDA ``.mat`` files.

    Every domain but USPS is cut to a seeded random subset of ``max_train`` training and
    ``max_test`` test images (the M3SDA protocol: 25,000 / 9,000); USPS keeps all its images
    (7,438 / 1,860 in ``usps_28x28.mat``). Greyscale images are repeated to RGB, float images in
    [0, 1] are scaled to 0..255, and images are resized bilinearly to ``image_size``.

    Args:
        root: folder with the ``.mat`` files, or its parent holding ``Digit-Five/``.
        image_size: side ``S`` of the returned square images.
        max_train: per-domain cap on training images (``None``: no cap); USPS is exempt.
        max_test: per-domain cap on test images (``None``: no cap); USPS is exempt.
        domains: subset of :data:`DIGIT5_DOMAINS` to load (default: all five, in that order).
        seed: seed of the random subsets; each (domain, split) draws from its own stream, so
            the subset does not depend on which other domains are loaded.

    Returns:
        A :class:`Benchmark` named ``"digit5"`` with 10 classes and ArrayDomain splits.

    Raises:
        FileNotFoundError: ``root`` or a domain's ``.mat`` file is missing.
        ValueError: a file lacks the expected keys or holds arrays of an unexpected layout.

    Example:
        >>> bench = load_digit5("data/Digit-Five", domains=["mnist", "usps"])  # doctest: +SKIP
        >>> image, label = bench.split("usps", "train")[0]  # doctest: +SKIP
        >>> image.shape, image.dtype  # doctest: +SKIP
        (torch.Size([3, 32, 32]), torch.uint8)
    """
    domains = list(DIGIT5_DOMAINS if domains is None else domains)
    unknown = [d for d in domains if d not in DIGIT5_DOMAINS]
    if unknown:
        raise ValueError(f"unknown Digit-Five domain(s) {unknown}; valid: {list(DIGIT5_DOMAINS)}")
    folder = _find_folder(Path(root).expanduser())
    bench = Benchmark(name="digit5", num_classes=10, image_size=int(image_size))
    for domain in domains:
        raw = _read_domain(folder, domain)
        bench.splits[domain] = {}
        for split, cap in (("train", max_train), ("test", max_test)):
            x, y = raw[split]
            idx = None if domain == "usps" else _subset(len(y), cap, seed, domain, split)
            if idx is not None:
                x, y = x[idx], y[idx]
            images = _to_tensor(_to_uint8(x), int(image_size))
            bench.splits[domain][split] = ArrayDomain(images, torch.from_numpy(y))
    return bench
