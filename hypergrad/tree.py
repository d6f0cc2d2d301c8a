"""Pytree helpers: flatten/unflatten and vector-space operations over pytrees of tensors.

A pytree here is a tensor, or a tuple/list/dict (nested) whose leaves are tensors. Solvers work on
*flat* pytrees: tuples of tensors. Reductions (dot products, norms) accumulate in at least float32
so that half-precision inputs do not lose the sum.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch._C._functorch import is_functorch_wrapped_tensor

from .errors import HypergradTypeError, HypergradValueError

Tensors = tuple[torch.Tensor, ...]
PyTree = Any

_MISSING = object()


@dataclass(frozen=True)
class TreeSpec:
    """Structure of a pytree: ``kind`` is "leaf", "tuple", "list", "dict" or "static" (a Python
    number or None kept in the structure as a constant, ``keys == (value,)``, no leaf: only
    :func:`tree_flatten` with ``static=True`` makes one)."""

    kind: str
    children: tuple[TreeSpec, ...] = ()
    keys: tuple[Any, ...] = ()
    num_leaves: int = 1

    def __repr__(self) -> str:
        if self.kind == "leaf":
            return "*"
        if self.kind == "static":
            return repr(self.keys[0])
        if self.kind == "dict":
            inner = ", ".join(f"{k!r}: {c!r}" for k, c in zip(self.keys, self.children))
            return "{" + inner + "}"
        inner = ", ".join(repr(c) for c in self.children)
        return f"({inner},)" if self.kind == "tuple" else f"[{inner}]"


def tree_flatten(
    tree: PyTree, name: str = "tree", static: bool = False
) -> tuple[list[torch.Tensor], TreeSpec]:
    """Flatten a pytree into its tensor leaves (depth-first, dict keys in insertion order).

    Args:
        tree: a tensor or nested tuple/list/dict of tensors.
        name: argument name used in error messages.
        static: also accept Python numbers and None as constants of the structure (they are no
            leaves; :func:`tree_unflatten` puts them back). For hyperparameters that are not
            differentiated, e.g. ``projection_box``'s ``(0.0, None)``.

    Returns:
        ``(leaves, spec)`` such that ``tree_unflatten(spec, leaves)`` rebuilds ``tree``.

    Example:
        >>> leaves, spec = tree_flatten({"w": torch.ones(2), "b": (torch.zeros(1),)})
        >>> len(leaves), spec
        (2, {'w': *, 'b': (*,)})
    """
    leaves: list[torch.Tensor] = []
    spec = _flatten(tree, name, leaves, static)
    return leaves, spec


# The recursions are module-level functions, not closures: a nested function that calls itself
# is a reference cycle (function -> closure cell -> function) that keeps every tensor it can reach
# alive until Python's cyclic garbage collector runs; truncated unrolling, which unflattens the
# parameters at every inner step, then held ~0.5 MiB per step of a 200k-parameter MLP.
def _flatten(node: Any, path: str, leaves: list[torch.Tensor], static: bool = False) -> TreeSpec:
    if isinstance(node, torch.Tensor):
        leaves.append(node)
        return TreeSpec("leaf")
    if isinstance(node, (tuple, list)):
        kids = tuple(_flatten(c, f"{path}[{i}]", leaves, static) for i, c in enumerate(node))
        kind = "tuple" if isinstance(node, tuple) else "list"
        return TreeSpec(kind, kids, (), sum(k.num_leaves for k in kids))
    if isinstance(node, dict):
        keys = tuple(node.keys())
        kids = tuple(_flatten(node[k], f"{path}[{k!r}]", leaves, static) for k in keys)
        return TreeSpec("dict", kids, keys, sum(k.num_leaves for k in kids))
    if static and (node is None or isinstance(node, (bool, int, float))):
        return TreeSpec("static", (), (node,), 0)
    allowed = "a tensor, a number, None" if static else "a tensor"
    raise HypergradTypeError(
        f"{path} must be {allowed} or a tuple/list/dict of those, got {type(node).__name__}"
        + ("" if static else "; wrap a number in torch.tensor(...) to use it here")
    )


def leaf_paths(spec: TreeSpec, name: str = "tree") -> list[str]:
    """Human-readable path of every leaf, e.g. ``["params['w']", "params['b'][0]"]``."""
    out: list[str] = []
    _paths(spec, name, out)
    return out


def _paths(s: TreeSpec, path: str, out: list[str]) -> None:
    if s.kind == "static":
        return
    if s.kind == "leaf":
        out.append(path)
    elif s.kind == "dict":
        for k, c in zip(s.keys, s.children):
            _paths(c, f"{path}[{k!r}]", out)
    else:
        for i, c in enumerate(s.children):
            _paths(c, f"{path}[{i}]", out)


def tree_unflatten(spec: TreeSpec, leaves: Sequence[torch.Tensor]) -> PyTree:
    """Inverse of :func:`tree_flatten`.

    Raises:
        HypergradValueError: ``leaves`` has more or fewer entries than ``spec`` has leaves.
    """
    leaves = list(leaves)
    it = iter(leaves)
    out = _unflatten(spec, it, spec.num_leaves, len(leaves))
    if next(it, _MISSING) is not _MISSING:
        raise HypergradValueError(
            f"too many leaves for this tree structure: it has {spec.num_leaves} leaves, "
            f"got {len(leaves)}"
        )
    return out


def _unflatten(s: TreeSpec, it: Iterator[torch.Tensor], expected: int, given: int) -> Any:
    if s.kind == "static":
        return s.keys[0]
    if s.kind == "leaf":
        leaf = next(it, _MISSING)
        if leaf is _MISSING:
            raise HypergradValueError(
                f"too few leaves for this tree structure: it has {expected} leaves, got {given}"
            )
        return leaf
    kids = [_unflatten(c, it, expected, given) for c in s.children]
    if s.kind == "dict":
        return dict(zip(s.keys, kids))
    return tuple(kids) if s.kind == "tuple" else kids


def _check_same_length(op: str, *trees: Tensors) -> None:
    """Raise when flat pytrees that an operation pairs leaf by leaf differ in length."""
    n = len(trees[0])
    if any(len(t) != n for t in trees[1:]):
        raise HypergradValueError(
            f"{op}: the flat pytrees have different numbers of leaves "
            f"({', '.join(str(len(t)) for t in trees)}); they must have the same structure"
        )


def tree_map(fn: Callable[..., torch.Tensor], *trees: Tensors) -> Tensors:
    """Apply ``fn`` leaf-wise over flat pytrees (tuples of tensors) of the same length."""
    if trees:
        _check_same_length("tree_map", *trees)
    return tuple(fn(*xs) for xs in zip(*trees, strict=True))


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


# Float32 leaves are dotted as pairwise sums (torch.sum of the product) over chunks of this many
# elements, the chunks' partial sums added in float64. A single BLAS dot over 10^6 float32
# elements errs by ~1e-6 relative, which measurably slows float32 CG on a 1M-parameter MLP; the
# chunked pairwise form errs by ~2e-8 and its temporary is 1 MiB whatever the model size.
_DOT_CHUNK = 1 << 18


def _leaf_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    acc = _acc_dtype(torch.promote_types(a.dtype, b.dtype))
    a, b = a.reshape(-1), b.reshape(-1)
    if acc == torch.float64 and a.dtype == b.dtype:
        return torch.dot(a, b)
    if a.numel() <= _DOT_CHUNK:
        return torch.sum(a.to(acc) * b.to(acc))
    parts = [
        torch.sum(ca.to(acc) * cb.to(acc))
        # Tensor.split is unannotated in torch (torch/_tensor.py), hence the ignores.
        for ca, cb in zip(
            a.split(_DOT_CHUNK),  # type: ignore[no-untyped-call]
            b.split(_DOT_CHUNK),  # type: ignore[no-untyped-call]
            strict=True,
        )
    ]
    return torch.stack(parts).sum(dtype=torch.float64).to(acc)


# On a GPU the vector operations of a solver on a pytree of many small leaves cost kernel
# launches, not memory traffic: per leaf a product, a sum and an add for a dot product, an
# addcmul for an axpy (a 6-leaf MLP's CG iteration launched about 125 kernels besides its
# Hessian-vector product). Up to this many elements in all, CUDA leaves of one dtype go through
# multi-tensor (``torch._foreach_*``) kernels and one float64 sum instead; the temporary is
# at most 16 MiB. Above it a launch is small beside the work, and the per-leaf forms are kept.
_FUSED_MAX = 1 << 22


def _fusable(x: Sequence[torch.Tensor], y: Sequence[torch.Tensor]) -> bool:
    """CUDA leaves, one dtype and device, at most ``_FUSED_MAX`` elements in all, outside
    ``torch.func`` transforms (``_foreach`` ops have no ``vmap`` batching rule)."""
    if len(x) < 2 or not x[0].is_cuda or is_functorch_wrapped_tensor(x[0]):
        return False
    dtype, device = x[0].dtype, x[0].device
    if not all(a.dtype == dtype and a.device == device for a in (*x, *y)):
        return False
    return sum(a.numel() for a in x) <= _FUSED_MAX


def _fused_vdot(x: Sequence[torch.Tensor], y: Sequence[torch.Tensor]) -> torch.Tensor:
    """``tree_vdot`` in four kernels: the products by one multi-tensor kernel, concatenated,
    summed in float64 (more accurate than the chunked float32 sums) and cast back."""
    prods = torch._foreach_mul(list(x), list(y))
    flat = torch.cat([p.reshape(-1) for p in prods])
    return flat.sum(dtype=torch.float64).to(_acc_dtype(x[0].dtype))


def _fused_axpy(
    alpha: torch.Tensor, x: Sequence[torch.Tensor], y: Sequence[torch.Tensor]
) -> Tensors:
    """``tree_axpy`` with a tensor ``alpha`` in two multi-tensor kernels (no host sync)."""
    a = alpha.to(device=x[0].device, dtype=x[0].dtype)
    return tuple(torch._foreach_add(list(y), torch._foreach_mul(list(x), a)))


def tree_vdot(x: Tensors, y: Tensors) -> torch.Tensor:
    """Sum of elementwise products over all leaves, accumulated in float32 or wider.

    Float32 leaves are summed pairwise in 256k-element chunks whose partial sums are added in
    float64: as accurate as a pairwise sum, without a full-size temporary. Small pytrees of
    many CUDA leaves are multiplied by one multi-tensor kernel and summed in float64 (fewer
    kernel launches; see ``_FUSED_MAX``).

    Example:
        >>> tree_vdot((torch.ones(3),), (torch.full((3,), 2.0),))
        tensor(6.)
    """
    _check_same_length("tree_vdot", x, y)
    if _fusable(x, y):
        return _fused_vdot(x, y)
    total: torch.Tensor | None = None
    for a, b in zip(x, y, strict=True):
        term = _leaf_dot(a, b)
        total = term if total is None else total + term
    if total is None:
        return torch.zeros(())
    return total


def tree_sq_norm(x: Tensors) -> torch.Tensor:
    """Squared Euclidean norm over all leaves (float32 or wider)."""
    return tree_vdot(x, x)


def tree_norm(x: Tensors) -> torch.Tensor:
    """Euclidean norm over all leaves (float32 or wider), without full-size temporaries."""
    if not x:
        return torch.zeros(())
    # torch.linalg's functions are typed as returning Any; they return tensors.
    norms: list[torch.Tensor] = [torch.linalg.vector_norm(a, dtype=_acc_dtype(a.dtype)) for a in x]
    if len(norms) == 1:
        return norms[0]
    acc = norms[0].dtype
    for n in norms[1:]:
        acc = torch.promote_types(acc, n.dtype)
    total: torch.Tensor = torch.linalg.vector_norm(torch.stack([n.to(acc) for n in norms]))
    return total


def tree_add(x: Tensors, y: Tensors) -> Tensors:
    """Leaf-wise ``x + y``."""
    _check_same_length("tree_add", x, y)
    return tuple(a + b for a, b in zip(x, y, strict=True))


def tree_sub(x: Tensors, y: Tensors) -> Tensors:
    """Leaf-wise ``x - y``."""
    _check_same_length("tree_sub", x, y)
    return tuple(a - b for a, b in zip(x, y, strict=True))


def tree_scale(alpha: float | torch.Tensor, x: Tensors) -> Tensors:
    """Leaf-wise ``alpha * x``."""
    return tuple(_cast(alpha, a) * a for a in x)


def tree_axpy(alpha: float | torch.Tensor, x: Tensors, y: Tensors) -> Tensors:
    """Leaf-wise ``alpha * x + y`` (BLAS axpy); a tensor ``alpha`` is never read on the host."""
    _check_same_length("tree_axpy", x, y)
    if isinstance(alpha, torch.Tensor) and _fusable(x, y):
        return _fused_axpy(alpha, x, y)
    out = []
    for a, b in zip(x, y, strict=True):
        if isinstance(alpha, torch.Tensor):
            out.append(torch.addcmul(b, a, alpha.to(device=a.device, dtype=a.dtype)))
        else:
            out.append(torch.add(b, a, alpha=alpha))
    return tuple(out)


def tree_zeros_like(x: Tensors) -> Tensors:
    """Zeros with the structure, dtypes and devices of ``x``."""
    return tuple(torch.zeros_like(a) for a in x)


def tree_numel(x: Tensors) -> int:
    """Total number of elements over all leaves."""
    return sum(a.numel() for a in x)


def tree_all_finite(x: Tensors) -> bool:
    """True when every element of every leaf is finite (one host sync)."""
    if not x:
        return True
    # A finite sum proves every element finite (NaN/Inf propagate); only when a sum is not
    # finite (possibly an overflow of finite values) is the elementwise check needed.
    sums = torch.stack([a.sum(dtype=_acc_dtype(a.dtype)).to(torch.float64) for a in x])
    if bool(torch.isfinite(sums).all()):
        return True
    return all(bool(torch.isfinite(a).all()) for a in x)


def tree_ravel(x: Tensors, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Concatenate all leaves into one 1-D tensor (optionally cast to ``dtype``)."""
    if not x:
        return torch.zeros(0, dtype=dtype or torch.float32)
    flat = [a.reshape(-1) if dtype is None else a.reshape(-1).to(dtype) for a in x]
    return torch.cat(flat)


def tree_unravel(vec: torch.Tensor, like: Tensors) -> Tensors:
    """Split a 1-D tensor into leaves shaped (and typed) like ``like``.

    Raises:
        HypergradValueError: ``vec`` does not have ``tree_numel(like)`` elements.
    """
    total = sum(a.numel() for a in like)
    if vec.numel() != total:
        raise HypergradValueError(
            f"tree_unravel: the vector has {vec.numel()} elements but the pytree has {total}"
        )
    out, i = [], 0
    for a in like:
        n = a.numel()
        out.append(vec[i : i + n].reshape(a.shape).to(a.dtype))
        i += n
    return tuple(out)


def _cast(alpha: float | torch.Tensor, like: torch.Tensor) -> float | torch.Tensor:
    if isinstance(alpha, torch.Tensor):
        return alpha.to(device=like.device, dtype=like.dtype)
    return alpha
