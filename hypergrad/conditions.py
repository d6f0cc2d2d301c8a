"""Optimality conditions for :func:`~hypergrad.custom_root` and
:func:`~hypergrad.custom_fixed_point`, and the stationarity measure every implicit entry point
reports.

An optimality condition is a map ``F(params, hparams)`` returning a pytree like ``params`` that is
zero at the solution; a fixed-point map ``T(params, hparams)`` returns a pytree like ``params``
equal to ``params`` at the solution. This module builds the usual ones:

* :func:`stationary` — ``F = ∇_params inner_loss``, the condition ``@hg.implicit`` differentiates
  (its Jacobian, the Hessian, is symmetric, so CG and MINRES may solve its adjoint system);
* :func:`fixed_point` — ``F = params − T(params, hparams)`` for :func:`~hypergrad.root_vjp` /
  :func:`~hypergrad.root_jvp` (what :func:`~hypergrad.custom_fixed_point` uses);
* :func:`proximal_gradient` and :func:`projected_gradient` — the fixed-point maps of proximal and
  projected gradient descent, ``T(x) = prox(x − s ∇f(x), ·, s)``, to hand to
  :func:`~hypergrad.custom_fixed_point`.

**Hyperparameters of the composite maps.** :func:`proximal_gradient` and
:func:`projected_gradient` take ``hparams`` as a pair ``(hparams_smooth, hparams_prox)``: the
first part goes to the smooth loss, the second to the prox (projection). A part without
hyperparameters is written ``()`` (a pytree without tensors) and reaches its function as
``None``, the "no hyperparameters" value of :mod:`hypergrad.prox`'s operators.

**Stationarity.** :func:`relative_residual` is the relative norm ``||F|| / scale`` that every
implicit entry point reports as ``info.stationarity`` (:class:`~hypergrad.HypergradInfo`):
:func:`~hypergrad.implicit_grad`, :func:`~hypergrad.implicit` and
:class:`~hypergrad.HyperStep` for ``F = ∇_params inner_loss``; :func:`~hypergrad.custom_root`,
:func:`~hypergrad.custom_fixed_point`, :func:`~hypergrad.root_vjp` and
:func:`~hypergrad.root_jvp` for their condition. :func:`warn_if_nonstationary` warns with
:class:`~hypergrad.NonStationaryWarning` above :data:`STATIONARITY_THRESHOLD` (every entry point
but ``HyperStep``, which is called away from the optimum by design and only reports). The scales
(chosen so that the ratio is dimensionless):

* a root of ``F``: ``max(||J x||, ||F(x) − J x||)`` with ``J = ∂F/∂params`` at ``x``: the two
  terms of ``F``'s linearisation ``F(x) − J x + J y`` at ``x``. For a linear condition
  ``F = A x − b`` this is ``||A x − b|| / max(||A x||, ||b||)``, a linear solver's relative
  residual; it costs one Jacobian-vector product;
* a gradient ``F = ∇L`` (the implicit entry points, :func:`stationary`): the same with
  ``J = H``, the Hessian: ``||∇L(x)|| / max(||H x||, ||∇L(x) − H x||)``, one Hessian-vector
  product (``∇L`` itself comes free with the products' gradient graph). For a quadratic
  ``L = ½ xᵀ H x − cᵀ x`` it is the relative residual of ``H x = c``. It does not change when
  the loss is multiplied by a constant or the parameters are rescaled;
* a fixed point of ``T``: ``||T(x) − x|| / ||x||`` (``T`` maps params to params: same units).

All are 0 at an exact solution (no product is spent then); the returned derivatives carry a
relative error of order ``κ · stationarity`` (``κ`` the condition number of ``∂F/∂params``),
hence the threshold.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .errors import HypergradTypeError, HypergradValueError, NonStationaryWarning, warn
from .prox import kinks as prox_kinks
from .tree import PyTree, Tensors, tree_flatten, tree_norm, tree_unflatten

__all__ = [
    "STATIONARITY_THRESHOLD",
    "Condition",
    "fixed_point",
    "projected_gradient",
    "proximal_gradient",
    "relative_residual",
    "stationary",
    "warn_if_nonstationary",
]

STATIONARITY_THRESHOLD = 1e-3
"""``info.stationarity`` above this warns (:class:`~hypergrad.NonStationaryWarning`): the point is
farther than 0.1 % (relative) from satisfying its condition, so a derivative computed there is off
by about ``κ · 1e-3`` relative or more (``κ``: the condition number of ``∂F/∂params``)."""

Map = Callable[[PyTree, PyTree], PyTree]


@dataclass(frozen=True)
class Condition:
    """An optimality condition ``F(params, hparams)`` (zero at the solution) with what is known
    about it; calling it evaluates ``F``.

    Plain callables work wherever a condition is expected (they are ``kind="root"``,
    ``symmetric=False``); a ``Condition`` tells the implicit entry points more:

    Attributes:
        fn: for ``kind="root"`` and ``"stationary"``: ``F`` itself; for ``"fixed_point"``: the
            map ``T``, with ``F = params − T(params, hparams)``.
        kind: ``"root"``, ``"fixed_point"`` or ``"stationary"`` (a gradient); it selects the
            scale of :func:`relative_residual`.
        symmetric: ``∂F/∂params`` is symmetric (a Hessian), so symmetric-only solvers (CG,
            MINRES, Nystrom) are allowed without the symmetry probe.
        name: how messages name the condition.
        kinks: ``kinks(params, hparams, rtol) -> int | None``, for a condition built on a
            proximal or projection operator of :mod:`hypergrad.prox`: how many coordinates of
            the operator's input lie within ``rtol · max(1, max|input|)`` of a point where the
            operator is not differentiable (:func:`hypergrad.prox.kinks`); None: unknown.

    Example:
        >>> import hypergrad as hg
        >>> F = hg.conditions.fixed_point(lambda x, h: 0.5 * x + h)
        >>> F(torch.tensor(2.0), torch.tensor(1.0))  # x - T(x)
        tensor(0.)
    """

    fn: Map
    kind: str = "root"
    symmetric: bool = False
    name: str = "optimality_fn"
    kinks: Callable[[PyTree, PyTree, float], int | None] | None = None

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise HypergradTypeError(f"{self.name} must be callable, got {type(self.fn).__name__}")
        if self.kind not in ("root", "fixed_point", "stationary"):
            raise HypergradValueError(
                f"kind must be 'root', 'fixed_point' or 'stationary', got {self.kind!r}"
            )

    def __call__(self, params: PyTree, hparams: PyTree) -> PyTree:
        if self.kind != "fixed_point":
            return self.fn(params, hparams)
        p_leaves, p_spec = tree_flatten(params, "params")
        t_leaves, t_spec = tree_flatten(self.fn(params, hparams), f"result of {self.name}")
        if t_spec != p_spec:
            raise HypergradValueError(
                f"{self.name} must return a pytree like params: got {t_spec!r}, expected {p_spec!r}"
            )
        return tree_unflatten(p_spec, [p - t for t, p in zip(t_leaves, p_leaves)])


def as_condition(fn: Map | Condition, name: str = "optimality_fn") -> Condition:
    """``fn`` as a :class:`Condition` (a plain callable becomes ``kind="root"``)."""
    if isinstance(fn, Condition):
        return fn
    if not callable(fn):
        raise HypergradTypeError(f"{name} must be callable, got {type(fn).__name__}")
    return Condition(fn, "root", False, name)


def stationary(inner_loss: Callable[[PyTree, PyTree], torch.Tensor]) -> Condition:
    """The stationarity condition ``F(params, hparams) = ∇_params inner_loss(params, hparams)``.

    This is the condition ``@hg.implicit(inner_loss)`` differentiates: ``hg.custom_root(
    hg.conditions.stationary(inner_loss), solver=hg.CG())`` gives the same derivatives. Its
    Jacobian is the Hessian of ``inner_loss`` (symmetric), so CG/MINRES are accepted without
    the symmetry probe; with ``solver=None`` :func:`~hypergrad.custom_root` uses CG for it.

    ``F`` is built with ``torch.autograd.grad(..., create_graph=True)``, so it is differentiable
    in ``params`` and ``hparams``; leaves of ``params`` that do not require grad are differentiated
    through detached copies, and a leaf that the loss does not use gets a zero gradient.

    Args:
        inner_loss: ``(params, hparams) -> scalar tensor``.

    Returns:
        A :class:`Condition` (``kind="stationary"``, ``symmetric=True``).

    Example:
        >>> import hypergrad as hg
        >>> F = hg.conditions.stationary(lambda w, lam: 0.5 * lam * (w**2).sum() - w.sum())
        >>> F(torch.tensor([1.0, 2.0]), torch.tensor(2.0))
        tensor([1., 3.])
    """
    if not callable(inner_loss):
        raise HypergradTypeError(f"inner_loss must be callable, got {type(inner_loss).__name__}")

    def gradient(params: PyTree, hparams: PyTree) -> PyTree:
        leaves, spec = tree_flatten(params, "params")
        # a graph only when someone can differentiate the gradient
        graph = torch.is_grad_enabled() and (_requires_grad(leaves) or _requires_grad(hparams))
        with torch.enable_grad():
            xs = [t if t.requires_grad else t.detach().requires_grad_(True) for t in leaves]
            loss = inner_loss(tree_unflatten(spec, xs), hparams)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise HypergradValueError(
                    "inner_loss must return a scalar tensor, got "
                    + (
                        f"shape {tuple(loss.shape)}"
                        if isinstance(loss, torch.Tensor)
                        else type(loss).__name__
                    )
                )
            grads = torch.autograd.grad(loss.reshape(()), xs, create_graph=graph, allow_unused=True)
        return tree_unflatten(
            spec,
            [
                torch.zeros_like(x) if g is None else g if graph else g.detach()
                for g, x in zip(grads, xs)
            ],
        )

    gradient.__name__ = f"stationary({getattr(inner_loss, '__name__', 'inner_loss')})"
    return Condition(gradient, "stationary", True, "stationary(inner_loss)")


def _requires_grad(tree: Any) -> bool:
    """Whether any tensor in ``tree`` (any nesting of tuples/lists/dicts; other objects are
    ignored) requires grad."""
    if isinstance(tree, torch.Tensor):
        return tree.requires_grad
    if isinstance(tree, (tuple, list)):
        return any(_requires_grad(t) for t in tree)
    if isinstance(tree, dict):
        return any(_requires_grad(t) for t in tree.values())
    return False


def fixed_point(fixed_point_fn: Map) -> Condition:
    """The root form ``F(params, hparams) = params − T(params, hparams)`` of a fixed-point map.

    For :func:`~hypergrad.root_vjp` / :func:`~hypergrad.root_jvp` at a fixed point;
    :func:`~hypergrad.custom_fixed_point` uses it. Its stationarity is
    ``||T(x) − x|| / ||x||``.

    Args:
        fixed_point_fn: ``T(params, hparams) -> pytree like params``.

    Example:
        >>> import hypergrad as hg
        >>> F = hg.conditions.fixed_point(lambda x, h: torch.tanh(x) + h)
        >>> F(torch.zeros(2), torch.ones(2))
        tensor([-1., -1.])
    """
    if isinstance(fixed_point_fn, Condition):
        raise HypergradTypeError("fixed_point() takes a map T(params, hparams), not a Condition")
    # the maps of proximal_gradient / projected_gradient know their operator's kinks
    kinks = getattr(fixed_point_fn, "kinks", None)
    return Condition(fixed_point_fn, "fixed_point", False, "fixed_point_fn", kinks)


def _check_stepsize(stepsize: Any) -> float | torch.Tensor:
    if isinstance(stepsize, torch.Tensor):
        if stepsize.numel() != 1 or not stepsize.is_floating_point():
            raise HypergradValueError("stepsize must be a positive real scalar")
        value = float(stepsize.detach())
    elif isinstance(stepsize, numbers.Real) and not isinstance(stepsize, bool):
        value = float(stepsize)
    else:
        raise HypergradTypeError(f"stepsize must be a positive number, got {stepsize!r}")
    if not (math.isfinite(value) and value > 0):
        raise HypergradValueError(f"stepsize must be positive and finite, got {value}")
    return stepsize if isinstance(stepsize, torch.Tensor) else value


def _split(hparams: PyTree, what: str) -> tuple[PyTree, PyTree]:
    """``(hparams_smooth, hparams_prox)``, an empty part (``()``) as None."""
    if not isinstance(hparams, (tuple, list)) or len(hparams) != 2:
        raise HypergradTypeError(
            f"hparams of a {what} map must be a pair (hparams_smooth, hparams_prox); write () "
            f"for a part without hyperparameters. Got {type(hparams).__name__}"
            + (f" of length {len(hparams)}" if isinstance(hparams, (tuple, list)) else "")
        )

    def part(h: PyTree) -> PyTree:
        return None if isinstance(h, (tuple, list)) and len(h) == 0 else h

    return part(hparams[0]), part(hparams[1])


def _gradient_step(
    loss: Callable[[PyTree, PyTree], torch.Tensor],
    stepsize: float | torch.Tensor,
    params: PyTree,
    h_loss: PyTree,
) -> PyTree:
    """``params − stepsize · ∇_params loss(params, h_loss)`` (differentiable)."""
    grad = stationary(loss)(params, h_loss)
    p_leaves, spec = tree_flatten(params, "params")
    g_leaves, _ = tree_flatten(grad, "gradient")
    return tree_unflatten(spec, [p - stepsize * g for p, g in zip(p_leaves, g_leaves)])


def proximal_gradient(
    smooth_loss: Callable[[PyTree, PyTree], torch.Tensor],
    prox: Callable[..., PyTree],
    stepsize: float | torch.Tensor,
) -> Callable[[PyTree, PyTree], PyTree]:
    """The fixed-point map of proximal gradient descent on ``f(x, θ_f) + g(x, θ_g)``.

    ``T(params, (hparams_smooth, hparams_prox)) = prox(params − s ∇f(params, hparams_smooth),
    hparams_prox, s)`` with ``s = stepsize``. Its fixed points are the minimisers of ``f + g``
    for any ``s > 0``; hand ``T`` to :func:`~hypergrad.custom_fixed_point`.

    Args:
        smooth_loss: ``f(params, hparams_smooth) -> scalar``.
        prox: ``prox(x, hparams_prox, scaling)``, e.g. :func:`hypergrad.prox.prox_lasso`.
        stepsize: ``s > 0`` (a number or a scalar tensor; a constant, not differentiated).

    Returns:
        ``T(params, hparams)``, with ``hparams`` the pair ``(hparams_smooth, hparams_prox)``; an
        empty part ``()`` reaches its function as None.

    Example (lasso; the fixed point is the soft-thresholded least-squares solution):
        >>> import hypergrad as hg
        >>> soft = lambda x, lam, s: torch.sign(x) * torch.relu(x.abs() - s * lam)
        >>> f = lambda w, _: 0.5 * ((w - torch.tensor([3.0, 0.5])) ** 2).sum()
        >>> T = hg.conditions.proximal_gradient(f, soft, 1.0)
        >>> T(torch.tensor([2.0, 0.0]), ((), torch.tensor(1.0)))  # a fixed point
        tensor([2., 0.])
    """
    for name, fn in (("smooth_loss", smooth_loss), ("prox", prox)):
        if not callable(fn):
            raise HypergradTypeError(f"{name} must be callable, got {type(fn).__name__}")
    step = _check_stepsize(stepsize)

    def proximal_gradient_map(params: PyTree, hparams: PyTree) -> PyTree:
        h_smooth, h_prox = _split(hparams, "proximal_gradient")
        return prox(_gradient_step(smooth_loss, step, params, h_smooth), h_prox, step)

    def count_kinks(params: PyTree, hparams: PyTree, rtol: float) -> int | None:
        h_smooth, h_prox = _split(hparams, "proximal_gradient")
        z = _gradient_step(smooth_loss, step, params, h_smooth)
        return _count_kinks(prox, z, h_prox, step, rtol)

    proximal_gradient_map.kinks = count_kinks  # type: ignore[attr-defined]
    return proximal_gradient_map


def projected_gradient(
    loss: Callable[[PyTree, PyTree], torch.Tensor],
    projection: Callable[..., PyTree],
    stepsize: float | torch.Tensor,
) -> Callable[[PyTree, PyTree], PyTree]:
    """The fixed-point map of projected gradient descent on ``loss`` over a convex set.

    ``T(params, (hparams_loss, hparams_projection)) = projection(params − s ∇loss(params,
    hparams_loss), hparams_projection)`` with ``s = stepsize``; its fixed points are the
    constrained minimisers. Hand ``T`` to :func:`~hypergrad.custom_fixed_point`.

    Args:
        loss: ``(params, hparams_loss) -> scalar``.
        projection: ``projection(x, hparams_projection)``, e.g.
            :func:`hypergrad.prox.projection_box` with ``hparams_projection = (lower, upper)``.
        stepsize: ``s > 0`` (a number or a scalar tensor; a constant, not differentiated).

    Returns:
        ``T(params, hparams)``, with ``hparams`` the pair ``(hparams_loss,
        hparams_projection)``; an empty part ``()`` reaches its function as None.

    Example:
        >>> import hypergrad as hg
        >>> loss = lambda w, c: 0.5 * ((w - c) ** 2).sum()
        >>> T = hg.conditions.projected_gradient(loss, lambda x, _: x.clamp(min=0.0), 0.5)
        >>> T(torch.tensor([1.0, 0.0]), (torch.tensor([1.0, -2.0]), ()))  # a fixed point
        tensor([1., 0.])
    """
    for name, fn in (("loss", loss), ("projection", projection)):
        if not callable(fn):
            raise HypergradTypeError(f"{name} must be callable, got {type(fn).__name__}")
    step = _check_stepsize(stepsize)

    def projected_gradient_map(params: PyTree, hparams: PyTree) -> PyTree:
        h_loss, h_proj = _split(hparams, "projected_gradient")
        return projection(_gradient_step(loss, step, params, h_loss), h_proj)

    def count_kinks(params: PyTree, hparams: PyTree, rtol: float) -> int | None:
        h_loss, h_proj = _split(hparams, "projected_gradient")
        z = _gradient_step(loss, step, params, h_loss)
        return _count_kinks(projection, z, h_proj, 1.0, rtol)

    projected_gradient_map.kinks = count_kinks  # type: ignore[attr-defined]
    return projected_gradient_map


def _count_kinks(
    prox: Callable[..., PyTree], z: PyTree, h: PyTree, scaling: Any, rtol: float
) -> int | None:
    """:func:`hypergrad.prox.kinks` of ``prox`` at its input ``z``, within ``rtol`` relative to
    ``max(1, max|z|)``; None for an operator whose kinks are unknown."""
    leaves, _ = tree_flatten(z, "the operator's input")
    scale = max([1.0] + [float(t.detach().abs().max()) for t in leaves if t.numel()])
    with torch.no_grad():
        return prox_kinks(prox, z, h, scaling, tol=rtol * scale)


def relative_residual(residual: Tensors, *scales: Tensors) -> float:
    """``||residual|| / max(||s|| for s in scales)``: how far a point is from its condition.

    0 when the residual is exactly zero; ``inf`` when it is not but every scale is zero.
    Entry points pass ``F(x)`` and the scales named in this module's docstring (roots:
    ``J x`` and ``F(x) − J x``; fixed points: ``x``; gradients: ``H x`` and ``∇L(x) − H x``).

    Example:
        >>> relative_residual((torch.tensor([3.0, 4.0]),), (torch.tensor([0.0, 50.0]),))
        0.1
    """
    num = float(tree_norm(residual))
    if num == 0.0:
        return 0.0
    den = max((float(tree_norm(s)) for s in scales), default=0.0)
    return num / den if den > 0 else math.inf


def warn_if_nonstationary(
    value: float,
    what: str,
    *,
    threshold: float = STATIONARITY_THRESHOLD,
    stacklevel: int | None = None,
) -> None:
    """Warn with :class:`~hypergrad.NonStationaryWarning` when ``value > threshold`` (or NaN).

    The text is fixed for a given ``what`` and ``threshold`` (the value is in
    ``info.stationarity``), so Python's default warning filter shows it once per call site
    rather than once per outer step.

    Args:
        value: a :func:`relative_residual`.
        what: the condition's name for the message (e.g. ``"optimality_fn"``).
        threshold: the limit (default :data:`STATIONARITY_THRESHOLD`).
        stacklevel: where the warning points. None (the default): at the first line outside
            hypergrad and torch, the line where the user called the library (see
            :func:`hypergrad.errors.warn`), so the default filter shows it once per such line.
            An int is passed on as :func:`warnings.warn`'s own (2: the line calling this
            function).

    Example (what :class:`~hypergrad.HyperStep`, which only reports, leaves to its caller):
        >>> import warnings, hypergrad as hg
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     hg.conditions.warn_if_nonstationary(0.2, "inner_loss")
        >>> caught[0].category.__name__
        'NonStationaryWarning'
    """
    if value <= threshold:
        return
    warn(
        f"the point is not a solution of {what}: its stationarity (the relative norm of the "
        f"condition; the value is in info.stationarity) is above {threshold:g} (or NaN), so the "
        "implicit derivative computed there is not the derivative of the solution map (relative "
        "error of order condition number x stationarity). Solve the inner problem more tightly "
        "(or check that the solver and the condition describe the same problem)",
        NonStationaryWarning,
        stacklevel,
    )
