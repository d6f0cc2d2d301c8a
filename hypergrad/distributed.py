"""All-reduce helpers for pytrees under ``torch.distributed``.

Two modes for implicit hypergradients when every rank holds its own shard of the batch and the
losses are means over equal-sized local batches:

* ``"exact"``: every product (right-hand side, each Hessian-vector product, the mixed product and
  the direct gradient) is averaged over ranks, so every rank runs the same solve as one process
  on the global batch would (one all-reduce per product).
* ``"local"``: each rank solves with its local Hessian and the final hypergradients are averaged
  (one all-reduce in total; an approximation, since the mean of inverses is not the inverse of
  the mean).

Without an initialised process group both modes reduce to the single-process computation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .errors import HypergradValueError
from .tree import Tensors, tree_ravel, tree_unravel

MODES = ("exact", "local")


def is_distributed() -> bool:
    """True when a ``torch.distributed`` process group with more than one rank is active."""
    return (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size() > 1
    )


def all_reduce_mean(tree: Tensors) -> Tensors:
    """Average a flat pytree over all ranks (one fused all-reduce; identity without a group).

    Example:
        >>> all_reduce_mean((torch.ones(2),))  # single process: unchanged
        (tensor([1., 1.]),)
    """
    if not is_distributed() or not tree:
        return tree
    flat = tree_ravel(tree, torch.promote_types(tree[0].dtype, torch.float32))
    torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.SUM)
    flat /= torch.distributed.get_world_size()
    return tree_unravel(flat, tree)


def all_gather_status(
    code: int, value: float, device: torch.device
) -> list[tuple[int, float]] | None:
    """Every rank's ``(code, value)``, known to every rank (None without a process group).

    One all-reduce of ``2 * world_size`` float64 numbers on ``device`` (a CUDA device under
    NCCL): each rank fills its own two slots and the sum hands every rank all of them. What
    :class:`~hypergrad.HyperStep` uses to decide collectively whether a result is a
    hypergradient (``code``: 0 when it is, else which failure; ``value``: the relative residual).

    Example:
        >>> all_gather_status(0, 1e-9, torch.device("cpu")) is None  # single process
        True
    """
    if not is_distributed():
        return None
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    flat = torch.zeros(2 * world, dtype=torch.float64, device=device)
    flat[rank], flat[world + rank] = float(code), float(value)
    torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.SUM)
    both = flat.cpu().tolist()
    return [(int(both[r]), float(both[world + r])) for r in range(world)]


def check_mode(mode: object) -> str | None:
    """Validate a ``distributed=`` argument (None, ``"exact"`` or ``"local"``) and return it.

    Raises:
        HypergradValueError: any other value.
    """
    if mode is not None and mode not in MODES:
        raise HypergradValueError(f"distributed must be None or one of {MODES}, got {mode!r}")
    return mode


def make_reducer(mode: str | None) -> Callable[[Tensors], Tensors] | None:
    """Reducer applied to every product in ``"exact"`` mode; None in ``"local"`` mode and for
    None (a single process)."""
    check_mode(mode)
    return all_reduce_mean if mode == "exact" else None
