"""What the stochastic bilevel solvers share: the state (checkpointed bit for bit), the solver
base class (frozen, validated settings; ``init`` and ``step``), the held-out diagnostics and the
:func:`run` loop with its divergence, tolerance and stall checks.

Sign convention of the adjoint, for every solver: ``v`` approximates
``v*(x) = -[∇²_zz G]⁻¹ ∇_z F`` at ``z = z*(x)``, the minimiser of
``½ vᵀ ∇²_zz G v + ∇_z Fᵀ v``, so the hypergradient is ``∇h(x) = ∇_x F + ∇²_xz G · v*``
(Dagréou et al. 2022's convention).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..errors import HypergradValueError, SolverDivergedWarning, SolverStalledWarning, warn
from ..settings import FrozenSettings, check_iters, check_number
from ..tree import (
    PyTree,
    Tensors,
    tree_add,
    tree_all_finite,
    tree_flatten,
    tree_norm,
    tree_sub,
    tree_unflatten,
)
from .oracles import Bilevel, Linearization, Specs, gradients


@dataclass
class StochasticState:
    """Where a stochastic bilevel run stands: its iterates and its position in the data.

    Attributes:
        x: outer variable (flat leaves of the user's ``x``).
        z: inner variable.
        v: adjoint (``-[∇²G]⁻¹∇_zF``; empty for BOME, which keeps none).
        y: the second copy of the inner variable of F²SA (the penalised problem's minimiser);
            empty otherwise.
        memory: SABA's per-block tables (``"<name>"``: leaves with a leading block dimension,
            ``"<name>_mean"`` their means); SRBA's directions and previous iterate
            (``"srba_*"``); empty otherwise.
        iteration: iterations done (outer steps).
        inner_draws: inner batches drawn so far (the counter of ``inner_sampler``).
        outer_draws: outer batches drawn so far.
        inner_calls: inner oracle calls (gradients, Hessian-vector and cross products).
        outer_calls: outer oracle calls (``∇_z F`` and ``∇_x F`` count one each).
        multiplier: the last penalty or barrier multiplier (F²SA's λ_k, BOME's λ); NaN otherwise.
        specs: the pytree structures of ``z`` and ``x``.

    :meth:`state_dict` and :meth:`load_state_dict` round-trip it through ``torch.save`` bit
    for bit: a run of 2N steps equals N steps, a save and a load, and N more.
    """

    x: Tensors
    z: Tensors
    v: Tensors
    specs: Specs
    y: Tensors = ()
    memory: dict[str, Tensors] = field(default_factory=dict)
    iteration: int = 0
    inner_draws: int = 0
    outer_draws: int = 0
    inner_calls: int = 0
    outer_calls: int = 0
    multiplier: float = math.nan

    _TENSORS: ClassVar[tuple[str, ...]] = ("x", "z", "v", "y")
    _INTS: ClassVar[tuple[str, ...]] = (
        "iteration",
        "inner_draws",
        "outer_draws",
        "inner_calls",
        "outer_calls",
    )

    def state_dict(self) -> dict[str, Any]:
        """Cloned tensors and counters, for ``torch.save``."""
        out: dict[str, Any] = {k: [t.clone() for t in getattr(self, k)] for k in self._TENSORS}
        out["memory"] = {k: [t.clone() for t in m] for k, m in self.memory.items()}
        out.update({k: getattr(self, k) for k in self._INTS})
        out["multiplier"] = self.multiplier
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (the structures ``specs`` are kept).

        Raises:
            HypergradValueError: a key is missing, or the leaves differ in number or shape.
        """
        missing = [k for k in (*self._TENSORS, *self._INTS, "memory") if k not in state]
        if missing:
            raise HypergradValueError(f"state_dict lacks {missing}")
        for k in ("x", "z"):
            mine, theirs = getattr(self, k), state[k]
            if len(mine) != len(theirs) or any(
                a.shape != b.shape for a, b in zip(mine, theirs, strict=True)
            ):
                raise HypergradValueError(f"state_dict's {k} does not match this state's shapes")
        for k in self._TENSORS:
            setattr(self, k, tuple(t.clone() for t in state[k]))
        self.memory = {k: tuple(t.clone() for t in m) for k, m in state["memory"].items()}
        for k in self._INTS:
            setattr(self, k, int(state[k]))
        self.multiplier = float(state.get("multiplier", math.nan))

    def copy(self) -> StochasticState:
        """A shallow copy (tensors are never updated in place by the solvers)."""
        return dataclasses.replace(self, memory=dict(self.memory))

    def x_tree(self) -> PyTree:
        """``x`` in the user's pytree structure."""
        return tree_unflatten(self.specs.x, self.x)

    def z_tree(self) -> PyTree:
        """``z`` in the user's pytree structure."""
        return tree_unflatten(self.specs.z, self.z)


def draw_inner(problem: Bilevel, state: StochasticState) -> Any:
    """The next inner batch (advances ``state.inner_draws``)."""
    batch = problem.inner_sampler(state.inner_draws)
    state.inner_draws += 1
    return batch


def draw_outer(problem: Bilevel, state: StochasticState) -> Any:
    """The next outer batch (advances ``state.outer_draws``)."""
    batch = problem.outer_sampler(state.outer_draws)
    state.outer_draws += 1
    return batch


@dataclass
class Diagnostics:
    """Held-out estimates at one iteration (NaN where a solver has no such quantity).

    Attributes:
        iteration: the state's iteration.
        inner_grad_norm: ``||∇_z G(z, x)||`` on the held-out inner batch.
        adjoint_residual: ``||∇²_zz G v + ∇_z F||`` on the held-out batches (NaN without ``v``).
        outer_grad_norm: ``||∇_x F + ∇²_xz G v||``, the hypergradient estimate's norm there
            (BOME, which has no ``v``: ``||∇_x F||`` at its ``z``).
    """

    iteration: int
    inner_grad_norm: float
    adjoint_residual: float
    outer_grad_norm: float


class StochasticSolver(FrozenSettings):
    """Base class of the stochastic bilevel solvers: frozen settings, :meth:`init`, :meth:`step`.

    A subclass is a keyword-only dataclass of its settings (validated once, then frozen;
    ``replace(...)`` builds a validated copy) whose :meth:`step` returns the next state.
    ``name`` names it in reports; ``cost`` is its oracle calls per iteration (inner, outer) as a
    formula of its settings (:meth:`calls`).
    """

    name: ClassVar[str] = "stochastic"

    def init(self, z0: PyTree, x0: PyTree, v0: PyTree | None = None) -> StochasticState:
        """The state at ``(z0, x0)`` (``v0``: the adjoint's start, zeros when None)."""
        z, zs = tree_flatten(z0, "z0")
        x, xs = tree_flatten(x0, "x0")
        zt, xt = tuple(t.detach().clone() for t in z), tuple(t.detach().clone() for t in x)
        for name, leaves in (("z0", zt), ("x0", xt)):
            if not leaves or any(not t.is_floating_point() for t in leaves):
                raise HypergradValueError(f"{name} must be a pytree of floating-point tensors")
        if v0 is None:
            v: Tensors = tuple(torch.zeros_like(t) for t in zt)
        else:
            v = tuple(t.detach().clone() for t in tree_flatten(v0, "v0")[0])
        return self._init(StochasticState(x=xt, z=zt, v=v, specs=Specs(zs, xs)))

    def _init(self, state: StochasticState) -> StochasticState:
        return state

    def step(self, state: StochasticState, problem: Bilevel) -> StochasticState:
        """One iteration: the next state (``state`` itself is left unchanged)."""
        raise NotImplementedError

    def adjoint(self, state: StochasticState) -> Tensors | None:
        """The solver's adjoint estimate ``≈ -[∇²G]⁻¹∇_zF`` (None when it keeps none)."""
        return state.v if state.v else None

    def diagnose(self, state: StochasticState, problem: Bilevel) -> Diagnostics:
        """:class:`Diagnostics` on the problem's held-out batches (not counted as oracle calls)."""
        bi, bo = problem.heldout()
        lin = Linearization(problem, state.specs, state.z, state.x, bi)
        fz, fx = gradients(problem.outer_loss, "outer_loss", state.specs, state.z, state.x, bo)
        v = self.adjoint(state)
        if v is None:
            res, out = math.nan, float(tree_norm(fx))
        else:
            hv, cross = lin.products(v)
            res = float(tree_norm(tree_add(hv, fz)))
            out = float(tree_norm(tree_add(fx, cross)))
        return Diagnostics(state.iteration, float(tree_norm(lin.grad)), res, out)


#: Why :func:`run` stopped: the values of :attr:`StochasticReport.reason`.
REASONS = ("converged", "maxiter", "stalled", "diverged", "callback")

#: The stall test of :func:`run` stops a run (``reason == "stalled"``, a
#: :class:`~hypergrad.SolverStalledWarning`) at an evaluation with more than ``stall_window``
#: before it when (a) no held-out estimate's best over the last ``stall_window`` evaluations is
#: below STALL_PROGRESS times its best before them, and (b) the iterates still move as much
#: (STALL_SHRINK below). A run still converging (SABA's or SRBA's on a plateau of minibatch
#: held-out estimates included) moves less and less; one at the noise floor of constant steps
#: keeps moving as much; one at the precision of its dtype no longer moves.
#: Progress, for the stall test: a held-out estimate's best value over the window fell below
#: this fraction of its best value before the window.
STALL_PROGRESS = 0.9

#: Still converging, for the stall test: the iterates' path length (the sum of their moves
#: between consecutive evaluations) over the window's second half is below this fraction of
#: that over its first half.
STALL_SHRINK = 1.0


@dataclass
class StochasticReport:
    """What :func:`run` did.

    Attributes:
        solver: the solver's ``name``.
        iterations: iterations done in this call.
        inner_calls: inner oracle calls since the state's start (gradients and products).
        outer_calls: outer oracle calls since the state's start.
        diverged: ``reason == "diverged"``: the iterates became non-finite, grew past the
            limit, or the held-out inner gradient grew past it; a
            :class:`~hypergrad.SolverDivergedWarning` was emitted and the run stopped.
        reason: why it stopped, one of ``hypergrad.stochastic.base.REASONS``: ``"maxiter"``
            (the iteration budget ran out; warned only when a ``tol`` was given and not met);
            ``"converged"`` (every held-out estimate was within ``tol`` at an evaluation:
            estimates on the held-out batches, see :class:`Diagnostics`); ``"stalled"`` (the
            held-out estimates made no progress over the last ``stall_window`` evaluations
            while the iterates kept moving as much, or no longer moved: the noise floor of
            constant steps, or the dtype's precision; a
            :class:`~hypergrad.SolverStalledWarning`); ``"diverged"`` (see ``diverged``);
            ``"callback"`` (the callback returned False).
        detail: a sentence on the cause of a ``"diverged"``, ``"stalled"``, ``"converged"`` or
            warned ``"maxiter"`` stop, with its numbers ("" otherwise).
        history: :class:`Diagnostics` every ``eval_every`` iterations and at the end.
        state: the final state (resume with ``run(..., state=report.state)``).
        seconds: wall time of the loop (diagnostics included).
    """

    solver: str
    iterations: int
    inner_calls: int
    outer_calls: int
    diverged: bool
    reason: str
    history: list[Diagnostics]
    state: StochasticState
    seconds: float
    detail: str = ""

    @property
    def z(self) -> PyTree:
        """The final inner variable, in the user's structure."""
        return self.state.z_tree()


def _divergence(state: StochasticState, scale: float, growth: float) -> str | None:
    tensors = state.x + state.z + state.v + state.y
    if not tree_all_finite(tensors):
        return "non-finite iterates"
    size = float(tree_norm(tensors))
    if size > growth * scale:
        return f"iterates grew to norm {size:.3g} (limit {growth:g} x {scale:.3g})"
    return None


def run(
    solver: StochasticSolver,
    problem: Bilevel,
    z0: PyTree | None = None,
    x0: PyTree | None = None,
    *,
    iterations: int,
    state: StochasticState | None = None,
    callback: Callable[[StochasticState], bool | None] | None = None,
    eval_every: int | None = None,
    growth: float = 1e6,
    tol: float | None = None,
    stall_window: int | None = 10,
) -> tuple[PyTree, StochasticReport]:
    """Run ``solver`` for ``iterations`` steps from ``(z0, x0)`` (or from ``state``).

    Args:
        solver, problem: a stochastic solver (``SOBA``, ...) and a :class:`Bilevel` problem.
        z0, x0: the starts of the inner and outer variables (unused with ``state``).
        iterations: the iteration budget.
        state: resume from this state (``report.state``, or one ``load_state_dict`` restored).
        callback: called with the state after every iteration; returning False stops the run.
        eval_every: held-out :class:`Diagnostics` every this many iterations and at the end
            (None: at the end only, and neither ``tol`` nor the stall test is checked).
        growth: diverged when the iterates' or held-out inner gradient's norm exceeds
            ``growth (1 + its first value)``.
        tol: ``reason == "converged"`` once every finite held-out estimate is <= ``tol``.
        stall_window: the stall test's window in evaluations (>= 2; None: off; the rule is
            at ``STALL_PROGRESS``), spanning several error halvings; it only stops the run.

    Returns:
        ``(x, report)``: the final ``x`` and a :class:`StochasticReport` (a divergence or a
        stall stops the run with a ``SolverDivergedWarning``/``SolverStalledWarning``).

    Raises:
        HypergradValueError: neither ``state`` nor both ``z0`` and ``x0`` given, or a bad count.
    """
    iterations = check_iters("run iterations", iterations, 0, allow_none=False)
    eval_every = check_iters("run eval_every", eval_every, 1, allow_none=True)
    growth = check_number("run growth", growth, minimum=1.0, strict=True)
    tol = check_number("run tol", tol, minimum=0.0, allow_none=True)
    stall_window = check_iters("run stall_window", stall_window, 2, allow_none=True)
    if state is None:
        if z0 is None or x0 is None:
            raise HypergradValueError("run needs z0 and x0, or a state to resume from")
        state = solver.init(z0, x0)
    start = time.perf_counter()
    scale = 1.0 + float(tree_norm(state.x + state.z + state.v + state.y))
    monitor = _Monitor(solver, problem, growth, tol, stall_window)
    reason, detail, done = "maxiter", "", 0
    for i in range(iterations):
        state = solver.step(state, problem)
        done = i + 1
        why = _divergence(state, scale, growth)
        stop = None if why is None else ("diverged", why)
        if stop is None and eval_every is not None and done % eval_every == 0:
            stop = monitor.evaluate(state)
        if stop is not None:
            reason, detail = stop
            break
        if callback is not None and callback(state) is False:
            reason = "callback"
            break
    history = monitor.history
    if reason != "diverged" and (not history or history[-1].iteration != state.iteration):
        history.append(solver.diagnose(state, problem))
    if reason == "maxiter" and tol is not None:
        detail = f"held-out estimates {_estimates(history[-1])} above tol {tol:g}"
    _warn_stop(solver, state, reason, detail, tol)
    report = StochasticReport(
        solver=solver.name, iterations=done, inner_calls=state.inner_calls,
        outer_calls=state.outer_calls, diverged=reason == "diverged", reason=reason,
        history=history, state=state, seconds=time.perf_counter() - start, detail=detail,
    )  # fmt: skip
    return state.x_tree(), report


_MEASURES = ("inner_grad_norm", "adjoint_residual", "outer_grad_norm")


def _measures(d: Diagnostics) -> list[float]:
    """The held-out estimates of ``d``, NaN where the solver has none."""
    return [getattr(d, name) for name in _MEASURES]


def _estimates(d: Diagnostics) -> str:
    return ", ".join(f"{n} {v:.3g}" for n, v in zip(_MEASURES, _measures(d)) if math.isfinite(v))


def _best(history: list[Diagnostics], k: int) -> float:
    """The least finite value of measure ``k`` in ``history`` (inf if none)."""
    return min((v for d in history if math.isfinite(v := _measures(d)[k])), default=math.inf)


class _Monitor:
    """:func:`run`'s periodic held-out checks: the :class:`Diagnostics` history, the
    divergence of the held-out inner gradient, ``tol`` and the stall test (which keeps the
    iterates of the last evaluations: references, as the solvers never update in place)."""

    def __init__(
        self,
        solver: StochasticSolver,
        problem: Bilevel,
        growth: float,
        tol: float | None,
        window: int | None,
    ):
        self.solver, self.problem, self.growth = solver, problem, growth
        self.tol, self.window = tol, window
        self.history: list[Diagnostics] = []
        self.first_grad: float | None = None
        self.last: Tensors | None = None
        self.moves: deque[float] = deque(maxlen=window or 0)

    def evaluate(self, state: StochasticState) -> tuple[str, str] | None:
        """The evaluation at ``state``: ``(reason, detail)`` if the run must stop, else None."""
        d = self.solver.diagnose(state, self.problem)
        self.history.append(d)
        if self.first_grad is None:
            self.first_grad = d.inner_grad_norm
        g = d.inner_grad_norm
        if not math.isfinite(g) or g > self.growth * (1.0 + self.first_grad):
            return "diverged", f"held-out inner gradient norm {g:.3g}"
        if self.tol is not None and all(not v > self.tol for v in _measures(d)):
            return "converged", f"held-out estimates {_estimates(d)} within tol {self.tol:g}"
        if self.window is None:
            return None
        now = state.x + state.z + state.v + state.y
        if self.last is not None:
            self.moves.append(float(tree_norm(tree_sub(now, self.last))))
        self.last = now
        return self._stalled()

    def _stalled(self) -> tuple[str, str] | None:
        w, h, moves = self.window, self.history, list(self.moves)
        if w is None or len(h) <= w:
            return None
        for k in range(len(_MEASURES)):
            before, now = _best(h[:-w], k), _best(h[-w:], k)
            if math.isfinite(before) and now < STALL_PROGRESS * before:
                return None  # progress
        half = w // 2
        recent, earlier = sum(moves[-half:]), sum(moves[-2 * half : -half])
        if recent < STALL_SHRINK * earlier:
            return None  # still converging
        return "stalled", (
            f"no held-out estimate improved by {1 - STALL_PROGRESS:.0%} over the last {w} "
            f"evaluations (iterations {h[-w].iteration}-{h[-1].iteration}; now "
            f"{_estimates(h[-1])}) while the iterates moved {recent:.3g} over the window's "
            f"second half, {earlier:.3g} over its first (path lengths)"
        )


_STOP_ADVICE = {
    "stalled": (
        "stalled (StochasticReport.reason == 'stalled'): the held-out estimates made no "
        "progress over the last evaluations while the iterates kept moving as much (or no "
        "longer moved at all), so more iterations at these steps will not improve them "
        "(report.detail has the numbers). With constant steps this is the solver's noise "
        "floor: decrease the steps (SOBA(decay=True)), enlarge the batches, or use a "
        "variance-reduced solver (SABA, SRBA); if the window spans too few iterations for a "
        "slowly converging run, raise stall_window (None turns this test off).",
        SolverStalledWarning,
    ),
    "maxiter": (
        "stopped at the iteration budget with held-out estimates above tol "
        "(StochasticReport.reason == 'maxiter'; report.detail has the numbers). Raise "
        "iterations, loosen tol, or check that the held-out batches' estimates can reach it "
        "(minibatch estimates do not vanish at the solution).",
        SolverStalledWarning,
    ),
}


def _warn_stop(
    solver: StochasticSolver, state: StochasticState, reason: str, detail: str, tol: float | None
) -> None:
    """The warning of a run that stopped short: divergence, a stall, or ``tol`` not met."""
    if reason == "diverged":
        warn(
            f"{solver.name}: diverged at iteration {state.iteration} ({detail}); the step "
            "sizes are likely too large for this problem's smoothness: reduce them",
            SolverDivergedWarning,
        )
    elif reason == "stalled" or (reason == "maxiter" and tol is not None):
        text, category = _STOP_ADVICE[reason]
        warn(f"{solver.name}: {text}", category)
