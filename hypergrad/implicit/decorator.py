"""The decorators: :func:`custom_root`, :func:`custom_fixed_point` and :func:`implicit` (which
is ``custom_root(stationary(inner_loss))`` with a gradient linearization), over one family of
autograd functions: :class:`_RootFn` (solution), :class:`_RootVJP` (reverse-mode solve) and
:class:`_RootJVP` (forward-mode solve)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..conditions import Condition, as_condition, stationary
from ..conditions import fixed_point as _fixed_point
from ..errors import (
    HypergradError,
    HypergradTypeError,
    HypergradValueError,
)
from ..operators import check_engine
from ..report import HypergradInfo, Loss, check_solver, explain_dtype_errors, fresh
from ..solvers import Solver
from ..tree import (
    PyTree,
    Tensors,
    leaf_paths,
    tree_flatten,
    tree_unflatten,
)
from .adjoint import pick_solver, solve_forward, solve_reverse
from .calls import bind_hparams, closure_leaves, outside_transforms, refuse_differentiable_constants
from .functional import check_flag
from .linearization import ConditionLinearization, GradientLinearization, Linearization, Map


@dataclass
class _RootProblem:
    """What the autograd functions of one decorated call share (not a tensor: never batched).

    ``out_spec`` and ``out_names`` (the structure of the solver's result) are filled in by the
    forward; ``report`` receives the :class:`~hypergrad.HypergradInfo` of each derivative.
    """

    solve: Callable[[PyTree], PyTree]
    cond: Condition
    solver: Solver
    h_spec: Any
    h_names: list[str]
    report: Callable[[HypergradInfo], None]
    out_spec: Any = None
    out_names: list[str] = field(default_factory=list)
    #: the solution, when the decorator solved before the autograd function (to look for
    #: captured tensors); the forward then returns it instead of solving again
    cached: Tensors | None = None
    #: tensors requiring grad that the condition reaches by closure, inputs of the function
    #: after the hyperparameters' leaves
    captured: Tensors = ()
    #: ``@hg.implicit``: the inner loss whose gradient is the condition, linearized by
    #: :class:`GradientLinearization` with this engine (None: the condition itself)
    inner_loss: Loss | None = None
    engine: str = "reuse"
    measure: bool = True
    #: how messages name the solver's result
    result_name: str = "params"

    def explain(self, x: Tensors, theta: Tensors) -> contextlib.AbstractContextManager[None]:
        """Around a derivative: torch's dtype errors from an inner loss of mixed dtypes become a
        :class:`~hypergrad.HypergradTypeError` naming the leaves (a condition checks its own
        output's dtypes)."""
        if self.inner_loss is None:
            return contextlib.nullcontext()
        return explain_dtype_errors([(x, self.out_names), (theta, self.h_names)])

    def linearize(self, x: Tensors, theta: Tensors) -> Linearization:
        n_h = len(self.h_names)
        if self.inner_loss is not None:
            return GradientLinearization.of_loss(
                self.cond,
                self.inner_loss,
                self.engine,
                self.measure,
                x,
                theta[:n_h],
                self.out_spec,
                self.h_spec,
                self.out_names,
                self.h_names,
                self.captured,
            )
        return ConditionLinearization(
            self.cond,
            x,
            theta[:n_h],
            self.out_spec,
            self.h_spec,
            self.out_names,
            self.h_names,
            self.captured,
        )

    def run_solve(self, hs: Tensors) -> Tensors:
        """The solver's result for the hyperparameter leaves ``hs`` (without autograd), checked
        and flattened; records its structure."""
        if self.cached is not None:
            return self.cached
        with torch.no_grad():
            out = self.solve(tree_unflatten(self.h_spec, [h.detach() for h in hs]))
        o_leaves, o_spec = tree_flatten(
            out, f"result of {getattr(self.solve, '__name__', 'solve')}"
        )
        names = leaf_paths(o_spec, self.result_name)
        for t, n in zip(o_leaves, names):
            if not t.is_floating_point():
                raise HypergradTypeError(
                    f"{n} (the solution) must be floating point, got {t.dtype}"
                )
        self.out_spec, self.out_names = o_spec, names
        return tuple(t.detach() for t in o_leaves)

    def find_captured(self, x: Tensors, hs: Tensors) -> Tensors:
        """The tensors requiring grad that ``F`` reaches by closure (one evaluation of ``F``, or
        of the inner loss for ``@hg.implicit``: its gradient reaches nothing else)."""
        xs, ts = fresh(x), fresh(hs)
        fn = self.cond if self.inner_loss is None else self.inner_loss
        try:
            with torch.enable_grad():
                out = fn(
                    tree_unflatten(self.out_spec, list(xs)), tree_unflatten(self.h_spec, list(ts))
                )
            leaves, _ = tree_flatten(out, f"result of {self.cond.name}")
        except Exception:  # noqa: BLE001  the derivative evaluates F again and explains the error
            return ()
        return closure_leaves(leaves, xs + ts)


def _unbatch(args: tuple[Any, ...], in_dims: tuple[Any, ...], i: int) -> list[Any]:
    return [a if d is None else a.select(d, i) for a, d in zip(args, in_dims)]


def _stack(rows: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    return tuple(torch.stack(col) for col in zip(*rows))


class _RootFn(torch.autograd.Function):
    """``hparams leaves -> root leaves``, differentiated implicitly in both modes.

    ``backward`` (reverse mode) and ``jvp`` (forward mode) hand the linear solves to
    :class:`_RootVJP` / :class:`_RootJVP`, functions of their own so that their autograd work runs
    below any ``torch.func`` transform and their ``vmap`` rules loop (``jacrev``, ``jacfwd``).
    """

    @staticmethod
    def forward(prob: _RootProblem, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # inputs: the hyperparameters' leaves, then the captured tensors
        return tuple(t.clone() for t in prob.run_solve(inputs[: len(prob.h_names)]))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
        prob, hs = inputs[0], inputs[1:]
        ctx.prob, ctx.n_out = prob, len(output)
        ctx.save_for_backward(*output, *hs)
        ctx.save_for_forward(*output, *hs)

    @staticmethod
    def backward(ctx: Any, *cots: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        saved = ctx.saved_tensors
        x, theta = saved[: ctx.n_out], saved[ctx.n_out :]
        b = tuple(torch.zeros_like(p) if c is None else c for c, p in zip(cots, x))
        needs = tuple(ctx.needs_input_grad[1:])
        out = _RootVJP.apply(ctx.prob, needs, len(b), *b, *x, *theta)
        return (None, *out)

    @staticmethod
    def jvp(
        ctx: Any, _prob_tangent: Any, *tangents: torch.Tensor | None
    ) -> tuple[torch.Tensor, ...]:
        saved = ctx.saved_tensors
        n_h = len(ctx.prob.h_names)
        if any(t is not None for t in tangents[n_h:]):
            raise HypergradError(
                f"forward mode through tensors that {ctx.prob.cond.name} reaches by closure is "
                "not supported: pass them in the hyperparameters (the first argument)"
            )
        tangents = tangents[:n_h]
        x, theta = saved[: ctx.n_out], saved[ctx.n_out : ctx.n_out + n_h]
        given = tuple(t is not None for t in tangents)
        filled = tuple(torch.zeros_like(h) if t is None else t for t, h in zip(tangents, theta))
        out: tuple[torch.Tensor, ...] = _RootJVP.apply(
            ctx.prob, given, ctx.n_out, *filled, *x, *theta
        )
        return out

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[Any, ...], prob: _RootProblem, *hs: torch.Tensor
    ) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:
        rows = [_RootFn.apply(prob, *_unbatch(hs, in_dims[1:], i)) for i in range(info.batch_size)]
        outs = _stack(rows)
        return outs, (0,) * len(outs)


def _first_order_only(*_: Any) -> Any:
    raise HypergradError(
        "@hg.implicit, custom_root and custom_fixed_point support first-order derivatives only: "
        "differentiating their derivative again (e.g. a Hessian w.r.t. the hyperparameters) is "
        "not implemented"
    )


class _SolveFn(torch.autograd.Function):
    """What the two solve functions share: arguments ``(prob, flags, n_out, *tensors)``, no
    saved state, no second derivative, and a ``vmap`` rule that loops over the batch (one solve
    per element: ``jacrev`` / ``jacfwd``)."""

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, ...]:
        _first_order_only()
        return ()  # pragma: no cover

    @classmethod
    def vmap(
        cls,
        info: Any,
        in_dims: tuple[Any, ...],
        prob: _RootProblem,
        flags: tuple[bool, ...],
        n_out: int,
        *tensors: torch.Tensor,
    ) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:
        rows = [
            cls.apply(prob, flags, n_out, *_unbatch(tensors, in_dims[3:], i))
            for i in range(info.batch_size)
        ]
        outs = _stack(rows)
        return outs, (0,) * len(outs)


class _RootVJP(_SolveFn):
    """``(v, x, θ) -> −Bᵀ u`` with ``Aᵀ u = v``: the reverse-mode solve."""

    @staticmethod
    def forward(
        prob: _RootProblem, needs: tuple[bool, ...], n_out: int, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        v = tuple(t.detach() for t in tensors[:n_out])
        x, theta = tensors[n_out : 2 * n_out], tensors[2 * n_out :]
        with prob.explain(x, theta):
            out, info = solve_reverse(prob.linearize(x, theta), v, prob.solver, needs)
        info.extras["adjoint"] = tree_unflatten(prob.out_spec, list(info.extras["adjoint"]))
        prob.report(info)
        return out


class _RootJVP(_SolveFn):
    """``(t, x, θ) -> w`` with ``A w = −B t``: the forward-mode solve."""

    @staticmethod
    def forward(
        prob: _RootProblem, given: tuple[bool, ...], n_out: int, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        n_h = len(given)
        t = tuple(a.detach() if g else None for a, g in zip(tensors[:n_h], given))
        lin = prob.linearize(tensors[n_h : n_h + n_out], tensors[n_h + n_out :])
        w, info = solve_forward(lin, t, prob.solver)
        info.extras["tangent"] = tree_unflatten(prob.out_spec, list(w))
        prob.report(info)
        return w


@dataclass(frozen=True)
class GradientCondition:
    """What ``@hg.implicit`` adds to ``custom_root(stationary(inner_loss))``: the inner loss
    itself, linearized through :class:`~hypergrad.operators.InnerOperator` with ``engine``, and
    whether to measure the stationarity (one product per derivative)."""

    inner_loss: Loss
    engine: str = "reuse"
    measure: bool = True


def decorate(
    cond: Condition, solver: Solver | None, what: str, gradient: GradientCondition | None = None
) -> Callable[[Callable[..., PyTree]], Callable[..., PyTree]]:
    """The decorator of :func:`custom_root`, :func:`custom_fixed_point` and (with ``gradient``)
    :func:`hypergrad.implicit`: one autograd function family for all three."""
    slv = pick_solver(solver, cond)

    def decorator(solve: Callable[..., PyTree]) -> Callable[..., PyTree]:
        if not callable(solve):
            raise HypergradTypeError(f"the decorated solver must be callable, got {solve!r}")
        the_cond, extra = cond, dict[str, Any]()
        if gradient is not None:
            name = f"the inner_loss of @hg.implicit {getattr(solve, '__qualname__', 'fit')}"
            the_cond = Condition(cond.fn, cond.kind, cond.symmetric, name)
            extra = dict(
                inner_loss=gradient.inner_loss,
                engine=gradient.engine,
                measure=gradient.measure,
                result_name="result",
            )

        def report(info: HypergradInfo) -> None:
            wrapped.last_info = info  # type: ignore[attr-defined]

        @functools.wraps(solve)
        def wrapped(*args: Any, **kwargs: Any) -> PyTree:
            hparams, call = bind_hparams(solve, args, kwargs)
            if torch.is_grad_enabled():
                refuse_differentiable_constants(solve, args, kwargs, hparams, what)
            # numbers and None in hparams are constants (e.g. projection_box's (0.0, None))
            h_leaves, h_spec = tree_flatten(hparams, "hparams", static=True)
            h_names = leaf_paths(h_spec, "hparams")
            if not h_leaves:
                raise HypergradValueError("hparams is empty: it must contain at least one tensor")
            for t, n in zip(h_leaves, h_names):
                if not t.is_floating_point():
                    raise HypergradTypeError(f"{n} must be a floating-point tensor, got {t.dtype}")
            prob = _RootProblem(call, the_cond, slv, h_spec, h_names, report, **extra)
            if torch.is_grad_enabled() and outside_transforms():
                # solve first, then look for tensors the condition reaches by closure: they
                # become inputs of the function, so they get their gradients too
                prob.cached = prob.run_solve(tuple(h_leaves))
                prob.captured = prob.find_captured(prob.cached, tuple(h_leaves))
            outs = _RootFn.apply(prob, *h_leaves, *prob.captured)
            prob.cached = None
            return tree_unflatten(prob.out_spec, list(outs))

        wrapped.last_info = None  # type: ignore[attr-defined]
        return wrapped

    return decorator


def custom_root(
    optimality_fn: Map | Condition, *, solver: Solver | None = None
) -> Callable[[Callable[..., PyTree]], Callable[..., PyTree]]:
    """Decorator: a solver of ``optimality_fn(params, hparams) = 0``, differentiated implicitly.

    The decorated ``solve(hparams, *args, **kwargs)`` runs without autograd and returns the root
    ``params`` (a pytree); ``optimality_fn(params, hparams)`` returns a pytree like ``params``,
    zero at the root (other data reaches it by closure). Gradients flowing into the root reach
    ``hparams`` through the transposed system ``(∂F/∂params)ᵀ u = v`` (reverse mode:
    ``.backward()``, ``torch.func.grad``/``vjp``/``jacrev``), tangents through
    ``(∂F/∂params) w = −(∂F/∂hparams) t`` (forward mode: ``torch.func.jvp``/``jacfwd``,
    ``torch.autograd.forward_ad``); ``torch.func.vmap`` runs one solve per batch element. Only
    first-order derivatives are supported. ``hparams`` is ``solve``'s first parameter, passed
    positionally or by keyword, as for :func:`~hypergrad.implicit`.

    ``@hg.implicit(inner_loss)`` is ``custom_root(hg.conditions.stationary(inner_loss))``.

    Diagnostics: ``solve.last_info`` is the :class:`~hypergrad.HypergradInfo` of the most recent
    derivative (None before the first): ``.solve`` the linear solve, ``.stationarity`` how far
    the returned point is from the root (a :class:`~hypergrad.NonStationaryWarning` above
    :data:`hypergrad.conditions.STATIONARITY_THRESHOLD`), ``.extras["adjoint"]`` /
    ``["tangent"]``.

    Args:
        optimality_fn: ``F(params, hparams)``, a callable or a
            :class:`hypergrad.conditions.Condition`.
        solver: linear solver (default ``hg.GMRES()``; ``hg.CG()`` for a symmetric condition).
            Symmetric-only solvers on a non-symmetric condition are refused (module docs).

    Example (the root of ``F(x, θ) = A x + θ ⊙ x³ − b``, found by Newton's method):
        >>> import hypergrad as hg
        >>> A = torch.tensor([[3.0, 1.0], [-1.0, 2.0]], dtype=torch.float64)
        >>> b = torch.tensor([1.0, 1.0], dtype=torch.float64)
        >>> F = lambda x, th: A @ x + th * x**3 - b
        >>> @hg.custom_root(F, solver=hg.Exact())
        ... def solve(th):
        ...     x = torch.zeros(2, dtype=torch.float64)
        ...     for _ in range(30):
        ...         x = x - torch.linalg.solve(A + torch.diag(3 * th * x**2), F(x, th))
        ...     return x
        >>> th = torch.tensor([0.5, 0.2], dtype=torch.float64, requires_grad=True)
        >>> solve(th).sum().backward()
        >>> th.grad.shape, solve.last_info.stationarity < 1e-12
        (torch.Size([2]), True)
        >>> J = torch.func.jacrev(solve)(th.detach())
        >>> torch.allclose(J.sum(0), th.grad)
        True
    """
    return decorate(as_condition(optimality_fn), solver, "@hg.custom_root")


def custom_fixed_point(
    fixed_point_fn: Map, *, solver: Solver | None = None
) -> Callable[[Callable[..., PyTree]], Callable[..., PyTree]]:
    """Decorator: a solver of ``params = fixed_point_fn(params, hparams)``, differentiated
    implicitly.

    :func:`custom_root` of ``F = params − T(params, hparams)``
    (:func:`hypergrad.conditions.fixed_point`): the reverse-mode system is
    ``(I − ∂T/∂params)ᵀ u = v``. ``info.stationarity`` is ``||T(x) − x|| / ||x||``. For a
    contraction ``T``, ``hg.Neumann(alpha=1.0, maxiter=...)`` is the adjoint fixed-point
    iteration; the default is ``hg.GMRES()``. Proximal and projected gradient descent:
    :func:`hypergrad.conditions.proximal_gradient`, :func:`hypergrad.conditions.projected_gradient`.

    Args:
        fixed_point_fn: ``T(params, hparams) -> pytree like params``.
        solver: linear solver (default ``hg.GMRES()``).

    Example (a DEQ-like layer ``z = tanh(W z + x)``, solved by iteration):
        >>> import hypergrad as hg
        >>> W = 0.3 * torch.eye(3, dtype=torch.float64).roll(1, 0)
        >>> T = lambda z, x: torch.tanh(W @ z + x)
        >>> @hg.custom_fixed_point(T, solver=hg.Exact())
        ... def layer(x):
        ...     z = torch.zeros_like(x)
        ...     for _ in range(100):
        ...         z = T(z, x)
        ...     return z
        >>> x = torch.tensor([0.1, -0.2, 0.3], dtype=torch.float64, requires_grad=True)
        >>> layer(x).sum().backward()
        >>> layer.last_info.solve.converged, layer.last_info.stationarity < 1e-12
        (True, True)
    """
    if isinstance(fixed_point_fn, Condition) or not callable(fixed_point_fn):
        raise HypergradTypeError(
            f"fixed_point_fn must be a map T(params, hparams), got {type(fixed_point_fn).__name__}"
        )
    return decorate(_fixed_point(fixed_point_fn), solver, "@hg.custom_fixed_point")


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
    element).

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
    measure = check_flag(stationarity, "stationarity")
    gradient = GradientCondition(inner_loss, engine, measure)
    return decorate(stationary(inner_loss), solver, "@hg.implicit", gradient)
