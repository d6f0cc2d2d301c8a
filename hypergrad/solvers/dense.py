"""Dense columns of an operator given only as a product: :func:`dense_matrix` (Exact, Nystrom,
the dense preconditioner), built one product per column or in measured batches."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from ..tree import Tensors, tree_numel, tree_ravel, tree_unravel
from .base import MatVec, nonfinite_product_error


def dense_matrix(
    matvec: MatVec, like: Tensors, columns: Sequence[int] | None = None, solver: str = "dense"
) -> torch.Tensor:
    """Materialise columns of the operator as a dense float64 matrix over *all* leaves.

    Column ``j`` is ``matvec(e_j)`` (one product each), flattened over every leaf of ``like``:
    off-diagonal blocks between leaves are kept (a block-diagonal approximation would silently
    give wrong answers for coupled parameters). When ``matvec`` has a ``batched`` method
    (``V -> A V`` over a leading batch dimension, or None when it cannot batch), the columns after
    the first two come from batched products (chunks of :data:`COLUMN_CHUNK`) when a probe batch
    of :data:`PROBE_COLUMNS` columns beats as many single products (:func:`batching_pays`; the
    numbers agree with the one-by-one products to rounding).

    Args:
        matvec: ``v -> A v`` on flat pytrees shaped like ``like``.
        like: a flat pytree fixing the shapes, dtype and device of the unit vectors.
        columns: the indices ``j`` to compute, in order (None: all ``n``, the full matrix).
        solver: the caller's name for the error message.

    Returns:
        a float64 tensor of shape ``(n, len(columns))`` (``(n, n)`` for all columns).

    Raises:
        HypergradValueError: a column has NaN/Inf (the message names it).

    Example:
        >>> A = torch.tensor([[2.0, 1.0], [1.0, 3.0]])
        >>> dense_matrix(lambda v: (A @ v[0],), (torch.zeros(2),), columns=[1])
        tensor([[1.],
                [3.]], dtype=torch.float64)
    """
    n = tree_numel(like)
    ref = like[0]
    idx = list(range(n) if columns is None else [int(j) for j in columns])

    def column(j: int) -> torch.Tensor:
        e = torch.zeros(n, dtype=ref.dtype, device=ref.device)
        e[j] = 1.0
        return tree_ravel(matvec(tree_unravel(e, like)), torch.float64)

    cols: list[torch.Tensor] = []
    batched = getattr(matvec, "batched", None)
    if callable(batched) and len(idx) > 2 + PROBE_COLUMNS:
        cols.append(column(idx[0]))  # warms up
        _sync(ref)
        t0 = time.perf_counter()
        cols.append(column(idx[1]))
        t_one = _elapsed(t0, ref)
        t0 = time.perf_counter()
        probe = batched_columns(batched, like, idx[2 : 2 + PROBE_COLUMNS])
        t_batch = _elapsed(t0, ref)
        if probe is not None:
            cols.extend(probe.unbind(1))
            if batching_pays(t_one, t_batch, PROBE_COLUMNS):
                rest = batched_columns(batched, like, idx[len(cols) :])
                cols.extend(() if rest is None else rest.unbind(1))
    cols.extend(column(j) for j in idx[len(cols) :])
    mat = torch.stack(cols, dim=1) if cols else torch.zeros(n, 0, dtype=torch.float64)
    bad = (~torch.isfinite(mat)).any(dim=0).nonzero()
    if len(bad):
        j = idx[int(bad[0])]
        raise nonfinite_product_error(solver, f"column {j} (unit vector e_{j})")
    return mat


#: Columns per batched product in :func:`dense_matrix` (bounds the memory of one batch).
COLUMN_CHUNK = 256
#: Columns in :func:`dense_matrix`'s probe batch, which decides whether batching pays.
PROBE_COLUMNS = 8


def batching_pays(t_one: float, t_batch: float, k: int) -> bool:
    """Whether :func:`dense_matrix` builds the remaining columns in batches: a batch of ``k``
    columns took ``t_batch`` s against ``t_one`` s for one product.

    A batched backward pass saves the per-product overhead but can cost several times the flops
    of the products it replaces (``vmap`` expands some intermediates by the batch size): the 30
    columns of a ridge Hessian took 1.61 ms batched vs 2.28 ms one by one on 500 x 30 data, but
    100 ms vs 18 ms on 50,000 x 30 (one CPU thread; the table in docs/solvers.md). The numbers
    agree to rounding either way.
    """
    return t_batch < k * t_one


def _sync(ref: torch.Tensor) -> None:
    """Wait until the device of ``ref`` has finished its queued work (nothing on a CPU)."""
    if ref.is_cuda:
        torch.cuda.synchronize(ref.device)


def _elapsed(t0: float, ref: torch.Tensor) -> float:
    """Seconds since ``t0``, once the device of ``ref`` has finished its queued work."""
    _sync(ref)
    return time.perf_counter() - t0


def batched_columns(
    batched: Callable[[Tensors], Tensors | None], like: Tensors, idx: list[int]
) -> torch.Tensor | None:
    """Columns ``idx`` of the operator from batched products (``batched(V) -> A V`` over a
    leading batch dimension, or None when it cannot batch), in chunks of
    :data:`COLUMN_CHUNK`; None when the operator cannot batch."""
    n = tree_numel(like)
    ref = like[0]
    blocks = []
    for start in range(0, len(idx), COLUMN_CHUNK):
        chunk = idx[start : start + COLUMN_CHUNK]
        eye = torch.zeros(len(chunk), n, dtype=ref.dtype, device=ref.device)
        eye[torch.arange(len(chunk)), torch.tensor(chunk, dtype=torch.long)] = 1.0
        vs = []
        offset = 0
        for t in like:
            vs.append(eye[:, offset : offset + t.numel()].reshape(len(chunk), *t.shape))
            offset += t.numel()
        out = batched(tuple(vs))
        if out is None:
            return None
        flat = torch.cat([o.reshape(len(chunk), -1).to(torch.float64) for o in out], dim=1)
        blocks.append(flat.T)
    return torch.cat(blocks, dim=1) if blocks else torch.zeros(n, 0, dtype=torch.float64)
