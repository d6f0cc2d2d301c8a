"""``compile_implicit_grad``: the implicit hypergradient as ``torch.func`` code, compiled.

:func:`~hypergrad.implicit_grad` runs eagerly: every Hessian-vector product is an
``autograd.grad`` call and every solver step a few small tensor operations, each paying
Python and dispatcher overhead (tens of microseconds). On a problem with tens of unknowns that
overhead is nearly all of the time. This module writes the same computation with
``torch.func`` (``grad``, ``vjp``, ``jacrev``) so that ``torch.compile`` can trace it into one
or a few fused graphs.

The module is a driver: the solver's own arithmetic is its *kernel*, written beside its eager
``solve`` in the solver's file (:mod:`hypergrad.solvers.functional`; ``CG``, ``Neumann`` and
``Exact`` declare one, and any solver whose ``kernel()`` returns one is compiled the same way).
An iterative kernel is one masked step (``init`` / ``step`` / ``answer`` / ``diagnose``), a dense
kernel a solve on the dense matrix.

Small problems (an iterative kernel on at most :data:`DENSE_MAX` unknowns, and a dense kernel)
are one graph: the outer loss's gradients (the right-hand side ``b`` and the direct term), the
inner Hessian as a dense matrix (:func:`~hypergrad.solvers.functional.dense_hessian`: one
``jacrev``, a ``vmap``-ed product over the unit vectors), the solve on it, and the epilogue
(*finish*: the residual ``||(H + damping I) x - b|| / ||b||`` recomputed from ``x`` with one
Hessian-vector product, as the eager solvers verify ``converged``, and the mixed term). The
iterations there are a loop (``torch._higher_order_ops.while_loop``) whose body is traced and
compiled once, whatever ``maxiter``, and which stops at the stopping test: one host sync per
call. Exact solves by float64 LU.

Larger iterative solves use Hessian-vector products in three graphs:

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
:func:`own_code`).

Differences from :func:`~hypergrad.implicit_grad` (each kernel's docstring has its own): no
preconditioner, no ``engine="recompute"``, no ``distributed``; MINRES, GMRES, BiCGStab and
Nystrom declare no kernel (refused); CG does not restart when the recurrence residual and the
recomputed one disagree (the recomputed residual still decides ``converged``); Neumann needs its
``alpha`` (no power iteration); Exact bounds the condition number from below instead of
estimating it and leaves a zero pivot, a residual above ``1e-6`` or a bound at
``ILL_CONDITIONED`` to the eager solve (``extras["compiled_fallback"]``: the pseudo-inverse and
its report). On the dense path the products are ``v @ H`` with the dense ``H`` rather than
Hessian-vector products: the same numbers to rounding (CG stopped far from convergence on an
ill-conditioned system can amplify that rounding, as it amplifies the eager solver's).
``compile=False`` runs the same functional code eagerly (for debugging a loss that does not
trace).
"""

from __future__ import annotations

import functools
import itertools
import time
import types
import warnings
from collections.abc import Callable
from typing import Any, cast, get_type_hints

import torch
from torch.func import grad_and_value, vjp

from .errors import HypergradTypeError, HypergradValueError
from .implicit import check_warm_start, implicit_grad
from .report import HypergradInfo, Loss
from .solvers import SOLVERS, Exact, SolveInfo, Solver
from .solvers.base import report_failure
from .solvers.functional import (
    DenseKernel,
    IterativeKernel,
    Kernel,
    Stats,
    axpy,
    dense_hessian,
    dot,
    flatten,
    loop,
    unflattener,
)
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


def own_code(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` (bound) rebuilt on a copy of its code object.

    ``torch.compile`` caches compiled graphs per code object, guarded on the objects the code
    touches. Without a copy, every ``compile_implicit_grad`` in a process would share one cache
    per method: each new instance adds an entry (a recompilation), every call walks the guards of
    all of them, and after ``torch._dynamo.config.recompile_limit`` entries (8) the method runs
    eagerly, slowly and with only a log message. A copy gives each instance its own cache.
    """
    if not isinstance(method, types.MethodType):
        raise HypergradTypeError(f"own_code takes a bound method, got {method!r}")
    func = method.__func__
    code = func.__code__.replace(co_name=f"{func.__name__}_{next(_instances)}")
    own = types.FunctionType(code, func.__globals__, code.co_name, func.__defaults__)
    return types.MethodType(own, method.__self__)


FlatLoss = Callable[[Tensors, Tensors], torch.Tensor]
Graph = Callable[..., tuple[Tensors, Tensors, torch.Tensor]]


def _stats(kernel: Kernel[Any], **named: torch.Tensor) -> torch.Tensor:
    """``named`` scalars stacked as a float64 vector in the order of :class:`Stats`, then of the
    kernel's ``fields`` (missing ones 0); an unknown name raises. Read back by
    :func:`_read_stats`: producer and consumer share these names, so reordering or adding a
    field cannot mislabel a diagnostic."""
    names = Stats._fields + kernel.fields
    unknown = set(named) - set(names)
    if unknown:
        raise KeyError(f"not a field of Stats or of {type(kernel).__name__}: {sorted(unknown)}")
    zero = torch.zeros((), dtype=torch.float64, device=named["residual"].device)
    return torch.stack([named[k].double() if k in named else zero for k in names])


def _read_stats(kernel: Kernel[Any], vector: torch.Tensor) -> tuple[Stats, dict[str, float]]:
    """The :class:`Stats` and the kernel's own statistics of a graph's vector (one host sync)."""
    values = vector.tolist()
    n = len(Stats._fields)
    return Stats(*values[:n]), dict(zip(kernel.fields, values[n:]))


def _kernel(solver: Solver) -> Kernel[Any]:
    """``solver.kernel()``.

    Raises:
        HypergradValueError: a solver without a kernel, or settings its kernel refuses.
    """
    kernel = solver.kernel()
    if kernel is None:
        names = [f"hg.{c.__name__}" for c in _compilable()]
        raise HypergradValueError(
            f"compile_implicit_grad supports {', '.join(names[:-1])} and {names[-1]} (the "
            f"solvers that declare a kernel), got {type(solver).__name__}; use hg.implicit_grad "
            "for it, or give the solver a kernel (docs/solvers.md, 'Writing a solver')"
        )
    return kernel


def _compilable() -> list[type[Solver]]:
    """The library's solver classes that declare a kernel (:data:`~hypergrad.solvers.SOLVERS`
    order, iterative kernels first), read from the return type of their ``kernel``."""

    def iterative(cls: type[Solver]) -> bool:
        kind = get_type_hints(cls.kernel).get("return")
        return isinstance(kind, type) and issubclass(kind, IterativeKernel)

    declared = [c for c in SOLVERS.values() if c.kernel is not Solver.kernel]
    return sorted(declared, key=lambda c: not iterative(c))


class _Graphs:
    """The functional pieces of one (inner, outer, solver) triple, compiled or not: what every
    solver shares (the outer gradients, the linearised inner gradient, the epilogue). A subclass
    drives one kind of kernel (:class:`_IterativeGraphs`, :class:`_DenseGraphs`). Every setting
    is read from the solver (through its kernel), whose settings cannot change after
    construction (:class:`~hypergrad.solvers.base.FrozenSettings`), so the graphs never keep a
    stale copy.
    """

    def __init__(
        self, inner: FlatLoss, outer: FlatLoss, solver: Solver, wrap: Callable[..., Any]
    ) -> None:
        self.inner, self.outer, self.solver = inner, outer, solver
        self.kernel: Kernel[Any] = _kernel(solver)

    @property
    def damping(self) -> float:
        """The solver's damping, read from the (frozen) solver, never copied."""
        return float(self.solver.damping)

    def solve(
        self, ps: Tensors, hs: Tensors, x0: Tensors, warm: bool
    ) -> tuple[Tensors, Tensors, torch.Tensor]:
        """Run the graphs: ``(x, hypergradient, statistics vector)`` (host side)."""
        raise NotImplementedError

    def _linearised(
        self, ps: Tensors, hs: Tensors
    ) -> tuple[torch.Tensor, Callable[[Tensors], tuple[Tensors, Tensors]]]:
        """The inner loss value and ``v -> (H v, mixed v)`` at ``(ps, hs)``."""

        def gin(p: Tensors, h: Tensors) -> tuple[Tensors, torch.Tensor]:
            g, value = grad_and_value(self.inner, argnums=0)(p, h)
            return g, value

        linearised = vjp(gin, ps, hs, has_aux=True)
        _, pullback, value = cast("tuple[Any, Callable[..., Any], torch.Tensor]", linearised)
        return value, pullback

    def _op(self, pullback: Callable[[Tensors], tuple[Tensors, Tensors]], v: Tensors) -> Tensors:
        hv = pullback(v)[0]
        return axpy(self.damping, v, hv) if self.damping else hv

    def _outer(self, ps: Tensors, hs: Tensors) -> tuple[Tensors, Tensors, torch.Tensor]:
        (g_ps, g_hs), lo = grad_and_value(self.outer, argnums=(0, 1))(ps, hs)
        return g_ps, g_hs, lo

    def _epilogue(
        self, ps: Tensors, hs: Tensors, x: Tensors, b: Tensors, g_hs: Tensors
    ) -> tuple[Tensors, dict[str, torch.Tensor]]:
        """The hypergradient and the norms of :class:`Stats` (the residual recomputed from
        ``x`` with one Hessian-vector product, as the eager solvers verify ``converged``)."""
        _, pullback = self._linearised(ps, hs)
        hx, mixed = pullback(x)
        if self.damping:
            hx = axpy(self.damping, x, hx)
        diff = tuple(a - c for a, c in zip(hx, b))
        hyper = tuple(d - m for d, m in zip(g_hs, mixed))
        finite = torch.stack([torch.isfinite(h).all() for h in hyper]).all()
        names = ("residual", "b_norm", "hypergrad_norm", "indirect_norm", "direct_norm")
        norms = {k: dot(t, t).sqrt() for k, t in zip(names, (diff, b, hyper, mixed, g_hs))}
        return hyper, {**norms, "finite": finite}


class _IterativeGraphs(_Graphs):
    """The driver of an :class:`~hypergrad.solvers.functional.IterativeKernel`, in one of two
    forms.

    * *dense* (at most :data:`DENSE_MAX` unknowns): one graph: the outer gradients, the inner
      Hessian as a dense matrix (:func:`~hypergrad.solvers.functional.dense_hessian`), the
      iterations on it in a loop (``torch._higher_order_ops.while_loop`` when compiled: its
      body is compiled once, whatever ``maxiter``) and *finish*'s epilogue;
    * otherwise Hessian-vector products: *start* (the state), *chunk* (:data:`CHUNK` masked
      iterations, called until ``state.done``) and *finish*; *whole* is the three in one
      graph, for ``maxiter <= CHUNK``.
    """

    kernel: IterativeKernel[Any, Any]

    def __init__(
        self, inner: FlatLoss, outer: FlatLoss, solver: Solver, wrap: Callable[..., Any]
    ) -> None:
        super().__init__(inner, outer, solver, wrap)
        self.start = wrap(self._start)
        self.chunk = wrap(self._chunk)
        self.finish: Graph = wrap(self._finish)
        self.whole: Graph = wrap(self._whole)  # start + one chunk + finish, for maxiter <= CHUNK
        self.dense: Graph = wrap(self._dense_whole)  # everything on a dense Hessian, one graph

    def solve(
        self, ps: Tensors, hs: Tensors, x0: Tensors, warm: bool
    ) -> tuple[Tensors, Tensors, torch.Tensor]:
        maxiter = self.kernel.maxiter(ps)
        if sum(t.numel() for t in ps) <= DENSE_MAX:  # one graph, one host sync, any maxiter
            return self.dense(ps, hs, x0, warm, torch.tensor(maxiter))
        if maxiter <= CHUNK:  # one graph, one host sync
            return self.whole(ps, hs, x0, warm, torch.tensor(maxiter))
        b, g_hs, losses, state = self.start(ps, hs, x0, warm)
        for spent in range(0, maxiter, CHUNK):  # one host sync per chunk
            if bool(state.done):
                break
            state = self.chunk(ps, hs, state, torch.tensor(maxiter - spent))
        return self.finish(ps, hs, state, x0, b, g_hs, losses)

    def _chunk(self, ps: Tensors, hs: Tensors, state: Any, budget: torch.Tensor) -> Any:
        """:data:`CHUNK` iterations, those past ``budget`` or the stopping test masked."""
        _, pullback = self._linearised(ps, hs)
        op = lambda v: self._op(pullback, v)  # noqa: E731
        for i in range(CHUNK):
            state = self.kernel.step(op, state, ~state.done & (budget > i))
        return state

    def _start(self, ps: Tensors, hs: Tensors, x0: Tensors, warm: bool) -> tuple[Any, ...]:
        b, g_hs, lo = self._outer(ps, hs)
        value, pullback = self._linearised(ps, hs)
        r = tuple(bi - a for bi, a in zip(b, self._op(pullback, x0))) if warm else b
        return b, g_hs, torch.stack([lo, value]), self.kernel.init(b, r, x0)

    def _finish(
        self,
        ps: Tensors,
        hs: Tensors,
        state: Any,
        x0: Tensors,
        b: Tensors,
        g_hs: Tensors,
        losses: torch.Tensor,
    ) -> tuple[Tensors, Tensors, torch.Tensor]:
        x, named = self.kernel.answer(state, x0)
        hyper, norms = self._epilogue(ps, hs, x, b, g_hs)
        stats = _stats(
            self.kernel, **norms, **named, iterations=state.iterations, outer_loss=losses[0],
            inner_loss=losses[1],
        )  # fmt: skip
        return x, hyper, stats

    def _whole(
        self, ps: Tensors, hs: Tensors, x0: Tensors, warm: bool, budget: torch.Tensor
    ) -> tuple[Tensors, Tensors, torch.Tensor]:
        b, g_hs, losses, state = self._start(ps, hs, x0, warm)
        state = self._chunk(ps, hs, state, budget)
        return self._finish(ps, hs, state, x0, b, g_hs, losses)

    def _dense_whole(
        self, ps: Tensors, hs: Tensors, x0: Tensors, warm: bool, budget: torch.Tensor
    ) -> tuple[Tensors, Tensors, torch.Tensor]:
        b, g_hs, lo = self._outer(ps, hs)
        losses = torch.stack([lo, self.inner(ps, hs)])
        mat, unflat = _hessian(self.inner, ps, hs)
        damping, kernel = self.damping, self.kernel

        def op(v: Tensors) -> Tensors:  # (H + damping I) v, as _op adds the damping
            hv = (v[0] @ mat,)  # J^T v, as the pullback gives
            return axpy(damping, v, hv) if damping else hv

        bf, xf = (flatten(b),), (flatten(x0),)
        r = tuple(bi - a for bi, a in zip(bf, op(xf))) if warm else bf
        state = loop(
            lambda st: ~st.done & (st.iterations < budget),
            lambda st: kernel.step(op, st, ~st.done & (st.iterations < budget)),
            kernel.init(bf, r, xf),
        )
        state = state._replace(**{k: unflat(getattr(state, k)[0]) for k in kernel.vectors})
        return self._finish(ps, hs, state, x0, b, g_hs, losses)


class _DenseGraphs(_Graphs):
    """The driver of a :class:`~hypergrad.solvers.functional.DenseKernel`: one graph (the dense
    Hessian, the kernel's solve, the residual, the mixed term)."""

    kernel: DenseKernel[Any]

    def __init__(
        self, inner: FlatLoss, outer: FlatLoss, solver: Solver, wrap: Callable[..., Any]
    ) -> None:
        super().__init__(inner, outer, solver, wrap)
        self.graph: Callable[[Tensors, Tensors], tuple[Tensors, Tensors, torch.Tensor]]
        self.graph = wrap(self._direct)

    def solve(
        self, ps: Tensors, hs: Tensors, x0: Tensors, warm: bool
    ) -> tuple[Tensors, Tensors, torch.Tensor]:
        return self.graph(ps, hs)

    def _direct(self, ps: Tensors, hs: Tensors) -> tuple[Tensors, Tensors, torch.Tensor]:
        b, g_hs, lo = self._outer(ps, hs)
        lin = self.inner(ps, hs)
        mat, unflat = _hessian(self.inner, ps, hs)
        x, named = self.kernel.solve(mat, b, unflat)
        hyper, norms = self._epilogue(ps, hs, x, b, g_hs)
        stats = _stats(self.kernel, **norms, outer_loss=lo, inner_loss=lin, **named)
        return x, hyper, stats


def _hessian(
    inner: FlatLoss, ps: Tensors, hs: Tensors
) -> tuple[torch.Tensor, Callable[[torch.Tensor], Tensors]]:
    """The inner Hessian at ``(ps, hs)`` as a dense ``(n, n)`` matrix over all the leaves
    (:func:`~hypergrad.solvers.functional.dense_hessian`) and the function splitting a flat
    vector into the leaves."""
    unflat = unflattener(ps)
    mat, _, _ = dense_hessian(lambda z: inner(unflat(z), hs), flatten(ps))
    return mat, unflat


def _graphs_for(solver: Solver) -> type[_Graphs]:
    """The driver of ``solver``'s kernel.

    Raises:
        HypergradValueError: a solver without a kernel, or settings its kernel refuses.
    """
    kernel = _kernel(solver)
    return _IterativeGraphs if isinstance(kernel, IterativeKernel) else _DenseGraphs


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
        return torch.compile(own_code(fn), fullgraph=True, dynamic=False, options=options)

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
        k = g.kernel
        st, own = _read_stats(k, stats)
        b_norm = st.b_norm
        rel = st.residual / b_norm if b_norm > 0 else 0.0
        s = self.solver
        if k.fallback(st, own, rel):
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
        info.matvecs = k.matvecs(sum(t.numel() for t in ps), its, warm)
        info.residual = rel
        info.extras.update(b_norm=b_norm, residual_verified=True, compiled=bool(self.compiled))
        info.diverged = bool(st.diverged)
        tol = k.tol()
        info.converged = not info.diverged and tol is not None and info.residual <= tol
        k.diagnose(info, st, own, ps[0].dtype)
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
