"""``compile_implicit_grad``: the implicit hypergradient as ``torch.func`` code, compiled.

:func:`~hypergrad.implicit_grad` runs eagerly: every Hessian-vector product is an
``autograd.grad`` call and every solver step a few small tensor operations, each paying
Python and dispatcher overhead (tens of microseconds). On a problem with tens of unknowns that
overhead is nearly all of the time. This module writes the same computation with
``torch.func`` (``grad``, ``vjp``, ``jacrev``) so that ``torch.compile`` can trace it into a few
fused graphs:

* *start*: the outer loss's gradients (the right-hand side ``b`` and the direct term), the
  starting residual and the solver's state;
* for :class:`~hypergrad.CG` and :class:`~hypergrad.Neumann`, a *chunk* of :data:`CHUNK`
  iterations, called until the solve stops (one host sync per chunk); an iteration that would
  run after the stopping test is masked, so the chunk size never changes the answer. Each chunk
  rebuilds the inner gradient's linearisation once (one extra forward and backward per chunk
  compared with the eager ``"reuse"`` engine);
* *finish*: the residual ``||(H + damping I) x - b|| / ||b||`` recomputed from ``x`` (one more
  product, always: ``converged`` is verified, as in the eager solvers) and the mixed term.

With ``maxiter <= CHUNK`` the three run as one graph; :class:`~hypergrad.Exact` is always one
graph (the dense Hessian from one ``jacrev``, a float64 LU solve, the residual, the mixed term).
Each graph is compiled on its first call for given shapes and dtypes; that call takes seconds
(``info.extras["first_call"]`` is True and its ``time_s`` includes the compilation). Measured
costs and the number of calls after which compiling pays off are in ``docs/solvers.md``. The
first call for new shapes also runs :func:`~hypergrad.implicit_grad` once, eagerly, to apply its
input checks (NaN/Inf, non-leaf tensors, hyperparameters that influence nothing) with the same
error messages. Every instance compiles its own copy of the graph code (see :func:`_own_code`).

Differences from :func:`~hypergrad.implicit_grad`: no restart of CG when the recurrence residual
and the recomputed one disagree (the recomputed residual still decides ``converged``); the
Neumann step ``alpha`` must be given (no power iteration); ``Exact`` computes no condition
number: when LU meets a zero pivot, misses the residual ``1e-6``, or ``||A||_1 ||A^-1 v||_1 /
||v||_1`` for ``v`` = ``b`` and two fixed probes (a lower bound on the condition number)
reaches ``ILL_CONDITIONED``, that call is
answered by the eager solve (``extras["compiled_fallback"]``; the pseudo-inverse and its
report). CG's tests for singular systems (its best iterate included) and Neumann's stall test
are the eager ones, so ``info.solve.failure`` and the warnings agree; no preconditioner, no
``engine="recompute"``, no ``distributed``; MINRES and Nystrom are not available.
``compile=False`` runs the same functional code eagerly (for debugging a loss that does not
trace).
"""

from __future__ import annotations

import itertools
import time
import types
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
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
    """An iterative solver: *start* (its state), *chunk* (:data:`CHUNK` masked iterations,
    called until ``state.done``) and *finish*; *whole* is the three in one graph, for
    ``maxiter <= CHUNK``. A subclass writes :meth:`_begin`, :meth:`_chunk` and :meth:`_answer`.
    """

    def __init__(
        self, inner: FlatLoss, outer: FlatLoss, solver: Solver, wrap: Callable[..., Any]
    ) -> None:
        super().__init__(inner, outer, solver, wrap)
        self.start = wrap(self._start)
        self.chunk = wrap(self._chunk)
        self.finish = wrap(self._finish)
        self.whole = wrap(self._whole)  # start + one chunk + finish, for maxiter <= CHUNK

    def _begin(self, b: Tensors, r: Tensors, x0: Tensors) -> Any:
        """The state before the first iteration (``r``: the starting residual)."""
        raise NotImplementedError

    def _chunk(self, ps: Tensors, hs: Tensors, state: Any, budget: torch.Tensor) -> Any:
        """:data:`CHUNK` iterations, those past ``budget`` or the stopping test masked."""
        raise NotImplementedError

    def _answer(self, state: Any, x0: Tensors) -> tuple[Tensors, dict[str, torch.Tensor]]:
        """The solution and the solver's own :class:`Stats` fields."""
        raise NotImplementedError

    def solve(
        self, ps: Tensors, hs: Tensors, x0: Tensors, warm: bool
    ) -> tuple[Tensors, Tensors, torch.Tensor]:
        s = self.solver
        maxiter = default_maxiter(ps) if s.maxiter is None else s.maxiter  # type: ignore[attr-defined]
        if maxiter <= CHUNK:  # one graph, one host sync
            return self.whole(ps, hs, x0, warm, torch.tensor(maxiter))  # type: ignore[no-any-return]
        b, g_hs, losses, state = self.start(ps, hs, x0, warm)
        for spent in range(0, maxiter, CHUNK):  # one host sync per chunk
            if bool(state.done):
                break
            state = self.chunk(ps, hs, state, torch.tensor(maxiter - spent))
        return self.finish(ps, hs, state, x0, b, g_hs, losses)  # type: ignore[no-any-return]

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

    def _chunk(self, ps: Tensors, hs: Tensors, state: CGState, budget: torch.Tensor) -> CGState:
        _, pullback = self._linearised(ps, hs)
        x, r, p, rs, stop, done = state.x, state.r, state.p, state.rs, state.stop, state.done
        negc, sing, its = state.negative_curvature, state.singular, state.iterations
        best_x, best_rs, a_norm = state.best_x, state.best_rs, state.a_norm
        crtol, glimit = singular_limits(x)
        for i in range(CHUNK):  # the steps and tests of the eager solve_cg, masked
            active = ~done & (budget > i)
            ap = self._op(pullback, p)
            pap, pp, apap = _dot(p, ap), _dot(p, p), _dot(ap, ap)
            broken = ~(torch.isfinite(pap) & torch.isfinite(apap)) | ((apap == 0) & (pap == 0))
            neg = active & broken
            a_norm = torch.where(
                active & ~broken, torch.maximum(a_norm, (apap / pp).sqrt()), a_norm
            )
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
            p = tuple(
                torch.where(active, ri + (beta * pi).to(pi.dtype), pi) for ri, pi in zip(r, p)
            )
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

    def _chunk(
        self, ps: Tensors, hs: Tensors, state: NeumannState, budget: torch.Tensor
    ) -> NeumannState:
        _, pullback = self._linearised(ps, hs)
        acc, v, norm_min, stop, done = state.acc, state.v, state.norm_min, state.stop, state.done
        grew, last, ratio, its = state.grew, state.last, state.ratio, state.iterations
        alpha, limit = self.solver.alpha, 1.0 + growth_tol(v[0].dtype)  # type: ignore[attr-defined]
        for i in range(CHUNK):
            active = ~done & (budget > i)
            v_next = _axpy(-alpha, self._op(pullback, v), v)
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
        sizes = [t.numel() for t in ps]
        n = sum(sizes)

        def unflat(z: torch.Tensor) -> Tensors:
            parts = z.split(sizes)  # type: ignore[no-untyped-call]
            return tuple(c.reshape(t.shape) for c, t in zip(parts, ps))

        def flat_grad(z: torch.Tensor) -> torch.Tensor:
            g = grad(self.inner, argnums=0)(unflat(z), hs)
            return torch.cat([t.reshape(-1) for t in g])

        z = torch.cat([t.reshape(-1) for t in ps])
        mat = jacrev(flat_grad)(z).to(torch.float64)  # one vmap-ed product over the unit vectors
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


class CompiledImplicitGrad:
    """The callable returned by :func:`compile_implicit_grad` (see there).

    Attributes:
        solver: the solver whose method and settings the graphs implement.
        compiled: whether the graphs go through ``torch.compile``.

    Raises:
        HypergradValueError: a solver :func:`compile_implicit_grad` does not support.
    """

    def __init__(
        self, inner_loss: Loss, outer_loss: Loss, solver: Solver, compiled: bool, mode: str | None
    ) -> None:
        self.inner_loss, self.outer_loss = inner_loss, outer_loss
        self._kind = _graphs_for(solver)
        self._solver, self.compiled, self._mode = solver, compiled, mode
        self._graphs: dict[Any, _Graphs] = {}

    @property
    def solver(self) -> Solver:
        """The solver (read-only: its graphs are built from it; settings are frozen too)."""
        return self._solver

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        if not self.compiled:
            return fn
        return torch.compile(_own_code(fn), fullgraph=True, dynamic=False, mode=self._mode)

    def __call__(
        self, params: PyTree, hparams: PyTree, *, x0: PyTree | None = None
    ) -> tuple[PyTree, HypergradInfo]:
        """``(hypergrads, info)`` at ``params`` exactly as :func:`~hypergrad.implicit_grad`."""
        t0 = time.perf_counter()
        p_leaves, p_spec = tree_flatten(params, "params")
        h_leaves, h_spec = tree_flatten(hparams, "hparams")
        key = (p_spec, h_spec) + tuple((t.shape, t.dtype, t.device) for t in p_leaves + h_leaves)
        first = key not in self._graphs
        if first:  # the eager entry point's input checks, once per signature
            with warnings.catch_warnings():  # the compiled solve warns for itself
                warnings.simplefilter("ignore")
                implicit_grad(self.inner_loss, self.outer_loss, params, hparams, solver=self.solver)

            def inner(ps: Tensors, hs: Tensors) -> torch.Tensor:
                return self.inner_loss(tree_unflatten(p_spec, ps), tree_unflatten(h_spec, hs))

            def outer(ps: Tensors, hs: Tensors) -> torch.Tensor:
                return self.outer_loss(tree_unflatten(p_spec, ps), tree_unflatten(h_spec, hs))

            self._graphs[key] = self._kind(inner, outer, self.solver, self._wrap)
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
            hinfo.solve.extras.update(compiled=self.compiled, compiled_fallback=True)
            hinfo.extras["first_call"] = first
            return g_eager, hinfo
        if not st.finite:
            raise HypergradValueError("the hypergradient contains NaN/Inf")
        its = int(st.iterations)
        info = SolveInfo(solver=s.name, iterations=its)
        info.matvecs = g.matvecs(sum(t.numel() for t in ps), its, warm)
        info.residual = rel
        info.extras.update(b_norm=b_norm, residual_verified=True, compiled=self.compiled)
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
    compile: bool = True,
    mode: str | None = None,
) -> CompiledImplicitGrad:
    """A compiled ``implicit_grad(inner_loss, outer_loss, params, hparams, solver=solver)``.

    Returns a callable ``f(params, hparams, *, x0=None) -> (hypergrads, info)`` with the
    arguments, results and diagnostics of :func:`~hypergrad.implicit_grad`, computed by
    ``torch.func`` code that ``torch.compile`` fuses into a few graphs (see
    :mod:`hypergrad.compiled`). It pays off on small problems called many times, where eager
    overhead dominates: on a 30-unknown ridge problem one call is several times faster, but the
    first call compiles for tens of seconds (``docs/performance.md`` has the measured break-even).
    The losses must be traceable by ``torch.func`` and ``torch.compile`` (pure functions of their
    arguments: no ``.item()``, no data-dependent Python control flow, no in-place updates of
    captured tensors).

    Args:
        inner_loss: ``(params, hparams) -> scalar``.
        outer_loss: ``(params, hparams) -> scalar``.
        solver: ``hg.CG`` (no preconditioner), ``hg.Neumann`` with an explicit ``alpha``, or
            ``hg.Exact``; default ``hg.Exact()``.
        compile: False runs the same functional code without ``torch.compile``.
        mode: ``torch.compile``'s ``mode``.

    Raises:
        HypergradValueError: another solver, Neumann without ``alpha``, CG with a
            preconditioner.

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
    solver = Exact() if solver is None else solver
    return CompiledImplicitGrad(inner_loss, outer_loss, solver, bool(compile), mode)
