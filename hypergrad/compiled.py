"""``compile_implicit_grad``: the implicit hypergradient as ``torch.func`` code, compiled.

:func:`~hypergrad.implicit_grad` runs eagerly: every Hessian-vector product is an
``autograd.grad`` call and every solver step a few small tensor operations, each paying
Python and dispatcher overhead (tens of microseconds). On a problem with tens of unknowns that
overhead is nearly all of the time. This module writes the same computation with
``torch.func`` (``grad``, ``vjp``, ``jacrev``) so that ``torch.compile`` can trace it into one
or a few fused graphs.

Small problems (CG and Neumann on at most :data:`DENSE_MAX` unknowns, and
:class:`~hypergrad.Exact`) are one graph: the outer loss's gradients (the right-hand side ``b``
and the direct term), the inner Hessian as a dense matrix (one ``jacrev``: a ``vmap``-ed product
over the unit vectors), the solve on it, and the epilogue (*finish*: the residual
``||(H + damping I) x - b|| / ||b||`` recomputed from ``x`` with one Hessian-vector product, as
the eager solvers verify ``converged``, and the mixed term). CG's and Neumann's iterations there
are a loop (``torch._higher_order_ops.while_loop``) whose body is traced and compiled once,
whatever ``maxiter``, and which stops at the stopping test: one host sync per call. Exact solves
by float64 LU.

Larger CG and Neumann solves use Hessian-vector products in three graphs:

* *start*: ``b``, the direct term, the starting residual and the solver's state;
* a *chunk* of :data:`CHUNK` unrolled iterations, called until the solve stops (one host sync
  per chunk); an iteration that would run after the stopping test is masked, so the chunk size
  never changes the answer. Each chunk rebuilds the inner gradient's linearisation once (one
  extra forward and backward per chunk compared with the eager ``"reuse"`` engine);
* *finish*, as above; with ``maxiter <= CHUNK`` the three run as one graph.

Each graph is compiled on its first call for given shapes and dtypes
(``info.extras["first_call"]`` is True and its ``time_s`` includes the compilation), with
``fullgraph=True``, ``dynamic=False`` and the options of :func:`compile_options` (on the CPU,
``cpp_wrapper``: one C++ compiler run per graph instead of one per kernel). Compiling costs
tens of seconds on a cold cache, seconds on a warm one; ``compile="auto"`` answers the calls
eagerly until they have taken ``compile_after`` seconds. The measured first-call times and the
number of calls after which compiling pays off are in ``docs/performance.md`` ("First call").
The first compiled call for new shapes also runs :func:`~hypergrad.implicit_grad` once, eagerly,
to apply its input checks (NaN/Inf, non-leaf tensors, hyperparameters that influence nothing)
with the same error messages. Every instance compiles its own copy of the graph code (see
:func:`_own_code`).

Differences from :func:`~hypergrad.implicit_grad`: no restart of CG when the recurrence residual
and the recomputed one disagree (the recomputed residual still decides ``converged``); the
Neumann step ``alpha`` must be given (no power iteration); ``Exact`` computes no condition
number: when LU meets a zero pivot, misses the residual ``1e-6``, or ``||A||_1 ||A^-1 v||_1 /
||v||_1`` for ``v`` = ``b`` and two fixed probes (a lower bound on the condition number)
reaches ``ILL_CONDITIONED``, that call is
answered by the eager solve (``extras["compiled_fallback"]``; the pseudo-inverse and its
report). CG's tests for singular systems (its best iterate included) and Neumann's stall test
are the eager ones, so ``info.solve.failure`` and the warnings agree; no preconditioner, no
``engine="recompute"``, no ``distributed``; MINRES and Nystrom are not available. On the dense
path CG's and Neumann's products are ``v @ H`` with the dense ``H`` rather than Hessian-vector
products: the same numbers to rounding (CG stopped far from convergence on an ill-conditioned
system can amplify that rounding, as it amplifies the eager solver's). ``compile=False`` runs
the same functional code eagerly (for debugging a loss that does not trace).
"""

from __future__ import annotations

import functools
import itertools
import time
import types
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch._higher_order_ops import while_loop
from torch.func import grad, grad_and_value, jacrev, vjp

from ._core import HypergradInfo, Loss
from .errors import HypergradTypeError, HypergradValueError
from .implicit import check_warm_start, implicit_grad
from .solvers import CG, Exact, Neumann, SolveInfo, Solver
from .solvers.base import report_failure, warn_diverged, warn_singular
from .solvers.exact import ILL_CONDITIONED
from .solvers.krylov import default_maxiter, singular_limits
from .solvers.neumann import growth_hint, growth_tol, stall_floor
from .tree import PyTree, Tensors, leaf_paths, tree_flatten, tree_unflatten

#: Iterations per compiled CG/Neumann chunk (one host sync each).
CHUNK = 16

#: CG and Neumann on at most this many unknowns run on the dense Hessian (one ``jacrev``, then
#: ``v @ mat`` per iteration) in one graph whose iterations are a loop compiled once; above it,
#: on Hessian-vector products in chunks of :data:`CHUNK` unrolled iterations. Measured on ridge
#: problems (CG, K = 20, ``max(2n, 300)`` rows; docs/performance.md, "First call"): a compiled
#: call on the dense Hessian takes 0.53x the CPU time of the chunked one at n = 30, 0.51x at 128,
#: 1.03x at 256 and 1.57x at 512 (building the Hessian costs ``n`` products; an earlier run:
#: 0.50x, 0.56x, 0.91x, 1.45x), and compiles in a fraction of the time at every n.
DENSE_MAX = 256

_instances = itertools.count()


def _own_code(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` (bound) rebuilt on a copy of its code object.

    ``torch.compile`` caches compiled graphs per code object, guarded on the objects the code
    touches. Without a copy, every ``compile_implicit_grad`` in a process would share one cache
    per method: each new instance adds an entry (a recompilation), every call walks the guards of
    all of them, and after ``torch._dynamo.config.recompile_limit`` entries (8) the method runs
    eagerly, slowly and with only a log message. A copy gives each instance its own cache.
    """
    func = method.__func__  # type: ignore[attr-defined]
    code = func.__code__.replace(co_name=f"{func.__name__}_{next(_instances)}")
    own = types.FunctionType(code, func.__globals__, code.co_name, func.__defaults__)
    return types.MethodType(own, method.__self__)  # type: ignore[attr-defined]


FlatLoss = Callable[[Tensors, Tensors], torch.Tensor]


class Stats(NamedTuple):
    """The scalars every graph returns, by name.

    A graph returns them as one float64 vector (one host sync), stacked in the order of these
    fields by :func:`_stats` and read back with ``Stats(*vector.tolist())``: producer and
    consumer share this one tuple of names, so reordering or adding a field cannot mislabel a
    diagnostic. A statistic a solver does not produce is 0.
    """

    residual: float  # ||(H + damping I) x - b||
    b_norm: float  # ||b||, the outer loss's gradient w.r.t. params
    hypergrad_norm: float
    indirect_norm: float  # the mixed term
    direct_norm: float
    finite: float  # 1.0 when the hypergradient is finite
    outer_loss: float
    inner_loss: float
    singular: float  # CG: 1 curvature test, 2 growth test; Exact: LU's error code
    iterations: float
    flag: float  # CG: negative curvature; Neumann: a term grew
    last_term: float  # Neumann: the last term's norm
    ratio: float  # Neumann: its ratio to the one before (-1 before the first step)
    condition_bound: float  # Exact: a lower bound on the 1-norm condition number


def _stats(**named: torch.Tensor) -> torch.Tensor:
    """``named`` scalars stacked as a float64 vector in the order of :class:`Stats` (missing
    ones 0); an unknown name raises."""
    unknown = set(named) - set(Stats._fields)
    if unknown:
        raise KeyError(f"not a field of Stats: {sorted(unknown)}")
    zero = torch.zeros((), dtype=torch.float64, device=named["residual"].device)
    return torch.stack([named[k].double() if k in named else zero for k in Stats._fields])


def _acc(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _dot(a: Tensors, b: Tensors) -> torch.Tensor:
    return sum((x.to(_acc(x)) * y.to(_acc(x))).sum() for x, y in zip(a, b))  # type: ignore[return-value]


def _axpy(alpha: float | torch.Tensor, x: Tensors, y: Tensors) -> Tensors:
    return tuple(yi + (alpha * xi).to(yi.dtype) for xi, yi in zip(x, y))


class CGState(NamedTuple):
    """What compiled CG carries from one graph to the next (its eager counterpart's locals)."""

    x: Tensors  # the iterate
    r: Tensors  # the recurrence residual b - (H + damping I) x
    p: Tensors  # the search direction
    rs: torch.Tensor  # r . r
    stop: torch.Tensor  # (tol ||b||)^2: stop once rs is at or below it
    done: torch.Tensor  # bool: no further iteration runs
    negative_curvature: torch.Tensor  # bool: a direction of negative (or NaN) curvature
    singular: torch.Tensor  # 0, or 1 for the curvature test and 2 for the growth test
    best_x: Tensors  # the iterate with the smallest residual, returned on a singular stop
    best_rs: torch.Tensor  # its rs
    a_norm: torch.Tensor  # the running estimate of ||A|| of the singular tests
    iterations: torch.Tensor


class NeumannState(NamedTuple):
    """What the compiled Neumann series carries from one graph to the next."""

    acc: Tensors  # the sum of the terms so far
    v: Tensors  # the last term
    norm_min: torch.Tensor  # the smallest term norm so far (the growth test's reference)
    stop: torch.Tensor  # tol ||b||, or -||r0|| without tol (never stops early)
    done: torch.Tensor  # bool: no further iteration runs
    grew: torch.Tensor  # bool: a term grew (divergence)
    last: torch.Tensor  # the last term's norm
    ratio: torch.Tensor  # its ratio to the one before, -1 before the first step (the stall test)
    iterations: torch.Tensor


#: The fields of each solver state that hold one tensor per parameter leaf (the dense path
#: carries them as one flat vector and splits them back for *finish*).
_VECTORS: dict[type, tuple[str, ...]] = {
    CGState: ("x", "r", "p", "best_x"),
    NeumannState: ("acc", "v"),
}


def _flat_hessian(
    inner: FlatLoss, ps: Tensors, hs: Tensors
) -> tuple[torch.Tensor, Callable[[torch.Tensor], Tensors]]:
    """The inner Hessian at ``(ps, hs)`` as a dense ``(n, n)`` matrix in the parameters' dtype
    (one ``jacrev``: a ``vmap``-ed product over the unit vectors; row ``i`` is ``e_i^T J`` of the
    inner gradient's Jacobian ``J``) and the function splitting a flat vector into the leaves."""
    sizes = [t.numel() for t in ps]

    def unflat(z: torch.Tensor) -> Tensors:
        parts = z.split(sizes)  # type: ignore[no-untyped-call]
        return tuple(c.reshape(t.shape) for c, t in zip(parts, ps))

    def flat_grad(z: torch.Tensor) -> torch.Tensor:
        g = grad(inner, argnums=0)(unflat(z), hs)
        return torch.cat([t.reshape(-1) for t in g])

    z = torch.cat([t.reshape(-1) for t in ps])
    return jacrev(flat_grad)(z), unflat


def _loop(cond: Callable[[Any], torch.Tensor], body: Callable[[Any], Any], state: Any) -> Any:
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

    out = while_loop(unpack(cond), step, tuple(leaves))  # type: ignore[no-untyped-call]
    return pytree.tree_unflatten(list(out), spec)


class _Graphs:
    """The functional pieces of one (inner, outer, solver) triple, compiled or not.

    The base class holds what every solver shares (the outer gradients, the linearised inner
    gradient, the epilogue); one subclass per supported solver class (:data:`_GRAPHS`) holds its
    graphs and the diagnostics it reports. Every setting is read from ``solver``, whose settings
    cannot change after construction (:class:`~hypergrad.solvers.base.FrozenSettings`), so the
    graphs never keep a stale copy.
    """

    def __init__(
        self, inner: FlatLoss, outer: FlatLoss, solver: Solver, wrap: Callable[..., Any]
    ) -> None:
        self.inner, self.outer, self.solver = inner, outer, solver

    @classmethod
    def refuse(cls, solver: Solver) -> str | None:
        """Why ``solver``'s settings cannot be compiled (``None``: they can)."""
        return None

    @property
    def damping(self) -> float:
        """The solver's damping, read from the (frozen) solver, never copied."""
        return float(self.solver.damping)

    def solve(
        self, ps: Tensors, hs: Tensors, x0: Tensors, warm: bool
    ) -> tuple[Tensors, Tensors, torch.Tensor]:
        """Run the graphs: ``(x, hypergradient, statistics vector)`` (host side)."""
        raise NotImplementedError

    def fallback(self, st: Stats, rel: float) -> bool:
        """Whether the eager solve must answer this call instead (see :class:`_ExactGraphs`)."""
        return False

    def tol(self) -> float | None:
        """The relative residual that ``converged`` requires."""
        return getattr(self.solver, "tol", None)

    def matvecs(self, n: int, iterations: int, warm: bool) -> int:
        """Products spent: one per iteration, the warm start's, and the verified residual's."""
        return iterations + int(warm) + 1

    def diagnose(self, info: SolveInfo, st: Stats, dtype: torch.dtype) -> None:
        """The solver's own diagnostics and warnings, as its eager solve reports them."""

    def _linearised(self, ps: Tensors, hs: Tensors) -> tuple[torch.Tensor, Callable[..., Any]]:
        """The inner loss value and ``v -> (H v, mixed v)`` at ``(ps, hs)``."""

        def gin(p: Tensors, h: Tensors) -> tuple[Tensors, torch.Tensor]:
            g, value = grad_and_value(self.inner, argnums=0)(p, h)
            return g, value

        _, pullback, value = vjp(gin, ps, hs, has_aux=True)  # type: ignore[misc]
        return value, pullback

    def _op(self, pullback: Callable[..., Any], v: Tensors) -> Tensors:
        hv = pullback(v)[0]
        return _axpy(self.damping, v, hv) if self.damping else hv

    def _outer(self, ps: Tensors, hs: Tensors) -> tuple[Any, ...]:
        (g_ps, g_hs), lo = grad_and_value(self.outer, argnums=(0, 1))(ps, hs)
        return g_ps, g_hs, lo

    def _epilogue(self, ps: Tensors, hs: Tensors, x: Tensors, b: Tensors, g_hs: Tensors):  # type: ignore[no-untyped-def]
        _, pullback = self._linearised(ps, hs)
        hx, mixed = pullback(x)
        if self.damping:
            hx = _axpy(self.damping, x, hx)
        diff = tuple(a - c for a, c in zip(hx, b))
        hyper = tuple(d - m for d, m in zip(g_hs, mixed))
        finite = torch.stack([torch.isfinite(h).all() for h in hyper]).all()
        names = ("residual", "b_norm", "hypergrad_norm", "indirect_norm", "direct_norm")
        norms = {k: _dot(t, t).sqrt() for k, t in zip(names, (diff, b, hyper, mixed, g_hs))}
        return hyper, {**norms, "finite": finite}


class _IterativeGraphs(_Graphs):
    """An iterative solver, in one of two forms.

    * *dense* (at most :data:`DENSE_MAX` unknowns): one graph: the outer gradients, the inner
      Hessian as a dense matrix (one ``jacrev``, as :class:`_ExactGraphs`), the iterations on
      it in a loop (``torch._higher_order_ops.while_loop`` when compiled: its body is compiled
      once, whatever ``maxiter``) and *finish*'s epilogue;
    * otherwise Hessian-vector products: *start* (the state), *chunk* (:data:`CHUNK` masked
      iterations, called until ``state.done``) and *finish*; *whole* is the three in one
      graph, for ``maxiter <= CHUNK``.

    A subclass writes :meth:`_begin`, :meth:`_step` (one iteration, masked by ``active``) and
    :meth:`_answer`.
    """

    def __init__(
        self, inner: FlatLoss, outer: FlatLoss, solver: Solver, wrap: Callable[..., Any]
    ) -> None:
        super().__init__(inner, outer, solver, wrap)
        self.start = wrap(self._start)
        self.chunk = wrap(self._chunk)
        self.finish = wrap(self._finish)
        self.whole = wrap(self._whole)  # start + one chunk + finish, for maxiter <= CHUNK
        self.dense = wrap(self._dense_whole)  # everything on a dense Hessian, one graph

    def _begin(self, b: Tensors, r: Tensors, x0: Tensors) -> Any:
        """The state before the first iteration (``r``: the starting residual)."""
        raise NotImplementedError

    def _step(self, op: Callable[[Tensors], Tensors], state: Any, active: torch.Tensor) -> Any:
        """One iteration with the operator ``op`` (``v -> (H + damping I) v``); masked (the
        state unchanged) where ``active`` is False."""
        raise NotImplementedError

    def _answer(self, state: Any, x0: Tensors) -> tuple[Tensors, dict[str, torch.Tensor]]:
        """The solution and the solver's own :class:`Stats` fields."""
        raise NotImplementedError

    def solve(
        self, ps: Tensors, hs: Tensors, x0: Tensors, warm: bool
    ) -> tuple[Tensors, Tensors, torch.Tensor]:
        s = self.solver
        maxiter = default_maxiter(ps) if s.maxiter is None else s.maxiter  # type: ignore[attr-defined]
        if sum(t.numel() for t in ps) <= DENSE_MAX:  # one graph, one host sync, any maxiter
            return self.dense(ps, hs, x0, warm, torch.tensor(maxiter))  # type: ignore[no-any-return]
        if maxiter <= CHUNK:  # one graph, one host sync
            return self.whole(ps, hs, x0, warm, torch.tensor(maxiter))  # type: ignore[no-any-return]
        b, g_hs, losses, state = self.start(ps, hs, x0, warm)
        for spent in range(0, maxiter, CHUNK):  # one host sync per chunk
            if bool(state.done):
                break
            state = self.chunk(ps, hs, state, torch.tensor(maxiter - spent))
        return self.finish(ps, hs, state, x0, b, g_hs, losses)  # type: ignore[no-any-return]

    def _chunk(self, ps: Tensors, hs: Tensors, state: Any, budget: torch.Tensor) -> Any:
        """:data:`CHUNK` iterations, those past ``budget`` or the stopping test masked."""
        _, pullback = self._linearised(ps, hs)
        op = lambda v: self._op(pullback, v)  # noqa: E731
        for i in range(CHUNK):
            state = self._step(op, state, ~state.done & (budget > i))
        return state

    def _start(self, ps: Tensors, hs: Tensors, x0: Tensors, warm: bool) -> tuple[Any, ...]:
        b, g_hs, lo = self._outer(ps, hs)
        value, pullback = self._linearised(ps, hs)
        r = tuple(bi - a for bi, a in zip(b, self._op(pullback, x0))) if warm else b
        return b, g_hs, torch.stack([lo, value]), self._begin(b, r, x0)

    def _finish(self, ps, hs, state, x0, b, g_hs, losses):  # type: ignore[no-untyped-def]
        x, named = self._answer(state, x0)
        hyper, norms = self._epilogue(ps, hs, x, b, g_hs)
        stats = _stats(
            **norms, **named, iterations=state.iterations, outer_loss=losses[0],
            inner_loss=losses[1],
        )  # fmt: skip
        return x, hyper, stats

    def _whole(self, ps, hs, x0, warm, budget):  # type: ignore[no-untyped-def]
        b, g_hs, losses, state = self._start(ps, hs, x0, warm)
        state = self._chunk(ps, hs, state, budget)
        return self._finish(ps, hs, state, x0, b, g_hs, losses)  # type: ignore[no-untyped-call]

    def _dense_whole(self, ps, hs, x0, warm, budget):  # type: ignore[no-untyped-def]
        b, g_hs, lo = self._outer(ps, hs)
        losses = torch.stack([lo, self.inner(ps, hs)])
        mat, unflat = _flat_hessian(self.inner, ps, hs)
        damping = self.damping

        def op(v: Tensors) -> Tensors:  # (H + damping I) v, as _op adds the damping
            hv = (v[0] @ mat,)  # J^T v, as the pullback gives
            return _axpy(damping, v, hv) if damping else hv

        def flat(ts: Tensors) -> Tensors:
            return (torch.cat([t.reshape(-1) for t in ts]),)

        bf, xf = flat(b), flat(x0)
        r = tuple(bi - a for bi, a in zip(bf, op(xf))) if warm else bf
        state = _loop(
            lambda st: ~st.done & (st.iterations < budget),
            lambda st: self._step(op, st, ~st.done & (st.iterations < budget)),
            self._begin(bf, r, xf),
        )
        state = state._replace(**{k: unflat(getattr(state, k)[0]) for k in _VECTORS[type(state)]})
        return self._finish(ps, hs, state, x0, b, g_hs, losses)  # type: ignore[no-untyped-call]


class _CGGraphs(_IterativeGraphs):
    """:class:`~hypergrad.CG` without a preconditioner; its state is a :class:`CGState`."""

    @classmethod
    def refuse(cls, solver: Solver) -> str | None:
        if solver.preconditioner is not None:  # type: ignore[attr-defined]
            return "compile_implicit_grad does not support CG preconditioners; use hg.implicit_grad"
        return None

    def _begin(self, b: Tensors, r: Tensors, x0: Tensors) -> CGState:
        false, zero = torch.zeros((), dtype=torch.bool), torch.zeros((), dtype=torch.int64)
        rs = _dot(r, r)
        stop = self.solver.tol**2 * _dot(b, b)  # type: ignore[attr-defined]
        return CGState(
            x=x0, r=r, p=r, rs=rs, stop=stop, done=rs <= stop, negative_curvature=false,
            singular=zero, best_x=x0, best_rs=rs, a_norm=torch.zeros_like(rs), iterations=zero,
        )  # fmt: skip

    def _step(
        self, op: Callable[[Tensors], Tensors], state: CGState, active: torch.Tensor
    ) -> CGState:
        x, r, p, rs, stop, done = state.x, state.r, state.p, state.rs, state.stop, state.done
        negc, sing, its = state.negative_curvature, state.singular, state.iterations
        best_x, best_rs, a_norm = state.best_x, state.best_rs, state.a_norm
        crtol, glimit = singular_limits(x)
        # the steps and tests of the eager solve_cg, masked
        ap = op(p)
        pap, pp, apap = _dot(p, ap), _dot(p, p), _dot(ap, ap)
        broken = ~(torch.isfinite(pap) & torch.isfinite(apap)) | ((apap == 0) & (pap == 0))
        neg = active & broken
        a_norm = torch.where(active & ~broken, torch.maximum(a_norm, (apap / pp).sqrt()), a_norm)
        flat = active & ~broken & (pap.abs() <= crtol * a_norm * pp)
        neg = neg | (active & ~broken & ~flat & (pap < 0))
        sing = torch.where(flat & (sing == 0), torch.ones_like(sing), sing)
        negc, active = negc | neg, active & ~neg & ~flat
        a = torch.where(active, rs / pap, torch.zeros_like(rs))
        x, r = _axpy(a, p, x), _axpy(-a, ap, r)
        rs_new = _dot(r, r)
        claimed = active & (rs_new <= stop)
        better = active & ~claimed & (rs_new < best_rs)
        grew = active & ~claimed & ~better & (rs_new > glimit**2 * best_rs)
        sing = torch.where(grew & (sing == 0), torch.full_like(sing, 2), sing)
        best_x = tuple(torch.where(better, xi, bi) for xi, bi in zip(x, best_x))
        best_rs = torch.where(better, rs_new, best_rs)
        beta = torch.where(active, rs_new / rs, torch.zeros_like(rs))
        p = tuple(torch.where(active, ri + (beta * pi).to(pi.dtype), pi) for ri, pi in zip(r, p))
        rs = torch.where(active, rs_new, rs)
        its = its + active.long()
        done = done | neg | flat | grew | claimed
        return CGState(
            x=x, r=r, p=p, rs=rs, stop=stop, done=done, negative_curvature=negc, singular=sing,
            best_x=best_x, best_rs=best_rs, a_norm=a_norm, iterations=its,
        )  # fmt: skip

    def _answer(self, state: CGState, x0: Tensors) -> tuple[Tensors, dict[str, torch.Tensor]]:
        # a singular stop returns the iterate with the smallest residual
        x = tuple(torch.where(state.singular > 0, bi, xi) for xi, bi in zip(state.x, state.best_x))
        return x, {"singular": state.singular, "flag": state.negative_curvature}

    def diagnose(self, info: SolveInfo, st: Stats, dtype: torch.dtype) -> None:
        if st.flag:
            info.extras["negative_curvature"] = True
            warn_diverged(info, "The operator is not positive definite: use MINRES or damping.")
        info.extras["singular"] = bool(st.singular) and not info.converged
        if info.extras["singular"]:
            info.extras["singular_test"] = "curvature" if st.singular == 1 else "growth"
            warn_singular(
                info,
                "the system is singular and inconsistent (or numerically singular): CG "
                "met a search direction of numerically zero curvature or a residual growing "
                "far above its minimum, where its iterate grows without bound; it stopped "
                "and returned the iterate with the smallest residual.",
            )


class _NeumannGraphs(_IterativeGraphs):
    """:class:`~hypergrad.Neumann` with a given ``alpha``; its state is a
    :class:`NeumannState`."""

    @classmethod
    def refuse(cls, solver: Solver) -> str | None:
        if solver.alpha is None:  # type: ignore[attr-defined]
            return (
                "compile_implicit_grad needs Neumann's alpha (no power iteration in the compiled "
                "path): pass Neumann(alpha=...), e.g. 1 / info.solve.extras['lambda_max'] of an "
                "eager implicit_grad call with alpha=None"
            )
        return None

    def _begin(self, b: Tensors, r: Tensors, x0: Tensors) -> NeumannState:
        false, zero = torch.zeros((), dtype=torch.bool), torch.zeros((), dtype=torch.int64)
        tol = self.solver.tol  # type: ignore[attr-defined]
        norm0 = _dot(r, r).sqrt()
        stop = -norm0 if tol is None else tol * _dot(b, b).sqrt()
        return NeumannState(
            acc=r, v=r, norm_min=norm0, stop=stop, done=norm0 <= stop, grew=false, last=norm0,
            ratio=-torch.ones_like(norm0), iterations=zero,
        )  # fmt: skip

    def _step(
        self, op: Callable[[Tensors], Tensors], state: NeumannState, active: torch.Tensor
    ) -> NeumannState:
        acc, v, norm_min, stop, done = state.acc, state.v, state.norm_min, state.stop, state.done
        grew, last, ratio, its = state.grew, state.last, state.ratio, state.iterations
        alpha, limit = self.solver.alpha, 1.0 + growth_tol(v[0].dtype)  # type: ignore[attr-defined]
        v_next = _axpy(-alpha, op(v), v)
        norm = _dot(v_next, v_next).sqrt()
        bad = active & ~(norm <= limit * norm_min)  # grew, or NaN/Inf
        grew, active = grew | bad, active & ~bad
        v = tuple(torch.where(active, a, b) for a, b in zip(v_next, v))
        acc = tuple(torch.where(active, a + b, a) for a, b in zip(acc, v))
        norm_min = torch.where(active, torch.minimum(norm_min, norm), norm_min)
        step = torch.where(last > 0, norm / last, torch.zeros_like(norm))
        ratio = torch.where(active, step, ratio)
        last = torch.where(active, norm, last)
        its = its + (active | bad).long()  # the step that grew counts, as in the eager series
        done = done | bad | (active & (norm <= stop))
        return NeumannState(
            acc=acc, v=v, norm_min=norm_min, stop=stop, done=done, grew=grew, last=last,
            ratio=ratio, iterations=its,
        )  # fmt: skip

    def _answer(self, state: NeumannState, x0: Tensors) -> tuple[Tensors, dict[str, torch.Tensor]]:
        x = _axpy(self.solver.alpha, state.acc, x0)  # type: ignore[attr-defined]
        return x, {"flag": state.grew, "last_term": state.last, "ratio": state.ratio}

    def diagnose(self, info: SolveInfo, st: Stats, dtype: torch.dtype) -> None:
        s = self.solver
        info.alpha = float(s.alpha)  # type: ignore[attr-defined]
        if st.flag:
            warn_diverged(info, growth_hint(False))
        # the eager series' stall test on the last ratio of term norms and its bound
        bound = st.last_term / st.b_norm if st.b_norm > 0 else 0.0
        info.extras["contraction"] = st.ratio if st.ratio >= 0 else None
        info.extras["stalled"] = (
            not info.diverged
            and st.ratio >= 1.0 - growth_tol(dtype)
            and bound > max(s.tol or 0.0, stall_floor(dtype))  # type: ignore[attr-defined]
        )
        if info.extras["stalled"]:
            info.converged = False


class _ExactGraphs(_Graphs):
    """:class:`~hypergrad.Exact`: one graph (the dense Hessian from one ``jacrev``, a float64 LU
    solve, the residual, the mixed term); a singular or rounding-dominated LU is answered by the
    eager solve."""

    #: the relative residual the compiled LU solve must reach (else the eager solve answers)
    RESIDUAL_TOL = 1e-6

    def __init__(
        self, inner: FlatLoss, outer: FlatLoss, solver: Solver, wrap: Callable[..., Any]
    ) -> None:
        super().__init__(inner, outer, solver, wrap)
        self.graph = wrap(self._exact)

    def solve(
        self, ps: Tensors, hs: Tensors, x0: Tensors, warm: bool
    ) -> tuple[Tensors, Tensors, torch.Tensor]:
        return self.graph(ps, hs)  # type: ignore[no-any-return]

    def fallback(self, st: Stats, rel: float) -> bool:
        # a singular or rounding-dominated LU: the eager Exact solve (minimum-norm least-squares
        # solution by the pseudo-inverse, honest report, its warnings)
        return bool(st.singular) or not (
            st.finite and rel <= self.RESIDUAL_TOL and st.condition_bound < ILL_CONDITIONED
        )

    def tol(self) -> float | None:
        return self.RESIDUAL_TOL

    def matvecs(self, n: int, iterations: int, warm: bool) -> int:
        return n + 1  # the columns, and the verified residual's

    def _dense(
        self, ps: Tensors, hs: Tensors, b: Tensors
    ) -> tuple[Tensors, torch.Tensor, torch.Tensor]:
        mat, unflat = _flat_hessian(self.inner, ps, hs)
        mat, n = mat.to(torch.float64), mat.shape[0]
        mat = mat + self.damping * torch.eye(n, dtype=torch.float64, device=mat.device)
        rhs = torch.cat([t.reshape(-1) for t in b]).to(torch.float64)
        # two probe columns besides b: Higham's alternating vector and fixed pseudo-random signs;
        # ||A||_1 ||A^-1 v||_1 / ||v||_1 <= cond_1(A) for each, a lower bound that reaches the
        # rounding level on a (numerically) singular matrix unless v is orthogonal to its null
        # space: such a matrix is left to the eager pseudo-inverse (as the eager Exact does)
        i = torch.arange(n, dtype=torch.float64, device=mat.device)
        alt = (1 - 2 * torch.remainder(i, 2)) * (1 + i / max(n - 1, 1))
        signs = torch.where(
            torch.remainder(torch.sin(i * 12.9898 + 1.0) * 43758.5453, 1.0) > 0.5, 1.0, -1.0
        )
        cols, err = torch.linalg.solve_ex(mat, torch.stack([rhs, alt, signs], dim=1))
        sol = cols[:, 0]
        growth = cols.abs().sum(0) / torch.stack([rhs, alt, signs], dim=1).abs().sum(0)
        kappa = mat.abs().sum(0).max() * growth.max()
        return tuple(s.to(t.dtype) for s, t in zip(unflat(sol), ps)), err, kappa

    def _exact(self, ps: Tensors, hs: Tensors) -> tuple[Any, ...]:
        b, g_hs, lo = self._outer(ps, hs)
        lin = self.inner(ps, hs)
        x, err, kappa = self._dense(ps, hs, b)
        hyper, norms = self._epilogue(ps, hs, x, b, g_hs)
        stats = _stats(
            **norms, outer_loss=lo, inner_loss=lin, singular=err, iterations=torch.ones_like(kappa),
            condition_bound=kappa,
        )  # fmt: skip
        return x, hyper, stats


#: The solvers ``compile_implicit_grad`` supports: a solver class -> the graphs implementing it
#: (a subclass of a listed class is compiled as that class). Its ``refuse`` names the settings
#: it cannot compile; a solver of another class is refused by :func:`_graphs_for`.
_GRAPHS: dict[type[Solver], type[_Graphs]] = {
    CG: _CGGraphs,
    Neumann: _NeumannGraphs,
    Exact: _ExactGraphs,
}


def _graphs_for(solver: Solver) -> type[_Graphs]:
    """The graphs class of ``solver`` from :data:`_GRAPHS`.

    Raises:
        HypergradValueError: a solver of another class, or settings its class cannot compile.
    """
    kind = next((_GRAPHS[c] for c in type(solver).__mro__ if c in _GRAPHS), None)
    if kind is None:
        names = [f"hg.{c.__name__}" for c in _GRAPHS]
        raise HypergradValueError(
            f"compile_implicit_grad supports {', '.join(names[:-1])} and {names[-1]}, got "
            f"{type(solver).__name__}; use hg.implicit_grad for it"
        )
    problem = kind.refuse(solver)
    if problem is not None:
        raise HypergradValueError(problem)
    return kind


#: ``torch.compile`` options every graph is compiled with, under the mode's and the user's (see
#: :func:`compile_options`). ``unsafe_marked_cacheable_functions`` lets inductor's on-disk caches
#: (the FX graph and AOTAutograd caches) keep a graph holding the dense path's ``while_loop``,
#: which they otherwise bypass, so that a new process compiles it from the cache (13 s instead of
#: 24-33 s measured, ``docs/performance.md``, "First call"): the cache key covers the loop's body
#: and condition (their code is part of the pickled graph) and torch's version; the option is
#: scoped to these graphs by ``torch.compile(options=...)``.
DEFAULT_OPTIONS: dict[str, Any] = {
    "unsafe_marked_cacheable_functions": {"torch.ops.higher_order.while_loop": torch.__version__}
}
#: Added on the CPU: ``cpp_wrapper`` builds a graph's kernels and its wrapper as one C++ file (one
#: compiler run per graph instead of one per kernel; the dense path's loop then runs in C++).
CPU_OPTIONS: dict[str, Any] = {"cpp_wrapper": True}


def compile_options(
    mode: str | None, options: dict[str, Any] | None, device_type: str = "cpu"
) -> dict[str, Any]:
    """The ``torch.compile`` options of the graphs on ``device_type``: :data:`DEFAULT_OPTIONS`
    (and :data:`CPU_OPTIONS` on the CPU), then ``mode``'s (``torch._inductor.list_mode_options``),
    then ``options``; ``torch.compile`` takes a mode or options, not both, so the mode is passed
    as its options."""
    mode_options = {}
    if mode is not None:  # importing inductor takes a second: only for a mode
        from torch._inductor import list_mode_options

        mode_options = list_mode_options(mode)
    device_options = CPU_OPTIONS if device_type == "cpu" else {}
    return {**DEFAULT_OPTIONS, **device_options, **mode_options, **(options or {})}


class CompiledImplicitGrad:
    """The callable returned by :func:`compile_implicit_grad` (see there).

    Attributes:
        solver: the solver whose method and settings the graphs implement.
        compiled: whether the graphs go through ``torch.compile`` (``"auto"``: once the eager
            calls of a signature have taken ``compile_after`` seconds).
        compile_after: with ``compiled="auto"``, the seconds of eager calls per signature after
            which the next call compiles.
        options: the ``torch.compile`` options of the graphs on the CPU (on another device
            without :data:`CPU_OPTIONS`).

    Raises:
        HypergradValueError: a solver :func:`compile_implicit_grad` does not support.
    """

    def __init__(
        self,
        inner_loss: Loss,
        outer_loss: Loss,
        solver: Solver,
        compiled: bool | str,
        mode: str | None,
        options: dict[str, Any] | None = None,
        compile_after: float = 0.0,
    ) -> None:
        self.inner_loss, self.outer_loss = inner_loss, outer_loss
        self._kind = _graphs_for(solver)
        self._solver, self.compiled, self.compile_after = solver, compiled, compile_after
        self._mode, self._options = mode, options
        self._graphs: dict[Any, _Graphs] = {}
        self._eager_s: dict[Any, float] = {}  # "auto": the eager calls' time per signature

    @property
    def solver(self) -> Solver:
        """The solver (read-only: its graphs are built from it; settings are frozen too)."""
        return self._solver

    @property
    def options(self) -> dict[str, Any]:
        """The ``torch.compile`` options of graphs on the CPU (:func:`compile_options`)."""
        return compile_options(self._mode, self._options)

    def _wrap(self, fn: Callable[..., Any], device_type: str = "cpu") -> Callable[..., Any]:
        if not self.compiled:
            return fn
        options = compile_options(self._mode, self._options, device_type)
        return torch.compile(_own_code(fn), fullgraph=True, dynamic=False, options=options)

    def _eager(
        self, key: Any, params: PyTree, hparams: PyTree, x0: PyTree | None
    ) -> tuple[PyTree, HypergradInfo]:
        """``compiled="auto"`` before the switch: the call is :func:`~hypergrad.implicit_grad`'s,
        its time added to the signature's account."""
        t0 = time.perf_counter()
        g, info = implicit_grad(
            self.inner_loss, self.outer_loss, params, hparams, solver=self.solver, x0=x0
        )
        self._eager_s[key] = self._eager_s.get(key, 0.0) + time.perf_counter() - t0
        info.solve.extras["compiled"] = False
        info.extras.update(first_call=False, compile_pending=True)
        return g, info

    def __call__(
        self, params: PyTree, hparams: PyTree, *, x0: PyTree | None = None
    ) -> tuple[PyTree, HypergradInfo]:
        """``(hypergrads, info)`` at ``params`` exactly as :func:`~hypergrad.implicit_grad`."""
        t0 = time.perf_counter()
        p_leaves, p_spec = tree_flatten(params, "params")
        h_leaves, h_spec = tree_flatten(hparams, "hparams")
        key = (p_spec, h_spec) + tuple((t.shape, t.dtype, t.device) for t in p_leaves + h_leaves)
        first = key not in self._graphs
        if first and self.compiled == "auto" and self._eager_s.get(key, 0.0) < self.compile_after:
            return self._eager(key, params, hparams, x0)
        if first:  # the eager entry point's input checks, once per signature
            with warnings.catch_warnings():  # the compiled solve warns for itself
                warnings.simplefilter("ignore")
                implicit_grad(self.inner_loss, self.outer_loss, params, hparams, solver=self.solver)

            def inner(ps: Tensors, hs: Tensors) -> torch.Tensor:
                return self.inner_loss(tree_unflatten(p_spec, ps), tree_unflatten(h_spec, hs))

            def outer(ps: Tensors, hs: Tensors) -> torch.Tensor:
                return self.outer_loss(tree_unflatten(p_spec, ps), tree_unflatten(h_spec, hs))

            wrap = functools.partial(self._wrap, device_type=p_leaves[0].device.type)
            self._graphs[key] = self._kind(inner, outer, self.solver, wrap)
        g = self._graphs[key]
        ps, hs = tuple(t.detach() for t in p_leaves), tuple(t.detach() for t in h_leaves)
        warm = x0 is not None
        if x0 is None:
            xs = tuple(torch.zeros_like(t) for t in ps)
        else:
            xs = check_warm_start(x0, p_leaves, p_spec, leaf_paths(p_spec, "params"))
        x, hyper, stats = g.solve(ps, hs, xs, warm)
        st = Stats(*stats.tolist())
        b_norm = st.b_norm
        rel = st.residual / b_norm if b_norm > 0 else 0.0
        s = self.solver
        if g.fallback(st, rel):
            g_eager, hinfo = implicit_grad(
                self.inner_loss, self.outer_loss, params, hparams, solver=s
            )
            hinfo.solve.extras.update(compiled=bool(self.compiled), compiled_fallback=True)
            hinfo.extras["first_call"] = first
            return g_eager, hinfo
        if not st.finite:
            raise HypergradValueError("the hypergradient contains NaN/Inf")
        its = int(st.iterations)
        info = SolveInfo(solver=s.name, iterations=its)
        info.matvecs = g.matvecs(sum(t.numel() for t in ps), its, warm)
        info.residual = rel
        info.extras.update(b_norm=b_norm, residual_verified=True, compiled=bool(self.compiled))
        info.diverged = bool(st.flag)
        tol = g.tol()
        info.converged = not info.diverged and tol is not None and info.residual <= tol
        g.diagnose(info, st, ps[0].dtype)
        report_failure(info)
        hinfo = HypergradInfo(
            solve=info,
            inner_loss=st.inner_loss,
            outer_loss=st.outer_loss,
            outer_grad_norm=b_norm,
            direct_norm=st.direct_norm,
            indirect_norm=st.indirect_norm,
            hypergrad_norm=st.hypergrad_norm,
            time_s=time.perf_counter() - t0,
            extras={"adjoint": tree_unflatten(p_spec, list(x)), "first_call": first},
        )
        return tree_unflatten(h_spec, list(hyper)), hinfo


def compile_implicit_grad(
    inner_loss: Loss,
    outer_loss: Loss,
    *,
    solver: Solver | None = None,
    compile: bool | str = True,
    mode: str | None = None,
    options: dict[str, Any] | None = None,
    compile_after: float = 30.0,
) -> CompiledImplicitGrad:
    """A compiled ``implicit_grad(inner_loss, outer_loss, params, hparams, solver=solver)``.

    Returns a callable ``f(params, hparams, *, x0=None) -> (hypergrads, info)`` with the
    arguments, results and diagnostics of :func:`~hypergrad.implicit_grad`, computed by
    ``torch.func`` code that ``torch.compile`` fuses into one graph (CG and Neumann on at most
    :data:`DENSE_MAX` unknowns, and ``Exact``) or a few (see :mod:`hypergrad.compiled`). It pays
    off on small problems called many times, where eager overhead dominates: a compiled call is
    several times faster than an eager one, but the first call for given shapes compiles. On a
    30-unknown ridge problem (CG, Neumann at K = 20, Exact; one loaded CPU core) that call took
    32-45 s with a cold inductor cache and 6-8 s with a warm one (a second run of the program),
    against 0.5-0.7 s for the first eager call; compiling paid off after about 10,000 calls cold
    and 1,600 warm (``docs/performance.md``, "First call"). Compile when the calls number in the
    thousands and keep inductor's cache folder between runs; with ``compile="auto"`` the calls
    run eagerly until they have taken ``compile_after`` seconds, then compile (about twice the
    better choice at worst when ``compile_after`` is close to the compile time). The losses must
    be traceable by ``torch.func`` and ``torch.compile`` (pure functions of their arguments: no
    ``.item()``, no data-dependent Python control flow, no in-place updates of captured
    tensors).

    Args:
        inner_loss: ``(params, hparams) -> scalar``.
        outer_loss: ``(params, hparams) -> scalar``.
        solver: ``hg.CG`` (no preconditioner), ``hg.Neumann`` with an explicit ``alpha``, or
            ``hg.Exact``; default ``hg.Exact()``.
        compile: True compiles on the first call of each signature (shapes, dtypes, devices);
            False runs the same functional code without ``torch.compile``; ``"auto"`` answers
            the calls of a signature by :func:`~hypergrad.implicit_grad` (eager, its numbers;
            ``info.extras["compile_pending"]``) until they have taken ``compile_after``
            seconds, then compiles.
        mode: ``torch.compile``'s ``mode`` (passed as its options).
        options: ``torch.compile`` options, over :data:`DEFAULT_OPTIONS` (and
            :data:`CPU_OPTIONS` on the CPU) and ``mode``'s.
        compile_after: seconds of eager calls per signature before ``compile="auto"``
            compiles (ignored otherwise).

    Raises:
        HypergradValueError: another solver, Neumann without ``alpha``, CG with a
            preconditioner, a ``compile`` other than True, False or ``"auto"``.

    Example:
        >>> import hypergrad as hg
        >>> X, y = torch.randn(20, 3, dtype=torch.float64), torch.randn(20, dtype=torch.float64)
        >>> inner = lambda w, lam: 0.5 * ((X @ w - y) ** 2).sum() + 0.5 * lam * (w ** 2).sum()
        >>> outer = lambda w, lam: 0.5 * ((X @ w - 1.0) ** 2).sum()
        >>> lam = torch.tensor(0.5, dtype=torch.float64)
        >>> w = torch.linalg.solve(X.T @ X + lam * torch.eye(3, dtype=torch.float64), X.T @ y)
        >>> f = hg.compile_implicit_grad(inner, outer, solver=hg.CG(tol=1e-12), compile=False)
        >>> g, info = f(w, lam)
        >>> g_eager, _ = hg.implicit_grad(inner, outer, w, lam, solver=hg.CG(tol=1e-12))
        >>> bool(torch.allclose(g, g_eager)), info.solve.converged
        (True, True)
    """
    if not (callable(inner_loss) and callable(outer_loss)):
        raise HypergradTypeError("inner_loss and outer_loss must be callable")
    if compile not in (True, False, "auto"):
        raise HypergradValueError(f"compile must be True, False or 'auto', got {compile!r}")
    solver = Exact() if solver is None else solver
    return CompiledImplicitGrad(
        inner_loss, outer_loss, solver, compile, mode, options, float(compile_after)
    )
