"""Implicit differentiation: ``implicit_grad`` and the ``@implicit`` decorator.

At an inner solution ``psi*(theta) = argmin_psi L_in(psi, theta)`` the optimality condition
``dL_in/dpsi = 0`` gives, by the implicit function theorem,

    dL_out/dtheta = dL_out/dtheta|_direct - (d^2 L_in / dtheta dpsi) H^{-1} dL_out/dpsi,

with ``H = d^2 L_in / dpsi^2``. The linear system ``H x = dL_out/dpsi`` is solved by any solver
in :mod:`hypergrad.solvers`. The result is the gradient of the outer loss: put it in ``.grad`` and
step any optimizer that *minimises*.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import HypergradError, HypergradTypeError, HypergradValueError
from .operators import InnerOperator, check_scalar_loss
from .solvers import CG, SolveInfo, Solver
from .tree import (
    PyTree,
    Tensors,
    leaf_paths,
    tree_all_finite,
    tree_flatten,
    tree_norm,
    tree_unflatten,
)

Loss = Callable[[PyTree, PyTree], torch.Tensor]


@dataclass
class HypergradInfo:
    """Diagnostics of one hypergradient.

    Attributes:
        solve: the linear solver's :class:`~hypergrad.SolveInfo`.
        inner_loss: value of the inner loss at the given point.
        outer_loss: value of the outer loss.
        outer_grad_norm: ``||dL_out/dpsi||`` (the right-hand side).
        direct_norm: ``||dL_out/dtheta||`` through the explicit dependence.
        indirect_norm: ``||(d^2 L_in/dtheta dpsi) x||`` through the inner solution.
        hypergrad_norm: norm of the returned hypergradient (before any clipping).
        clipped: whether :class:`~hypergrad.HyperStep` clipped it.
        skipped, skip_reason: whether :class:`~hypergrad.HyperStep` (``on_diverged="skip"``)
            left ``.grad`` unwritten because the result was not a hypergradient, and why.
        time_s: wall time of the whole computation.
        extras: entry-point-specific details.
    """

    solve: SolveInfo
    inner_loss: float = float("nan")
    outer_loss: float = float("nan")
    outer_grad_norm: float = float("nan")
    direct_norm: float = float("nan")
    indirect_norm: float = float("nan")
    hypergrad_norm: float = float("nan")
    clipped: bool = False
    skipped: bool = False
    skip_reason: str | None = None
    time_s: float = 0.0
    extras: dict[str, Any] = field(default_factory=dict)


def check_leaves(leaves: list[torch.Tensor], names: list[str], what: str) -> None:
    """Raise on integer/complex tensors, non-leaf tensors and NaN/Inf values."""
    if not leaves:
        raise HypergradValueError(f"{what} is empty: it must contain at least one tensor")
    for t, n in zip(leaves, names):
        if not t.is_floating_point():
            kind = "complex" if t.is_complex() else "integer/bool"
            raise HypergradTypeError(
                f"{n} is a {kind} tensor ({t.dtype}); hypergradients need real floating-point "
                "tensors"
            )
        if t.grad_fn is not None:
            raise HypergradTypeError(
                f"{n} is a non-leaf tensor (it has a grad_fn {type(t.grad_fn).__name__}); pass "
                "detached values (.detach()) — a graph behind them would be cut silently"
            )
        if not tree_all_finite((t.detach(),)):
            raise HypergradValueError(f"{n} contains NaN or Inf")


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
                "params leaf by leaf (e.g. pass the previous info.extras['adjoint'], or cast "
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


def _fresh(leaves: list[torch.Tensor]) -> Tensors:
    return tuple(t.detach().requires_grad_(True) for t in leaves)


def _check_solver(solver: Any) -> Solver:
    if solver is None:
        return CG()
    if not hasattr(solver, "solve"):
        raise HypergradTypeError(
            "solver must be a hypergrad solver such as hg.CG(), hg.MINRES(), hg.Neumann(), "
            f"hg.Exact() or hg.Nystrom(), got {type(solver).__name__}"
        )
    return solver


def solve_adjoint(
    op: InnerOperator,
    b: Tensors,
    solver: Solver,
    x0: Tensors | None = None,
) -> tuple[Tensors, SolveInfo, list[torch.Tensor | None]]:
    """Solve ``H x = b`` and return ``x``, the solve info and ``mixed(x)``."""
    x, info = solver.solve(op.hvp, b, x0)
    if not tree_all_finite(x):
        info.diverged = True
        raise HypergradValueError(
            f"the {info.solver} solve produced NaN/Inf (residual {info.residual:.3g}); check the "
            "inner loss, add damping, or use another solver"
        )
    return x, info, op.mixed(x)


def hypergradient_core(
    inner: Callable[[Tensors, Tensors], torch.Tensor],
    outer: Callable[[Tensors, Tensors], torch.Tensor],
    psi: Tensors,
    theta: Tensors,
    solver: Solver,
    engine: str = "reuse",
    x0: Tensors | None = None,
    psi_names: list[str] | None = None,
    theta_names: list[str] | None = None,
    reduce: Callable[[Tensors], Tensors] | None = None,
) -> tuple[Tensors, HypergradInfo]:
    """The implicit hypergradient over flat leaves that already require grad.

    Shared by :func:`implicit_grad` and :class:`~hypergrad.HyperStep`. ``reduce`` (optional)
    post-processes the right-hand side and products, e.g. a distributed all-reduce.
    """
    t0 = time.perf_counter()
    theta_names = theta_names or [f"hparams[{i}]" for i in range(len(theta))]
    with torch.enable_grad():
        lo = check_scalar_loss(outer(psi, theta), "outer_loss")
        grads = torch.autograd.grad(lo, psi + theta, allow_unused=True)
    g_psi = tuple(torch.zeros_like(p) if g is None else g for g, p in zip(grads[: len(psi)], psi))
    g_theta = list(grads[len(psi) :])
    op = InnerOperator(inner, psi, theta, engine=engine, psi_names=psi_names)
    if reduce is not None:
        g_psi = reduce(g_psi)
        hvp = op.hvp
        op.hvp = lambda v: reduce(hvp(v))  # type: ignore[method-assign]
    x, sinfo, mixed = solve_adjoint(op, g_psi, solver, x0)
    unused = [n for n, m, d in zip(theta_names, mixed, g_theta) if m is None and d is None]
    if unused:
        raise HypergradError(
            f"{', '.join(unused)} influence neither the inner solution nor the outer loss: the "
            "hypergradient would be silently zero. Check that the inner loss uses these "
            "hyperparameters without detaching them"
        )
    direct = tuple(torch.zeros_like(t) if d is None else d.detach() for d, t in zip(g_theta, theta))
    indirect = tuple(torch.zeros_like(t) if m is None else m for m, t in zip(mixed, theta))
    if reduce is not None:
        direct, indirect = reduce(direct), reduce(indirect)
    hyper = tuple(d - m for d, m in zip(direct, indirect))
    if not tree_all_finite(hyper):
        raise HypergradValueError("the hypergradient contains NaN/Inf")
    info = HypergradInfo(
        solve=sinfo,
        inner_loss=op.loss_value,
        outer_loss=float(lo.detach()),
        outer_grad_norm=float(sinfo.extras.get("b_norm", tree_norm(g_psi))),
        direct_norm=float(tree_norm(direct)),
        indirect_norm=float(tree_norm(indirect)),
        hypergrad_norm=float(tree_norm(hyper)),
        time_s=time.perf_counter() - t0,
        extras={"adjoint": x},
    )
    return hyper, info


def implicit_grad(
    inner_loss: Loss,
    outer_loss: Loss,
    params: PyTree,
    hparams: PyTree,
    solver: Solver | None = None,
    engine: str = "reuse",
    x0: PyTree | None = None,
    distributed: str | None = None,
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
            call's ``info.extras["adjoint"]``, the adjoint solution it computed).
        distributed: None, ``"exact"`` or ``"local"`` (see :mod:`hypergrad.distributed`).

    Returns:
        ``(hypergrads, info)``: hypergrads has the structure of ``hparams``; ``info.solve`` is
        the solver's :class:`~hypergrad.SolveInfo`.

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
        >>> info.solve.converged
        True
    """
    if not callable(inner_loss):
        raise HypergradTypeError(f"inner_loss must be callable, got {type(inner_loss).__name__}")
    if not callable(outer_loss):
        raise HypergradTypeError(f"outer_loss must be callable, got {type(outer_loss).__name__}")
    solver = _check_solver(solver)
    p_leaves, p_spec = tree_flatten(params, "params")
    h_leaves, h_spec = tree_flatten(hparams, "hparams")
    p_names, h_names = leaf_paths(p_spec, "params"), leaf_paths(h_spec, "hparams")
    check_leaves(p_leaves, p_names, "params")
    check_leaves(h_leaves, h_names, "hparams")
    x0_leaves = None if x0 is None else check_warm_start(x0, p_leaves, p_spec, p_names)
    psi, theta = _fresh(p_leaves), _fresh(h_leaves)

    def inner(ps: Tensors, hs: Tensors) -> torch.Tensor:
        return inner_loss(tree_unflatten(p_spec, ps), tree_unflatten(h_spec, hs))

    def outer(ps: Tensors, hs: Tensors) -> torch.Tensor:
        return outer_loss(tree_unflatten(p_spec, ps), tree_unflatten(h_spec, hs))

    reduce = None
    if distributed is not None:
        from .distributed import make_reducer

        reduce = make_reducer(distributed)
    hyper, info = hypergradient_core(
        inner, outer, psi, theta, solver, engine, x0_leaves, p_names, h_names, reduce
    )
    if distributed == "local":
        from .distributed import all_reduce_mean

        hyper = all_reduce_mean(hyper)
    # the adjoint solution x = H^-1 dL_out/dpsi, shaped like params: pass it as x0 next time
    info.extras["adjoint"] = tree_unflatten(p_spec, list(info.extras["adjoint"]))
    return tree_unflatten(h_spec, list(hyper)), info


@dataclass
class _ImplicitProblem:
    """What the autograd functions of one ``@implicit`` call share (not a tensor: never batched)."""

    fit: Callable[[PyTree], PyTree]
    inner_loss: Loss
    solver: Solver
    engine: str
    h_spec: Any
    h_names: list[str]
    box: dict[str, Any]


def _unbatch(args: tuple[Any, ...], in_dims: tuple[Any, ...], i: int) -> list[Any]:
    """Slice ``i`` of every batched argument (``in_dims`` as given to a ``vmap`` staticmethod)."""
    return [a if d is None else a.select(d, i) for a, d in zip(args, in_dims)]


def _stack(rows: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    return tuple(torch.stack(col) for col in zip(*rows))


class _ImplicitFn(torch.autograd.Function):
    """``hparams leaves -> fit(hparams) leaves`` with the implicit VJP as its backward.

    Written in the ``setup_context`` style so that ``torch.func`` transforms can run it; the
    ``vmap`` rule loops over the batch (one inner solve per batch element).
    """

    @staticmethod
    def forward(prob: _ImplicitProblem, *hs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with torch.no_grad():
            out = prob.fit(tree_unflatten(prob.h_spec, [h.detach() for h in hs]))
        o_leaves, o_spec = tree_flatten(out, f"result of {getattr(prob.fit, '__name__', 'fit')}")
        names = leaf_paths(o_spec, "result")
        for t, n in zip(o_leaves, names):
            if not t.is_floating_point():
                raise HypergradTypeError(f"{n} must be floating point, got {t.dtype}")
        prob.box["spec"], prob.box["names"] = o_spec, names
        return tuple(t.detach().clone() for t in o_leaves)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
        prob, hs = inputs[0], inputs[1:]
        ctx.prob, ctx.n_out = prob, len(output)
        ctx.save_for_backward(*output, *hs)

    @staticmethod
    def backward(ctx: Any, *cots: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        saved = ctx.saved_tensors
        psi, theta = saved[: ctx.n_out], saved[ctx.n_out :]
        b = tuple(torch.zeros_like(p) if c is None else c for c, p in zip(cots, psi))
        needs = tuple(ctx.needs_input_grad[1:])
        mixed = _AdjointVJP.apply(ctx.prob, needs, len(b), *b, *psi, *theta)
        return (None, *(-m for m in mixed))

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[Any, ...], prob: _ImplicitProblem, *hs: torch.Tensor
    ) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:
        rows = [
            _ImplicitFn.apply(prob, *_unbatch(hs, in_dims[1:], i)) for i in range(info.batch_size)
        ]
        outs = _stack(rows)
        return outs, (0,) * len(outs)


class _AdjointVJP(torch.autograd.Function):
    """``(b, psi, theta) -> mixed(H^{-1} b)``: the adjoint solve of ``@implicit``'s backward.

    A function of its own so that the Hessian-vector products (plain ``torch.autograd`` on fresh
    detached leaves) run below any ``torch.func`` transform; its ``vmap`` rule loops over the
    batch, so ``jacrev`` (a ``vmap`` over cotangents) does one adjoint solve per output element.
    Differentiating it again (second-order hypergradients) is not supported.
    """

    @staticmethod
    def forward(
        prob: _ImplicitProblem, needs: tuple[bool, ...], n_out: int, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        b = tuple(t.detach() for t in tensors[:n_out])
        psi, theta = _fresh(list(tensors[n_out : 2 * n_out])), _fresh(list(tensors[2 * n_out :]))
        spec, h_spec, inner_loss = prob.box["spec"], prob.h_spec, prob.inner_loss

        def inner(ps: Tensors, hs: Tensors) -> torch.Tensor:
            return inner_loss(tree_unflatten(spec, ps), tree_unflatten(h_spec, hs))

        op = InnerOperator(inner, psi, theta, engine=prob.engine, psi_names=prob.box["names"])
        _, info, mixed = solve_adjoint(op, b, prob.solver)
        prob.box["info"] = info
        unused = [n for n, m, need in zip(prob.h_names, mixed, needs) if m is None and need]
        if unused:
            raise HypergradError(
                f"inner_loss does not depend on {', '.join(unused)}: the gradient "
                "through the inner solution would be silently zero"
            )
        return tuple(torch.zeros_like(t) if m is None else m for m, t in zip(mixed, theta))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, ...]:
        raise HypergradError(
            "@hg.implicit supports first-order derivatives only: differentiating its backward "
            "again (e.g. a Hessian w.r.t. the hyperparameters) is not implemented"
        )

    @staticmethod
    def vmap(
        info: Any,
        in_dims: tuple[Any, ...],
        prob: _ImplicitProblem,
        needs: tuple[bool, ...],
        n_out: int,
        *tensors: torch.Tensor,
    ) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:
        rows = [
            _AdjointVJP.apply(prob, needs, n_out, *_unbatch(tensors, in_dims[3:], i))
            for i in range(info.batch_size)
        ]
        outs = _stack(rows)
        return outs, (0,) * len(outs)


def _bind_hparams(
    fit: Callable[..., PyTree], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[PyTree, Callable[[PyTree], PyTree]]:
    """Split a call of ``fit`` into its hyperparameters (first parameter) and the rest.

    The hyperparameters may be passed positionally or by keyword (by the name of ``fit``'s first
    parameter, or as ``hparams=``). Returns them and ``h -> fit(...)`` with them replaced by ``h``.
    """
    try:
        params = list(inspect.signature(fit).parameters.values())
    except (TypeError, ValueError):  # builtins and the like: fall back to positional
        params = []
    first = params[0] if params else None
    named = first is not None and first.kind in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.KEYWORD_ONLY,
    )
    if named and not args and first.name in kwargs:
        rest = dict(kwargs)
        hparams = rest.pop(first.name)
        return hparams, lambda h: fit(*args, **{first.name: h}, **rest)
    if not args and "hparams" in kwargs:
        rest = dict(kwargs)
        hparams = rest.pop("hparams")
        if named and first.kind is inspect.Parameter.KEYWORD_ONLY:
            return hparams, lambda h: fit(**{first.name: h}, **rest)
        return hparams, lambda h: fit(h, **rest)
    if not args:
        raise HypergradTypeError(
            f"{getattr(fit, '__name__', 'fit')} needs its hyperparameters: pass them as the first "
            "positional argument or by the name of its first parameter"
        )
    return args[0], lambda h: fit(h, *args[1:], **kwargs)


def implicit(
    inner_loss: Loss,
    solver: Solver | None = None,
    engine: str = "reuse",
) -> Callable[[Callable[..., PyTree]], Callable[..., PyTree]]:
    """Decorator making an inner solver differentiable by implicit differentiation.

    The decorated function ``fit(hparams, *args, **kwargs)`` returns ``params`` approximately
    minimising ``inner_loss(params, hparams)``; it runs without autograd. Gradients flowing into
    its output are mapped to ``hparams`` by solving the adjoint system at the returned point, so
    ``outer(fit(hparams, ...)).backward()`` fills ``hparams.grad`` with the hypergradient (plus any
    direct dependence of the outer loss on ``hparams``, handled by ordinary autograd).

    The hyperparameters are ``fit``'s first parameter; they may be passed positionally or by
    keyword (``fit(lam=...)`` for ``def fit(lam, ...)``, or ``fit(hparams=...)``). Only they are
    differentiated: the other arguments are constants.

    The decorated function composes with ``torch.func``: ``torch.func.grad`` of an outer loss
    w.r.t. ``hparams``, ``torch.func.jacrev`` / ``vjp`` of the solution map, and
    ``torch.func.vmap`` over a batch of hyperparameters. ``vmap`` runs one inner solve per batch
    element (a Python loop), and ``jacrev`` one adjoint solve per output element. Only
    first-order derivatives are supported (no ``jacrev(jacrev(fit))`` or ``jvp``).

    Args:
        inner_loss: ``(params, hparams) -> scalar``.
        solver: linear solver (default ``hg.CG()``).
        engine: ``"reuse"`` or ``"recompute"``.

    Example:
        >>> import hypergrad as hg
        >>> X, y = torch.randn(20, 3, dtype=torch.float64), torch.randn(20, dtype=torch.float64)
        >>> inner = lambda w, lam: 0.5 * ((X @ w - y) ** 2).sum() + 0.5 * lam * (w ** 2).sum()
        >>> @hg.implicit(inner, solver=hg.CG(tol=1e-12))
        ... def fit(lam):
        ...     return torch.linalg.solve(X.T @ X + lam * torch.eye(3, dtype=X.dtype), X.T @ y)
        >>> lam = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
        >>> (fit(lam) ** 2).sum().backward()
        >>> lam.grad is not None
        True
        >>> g = torch.func.grad(lambda lam: (fit(lam) ** 2).sum())(lam.detach())
        >>> torch.allclose(g, lam.grad)
        True
    """
    solver = _check_solver(solver)

    def decorator(fit: Callable[..., PyTree]) -> Callable[..., PyTree]:
        @functools.wraps(fit)
        def wrapped(*args: Any, **kwargs: Any) -> PyTree:
            hparams, call = _bind_hparams(fit, args, kwargs)
            h_leaves, h_spec = tree_flatten(hparams, "hparams")
            h_names = leaf_paths(h_spec, "hparams")
            for t, n in zip(h_leaves, h_names):
                if not t.is_floating_point():
                    raise HypergradTypeError(f"{n} must be a floating-point tensor, got {t.dtype}")
            box: dict[str, Any] = {}
            prob = _ImplicitProblem(call, inner_loss, solver, engine, h_spec, h_names, box)
            outs = _ImplicitFn.apply(prob, *h_leaves)
            result = tree_unflatten(box["spec"], list(outs))
            wrapped.last_info = box  # type: ignore[attr-defined]
            return result

        return wrapped

    return decorator
