"""Training the pipeline on several processes: ``torchrun`` + ``DistributedDataParallel``.

``torchrun --nproc_per_node=N examples/bort2/run.py ...`` starts N processes (ranks); each one
runs every stage. What is split and what is reduced, per iteration:

* **Batches.** Every rank draws the *global* batch (the configured batch size) from the same
  seeded sampler and makes the same augmentation draws on it, then keeps its own rows: from
  each per-domain block of ``k`` rows, rows ``rank * k/N ... (rank + 1) * k/N - 1``
  (:func:`shard_rows`). The network's forward and backward, the expensive part, run on the
  rank's rows only; reading and augmenting the global batch is repeated on every rank, which
  keeps every draw equal to a one-process run's.
* **Gradients.** The trained network is wrapped in ``DistributedDataParallel``
  (:func:`wrap_ddp`), which averages gradients across ranks in the backward pass: with losses
  that are means over equal-sized local batches, that is the gradient of the global batch.
* **BatchNorm.** ``model.sync_bn=true`` replaces every BatchNorm by :class:`GlobalBatchNorm`,
  which normalises with the statistics of the global batch (two differentiable all-reduces;
  works with gloo on CPUs and NCCL on GPUs, unlike ``nn.SyncBatchNorm``, which needs a GPU).
  Without it each rank normalises with its own rows, as DDP does by default.
* **Random draws inside the network** (dropout masks, the stochastic layer's noise): under
  :func:`global_rows` they are drawn for the global batch and each rank keeps its rows
  (:func:`row_draw`), so they equal a one-process run's too.
* **Pseudo-labels and the adaptive threshold** are computed by every rank on the global batch
  (the teacher's forward pass is repeated), so tau and the masks are identical everywhere.
* **The hyper step** uses ``HyperStep(distributed="exact")``: every product is all-reduced and
  the hypergradient is that of the global batch.
* **Logs and decisions.** What is logged is the global batch's: values each rank computes on
  its own rows are averaged over the ranks (:func:`mean_over_ranks`) or gathered back into the
  global order (:func:`gather_rows`) before a global mask or label indexes them; a non-finite
  loss stops every rank together.
* **Files.** Only rank 0 writes checkpoints, results and TensorBoard logs; all ranks read them
  (``resume=true`` works under torchrun).

Outside torchrun (``WORLD_SIZE`` unset or 1) nothing here changes what a run computes.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "DistEnv",
    "GlobalBatchNorm",
    "barrier",
    "broadcast_buffers",
    "convert_batchnorm",
    "environment",
    "gather_rows",
    "global_rows",
    "mean_over_ranks",
    "row_draw",
    "rowwise",
    "shard_rows",
    "wrap_ddp",
]


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job: ``rank`` of ``world`` processes (``local_rank`` on its
    machine)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def active(self) -> bool:
        """More than one process."""
        return self.world > 1

    @property
    def main(self) -> bool:
        """Rank 0: the process that writes files."""
        return self.rank == 0


def launched_by_torchrun() -> bool:
    """True when the environment says this process is one of several (``WORLD_SIZE > 1``)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def environment(device: str = "auto") -> DistEnv:
    """The job's :class:`DistEnv`, initialising the process group under torchrun.

    The backend is NCCL when the run uses CUDA, gloo otherwise. Without torchrun (or with an
    already initialised group) nothing is initialised here.
    """
    if dist.is_available() and dist.is_initialized():
        return DistEnv(dist.get_rank(), dist.get_world_size(), _local_rank())
    if not launched_by_torchrun():
        return DistEnv()
    cuda = device != "cpu" and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(_local_rank())
    dist.init_process_group("nccl" if cuda else "gloo")
    return DistEnv(dist.get_rank(), dist.get_world_size(), _local_rank())


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def current() -> DistEnv:
    """The :class:`DistEnv` of an initialised process group (single process otherwise)."""
    if dist.is_available() and dist.is_initialized():
        return DistEnv(dist.get_rank(), dist.get_world_size(), _local_rank())
    return DistEnv()


def barrier(env: DistEnv) -> None:
    """Wait for every rank (no-op in one process)."""
    if env.active:
        dist.barrier()


def shutdown() -> None:
    """Destroy the process group if this module's :func:`environment` created one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- batches
def shard_rows(n: int, blocks: int, env: DistEnv, what: str = "batch") -> torch.Tensor | None:
    """Global indices of this rank's rows of an ``n``-row batch made of ``blocks`` equal blocks.

    From each block of ``k = n / blocks`` rows the rank takes ``k / world`` consecutive rows.
    Returns None in one process (every row is local).

    Raises:
        ValueError: ``k`` is not divisible by the number of processes (naming ``what``).
    """
    if not env.active:
        return None
    k = n // blocks
    if k * blocks != n or k % env.world:
        raise ValueError(
            f"the {what} has {k} rows per block, which {env.world} processes cannot split "
            f"evenly: choose a batch size divisible by {env.world}"
        )
    m = k // env.world
    start = torch.arange(blocks) * k + env.rank * m
    return (start[:, None] + torch.arange(m)[None, :]).reshape(-1)


def take(t: torch.Tensor | None, rows: torch.Tensor | None) -> torch.Tensor | None:
    """``t``'s rows ``rows`` (``t`` itself when ``rows`` is None)."""
    if t is None or rows is None:
        return t
    return t.index_select(0, rows.to(t.device))


def gather_rows(
    t: torch.Tensor, rows: torch.Tensor | None, n: int, env: DistEnv, blocks: int = 1
) -> torch.Tensor:
    """The global batch of a tensor that each rank holds for its rows: every rank's ``t`` (its
    rows ``rows`` of an ``n``-row batch of ``blocks`` blocks, :func:`shard_rows`) put back in
    the global order, on every rank. ``t`` itself in one process (``rows`` None).

    What a logging or evaluation branch must use before it indexes a local result (the
    student's sigma, its logits) with a mask or labels of the global batch.
    """
    if rows is None or not env.active:
        return t
    t = t.detach().contiguous()
    parts = [torch.empty_like(t) for _ in range(env.world)]
    dist.all_gather(parts, t)
    out = t.new_empty((n, *t.shape[1:]))
    for rank, part in enumerate(parts):
        idx = shard_rows(n, blocks, DistEnv(rank, env.world))
        out.index_copy_(0, idx.to(out.device), part)
    return out


def mean_over_ranks(
    values: dict[str, float], env: DistEnv, device: torch.device | None = None
) -> dict[str, float]:
    """Each value averaged over the ranks (``values`` itself in one process).

    For logged scalars that each rank computes on its own rows: a mean over equal-sized local
    batches averaged over the ranks is the mean over the global batch. Every rank must call it
    with the same keys, at the same iteration (it is one all-reduce).
    """
    if not env.active or not values:
        return values
    keys = sorted(values)
    buf = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(buf)
    buf /= env.world
    mean = dict(zip(keys, buf.tolist()))
    return {k: float(mean[k]) for k in values}


_ROWS: list[tuple[torch.Tensor, int]] = []


@contextlib.contextmanager
def global_rows(rows: torch.Tensor | None, n: int) -> Iterator[None]:
    """Inside the block, :func:`row_draw` draws for ``n`` global rows and keeps ``rows``.

    A no-op when ``rows`` is None (one process).
    """
    if rows is None:
        yield
        return
    _ROWS.append((rows, n))
    try:
        yield
    finally:
        _ROWS.pop()


def row_draw(shape: torch.Size, draw: Callable[[tuple[int, ...]], torch.Tensor]) -> torch.Tensor:
    """``draw(shape)``, or, under :func:`global_rows` with ``shape[0]`` equal to the number of
    local rows, this rank's rows of ``draw((n, *shape[1:]))``: the random numbers a one-process
    run makes for these rows."""
    if _ROWS:
        rows, n = _ROWS[-1]
        if len(shape) and shape[0] == len(rows):
            full = draw((n, *shape[1:]))
            return full.index_select(0, rows.to(full.device))
    return draw(tuple(shape))


def rowwise(x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``fn(x)`` for a row-wise ``fn`` that draws random numbers for its input's shape (e.g. a
    generator-driven Gumbel-softmax): under :func:`global_rows`, ``fn`` runs on a global-batch
    tensor holding ``x`` in this rank's rows (zeros elsewhere, differentiable in ``x``), so its
    draws for these rows are a one-process run's, and this rank's rows are returned."""
    if _ROWS:
        rows, n = _ROWS[-1]
        if len(x) == len(rows):
            rows = rows.to(x.device)
            full = x.new_zeros((n, *x.shape[1:])).index_copy(0, rows, x)
            return fn(full).index_select(0, rows)
    return fn(x)


class RowDropout(nn.Dropout):
    """``nn.Dropout`` whose mask comes from :func:`row_draw` (the same numbers as
    ``nn.Dropout`` on the CPU in one process: ``bernoulli_(1 - p)`` on the input's shape)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if not _ROWS:
            return nn.functional.dropout(x, self.p, True, self.inplace)
        keep = 1.0 - self.p
        noise = row_draw(
            x.shape, lambda s: torch.empty(s, dtype=x.dtype, device=x.device).bernoulli_(keep)
        )
        return x * noise.div_(keep)


# ----------------------------------------------------------------------------- BatchNorm
class GlobalBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm over the global batch of all ranks (1-D or 2-D inputs alike).

    In training mode under an active process group, the mean and the biased variance that
    normalise the input are those of every rank's rows together (a differentiable all-reduce of
    the per-channel sums, then of the squared deviations), and the running statistics are
    updated with them (unbiased variance, as ``nn.BatchNorm``). Otherwise it is an ordinary
    BatchNorm. State-dict keys are those of ``nn.BatchNorm1d/2d``.
    """

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2-D input, got {x.dim()}-D")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return super().forward(x)
        dims = [0, *range(2, x.dim())]
        view = [1, -1] + [1] * (x.dim() - 2)
        count = torch.tensor([x.numel() // x.shape[1]], dtype=torch.float64, device=x.device)
        dist.all_reduce(count, group=_bn_group())
        n = float(count)
        mean = _all_reduce_sum(x.sum(dims)) / n
        centered = x - mean.view(view)
        var = _all_reduce_sum((centered * centered).sum(dims)) / n
        y = centered * torch.rsqrt(var + self.eps).view(view)
        if self.affine:
            y = y * self.weight.view(view) + self.bias.view(view)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                m = (
                    1.0 / float(self.num_batches_tracked)
                    if self.momentum is None
                    else self.momentum
                )
                self.running_mean.mul_(1 - m).add_(mean.detach(), alpha=m)
                unbiased = var.detach() * (n / max(n - 1.0, 1.0))
                self.running_var.mul_(1 - m).add_(unbiased, alpha=m)
        return y


_GROUP: dict[int, Any] = {}  # id of the default group -> the BatchNorm group made under it


def _bn_group() -> Any:
    """A process group of its own for the BatchNorm all-reduces, so that they never interleave
    with DistributedDataParallel's asynchronous gradient all-reduces on the default group (made
    again when the default group was destroyed and initialised anew)."""
    key = id(dist.group.WORLD)
    if key not in _GROUP:
        _GROUP.clear()
        _GROUP[key] = dist.new_group()
    return _GROUP[key]


def _all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Differentiable all-reduce (sum): its backward all-reduces the gradient, to any order."""
    from torch.distributed.nn.functional import all_reduce

    with warnings.catch_warnings():  # deprecated for the compiler's functional collectives,
        warnings.simplefilter("ignore", FutureWarning)  # which have no autograd rule yet
        return all_reduce(t, group=_bn_group())


def convert_batchnorm(module: nn.Module) -> nn.Module:
    """Replace every ``nn.BatchNorm1d/2d`` of ``module`` by a :class:`GlobalBatchNorm` holding
    the same parameters and buffers (returns the converted module)."""
    if isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d)) and not isinstance(
        module, GlobalBatchNorm
    ):
        like = next(iter(module.state_dict().values()))
        ref = module.running_mean if module.running_mean is not None else like
        new = GlobalBatchNorm(
            module.num_features, module.eps, module.momentum, module.affine,
            module.track_running_stats, device=ref.device, dtype=ref.dtype,
        )  # fmt: skip
        new.load_state_dict(module.state_dict())
        new.train(module.training)
        return new
    for name, child in module.named_children():
        setattr(module, name, convert_batchnorm(child))
    return module


# ----------------------------------------------------------------------------- models
class LossModule(nn.Module):
    """``forward(fn, *args) = fn(net, *args)``: lets ``DistributedDataParallel`` wrap a network
    whose loss is computed by a function (or a method other than ``forward``)."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(self.net, *args)


def wrap_ddp(net: nn.Module, env: DistEnv, device: torch.device) -> nn.Module | None:
    """``DistributedDataParallel(LossModule(net))`` under torchrun; None in one process.

    Call it as ``ddp(fn, *args)`` with ``fn(net, *args) -> loss`` (or ``(loss, extras)``).
    """
    if not env.active:
        return None
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(LossModule(net), device_ids=ids, find_unused_parameters=True)


def call_loss(ddp: nn.Module | None, net: nn.Module, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(net, *args)`` through the DDP wrapper when there is one."""
    return fn(net, *args) if ddp is None else ddp(fn, *args)


@torch.no_grad()
def broadcast_buffers(module: nn.Module, env: DistEnv) -> None:
    """Copy rank 0's buffers (BatchNorm running statistics) to every rank."""
    if not env.active:
        return
    for buf in module.buffers():
        dist.broadcast(buf, src=0)
