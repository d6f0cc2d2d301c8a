"""Fashion-MNIST's idx files written as the ``mnist.pkl`` that benchmark_bilevel's ``mnist``
dataset reads (keys ``training_images``, ``training_labels``, ``test_images``, ``test_labels``;
images ``uint8`` of shape ``(n, 784)``, labels ``uint8`` of shape ``(n,)``). The Debian package
``dataset-fashion-mnist`` installs the idx files under ``/usr/share/datasets/fashion-mnist/``.
"""

from __future__ import annotations

import gzip
import pickle
import struct
from pathlib import Path

import numpy as np

FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
FILES = {
    "training_images": "train-images-idx3-ubyte",
    "training_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}


def read_idx(path: Path) -> np.ndarray:
    """An idx file (gzipped or not) as an array: images flattened to ``(n, rows * cols)``."""
    raw = gzip.open(path, "rb").read() if path.suffix == ".gz" else path.read_bytes()
    zero, dtype, ndim = struct.unpack(">HBB", raw[:4])
    if zero != 0 or dtype != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte idx file (magic {raw[:4].hex()})")
    shape = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
    data = np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(shape)):
        raise ValueError(f"{path}: {data.size} bytes for shape {shape}")
    return data.reshape(shape[0], -1) if ndim > 1 else data.reshape(shape[0])


def find(directory: Path, stem: str) -> Path:
    for name in (stem + ".gz", stem):
        if (directory / name).exists():
            return directory / name
    raise FileNotFoundError(
        f"{directory / stem}[.gz] not found (apt-get install dataset-fashion-mnist)"
    )


def write_pickle(out: Path, directory: Path = FASHION_DIR) -> dict[str, np.ndarray]:
    """Write ``out`` (``mnist.pkl``) from the idx files in ``directory``; returns the dict."""
    data = {key: read_idx(find(directory, stem)) for key, stem in FILES.items()}
    for part in ("training", "test"):
        if len(data[f"{part}_images"]) != len(data[f"{part}_labels"]):
            raise ValueError(f"{part}: images and labels differ in number")
    with open(out, "wb") as f:
        pickle.dump(data, f)
    return data
