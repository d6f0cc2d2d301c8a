"""What the stochastic bilevel solvers share: the state (checkpointed bit for bit), the solver
base class (frozen, validated settings; ``init`` and ``step``), the held-out diagnostics and the
:func:`run` loop with its divergence checks.

Sign convention of the adjoint, for every solver: ``v`` approximates
``v*(x) = -[∇²_zz G]⁻¹ ∇_z F`` at ``z = z*(x)``, the minimiser of
``½ vᵀ ∇²_zz G v + ∇_z Fᵀ v``, so the hypergradient is ``∇h(x) = ∇_x F + ∇²_xz G · v*``
(Dagréou et al. 2022's convention).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..errors import HypergradValueError, SolverDivergedWarning, warn
from ..settings import FrozenSettings, check_iters, check_number
from ..tree import (
    PyTree,
    Tensors,
    tree_add,
    tree_all_finite,
    tree_flatten,
    tree_norm,
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


@dataclass
class StochasticReport:
    """What :func:`run` did.

    Attributes:
        solver: the solver's ``name``.
        iterations: iterations done in this call.
        inner_calls: inner oracle calls since the state's start (gradients and products).
        outer_calls: outer oracle calls since the state's start.
        diverged: the iterates became non-finite, grew past the limit, or the held-out inner
            gradient grew past it; a :class:`~hypergrad.SolverDivergedWarning` was emitted and
            the run stopped.
        reason: why it stopped (``"iterations"``, ``"callback"`` or the divergence's cause).
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
) -> tuple[PyTree, StochasticReport]:
    """Run ``solver`` for ``iterations`` steps from ``(z0, x0)`` (or from ``state``).

    Args:
        solver: a stochastic solver (:class:`~hypergrad.stochastic.SOBA`, ...).
        problem: the :class:`~hypergrad.stochastic.Bilevel` problem.
        z0: start of the inner variable (unused with ``state``).
        x0: start of the outer variable (unused with ``state``).
        iterations: the iteration budget.
        state: resume from this state (e.g. ``report.state``, or one restored by
            ``load_state_dict``).
        callback: called with the state after every iteration; returning False stops the run.
        eval_every: held-out :class:`Diagnostics` every this many iterations (and at the end);
            None: at the end only.
        growth: the run is reported diverged when the iterates' norm exceeds ``growth`` times
            ``1 +`` their starting norm, or the held-out inner gradient norm exceeds ``growth``
            times ``1 +`` its first value.

    Returns:
        ``(x, report)``: the final ``x`` in the user's structure and a
        :class:`StochasticReport`. A divergence (NaN/Inf or growth) stops the run with a
        :class:`~hypergrad.SolverDivergedWarning`; it is never silent.

    Raises:
        HypergradValueError: neither ``state`` nor both ``z0`` and ``x0`` given, or a bad count.
    """
    iterations = check_iters("run iterations", iterations, 0, allow_none=False)
    eval_every = check_iters("run eval_every", eval_every, 1, allow_none=True)
    growth = check_number("run growth", growth, minimum=1.0, strict=True)
    if state is None:
        if z0 is None or x0 is None:
            raise HypergradValueError("run needs z0 and x0, or a state to resume from")
        state = solver.init(z0, x0)
    start = time.perf_counter()
    scale = 1.0 + float(tree_norm(state.x + state.z + state.v + state.y))
    history: list[Diagnostics] = []
    first_grad: float | None = None
    reason, diverged, done = "iterations", False, 0
    for i in range(iterations):
        state = solver.step(state, problem)
        done = i + 1
        why = _divergence(state, scale, growth)
        if why is None and eval_every is not None and done % eval_every == 0:
            why, first_grad = _held_out(solver, state, problem, history, first_grad, growth)
        if why is not None:
            reason, diverged = why, True
            _warn_diverged(solver, state, why)
            break
        if callback is not None and callback(state) is False:
            reason = "callback"
            break
    if not diverged and (not history or history[-1].iteration != state.iteration):
        history.append(solver.diagnose(state, problem))
    report = StochasticReport(
        solver=solver.name,
        iterations=done,
        inner_calls=state.inner_calls,
        outer_calls=state.outer_calls,
        diverged=diverged,
        reason=reason,
        history=history,
        state=state,
        seconds=time.perf_counter() - start,
    )
    return state.x_tree(), report


def _held_out(
    solver: StochasticSolver,
    state: StochasticState,
    problem: Bilevel,
    history: list[Diagnostics],
    first_grad: float | None,
    growth: float,
) -> tuple[str | None, float | None]:
    """:func:`run`'s periodic :class:`Diagnostics` (appended to ``history``): the divergence it
    shows (None if none) and the first held-out inner gradient norm."""
    d = solver.diagnose(state, problem)
    history.append(d)
    if first_grad is None:
        first_grad = d.inner_grad_norm
    if not math.isfinite(d.inner_grad_norm) or d.inner_grad_norm > growth * (1.0 + first_grad):
        return f"held-out inner gradient norm {d.inner_grad_norm:.3g}", first_grad
    return None, first_grad


def _warn_diverged(solver: StochasticSolver, state: StochasticState, why: str) -> None:
    """The :class:`~hypergrad.SolverDivergedWarning` of a run stopped by divergence."""
    warn(
        f"{solver.name}: diverged at iteration {state.iteration} ({why}); the step "
        "sizes are likely too large for this problem's smoothness: reduce them",
        SolverDivergedWarning,
    )
