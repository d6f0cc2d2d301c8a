"""Implicit differentiation: ``implicit_grad`` and the ``@implicit`` decorator.

At an inner solution ``psi*(theta) = argmin_psi L_in(psi, theta)`` the optimality condition
``dL_in/dpsi = 0`` gives, by the implicit function theorem,

    dL_out/dtheta = dL_out/dtheta|_direct - (d^2 L_in / dtheta dpsi) H^{-1} dL_out/dpsi,

with ``H = d^2 L_in / dpsi^2``. The linear system ``H x = dL_out/dpsi`` is solved by any solver
in :mod:`hypergrad.solvers`. The result is the gradient of the outer loss: put it in ``.grad`` and
step any optimizer that *minimises*.

The formula holds at a stationary point only, so both entry points report how far the given
point is from one, ``info.stationarity = ||g|| / max(||H psi||, ||g - H psi||)`` with
``g = dL_in/dpsi`` (:mod:`hypergrad.conditions`; one Hessian-vector product), and warn with
:class:`~hypergrad.NonStationaryWarning` above
:data:`~hypergrad.conditions.STATIONARITY_THRESHOLD`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._core import (
    HypergradInfo,
    Loss,
    average_if_local,
    check_leaves,
    check_solver,
    fresh,
    hypergradient_core,
)
from .conditions import stationary, warn_if_nonstationary
from .distributed import check_mode, make_reducer
from .errors import HypergradTypeError, HypergradValueError
from .operators import check_engine
from .roots import GradientCondition, decorate
from .solvers import Solver
from .tree import (
    PyTree,
    Tensors,
    leaf_paths,
    tree_all_finite,
    tree_flatten,
    tree_unflatten,
)


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


def _check_flag(value: object, name: str) -> bool:
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
        inner_loss: ``(params, hparams) -> scalar``; ``params`` should (approximately) minimise it.
        outer_loss: ``(params, hparams) -> scalar`` to be minimised over ``hparams``.
        params: inner solution, a pytree (tensor / tuple / list / dict) of float tensors.
        hparams: hyperparameters, a pytree of float tensors.
        solver: linear solver for ``H x = dL_out/dpsi``; default ``hg.CG()``.
        engine: ``"reuse"`` (one graph, fastest) or ``"recompute"`` (lowest memory).
        x0: warm start for the solver, with the structure of ``params`` (e.g. the previous
            call's ``info.adjoint``, the adjoint solution it computed, or
            :class:`hg.WarmStart(...).x0() <hypergrad.WarmStart>`, which keeps only good ones).
        distributed: None, ``"exact"`` or ``"local"`` (see :mod:`hypergrad.distributed`).
        stationarity: measure ``info.stationarity`` (default True): how far ``params`` is from a
            stationary point of ``inner_loss``, ``||g|| / max(||H params||, ||g − H params||)``
            with ``g = ∇_params inner_loss`` (:mod:`hypergrad.conditions`). It costs one
            Hessian-vector product (``info.extras["condition_products"]``; none when ``g`` is
            exactly zero): 4% of a 20-iteration CG solve on an 85k-parameter MLP, 19% of
            a three-term Neumann series (``docs/modules.md``). False skips it
            (``info.stationarity`` is NaN, nothing warns).

    Returns:
        ``(hypergrads, info)``: hypergrads has the structure of ``hparams``; ``info.solve`` is
        the solver's :class:`~hypergrad.SolveInfo`; ``info.stationarity`` as above.

    Warns:
        NonStationaryWarning: ``info.stationarity`` is above
            :data:`~hypergrad.conditions.STATIONARITY_THRESHOLD` (1e-3): ``params`` is not an
            inner solution, so the result is the implicit formula evaluated away from the
            solution, not the hypergradient (its relative error is of order ``κ ·
            stationarity``, ``κ`` the condition number of ``H``). The hypergradient is returned.
            The text is fixed (the number is in ``info``): Python's default filter shows it once
            per call site.
        HypergradWarning: the result is returned, with a warning (a subclass per cause), when it
            is not a hypergradient: ``info.solve.failure`` is set (the solve diverged, the system
            is singular and inconsistent, the iteration stalled, or the relative residual is
            NaN/Inf or above 1). hypergrad's solvers warn themselves; for another solver object
            this function warns. A truncated solve (residual below 1, ``converged=False``) is an
            approximate hypergradient and is not warned about here.

    Raises:
        HypergradError: bad inputs (non-scalar/non-finite losses, integer or non-leaf tensors,
            structure mismatches; a warm start ``x0`` whose structure, shapes, dtypes or devices
            differ from ``params``, or with NaN/Inf), hyperparameters that influence neither
            loss, or a Hessian-vector product that returned NaN/Inf (the message names the
            solver and the iteration).

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
    if not callable(inner_loss):
        raise HypergradTypeError(f"inner_loss must be callable, got {type(inner_loss).__name__}")
    if not callable(outer_loss):
        raise HypergradTypeError(f"outer_loss must be callable, got {type(outer_loss).__name__}")
    solver = check_solver(solver)
    check_engine(engine)
    check_mode(distributed)
    stationarity = _check_flag(stationarity, "stationarity")
    p_leaves, p_spec = tree_flatten(params, "params")
    h_leaves, h_spec = tree_flatten(hparams, "hparams")
    p_names, h_names = leaf_paths(p_spec, "params"), leaf_paths(h_spec, "hparams")
    check_leaves(p_leaves, p_names, "params")
    check_leaves(h_leaves, h_names, "hparams")
    x0_leaves = None if x0 is None else check_warm_start(x0, p_leaves, p_spec, p_names)
    psi, theta = fresh(p_leaves), fresh(h_leaves)

    def inner(ps: Tensors, hs: Tensors) -> torch.Tensor:
        return inner_loss(tree_unflatten(p_spec, ps), tree_unflatten(h_spec, hs))

    def outer(ps: Tensors, hs: Tensors) -> torch.Tensor:
        return outer_loss(tree_unflatten(p_spec, ps), tree_unflatten(h_spec, hs))

    hyper, info = hypergradient_core(
        inner,
        outer,
        psi,
        theta,
        solver,
        engine=engine,
        x0=x0_leaves,
        psi_names=p_names,
        theta_names=h_names,
        reduce=make_reducer(distributed),
        stationarity=stationarity,
    )
    if stationarity:
        warn_if_nonstationary(info.stationarity, "inner_loss (at params)")
    hyper = average_if_local(hyper, distributed)
    # the adjoint solution x = H^-1 dL_out/dpsi, shaped like params: pass it as x0 next time
    info.adjoint = tree_unflatten(p_spec, list(info.adjoint))
    return tree_unflatten(h_spec, list(hyper)), info


def implicit(
    inner_loss: Loss,
    *,
    solver: Solver | None = None,
    engine: str = "reuse",
    stationarity: bool = True,
) -> Callable[[Callable[..., PyTree]], Callable[..., PyTree]]:
    """Decorator making an inner solver differentiable by implicit differentiation.

    The decorated function ``fit(hparams, *args, **kwargs)`` returns ``params`` approximately
    minimising ``inner_loss(params, hparams)``; it runs without autograd. Gradients flowing into
    its output are mapped to ``hparams`` by solving the adjoint system at the returned point, so
    ``outer(fit(hparams, ...)).backward()`` fills ``hparams.grad`` with the hypergradient (plus any
    direct dependence of the outer loss on ``hparams``, handled by ordinary autograd).

    The hyperparameters are ``fit``'s first parameter; they may be passed positionally or by
    keyword (``fit(lam=...)`` for ``def fit(lam, ...)``, or ``fit(hparams=...)``). Only they are
    differentiated: the other arguments are constants, and one holding a tensor that requires
    grad (which would silently receive no gradient) raises :class:`~hypergrad.HypergradError`
    naming it: detach it (a warm start: its derivative is zero at a solution), or move it into
    the hyperparameters.

    The decorated function composes with ``torch.func``: ``torch.func.grad`` of an outer loss
    w.r.t. ``hparams``, ``torch.func.jacrev`` / ``vjp`` of the solution map, and
    ``torch.func.vmap`` over a batch of hyperparameters. ``vmap`` runs one inner solve per batch
    element (a Python loop), and ``jacrev`` one adjoint solve per output element. Only
    first-order derivatives are supported (no ``jacrev(jacrev(fit))`` or ``jvp``).

    A backward whose adjoint solve is not a hypergradient (``fit.last_info.solve.failure`` set)
    still fills the gradients, with a :class:`~hypergrad.HypergradWarning` (from the solver, or
    from the decorator for a solver object that is not hypergrad's), as ``implicit_grad`` does.
    Likewise a backward at a point that ``fit`` left far from a stationary point of
    ``inner_loss`` (``fit.last_info.stationarity`` above
    :data:`~hypergrad.conditions.STATIONARITY_THRESHOLD`) warns with
    :class:`~hypergrad.NonStationaryWarning` (once per decorated function under Python's
    default filter).

    Diagnostics: ``fit.last_info`` is the :class:`~hypergrad.HypergradInfo` of the most recent
    backward (None before the first): ``fit.last_info.solve`` is the adjoint solve's
    :class:`~hypergrad.SolveInfo`, ``hypergrad_norm`` (= ``indirect_norm``) the norm of the
    gradient passed to ``hparams`` through the solution, ``stationarity`` as in
    :func:`~hypergrad.implicit_grad`, ``adjoint`` the adjoint
    solution; ``outer_loss`` and ``direct_norm`` are NaN (the decorator never sees the outer
    loss). It is overwritten by every backward (under ``vmap``/``jacrev``: by the last batch
    element). ``fit.last_info["info"]`` (the old dict form) still returns the ``SolveInfo``
    with a :class:`DeprecationWarning`.

    Args:
        inner_loss: ``(params, hparams) -> scalar``.
        solver: linear solver (default ``hg.CG()``).
        engine: ``"reuse"`` or ``"recompute"``.
        stationarity: measure ``fit.last_info.stationarity`` in each backward (default True; one
            Hessian-vector product, as in :func:`~hypergrad.implicit_grad`); False skips it
            (NaN, nothing warns).

    Example:
        >>> import hypergrad as hg
        >>> X, y = torch.randn(20, 3, dtype=torch.float64), torch.randn(20, dtype=torch.float64)
        >>> inner = lambda w, lam: 0.5 * ((X @ w - y) ** 2).sum() + 0.5 * lam * (w ** 2).sum()
        >>> @hg.implicit(inner, solver=hg.CG(tol=1e-12))
        ... def fit(lam):
        ...     return torch.linalg.solve(X.T @ X + lam * torch.eye(3, dtype=X.dtype), X.T @ y)
        >>> lam = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
        >>> (fit(lam) ** 2).sum().backward()
        >>> lam.grad is not None, fit.last_info.solve.converged, fit.last_info.stationarity < 1e-12
        (True, True, True)
        >>> g = torch.func.grad(lambda lam: (fit(lam) ** 2).sum())(lam.detach())
        >>> torch.allclose(g, lam.grad)
        True
    """
    solver = check_solver(solver)
    check_engine(engine)
    measure = _check_flag(stationarity, "stationarity")
    gradient = GradientCondition(inner_loss, engine, measure)
    return decorate(stationary(inner_loss), solver, "@hg.implicit", gradient)
