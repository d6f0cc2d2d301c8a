"""The race's problems rebuilt in torch from a dataset's arrays (no benchopt, no JAX here).

``benchmark_bilevel`` hands its solvers JAX closures ``f(inner_var, outer_var, start,
batch_size)``; the arrays they slice are not part of the solver interface. :func:`closure_arrays`
reads them from the closure's free variables by name (read only, nothing of the benchmark is
changed), and :func:`build` turns them into the minibatch losses ``inner_loss(z, x, batch)`` and
``outer_loss(z, x, batch)`` of :class:`hypergrad.stochastic.Bilevel`, for the three problem
kinds of the race:

* ``quadratic`` (the benchmark's ``simulated``): per sample ``½zᵀA_iz + ½xᵀB_ix + xᵀC_iz +
  a_iᵀz + b_iᵀx``;
* ``regsel`` (regularization selection, ours: ``datasets/hg_regsel.py``): binary logistic
  regression, ``G = mean log(1 + exp(-y_i ⟨z, a_i⟩)) + ½ Σ_j e^{x_j} z_j²``, ``F`` the same
  data term on the validation set;
* ``datacleaning`` (the benchmark's ``mnist``): linear softmax, ``G = mean σ(x_i) CE_i +
  reg ‖z‖²``, ``F`` the validation cross-entropy.

A batch is ``(indices, denominator)`` (indices: a ``slice`` or an index tensor) and a loss is
the **sum** over the indices divided by the denominator. :class:`BlockSampler`'s batches are
contiguous blocks (as the benchmark's own sampler: its data are already in random order), so
taking a batch is a view, not a gather; a block's denominator is ``n / num_blocks``, so the
mean over blocks of the block losses is the full loss exactly, even when the batch size does
not divide ``n`` (SABA's tables stay unbiased).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as fn

Batch = tuple[slice | torch.Tensor, float]


def closure_arrays(f: Callable[..., Any]) -> dict[str, Any]:
    """The free variables of a (jitted, wrapped or partial) closure, by name."""
    seen = 0
    while seen < 10:
        seen += 1
        if isinstance(f, functools.partial):
            f = f.func
        elif hasattr(f, "__wrapped__"):
            f = f.__wrapped__
        else:
            break
    code = getattr(f, "__code__", None)
    if code is None or f.__closure__ is None:
        raise TypeError(f"{f!r} is not a closure: no arrays to read")
    return {n: c.cell_contents for n, c in zip(code.co_freevars, f.__closure__, strict=True)}


def _np(a: Any) -> np.ndarray:
    return np.asarray(a)


class BlockSampler:
    """Batches of ``(slice, denominator)`` over ``n`` samples (a sampler of
    :class:`hypergrad.stochastic.Bilevel`), on the partition of ``0..n-1`` into
    ``n // batch_size`` contiguous blocks of sizes ``batch_size`` or ``batch_size + 1``.

    ``sampler(k)`` and ``block(k)``: a block drawn uniformly (independently for each ``k``, by a
    generator seeded by ``(seed, k)``), so each batch's loss is an unbiased estimate of the full
    loss; ``block`` also returns the block's number (SABA's tables); ``full()``: every sample;
    ``heldout()``: a fixed block from another stream.
    """

    def __init__(self, n: int, batch_size: int, seed: int = 0):
        if n < 1 or batch_size < 1:
            raise ValueError(f"BlockSampler needs n, batch_size >= 1, got {n}, {batch_size}")
        self.n, self.batch_size, self.seed = int(n), min(int(batch_size), int(n)), int(seed)
        self.num_blocks = max(1, self.n // self.batch_size)
        edges = [self.n * b // self.num_blocks for b in range(self.num_blocks + 1)]
        self.blocks = [slice(lo, hi) for lo, hi in zip(edges[:-1], edges[1:], strict=True)]
        self.block_denominator = self.n / self.num_blocks

    def _gen(self, k: int, stream: int) -> torch.Generator:
        return torch.Generator().manual_seed((self.seed * 1_000_003 + stream * 7_919 + k * 104_729)
                                             % (2**62))

    def _draw(self, k: int, stream: int) -> int:
        return int(torch.randint(self.num_blocks, (1,), generator=self._gen(k, stream)))

    def __call__(self, k: int) -> Batch:
        return self.blocks[self._draw(k, 0)], self.block_denominator

    def block(self, k: int) -> tuple[int, Batch]:
        b = self._draw(k, 0)
        return b, (self.blocks[b], self.block_denominator)

    def full(self) -> Batch:
        return slice(0, self.n), float(self.n)

    def heldout(self) -> Batch:
        return self.blocks[self._draw(0, 1)], self.block_denominator


@dataclass
class TorchProblem:
    """The torch losses of one race problem and their sizes."""

    kind: str
    inner_loss: Callable[[torch.Tensor, torch.Tensor, Batch], torch.Tensor]
    outer_loss: Callable[[torch.Tensor, torch.Tensor, Batch], torch.Tensor]
    n_inner: int
    n_outer: int

    def full_inner(self, z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.inner_loss(z, x, (slice(0, self.n_inner), float(self.n_inner)))

    def full_outer(self, z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.outer_loss(z, x, (slice(0, self.n_outer), float(self.n_outer)))


def quadratic(arrays_in: dict[str, Any], arrays_out: dict[str, Any]) -> TorchProblem:
    """The ``simulated`` quadratics from the arrays of its ``f_inner`` and ``f_outer``."""

    def make(a: dict[str, Any]) -> Callable[[torch.Tensor, torch.Tensor, Batch], torch.Tensor]:
        hz = torch.as_tensor(_np(a["hess_inner"]))  # (n, dz, dz)
        hx = torch.as_tensor(_np(a["hess_outer"]))  # (n, dx, dx)
        c = torch.as_tensor(_np(a["cross"]))  # (n, dx, dz)
        lz = torch.as_tensor(_np(a["linear_inner"]))  # (n, dz)
        lx = torch.as_tensor(_np(a["linear_outer"]))  # (n, dx)

        def loss(z: torch.Tensor, x: torch.Tensor, batch: Batch) -> torch.Tensor:
            i, den = batch
            a_i, b_i, c_i, l_i, m_i = hz[i], hx[i], c[i], lz[i], lx[i]  # views for a slice
            s = (0.5 * (a_i @ z) + c_i.transpose(1, 2) @ x + l_i) @ z  # per sample, (b,)
            s = s + (0.5 * (b_i @ x) + m_i) @ x
            return s.sum() / den

        return loss

    n_in = int(_np(arrays_in["hess_inner"]).shape[0])
    n_out = int(_np(arrays_out["hess_inner"]).shape[0])
    return TorchProblem("quadratic", make(arrays_in), make(arrays_out), n_in, n_out)


def regsel(x_train: Any, y_train: Any, x_val: Any, y_val: Any) -> TorchProblem:
    """Binary logistic regression with one penalty ``e^{x_j}`` per feature (labels ±1)."""
    a, y = torch.as_tensor(_np(x_train)), torch.as_tensor(_np(y_train))
    av, yv = torch.as_tensor(_np(x_val)), torch.as_tensor(_np(y_val))

    def inner(z: torch.Tensor, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        i, den = batch
        data = fn.softplus(-y[i] * (a[i] @ z)).sum() / den
        return data + 0.5 * (x.exp() * z * z).sum()

    def outer(z: torch.Tensor, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        j, den = batch
        return fn.softplus(-yv[j] * (av[j] @ z)).sum() / den

    return TorchProblem("regsel", inner, outer, int(a.shape[0]), int(av.shape[0]))


def datacleaning(x_train: Any, y_train: Any, x_val: Any, y_val: Any, reg: float) -> TorchProblem:
    """Hyper-cleaning with a linear softmax: one weight ``σ(x_i)`` per training sample
    (labels one-hot or integer; ``z`` is the flat ``(features, classes)`` matrix)."""
    a, av = torch.as_tensor(_np(x_train)), torch.as_tensor(_np(x_val))
    y, yv = _np(y_train), _np(y_val)
    classes = y.shape[1] if y.ndim == 2 else int(max(y.max(), yv.max())) + 1
    yi = torch.as_tensor(y.argmax(1) if y.ndim == 2 else y).long()
    yvi = torch.as_tensor(yv.argmax(1) if yv.ndim == 2 else yv).long()
    features = int(a.shape[1])

    def inner(z: torch.Tensor, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        i, den = batch
        ce = fn.cross_entropy(a[i] @ z.view(features, classes), yi[i], reduction="none")
        return (torch.sigmoid(x[i]) * ce).sum() / den + reg * (z * z).sum()

    def outer(z: torch.Tensor, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        j, den = batch
        return fn.cross_entropy(av[j] @ z.view(features, classes), yvi[j], reduction="sum") / den

    return TorchProblem("datacleaning", inner, outer, int(a.shape[0]), int(av.shape[0]))


def build(f_inner: Callable[..., Any], f_outer: Callable[..., Any]) -> TorchProblem:
    """The torch problem behind the benchmark's ``f_inner`` / ``f_outer`` closures."""
    ci, co = closure_arrays(f_inner), closure_arrays(f_outer)
    if "hess_inner" in ci:
        return quadratic(ci, co)
    if "hg_regsel" in ci:  # ours: datasets/hg_regsel.py
        return regsel(ci["X_train"], ci["y_train"], co["X_val"], co["y_val"])
    if "X_train" in ci and "self" in ci and hasattr(ci["self"], "reg"):  # the benchmark's mnist
        return datacleaning(ci["X_train"], ci["y_train"], co["X_val"], co["y_val"],
                            float(ci["self"].reg))
    raise TypeError(f"unknown problem: f_inner's free variables are {sorted(ci)}")


def check_losses(problem: TorchProblem, f_inner: Callable[..., Any], f_outer: Callable[..., Any],
                 z0: np.ndarray, x0: np.ndarray, points: int = 3, batch: int = 64,
                 seed: int = 0) -> dict[str, float]:
    """Largest relative difference between the torch losses and the benchmark's ``f_inner`` /
    ``f_outer`` at random points (around the start, scale 1) on random contiguous batches and
    the full batch, in float32 (what the race's notes report)."""
    rng = np.random.default_rng(seed)
    worst = {"inner": 0.0, "outer": 0.0}
    for _ in range(points):
        z = (z0 + rng.standard_normal(z0.shape)).astype(np.float32)
        x = (x0 + rng.standard_normal(x0.shape)).astype(np.float32)
        zt, xt = torch.as_tensor(z), torch.as_tensor(x)
        for name, f, loss, n in (("inner", f_inner, problem.inner_loss, problem.n_inner),
                                 ("outer", f_outer, problem.outer_loss, problem.n_outer)):
            b = min(batch, n)
            start = int(rng.integers(0, n - b + 1))
            for s, size in ((start, b), (0, n)):
                ref = float(f(z, x, s, size))
                ours = float(loss(zt, xt, (slice(s, s + size), float(size))))
                worst[name] = max(worst[name], abs(ours - ref) / max(1.0, abs(ref)))
    return worst
