"""Natural photos bundled with scikit-learn and scikit-image, split between MiniDigits domains.

Owns: loading the bundled photos (no downloads) as uint8 RGB arrays, the fixed photo split
between ``uci_m`` and ``syn_m`` (:data:`PHOTO_SPLIT`), and random multi-scale patch sampling
(:func:`random_patch`).

Only images that ship inside the installed packages are used: scikit-learn's
``load_sample_images()`` (china, flower) and the scikit-image samples listed in
:data:`PHOTO_SPLIT`; other scikit-image samples need a download and are never touched.
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
from PIL import Image

#: Photos per domain: fixed by name, disjoint, each mixing colour and greyscale pictures.
PHOTO_SPLIT: dict[str, tuple[str, ...]] = {
    "uci_m": ("china", "astronaut", "chelsea", "immunohistochemistry", "camera", "gravel", "coins"),
    "syn_m": ("flower", "coffee", "rocket", "stereo_motorcycle", "brick", "grass"),
}

#: Fewest photos a domain needs; below this :func:`domain_photos` raises.
MIN_PHOTOS_PER_DOMAIN = 2


def _to_rgb_uint8(img: np.ndarray) -> np.ndarray:
    img = np.asarray(img)
    if img.dtype != np.uint8:
        img = img.astype(np.float64)
        if img.max() <= 1.0 + 1e-6:  # float images in [0, 1]
            img = img * 255.0
        img = np.clip(np.round(img), 0, 255).astype(np.uint8)
    if img.ndim == 2:
        img = np.repeat(img[:, :, None], 3, axis=2)
    if img.shape[2] == 4:  # drop alpha
        img = img[:, :, :3]
    return np.ascontiguousarray(img)


def _load_one(name: str) -> np.ndarray:
    if name in ("china", "flower"):
        from sklearn.datasets import load_sample_image

        return load_sample_image(f"{name}.jpg")
    import skimage.data

    img = getattr(skimage.data, name)()
    if isinstance(img, tuple):  # stereo_motorcycle -> (left, right, disparity): use the left view
        img = img[0]
    return img


@functools.cache
def load_photo(name: str) -> np.ndarray | None:
    """Load one bundled photo as a uint8 ``(H, W, 3)`` array, or ``None`` if it fails to load.

    Args:
        name: one of the names in :data:`PHOTO_SPLIT`.

    Returns:
        The photo (cached, read-only) or ``None`` (with a warning) on any error.
    """
    try:
        img = _to_rgb_uint8(_load_one(name))
    except Exception as exc:  # noqa: BLE001 - a missing optional sample must not break the build
        warnings.warn(f"MiniDigits: could not load bundled photo {name!r}: {exc}", stacklevel=2)
        return None
    img.setflags(write=False)
    return img


def domain_photos(domain: str) -> list[tuple[str, np.ndarray]]:
    """Return the photos assigned to ``domain`` that load.

    Args:
        domain: ``"uci_m"`` or ``"syn_m"``.

    Returns:
        ``[(name, uint8 RGB array), ...]`` in :data:`PHOTO_SPLIT` order.

    Raises:
        RuntimeError: if fewer than :data:`MIN_PHOTOS_PER_DOMAIN` photos load.

    Example:
        >>> [n for n, _ in domain_photos("syn_m")][:2]
        ['flower', 'coffee']
    """
    names = PHOTO_SPLIT[domain]
    photos = [(n, img) for n in names if (img := load_photo(n)) is not None]
    if len(photos) < MIN_PHOTOS_PER_DOMAIN:
        raise RuntimeError(
            f"MiniDigits domain {domain!r} needs at least {MIN_PHOTOS_PER_DOMAIN} photos from "
            f"{names} (scikit-learn's load_sample_images and scikit-image's bundled samples), "
            f"but only {len(photos)} loaded; check that scikit-learn and scikit-image are "
            "installed with their data files."
        )
    return photos


def random_patch(
    rng: np.random.Generator,
    photos: list[tuple[str, np.ndarray]],
    size: int = 32,
    min_side: int = 32,
    max_side: int = 128,
) -> np.ndarray:
    """Crop a random square of side ``min_side..max_side`` from a random photo, resized to size.

    Plain ``size``-pixel crops of large photos are nearly flat; larger crops scaled down keep
    edges and texture.

    Args:
        rng: random generator.
        photos: from :func:`domain_photos`.
        size: output side.
        min_side: smallest crop side.
        max_side: largest crop side (clipped to the photo).

    Returns:
        uint8 ``(size, size, 3)``.
    """
    img = photos[int(rng.integers(len(photos)))][1]
    h, w = img.shape[:2]
    hi = min(max_side, h, w)
    side = int(np.exp(rng.uniform(np.log(min_side), np.log(hi)))) if hi > min_side else hi
    y = int(rng.integers(0, h - side + 1))
    x = int(rng.integers(0, w - side + 1))
    crop = img[y : y + side, x : x + side]
    if rng.random() < 0.5:
        crop = crop[:, ::-1]
    im = Image.fromarray(np.ascontiguousarray(crop))
    if side != size:
        im = im.resize((size, size), Image.BILINEAR)
    return np.asarray(im, dtype=np.uint8)
