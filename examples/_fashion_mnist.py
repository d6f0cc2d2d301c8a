"""Fashion-MNIST loader for the examples (reads the gzipped IDX files, no torchvision needed).

Debian/Ubuntu ship the data set as a package: ``apt-get install dataset-fashion-mnist`` puts
``train-images-idx3-ubyte.gz``, ``train-labels-idx1-ubyte.gz``, ``t10k-images-idx3-ubyte.gz``
and ``t10k-labels-idx1-ubyte.gz`` in ``/usr/share/datasets/fashion-mnist``.
"""

from __future__ import annotations

import gzip
import os

import numpy as np

DEFAULT_DIR = "/usr/share/datasets/fashion-mnist"
FILES = {
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}
INSTALL_HINT = (
    "Fashion-MNIST not found in {dir}. Install it with\n"
    "    apt-get install dataset-fashion-mnist\n"
    "(files go to /usr/share/datasets/fashion-mnist/*-ubyte.gz) or pass --data-dir DIR pointing "
    "at a folder holding {files}."
)


class FashionMNISTMissing(FileNotFoundError):
    """The IDX files are absent; the message says how to install them."""


def missing_files(data_dir: str = DEFAULT_DIR) -> list[str]:
    """Names of the four IDX files that are not in ``data_dir`` (empty when all are present)."""
    return [f for f in FILES.values() if not os.path.isfile(os.path.join(data_dir, f))]


def available(data_dir: str = DEFAULT_DIR) -> bool:
    """Whether all four files are present."""
    return not missing_files(data_dir)


def _read_idx(path: str) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        raw = f.read()
    magic = int.from_bytes(raw[0:4], "big")
    if magic >> 8 != 0x08:  # 0x08 = unsigned byte data
        raise ValueError(f"{path}: not an unsigned-byte IDX file (magic {magic:#x})")
    ndim = magic & 0xFF
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise ValueError(f"{path}: expected {dims} values, found {data.size}")
    return data.reshape(dims)


def load(data_dir: str = DEFAULT_DIR) -> dict[str, np.ndarray]:
    """Return ``train_images`` (60000, 784) uint8, ``train_labels`` (60000,) uint8, and the same
    for ``test_*`` (10000 examples), in the official file order.

    Raises:
        FashionMNISTMissing: when a file is absent (message with the install command).
    """
    missing = missing_files(data_dir)
    if missing:
        raise FashionMNISTMissing(INSTALL_HINT.format(dir=data_dir, files=", ".join(missing)))
    out = {k: _read_idx(os.path.join(data_dir, f)) for k, f in FILES.items()}
    for split in ("train", "test"):
        images = out[f"{split}_images"]
        out[f"{split}_images"] = images.reshape(images.shape[0], -1)
        if len(out[f"{split}_labels"]) != images.shape[0]:
            raise ValueError(f"{split}: image and label counts differ")
    return out
