"""Solvers as pure tensor functions: the kernel protocol that
:func:`~hypergrad.compile_implicit_grad` drives, the masked utilities kernels are written with,
and the one dense-Hessian builder of the ``torch.func`` code.

A solver becomes compilable by declaring a kernel beside its eager ``solve``, in its own file
(``Solver.kernel()`` returns it; ``docs/solvers.md``, "Writing a solver"):

* an :class:`IterativeKernel` (CG, Neumann) is ``init`` / ``step`` / ``answer`` / ``diagnose``
  over a state, a ``NamedTuple`` of tensors (with at least ``done`` and ``iterations``):
  ``step(op, state, active)`` is one iteration with the operator ``op: v -> (A + damping I) v``,
  *masked*: where the 0-d bool ``active`` is False it returns the state unchanged, so that the
  driver can run a fixed number of iterations in one graph (or a ``while_loop``) without a host
  sync per iteration. It is written with :func:`dot`, :func:`axpy` and ``torch.where``, never
  with ``float(...)``, ``.item()`` or Python branches on tensors;
* a :class:`DenseKernel` (Exact) solves on the dense matrix of the operator in one go.

Every kernel reports scalars through the driver as one float64 vector (one host sync per call):
the driver's generic ones (:class:`Stats`) and the kernel's own (``fields``, returned by
``answer``/``solve`` by name); ``diagnose`` turns them into the :class:`~hypergrad.SolveInfo` and
the warnings of the eager ``solve``.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Generic, NamedTuple, TypeVar

import torch
import torch.utils._pytree as pytree
from torch._higher_order_ops import while_loop
from torch.func import grad_and_value, jacrev

from ..tree import Tensors
from .krylov import default_maxiter

if TYPE_CHECKING:
    from .base import SolveInfo, Solver

Op = Callable[[Tensors], Tensors]
#: a solver class a kernel is written for
S = TypeVar("S", bound="Solver")
#: a kernel's state: a NamedTuple of tensors (and tuples of tensors)
State = TypeVar("State", bound=tuple[Any, ...])


class Stats(NamedTuple):
    """The scalars every compiled solve reports, whatever its solver, by name.

    The driver (:mod:`hypergrad.compiled`) returns them with the kernel's own (its ``fields``)
    as one float64 vector, stacked and read back through these names (a statistic not produced
    is 0).
    """

    residual: float  # ||(H + damping I) x - b||
    b_norm: float  # ||b||, the outer loss's gradient w.r.t. params
    hypergrad_norm: float
    indirect_norm: float  # the mixed term
    direct_norm: float
    finite: float  # 1.0 when the hypergradient is finite
    outer_loss: float
    inner_loss: float
    iterations: float
    diverged: float  # 1.0: the iteration blew up (CG: negative curvature; Neumann: a term grew)


class Kernel(Generic[S]):
    """What every kernel declares: the solver it implements (whose settings are frozen, so the
    kernel reads them from it and never keeps a copy), its own statistics and its report."""

    #: the names of the kernel's own statistics (returned by ``answer``/``solve``, read by
    #: :meth:`diagnose` and :meth:`fallback`)
    fields: ClassVar[tuple[str, ...]] = ()

    def __init__(self, solver: S) -> None:
        self.solver = solver

    def tol(self) -> float | None:
        """The relative residual that ``converged`` requires (None: never claimed)."""
        tol: float | None = getattr(self.solver, "tol", None)
        return tol

    def matvecs(self, n: int, iterations: int, warm: bool) -> int:
        """Products spent: one per iteration, the warm start's, and the verified residual's."""
        return iterations + int(warm) + 1

    def fallback(self, st: Stats, own: dict[str, float], rel: float) -> bool:
        """Whether the eager ``solve`` must answer this call instead (e.g. a singular LU)."""
        return False

    def diagnose(
        self, info: SolveInfo, st: Stats, own: dict[str, float], dtype: torch.dtype
    ) -> None:
        """The solver's own diagnostics and warnings, as its eager ``solve`` reports them
        (``info`` has ``iterations``, ``residual``, ``diverged`` and ``converged`` set;
        ``dtype``: the parameters')."""


class IterativeKernel(Kernel[S], Generic[S, State]):
    """An iteration ``init`` -> ``step``\\* -> ``answer`` over a ``NamedTuple`` state.

    The state holds tensors only (one tuple per vector, one tensor per parameter leaf) and has
    the fields ``done`` (0-d bool: no further iteration runs) and ``iterations`` (0-d int64);
    ``vectors`` names its fields that are vectors (the dense path carries each as one flat
    tensor and splits it back before :meth:`answer`).
    """

    vectors: ClassVar[tuple[str, ...]] = ()

    def maxiter(self, like: Tensors) -> int:
        """The iteration budget for a system shaped like ``like``: the solver's ``maxiter``, or
        (None) the eager solvers' default, ``min(2 * numel, 1000)``."""
        maxiter = getattr(self.solver, "maxiter", None)
        return default_maxiter(like) if maxiter is None else int(maxiter)

    def init(self, b: Tensors, r: Tensors, x0: Tensors) -> State:
        """The state before the first iteration (``r``: the starting residual ``b - A x0``)."""
        raise NotImplementedError

    def step(self, op: Op, state: State, active: torch.Tensor) -> State:
        """One iteration with ``op`` (``v -> (A + damping I) v``); the state unchanged where
        ``active`` is False."""
        raise NotImplementedError

    def answer(self, state: State, x0: Tensors) -> tuple[Tensors, dict[str, torch.Tensor]]:
        """The solution and the statistics (0-d tensors) named in :data:`Stats` (``diverged``)
        or in ``fields``."""
        raise NotImplementedError


class DenseKernel(Kernel[S]):
    """A direct solve on the dense matrix of the operator."""

    def solve(
        self, mat: torch.Tensor, b: Tensors, unflat: Callable[[torch.Tensor], Tensors]
    ) -> tuple[Tensors, dict[str, torch.Tensor]]:
        """``x`` solving ``(mat + damping I) x = b`` (``mat``: ``(n, n)`` in the parameters'
        dtype; ``unflat`` splits a flat vector into the leaves of ``b``) and the statistics as
        :meth:`IterativeKernel.answer`'s."""
        raise NotImplementedError


# ---------------------------------------------------------------------------------------------
# Masked utilities


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype reductions over ``t`` accumulate in (float32 or wider)."""
    return torch.promote_types(t.dtype, torch.float32)


def dot(a: Tensors, b: Tensors) -> torch.Tensor:
    """``sum_i <a_i, b_i>`` over the leaves, accumulated in float32 or wider (a 0-d tensor)."""
    terms = [(x.to(acc_dtype(x)) * y.to(acc_dtype(x))).sum() for x, y in zip(a, b)]
    total: torch.Tensor = functools.reduce(operator.add, terms)
    return total


def axpy(alpha: float | torch.Tensor, x: Tensors, y: Tensors) -> Tensors:
    """``y + alpha x`` per leaf, in ``y``'s dtype (``alpha`` may be a 0-d tensor)."""
    return tuple(yi + (alpha * xi).to(yi.dtype) for xi, yi in zip(x, y))


def select(mask: torch.Tensor, a: Tensors, b: Tensors) -> Tensors:
    """``a`` where the 0-d bool ``mask`` is True, else ``b``, per leaf."""
    return tuple(torch.where(mask, ai, bi) for ai, bi in zip(a, b))


def loop(cond: Callable[[Any], torch.Tensor], body: Callable[[Any], Any], state: Any) -> Any:
    """``while cond(state): state = body(state)``; under ``torch.compile`` as one
    ``while_loop`` (the body traced and compiled once), else in Python. ``state`` is a pytree of
    tensors whose shapes and dtypes ``body`` keeps."""
    if not torch.compiler.is_compiling():
        while bool(cond(state)):
            state = body(state)
        return state
    leaves, spec = pytree.tree_flatten(state)
    # nor may one tensor be carried twice (x0 as the iterate and as the best one, ...)
    leaves = [t.clone() if any(t is u for u in leaves[:i]) else t for i, t in enumerate(leaves)]

    def unpack(fn: Callable[[Any], Any]) -> Callable[..., Any]:
        return lambda *xs: fn(pytree.tree_unflatten(list(xs), spec))

    def step(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = pytree.tree_leaves(unpack(body)(*xs))
        # while_loop's body may not return an input as it is (aliasing): a constant is copied
        return tuple(o.clone() if any(o is x for x in xs) else o for o in out)

    run: Callable[..., tuple[torch.Tensor, ...]] = while_loop
    out = run(unpack(cond), step, tuple(leaves))
    return pytree.tree_unflatten(list(out), spec)


# ---------------------------------------------------------------------------------------------
# Flat vectors and the dense Hessian


def flatten(ts: Tensors) -> torch.Tensor:
    """The leaves of ``ts`` as one flat vector."""
    return torch.cat([t.reshape(-1) for t in ts])


def unflattener(like: Tensors) -> Callable[[torch.Tensor], Tensors]:
    """The function splitting a flat vector into leaves shaped like ``like`` (the inverse of
    :func:`flatten`)."""
    sizes = [t.numel() for t in like]
    shapes = [t.shape for t in like]

    def unflat(z: torch.Tensor) -> Tensors:
        parts: tuple[torch.Tensor, ...] = torch.split(z, sizes)
        return tuple(c.reshape(s) for c, s in zip(parts, shapes))

    return unflat


def dense_hessian(
    loss: Callable[[torch.Tensor], torch.Tensor], z: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(H, g, value)``: the Hessian, gradient and value of ``loss`` at the flat vector ``z``,
    as ``torch.func`` code (one ``jacrev`` of ``grad_and_value``: a ``vmap``-ed product over
    the unit vectors; row ``i`` of ``H`` is ``e_iᵀ J`` of the gradient's Jacobian ``J``), in
    ``z``'s dtype. The one dense Hessian of the compiled paths (:mod:`hypergrad.compiled`,
    :mod:`hypergrad.compiled_step`). Its eager twin is :func:`hypergrad.inner.smooth.hessian`
    (``hg.inner.Newton``): one batched double-backward pass, about 3x faster eagerly but not
    traceable by ``torch.compile`` (``torch.autograd.grad`` breaks the graph), so each
    execution mode keeps the builder that runs in it; the linear solvers build an operator's
    dense matrix from its products with :func:`~hypergrad.solvers.dense.dense_matrix`."""

    def with_aux(v: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        g, value = grad_and_value(loss)(v)
        return g, (g, value)

    hess, (g, value) = jacrev(with_aux, has_aux=True)(z)
    return hess, g, value
