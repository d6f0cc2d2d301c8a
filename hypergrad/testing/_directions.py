"""The directions a check differences along: drawn, labelled, flattened and refused."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import HypergradValueError
from ._settings import ALL_COORDINATES_UP_TO, DEFAULT_RANDOM_DIRECTIONS

#: One direction: its label and one tensor per hyperparameter leaf.
Direction = tuple[str, list[torch.Tensor]]


def _index_label(name: str, shape: torch.Size, flat: int) -> str:
    if len(shape) == 0:
        return name
    idx = []
    for s in reversed(shape):
        idx.append(flat % s)
        flat //= s
    return f"{name}[{', '.join(str(i) for i in reversed(idx))}]"


def _coordinates(theta: list[torch.Tensor], names: list[str]) -> list[Direction]:
    out = []
    for i, (t, n) in enumerate(zip(theta, names)):
        for j in range(t.numel()):
            d = [torch.zeros_like(s) for s in theta]
            d[i].view(-1)[j] = 1.0
            out.append((_index_label(n, t.shape, j), d))
    return out


def _random(theta: list[torch.Tensor], count: int, seed: int) -> list[Direction]:
    numel = sum(t.numel() for t in theta)
    gen = torch.Generator().manual_seed(int(seed))
    out = []
    for k in range(count):
        v = torch.randn(numel, generator=gen, dtype=torch.float64)
        v = v / v.norm()
        d, i = [], 0
        for t in theta:
            d.append(v[i : i + t.numel()].reshape(t.shape).to(dtype=t.dtype, device=t.device))
            i += t.numel()
        out.append((f"random #{k}", d))
    return out


def draw_directions(
    theta: list[torch.Tensor],
    names: list[str],
    directions: Any,
    seed: int,
    flatten_given: Callable[[Any, int], list[torch.Tensor]],
) -> tuple[str, list[Direction]]:
    """``(kind, [(label, d), ...])`` for the ``directions`` argument of a check."""
    if directions is None:
        numel = sum(t.numel() for t in theta)
        directions = "all" if numel <= ALL_COORDINATES_UP_TO else DEFAULT_RANDOM_DIRECTIONS
    if isinstance(directions, str):
        if directions != "all":
            raise HypergradValueError(
                f"directions must be None, 'all', an int >= 1 or a sequence of directions, got "
                f"{directions!r}"
            )
        return "coordinates", _coordinates(theta, names)
    if isinstance(directions, numbers.Integral) and not isinstance(directions, bool):
        if directions < 1:
            raise HypergradValueError(f"directions must be >= 1, got {directions}")
        return "random", _random(theta, int(directions), seed)
    if isinstance(directions, Sequence) and len(directions) > 0:
        return "given", [(f"direction #{k}", flatten_given(d, k)) for k, d in enumerate(directions)]
    raise HypergradValueError(
        "directions must be None, 'all', an int >= 1 or a non-empty sequence of directions, got "
        f"{type(directions).__name__}"
    )


def check_directions(theta: list[torch.Tensor], dirs: list[Direction], eps: float) -> None:
    """Refuse directions that are zero, not finite, or so small that ``theta +- eps d`` is
    ``theta`` up to rounding (the differences would be noise and every comparison below atol)."""
    scale = max([1.0] + [float(t.detach().abs().max()) for t in theta if t.numel()])
    unit = max(torch.finfo(t.dtype).eps for t in theta)
    for label, d in dirs:
        size = max((float(v.detach().abs().max()) for v in d if v.numel()), default=0.0)
        finite = all(bool(torch.isfinite(v).all()) for v in d)
        if not finite or size == 0.0:
            raise HypergradValueError(
                f"{label} is {'not finite' if not finite else 'zero'}: a direction must be a "
                "non-zero finite pytree like hparams"
            )
        if eps * size < 100 * unit * scale:
            raise HypergradValueError(
                f"{label} is degenerate: its largest entry is {size:.1e}, so the step eps * d "
                f"({eps * size:.1e}) is lost in the rounding of hparams (|hparams| up to "
                f"{scale:.1e}, machine eps {unit:.1e}) and every comparison would be below atol; "
                "directions are used as given, not normalised: scale it up (e.g. to unit norm)"
            )


def flatten_like(
    tree: Any, theta: list[torch.Tensor], spec: Any, what: str, to_flat: Callable[[Any], Any]
) -> list[torch.Tensor]:
    """Flatten ``tree`` and check it has the structure and shapes of ``theta``."""
    leaves, tspec = to_flat(tree)
    if (spec is not None and tspec != spec) or len(leaves) != len(theta):
        raise HypergradValueError(
            f"{what} must have the structure of hparams ({len(theta)} tensors), got {tspec!r}"
        )
    out = []
    for i, (a, t) in enumerate(zip(leaves, theta)):
        if not isinstance(a, torch.Tensor) or a.shape != t.shape:
            shape = tuple(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__
            raise HypergradValueError(
                f"{what}: leaf {i} has shape {shape}, expected {tuple(t.shape)}"
            )
        out.append(a.detach().to(dtype=t.dtype, device=t.device))
    return out
