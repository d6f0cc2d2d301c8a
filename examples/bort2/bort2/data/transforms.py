"""Batched weak/strong augmentations on float image batches (N, 3, H, W) in [0, 1].

Datasets yield uint8 ``(3, S, S)`` images; a collated batch is converted with :func:`to_float`,
augmented here (on whatever device it lives on), then optionally normalised with
:func:`normalize`. Every random draw takes an optional :class:`torch.Generator` so that a
seeded run is reproducible; numbers are drawn on the generator's device and moved to the
batch's device.

The training views are :func:`weak_view` and :func:`strong_view`, in one of two styles:

- ``style="official"`` (default), the BORT² authors' Dassl recipe for digits:

  - weak: no augmentation for digits; for photos (``photo=True``) a random horizontal flip and
    the random translation of :func:`weak`;
  - strong: a random horizontal flip (digits too), then 2 RandAugment operations per image
    drawn uniformly from the FixMatch list :data:`FIXMATCH_OPS`, each with a uniform
    magnitude (see :func:`apply_fixmatch_op`; enhance factors in [0.05, 0.95]; geometric
    operations fill with gray 0.5), then Cutout (:func:`cutout_fixed`): one black square of
    fixed side half the image side (16 px on 32-px images), clipped at the borders.

- ``style="legacy"``, this example's original views, :func:`weak` and :func:`strong` with their
  default arguments (``photo`` is ignored):

  - :func:`weak`: random translation by up to 12.5% of the side with reflect padding (the
    FixMatch "pad and random crop"), plus a random horizontal flip only when ``hflip=True``;
  - :func:`strong`: optionally the weak transform first, then RandAugment-style: ``num_ops``
    random operations per image from :data:`OPS` with a random magnitude each, then Cutout
    (a square of random side up to half the image, filled with 0.5).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

OPS: tuple[str, ...] = (
    "identity",
    "autocontrast",
    "equalize",
    "brightness",
    "contrast",
    "sharpness",
    "posterize",
    "solarize",
    "rotate",
    "shear_x",
    "shear_y",
    "translate_x",
    "translate_y",
)

_GEOMETRIC = ("rotate", "shear_x", "shear_y", "translate_x", "translate_y")

FIXMATCH_OPS: tuple[str, ...] = (
    "identity",
    "autocontrast",
    "brightness",
    "color",
    "contrast",
    "equalize",
    "posterize",
    "rotate",
    "sharpness",
    "shear_x",
    "shear_y",
    "solarize",
    "translate_x",
    "translate_y",
)
"""RandAugment operations of the FixMatch paper (Dassl's ``fixmatch_list``), see
:func:`apply_fixmatch_op`."""

STYLES: tuple[str, ...] = ("official", "legacy")
"""Valid ``style`` values of :func:`weak_view` and :func:`strong_view`."""


def to_float(images: torch.Tensor) -> torch.Tensor:
    """Convert a uint8 batch (values 0..255) to floats in [0, 1] (torch's default dtype:
    float32 unless a test asked for float64)."""
    if images.dtype != torch.uint8:
        raise TypeError(f"expected a uint8 batch, got {images.dtype}")
    return images.to(torch.get_default_dtype()).div_(255.0)


def normalize(x: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """Per-channel ``(x - mean) / std`` for a batch (N, C, H, W)."""
    m = torch.as_tensor(mean, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    s = torch.as_tensor(std, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    return (x - m) / s


def _rand(shape: tuple[int, ...], generator: torch.Generator | None, device) -> torch.Tensor:
    gen_device = generator.device if generator is not None else device
    return torch.rand(shape, generator=generator, device=gen_device).to(device)


def _randint(
    high: int, shape: tuple[int, ...], generator: torch.Generator | None, device
) -> torch.Tensor:
    gen_device = generator.device if generator is not None else device
    return torch.randint(0, high, shape, generator=generator, device=gen_device).to(device)


def translate(x: torch.Tensor, dx: torch.Tensor, dy: torch.Tensor, pad: int) -> torch.Tensor:
    """Shift every image by integer offsets with reflect padding.

    ``out[n, :, i, j] = P[n, :, i + pad - dy[n], j + pad - dx[n]]`` where ``P`` is ``x``
    reflect-padded by ``pad`` pixels: content moves ``dx`` pixels right and ``dy`` down.

    Args:
        x: Batch (N, C, H, W).
        dx: Horizontal shifts (N,), integers in ``[-pad, pad]``.
        dy: Vertical shifts (N,), integers in ``[-pad, pad]``.
        pad: Reflect padding width (< H and < W).

    Returns:
        The shifted batch, same shape as ``x``.
    """
    n, c, h, w = x.shape
    if pad == 0:
        return x.clone()
    padded = F.pad(x, (pad, pad, pad, pad), mode="reflect")
    dx = dx.to(x.device).long()
    dy = dy.to(x.device).long()
    rows = torch.arange(h, device=x.device).view(1, h) + (pad - dy).view(n, 1)  # (N, H)
    cols = torch.arange(w, device=x.device).view(1, w) + (pad - dx).view(n, 1)  # (N, W)
    wp = w + 2 * pad
    flat = padded.reshape(n, c, -1)
    index = (rows.view(n, h, 1) * wp + cols.view(n, 1, w)).view(n, 1, h * w).expand(n, c, h * w)
    return flat.gather(2, index).view(n, c, h, w)


def hflip_random(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Flip each image horizontally with probability 0.5."""
    flip = _rand((x.shape[0],), generator, x.device) < 0.5
    return torch.where(flip.view(-1, 1, 1, 1), x.flip(-1), x)


def weak(
    x: torch.Tensor,
    generator: torch.Generator | None = None,
    hflip: bool = False,
    max_translate: float = 0.125,
) -> torch.Tensor:
    """Weak augmentation: random translation (reflect padding) and optional flip.

    Args:
        x: Float batch (N, C, H, W) in [0, 1].
        generator: Optional generator for the draws.
        hflip: Also flip horizontally with probability 0.5 (leave False for digits).
        max_translate: Largest shift as a fraction of the side (rounded to whole pixels).

    Returns:
        The augmented batch (a new tensor).
    """
    n, _, h, w = x.shape
    pad = min(int(round(max_translate * min(h, w))), h - 1, w - 1)
    shifts = _randint(2 * pad + 1, (2, n), generator, x.device) - pad
    out = translate(x, shifts[0], shifts[1], pad)
    if hflip:
        out = hflip_random(out, generator)
    return out


# ----------------------------------------------------------------------------- strong ops
def _blend(degenerate: torch.Tensor, x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """PIL ImageEnhance: ``degenerate + factor * (x - degenerate)``, clamped to [0, 1]."""
    f = factor.view(-1, 1, 1, 1)
    return (degenerate + f * (x - degenerate)).clamp_(0.0, 1.0)


def _autocontrast(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    lo = x.amin(dim=(2, 3), keepdim=True)
    hi = x.amax(dim=(2, 3), keepdim=True)
    span = hi - lo
    scaled = (x - lo) / span.clamp_min(1e-6)
    return torch.where(span > 1e-6, scaled, x).clamp_(0.0, 1.0)


def _equalize(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    n, c, h, w = x.shape
    levels = (x * 255.0).round().long().clamp_(0, 255).view(n * c, h * w)
    hist = torch.zeros(n * c, 256, device=x.device, dtype=x.dtype)
    hist.scatter_add_(1, levels, torch.ones_like(levels, dtype=x.dtype))
    cdf = hist.cumsum(dim=1)
    cdf_min = cdf.gather(1, levels.amin(dim=1, keepdim=True))
    total = float(h * w)
    mapped = (cdf.gather(1, levels) - cdf_min) / (total - cdf_min).clamp_min(1.0)
    flat = x.reshape(n * c, h * w)
    out = torch.where(cdf_min < total, mapped, flat)
    return out.view(n, c, h, w).clamp_(0.0, 1.0)


def _gray(x: torch.Tensor) -> torch.Tensor:
    """ITU-R 601-2 luma (PIL's ``convert("L")``) of an RGB batch, shape (N, 1, H, W)."""
    if x.shape[1] != 3:
        return x.mean(dim=1, keepdim=True)
    return (0.299 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2]).unsqueeze(1)


def _degenerate_brightness(x: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(x)


def _degenerate_color(x: torch.Tensor) -> torch.Tensor:
    return _gray(x).expand_as(x)


def _degenerate_contrast(x: torch.Tensor) -> torch.Tensor:
    gray = 0.299 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2]
    mean = gray.mean(dim=(1, 2)).view(-1, 1, 1, 1)
    return mean.expand_as(x)


def _degenerate_sharpness(x: torch.Tensor) -> torch.Tensor:
    c = x.shape[1]
    k = torch.ones(3, 3, device=x.device, dtype=x.dtype)
    k[1, 1] = 5.0
    k = (k / k.sum()).expand(c, 1, 3, 3)
    return F.conv2d(F.pad(x, (1, 1, 1, 1), mode="replicate"), k, groups=c)


_DEGENERATE = {
    "brightness": _degenerate_brightness,
    "color": _degenerate_color,
    "contrast": _degenerate_contrast,
    "sharpness": _degenerate_sharpness,
}


def _brightness(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return _blend(_degenerate_brightness(x), x, 1.0 + 0.9 * v)


def _contrast(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return _blend(_degenerate_contrast(x), x, 1.0 + 0.9 * v)


def _sharpness(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return _blend(_degenerate_sharpness(x), x, 1.0 + 0.9 * v)


def _posterize_bits(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """PIL posterize: keep the ``bits`` (N,) high bits of every 8-bit level."""
    step = (2.0 ** (8 - bits)).view(-1, 1, 1, 1)
    return (torch.floor((x * 255.0).round() / step) * step / 255.0).clamp_(0.0, 1.0)


def _posterize(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return _posterize_bits(x, 8 - (v.abs() * 4).round())  # 4..8 bits kept


def _solarize_threshold(x: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """PIL solarize: invert the pixels at or above ``threshold`` (N,)."""
    return torch.where(x >= threshold.view(-1, 1, 1, 1), 1.0 - x, x)


def _solarize(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return _solarize_threshold(x, 1.0 - v.abs())


def _affine(x: torch.Tensor, theta: torch.Tensor, fill: float) -> torch.Tensor:
    """Sample ``x`` at ``theta @ [u, v, 1]`` (normalised coords); outside pixels get ``fill``."""
    grid = F.affine_grid(theta.to(x.dtype), list(x.shape), align_corners=False)
    out = F.grid_sample(x - fill, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    return (out + fill).clamp_(0.0, 1.0)


def _geometric_theta(op: str, v: torch.Tensor) -> torch.Tensor:
    n = v.shape[0]
    theta = torch.zeros(n, 2, 3, device=v.device, dtype=v.dtype)
    theta[:, 0, 0] = 1.0
    theta[:, 1, 1] = 1.0
    if op == "rotate":
        a = v * (30.0 * math.pi / 180.0)
        theta[:, 0, 0], theta[:, 0, 1] = a.cos(), -a.sin()
        theta[:, 1, 0], theta[:, 1, 1] = a.sin(), a.cos()
    elif op == "shear_x":
        theta[:, 0, 1] = 0.3 * v
    elif op == "shear_y":
        theta[:, 1, 0] = 0.3 * v
    elif op == "translate_x":
        theta[:, 0, 2] = 2 * 0.3 * v  # up to 30% of the width
    elif op == "translate_y":
        theta[:, 1, 2] = 2 * 0.3 * v
    return theta


_COLOR_FNS = {
    "autocontrast": _autocontrast,
    "equalize": _equalize,
    "brightness": _brightness,
    "contrast": _contrast,
    "sharpness": _sharpness,
    "posterize": _posterize,
    "solarize": _solarize,
}


def apply_op(x: torch.Tensor, op: str, v: torch.Tensor, fill: float = 0.5) -> torch.Tensor:
    """Apply one named operation of :data:`OPS` to a batch with signed magnitudes ``v``.

    Magnitudes ``v`` (N,) lie in [-1, 1]; unsigned operations use ``|v|``. Ranges at |v| = 1:
    enhance factors (brightness, contrast, sharpness) 1 +/- 0.9; posterize to 4 bits; solarize
    threshold 0; rotate +/-30 degrees; shear +/-0.3; translate +/-30% of the side (``fill``
    outside the image).
    """
    if op == "identity":
        return x
    if op in _COLOR_FNS:
        return _COLOR_FNS[op](x, v)
    if op in _GEOMETRIC:
        return _affine(x, _geometric_theta(op, v), fill)
    raise ValueError(f"unknown op {op!r}; valid: {list(OPS)}")


def cutout(
    x: torch.Tensor,
    generator: torch.Generator | None = None,
    max_frac: float = 0.5,
    fill: float = 0.5,
) -> torch.Tensor:
    """Fill one square per image, of random side up to ``max_frac`` of the image, with ``fill``.

    The square's centre is uniform over the image and the square is clipped at the borders.
    """
    n, _, h, w = x.shape
    r = _rand((3, n), generator, x.device)
    side = (r[0] * max_frac * min(h, w)).round()
    cy = (r[1] * h).floor()
    cx = (r[2] * w).floor()
    y0 = (cy - torch.div(side, 2, rounding_mode="floor")).view(n, 1, 1)
    x0 = (cx - torch.div(side, 2, rounding_mode="floor")).view(n, 1, 1)
    s = side.view(n, 1, 1)
    ii = torch.arange(h, device=x.device).view(1, h, 1)
    jj = torch.arange(w, device=x.device).view(1, 1, w)
    inside = (ii >= y0) & (ii < y0 + s) & (jj >= x0) & (jj < x0 + s)
    return torch.where(inside.unsqueeze(1), torch.full_like(x, fill), x)


def strong(
    x: torch.Tensor,
    generator: torch.Generator | None = None,
    num_ops: int = 2,
    hflip: bool = False,
    with_weak: bool = True,
    cutout_frac: float = 0.5,
    fill: float = 0.5,
) -> torch.Tensor:
    """Strong augmentation: (weak) + RandAugment-style ops with random magnitudes + Cutout.

    For each of ``num_ops`` rounds every image draws one op uniformly from :data:`OPS` and a
    magnitude ``v ~ U[-1, 1]`` (see :func:`apply_op`); images sharing an op are processed
    together. Cutout follows with a square of random side in ``[0, cutout_frac * size]``.

    Args:
        x: Float batch (N, C, H, W) in [0, 1].
        generator: Optional generator for the draws.
        num_ops: Operations per image.
        hflip: Random horizontal flips in the weak stage (not for digits).
        with_weak: Apply :func:`weak` first (FixMatch's strong view also shifts/flips).
        cutout_frac: Largest Cutout side as a fraction of the image side (0 disables it).
        fill: Fill value of Cutout and of pixels moved in by geometric ops.

    Returns:
        The augmented batch (a new tensor) in [0, 1].
    """
    out = weak(x, generator, hflip=hflip) if with_weak else x.clone()
    n = out.shape[0]
    for _ in range(num_ops):
        ops = _randint(len(OPS), (n,), generator, out.device)
        mags = _rand((n,), generator, out.device) * 2.0 - 1.0
        for k, op in enumerate(OPS):
            if op == "identity":
                continue
            idx = (ops == k).nonzero().squeeze(1)
            if idx.numel() == 0:
                continue
            out[idx] = apply_op(out[idx], op, mags[idx], fill)
    if cutout_frac > 0:
        out = cutout(out, generator, cutout_frac, fill)
    return out


# ----------------------------------------------------------------------------- official views
def apply_fixmatch_op(x: torch.Tensor, op: str, u: torch.Tensor, fill: float = 0.5) -> torch.Tensor:
    """Apply one operation of :data:`FIXMATCH_OPS` with magnitudes ``u`` (N,) in [0, 1].

    The magnitude maps linearly onto the operation's range (Dassl's ``fixmatch_list``):
    brightness, color, contrast and sharpness blend with their degenerate image (black, the
    grayscale image, the mean gray level, the 3x3 smoothed image; PIL ``ImageEnhance``) with the
    factor ``0.05 + 0.9 u``; posterize keeps ``min(4 + floor(5 u), 8)`` bits (4..8); solarize
    inverts the pixels ``>= u``; rotate by ``(2u - 1) * 30`` degrees, shear by ``(2u - 1) *
    0.3``, translate by ``(2u - 1) * 30%`` of the side (``fill`` outside the image);
    identity, autocontrast and equalize ignore ``u``.

    Args:
        x: Float batch (N, C, H, W) in [0, 1].
        op: Name of the operation.
        u: Magnitudes (N,) in [0, 1].
        fill: Value of the pixels that geometric operations move in from outside.

    Returns:
        The transformed batch in [0, 1].
    """
    u = u.to(device=x.device, dtype=x.dtype)
    if op == "identity":
        return x
    if op in _DEGENERATE:
        return _blend(_DEGENERATE[op](x), x, 0.05 + 0.9 * u)
    if op == "posterize":
        return _posterize_bits(x, (4 + (5 * u).floor()).clamp_max(8))
    if op == "solarize":
        return _solarize_threshold(x, u)
    if op in ("autocontrast", "equalize"):
        return _COLOR_FNS[op](x, u)
    if op in _GEOMETRIC:
        return _affine(x, _geometric_theta(op, 2.0 * u - 1.0), fill)
    raise ValueError(f"unknown op {op!r}; valid: {list(FIXMATCH_OPS)}")


def cutout_fixed(
    x: torch.Tensor,
    generator: torch.Generator | None = None,
    size_frac: float = 0.5,
    fill: float = 0.0,
) -> torch.Tensor:
    """Fill one square per image, of fixed side ``round(size_frac * min(H, W))``, with ``fill``.

    The square covers rows ``[cy - s // 2, cy - s // 2 + s)`` and the same columns around
    ``cx``, with ``cy = floor(r0 * H)`` and ``cx = floor(r1 * W)`` for uniform ``r0, r1`` (two
    draws per image), clipped at the borders (Dassl's ``Cutout(n_holes=1, length=16)`` on 32-px
    images, which multiplies the tensor image by 0).

    Args:
        x: Float batch (N, C, H, W).
        generator: Optional generator for the centres.
        size_frac: Side of the square as a fraction of the smaller image side.
        fill: Value written inside the square.

    Returns:
        A new batch with the squares filled.
    """
    n, _, h, w = x.shape
    side = int(round(size_frac * min(h, w)))
    r = _rand((2, n), generator, x.device)
    y0 = ((r[0] * h).floor() - side // 2).view(n, 1, 1)
    x0 = ((r[1] * w).floor() - side // 2).view(n, 1, 1)
    ii = torch.arange(h, device=x.device).view(1, h, 1)
    jj = torch.arange(w, device=x.device).view(1, 1, w)
    inside = (ii >= y0) & (ii < y0 + side) & (jj >= x0) & (jj < x0 + side)
    return torch.where(inside.unsqueeze(1), torch.full_like(x, fill), x)


def _check_style(style: str) -> None:
    if style not in STYLES:
        raise ValueError(f"unknown augmentation style {style!r}; valid: {list(STYLES)}")


def weak_view(
    x: torch.Tensor,
    generator: torch.Generator | None = None,
    style: str = "official",
    photo: bool = False,
) -> torch.Tensor:
    """The weak training view of a batch (see the module docstring).

    Args:
        x: Float batch (N, 3, H, W) in [0, 1].
        generator: Optional generator for the draws.
        style: ``"official"`` (digits: none; photos: flip and translation) or ``"legacy"``
            (``weak(x, generator)``, the same draws).
        photo: Photo dataset (official style only): random flip and translation.

    Returns:
        The augmented batch (a new tensor).

    Raises:
        ValueError: For an unknown ``style``.
    """
    _check_style(style)
    if style == "legacy":
        return weak(x, generator)
    if not photo:
        return x.clone()
    return weak(x, generator, hflip=True)


def strong_view(
    x: torch.Tensor,
    generator: torch.Generator | None = None,
    style: str = "official",
    photo: bool = False,
) -> torch.Tensor:
    """The strong training view of a batch (see the module docstring).

    The official view draws, in order: one flip per image (:func:`hflip_random`), then for each
    of the 2 rounds one op index per image (uniform over :data:`FIXMATCH_OPS`) and one magnitude
    per image (uniform in [0, 1), see :func:`apply_fixmatch_op`), then the Cutout centres
    (:func:`cutout_fixed`, black square of half the side). Images sharing an op are processed
    together.

    Args:
        x: Float batch (N, 3, H, W) in [0, 1].
        generator: Optional generator for the draws.
        style: ``"official"`` or ``"legacy"`` (``strong(x, generator)``, the same draws).
        photo: Photo dataset; the official strong view is the same for digits and photos (the
            authors' digits strong transform flips too).

    Returns:
        The augmented batch (a new tensor) in [0, 1].

    Raises:
        ValueError: For an unknown ``style``.
    """
    _check_style(style)
    if style == "legacy":
        return strong(x, generator)
    out = hflip_random(x, generator)
    n = out.shape[0]
    for _ in range(2):
        ops = _randint(len(FIXMATCH_OPS), (n,), generator, out.device)
        mags = _rand((n,), generator, out.device)
        for k, op in enumerate(FIXMATCH_OPS):
            if op == "identity":
                continue
            idx = (ops == k).nonzero().squeeze(1)
            if idx.numel() == 0:
                continue
            out[idx] = apply_fixmatch_op(out[idx], op, mags[idx], fill=0.5)
    return cutout_fixed(out, generator, size_frac=0.5, fill=0.0)
