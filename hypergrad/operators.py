"""Second-order products of an inner loss: Hessian-vector and mixed-partial products.

For ``L(psi, theta)`` this module builds, at a fixed point ``(psi, theta)``:

* ``hvp(v)   = d^2 L / d psi^2 . v``           (shape of ``psi``)
* ``mixed(v) = d^2 L / d theta d psi . v``     (shape of ``theta``; ``None`` for a leaf of
  ``theta`` that the gradient ``dL/dpsi`` does not depend on)

Two engines:

* ``"reuse"`` (default): one forward and one ``create_graph`` backward; every product is a
  ``retain_graph`` vector-Jacobian product of that single gradient graph. Random draws inside the
  loss (dropout, Gumbel noise) are made once, so every product sees the same draw.
* ``"recompute"``: every product rebuilds the gradient graph from a fresh forward (lowest peak
  memory: one graph alive at a time). The RNG state (CPU and CUDA) captured before the first
  forward is restored for every recomputation, so the draws are identical too; the caller's RNG
  stream advances exactly as if one forward had run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from .errors import HypergradTypeError, HypergradValueError
from .tree import Tensors

FlatLoss = Callable[[Tensors, Tensors], torch.Tensor]
ENGINES = ("reuse", "recompute")


def check_engine(engine: object) -> str:
    """Validate an ``engine=`` argument (one of :data:`ENGINES`) and return it.

    Raises:
        HypergradValueError: any other value.
    """
    if engine not in ENGINES:
        raise HypergradValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    return engine


def check_scalar_loss(loss: object, name: str) -> torch.Tensor:
    """Raise unless ``loss`` is a finite real scalar tensor."""
    if not isinstance(loss, torch.Tensor):
        raise HypergradTypeError(f"{name} must return a scalar tensor, got {type(loss).__name__}")
    if loss.numel() != 1 or loss.ndim > 1:
        raise HypergradValueError(
            f"{name} must return a scalar (0-d) tensor, got shape {tuple(loss.shape)}; "
            "reduce it with .mean() or .sum()"
        )
    if not (loss.is_floating_point()):
        raise HypergradTypeError(f"{name} must return a floating-point tensor, got {loss.dtype}")
    if not bool(torch.isfinite(loss.detach()).all()):
        raise HypergradValueError(f"{name} is not finite ({float(loss.detach()):.4g})")
    return loss.reshape(())


class _RNGSnapshot:
    """CPU and (initialised) CUDA generator states, restorable inside a forked RNG scope."""

    def __init__(self) -> None:
        self.cpu = torch.get_rng_state()
        # torch.cuda.is_initialized is unannotated in torch, hence the ignore.
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call]

    def replay(self) -> contextlib.AbstractContextManager[None]:
        devices = list(range(len(self.cuda))) if self.cuda is not None else []
        ctx = torch.random.fork_rng(devices=devices)
        ctx.__enter__()
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        return ctx


class InnerOperator:
    """Hessian-vector and mixed products of ``loss_fn`` at ``(psi, theta)``.

    Args:
        loss_fn: ``(psi_leaves, theta_leaves) -> scalar`` inner loss over flat tuples.
        psi: inner parameters (tensors that require grad).
        theta: hyperparameters (tensors that require grad).
        engine: ``"reuse"`` or ``"recompute"`` (see module docstring).
        name: name of the loss in error messages.
        psi_names: leaf names for error messages.

    Example:
        >>> w = torch.tensor([1.0, 2.0], requires_grad=True)
        >>> lam = torch.tensor(3.0, requires_grad=True)
        >>> op = InnerOperator(lambda p, h: 0.5 * h[0] * (p[0] ** 2).sum(), (w,), (lam,))
        >>> op.hvp((torch.ones(2),))[0]
        tensor([3., 3.])
        >>> op.mixed((torch.ones(2),))[0]
        tensor(3.)
    """

    def __init__(
        self,
        loss_fn: FlatLoss,
        psi: Tensors,
        theta: Tensors,
        engine: str = "reuse",
        name: str = "inner_loss",
        psi_names: list[str] | None = None,
    ):
        check_engine(engine)
        self.loss_fn, self.psi, self.theta, self.engine, self.name = (
            loss_fn,
            psi,
            theta,
            engine,
            name,
        )
        self.psi_names = psi_names or [f"params[{i}]" for i in range(len(psi))]
        self.hvps = 0
        self._rng = _RNGSnapshot() if engine == "recompute" else None
        self.loss_value, grads = self._gradient_graph(first=True)
        self._grads = grads if engine == "reuse" else None

    def _gradient_graph(self, first: bool = False) -> tuple[float, list[torch.Tensor | None]]:
        ctx = None if first or self._rng is None else self._rng.replay()
        try:
            with torch.enable_grad():
                loss = check_scalar_loss(self.loss_fn(self.psi, self.theta), self.name)
                grads = torch.autograd.grad(loss, self.psi, create_graph=True, allow_unused=True)
        finally:
            if ctx is not None:
                ctx.__exit__(None, None, None)
        if first:
            unused = [n for n, g in zip(self.psi_names, grads) if g is None]
            if unused:
                raise HypergradValueError(
                    f"{self.name} does not depend on {', '.join(unused)}: its Hessian is singular "
                    "there; remove those parameters or make the inner loss use them"
                )
        return float(loss.detach()), list(grads)

    def _vjp(self, v: Tensors, inputs: Tensors, retain: bool) -> list[torch.Tensor | None]:
        if self.engine == "reuse":
            if self._grads is None:
                raise HypergradValueError("this operator's graph was released by mixed()")
            grads = self._grads
        else:
            grads = self._gradient_graph()[1]
        outs, cots = [], []
        for g, vi in zip(grads, v, strict=True):
            if g is not None and g.requires_grad:
                outs.append(g)
                cots.append(vi.to(g.dtype))
        if not outs:
            return [None] * len(inputs)
        keep = retain and self.engine == "reuse"
        return list(torch.autograd.grad(outs, inputs, cots, retain_graph=keep, allow_unused=True))

    def hvp(self, v: Tensors) -> Tensors:
        """``d^2 L / d psi^2 . v``."""
        self.hvps += 1
        out = self._vjp(v, self.psi, retain=True)
        return tuple(
            torch.zeros_like(p) if o is None else o.detach() for o, p in zip(out, self.psi)
        )

    def hvp_batched(self, vs: Tensors) -> Tensors | None:
        """``H v_i`` for a batch of vectors in one backward pass (``vs``: leaves with a leading
        batch dimension), through ``torch.autograd.grad(..., is_grads_batched=True)``.

        Only with the reuse engine; returns None when the graph has an operation without a
        batching rule (the caller then loops over :meth:`hvp`). Counts one product per vector.
        """
        if self.engine != "reuse" or self._grads is None:
            return None
        outs, cots = [], []
        for g, vi in zip(self._grads, vs, strict=True):
            if g is not None and g.requires_grad:
                outs.append(g)
                cots.append(vi.to(g.dtype))
        if not outs:
            return None
        try:
            out = torch.autograd.grad(
                outs, self.psi, cots, retain_graph=True, allow_unused=True, is_grads_batched=True
            )
        except RuntimeError:  # an operation without a vmap rule: fall back to one per column
            return None
        k = vs[0].shape[0]
        self.hvps += k
        return tuple(
            torch.zeros((k, *p.shape), dtype=p.dtype, device=p.device) if o is None else o.detach()
            for o, p in zip(out, self.psi)
        )

    def hvp_and_mixed(self, v: Tensors) -> tuple[Tensors, list[torch.Tensor | None]]:
        """``(H v, d^2 L / d theta d psi . v)`` from one backward pass through the gradient graph
        (one vector-Jacobian product over ``psi`` and ``theta`` together); the reuse engine's
        graph is released afterwards. Counts one product."""
        self.hvps += 1
        out = self._vjp(v, self.psi + self.theta, retain=False)
        if self.engine == "reuse":
            self._grads = None
        n = len(self.psi)
        hv = tuple(torch.zeros_like(p) if o is None else o.detach() for o, p in zip(out, self.psi))
        return hv, [None if o is None else o.detach() for o in out[n:]]

    def mixed(self, v: Tensors, release: bool = True) -> list[torch.Tensor | None]:
        """``d^2 L / d theta d psi . v``; ``None`` where a hyperparameter leaf is unused.

        With ``release=True`` (the default) the reuse engine frees its graph afterwards.
        """
        out = self._vjp(v, self.theta, retain=not release)
        if release:
            self._grads = None
        return [None if o is None else o.detach() for o in out]
