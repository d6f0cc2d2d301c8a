"""The functional forms: :func:`implicit_grad` (the hypergradient of an outer loss at an inner
solution), :func:`root_vjp` and :func:`root_jvp` (one derivative of a root in reverse / forward
mode)."""

from __future__ import annotations

from typing import Any

import torch

from ..conditions import Condition, as_condition, warn_if_nonstationary
from ..distributed import check_mode, make_reducer
from ..errors import (
    HypergradTypeError,
    HypergradValueError,
)
from ..operators import check_engine
from ..report import HypergradInfo, Loss, average_if_local, check_leaves, check_solver, fresh
from ..solvers import Solver
from ..tree import (
    PyTree,
    Tensors,
    leaf_paths,
    tree_all_finite,
    tree_flatten,
    tree_unflatten,
)
from .adjoint import hypergradient_core, pick_solver, solve_forward, solve_reverse
from .linearization import ConditionLinearization, Map


def check_warm_start(
    x0: PyTree, p_leaves: list[torch.Tensor], p_spec: Any, p_names: list[str]
) -> Tensors:
    """Validate a warm start against ``params`` leaf by leaf and return its detached leaves.

    Args:
        x0: the warm start, a pytree like ``params``.
        p_leaves: the leaves of ``params``.
        p_spec: the structure of ``params``.
        p_names: the leaf paths of ``params`` (for messages).

    Raises:
        HypergradValueError: structure, shape or device differs from ``params``, or NaN/Inf.
        HypergradTypeError: a leaf's dtype differs from the matching ``params`` leaf.
    """
    x0_list, x0_spec = tree_flatten(x0, "x0")
    if x0_spec != p_spec or any(a.shape != b.shape for a, b in zip(x0_list, p_leaves)):
        raise HypergradValueError(
            f"x0 must have the structure and shapes of params: got {x0_spec!r} with shapes "
            f"{[tuple(a.shape) for a in x0_list]}, expected {p_spec!r} with shapes "
            f"{[tuple(a.shape) for a in p_leaves]}"
        )
    x0_names = leaf_paths(x0_spec, "x0")
    for a, p, an, pn in zip(x0_list, p_leaves, x0_names, p_names):
        if a.dtype != p.dtype:
            raise HypergradTypeError(
                f"{an} has dtype {a.dtype} but {pn} has dtype {p.dtype}: a warm start must match "
                "params leaf by leaf (e.g. pass the previous info.adjoint, or cast "
                "with .to(params.dtype))"
            )
        if a.device != p.device:
            raise HypergradValueError(
                f"{an} is on device {a.device} but {pn} is on device {p.device}: move the warm "
                "start to the device of params"
            )
        if not tree_all_finite((a.detach(),)):
            raise HypergradValueError(f"{an} contains NaN or Inf")
    return tuple(a.detach() for a in x0_list)


def check_flag(value: object, name: str) -> bool:
    """``value`` if it is a bool; raise otherwise (a string such as ``"off"`` is not False)."""
    if not isinstance(value, bool):
        raise HypergradTypeError(f"{name} must be True or False, got {value!r}")
    return value


def implicit_grad(
    inner_loss: Loss,
    outer_loss: Loss,
    params: PyTree,
    hparams: PyTree,
    *,
    solver: Solver | None = None,
    engine: str = "reuse",
    x0: PyTree | None = None,
    distributed: str | None = None,
    stationarity: bool = True,
) -> tuple[PyTree, HypergradInfo]:
    """Hypergradient ``dL_out/dtheta`` at an (approximate) inner solution, by implicit diff.

    Args:
        inner_loss: ``(params, hparams) -> scalar``, (approximately) minimised by ``params``.
        outer_loss: ``(params, hparams) -> scalar`` to be minimised over ``hparams``.
        params, hparams: the inner solution and the hyperparameters, pytrees (tensor / tuple /
            list / dict) of float tensors.
        solver: linear solver for ``H x = dL_out/dpsi``; default ``hg.CG()``.
        engine: ``"reuse"`` (one graph, fastest) or ``"recompute"`` (lowest memory).
        x0: warm start, shaped like ``params``: the previous call's ``info.adjoint``, or
            :class:`hg.WarmStart(...).x0() <hypergrad.WarmStart>` (which keeps good ones only).
        distributed: None, ``"exact"`` or ``"local"`` (see :mod:`hypergrad.distributed`).
        stationarity: measure ``info.stationarity`` (default True), ``||g|| / max(||H params||,
            ||g − H params||)`` with ``g = ∇_params inner_loss``: one Hessian-vector product
            (4% of a 20-iteration CG solve on an 85k-parameter MLP, 19% of a three-term
            Neumann series, ``docs/modules.md``). False skips it (NaN, nothing warns).

    Returns:
        ``(hypergrads, info)``: hypergrads shaped like ``hparams``; ``info`` a
        :class:`~hypergrad.HypergradInfo` (``info.solve``: the solve's report).

    Warns:
        NonStationaryWarning: ``info.stationarity`` is above
            :data:`~hypergrad.conditions.STATIONARITY_THRESHOLD` (1e-3): ``params`` is not an
            inner solution, so the result (returned) is not the hypergradient; its relative
            error is of order ``κ · stationarity``, ``κ`` the condition number of ``H``.
        HypergradWarning: ``info.solve.failure`` is set (the solve diverged, the system is
            singular and inconsistent, the iteration stalled, or the relative residual is
            NaN/Inf or above 1): the result is returned, with a warning (a subclass per cause).
            A truncated solve (residual below 1, ``converged=False``) is not warned about.

    Raises:
        HypergradError: bad inputs (non-scalar/non-finite losses, integer or non-leaf tensors,
            structure mismatches, a warm start ``x0`` unlike ``params`` or with NaN/Inf),
            hyperparameters that influence neither loss, or a Hessian-vector product that
            returned NaN/Inf (the message names the solver and the iteration).

    Example (ridge regression; the hypergradient of the validation loss w.r.t. the decay):
        >>> import hypergrad as hg
        >>> X, y = torch.randn(20, 3, dtype=torch.float64), torch.randn(20, dtype=torch.float64)
        >>> lam = torch.tensor(0.5, dtype=torch.float64)
        >>> inner = lambda w, lam: 0.5 * ((X @ w - y) ** 2).sum() + 0.5 * lam * (w ** 2).sum()
        >>> outer = lambda w, lam: 0.5 * ((X @ w - 1.0) ** 2).sum()
        >>> w = torch.linalg.solve(X.T @ X + lam * torch.eye(3, dtype=torch.float64), X.T @ y)
        >>> g, info = hg.implicit_grad(inner, outer, w, lam, solver=hg.CG(tol=1e-12))
        >>> info.solve.converged, info.stationarity < 1e-12
        (True, True)
    """
    for name, fn in (("inner_loss", inner_loss), ("outer_loss", outer_loss)):
        if not callable(fn):
            raise HypergradTypeError(f"{name} must be callable, got {type(fn).__name__}")
    solver = check_solver(solver)
    check_engine(engine)
    check_mode(distributed)
    stationarity = check_flag(stationarity, "stationarity")
    flat = _FlatProblem(inner_loss, outer_loss, params, hparams)
    x0_leaves = None if x0 is None else check_warm_start(x0, *flat.params)
    hyper, info = hypergradient_core(
        flat.inner, flat.outer, fresh(flat.p_leaves), fresh(flat.h_leaves), solver, engine=engine,
        x0=x0_leaves, psi_names=flat.p_names, theta_names=flat.h_names,
        reduce=make_reducer(distributed), stationarity=stationarity,
    )  # fmt: skip
    if stationarity:
        warn_if_nonstationary(info.stationarity, "inner_loss (at params)")
    hyper = average_if_local(hyper, distributed)
    # the adjoint solution x = H^-1 dL_out/dpsi, shaped like params: pass it as x0 next time
    info.adjoint = tree_unflatten(flat.p_spec, list(info.adjoint))
    return tree_unflatten(flat.h_spec, list(hyper)), info


class _FlatProblem:
    """``implicit_grad``'s losses over flat leaves: the pytrees flattened and checked, and the
    two losses rebuilding them."""

    def __init__(self, inner_loss: Loss, outer_loss: Loss, params: PyTree, hparams: PyTree):
        self.inner_loss, self.outer_loss = inner_loss, outer_loss
        self.p_leaves, self.p_spec = tree_flatten(params, "params")
        self.h_leaves, self.h_spec = tree_flatten(hparams, "hparams")
        self.p_names = leaf_paths(self.p_spec, "params")
        self.h_names = leaf_paths(self.h_spec, "hparams")
        self.params = (self.p_leaves, self.p_spec, self.p_names)
        check_leaves(self.p_leaves, self.p_names, "params")
        check_leaves(self.h_leaves, self.h_names, "hparams")

    def inner(self, ps: Tensors, hs: Tensors) -> torch.Tensor:
        return self.inner_loss(tree_unflatten(self.p_spec, ps), tree_unflatten(self.h_spec, hs))

    def outer(self, ps: Tensors, hs: Tensors) -> torch.Tensor:
        return self.outer_loss(tree_unflatten(self.p_spec, ps), tree_unflatten(self.h_spec, hs))


def _check_like(
    tree: PyTree, what: str, leaves: list[torch.Tensor], spec: Any, names: list[str]
) -> Tensors:
    """The leaves of ``tree`` (detached), checked against ``leaves`` (structure, shape, dtype,
    device) and for NaN/Inf."""
    t_leaves, t_spec = tree_flatten(tree, what)
    if t_spec != spec or any(a.shape != b.shape for a, b in zip(t_leaves, leaves)):
        raise HypergradValueError(
            f"{what} must have the structure and shapes of {names[0].split('[')[0]}: got "
            f"{t_spec!r} with shapes {[tuple(a.shape) for a in t_leaves]}, expected {spec!r} "
            f"with shapes {[tuple(a.shape) for a in leaves]}"
        )
    for a, b, n in zip(t_leaves, leaves, names):
        if a.dtype != b.dtype:
            raise HypergradTypeError(f"{what} has dtype {a.dtype} where {n} has {b.dtype}")
        if a.device != b.device:
            raise HypergradValueError(f"{what} is on {a.device} where {n} is on {b.device}")
    out = tuple(a.detach() for a in t_leaves)
    if not tree_all_finite(out):
        raise HypergradValueError(f"{what} contains NaN or Inf")
    return out


def _setup(
    optimality_fn: Map | Condition, params: PyTree, hparams: PyTree
) -> tuple[Condition, list[torch.Tensor], Any, list[str], list[torch.Tensor], Any, list[str]]:
    cond = as_condition(optimality_fn)
    p_leaves, p_spec = tree_flatten(params, "params")
    h_leaves, h_spec = tree_flatten(hparams, "hparams")
    p_names, h_names = leaf_paths(p_spec, "params"), leaf_paths(h_spec, "hparams")
    check_leaves(p_leaves, p_names, "params")
    check_leaves(h_leaves, h_names, "hparams")
    return cond, p_leaves, p_spec, p_names, h_leaves, h_spec, h_names


def root_vjp(
    optimality_fn: Map | Condition,
    params: PyTree,
    hparams: PyTree,
    cotangent: PyTree,
    *,
    solver: Solver | None = None,
) -> tuple[PyTree, HypergradInfo]:
    """Reverse mode: ``vᵀ dx*/dθ`` at a root ``params`` of ``optimality_fn``.

    Solves ``(∂F/∂params)ᵀ u = cotangent`` and returns ``−(∂F/∂hparams)ᵀ u``: the gradient that
    a loss with ``∂loss/∂params = cotangent`` passes to ``hparams`` through the solution map.

    Args:
        optimality_fn: ``F(params, hparams)``, a pytree like ``params``, zero at the solution;
            a plain callable or a :class:`hypergrad.conditions.Condition` (e.g.
            ``hg.conditions.fixed_point(T)`` for a fixed point ``params = T(params, hparams)``).
        params: the root (a pytree of float tensors, detached).
        hparams: the hyperparameters (a pytree of float tensors, detached).
        cotangent: ``v``, a pytree like ``params``.
        solver: linear solver for the transposed system (default: ``hg.GMRES()``; ``hg.CG()``
            for a symmetric condition such as ``hg.conditions.stationary(loss)``). Symmetric-only
            solvers are refused for a condition whose Jacobian is not symmetric (module docs).

    Returns:
        ``(vjp, info)``: ``vjp`` has the structure of ``hparams``; ``info`` is a
        :class:`~hypergrad.HypergradInfo` (``info.solve``, ``info.stationarity``,
        ``info.extras["adjoint"]``).

    Raises:
        HypergradError: bad inputs (integer, non-leaf or non-finite tensors, a cotangent unlike
            params, ``F`` returning a pytree unlike params or NaN/Inf), ``F`` not depending on a
            leaf of params (singular system) or of hparams (a silently zero derivative), a
            symmetric-only solver on a non-symmetric condition.

    Warns:
        NonStationaryWarning: ``info.stationarity`` is above
            :data:`hypergrad.conditions.STATIONARITY_THRESHOLD`.

    Example (the root of ``F(x, θ) = A x − θ`` is ``A⁻¹ θ``, so ``vᵀ dx*/dθ = A⁻ᵀ v``):
        >>> import hypergrad as hg
        >>> A = torch.tensor([[2.0, 1.0], [0.0, 4.0]], dtype=torch.float64)
        >>> F = lambda x, th: A @ x - th
        >>> th = torch.tensor([1.0, 2.0], dtype=torch.float64)
        >>> x = torch.linalg.solve(A, th)
        >>> v = torch.tensor([1.0, 1.0], dtype=torch.float64)
        >>> g, info = hg.root_vjp(F, x, th, v, solver=hg.Exact())
        >>> torch.allclose(g, torch.linalg.solve(A.T, v)), info.stationarity
        (True, 0.0)
    """
    cond, p_leaves, p_spec, p_names, h_leaves, h_spec, h_names = _setup(
        optimality_fn, params, hparams
    )
    cot = _check_like(cotangent, "cotangent", p_leaves, p_spec, p_names)
    slv = pick_solver(solver, cond)
    lin = ConditionLinearization(
        cond, tuple(p_leaves), tuple(h_leaves), p_spec, h_spec, p_names, h_names
    )
    out, info = solve_reverse(lin, cot, slv, (True,) * len(h_leaves))
    info.extras["adjoint"] = tree_unflatten(p_spec, list(info.extras["adjoint"]))
    return tree_unflatten(h_spec, list(out)), info


def root_jvp(
    optimality_fn: Map | Condition,
    params: PyTree,
    hparams: PyTree,
    tangents: PyTree,
    *,
    solver: Solver | None = None,
) -> tuple[PyTree, HypergradInfo]:
    """Forward mode: ``dx*/dθ · t`` at a root ``params`` of ``optimality_fn``.

    Solves ``(∂F/∂params) w = −(∂F/∂hparams) t`` and returns ``w``. The products with
    ``∂F/∂params`` are vjps of ``F``'s vjp (``F`` must be twice differentiable by autograd).

    Args:
        optimality_fn: ``F(params, hparams)`` as in :func:`root_vjp`.
        params: the root (a pytree of float tensors, detached).
        hparams: the hyperparameters (a pytree of float tensors, detached).
        tangents: ``t``, a pytree like ``hparams``.
        solver: as in :func:`root_vjp` (the system is ``∂F/∂params``, not its transpose).

    Returns:
        ``(jvp, info)``: ``jvp`` has the structure of ``params``; ``info`` is a
        :class:`~hypergrad.HypergradInfo` (``info.extras["tangent"]`` is ``jvp`` itself).

    Raises:
        HypergradError: as :func:`root_vjp` (tangents unlike hparams).

    Warns:
        NonStationaryWarning: as :func:`root_vjp`.

    Example:
        >>> import hypergrad as hg
        >>> A = torch.tensor([[2.0, 1.0], [0.0, 4.0]], dtype=torch.float64)
        >>> F = lambda x, th: A @ x - th
        >>> th = torch.tensor([1.0, 2.0], dtype=torch.float64)
        >>> t = torch.tensor([1.0, 0.0], dtype=torch.float64)
        >>> w, info = hg.root_jvp(F, torch.linalg.solve(A, th), th, t, solver=hg.Exact())
        >>> torch.allclose(w, torch.linalg.solve(A, t))
        True
    """
    cond, p_leaves, p_spec, p_names, h_leaves, h_spec, h_names = _setup(
        optimality_fn, params, hparams
    )
    tan = _check_like(tangents, "tangents", h_leaves, h_spec, h_names)
    slv = pick_solver(solver, cond)
    lin = ConditionLinearization(
        cond, tuple(p_leaves), tuple(h_leaves), p_spec, h_spec, p_names, h_names
    )
    w, info = solve_forward(lin, tan, slv)
    w_tree = tree_unflatten(p_spec, list(w))
    info.extras["tangent"] = w_tree
    return w_tree, info
