"""Proximal operators and projections, differentiable in the input and in their hyperparameters.

Every operator here has the signature ``prox(x, hparams=None, scaling=1.0)`` and returns

    argmin_y  ½‖y − x‖² + scaling · g(y, hparams)

for a convex penalty ``g`` (projections: ``g`` is the indicator of a convex set, so ``scaling``
is accepted and ignored, which lets the two kinds be swapped inside a proximal-gradient map
``prox(x − s∇f(x), hparams, s)``). The semantics of ``hparams`` follow jaxopt's
``jaxopt.prox`` and ``jaxopt.projection`` (https://jaxopt.github.io/stable/api.html); the code is
this library's own.

``x`` is a tensor or a pytree (tuple/list/dict, nested) of tensors; the result has its structure.
A hyperparameter is a real number, a floating-point tensor that broadcasts against each leaf, or
a pytree with the structure of ``x`` (one value per leaf). Operators that involve a norm of the
whole input (:func:`prox_group_lasso` with ``dim=None``, :func:`projection_l2_ball`) take it over
every leaf together, as jaxopt does.

The operators are built from ``torch`` ops only (``sign``, ``relu``, ``clamp``, ``sort``,
``cumsum``, ``gather``, norms), so ``torch.autograd`` and ``torch.func`` (``grad``, ``jacrev``,
``jacfwd``, ``vmap``) differentiate them in ``x`` and in ``hparams`` everywhere except on the
kinks (``|x_i| = λ`` for the lasso, a coordinate on a box face, ...), a set of measure zero;
there autograd returns one of the one-sided derivatives. :func:`kinks` counts the coordinates
of an input at (or within a tolerance of) a kink, :func:`kink_mask` says which they are.

Bad hyperparameters raise :class:`~hypergrad.HypergradValueError` naming them, never a NaN or a
result of another shape: a negative strength or ``scaling``; a NaN or infinite strength,
``scaling`` or simplex value (``0 · inf`` has no value); ``lower > upper``, a NaN bound,
``lower = +inf`` or ``upper = −inf`` (``−inf``/``+inf`` on the other side is no bound); a
non-positive or NaN radius (``+inf`` is the whole space: the identity); a tensor that does not
broadcast to its leaf's shape (``x`` of shape ``(3,)`` with a ``λ`` of shape ``(2, 3)`` would
give a ``(2, 3)`` result). Shapes are checked without reading values; the value checks of one
call are read together (one host synchronisation, none when every hyperparameter is a number)
and are skipped for values batched by ``torch.func.vmap`` (where data-dependent checks are
impossible).

Example:
    >>> import torch, hypergrad as hg
    >>> hg.prox.prox_lasso(torch.tensor([-2.0, 0.5, 3.0]), 1.0)
    tensor([-1.,  0.,  2.])
    >>> hg.prox.projection_simplex(torch.tensor([0.5, 0.2, -1.0]))
    tensor([0.6500, 0.3500, 0.0000])
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable
from typing import Any, cast

import torch

from .errors import HypergradTypeError, HypergradValueError
from .settings import check_number
from .tree import PyTree, TreeSpec, tree_flatten, tree_unflatten

__all__ = [
    "kink_mask",
    "kinks",
    "prox_elastic_net",
    "prox_group_lasso",
    "prox_lasso",
    "prox_non_negative_lasso",
    "projection_box",
    "projection_l2_ball",
    "projection_non_negative",
    "projection_simplex",
]

Param = float | torch.Tensor


# ---------------------------------------------------------------------------------------------
# helpers: hyperparameters broadcast over the leaves of x, validation that survives torch.func


def _leaves(x: PyTree) -> tuple[list[torch.Tensor], TreeSpec]:
    leaves, spec = tree_flatten(x, "x")
    for i, leaf in enumerate(leaves):
        if not leaf.is_floating_point():
            where = "x" if spec.kind == "leaf" else f"leaf {i} of x"
            raise HypergradTypeError(f"{where} must be a floating-point tensor, got {leaf.dtype}")
    return leaves, spec


def _param(value: Any, name: str) -> Param:
    """A number or a floating-point tensor (bools, strings, integer tensors refused)."""
    if isinstance(value, torch.Tensor):
        if not value.is_floating_point():
            raise HypergradTypeError(f"{name} must be a floating-point tensor, got {value.dtype}")
        return value
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    raise HypergradTypeError(f"{name} must be a real number or a tensor, got {value!r}")


def _per_leaf(value: Any, spec: TreeSpec, n: int, name: str) -> list[Param]:
    """One hyperparameter per leaf of x: shared, or a pytree with the structure of x."""
    if isinstance(value, (tuple, list, dict)) and spec.kind != "leaf":
        out: list[Param] = []
        _zip_spec(value, spec, name, out)
        return out
    p = _param(value, name)
    return [p] * n


def _zip_spec(value: Any, spec: TreeSpec, path: str, out: list[Param]) -> None:
    """Leaves (numbers or tensors) of ``value``, which must have the structure ``spec``."""
    if spec.kind == "leaf":
        out.append(_param(value, path))
        return
    kind = {"tuple": tuple, "list": list, "dict": dict}[spec.kind]
    same = isinstance(value, kind) and len(value) == len(spec.children)
    if same and isinstance(value, dict):
        same = tuple(value.keys()) == spec.keys
    if not same:
        raise HypergradValueError(
            f"{path} must be a number, a tensor or a pytree with the structure of x {spec!r}, "
            f"got {type(value).__name__} {value!r:.80}"
        )
    if isinstance(value, dict):
        for k, child in zip(spec.keys, spec.children):
            _zip_spec(value[k], child, f"{path}[{k!r}]", out)
    else:
        for i, (v, child) in enumerate(zip(value, spec.children)):
            _zip_spec(v, child, f"{path}[{i}]", out)


class _Checks:
    """Value checks on tensor hyperparameters, collected over one call and read together: one
    host synchronisation per device and call (none when every hyperparameter is a number).

    ``add(bad, message)`` records a boolean tensor that is True where a value is invalid;
    :meth:`run` raises :class:`~hypergrad.HypergradValueError` with the message of the first
    invalid one. Values batched by ``torch.func.vmap`` cannot be read (no data-dependent
    control flow there), so the check is skipped for them.
    """

    def __init__(self) -> None:
        self.items: list[tuple[torch.Tensor, Callable[[], str]]] = []

    def add(self, bad: torch.Tensor, message: Callable[[], str]) -> None:
        self.items.append((bad.detach().any(), message))

    def run(self) -> None:
        if not self.items:
            return
        by_device: dict[torch.device, list[int]] = {}
        for i, (flag, _) in enumerate(self.items):
            by_device.setdefault(flag.device, []).append(i)
        failed: list[int] = []
        for idx in by_device.values():
            try:  # one read per device
                flags = torch.stack([self.items[i][0] for i in idx]).tolist()
            except RuntimeError:  # vmap: "data-dependent control flow" is not supported
                continue
            failed += [i for i, f in zip(idx, flags) if f]
        if failed:
            raise HypergradValueError(self.items[min(failed)][1]())


def _entries(value: torch.Tensor, strict: bool) -> str:
    """What is wrong in a tensor hyperparameter (for a message: on the error path only)."""
    v = value.detach()
    if not bool(torch.isfinite(v).all()):
        return "NaN/Inf entries"
    return "non-positive entries" if strict else "negative entries"


def _check_low(value: Param, name: str, checks: _Checks, *, strict: bool) -> None:
    """``value`` finite and ``>= 0`` (``> 0`` when ``strict``): a number now, a tensor with
    ``checks``."""
    kind = "> 0" if strict else ">= 0"
    if isinstance(value, float):
        if not math.isfinite(value) or (value <= 0.0 if strict else value < 0.0):
            raise HypergradValueError(f"{name} must be finite and {kind}, got {value}")
        return
    bad = ~torch.isfinite(value) | ((value <= 0) if strict else (value < 0))
    checks.add(
        bad,
        lambda: f"{name} must be finite and {kind}, got a tensor with {_entries(value, strict)}",
    )


def _fit(value: Param | None, shape: torch.Size, name: str, what: str = "x's shape") -> None:
    """A tensor hyperparameter must broadcast TO ``shape`` (the leaf's, or the groups'): one
    that would broadcast the result to a larger shape is refused (a shape check, no sync)."""
    if not isinstance(value, torch.Tensor) or value.shape == shape:
        return
    try:
        fits = torch.broadcast_shapes(value.shape, shape) == shape  # type: ignore[no-untyped-call]
    except RuntimeError:
        fits = False
    if not fits:
        raise HypergradValueError(
            f"{name} has shape {tuple(value.shape)}, which does not broadcast to {what} "
            f"{tuple(shape)}: the result would not have x's shape. Pass a number, a tensor "
            f"that broadcasts to {tuple(shape)}, or a pytree like x"
        )


def _where(name: str, spec: TreeSpec, i: int) -> str:
    return name if spec.kind == "leaf" else f"{name} (for leaf {i} of x)"


def _scaling(scaling: Any, checks: _Checks) -> Param:
    s = _param(scaling, "scaling")
    _check_low(s, "scaling", checks, strict=False)
    return s


def _coordinatewise(
    x: PyTree, named: list[tuple[Any, str]], scaling: Any, *, strict: bool = False
) -> tuple[list[torch.Tensor], TreeSpec, list[list[Param]], Param]:
    """Leaves of ``x``, each named hyperparameter per leaf and ``scaling``, checked: every
    tensor broadcasts to its leaf's shape, every value is finite and ``>= 0`` (``> 0`` when
    ``strict``); the tensor values read together (:class:`_Checks`)."""
    leaves, spec = _leaves(x)
    checks = _Checks()
    s = _scaling(scaling, checks)
    params = []
    for value, name in named:
        ps = _per_leaf(value, spec, len(leaves), name)
        for i, (leaf, p) in enumerate(zip(leaves, ps)):
            _fit(p, leaf.shape, _where(name, spec, i))
        for j, p in enumerate(ps):
            if all(p is not q for q in ps[:j]):  # a shared value is checked once
                _check_low(p, name, checks, strict=strict)
        params.append(ps)
    for i, leaf in enumerate(leaves):
        _fit(s, leaf.shape, _where("scaling", spec, i))
    checks.run()
    return leaves, spec, params, s


def _map(fn: Callable[..., torch.Tensor], x: PyTree, params: list[list[Param]]) -> PyTree:
    leaves, spec = _leaves(x)
    out = [fn(leaf, *(p[i] for p in params)) for i, leaf in enumerate(leaves)]
    return tree_unflatten(spec, out)


def _pair(hparams: Any, name: str, default: tuple[Any, Any]) -> tuple[Any, Any]:
    if hparams is None:
        return default
    if not isinstance(hparams, (tuple, list)) or len(hparams) != 2:
        raise HypergradTypeError(f"{name} must be a pair {default}, got {hparams!r}")
    return hparams[0], hparams[1]


def _soft(x: torch.Tensor, t: Param) -> torch.Tensor:
    """Soft threshold ``sign(x) · max(|x| − t, 0)``."""
    return torch.sign(x) * torch.relu(torch.abs(x) - t)


def _sq_norm(leaves: list[torch.Tensor]) -> torch.Tensor:
    return cast(torch.Tensor, sum(leaf.pow(2).sum() for leaf in leaves))


def _safe_sqrt(sq: torch.Tensor) -> torch.Tensor:
    """``sqrt`` whose derivative at 0 is 0 instead of inf (the double-``where`` idiom)."""
    pos = sq > 0
    return torch.where(pos, torch.sqrt(torch.where(pos, sq, torch.ones_like(sq))), 0.0 * sq)


# ---------------------------------------------------------------------------------------------
# proximal operators


def prox_lasso(x: PyTree, hparams: Any = None, scaling: Any = 1.0) -> PyTree:
    """Proximal operator of the l1 norm (soft thresholding).

    ``argmin_y ½‖y − x‖² + scaling · λ · ‖y‖₁`` = ``sign(x) · max(|x| − scaling · λ, 0)``,
    with ``λ = hparams`` (jaxopt's ``prox_lasso``, ``l1reg``).

    Derivatives (off the kinks ``|x_i| = scaling·λ_i``): ``∂y_i/∂x_i = 1`` on the active set
    ``|x_i| > scaling·λ_i`` and 0 elsewhere; ``∂y_i/∂λ_i = −scaling · sign(x_i)`` on the active
    set and 0 elsewhere.

    Args:
        x: a tensor or a pytree of tensors.
        hparams: ``λ >= 0``: a number, a tensor broadcasting to ``x``'s shape (per-coordinate
            strengths) or a pytree like ``x``. ``None`` means 1.0.
        scaling: a non-negative factor on the penalty (a proximal-gradient step size).

    Returns:
        The proximal point, with the structure of ``x``.

    Raises:
        HypergradValueError: a negative or non-finite ``λ`` or ``scaling``, or one that does not
            broadcast to ``x``'s shape.

    Example:
        >>> import torch, hypergrad as hg
        >>> hg.prox.prox_lasso(torch.tensor([-2.0, 0.5, 3.0]), torch.tensor([1.0, 1.0, 2.5]))
        tensor([-1.0000,  0.0000,  0.5000])
    """
    lam_v = 1.0 if hparams is None else hparams
    leaves, spec, (lam,), s = _coordinatewise(x, [(lam_v, "hparams (λ)")], scaling)
    return tree_unflatten(spec, [_soft(xi, s * li) for xi, li in zip(leaves, lam)])


def prox_non_negative_lasso(x: PyTree, hparams: Any = None, scaling: Any = 1.0) -> PyTree:
    """Proximal operator of the l1 norm restricted to the non-negative orthant.

    ``argmin_{y >= 0} ½‖y − x‖² + scaling · λ · ‖y‖₁`` = ``max(x − scaling · λ, 0)``, with
    ``λ = hparams`` (jaxopt's ``prox_non_negative_lasso``).

    Args:
        x: a tensor or a pytree of tensors.
        hparams: ``λ >= 0``: a number, a tensor broadcasting to ``x``'s shape or a pytree like
            ``x``. ``None`` means 1.0.
        scaling: a non-negative factor on the penalty.

    Returns:
        The proximal point, with the structure of ``x``.

    Raises:
        HypergradValueError: a negative or non-finite ``λ`` or ``scaling``, or one that does not
            broadcast to ``x``'s shape.

    Example:
        >>> import torch, hypergrad as hg
        >>> hg.prox.prox_non_negative_lasso(torch.tensor([-2.0, 0.5, 3.0]), 1.0)
        tensor([0., 0., 2.])
    """
    lam_v = 1.0 if hparams is None else hparams
    leaves, spec, (lam,), s = _coordinatewise(x, [(lam_v, "hparams (λ)")], scaling)
    return tree_unflatten(spec, [torch.relu(xi - s * li) for xi, li in zip(leaves, lam)])


def prox_elastic_net(x: PyTree, hparams: Any = None, scaling: Any = 1.0) -> PyTree:
    """Proximal operator of the elastic net penalty.

    With ``hparams = (λ, γ)`` (jaxopt's ``prox_elastic_net``) the penalty is
    ``g(y) = λ · (‖y‖₁ + γ/2 · ‖y‖²)``, and

        argmin_y ½‖y − x‖² + scaling · g(y)  =  soft(x, scaling·λ) / (1 + scaling·λ·γ)

    where ``soft`` is the soft threshold of :func:`prox_lasso`.

    Args:
        x: a tensor or a pytree of tensors.
        hparams: the pair ``(λ, γ)``, both ``>= 0``; each a number, a tensor broadcasting to
            ``x``'s shape or a pytree like ``x``; finite. ``None`` means ``(1.0, 1.0)``.
        scaling: a non-negative factor on the penalty.

    Returns:
        The proximal point, with the structure of ``x``.

    Raises:
        HypergradTypeError: ``hparams`` is not a pair.
        HypergradValueError: a negative or non-finite ``λ``, ``γ`` or ``scaling``, or one that
            does not broadcast to ``x``'s shape.

    Example:
        >>> import torch, hypergrad as hg
        >>> hg.prox.prox_elastic_net(torch.tensor([-2.0, 0.5, 3.0]), (1.0, 1.0))
        tensor([-0.5000,  0.0000,  1.0000])
    """
    lam_v, gam_v = _pair(hparams, "hparams (λ, γ)", (1.0, 1.0))
    named = [(lam_v, "hparams[0] (λ)"), (gam_v, "hparams[1] (γ)")]
    leaves, spec, (lam, gam), s = _coordinatewise(x, named, scaling)
    out = [_soft(xi, s * li) / (1.0 + s * li * gi) for xi, li, gi in zip(leaves, lam, gam)]
    return tree_unflatten(spec, out)


def prox_group_lasso(
    x: PyTree,
    hparams: Any = None,
    scaling: Any = 1.0,
    *,
    dim: int | tuple[int, ...] | None = None,
) -> PyTree:
    """Proximal operator of the (group) l2 norm: block soft thresholding.

    ``argmin_y ½‖y − x‖² + scaling · λ · Σ_g ‖y_g‖₂`` = ``x_g · max(1 − scaling·λ / ‖x_g‖, 0)``
    for each group ``g``.

    Groups: with ``dim=None`` (the default, jaxopt's ``prox_group_lasso``) the whole input is
    one group; for a pytree, the norm is taken over all its leaves together. With ``dim`` given,
    the norm is taken over those dimensions of each leaf, so every slice along the remaining
    dimensions is its own group: for a 2-D ``x``, ``dim=1`` makes each **row** a group (and
    ``dim=0`` each column). ``λ`` may then be a tensor of per-group strengths broadcasting to
    the reduced shape (``(n_rows,)`` for ``dim=1``).

    Args:
        x: a tensor or a pytree of tensors.
        hparams: ``λ >= 0``: a number or a tensor (per group, see above); a pytree like ``x``
            when ``dim`` is given. ``None`` means 1.0.
        scaling: a non-negative factor on the penalty.
        dim: the dimension(s) that a group spans (see above); ``None``: one group.

    Returns:
        The proximal point, with the structure of ``x``.

    Raises:
        HypergradValueError: a negative or non-finite ``λ`` or ``scaling``; a non-scalar one
            with ``dim=None``, or one that does not broadcast to the groups' shape.

    Example:
        >>> import torch, hypergrad as hg
        >>> x = torch.tensor([[3.0, 4.0], [0.3, 0.4]])
        >>> hg.prox.prox_group_lasso(x, 1.0, dim=1)  # rows are groups: norms 5 and 0.5
        tensor([[2.4000, 3.2000],
                [0.0000, 0.0000]])
    """
    leaves, spec, lams, s = _group_params(x, hparams, scaling, dim)
    if dim is None:
        norm = _safe_sqrt(_sq_norm(leaves))
        factor = _shrink(norm, s * lams[0])
        return tree_unflatten(spec, [leaf * factor for leaf in leaves])
    dims = _dims(dim)

    def block(xi: torch.Tensor, li: Param) -> torch.Tensor:
        norm = _safe_sqrt(xi.pow(2).sum(dim=dims))
        return xi * _expand(_shrink(norm, s * li), xi, dims)

    return tree_unflatten(spec, [block(xi, li) for xi, li in zip(leaves, lams)])


def _dims(dim: int | tuple[int, ...]) -> tuple[int, ...]:
    return (dim,) if isinstance(dim, int) else tuple(dim)


def _reduced(xi: torch.Tensor, dims: tuple[int, ...]) -> torch.Size:
    """The shape of ``xi`` with ``dims`` removed (the shape of its groups)."""
    drop = {d % xi.dim() for d in dims} if xi.dim() else set()
    return torch.Size(n for d, n in enumerate(xi.shape) if d not in drop)


def _expand(per_group: torch.Tensor, xi: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """A tensor over the groups, with the reduced dimensions put back (size 1)."""
    for d in sorted(d % xi.dim() for d in dims):
        per_group = per_group.unsqueeze(d)
    return per_group


def _group_params(
    x: PyTree, hparams: Any, scaling: Any, dim: int | tuple[int, ...] | None
) -> tuple[list[torch.Tensor], TreeSpec, list[Param], Param]:
    """Leaves, per-leaf ``λ`` (one scalar for ``dim=None``) and ``scaling`` of
    :func:`prox_group_lasso`, checked (shapes against the groups', values finite and >= 0)."""
    leaves, spec = _leaves(x)
    checks = _Checks()
    s = _scaling(scaling, checks)
    value = 1.0 if hparams is None else hparams
    if dim is None:
        lam = _param(value, "hparams (λ)")
        for v, name in ((lam, "hparams (λ)"), (s, "scaling")):
            if isinstance(v, torch.Tensor) and v.numel() != 1:
                raise HypergradValueError(
                    f"{name} must be a scalar with dim=None (the whole x is one group), got a "
                    f"tensor of shape {tuple(v.shape)}; pass dim=... for per-group strengths"
                )
        _check_low(lam, "hparams (λ)", checks, strict=False)
        checks.run()
        if isinstance(lam, torch.Tensor):
            lam = lam.reshape(())
        if isinstance(s, torch.Tensor):
            s = s.reshape(())
        return leaves, spec, [lam], s
    lams = _per_leaf(value, spec, len(leaves), "hparams (λ)")
    dims = _dims(dim)
    for i, (xi, li) in enumerate(zip(leaves, lams)):
        groups = _reduced(xi, dims)
        _fit(li, groups, _where("hparams (λ)", spec, i), "the shape of the groups")
        _fit(s, groups, _where("scaling", spec, i), "the shape of the groups")
        if all(li is not q for q in lams[:i]):
            _check_low(li, "hparams (λ)", checks, strict=False)
    checks.run()
    return leaves, spec, lams, s


def _shrink(norm: torch.Tensor, t: Param) -> torch.Tensor:
    """``max(norm − t, 0) / norm`` (0 where ``norm = 0``), with finite derivatives."""
    safe = torch.where(norm > 0, norm, torch.ones_like(norm))
    return torch.relu(norm - t) / safe


# ---------------------------------------------------------------------------------------------
# projections (scaling is accepted and ignored: the indicator of a set is scale-invariant)


def projection_non_negative(x: PyTree, hparams: Any = None, scaling: Any = 1.0) -> PyTree:
    """Projection onto the non-negative orthant: ``argmin_{y >= 0} ‖y − x‖²`` = ``max(x, 0)``.

    Args:
        x: a tensor or a pytree of tensors.
        hparams: ignored (jaxopt's ``projection_non_negative`` takes none either).
        scaling: ignored (the penalty is the indicator of the set).

    Returns:
        The projection, with the structure of ``x``.

    Example:
        >>> import torch, hypergrad as hg
        >>> hg.prox.projection_non_negative(torch.tensor([-1.0, 2.0]))
        tensor([0., 2.])
    """
    del hparams, scaling
    return _map(torch.relu, x, [])


def projection_box(x: PyTree, hparams: Any = None, scaling: Any = 1.0) -> PyTree:
    """Projection onto the box ``lower <= y <= upper``: ``clamp(x, lower, upper)``.

    Args:
        x: a tensor or a pytree of tensors.
        hparams: the pair ``(lower, upper)`` (jaxopt's ``projection_box``); each a number, a
            tensor broadcasting to ``x``'s shape, a pytree like ``x``, or ``None`` (no bound
            on that side; so is ``-inf`` for ``lower`` and ``+inf`` for ``upper``).
            ``∂y/∂lower = 1`` where ``x < lower``, ``∂y/∂upper = 1`` where ``x > upper``.
        scaling: ignored (the penalty is the indicator of the set).

    Returns:
        The projection, with the structure of ``x``.

    Raises:
        HypergradTypeError: ``hparams`` is not a pair.
        HypergradValueError: ``lower > upper`` somewhere (an empty box); a NaN bound;
            ``lower = +inf`` or ``upper = −inf`` (no real point); a bound that does not
            broadcast to ``x``'s shape.

    Example:
        >>> import torch, hypergrad as hg
        >>> hg.prox.projection_box(torch.tensor([-2.0, 0.5, 3.0]), (0.0, 1.0))
        tensor([0.0000, 0.5000, 1.0000])
    """
    del scaling
    leaves, spec, lo, hi = _box_params(x, hparams)

    def clip(xi: torch.Tensor, a: Param | None, b: Param | None) -> torch.Tensor:
        y = xi
        if a is not None:
            y = torch.maximum(y, torch.as_tensor(a, dtype=xi.dtype, device=xi.device))
        if b is not None:
            y = torch.minimum(y, torch.as_tensor(b, dtype=xi.dtype, device=xi.device))
        return y

    out = [clip(leaf, a, b) for leaf, a, b in zip(leaves, lo, hi)]
    return tree_unflatten(spec, out)


_EMPTY_BOX = "projection_box: lower > upper somewhere (an empty box)"


def _box_params(
    x: PyTree, hparams: Any
) -> tuple[list[torch.Tensor], TreeSpec, list[Param | None], list[Param | None]]:
    """Leaves and per-leaf bounds of :func:`projection_box`, checked: shapes broadcast to the
    leaves', no NaN, no ``lower = +inf`` or ``upper = -inf`` (no real point), ``lower <=
    upper``; the tensor values read together (:class:`_Checks`)."""
    if hparams is None:
        raise HypergradTypeError("projection_box needs hparams=(lower, upper)")
    lo_v, hi_v = _pair(hparams, "hparams (lower, upper)", (None, None))
    leaves, spec = _leaves(x)
    n = len(leaves)
    lo: list[Param | None] = [None] * n if lo_v is None else list(_per_leaf(lo_v, spec, n, "lower"))
    hi: list[Param | None] = [None] * n if hi_v is None else list(_per_leaf(hi_v, spec, n, "upper"))
    checks = _Checks()
    for i, (leaf, a, b) in enumerate(zip(leaves, lo, hi)):
        for v, name, empty in ((a, "lower", math.inf), (b, "upper", -math.inf)):
            _fit(v, leaf.shape, _where(name, spec, i))
            if v is None:
                continue
            sign = "+inf" if empty > 0 else "-inf"
            why = f"projection_box: {name} is {sign} somewhere (an empty box: no real y there)"
            if isinstance(v, float):
                if math.isnan(v):
                    raise HypergradValueError(f"projection_box: {name} is NaN")
                if v == empty:
                    raise HypergradValueError(why)
            else:
                nan = f"projection_box: {name} contains NaN"
                checks.add(v.isnan(), functools.partial(str, nan))
                checks.add(v == empty, functools.partial(str, why))
        if a is None or b is None:
            continue
        if isinstance(a, float) and isinstance(b, float):
            if a > b:
                raise HypergradValueError(_EMPTY_BOX)
        else:
            ta = a if isinstance(a, torch.Tensor) else torch.as_tensor(a)
            tb = b if isinstance(b, torch.Tensor) else torch.as_tensor(b)
            checks.add(ta.detach().to(tb.dtype) > tb.detach(), lambda: _EMPTY_BOX)
    checks.run()
    return leaves, spec, lo, hi


def projection_simplex(x: PyTree, hparams: Any = None, scaling: Any = 1.0) -> PyTree:
    """Projection onto the simplex ``{y >= 0, Σ y = value}`` along the last dimension.

    ``argmin_y ‖y − x‖²`` subject to ``y >= 0`` and ``Σ_i y_i = value``, with
    ``value = hparams`` (jaxopt's ``projection_simplex``). The solution is ``max(x − τ, 0)``
    with the threshold ``τ`` found by sorting (Held, Wolfe and Crowder 1974; Duchi et al.
    2008). A 1-D ``x`` is one vector; an N-D ``x`` is projected row by row along its last
    dimension (``value`` may then be a tensor of shape ``x.shape[:-1]``); each leaf of a pytree
    separately. On the support ``S``, ``∂y_i/∂value = 1/|S|``.

    Args:
        x: a tensor (at least 1-D) or a pytree of such tensors.
        hparams: ``value > 0`` (the sum); a number or a tensor. ``None`` means 1.0.
        scaling: ignored (the penalty is the indicator of the set).

    Returns:
        The projection, with the structure of ``x``.

    Raises:
        HypergradValueError: a non-positive or non-finite ``value``, or one shaped neither as a
            scalar nor as the rows (``x.shape[:-1]``); a 0-d ``x``, or an empty last dimension
            (a simplex in ``R^0`` has no point).

    Example:
        >>> import torch, hypergrad as hg
        >>> hg.prox.projection_simplex(torch.tensor([[2.0, 0.0], [0.3, 0.1]]))
        tensor([[1.0000, 0.0000],
                [0.6000, 0.4000]])
    """
    del scaling
    leaves, spec, vals = _simplex_params(x, hparams)
    return tree_unflatten(
        spec, [torch.relu(xi - _simplex_tau(xi, v)) for xi, v in zip(leaves, vals)]
    )


def _simplex_params(x: PyTree, hparams: Any) -> tuple[list[torch.Tensor], TreeSpec, list[Param]]:
    """Leaves and per-leaf values of :func:`projection_simplex`, checked: at least 1-D leaves
    with a non-empty last dimension, values finite and > 0, a scalar or shaped like the rows."""
    leaves, spec = _leaves(x)
    vals = _per_leaf(1.0 if hparams is None else hparams, spec, len(leaves), "hparams (value)")
    checks = _Checks()
    for i, (xi, v) in enumerate(zip(leaves, vals)):
        if xi.dim() == 0:
            raise HypergradValueError("projection_simplex needs a tensor with at least 1 dim")
        if xi.shape[-1] == 0 and math.prod(xi.shape[:-1]) > 0:
            raise HypergradValueError(
                f"projection_simplex: the last dimension of x is empty (shape "
                f"{tuple(xi.shape)}): the simplex {{y >= 0, Σ y = value > 0}} has no point there"
            )
        if not (isinstance(v, torch.Tensor) and v.numel() == 1):
            _fit(v, xi.shape[:-1], _where("hparams (value)", spec, i), "the rows' shape")
        if all(v is not q for q in vals[:i]):
            _check_low(v, "hparams (value)", checks, strict=True)
    checks.run()
    return leaves, spec, vals


def _simplex_tau(xi: torch.Tensor, v: Param) -> torch.Tensor:
    """The threshold ``τ`` of each row (``keepdim``): ``projection = max(x − τ, 0)``."""
    n = xi.shape[-1]
    u, _ = torch.sort(xi, dim=-1, descending=True)
    vt: Param = v
    if isinstance(v, torch.Tensor):
        vt = v.reshape(()) if v.numel() == 1 else v.unsqueeze(-1)
    cssv = torch.cumsum(u, dim=-1) - vt
    k = torch.arange(1, n + 1, dtype=xi.dtype, device=xi.device)
    # u_k − (Σ_{j<=k} u_j − value)/k > 0 holds exactly for k <= ρ (a prefix of the sort)
    rho = (u * k > cssv).sum(dim=-1, keepdim=True).clamp(min=1)
    return torch.gather(cssv, -1, rho - 1) / rho.to(xi.dtype)


def projection_l2_ball(x: PyTree, hparams: Any = None, scaling: Any = 1.0) -> PyTree:
    """Projection onto the l2 ball ``‖y‖ <= radius``: ``x · min(1, radius / ‖x‖)``.

    The norm is that of the whole input (all leaves of a pytree together), as in jaxopt's
    ``projection_l2_ball``.

    Args:
        x: a tensor or a pytree of tensors.
        hparams: ``radius > 0``, a number or a scalar tensor. ``None`` means 1.0; ``+inf``
            (number or tensor) is the whole space: the identity, with a zero derivative in
            the radius.
        scaling: ignored (the penalty is the indicator of the set).

    Returns:
        The projection, with the structure of ``x``.

    Raises:
        HypergradValueError: a non-positive, NaN or non-scalar radius.

    Example:
        >>> import torch, hypergrad as hg
        >>> hg.prox.projection_l2_ball(torch.tensor([3.0, 4.0]), 1.0)
        tensor([0.6000, 0.8000])
    """
    del scaling
    leaves, spec, r = _ball_params(x, hparams)
    if isinstance(r, float) and math.isinf(r):
        return tree_unflatten(spec, list(leaves))
    norm = _safe_sqrt(_sq_norm(leaves))
    rt = torch.as_tensor(r, dtype=norm.dtype, device=norm.device)
    if isinstance(r, float):
        factor = rt / torch.maximum(norm, rt)
    else:  # an infinite tensor radius: the identity (factor 1, no derivative in r), not inf/inf
        finite = torch.isfinite(rt)
        safe = torch.where(finite, rt, torch.ones_like(rt))
        factor = torch.where(finite, safe / torch.maximum(norm, safe), torch.ones_like(rt))
    return tree_unflatten(spec, [leaf * factor for leaf in leaves])


def _ball_params(x: PyTree, hparams: Any) -> tuple[list[torch.Tensor], TreeSpec, Param]:
    """Leaves and the radius of :func:`projection_l2_ball`: a scalar, > 0, not NaN (``+inf``:
    the whole space)."""
    leaves, spec = _leaves(x)
    r = _param(1.0 if hparams is None else hparams, "hparams (radius)")
    if isinstance(r, torch.Tensor):
        if r.numel() != 1:
            raise HypergradValueError(
                f"hparams (radius) must be a scalar, got a tensor of shape {tuple(r.shape)}"
            )
        r = r.reshape(())
    checks = _Checks()
    message = "hparams (radius) must be > 0 and not NaN (+inf: the whole space), got"
    if isinstance(r, float):
        if not r > 0.0:
            raise HypergradValueError(f"{message} {r}")
    else:
        checks.add(~(r > 0), lambda: f"{message} {float(r.detach())}")
    checks.run()
    return leaves, spec, r


# ---------------------------------------------------------------------------------------------
# kinks: the inputs where an operator is not differentiable

_Masks = tuple[TreeSpec, list[torch.Tensor]]
#: The kink finder of each operator of this module: ``(x, hparams, scaling, tol, **keywords) ->
#: (spec, masks)``, one boolean mask per leaf of ``x``.
_KINKS: dict[Callable[..., Any], Callable[..., _Masks]] = {}


def _finds_kinks_of(
    op: Callable[..., Any],
) -> Callable[[Callable[..., _Masks]], Callable[..., _Masks]]:
    def register(fn: Callable[..., _Masks]) -> Callable[..., _Masks]:
        _KINKS[op] = fn
        return fn

    return register


def _as(value: Param, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(value, dtype=like.dtype, device=like.device)


def _full(hit: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
    """``hit`` (one flag for the whole leaf, or per group) spread over every coordinate."""
    return hit.expand(leaf.shape).clone()


def _threshold(xi: torch.Tensor, t: Param, tol: float) -> torch.Tensor:
    """Soft thresholding's kinks: ``| |x_i| − t_i | <= tol`` where ``t_i > 0`` (``t_i = 0`` is
    the identity, smooth everywhere)."""
    tt = _as(t, xi)
    return ((xi.abs() - tt).abs() <= tol) & (tt > 0)


@_finds_kinks_of(prox_lasso)
def _lasso_kinks(x: PyTree, hparams: Any, scaling: Any, tol: float) -> _Masks:
    lam_v = 1.0 if hparams is None else hparams
    leaves, spec, (lam,), s = _coordinatewise(x, [(lam_v, "hparams (λ)")], scaling)
    return spec, [_threshold(xi, s * li, tol) for xi, li in zip(leaves, lam)]


@_finds_kinks_of(prox_elastic_net)
def _elastic_net_kinks(x: PyTree, hparams: Any, scaling: Any, tol: float) -> _Masks:
    lam_v, gam_v = _pair(hparams, "hparams (λ, γ)", (1.0, 1.0))
    named = [(lam_v, "hparams[0] (λ)"), (gam_v, "hparams[1] (γ)")]
    leaves, spec, (lam, _), s = _coordinatewise(x, named, scaling)
    return spec, [_threshold(xi, s * li, tol) for xi, li in zip(leaves, lam)]


@_finds_kinks_of(prox_non_negative_lasso)
def _non_negative_lasso_kinks(x: PyTree, hparams: Any, scaling: Any, tol: float) -> _Masks:
    lam_v = 1.0 if hparams is None else hparams
    leaves, spec, (lam,), s = _coordinatewise(x, [(lam_v, "hparams (λ)")], scaling)
    return spec, [(xi - _as(s * li, xi)).abs() <= tol for xi, li in zip(leaves, lam)]


@_finds_kinks_of(prox_group_lasso)
def _group_lasso_kinks(
    x: PyTree,
    hparams: Any,
    scaling: Any,
    tol: float,
    *,
    dim: int | tuple[int, ...] | None = None,
) -> _Masks:
    leaves, spec, lams, s = _group_params(x, hparams, scaling, dim)
    if dim is None:
        norm = _sq_norm(leaves).sqrt()
        t = _as(s * lams[0], norm)
        hit = ((norm - t).abs() <= tol) & (t > 0)
        return spec, [_full(hit, leaf) for leaf in leaves]
    dims = _dims(dim)
    masks = []
    for xi, li in zip(leaves, lams):
        norm = xi.pow(2).sum(dim=dims).sqrt()
        t = _as(s * li, norm)
        hit = ((norm - t).abs() <= tol) & (t > 0)
        masks.append(_full(_expand(hit, xi, dims), xi))
    return spec, masks


@_finds_kinks_of(projection_non_negative)
def _non_negative_kinks(x: PyTree, hparams: Any, scaling: Any, tol: float) -> _Masks:
    leaves, spec = _leaves(x)
    return spec, [xi.abs() <= tol for xi in leaves]


@_finds_kinks_of(projection_box)
def _box_kinks(x: PyTree, hparams: Any, scaling: Any, tol: float) -> _Masks:
    leaves, spec, lo, hi = _box_params(x, hparams)
    masks = []
    for xi, a, b in zip(leaves, lo, hi):
        hit = torch.zeros_like(xi, dtype=torch.bool)
        for bound in (a, b):
            if bound is not None:  # an infinite bound is never within tol: no kink
                hit = hit | ((xi - _as(bound, xi)).abs() <= tol)
        masks.append(hit)
    return spec, masks


@_finds_kinks_of(projection_simplex)
def _simplex_kinks(x: PyTree, hparams: Any, scaling: Any, tol: float) -> _Masks:
    leaves, spec, vals = _simplex_params(x, hparams)
    return spec, [(xi - _simplex_tau(xi, v)).abs() <= tol for xi, v in zip(leaves, vals)]


@_finds_kinks_of(projection_l2_ball)
def _l2_ball_kinks(x: PyTree, hparams: Any, scaling: Any, tol: float) -> _Masks:
    leaves, spec, r = _ball_params(x, hparams)
    norm = _sq_norm(leaves).sqrt()
    hit = (norm - _as(r, norm)).abs() <= tol  # an infinite radius: never
    return spec, [_full(hit, leaf) for leaf in leaves]


def _kink_finder(prox: Callable[..., Any]) -> tuple[Callable[..., _Masks] | None, dict[str, Any]]:
    """The kink finder of ``prox`` and the keywords a ``functools.partial`` fixed (``dim``)."""
    keywords: dict[str, Any] = {}
    while isinstance(prox, functools.partial):
        if prox.args:  # x or hparams bound positionally: not this module's signature
            return None, {}
        keywords = {**prox.keywords, **keywords}
        prox = prox.func
    try:
        return _KINKS.get(prox), keywords
    except TypeError:  # an unhashable callable: not one of ours
        return None, {}


def kink_mask(
    prox: Callable[..., Any],
    x: PyTree,
    hparams: Any = None,
    scaling: Any = 1.0,
    tol: float = 0.0,
    **keywords: Any,
) -> PyTree | None:
    """Which coordinates of the input ``x`` lie within ``tol`` of a point where ``prox`` is not
    differentiable (a kink); see :func:`kinks` for the points of each operator.

    Args:
        prox, x, hparams, scaling, tol, keywords: as for :func:`kinks`.

    Returns:
        A pytree of boolean tensors with the structure and shapes of ``x``, or ``None`` when
        ``prox`` is not one of this module's operators (nor a ``functools.partial`` of one that
        fixes keywords only), whose kinks are unknown.

    Raises:
        HypergradValueError: ``tol`` negative or not finite; the operator's own errors for bad
            ``hparams`` or ``scaling``.

    Example:
        >>> import torch, hypergrad as hg
        >>> hg.prox.kink_mask(hg.prox.prox_lasso, torch.tensor([-1.0, 0.5, 2.0]), 1.0)
        tensor([ True, False, False])
    """
    finder, fixed = _kink_finder(prox)
    if finder is None:
        return None
    tol = check_number("kinks tol", tol)
    with torch.no_grad():
        spec, masks = finder(x, hparams, scaling, tol, **{**fixed, **keywords})
    return tree_unflatten(spec, masks)


def kinks(
    prox: Callable[..., Any],
    x: PyTree,
    hparams: Any = None,
    scaling: Any = 1.0,
    tol: float = 0.0,
    **keywords: Any,
) -> int | None:
    """The number of coordinates of the prox's input ``x`` within ``tol`` of a kink: a point where
    ``prox(., hparams, scaling)`` is not differentiable, so that its Jacobian there (which
    autograd returns anyway: one of the one-sided derivatives, jaxopt may return the other) is
    not a derivative, and an implicit hypergradient built on it is one of several limits.

    For the proximal-gradient fixed point ``w = prox(w − s ∇f(w), hparams, s)``, pass the prox's
    input ``x = w − s ∇f(w)`` and ``scaling = s``. A coordinate counts when (``t = scaling · λ``,
    all per coordinate or per group as the operator broadcasts them):

    * :func:`prox_lasso`, :func:`prox_elastic_net`: ``| |x_i| − t_i | <= tol`` where ``t_i > 0``
      (``t_i = 0`` is the identity, differentiable everywhere);
    * :func:`prox_non_negative_lasso`: ``|x_i − t_i| <= tol`` (``max(x − t, 0)`` has a kink at
      ``t`` for every ``t >= 0``);
    * :func:`prox_group_lasso`: every coordinate of a group with ``| ‖x_g‖ − t_g | <= tol`` and
      ``t_g > 0`` (``dim=None``: the whole input is one group);
    * :func:`projection_non_negative`: ``|x_i| <= tol``;
    * :func:`projection_box`: ``x_i`` within ``tol`` of a finite bound;
    * :func:`projection_simplex`: ``|x_i − τ| <= tol`` with ``τ`` the threshold of its row
      (``projection = max(x − τ, 0)``: the coordinate enters or leaves the support);
    * :func:`projection_l2_ball`: every coordinate when ``| ‖x‖ − radius | <= tol`` (on the
      sphere; an infinite radius has none).

    ``tol = 0`` counts exact ties only; a solution computed to a tolerance is better measured
    with a ``tol`` of the order of its error. The count is read with one host synchronisation,
    so this is not for use under ``torch.func.vmap``; it is not differentiated.

    Args:
        prox: one of this module's operators, or a ``functools.partial`` of one fixing keywords
            only (e.g. ``partial(prox_group_lasso, dim=1)``).
        x: the operator's input, a tensor or a pytree of tensors.
        hparams, scaling: as passed to ``prox``.
        tol: the distance (absolute, in the units of ``x``; for the norm operators, of the
            norm) within which a coordinate counts, finite and >= 0.
        **keywords: the operator's own keywords (``dim`` of :func:`prox_group_lasso`).

    Returns:
        The count (an int), or ``None`` when ``prox`` is not one of this module's operators,
        whose kinks are unknown (:func:`kink_mask` gives the coordinates).

    Raises:
        HypergradValueError: ``tol`` negative or not finite; the operator's own errors for bad
            ``hparams`` or ``scaling``.

    Example:
        >>> import torch, hypergrad as hg
        >>> x = torch.tensor([-1.0, 0.5, 1.0 + 1e-9, 3.0], dtype=torch.float64)
        >>> hg.prox.kinks(hg.prox.prox_lasso, x, 1.0)  # |x_0| = λ exactly
        1
        >>> hg.prox.kinks(hg.prox.prox_lasso, x, 1.0, tol=1e-6)
        2
        >>> hg.prox.kinks(hg.prox.projection_box, x, (-1.0, 3.0))  # x_0 and x_3 on a face
        2
    """
    mask = kink_mask(prox, x, hparams, scaling, tol, **keywords)
    if mask is None:
        return None
    leaves = _bool_leaves(mask)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for m in leaves:
        by_device.setdefault(m.device, []).append(m.sum())
    return sum(int(torch.stack(c).sum()) for c in by_device.values())


def _bool_leaves(tree: PyTree) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    items = tree.values() if isinstance(tree, dict) else tree
    return [leaf for child in items for leaf in _bool_leaves(child)]
