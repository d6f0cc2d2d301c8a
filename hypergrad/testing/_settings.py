"""The options every check shares (:class:`CheckSettings`) and small numeric helpers."""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..errors import HypergradTypeError, HypergradValueError, HypergradWarning, warn
from ..settings import FrozenSettings, integer, number, setting

#: Up to this many hyperparameter elements, every coordinate is a direction by default.
ALL_COORDINATES_UP_TO = 16
#: Number of random unit directions by default above that.
DEFAULT_RANDOM_DIRECTIONS = 8
#: Share of the comparison tolerance the inner solves may use up (automatic inner criterion).
INNER_BUDGET = 0.5


def _check_inner_tol(name: str, tol: Any) -> float | None:
    """``inner_tol``: None or a finite number >= 0 (an infinite one points at check_unrolled)."""
    if tol is None:
        return None
    finite = isinstance(tol, numbers.Real) and not isinstance(tol, bool) and math.isfinite(tol)
    if not finite or float(tol) < 0:
        unrolled = (
            "; an unrolled procedure (a fixed number of optimizer steps, whose result is not "
            "a stationary point) is checked by hypergrad.testing.check_unrolled, which skips "
            "the stationarity check"
            if isinstance(tol, numbers.Real) and math.isinf(tol) and float(tol) > 0
            else ""
        )
        raise HypergradValueError(
            f"{name} must be None or a finite number >= 0, got {tol!r}{unrolled}"
        )
    return float(tol)


@dataclass
class CheckSettings(FrozenSettings):
    """The keyword options of every check, declared with the field helpers of
    :mod:`hypergrad.settings`: validated once when built, then frozen (assigning one raises
    :class:`~hypergrad.FrozenSettingError`; ``replace()`` builds a validated copy).

    Attributes:
        directions: None, ``"all"``, an int or a sequence of directions (checked when drawn).
        eps: finite-difference step, finite and > 0.
        rtol: relative tolerance, finite and >= 0.
        atol: absolute tolerance, finite and >= 0.
        seed: seed of the random directions and of the RNG around each re-solve.
        inner_tol: None (the adjoint criterion) or a bound on ``||dL_in/dpsi||``.
    """

    directions: Any = setting(None)  # checked when the directions are drawn
    eps: float = number(1e-4, strict=True)
    rtol: float = number(1e-4)
    atol: float = number(1e-8)
    seed: int = integer(0)
    inner_tol: float | None = setting(None, _check_inner_tol)

    display: ClassVar[str] = "hypergrad.testing"
    _instance_name = "settings"
    _read_by = "the whole check"

    def __hash__(self) -> int:
        # consistent with the dataclass __eq__ (directions, possibly a list, left out)
        return hash((CheckSettings, self.eps, self.rtol, self.atol, self.seed, self.inner_tol))


def warn_low_precision(
    tensors: Sequence[torch.Tensor], what: str, eps: float, stacklevel: int | None = None
) -> None:
    low = sorted({str(t.dtype) for t in tensors if t.dtype != torch.float64})
    if low:
        warn(
            f"{what} {'is' if len(low) == 1 else 'are'} {', '.join(low)}: central differences "
            f"with eps={eps:g} cancel all but a few digits of the loss in this precision "
            "(rounding ~ machine epsilon * |L| / eps), so the check is unreliable; cast the "
            "problem to float64 (.double()) to check the hypergradient",
            HypergradWarning,
            stacklevel,
        )


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run a block with the RNG seeded to ``seed``; the caller's RNG streams are untouched."""
    # torch.cuda.is_initialized is unannotated in torch, hence the ignore.
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []  # type: ignore[no-untyped-call]
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def scalar(loss: object, name: str) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor):
        raise HypergradTypeError(f"{name} must return a scalar tensor, got {type(loss).__name__}")
    if loss.numel() != 1 or not loss.is_floating_point():
        raise HypergradValueError(
            f"{name} must return a floating-point scalar tensor, got shape {tuple(loss.shape)} "
            f"and dtype {loss.dtype}"
        )
    return loss.reshape(())


def grads(loss: torch.Tensor, wrt: Sequence[torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
    """``d loss / d wrt`` with None for unused inputs (all None when the loss is constant)."""
    if not loss.requires_grad:
        return (None,) * len(wrt)
    return torch.autograd.grad(loss, list(wrt), allow_unused=True)


def zeros_for_none(
    found: Sequence[torch.Tensor | None], like: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, ...]:
    """Detached gradients with zeros for the inputs a loss does not use."""
    return tuple(torch.zeros_like(t) if g is None else g.detach() for g, t in zip(found, like))


def dot(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    return float(sum((x.detach().double() * y.detach().double()).sum() for x, y in zip(a, b)))


def norm(a: Sequence[torch.Tensor]) -> float:
    return math.sqrt(sum(float((x.detach().double() ** 2).sum()) for x in a))
