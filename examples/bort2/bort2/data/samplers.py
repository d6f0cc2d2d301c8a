"""Domain-balanced batching for multi-source training, resumable from a state dict.

Owns :class:`DomainBalancedSampler` (infinite index batches with exactly ``k`` indices from
every domain, each domain reshuffled on every pass over it) and :class:`InfiniteLoader` (the
matching stream of stacked ``(images uint8, labels, domain ids)`` batches: direct tensor
indexing for in-memory :class:`~bort2.data.base.ArrayDomain` data, a torch ``DataLoader`` with
worker processes for on-disk data). Both are deterministic given the seed, and
``state_dict()`` / ``load_state_dict()`` make a resumed run draw the same batches.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

__all__ = ["DomainBalancedSampler", "InfiniteLoader"]

# (generator state, per-domain permutations, per-domain cursors); permutations are never
# modified in place, so a snapshot may share them with the live sampler.
_Snapshot = tuple[torch.Tensor, list[torch.Tensor], list[int]]


def _as_generator(generator: torch.Generator | int | None) -> torch.Generator:
    if isinstance(generator, torch.Generator):
        if generator.device.type != "cpu":
            raise ValueError(f"generator must live on the CPU, not {generator.device}")
        return generator
    if generator is None:  # follow the global seed, as torch's RandomSampler does
        generator = int(torch.empty((), dtype=torch.int64).random_().item())
    return torch.Generator().manual_seed(int(generator))


class DomainBalancedSampler:
    """Infinite iterator over index batches holding ``k`` indices from every domain.

    Indices point into the concatenation of the domains (domain ``d`` owns
    ``offsets[d] .. offsets[d] + domain_sizes[d] - 1``). Every batch is the
    ``batch_size_per_domain`` next indices of domain 0, then of domain 1, and so on. Each domain
    walks through a random permutation of its indices and draws a fresh one from the shared
    generator whenever it runs out, so every aligned pass of ``domain_sizes[d]`` draws visits
    each of its indices exactly once; a batch can straddle two passes.

    Args:
        domain_sizes: number of items in each domain (all positive).
        batch_size_per_domain: indices drawn from every domain per batch (``k``).
        generator: a CPU ``torch.Generator`` (used and advanced in place), an integer seed, or
            ``None`` to seed from torch's global RNG.

    Example:
        >>> sampler = DomainBalancedSampler([5, 3], batch_size_per_domain=2, generator=0)
        >>> batch = next(sampler)
        >>> batch.shape, bool((batch[:2] < 5).all()), bool((batch[2:] >= 5).all())
        (torch.Size([4]), True, True)
        >>> state = sampler.state_dict()
        >>> a = [next(sampler) for _ in range(3)]
        >>> sampler.load_state_dict(state)
        >>> all(torch.equal(x, next(sampler)) for x in a)
        True
    """

    def __init__(
        self,
        domain_sizes: Sequence[int],
        batch_size_per_domain: int,
        generator: torch.Generator | int | None = None,
    ):
        self.domain_sizes = [int(n) for n in domain_sizes]
        if not self.domain_sizes or min(self.domain_sizes) <= 0:
            raise ValueError(f"domain_sizes must be positive and non-empty, got {domain_sizes}")
        self.batch_size_per_domain = int(batch_size_per_domain)
        if self.batch_size_per_domain <= 0:
            raise ValueError(f"batch_size_per_domain must be positive, got {batch_size_per_domain}")
        self.offsets = [0]
        for n in self.domain_sizes[:-1]:
            self.offsets.append(self.offsets[-1] + n)
        self.generator = _as_generator(generator)
        self._perms = [torch.randperm(n, generator=self.generator) for n in self.domain_sizes]
        self._cursors = [0] * len(self.domain_sizes)
        self.domain_ids = torch.arange(len(self.domain_sizes)).repeat_interleave(
            self.batch_size_per_domain
        )

    @property
    def num_domains(self) -> int:
        """Number of domains."""
        return len(self.domain_sizes)

    @property
    def batch_size(self) -> int:
        """Total indices per batch: ``num_domains * batch_size_per_domain``."""
        return self.num_domains * self.batch_size_per_domain

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self

    def __next__(self) -> torch.Tensor:
        """Return the next batch: an int64 tensor of ``batch_size`` concatenated indices."""
        return torch.cat([self._draw(d) + self.offsets[d] for d in range(self.num_domains)])

    def _draw(self, d: int) -> torch.Tensor:
        n, need, chunks = self.domain_sizes[d], self.batch_size_per_domain, []
        while need:
            if self._cursors[d] == n:
                self._perms[d] = torch.randperm(n, generator=self.generator)
                self._cursors[d] = 0
            take = min(need, n - self._cursors[d])
            chunks.append(self._perms[d][self._cursors[d] : self._cursors[d] + take])
            self._cursors[d] += take
            need -= take
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks)

    def _snapshot(self) -> _Snapshot:
        return self.generator.get_state(), list(self._perms), list(self._cursors)

    def _state_from(self, snap: _Snapshot) -> dict[str, Any]:
        gen, perms, cursors = snap
        return {
            "domain_sizes": list(self.domain_sizes),
            "batch_size_per_domain": self.batch_size_per_domain,
            "generator": gen.clone(),
            "perms": [p.clone() for p in perms],
            "cursors": list(cursors),
        }

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the stream: generator state, permutations, cursors.

        Contains only tensors, ints and lists, so it loads with ``torch.load(weights_only=True)``.
        """
        return self._state_from(self._snapshot())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; the next batches equal those that followed it.

        Raises:
            ValueError: the state belongs to other domain sizes or another batch size.
        """
        if (
            list(state["domain_sizes"]) != self.domain_sizes
            or int(state["batch_size_per_domain"]) != self.batch_size_per_domain
        ):
            raise ValueError(
                "sampler state is for domain_sizes="
                f"{list(state['domain_sizes'])}, k={state['batch_size_per_domain']}; this sampler "
                f"has domain_sizes={self.domain_sizes}, k={self.batch_size_per_domain}"
            )
        perms = [torch.as_tensor(p, dtype=torch.int64).clone() for p in state["perms"]]
        cursors = [int(c) for c in state["cursors"]]
        for p, c, n in zip(perms, cursors, self.domain_sizes):
            if p.shape != (n,) or not 0 <= c <= n:
                raise ValueError("corrupt sampler state: permutation or cursor out of range")
        self.generator.set_state(state["generator"].clone())
        self._perms, self._cursors = perms, cursors


def _is_in_memory(ds: Dataset) -> bool:
    images, labels = getattr(ds, "images", None), getattr(ds, "labels", None)
    return isinstance(images, torch.Tensor) and isinstance(labels, torch.Tensor)


class _Concat(Dataset):
    """Concatenated domains whose items carry their domain id: ``(image, label, domain)``."""

    def __init__(self, datasets: Sequence[Dataset], offsets: Sequence[int]):
        self.datasets, self.offsets = list(datasets), list(offsets)

    def __len__(self) -> int:
        return self.offsets[-1] + len(self.datasets[-1])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int, int]:
        d = bisect.bisect_right(self.offsets, i) - 1
        image, label = self.datasets[d][i - self.offsets[d]]
        return image, int(label), d


class _RecordingBatchSampler:
    """Feeds the sampler's batches to a DataLoader and queues the state after each one."""

    def __init__(self, sampler: DomainBalancedSampler, pending: deque):
        self.sampler, self.pending = sampler, pending

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            batch = next(self.sampler)
            self.pending.append(self.sampler._snapshot())
            yield batch.tolist()


class InfiniteLoader:
    """Endless domain-balanced batches ``(images, labels, domain_ids)`` from several datasets.

    ``images`` is uint8 ``(D*k, 3, S, S)``, ``labels`` and ``domain_ids`` are int64 ``(D*k,)``;
    rows ``d*k .. d*k + k - 1`` come from ``datasets[d]`` (see :class:`DomainBalancedSampler`).
    In-memory datasets (``images`` and ``labels`` tensors, e.g. ArrayDomain) are indexed
    directly; any other dataset is read through a ``DataLoader`` with ``num_workers`` processes.
    :meth:`state_dict` describes the position after the last batch *returned* (batches that
    workers prefetched are drawn again after a restore), so a resumed run sees the same stream.

    Args:
        datasets: one dataset per domain; items ``(uint8 (3, S, S) image, int label)``.
        batch_size_per_domain: items drawn from every domain per batch (``k``).
        generator: CPU ``torch.Generator``, integer seed, or ``None`` (seed from torch's RNG).
        num_workers: DataLoader worker processes for on-disk datasets (0: main process).
        pin_memory: return batches in pinned memory (only useful with a GPU).
        prefetch_factor: batches each worker loads ahead (DataLoader default when ``None``).

    Example:
        >>> from bort2.data.base import ArrayDomain
        >>> a = ArrayDomain(torch.zeros(6, 3, 4, 4, dtype=torch.uint8), torch.arange(6))
        >>> b = ArrayDomain(torch.ones(4, 3, 4, 4, dtype=torch.uint8), torch.arange(4))
        >>> loader = InfiniteLoader([a, b], batch_size_per_domain=3, generator=0)
        >>> images, labels, domains = next(loader)
        >>> images.shape, domains.tolist()
        (torch.Size([6, 3, 4, 4]), [0, 0, 0, 1, 1, 1])
    """

    def __init__(
        self,
        datasets: Sequence[Dataset],
        batch_size_per_domain: int,
        generator: torch.Generator | int | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
        prefetch_factor: int | None = None,
    ):
        self.datasets = list(datasets)
        if not self.datasets:
            raise ValueError("InfiniteLoader needs at least one dataset")
        sizes = [len(ds) for ds in self.datasets]
        if min(sizes) == 0:
            empty = [i for i, n in enumerate(sizes) if n == 0]
            raise ValueError(f"InfiniteLoader: dataset(s) {empty} are empty")
        self.sampler = DomainBalancedSampler(sizes, batch_size_per_domain, generator)
        self.num_workers = int(num_workers)
        self.pin_memory = bool(pin_memory)
        self.prefetch_factor = prefetch_factor
        self.in_memory = all(_is_in_memory(ds) for ds in self.datasets)
        self._pending: deque = deque()
        self._resume: _Snapshot = self.sampler._snapshot()
        self._iter: Iterator | None = None

    @property
    def batch_size(self) -> int:
        """Items per batch: ``len(datasets) * batch_size_per_domain``."""
        return self.sampler.batch_size

    def __iter__(self) -> InfiniteLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return the next ``(images, labels, domain_ids)`` batch."""
        if self.in_memory:
            return self._gather(next(self.sampler))
        if self._iter is None:
            self._iter = iter(self._make_dataloader())
        images, labels, domains = next(self._iter)
        self._resume = self._pending.popleft()
        return images, labels, domains

    def _gather(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        k, images, labels = self.sampler.batch_size_per_domain, [], []
        for d, ds in enumerate(self.datasets):
            local = idx[d * k : (d + 1) * k] - self.sampler.offsets[d]
            images.append(ds.images[local])
            labels.append(ds.labels[local])
        out = (torch.cat(images), torch.cat(labels).long(), self.sampler.domain_ids.clone())
        if self.pin_memory and torch.cuda.is_available():
            out = tuple(t.pin_memory() for t in out)
        return out

    def _make_dataloader(self) -> DataLoader:
        self._pending.clear()
        kw: dict[str, Any] = {}
        if self.num_workers > 0 and self.prefetch_factor is not None:
            kw["prefetch_factor"] = int(self.prefetch_factor)
        return DataLoader(
            _Concat(self.datasets, self.sampler.offsets),
            batch_sampler=_RecordingBatchSampler(self.sampler, self._pending),
            num_workers=self.num_workers,
            pin_memory=self.pin_memory and torch.cuda.is_available(),
            **kw,
        )

    def state_dict(self) -> dict[str, Any]:
        """Position of the stream after the last returned batch (see :meth:`load_state_dict`)."""
        if self.in_memory:
            return {"sampler": self.sampler.state_dict()}
        return {"sampler": self.sampler._state_from(self._resume)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict`; stops any running workers first."""
        self.close()
        self.sampler.load_state_dict(state["sampler"])
        self._resume = self.sampler._snapshot()

    def close(self) -> None:
        """Shut down DataLoader workers (they restart on the next batch) and drop prefetches.

        The position stays that of the last returned batch.
        """
        if self._iter is not None:
            shutdown = getattr(self._iter, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
            self._iter = None
            self._pending.clear()
            gen, perms, cursors = self._resume
            self.sampler.generator.set_state(gen.clone())
            self.sampler._perms, self.sampler._cursors = list(perms), list(cursors)
