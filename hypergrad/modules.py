"""``HyperStep``: implicit hypergradients over ``nn.Module`` parameters (what BORT2 uses).

The inner model's parameters play ``psi`` (taken at their current values, an approximate inner
solution) and the hyper module's parameters play ``theta``. The user's losses receive the live
modules and may call any of their methods. Policies:

* Buffers: with ``buffers="freeze"`` (default) every buffer of both modules (BatchNorm running
  statistics, ``num_batches_tracked``) is swapped for a private copy during the hypergradient's own
  forward passes, so the running statistics after the step are bit-for-bit what they were before
  (BatchNorm in train mode still normalises with batch statistics). ``"update"`` lets those passes
  update the statistics as an ordinary forward would.
* Randomness: dropout masks, Gumbel noise and any other draw inside the inner loss are identical
  for every Hessian-vector product of one hypergradient (see :mod:`hypergrad.operators`).
* Gradients: the hypergradient is written to (or, with ``accumulate=True``, added to) the
  ``.grad`` of the hyper parameters; the inner model's ``.grad`` is never touched.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from .errors import HypergradTypeError, HypergradValueError
from .implicit import HypergradInfo, _check_solver, hypergradient_core
from .solvers import Solver
from .tree import Tensors, tree_norm

BUFFER_POLICIES = ("freeze", "update")


@contextlib.contextmanager
def frozen_buffers(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Swap every buffer of ``modules`` for a clone for the duration of the block.

    In-place updates made inside the block (BatchNorm's running statistics) land on the clones;
    the original buffer tensors are restored, untouched, on exit.

    Example:
        >>> bn = nn.BatchNorm1d(2)
        >>> with frozen_buffers([bn]):
        ...     _ = bn(torch.randn(4, 2))
        >>> bn.running_mean
        tensor([0., 0.])
    """
    saved: list[tuple[nn.Module, str, torch.Tensor]] = []
    seen: set[int] = set()
    try:
        for root in modules:
            for mod in root.modules():
                if id(mod) in seen:
                    continue
                seen.add(id(mod))
                for name, buf in list(mod._buffers.items()):
                    if buf is not None:
                        saved.append((mod, name, buf))
                        mod._buffers[name] = buf.clone()
        yield
    finally:
        for mod, name, buf in saved:
            mod._buffers[name] = buf


def _hyper_tensors(
    hyper: nn.Module | Sequence[torch.Tensor],
) -> tuple[list[str], list[torch.Tensor]]:
    if isinstance(hyper, nn.Module):
        named = [(n, p) for n, p in hyper.named_parameters() if p.requires_grad]
        if not named:
            raise HypergradValueError(
                "hyper module has no parameters that require grad: nothing to differentiate"
            )
        return [f"hyper.{n}" for n, _ in named], [p for _, p in named]
    if isinstance(hyper, torch.Tensor):
        hyper = [hyper]
    tensors = list(hyper)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise HypergradTypeError(f"hyper[{i}] must be a tensor, got {type(t).__name__}")
        if not t.is_leaf or not t.requires_grad:
            raise HypergradValueError(
                f"hyper[{i}] must be a leaf tensor with requires_grad=True (its .grad receives "
                "the hypergradient)"
            )
    if not tensors:
        raise HypergradValueError("hyper is empty: pass an nn.Module or a list of tensors")
    return [f"hyper[{i}]" for i in range(len(tensors))], tensors


class HyperStep:
    """Implicit hypergradient of nn.Module parameters, written into the hyper ``.grad``.

    Args:
        inner: the inner model ``psi`` (its trainable parameters, at their current values).
        hyper: the hyper module ``theta`` (or a list of leaf tensors requiring grad).
        inner_loss: ``(inner, batch) -> scalar``; may call ``hyper`` (e.g. a label network).
        outer_loss: ``(inner, batch) -> scalar``.
        solver: linear solver (default ``hg.Neumann(steps=3, alpha=None)`` is *not* assumed:
            default ``hg.CG()``).
        buffers: ``"freeze"`` (running statistics untouched) or ``"update"``.
        engine: ``"reuse"`` or ``"recompute"``.
        clip_norm: if set, rescale the hypergradient to at most this global norm.
        accumulate: add to ``.grad`` instead of overwriting it.
        distributed: None, ``"exact"`` or ``"local"`` (see :mod:`hypergrad.distributed`).

    Example:
        >>> import hypergrad as hg
        >>> model, labeler = nn.Linear(4, 3), nn.Linear(4, 3)
        >>> x = torch.randn(8, 4)
        >>> inner = lambda m, b: ((m(b) - labeler(b)) ** 2).mean() + 1e-2 * (m.weight ** 2).sum()
        >>> outer = lambda m, b: (m(b) ** 2).mean()
        >>> step = hg.HyperStep(model, labeler, inner, outer, solver=hg.CG(maxiter=20))
        >>> info = step(x)
        >>> labeler.weight.grad.shape
        torch.Size([3, 4])
    """

    def __init__(
        self,
        inner: nn.Module,
        hyper: nn.Module | Sequence[torch.Tensor],
        inner_loss: Callable[[nn.Module, Any], torch.Tensor],
        outer_loss: Callable[[nn.Module, Any], torch.Tensor],
        solver: Solver | None = None,
        buffers: str = "freeze",
        engine: str = "reuse",
        clip_norm: float | None = None,
        accumulate: bool = False,
        distributed: str | None = None,
    ):
        if not isinstance(inner, nn.Module):
            raise HypergradTypeError(f"inner must be an nn.Module, got {type(inner).__name__}")
        if not callable(inner_loss) or not callable(outer_loss):
            raise HypergradTypeError("inner_loss and outer_loss must be callables (model, batch)")
        if buffers not in BUFFER_POLICIES:
            raise HypergradValueError(f"buffers must be one of {BUFFER_POLICIES}, got {buffers!r}")
        from .operators import ENGINES

        if engine not in ENGINES:
            raise HypergradValueError(f"engine must be one of {ENGINES}, got {engine!r}")
        if clip_norm is not None and not clip_norm > 0:
            raise HypergradValueError(f"clip_norm must be > 0 or None, got {clip_norm!r}")
        self.inner, self.hyper = inner, hyper
        self.inner_loss, self.outer_loss = inner_loss, outer_loss
        self.solver = _check_solver(solver)
        self.buffers, self.engine = buffers, engine
        self.clip_norm, self.accumulate, self.distributed = clip_norm, accumulate, distributed
        named = [(n, p) for n, p in inner.named_parameters() if p.requires_grad]
        if not named:
            raise HypergradValueError("inner model has no parameters that require grad")
        self.psi_names = [f"inner.{n}" for n, _ in named]
        self.psi = tuple(p for _, p in named)
        self.theta_names, theta = _hyper_tensors(hyper)
        self.theta = tuple(theta)
        shared = {id(p) for p in self.psi} & {id(t) for t in self.theta}
        if shared:
            raise HypergradValueError("inner and hyper share parameters; they must be disjoint")

    def compute(self, batch: Any, outer_batch: Any = None) -> tuple[Tensors, HypergradInfo]:
        """Return the hypergradient (one tensor per hyper parameter) without touching ``.grad``."""
        outer_batch = batch if outer_batch is None else outer_batch
        modules = [self.inner] + ([self.hyper] if isinstance(self.hyper, nn.Module) else [])
        ctx = frozen_buffers(modules) if self.buffers == "freeze" else contextlib.nullcontext()
        reduce = None
        if self.distributed is not None:
            from .distributed import make_reducer

            reduce = make_reducer(self.distributed)
        with ctx:
            hyper, info = hypergradient_core(
                lambda ps, hs: self.inner_loss(self.inner, batch),
                lambda ps, hs: self.outer_loss(self.inner, outer_batch),
                self.psi,
                self.theta,
                self.solver,
                self.engine,
                psi_names=self.psi_names,
                theta_names=self.theta_names,
                reduce=reduce,
            )
        if self.distributed == "local":
            from .distributed import all_reduce_mean

            hyper = all_reduce_mean(hyper)
        return hyper, info

    def __call__(self, batch: Any, outer_batch: Any = None) -> HypergradInfo:
        """Compute the hypergradient on ``batch`` and write it to the hyper ``.grad``.

        Args:
            batch: passed to ``inner_loss`` (and to ``outer_loss`` unless ``outer_batch`` is set).
            outer_batch: optional separate batch for the outer loss (e.g. a validation split).

        Returns:
            :class:`~hypergrad.HypergradInfo` (solver diagnostics, norms, clipping, time).
        """
        t0 = time.perf_counter()
        hyper, info = self.compute(batch, outer_batch)
        if self.clip_norm is not None:
            norm = float(tree_norm(hyper))
            if norm > self.clip_norm:
                scale = self.clip_norm / (norm + 1e-12)
                hyper = tuple(h * scale for h in hyper)
                info.clipped = True
        for t, h in zip(self.theta, hyper):
            h = h.to(t.dtype)
            if self.accumulate and t.grad is not None:
                t.grad.add_(h)
            else:
                t.grad = h.clone()
        info.time_s = time.perf_counter() - t0
        return info
