"""What a solver's ``solve(matvec, b, x0)`` accepts, checked once for every solver.

The algorithms work on *flat* pytrees (tuples of tensors). Users pass what they have: a bare
tensor, or a tuple/list/dict (nested) of tensors, for ``b`` and ``x0``, and a ``matvec`` over
that same structure. :func:`normalizing_solve` wraps every :class:`~hypergrad.solvers.Solver`
subclass's ``solve`` (:meth:`Solver.__init_subclass__ <hypergrad.solvers.Solver>`) so that:

* ``b`` is flattened (a flat tuple of tensors passes through untouched: what the library's own
  callers hand over costs nothing), its leaves must be floating-point tensors;
* ``x0`` must have the structure, shapes, dtypes and devices of ``b``;
* ``matvec`` is called on the user's structure and must return that structure with the shapes
  and dtypes of its input (a float32 product for a float64 ``b`` is refused by name, not
  promoted silently: promotion would return an ``x`` of another dtype, or lose the precision
  that ``tol`` asks for);
* ``x`` comes back with the structure of ``b`` (a bare tensor for a bare tensor, a dict for a
  dict).

Bad input raises :class:`~hypergrad.HypergradTypeError` (a wrong type, dtype or structure) or
:class:`~hypergrad.HypergradValueError` (a wrong shape or device) naming the argument.

``matvec`` may carry what its caller knows about the operator as attributes, read by the
solvers and kept by the wrapper: ``batched`` (``V -> A V`` over a leading batch dimension, for
the column-building solvers) and ``symmetric`` (True: the operator is symmetric, e.g. a Hessian;
False: it is not known to be, e.g. the Jacobian of a root or fixed-point condition; None or
absent: nothing is known). ``symmetric`` only changes the advice of the warnings (a symmetric-only
remedy such as MINRES is not suggested for an operator that is not known to be symmetric).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..errors import HypergradTypeError, HypergradValueError
from ..tree import PyTree, Tensors, TreeSpec, leaf_paths, tree_flatten, tree_unflatten

if TYPE_CHECKING:
    from .base import SolveInfo, Solver

SolveMethod = Callable[..., "tuple[Tensors, SolveInfo]"]

#: Marks a ``solve`` already wrapped by :func:`normalizing_solve` (a subclass that inherits it,
#: or defines it by assigning a wrapped one, is not wrapped twice).
_WRAPPED = "__hypergrad_normalizes_inputs__"


def is_flat(tree: Any) -> bool:
    """Whether ``tree`` is already what the algorithms take: a tuple of tensors."""
    return type(tree) is tuple and all(isinstance(t, torch.Tensor) for t in tree)


def symmetric_hint(matvec: Any) -> bool | None:
    """What ``matvec`` says about its operator's symmetry (its ``symmetric`` attribute): True,
    False (not known to be symmetric), or None (nothing known)."""
    value = getattr(matvec, "symmetric", None)
    return value if isinstance(value, bool) else None


class CheckedProduct:
    """The product handed to a solver's algorithm: ``matvec`` on flat pytrees, each result
    checked against its input (structure, shapes, dtypes).

    ``spec`` is None when ``b`` was flat already (``matvec`` takes and returns flat tuples),
    else the structure of ``b`` (each vector is unflattened for ``matvec`` and its result
    flattened back). ``batched`` (kept for a flat ``b`` only: the column-building solvers call it
    on flat batches) and ``symmetric`` are ``matvec``'s own.
    """

    def __init__(self, matvec: Callable[..., Any], spec: TreeSpec | None, solver: str) -> None:
        self.matvec, self.spec, self.solver = matvec, spec, solver
        self.symmetric = symmetric_hint(matvec)
        inner = getattr(matvec, "batched", None)
        self.batched = inner if spec is None and callable(inner) else None

    def __call__(self, v: Tensors) -> Tensors:
        out: Tensors
        if self.spec is None:
            result = self.matvec(v)
            out = (
                result
                if is_flat(result) and len(result) == len(v)
                else self._flat_result(result, len(v))
            )
        else:
            out = self._structured_result(self.matvec(tree_unflatten(self.spec, v)))
        for i, (o, vi) in enumerate(zip(out, v)):
            if o.dtype != vi.dtype or o.shape != vi.shape:
                self._mismatch(i, o, vi)
        return out

    def _where(self, i: int) -> str:
        if self.spec is None:
            return f"leaf [{i}]"
        path = leaf_paths(self.spec, "")[i]
        return f"leaf {path}" if path else "the tensor"

    def _flat_result(self, out: Any, n: int) -> Tensors:
        if isinstance(out, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in out):
            if len(out) == n:
                return tuple(out)
            raise HypergradValueError(
                f"{self.solver}: matvec returned {len(out)} tensors for a vector of {n} leaves "
                "(b's leaves): the product must have the structure of b"
            )
        raise HypergradTypeError(
            f"{self.solver}: matvec must return a tuple of {n} tensors (the structure of b), "
            f"got {_describe(out)}"
        )

    def _structured_result(self, out: Any) -> Tensors:
        assert self.spec is not None
        try:
            leaves, spec = tree_flatten(out, "matvec(v)")
        except HypergradTypeError as err:
            raise HypergradTypeError(
                f"{self.solver}: matvec must return the structure of b ({self.spec!r}): {err}"
            ) from None
        if spec != self.spec:
            raise HypergradTypeError(
                f"{self.solver}: matvec must return the structure of b ({self.spec!r}), "
                f"got {spec!r}"
            )
        return tuple(leaves)

    def _mismatch(self, i: int, out: torch.Tensor, v: torch.Tensor) -> None:
        where = self._where(i)
        if out.dtype != v.dtype:
            raise HypergradTypeError(
                f"{self.solver}: matvec returned {out.dtype} for a {v.dtype} vector ({where}): "
                f"a product must keep the dtype of b, which is {v.dtype}; cast inside matvec "
                f"(or give b, and x0, in {out.dtype})"
            )
        raise HypergradValueError(
            f"{self.solver}: matvec returned shape {tuple(out.shape)} for a vector of shape "
            f"{tuple(v.shape)} ({where}): the product must have the shapes of b"
        )


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a bare tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        kinds = ", ".join(type(v).__name__ for v in value[:4])
        more = ", ..." if len(value) > 4 else ""
        return f"a {type(value).__name__} of ({kinds}{more})"
    return type(value).__name__


def _paths(spec: TreeSpec | None, name: str, n: int) -> list[str]:
    return [f"{name}[{i}]" for i in range(n)] if spec is None else leaf_paths(spec, name)


def flatten_b(solver: str, b: PyTree) -> tuple[Tensors, TreeSpec | None]:
    """``b`` as a flat tuple, and its structure (None when it was flat already).

    Raises:
        HypergradTypeError: ``b`` is not a tensor or a tuple/list/dict of tensors, or a leaf is
            not floating-point.
    """
    if is_flat(b):
        flat, spec = b, None
    else:
        try:
            leaves, spec = tree_flatten(b, "b")
        except HypergradTypeError as err:
            raise HypergradTypeError(f"{solver}: {err}") from None
        flat = tuple(leaves)
    for path, t in zip(_paths(spec, "b", len(flat)), flat):
        if not t.is_floating_point():
            raise HypergradTypeError(
                f"{solver}: {path} must be a floating-point tensor, got {t.dtype}"
            )
    return flat, spec


def flatten_x0(solver: str, x0: PyTree, b: Tensors, spec: TreeSpec | None) -> Tensors | None:
    """``x0`` as a flat tuple checked against ``b`` (a flat ``x0`` for a flat ``b`` is returned
    as is, so that a solver can return the very object when it already meets ``tol``).

    Raises:
        HypergradTypeError: ``x0`` is not a pytree of tensors, has another structure than ``b``,
            or a leaf of another dtype.
        HypergradValueError: a leaf of another shape or device than ``b``'s.
    """
    if x0 is None:
        return None
    if spec is None and is_flat(x0):
        flat: Tensors = x0
    else:
        try:
            leaves, x_spec = tree_flatten(x0, "x0")
        except HypergradTypeError as err:
            raise HypergradTypeError(f"{solver}: {err}") from None
        b_spec = spec if spec is not None else tree_flatten(b, "b")[1]
        if x_spec != b_spec:
            raise HypergradTypeError(
                f"{solver}: x0 must have the structure of b ({b_spec!r}), got {x_spec!r}"
            )
        flat = tuple(leaves)
    if len(flat) != len(b):
        raise HypergradTypeError(
            f"{solver}: x0 has {len(flat)} leaves but b has {len(b)}: x0 must have the "
            "structure of b"
        )
    for path, xi, bi in zip(_paths(spec, "x0", len(flat)), flat, b):
        if xi.dtype != bi.dtype:
            raise HypergradTypeError(
                f"{solver}: {path} is {xi.dtype} but b's leaf is {bi.dtype}: the warm start must "
                f"have the dtypes of b (cast it: x0.to({bi.dtype}))"
            )
        if xi.shape != bi.shape:
            raise HypergradValueError(
                f"{solver}: {path} has shape {tuple(xi.shape)} but b's leaf has "
                f"{tuple(bi.shape)}: the warm start must have the shapes of b"
            )
        if xi.device != bi.device:
            raise HypergradValueError(
                f"{solver}: {path} is on {xi.device} but b's leaf is on {bi.device}"
            )
    return flat


def normalizing_solve(solve: SolveMethod) -> SolveMethod:
    """Wrap a solver's ``solve(self, matvec, b, x0=None)`` so that it takes and returns what
    users pass (module docstring); the algorithm sees flat tuples and a :class:`CheckedProduct`."""
    if getattr(solve, _WRAPPED, False):
        return solve

    @functools.wraps(solve)
    def wrapper(
        self: Solver, matvec: Callable[..., Any], b: PyTree, x0: PyTree = None
    ) -> tuple[PyTree, SolveInfo]:
        solver = type(self).display
        if isinstance(matvec, CheckedProduct) and is_flat(b):  # a super().solve(...) call
            return solve(self, matvec, b, x0)
        if not callable(matvec):
            raise HypergradTypeError(
                f"{solver}: matvec must be a callable v -> A v, got {type(matvec).__name__}"
            )
        flat_b, spec = flatten_b(solver, b)
        flat_x0 = flatten_x0(solver, x0, flat_b, spec)
        x, info = solve(self, CheckedProduct(matvec, spec, solver), flat_b, flat_x0)
        return (x if spec is None else tree_unflatten(spec, list(x))), info

    setattr(wrapper, _WRAPPED, True)
    return wrapper
