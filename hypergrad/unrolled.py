"""Unrolled differentiation: reverse mode through T steps of a functional optimizer.

The optimizer is torchopt's or :mod:`hypergrad.optim`'s, or a function of the hyperparameters
that returns one (to learn a learning rate, a momentum or Adam's betas).
``psi_T(theta)`` is computed by ``steps`` optimizer updates on the inner loss, keeping the autograd
graph of the last ``truncate`` updates (all of them when ``truncate`` is None), and the outer loss
at ``psi_T`` is differentiated with respect to ``theta``.

Memory: the graph of every kept step stays alive until the backward pass, so peak memory grows
linearly with ``steps`` (full) or with ``truncate`` (truncated); implicit differentiation
(:func:`hypergrad.implicit_grad`) needs memory independent of the number of inner steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torchopt

from .errors import HypergradError, HypergradTypeError, HypergradValueError
from .operators import check_scalar_loss
from .report import Loss, check_leaves, explain_dtype_errors
from .tree import PyTree, Tensors, leaf_paths, tree_flatten, tree_norm, tree_unflatten


@dataclass
class UnrolledInfo:
    """Diagnostics of :func:`unrolled_grad`.

    Attributes:
        steps: inner steps run.
        truncate: the last steps differentiated through.
        inner_losses: inner loss before each step.
        outer_loss: outer loss at the final iterate.
        hypergrad_norm: norm of the result (before any clipping).
        params: the final iterate ``psi_T`` (detached, structure of ``params0``).
        time_s: wall time.
        clipped: whether :class:`~hypergrad.HyperStep` (``method=hg.Unrolled(...)``) clipped it.
        skipped: whether that HyperStep left ``.grad`` unwritten (NaN/Inf result under
            ``on_diverged="skip"``).
        skip_reason: why it was skipped (None when it was not).
    """

    steps: int
    truncate: int
    inner_losses: list[float] = field(default_factory=list)
    outer_loss: float = float("nan")
    hypergrad_norm: float = float("nan")
    params: Any = None
    time_s: float = 0.0
    clipped: bool = False
    skipped: bool = False
    skip_reason: str | None = None


def _detach_state(state: Any) -> Any:
    return torchopt.pytree.tree_map(
        lambda t: t.detach() if isinstance(t, torch.Tensor) else t, state
    )


OptimizerArg = Any  # a functional optimizer, or a function of the hyperparameters returning one


def _is_transformation(obj: Any) -> bool:
    return callable(getattr(obj, "init", None)) and callable(getattr(obj, "update", None))


def check_optimizer(optimizer: OptimizerArg) -> None:
    """Refuse anything that is neither a functional optimizer nor a callable returning one."""
    if isinstance(optimizer, type) or isinstance(optimizer, torch.optim.Optimizer):
        raise HypergradTypeError(
            "optimizer must be a functional optimizer such as torchopt.sgd(lr=0.1) or "
            "hg.optim.sgd(lr=0.1) (or a function of the hyperparameters returning one); "
            f"{getattr(optimizer, '__name__', type(optimizer).__name__)} is a torch.optim "
            "optimizer (a class or a stateful object that updates parameters in place), which "
            "cannot be differentiated through"
        )
    if _is_transformation(optimizer) or callable(optimizer):
        return
    raise HypergradTypeError(
        "optimizer must be a functional optimizer such as torchopt.sgd(lr=0.1) or "
        "hg.optim.sgd(lr=0.1), or a function of the hyperparameters returning one "
        f"(optimizer=lambda h: hg.optim.sgd(lr=h['log_lr'].exp())), got {type(optimizer).__name__}"
    )


def resolve_optimizer(optimizer: OptimizerArg, hparams: Any) -> Any:
    """The functional optimizer for these hyperparameter tensors (calls ``optimizer(hparams)``
    when ``optimizer`` is a function of the hyperparameters)."""
    if _is_transformation(optimizer):
        return optimizer
    made = optimizer(hparams)
    if not _is_transformation(made):
        raise HypergradTypeError(
            "optimizer(hparams) must return a functional optimizer (with init and update), got "
            f"{type(made).__name__}"
        )
    return made


_TENSOR_SETTING_HINT = (
    "the optimizer rejected a tensor setting ({err}): torchopt's optimizers take tensors for "
    "some settings only (the learning rate, plain momentum) and pass the others to "
    "Tensor.add(alpha=...), which needs a Python number. hypergrad.optim.sgd / adam / adamw "
    "are differentiable in every setting"
)


def unroll(
    f_in: Callable[[Tensors, Tensors], torch.Tensor],
    psi0: Tensors,
    theta: Tensors,
    steps: int,
    optimizer: OptimizerArg,
    truncate: int,
    make_hparams: Callable[[Tensors], Any],
    inner_losses: list[float],
) -> Tensors:
    """Run ``steps`` optimizer updates from ``psi0`` on ``f_in(psi, theta)``, keeping the autograd
    graph (through ``psi`` and ``theta``) of the last ``truncate`` of them.

    ``optimizer`` may be a function of the hyperparameters: it is called with
    ``make_hparams(theta)`` for the differentiated steps and with detached copies for the others.
    Returns the final iterate (attached to ``theta`` through the kept steps).
    """
    theta_const = tuple(h.detach() for h in theta)
    opt_keep = resolve_optimizer(optimizer, make_hparams(theta))
    opt_const = opt_keep
    if truncate < steps and not _is_transformation(optimizer):
        opt_const = resolve_optimizer(optimizer, make_hparams(theta_const))
    psi: Tensors = tuple(p.detach().requires_grad_(True) for p in psi0)
    state = opt_keep.init(psi)
    for t in range(steps):
        keep = t >= steps - truncate
        if not keep:
            psi = tuple(p.detach().requires_grad_(True) for p in psi)
        loss = f_in(psi, theta if keep else theta_const)
        inner_losses.append(float(loss.detach()))
        grads = torch.autograd.grad(loss, psi, create_graph=keep)
        opt = opt_keep if keep else opt_const
        try:
            updates, state = opt.update(grads, state, params=psi, inplace=False)
        except TypeError as err:
            if "must be Number" in str(err):
                raise HypergradTypeError(_TENSOR_SETTING_HINT.format(err=err)) from err
            raise
        psi = tuple(torchopt.apply_updates(psi, updates, inplace=False))
        if not keep:
            state = _detach_state(state)
            psi = tuple(p.detach().requires_grad_(True) for p in psi)
    return psi


def unused_error(unused: list[str]) -> HypergradError:
    """The error for hyperparameters that received no gradient."""
    return HypergradError(
        f"{', '.join(unused)} influence neither the inner updates nor the outer loss: the "
        "hypergradient would be silently zero. If it is an optimizer setting (a learning rate), "
        "pass the optimizer as a function of the hyperparameters, e.g. "
        "optimizer=lambda h: hg.optim.sgd(lr=h['log_lr'].exp()): an optimizer built beforehand "
        "holds the original tensor, not the one being differentiated"
    )


def unrolled_grad(
    inner_loss: Loss,
    outer_loss: Loss,
    params0: PyTree,
    hparams: PyTree,
    *,
    steps: int,
    optimizer: OptimizerArg,
    truncate: int | None = None,
) -> tuple[PyTree, UnrolledInfo]:
    """Hypergradient by differentiating through ``steps`` optimizer updates.

    Args:
        inner_loss: ``(params, hparams) -> scalar``.
        outer_loss: ``(params, hparams) -> scalar``, evaluated at the final iterate.
        params0: initial inner parameters (pytree of float tensors; not differentiated).
        hparams: hyperparameters (pytree of float tensors).
        steps: number of inner updates T.
        optimizer: a functional optimizer (torchopt's, e.g. ``torchopt.sgd(lr=0.1)``, or
            :mod:`hypergrad.optim`'s), or a function of the hyperparameters returning one, to
            learn the optimizer's own settings:
            ``optimizer=lambda h: hg.optim.sgd(lr=h["log_lr"].exp(), momentum=h["mom"])``. The
            function is called with the tensors being differentiated (structure of
            ``hparams``). Updates are applied out of place.
        truncate: differentiate only through the last K updates (None: all T).

    Returns:
        ``(hypergrads, info)`` with hypergrads shaped like ``hparams``.

    Example:
        >>> import hypergrad as hg, torchopt
        >>> inner = lambda w, lam: 0.5 * ((w - 1.0) ** 2).sum() + 0.5 * lam * (w ** 2).sum()
        >>> outer = lambda w, lam: (w ** 2).sum()
        >>> g, info = hg.unrolled_grad(inner, outer, torch.zeros(2), torch.tensor(0.1),
        ...                            steps=20, optimizer=torchopt.sgd(lr=0.5))
        >>> info.truncate
        20
        >>> h = {"log_lr": torch.tensor(-1.0)}      # learn the learning rate itself
        >>> inner2 = lambda w, h: 0.5 * ((w - 1.0) ** 2).sum()
        >>> g, info = hg.unrolled_grad(inner2, outer, torch.zeros(2), h, steps=5,
        ...                            optimizer=lambda h: hg.optim.sgd(lr=h["log_lr"].exp()))
        >>> sorted(g)
        ['log_lr']
    """
    t0 = time.perf_counter()
    truncate = _checked_settings(inner_loss, outer_loss, steps, truncate, optimizer)
    (p_leaves, p_spec, p_names), (h_leaves, h_spec, h_names) = _checked_leaves(params0, hparams)
    theta = tuple(h.detach().requires_grad_(True) for h in h_leaves)
    info = UnrolledInfo(steps=steps, truncate=truncate)

    def f_in(ps: Tensors, hs: Tensors) -> torch.Tensor:
        return check_scalar_loss(
            inner_loss(tree_unflatten(p_spec, ps), tree_unflatten(h_spec, hs)), "inner_loss"
        )

    with torch.enable_grad(), explain_dtype_errors([(p_leaves, p_names), (h_leaves, h_names)]):
        psi = unroll(
            f_in,
            tuple(p_leaves),
            theta,
            steps,
            optimizer,
            truncate,
            lambda hs: tree_unflatten(h_spec, list(hs)),
            info.inner_losses,
        )
        lo = check_scalar_loss(
            outer_loss(tree_unflatten(p_spec, psi), tree_unflatten(h_spec, theta)), "outer_loss"
        )
        grads = torch.autograd.grad(lo, theta, allow_unused=True)
    hyper = _detached(grads, h_names)
    info.outer_loss = float(lo.detach())
    info.hypergrad_norm = float(tree_norm(hyper))
    info.params = tree_unflatten(p_spec, [p.detach() for p in psi])
    info.time_s = time.perf_counter() - t0
    return tree_unflatten(h_spec, list(hyper)), info


def _checked_settings(
    inner_loss: Loss, outer_loss: Loss, steps: int, truncate: int | None, optimizer: OptimizerArg
) -> int:
    """:func:`unrolled_grad`'s settings checked: the losses, ``steps``, the optimizer, and
    ``truncate`` (returned, None meaning ``steps``)."""
    if not callable(inner_loss) or not callable(outer_loss):
        raise HypergradTypeError("inner_loss and outer_loss must be callables (params, hparams)")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise HypergradValueError(f"steps must be a positive int, got {steps!r}")
    truncate = steps if truncate is None else truncate
    if isinstance(truncate, bool) or not isinstance(truncate, int) or not 1 <= truncate <= steps:
        raise HypergradValueError(
            f"truncate must be an int in [1, steps={steps}], got {truncate!r}"
        )
    check_optimizer(optimizer)
    return truncate


def _checked_leaves(
    params0: PyTree, hparams: PyTree
) -> tuple[tuple[list[torch.Tensor], Any, list[str]], tuple[list[torch.Tensor], Any, list[str]]]:
    """The leaves, structure and leaf names of ``params0`` and of ``hparams``, the leaves
    checked (float tensors)."""
    p_leaves, p_spec = tree_flatten(params0, "params0")
    h_leaves, h_spec = tree_flatten(hparams, "hparams")
    p_names = leaf_paths(p_spec, "params0")
    check_leaves(p_leaves, p_names, "params0")
    h_names = leaf_paths(h_spec, "hparams")
    check_leaves(h_leaves, h_names, "hparams")
    return (p_leaves, p_spec, p_names), (h_leaves, h_spec, h_names)


def _detached(grads: tuple[torch.Tensor | None, ...], names: list[str]) -> Tensors:
    """The hypergradients detached; a hyperparameter the outer loss does not reach raises."""
    unused = [n for n, g in zip(names, grads) if g is None]
    if unused:
        raise unused_error(unused)
    return tuple(g.detach() for g in grads if g is not None)
