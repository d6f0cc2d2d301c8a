"""The minibatch oracles of a bilevel problem, and the samplers that pick its batches.

For ``min_x h(x) = F(z*(x), x)`` with ``z*(x) = argmin_z G(z, x)``, the user gives the minibatch
losses ``inner_loss(z, x, batch)`` (``G`` on a batch) and ``outer_loss(z, x, batch)`` (``F``),
over pytrees ``z`` and ``x``. On one batch this module computes

* :class:`Linearization`: ``∇_z G`` and, for any ``v``, ``∇²_zz G · v`` and ``∇²_xz G · v``
  (the Hessian-vector and cross products) from **one** ``create_graph`` gradient graph: a single
  backward pass of ``⟨∇_z G, v⟩`` with respect to ``(z, x)`` gives both products (the
  reverse-over-reverse linearization of :class:`~hypergrad.operators.InnerOperator`'s ``reuse``
  engine, with the two products fused into one pass);
* :func:`gradients`: ``(∇_z L, ∇_x L)`` of either loss from one backward pass.

Solvers work on flat tuples of tensors (:mod:`hypergrad.tree`); the losses always see the
user's pytrees. Samplers are functions of a counter (``sampler(k)`` is the ``k``-th batch), so a
run's position in its data is an int of the solver state and a resumed run draws the same batches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import HypergradTypeError, HypergradValueError
from ..settings import check_int, check_iters
from ..tree import PyTree, Tensors, TreeSpec, tree_unflatten

BilevelLoss = Callable[[PyTree, PyTree, Any], torch.Tensor]
Sampler = Callable[[int], Any]

_MIX = 0x9E3779B97F4A7C15  # Weyl constant: consecutive counters give unrelated seeds


def _seed(seed: int, k: int, stream: int = 0) -> int:
    return (seed * 1_000_003 + stream * 7_919 + k * _MIX) % (2**63 - 1)


class IndexSampler:
    """Batches of sample indices over ``n`` samples: ``sampler(k)`` is the ``k``-th batch.

    Args:
        n: number of samples.
        batch_size: indices per batch, drawn uniformly **with replacement** from a generator
            seeded by ``(seed, k)``, so consecutive batches are independent (the i.i.d. sampling
            the convergence proofs of SOBA, StocBiO and AmIGO assume, and what makes products of
            batch Hessians unbiased). None: the full batch ``arange(n)`` every time
            (deterministic runs).
        seed: seed of the draws.

    :meth:`block` draws instead one block of a fixed partition of the samples (SABA's per-block
    memory); :meth:`full` is the whole sample set (SRBA's refresh); :meth:`heldout` is a fixed
    batch from another stream, for the diagnostics.

    Example:
        >>> s = IndexSampler(10, batch_size=3, seed=0)
        >>> bool((s(5) == s(5)).all()), s(5).shape
        (True, torch.Size([3]))
    """

    def __init__(self, n: int, batch_size: int | None = None, seed: int = 0):
        self.n = check_iters("IndexSampler n", n, 1, allow_none=False)
        self.batch_size = check_iters("IndexSampler batch_size", batch_size, 1, allow_none=True)
        self.seed = check_int("IndexSampler seed", seed)
        self._blocks: torch.Tensor | None = None

    def _generator(self, k: int, stream: int) -> torch.Generator:
        return torch.Generator().manual_seed(_seed(self.seed, k, stream))

    def __call__(self, k: int) -> torch.Tensor:
        if self.batch_size is None:
            return torch.arange(self.n)
        return torch.randint(self.n, (self.batch_size,), generator=self._generator(k, 0))

    def heldout(self) -> torch.Tensor:
        """A fixed batch (the full batch when ``batch_size`` is None), drawn from a stream that
        :meth:`__call__` never uses: what the diagnostics of :func:`~hypergrad.stochastic.run`
        are estimated on."""
        if self.batch_size is None:
            return torch.arange(self.n)
        return torch.randint(self.n, (self.batch_size,), generator=self._generator(0, 1))

    def full(self) -> torch.Tensor:
        """The full batch ``arange(n)``: the periodic refresh of
        :class:`~hypergrad.stochastic.SRBA`."""
        return torch.arange(self.n)

    @property
    def num_blocks(self) -> int:
        """Blocks of :meth:`block`: ``n / batch_size`` (1 for the full batch)."""
        return 1 if self.batch_size is None else self.n // self.batch_size

    def block(self, k: int) -> tuple[int, torch.Tensor]:
        """The ``k``-th draw of a block: ``(b, indices)``, ``b`` uniform over :attr:`num_blocks`
        blocks of a fixed random partition of the samples (equal sizes).

        Raises:
            HypergradValueError: ``batch_size`` does not divide ``n``.
        """
        if self.batch_size is None:
            return 0, torch.arange(self.n)
        if self.n % self.batch_size:
            raise HypergradValueError(
                f"IndexSampler.block needs batch_size ({self.batch_size}) to divide n ({self.n}):"
                " the blocks of a variance-reduced solver must have equal sizes to be unbiased"
            )
        if self._blocks is None:
            perm = torch.randperm(self.n, generator=self._generator(0, 2))
            self._blocks = perm.reshape(self.num_blocks, self.batch_size)
        b = int(torch.randint(self.num_blocks, (1,), generator=self._generator(k, 3)))
        return b, self._blocks[b]


@dataclass(frozen=True)
class Bilevel:
    """A stochastic bilevel problem: minibatch losses and the samplers of their batches.

    Args:
        inner_loss: ``(z, x, batch) -> scalar``, ``G`` on a batch (strongly convex in ``z``).
        outer_loss: ``(z, x, batch) -> scalar``, ``F`` on a batch.
        inner_sampler: ``k -> batch`` of the inner loss (an :class:`IndexSampler`, or any
            function of the counter ``k``: then a resumed run draws the same batches).
        outer_sampler: the same for the outer loss.
        heldout_inner: the batch on which the diagnostics evaluate the inner loss; None: the
            sampler's ``heldout()`` when it has one, else ``inner_sampler(-1)``.
        heldout_outer: the same for the outer loss.
    """

    inner_loss: BilevelLoss
    outer_loss: BilevelLoss
    inner_sampler: Sampler
    outer_sampler: Sampler
    heldout_inner: Any = None
    heldout_outer: Any = None

    def __post_init__(self) -> None:
        for name in ("inner_loss", "outer_loss", "inner_sampler", "outer_sampler"):
            if not callable(getattr(self, name)):
                raise HypergradTypeError(f"Bilevel {name} must be callable")

    def heldout(self) -> tuple[Any, Any]:
        """The held-out ``(inner batch, outer batch)`` of the diagnostics."""
        out = []
        for given, sampler in (
            (self.heldout_inner, self.inner_sampler),
            (self.heldout_outer, self.outer_sampler),
        ):
            if given is None:
                fixed = getattr(sampler, "heldout", None)
                given = fixed() if callable(fixed) else sampler(-1)
            out.append(given)
        return out[0], out[1]


@dataclass(frozen=True)
class Specs:
    """The pytree structures of ``z`` and ``x`` (the losses see pytrees, solvers flat tuples)."""

    z: TreeSpec
    x: TreeSpec


def _scalar(loss: object, name: str) -> torch.Tensor:
    # unlike check_scalar_loss, a non-finite value passes: the solver's divergence check
    # reports it (with a warning) instead of an exception in the middle of a run
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        raise HypergradTypeError(f"{name} must return a floating-point scalar tensor")
    return loss.reshape(())


def _fresh(leaves: Tensors) -> Tensors:
    return tuple(t.detach().requires_grad_(True) for t in leaves)


def _dense(grads: tuple[torch.Tensor | None, ...], like: Tensors) -> Tensors:
    return tuple(
        torch.zeros_like(p) if g is None else g.detach() for g, p in zip(grads, like, strict=True)
    )


def gradients(
    loss_fn: BilevelLoss,
    name: str,
    specs: Specs,
    z: Tensors,
    x: Tensors,
    batch: Any,
    wrt_x: bool = True,
) -> tuple[Tensors, Tensors]:
    """``(∇_z L, ∇_x L)`` of ``loss_fn`` at ``(z, x)`` on ``batch``: one backward pass (zeros
    for leaves the loss does not use; ``∇_x L`` is ``()`` when ``wrt_x`` is False)."""
    zs = _fresh(z)
    xs = _fresh(x) if wrt_x else tuple(t.detach() for t in x)
    with torch.enable_grad():
        loss = _scalar(
            loss_fn(tree_unflatten(specs.z, zs), tree_unflatten(specs.x, xs), batch), name
        )
        grads = torch.autograd.grad(loss, zs + xs if wrt_x else zs, allow_unused=True)
    return _dense(grads[: len(zs)], zs), _dense(grads[len(zs) :], xs) if wrt_x else ()


class Linearization:
    """The inner loss's gradient on one batch, linearized once at ``(z, x)``.

    ``grad`` is ``∇_z G(z, x; batch)``; :meth:`products` returns ``(∇²_zz G · v, ∇²_xz G · v)``
    from one backward pass through the gradient's graph, :meth:`hvp` the first alone. The graph
    is kept for further products while ``retain=True``.

    Raises:
        HypergradValueError: the inner loss does not depend on a leaf of ``z`` (its Hessian
            is singular).
    """

    def __init__(self, problem: Bilevel, specs: Specs, z: Tensors, x: Tensors, batch: Any):
        self.zs, self.xs = _fresh(z), _fresh(x)
        with torch.enable_grad():
            loss = _scalar(
                problem.inner_loss(
                    tree_unflatten(specs.z, self.zs), tree_unflatten(specs.x, self.xs), batch
                ),
                "inner_loss",
            )
            grads = torch.autograd.grad(loss, self.zs, create_graph=True, allow_unused=True)
        unused = [i for i, g in enumerate(grads) if g is None]
        if unused:
            raise HypergradValueError(
                f"inner_loss does not depend on z's leaves {unused}: its Hessian is singular"
            )
        self._grads: list[torch.Tensor] = [g for g in grads if g is not None]
        self.grad: Tensors = tuple(g.detach() for g in self._grads)

    def _vjp(self, v: Tensors, inputs: Tensors, retain: bool) -> tuple[torch.Tensor | None, ...]:
        pairs = [(g, vi.to(g.dtype)) for g, vi in zip(self._grads, v, strict=True)]
        live = [(g, c) for g, c in pairs if g.requires_grad]
        if not live:
            return (None,) * len(inputs)
        return torch.autograd.grad(
            [g for g, _ in live],
            inputs,
            [c for _, c in live],
            retain_graph=retain,
            allow_unused=True,
        )

    def products(self, v: Tensors, retain: bool = False) -> tuple[Tensors, Tensors]:
        """``(∇²_zz G · v, ∇²_xz G · v)``: one backward pass of ``⟨∇_z G, v⟩`` over ``(z, x)``."""
        out = self._vjp(v, self.zs + self.xs, retain)
        n = len(self.zs)
        return _dense(out[:n], self.zs), _dense(out[n:], self.xs)

    def hvp(self, v: Tensors, retain: bool = False) -> Tensors:
        """``∇²_zz G · v`` alone (a backward pass over ``z`` only)."""
        return _dense(self._vjp(v, self.zs, retain), self.zs)
