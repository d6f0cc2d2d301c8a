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
kinks (``|x_i| = λ`` for the lasso, a coordinate on a box face, ...), a set of measure zero.
Bad hyperparameters (a negative strength, ``lower > upper``, a non-positive radius or simplex
value) raise :class:`~hypergrad.HypergradValueError`; the check reads tensor values, so it is
skipped for values batched by ``torch.func.vmap`` (where data-dependent checks are impossible).

Example:
    >>> import torch, hypergrad as hg
    >>> hg.prox.prox_lasso(torch.tensor([-2.0, 0.5, 3.0]), 1.0)
    tensor([-1.,  0.,  2.])
    >>> hg.prox.projection_simplex(torch.tensor([0.5, 0.2, -1.0]))
    tensor([0.6500, 0.3500, 0.0000])
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any, cast

import torch

from .errors import HypergradTypeError, HypergradValueError
from .tree import PyTree, TreeSpec, tree_flatten, tree_unflatten

__all__ = [
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


def _violates(cond: torch.Tensor) -> bool:
    """``bool(cond.any())``, or False where the value is batched by vmap (unreadable)."""
    try:
        return bool(cond.detach().any())
    except RuntimeError:  # vmap: "data-dependent control flow" is not supported
        return False


def _check_low(value: Param, name: str, *, strict: bool) -> None:
    if isinstance(value, float):
        bad = value != value or (value <= 0.0 if strict else value < 0.0)
        shown = str(value)
    else:
        bad = _violates(value.isnan() | ((value <= 0) if strict else (value < 0)))
        shown = "a tensor with such entries"
    if bad:
        raise HypergradValueError(f"{name} must be {'> 0' if strict else '>= 0'}, got {shown}")


def _scaling(scaling: Any) -> Param:
    s = _param(scaling, "scaling")
    _check_low(s, "scaling", strict=False)
    return s


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
        hparams: ``λ >= 0``: a number, a tensor broadcasting against ``x`` (per-coordinate
            strengths) or a pytree like ``x``. ``None`` means 1.0.
        scaling: a non-negative factor on the penalty (a proximal-gradient step size).

    Returns:
        The proximal point, with the structure of ``x``.

    Raises:
        HypergradValueError: a negative ``λ`` or ``scaling``.

    Example:
        >>> import torch, hypergrad as hg
        >>> hg.prox.prox_lasso(torch.tensor([-2.0, 0.5, 3.0]), torch.tensor([1.0, 1.0, 2.5]))
        tensor([-1.0000,  0.0000,  0.5000])
    """
    leaves, spec = _leaves(x)
    lam = _per_leaf(1.0 if hparams is None else hparams, spec, len(leaves), "hparams (λ)")
    s = _scaling(scaling)
    for v in lam:
        _check_low(v, "hparams (λ)", strict=False)
    return _map(lambda xi, li: _soft(xi, s * li), x, [lam])


def prox_non_negative_lasso(x: PyTree, hparams: Any = None, scaling: Any = 1.0) -> PyTree:
    """Proximal operator of the l1 norm restricted to the non-negative orthant.

    ``argmin_{y >= 0} ½‖y − x‖² + scaling · λ · ‖y‖₁`` = ``max(x − scaling · λ, 0)``, with
    ``λ = hparams`` (jaxopt's ``prox_non_negative_lasso``).

    Args:
        x: a tensor or a pytree of tensors.
        hparams: ``λ >= 0``: a number, a tensor broadcasting against ``x`` or a pytree like
            ``x``. ``None`` means 1.0.
        scaling: a non-negative factor on the penalty.

    Returns:
        The proximal point, with the structure of ``x``.

    Raises:
        HypergradValueError: a negative ``λ`` or ``scaling``.

    Example:
        >>> import torch, hypergrad as hg
        >>> hg.prox.prox_non_negative_lasso(torch.tensor([-2.0, 0.5, 3.0]), 1.0)
        tensor([0., 0., 2.])
    """
    leaves, spec = _leaves(x)
    lam = _per_leaf(1.0 if hparams is None else hparams, spec, len(leaves), "hparams (λ)")
    s = _scaling(scaling)
    for v in lam:
        _check_low(v, "hparams (λ)", strict=False)
    return _map(lambda xi, li: torch.relu(xi - s * li), x, [lam])


def prox_elastic_net(x: PyTree, hparams: Any = None, scaling: Any = 1.0) -> PyTree:
    """Proximal operator of the elastic net penalty.

    With ``hparams = (λ, γ)`` (jaxopt's ``prox_elastic_net``) the penalty is
    ``g(y) = λ · (‖y‖₁ + γ/2 · ‖y‖²)``, and

        argmin_y ½‖y − x‖² + scaling · g(y)  =  soft(x, scaling·λ) / (1 + scaling·λ·γ)

    where ``soft`` is the soft threshold of :func:`prox_lasso`.

    Args:
        x: a tensor or a pytree of tensors.
        hparams: the pair ``(λ, γ)``, both ``>= 0``; each a number, a tensor broadcasting
            against ``x`` or a pytree like ``x``. ``None`` means ``(1.0, 1.0)``.
        scaling: a non-negative factor on the penalty.

    Returns:
        The proximal point, with the structure of ``x``.

    Raises:
        HypergradTypeError: ``hparams`` is not a pair.
        HypergradValueError: a negative ``λ``, ``γ`` or ``scaling``.

    Example:
        >>> import torch, hypergrad as hg
        >>> hg.prox.prox_elastic_net(torch.tensor([-2.0, 0.5, 3.0]), (1.0, 1.0))
        tensor([-0.5000,  0.0000,  1.0000])
    """
    leaves, spec = _leaves(x)
    lam_v, gam_v = _pair(hparams, "hparams (λ, γ)", (1.0, 1.0))
    lam = _per_leaf(lam_v, spec, len(leaves), "hparams[0] (λ)")
    gam = _per_leaf(gam_v, spec, len(leaves), "hparams[1] (γ)")
    s = _scaling(scaling)
    for v in lam:
        _check_low(v, "hparams[0] (λ)", strict=False)
    for v in gam:
        _check_low(v, "hparams[1] (γ)", strict=False)
    return _map(lambda xi, li, gi: _soft(xi, s * li) / (1.0 + s * li * gi), x, [lam, gam])


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
    ``dim=0`` each column). ``λ`` may then be a tensor of per-group strengths broadcasting
    against the reduced shape (``(n_rows,)`` for ``dim=1``).

    Args:
        x: a tensor or a pytree of tensors.
        hparams: ``λ >= 0``: a number or a tensor (per group, see above); a pytree like ``x``
            when ``dim`` is given. ``None`` means 1.0.
        scaling: a non-negative factor on the penalty.
        dim: the dimension(s) that a group spans (see above); ``None``: one group.

    Returns:
        The proximal point, with the structure of ``x``.

    Raises:
        HypergradValueError: a negative ``λ`` or ``scaling``; a non-scalar ``λ`` with
            ``dim=None``.

    Example:
        >>> import torch, hypergrad as hg
        >>> x = torch.tensor([[3.0, 4.0], [0.3, 0.4]])
        >>> hg.prox.prox_group_lasso(x, 1.0, dim=1)  # rows are groups: norms 5 and 0.5
        tensor([[2.4000, 3.2000],
                [0.0000, 0.0000]])
    """
    leaves, spec = _leaves(x)
    s = _scaling(scaling)
    if dim is None:
        lam = _param(1.0 if hparams is None else hparams, "hparams (λ)")
        if isinstance(lam, torch.Tensor) and lam.numel() != 1:
            raise HypergradValueError(
                "hparams (λ) must be a scalar with dim=None (the whole x is one group), got a "
                f"tensor of shape {tuple(lam.shape)}; pass dim=... for per-group strengths"
            )
        _check_low(lam, "hparams (λ)", strict=False)
        if isinstance(lam, torch.Tensor):
            lam = lam.reshape(())
        norm = _safe_sqrt(_sq_norm(leaves))
        factor = _shrink(norm, s * lam)
        return tree_unflatten(spec, [leaf * factor for leaf in leaves])
    lams = _per_leaf(1.0 if hparams is None else hparams, spec, len(leaves), "hparams (λ)")
    for v in lams:
        _check_low(v, "hparams (λ)", strict=False)
    dims = (dim,) if isinstance(dim, int) else tuple(dim)

    def block(xi: torch.Tensor, li: Param) -> torch.Tensor:
        norm = _safe_sqrt(xi.pow(2).sum(dim=dims))
        factor = _shrink(norm, s * li)
        for d in sorted(d % xi.dim() for d in dims):
            factor = factor.unsqueeze(d)
        return xi * factor

    return _map(block, x, [lams])


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
            tensor broadcasting against ``x``, a pytree like ``x``, or ``None`` (no bound on
            that side). ``∂y/∂lower = 1`` where ``x < lower``, ``∂y/∂upper = 1`` where
            ``x > upper``.
        scaling: ignored (the penalty is the indicator of the set).

    Returns:
        The projection, with the structure of ``x``.

    Raises:
        HypergradTypeError: ``hparams`` is not a pair.
        HypergradValueError: ``lower > upper`` somewhere (an empty box).

    Example:
        >>> import torch, hypergrad as hg
        >>> hg.prox.projection_box(torch.tensor([-2.0, 0.5, 3.0]), (0.0, 1.0))
        tensor([0.0000, 0.5000, 1.0000])
    """
    del scaling
    if hparams is None:
        raise HypergradTypeError("projection_box needs hparams=(lower, upper)")
    lo_v, hi_v = _pair(hparams, "hparams (lower, upper)", (None, None))
    leaves, spec = _leaves(x)
    lo = [None] * len(leaves) if lo_v is None else _per_leaf(lo_v, spec, len(leaves), "lower")
    hi = [None] * len(leaves) if hi_v is None else _per_leaf(hi_v, spec, len(leaves), "upper")
    for a, b in zip(lo, hi):
        if a is None or b is None:
            continue
        if isinstance(a, float) and isinstance(b, float):
            bad = a > b
        else:
            ta = a if isinstance(a, torch.Tensor) else torch.tensor(a)
            tb = b if isinstance(b, torch.Tensor) else torch.tensor(b)
            bad = _violates(ta.detach().to(tb.dtype) > tb.detach())
        if bad:
            raise HypergradValueError("projection_box: lower > upper somewhere (an empty box)")

    def clip(xi: torch.Tensor, a: Param | None, b: Param | None) -> torch.Tensor:
        y = xi
        if a is not None:
            y = torch.maximum(y, torch.as_tensor(a, dtype=xi.dtype, device=xi.device))
        if b is not None:
            y = torch.minimum(y, torch.as_tensor(b, dtype=xi.dtype, device=xi.device))
        return y

    out = [clip(leaf, a, b) for leaf, a, b in zip(leaves, lo, hi)]
    return tree_unflatten(spec, out)


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
        HypergradValueError: a non-positive ``value``, or a 0-d ``x``.

    Example:
        >>> import torch, hypergrad as hg
        >>> hg.prox.projection_simplex(torch.tensor([[2.0, 0.0], [0.3, 0.1]]))
        tensor([[1.0000, 0.0000],
                [0.6000, 0.4000]])
    """
    del scaling
    leaves, spec = _leaves(x)
    vals = _per_leaf(1.0 if hparams is None else hparams, spec, len(leaves), "hparams (value)")
    for v in vals:
        _check_low(v, "hparams (value)", strict=True)

    def project(xi: torch.Tensor, v: Param) -> torch.Tensor:
        if xi.dim() == 0:
            raise HypergradValueError("projection_simplex needs a tensor with at least 1 dim")
        n = xi.shape[-1]
        u, _ = torch.sort(xi, dim=-1, descending=True)
        vt: Param = v
        if isinstance(v, torch.Tensor):
            vt = v.reshape(()) if v.numel() == 1 else v.unsqueeze(-1)
        cssv = torch.cumsum(u, dim=-1) - vt
        k = torch.arange(1, n + 1, dtype=xi.dtype, device=xi.device)
        # u_k − (Σ_{j<=k} u_j − value)/k > 0 holds exactly for k <= ρ (a prefix of the sort)
        rho = (u * k > cssv).sum(dim=-1, keepdim=True).clamp(min=1)
        tau = torch.gather(cssv, -1, rho - 1) / rho.to(xi.dtype)
        return torch.relu(xi - tau)

    return _map(project, x, [vals])


def projection_l2_ball(x: PyTree, hparams: Any = None, scaling: Any = 1.0) -> PyTree:
    """Projection onto the l2 ball ``‖y‖ <= radius``: ``x · min(1, radius / ‖x‖)``.

    The norm is that of the whole input (all leaves of a pytree together), as in jaxopt's
    ``projection_l2_ball``.

    Args:
        x: a tensor or a pytree of tensors.
        hparams: ``radius > 0``, a number or a scalar tensor. ``None`` means 1.0.
        scaling: ignored (the penalty is the indicator of the set).

    Returns:
        The projection, with the structure of ``x``.

    Raises:
        HypergradValueError: a non-positive or non-scalar radius.

    Example:
        >>> import torch, hypergrad as hg
        >>> hg.prox.projection_l2_ball(torch.tensor([3.0, 4.0]), 1.0)
        tensor([0.6000, 0.8000])
    """
    del scaling
    leaves, spec = _leaves(x)
    r = _param(1.0 if hparams is None else hparams, "hparams (radius)")
    if isinstance(r, torch.Tensor):
        if r.numel() != 1:
            raise HypergradValueError(
                f"hparams (radius) must be a scalar, got a tensor of shape {tuple(r.shape)}"
            )
        r = r.reshape(())
    _check_low(r, "hparams (radius)", strict=True)
    if isinstance(r, float) and math.isinf(r):
        return tree_unflatten(spec, list(leaves))
    norm = _safe_sqrt(_sq_norm(leaves))
    factor = r / torch.maximum(norm, torch.as_tensor(r, dtype=norm.dtype, device=norm.device))
    return tree_unflatten(spec, [leaf * factor for leaf in leaves])
