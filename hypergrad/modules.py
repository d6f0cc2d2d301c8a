"""``HyperStep``: hypergradients over ``nn.Module`` parameters (what BORT2 uses).

The inner model's parameters play ``psi`` and the hyper module's parameters play ``theta``. Two
methods, passed as objects (:mod:`hypergrad.methods`): ``hg.Implicit(solver=...)`` (default)
takes ``psi`` at its current values as an approximate inner solution and solves the
implicit-function linear system; ``hg.Unrolled(optimizer, steps=...)`` differentiates through
``steps`` look-ahead optimizer updates from the current ``psi`` (one step: the look-ahead of
Meta-Weight-Net and second-order DARTS), leaving the model's parameters unchanged. The user's
losses receive the live modules and may call any of their methods. Policies (both methods):

* Buffers: with ``buffers="freeze"`` (default) every buffer of both modules (BatchNorm running
  statistics, ``num_batches_tracked``) is swapped for a private copy during the hypergradient's own
  forward passes, so the running statistics after the step are bit-for-bit what they were before
  (BatchNorm in train mode still normalises with batch statistics). ``"update"`` lets those passes
  update the statistics as an ordinary forward would.
* Randomness: dropout masks, Gumbel noise and any other draw inside the inner loss are identical
  for every Hessian-vector product of one hypergradient (see :mod:`hypergrad.operators`).
* Gradients: the hypergradient is written to (or, with ``accumulate=True``, added to) the
  ``.grad`` of the hyper parameters; the inner model's ``.grad`` is never touched.
* Stationarity (implicit method): ``info.stationarity`` says how far the inner model is from a
  stationary point of the inner loss on the batch; it is reported, never warned about, because
  ``HyperStep`` is called away from the inner optimum by design (``HyperStep``'s
  ``measure_stationarity``; ``docs/modules.md``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
from torch import nn

from .distributed import all_gather_status, check_mode, make_reducer
from .errors import (
    HypergradError,
    HypergradTypeError,
    HypergradValueError,
    HypergradWarning,
    SolveFailedWarning,
    warn,
)
from .first_order import FirstOrderInfo, first_order_hypergrad, update_derivative
from .implicit.adjoint import hypergradient_core
from .methods import FirstOrder, Implicit, SingleLoop, Unrolled, WarmStart
from .operators import check_scalar_loss
from .report import HypergradInfo, average_if_local, explain_dtype_errors
from .single_loop import SingleLoopInfo, single_loop_step
from .solvers import Solver
from .solvers.base import failure_warning
from .tree import Tensors, tree_all_finite, tree_norm
from .unrolled import UnrolledInfo, unroll, unused_error

BUFFER_POLICIES = ("freeze", "update")
#: what one hypergradient step reports, by method
Info = HypergradInfo | UnrolledInfo | FirstOrderInfo | SingleLoopInfo
DIVERGED_POLICIES = ("skip", "write", "raise")


def check_method(method: object) -> None:
    """Raise :class:`~hypergrad.HypergradTypeError` unless ``method`` is an
    :class:`~hypergrad.Implicit` or :class:`~hypergrad.Unrolled` object, saying what to pass."""
    if isinstance(method, (Implicit, Unrolled, FirstOrder, SingleLoop)):
        return
    instead = {
        "implicit": "hg.Implicit(solver=...)",
        "unrolled": "hg.Unrolled(optimizer, ...)",
        "first_order": "hg.FirstOrder(alpha=... or optimizer=...)",
        "single_loop": "hg.SingleLoop(step=...)",
    }
    named = instead.get(method) if isinstance(method, str) else None
    raise HypergradTypeError(
        "method must be hg.Implicit(solver=..., engine=..., warm_start=...), "
        "hg.Unrolled(optimizer, steps=..., truncate=...), hg.FirstOrder(alpha=... or "
        f"optimizer=..., terms=...) or hg.SingleLoop(step=...), got {method!r}"
        + (f": a method is an object, not a name (pass method={named})" if named else "")
    )


@contextlib.contextmanager
def frozen_buffers(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Swap every buffer of ``modules`` for a clone for the duration of the block.

    In-place updates made inside the block (BatchNorm's running statistics) land on the clones;
    the original buffer tensors are restored, untouched, on exit.

    Example:
        >>> bn = nn.BatchNorm1d(2)
        >>> with frozen_buffers([bn]):
        ...     _ = bn(torch.randn(4, 2))
        >>> bn.running_mean
        tensor([0., 0.])
    """
    saved: list[tuple[nn.Module, str, torch.Tensor]] = []
    seen: set[int] = set()
    try:
        for root in modules:
            for mod in root.modules():
                if id(mod) in seen:
                    continue
                seen.add(id(mod))
                for name, buf in list(mod._buffers.items()):
                    if buf is not None:
                        saved.append((mod, name, buf))
                        mod._buffers[name] = buf.clone()
        yield
    finally:
        for mod, name, buf in saved:
            mod._buffers[name] = buf


@contextlib.contextmanager
def swapped_parameters(module: nn.Module, values: dict[int, torch.Tensor]) -> Iterator[None]:
    """Let ``module`` compute with other tensors in place of some of its parameters.

    ``values`` maps ``id(parameter)`` to the tensor used instead (tied parameters are replaced
    everywhere they occur); the original ``nn.Parameter`` objects are restored on exit. Inside
    the block ``module(x)`` (or any of its methods) is differentiable w.r.t. those tensors.
    """
    saved: list[tuple[nn.Module, str, Any]] = []
    try:
        for mod in module.modules():
            for name, p in list(mod._parameters.items()):
                if p is not None and id(p) in values:
                    saved.append((mod, name, p))
                    # Deliberately a plain tensor where nn.Module keeps Parameters (restored below).
                    mod._parameters[name] = values[id(p)]  # type: ignore[assignment]
        yield
    finally:
        for mod, name, p in reversed(saved):
            mod._parameters[name] = p


def _hyper_tensors(
    hyper: nn.Module | Sequence[torch.Tensor],
) -> tuple[list[str], list[torch.Tensor]]:
    if isinstance(hyper, nn.Module):
        named = [(n, p) for n, p in hyper.named_parameters() if p.requires_grad]
        if not named:
            raise HypergradValueError(
                "hyper module has no parameters that require grad: nothing to differentiate"
            )
        return [f"hyper.{n}" for n, _ in named], [p for _, p in named]
    if isinstance(hyper, torch.Tensor):
        hyper = [hyper]
    tensors = list(hyper)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise HypergradTypeError(f"hyper[{i}] must be a tensor, got {type(t).__name__}")
        if not t.is_leaf or not t.requires_grad:
            raise HypergradValueError(
                f"hyper[{i}] must be a leaf tensor with requires_grad=True (its .grad receives "
                "the hypergradient)"
            )
    if not tensors:
        raise HypergradValueError("hyper is empty: pass an nn.Module or a list of tensors")
    return [f"hyper[{i}]" for i in range(len(tensors))], tensors


class HyperStep:
    """Hypergradient of nn.Module parameters (implicit or unrolled), written into the hyper
    ``.grad``.

    Warm starts (``hg.Implicit(warm_start="previous"|"extrapolate")``) follow
    :class:`~hypergrad.WarmStart`'s rule: each implicit solve starts from the previous call's
    adjoint, or from ``2 x_k - x_{k-1}``; the adjoint of a failed solve is not kept (and the kept
    ones are forgotten). The step's own :class:`~hypergrad.WarmStart` is ``self.warm`` (the last
    kept adjoint is ``self.adjoint``); call :meth:`reset_adjoint` when the model or the batch
    changes completely.

    Args:
        inner: the inner model ``psi`` (its trainable parameters, at their current values).
        hyper: the hyper module ``theta`` (or a list of leaf tensors requiring grad).
        inner_loss: ``(inner, batch) -> scalar``; may call ``hyper`` (e.g. a label network).
        outer_loss: ``(inner, batch) -> scalar``.
        method: how the hypergradient is computed: ``hg.Implicit(solver=..., engine=...,
            warm_start=...)`` (the default, ``hg.Implicit()``: CG) or ``hg.Unrolled(optimizer=...,
            steps=1, truncate=None)`` (look-ahead updates from the current parameters; the
            model's own parameters are not changed; every inner step uses ``batch``). Each
            object validates its own settings (:mod:`hypergrad.methods`).
        solver: shorthand for ``method=hg.Implicit(solver=solver)`` (the common case); not
            together with ``method=``.
        buffers: ``"freeze"`` (running statistics untouched) or ``"update"``.
        clip_norm: if set, rescale the hypergradient to at most this global norm.
        accumulate: add to ``.grad`` instead of overwriting it.
        distributed: None, ``"exact"`` or ``"local"`` (see :mod:`hypergrad.distributed`; any
            other value raises here, at construction); the unrolled method supports ``"local"``
            (average of the per-process hypergradients).
        on_diverged: what ``__call__`` does when the result is not a hypergradient: the solve's
            :attr:`SolveInfo.failure <hypergrad.SolveInfo.failure>` is set (it diverged, the
            system is singular and inconsistent, the iteration stalled, or the relative residual
            is NaN/Inf or above 1, a worse answer than ``x = 0``), or the result has NaN/Inf
            entries. ``"skip"`` (default) writes nothing, sets the hyper ``.grad`` to None (kept
            as is with ``accumulate=True``) so the next optimizer step leaves the hyper
            parameters where they are, marks ``info.skipped`` and ``info.skip_reason`` and warns;
            ``"write"`` writes it anyway (with a warning: the solver's, or this step's for
            NaN/Inf entries and for another rank's failure); ``"raise"`` raises
            :class:`~hypergrad.HypergradError`. Skip is the default because one diverged solve
            written into ``.grad`` can throw the hyper parameters anywhere (a Neumann series that
            grew is orders of magnitude too large), and raising would end a long training run
            for one bad batch; the skip is counted and warned, never silent. Under
            ``distributed=...`` the decision is collective: every rank's failure is all-reduced
            before anything is averaged or written, so when any rank's result is not a
            hypergradient every rank skips (or raises, or writes the same average), and
            ``skip_reason`` names the rank(s) (``"rank 1: the cg solve diverged"``); a skipped
            rank's result is never averaged into the others'.

    Attributes:
        last_info: the diagnostics returned by the most recent ``__call__`` (None before the
            first): a :class:`~hypergrad.HypergradInfo`, or an :class:`~hypergrad.UnrolledInfo`
            for ``hg.Unrolled``.
        method: the :class:`~hypergrad.Implicit` or :class:`~hypergrad.Unrolled` object, the
            one place of the method's settings (``step.method.solver``,
            ``step.method.steps``). Assigning another one (``step.method =
            dataclasses.replace(step.method, solver=hg.MINRES())``) checks it as the constructor
            does; the kept adjoints of a warm start stay when the warm-start kind is unchanged
            (the adjoint system does not depend on the solver or the engine) and are dropped
            otherwise.
        measure_stationarity: ``True`` (default): the implicit method reports
            ``info.stationarity``, how far the inner model is from a stationary point of
            ``inner_loss`` on ``batch`` (:mod:`hypergrad.conditions`; one Hessian-vector
            product). It is reported, never warned about: ``HyperStep`` is called away from the
            inner optimum by design (BORT² and look-ahead methods take one inner step per hyper
            step), so the number is a health metric to log, not an error.
            ``hg.conditions.warn_if_nonstationary(info.stationarity, "inner_loss")`` after the
            call warns like :func:`~hypergrad.implicit_grad` does. Set it to ``False`` to skip
            the product (``info.stationarity`` is then NaN), e.g. with a three-term Neumann
            solve, where it is about a fifth of the step's time.

    Example:
        >>> import hypergrad as hg
        >>> model, labeler = nn.Linear(4, 3), nn.Linear(4, 3)
        >>> x = torch.randn(8, 4)
        >>> inner = lambda m, b: ((m(b) - labeler(b)) ** 2).mean() + 1e-2 * (m.weight ** 2).sum()
        >>> outer = lambda m, b: (m(b) ** 2).mean()
        >>> step = hg.HyperStep(model, labeler, inner, outer,
        ...                     method=hg.Implicit(solver=hg.CG(maxiter=20), warm_start="previous"))
        >>> info = step(x)
        >>> labeler.weight.grad.shape
        torch.Size([3, 4])
        >>> look_ahead = hg.HyperStep(model, labeler, inner, outer,
        ...                           method=hg.Unrolled(hg.optim.sgd(lr=0.1), steps=1))
    """

    def __init__(
        self,
        inner: nn.Module,
        hyper: nn.Module | Sequence[torch.Tensor],
        inner_loss: Callable[[nn.Module, Any], torch.Tensor],
        outer_loss: Callable[[nn.Module, Any], torch.Tensor],
        *,
        method: Implicit | Unrolled | FirstOrder | SingleLoop | None = None,
        solver: Solver | None = None,
        buffers: str = "freeze",
        clip_norm: float | None = None,
        accumulate: bool = False,
        distributed: str | None = None,
        on_diverged: str = "skip",
    ):
        if not isinstance(inner, nn.Module):
            raise HypergradTypeError(f"inner must be an nn.Module, got {type(inner).__name__}")
        if not callable(inner_loss) or not callable(outer_loss):
            raise HypergradTypeError("inner_loss and outer_loss must be callables (model, batch)")
        if buffers not in BUFFER_POLICIES:
            raise HypergradValueError(f"buffers must be one of {BUFFER_POLICIES}, got {buffers!r}")
        check_mode(distributed)
        if clip_norm is not None and not clip_norm > 0:
            raise HypergradValueError(f"clip_norm must be > 0 or None, got {clip_norm!r}")
        if on_diverged not in DIVERGED_POLICIES:
            raise HypergradValueError(
                f"on_diverged must be one of {DIVERGED_POLICIES}, got {on_diverged!r}"
            )
        if method is None:
            method = Implicit(solver=solver)
        elif solver is not None:
            check_method(method)
            raise HypergradValueError(
                "solver= given with method=hg.Implicit(...): pass it once, as "
                "hg.Implicit(solver=...)"
                if isinstance(method, Implicit)
                else "solver= given with method=hg.Unrolled(...): the unrolled method takes no "
                "solver (it solves no system)"
            )
        self.inner, self.hyper = inner, hyper
        self.inner_loss, self.outer_loss = inner_loss, outer_loss
        self.on_diverged = on_diverged
        self.buffers = buffers
        self.clip_norm, self.accumulate, self.distributed = clip_norm, accumulate, distributed
        #: the warm-start rule of the implicit solves (None: off), with the kept adjoints
        self.warm: WarmStart | None = None
        #: the single-loop method's kept adjoint and the steps it has been advanced
        self._loop_v: Tensors | None = None
        self._loop_steps = 0
        self.method = method  # checked, and self.warm made, by the setter
        named = [(n, p) for n, p in inner.named_parameters() if p.requires_grad]
        if not named:
            raise HypergradValueError("inner model has no parameters that require grad")
        self.psi_names = [f"inner.{n}" for n, _ in named]
        self.psi = tuple(p for _, p in named)
        self.theta_names, theta = _hyper_tensors(hyper)
        self.theta = tuple(theta)
        shared = {id(p) for p in self.psi} & {id(t) for t in self.theta}
        if shared:
            raise HypergradValueError("inner and hyper share parameters; they must be disjoint")
        self.last_info: Info | None = None
        self.measure_stationarity = True

    @property
    def method(self) -> Implicit | Unrolled | FirstOrder | SingleLoop:
        """How the hypergradient is computed: the :class:`~hypergrad.Implicit` or
        :class:`~hypergrad.Unrolled` object, the one place of its settings."""
        return self._method

    @method.setter
    def method(self, value: Implicit | Unrolled | FirstOrder | SingleLoop) -> None:
        """Check ``value`` as the constructor does; keep the warm start's adjoints when its kind
        is unchanged (they solve the same system whatever the solver), else start afresh."""
        check_method(value)
        value.check_distributed(self.distributed)
        kind = value.warm_start_kind if isinstance(value, Implicit) else None
        if kind is None:
            self.warm = None
        elif self.warm is None or self.warm.kind != kind:
            self.warm = WarmStart(kind)
        if not isinstance(value, SingleLoop):  # another step size keeps the kept adjoint
            self._loop_v, self._loop_steps = None, 0
        self._method = value

    @property
    def adjoint(self) -> Tensors | None:
        """The last kept adjoint of a ``warm_start`` solve, or the single-loop method's state
        (None: none kept, or neither in use)."""
        if isinstance(self._method, SingleLoop):
            return self._loop_v
        return None if self.warm is None else cast("Tensors | None", self.warm.last)

    def _buffer_context(self) -> contextlib.AbstractContextManager[None]:
        modules = [self.inner] + ([self.hyper] if isinstance(self.hyper, nn.Module) else [])
        return frozen_buffers(modules) if self.buffers == "freeze" else contextlib.nullcontext()

    def _unrolled(
        self, method: Unrolled, batch: Any, outer_batch: Any
    ) -> tuple[Tensors, UnrolledInfo]:
        steps, truncate = method.steps, cast(int, method.truncate)
        info = UnrolledInfo(steps=steps, truncate=truncate)
        ids = [id(p) for p in self.psi]

        def f_in(ps: Tensors, hs: Tensors) -> torch.Tensor:
            with swapped_parameters(self.inner, dict(zip(ids, ps))):
                return check_scalar_loss(self.inner_loss(self.inner, batch), "inner_loss")

        names = [(self.psi, self.psi_names), (self.theta, self.theta_names)]
        with self._buffer_context(), torch.enable_grad(), explain_dtype_errors(names):
            psi = unroll(
                f_in, self.psi, self.theta, steps, method.optimizer, truncate,
                lambda hs: tuple(hs), info.inner_losses,
            )  # fmt: skip
            with swapped_parameters(self.inner, dict(zip(ids, psi))):
                lo = check_scalar_loss(self.outer_loss(self.inner, outer_batch), "outer_loss")
            grads = torch.autograd.grad(lo, self.theta, allow_unused=True)
        unused = [n for n, g in zip(self.theta_names, grads) if g is None]
        if unused:
            raise unused_error(unused)
        hyper = tuple(g.detach() for g in grads)
        info.outer_loss = float(lo.detach())
        info.hypergrad_norm = float(tree_norm(hyper))
        info.params = tuple(p.detach() for p in psi)
        return hyper, info

    def _first_order(
        self, method: FirstOrder, batch: Any, outer_batch: Any
    ) -> tuple[Tensors, FirstOrderInfo]:
        ids = [id(p) for p in self.psi]
        if method.optimizer is not None:
            base = update_derivative(method.optimizer, self.psi)
        else:
            base = tuple(torch.full_like(p, cast(float, method.alpha)).detach() for p in self.psi)

        def f_in(ps: Tensors, hs: Tensors) -> torch.Tensor:
            with swapped_parameters(self.inner, dict(zip(ids, ps))):
                return self.inner_loss(self.inner, batch)

        names = [(self.psi, self.psi_names), (self.theta, self.theta_names)]
        with self._buffer_context(), explain_dtype_errors(names):
            return first_order_hypergrad(
                f_in,
                lambda ps, hs: self.outer_loss(self.inner, outer_batch),
                self.psi,
                self.theta,
                base,
                terms=method.terms,
                fd_step=method.fd_step,
                reduce=make_reducer(self.distributed),
            )

    def _single_loop(
        self, method: SingleLoop, batch: Any, outer_batch: Any
    ) -> tuple[Tensors, SingleLoopInfo]:
        ids = [id(p) for p in self.psi]

        def f_in(ps: Tensors, hs: Tensors) -> torch.Tensor:
            with swapped_parameters(self.inner, dict(zip(ids, ps))):
                return self.inner_loss(self.inner, batch)

        names = [(self.psi, self.psi_names), (self.theta, self.theta_names)]
        with self._buffer_context(), explain_dtype_errors(names):
            hyper, v, info = single_loop_step(
                f_in,
                lambda ps, hs: self.outer_loss(self.inner, outer_batch),
                self.psi,
                self.theta,
                self._loop_v,
                method.step,
                engine=method.engine,
                reduce=make_reducer(self.distributed),
                psi_names=self.psi_names,
            )
        if info.failure is not None:  # warned here: the method is its own solver
            warn(
                "SingleLoop: the kept adjoint's relative residual ||g - H v|| / ||g|| is above 1 "
                "or not finite (info.adjoint_residual), so the result is not a hypergradient; "
                "the adjoint is dropped and restarts from step * g. Lower SingleLoop(step=...) "
                "below 2 / (the largest Hessian eigenvalue)",
                failure_warning(info.failure, SolveFailedWarning),
            )
        # a failed or NaN/Inf adjoint is dropped (the next step restarts from step * grad)
        good = info.failure is None and tree_all_finite(v)
        self._loop_v, self._loop_steps = (v, self._loop_steps + 1) if good else (None, 0)
        info.step = self._loop_steps if good else 0
        return hyper, info

    def _local(self, batch: Any, outer_batch: Any) -> tuple[Tensors, Info]:
        """This process's hypergradient and report, before any averaging over ranks."""
        outer_batch = batch if outer_batch is None else outer_batch
        method = self.method
        if isinstance(method, Unrolled):
            return self._unrolled(method, batch, outer_batch)
        if isinstance(method, FirstOrder):
            return self._first_order(method, batch, outer_batch)
        if isinstance(method, SingleLoop):
            return self._single_loop(method, batch, outer_batch)
        with self._buffer_context():
            hyper, info = hypergradient_core(
                lambda ps, hs: self.inner_loss(self.inner, batch),
                lambda ps, hs: self.outer_loss(self.inner, outer_batch),
                self.psi,
                self.theta,
                cast(Solver, method.solver),  # Implicit() resolved None to hg.CG()
                engine=method.engine,
                x0=self._start(),
                psi_names=self.psi_names,
                theta_names=self.theta_names,
                reduce=make_reducer(self.distributed),
                nonfinite="return",  # NaN/Inf is on_diverged's business, not an error here
                stationarity=bool(self.measure_stationarity),
            )
        if self.warm is not None:
            self.warm.update(info)  # keeps no adjoint of a failed (or NaN/Inf) solve
        return hyper, info

    def compute(self, batch: Any, outer_batch: Any = None) -> tuple[Tensors, Info]:
        """Return the hypergradient (one tensor per hyper parameter) without touching ``.grad``.

        No ``on_diverged`` policy applies here: the result is returned whatever its report says
        (a failed solve has been warned about), averaged over ranks under
        ``distributed="local"``. :meth:`__call__` decides, collectively, what to write.
        """
        hyper, info = self._local(batch, outer_batch)
        return average_if_local(hyper, self.distributed), info

    def _start(self) -> Tensors | None:
        """The warm start of the next solve (None: from zero): ``self.warm.x0()``."""
        return None if self.warm is None else cast("Tensors | None", self.warm.x0())

    def reset_adjoint(self) -> None:
        """Forget the kept adjoints: the next ``warm_start`` solve starts from zero
        (``self.warm.reset()``)."""
        if self.warm is not None:
            self.warm.reset()
        self._loop_v, self._loop_steps = None, 0

    def __call__(self, batch: Any, outer_batch: Any = None) -> Info:
        """Compute the hypergradient on ``batch`` and write it to the hyper ``.grad``.

        Args:
            batch: passed to ``inner_loss`` (and to ``outer_loss`` unless ``outer_batch`` is set).
            outer_batch: optional separate batch for the outer loss (e.g. a validation split).

        Returns:
            :class:`~hypergrad.HypergradInfo` (solver diagnostics, norms, clipping, time); for
            ``hg.Unrolled`` an :class:`~hypergrad.UnrolledInfo`. The same object is kept
            in ``self.last_info``.
        """
        t0 = time.perf_counter()
        hyper, info = self._local(batch, outer_batch)
        self.last_info = info  # also when on_diverged="raise" raises below
        local = _failure(hyper, info)
        problem = None if local is None else _not_a_hypergradient(hyper, info)
        elsewhere = False  # only other ranks' results are not hypergradients
        if self.distributed is not None:
            # One decision for every rank: each rank's failure is known to all (one small
            # all-reduce) before anything is averaged or written.
            statuses = all_gather_status(_code(local), _residual_of(info), hyper[0].device)
            if statuses is not None:
                failed = {
                    rank: (_kind(code), residual)
                    for rank, (code, residual) in enumerate(statuses)
                    if code
                }
                problem = _describe_ranks(failed, info) if failed else None
                # this rank's own solve was fine but what it writes is averaged with a failure
                elsewhere = local is None and bool(failed)
        if problem is not None and self.on_diverged != "write":
            if self.on_diverged == "raise":
                raise HypergradError(
                    f"HyperStep: {problem}; nothing was written to .grad (on_diverged='raise'). "
                    "The diagnostics are in the solver's SolveInfo"
                )
            warn(
                "HyperStep skipped a result that is not a hypergradient (a solve that diverged, "
                "is singular, stalled, or has a relative residual NaN/Inf or above 1, or NaN/Inf "
                "entries; under torch.distributed on any rank): .grad was not written and the "
                "hyper parameters will not move this step (on_diverged='skip'; info.skipped is "
                "True and info.skip_reason says why)",
                HypergradWarning,
            )
            info.skipped, info.skip_reason = True, problem
            if not self.accumulate:
                for t in self.theta:
                    t.grad = None
            info.time_s = time.perf_counter() - t0
            return info
        if problem is not None and (elsewhere or _unwarned(local, info)):
            # on_diverged="write": the failing solver warned on its own rank; a result that is not
            # a hypergradient for another reason (or averaged with another rank's) warns here
            warn(
                "HyperStep wrote a result that is not a hypergradient (NaN/Inf entries, or "
                "averaged over ranks with another rank's failed solve) because "
                "on_diverged='write'",
                HypergradWarning,
            )
        hyper = average_if_local(hyper, self.distributed)
        if self.clip_norm is not None:
            norm = float(tree_norm(hyper))
            if norm > self.clip_norm:
                scale = self.clip_norm / (norm + 1e-12)
                hyper = tuple(h * scale for h in hyper)
                info.clipped = True
        for t, h in zip(self.theta, hyper):
            h = h.to(t.dtype)
            if self.accumulate and t.grad is not None:
                t.grad.add_(h)
            else:
                t.grad = h.clone()
        info.time_s = time.perf_counter() - t0
        return info


#: The reasons a result is not a hypergradient: :attr:`SolveInfo.failure
#: <hypergrad.SolveInfo.failure>`'s five, then NaN/Inf entries in the hypergradient itself.
FAILURES = ("diverged", "singular", "stalled", "non-finite residual", "residual above 1",
            "non-finite hypergradient")  # fmt: skip


def _code(failure: str | None) -> int:
    """``failure`` as a number for :func:`~hypergrad.distributed.all_gather_status` (0: none)."""
    if failure is None:
        return 0
    return FAILURES.index(failure) + 1 if failure in FAILURES else len(FAILURES) + 1


def _kind(code: int) -> str:
    """The inverse of :func:`_code` for a failure (a kind unknown here reads ``"failed"``)."""
    return FAILURES[code - 1] if 1 <= code <= len(FAILURES) else "failed"


def _report(info: Info) -> tuple[str | None, float, str]:
    """``(failure, relative residual, solver name)`` of ``info``'s solve: the implicit method's
    :class:`~hypergrad.SolveInfo`, the single-loop method's kept adjoint; none for the others."""
    if isinstance(info, HypergradInfo):
        return info.solve.failure, float(info.solve.residual), info.solve.solver
    if isinstance(info, SingleLoopInfo):
        return info.failure, info.adjoint_residual, "single-loop"
    return None, float("nan"), ""


def _failure(hyper: Tensors, info: Info) -> str | None:
    """Which of :data:`FAILURES` makes ``hyper`` not a hypergradient (None when it is one)."""
    failure = _report(info)[0]
    if failure is not None:
        return failure
    if not all(bool(torch.isfinite(h).all()) for h in hyper):
        return "non-finite hypergradient"
    return None


def _residual_of(info: Info) -> float:
    """The relative residual of ``info``'s solve (NaN without one), for other ranks' messages."""
    return _report(info)[1]


def _describe(failure: str, solver: str, residual: float) -> str:
    """One sentence for a :data:`FAILURES` entry (``solver``: the solve's ``SolveInfo.solver``)."""
    if failure == "diverged":
        return f"the {solver} solve diverged"
    if failure == "singular":
        return f"the {solver} system is singular and inconsistent (no x solves it)"
    if failure == "stalled":
        return f"the {solver} iteration stalled"
    if failure == "non-finite residual":
        return f"the {solver} solve's relative residual is NaN/Inf"
    if failure == "residual above 1":
        return (
            f"the {solver} solve's relative residual {residual:.3g} is above 1 (a worse answer "
            "than x = 0)"
        )
    if failure == "non-finite hypergradient":
        return "the hypergradient has NaN/Inf entries"
    return f"the {solver} solve failed ({failure})"


def _not_a_hypergradient(hyper: Tensors, info: Info) -> str | None:
    """Why ``hyper`` is not a hypergradient (None when it is one).

    A failed solve (:attr:`SolveInfo.failure <hypergrad.SolveInfo.failure>`: diverged,
    singular, stalled, a relative residual that is NaN/Inf or above 1), or NaN/Inf entries.
    """
    failure = _failure(hyper, info)
    if failure is None:
        return None
    return _describe(failure, _report(info)[2], _residual_of(info))


def _unwarned(local: str | None, info: Info) -> bool:
    """Whether this rank's problem ``local`` has not been warned about by a solver (NaN/Inf
    entries with a solve that reported no failure, or no solve at all)."""
    return local is not None and _report(info)[0] is None


def _describe_ranks(failed: dict[int, tuple[str, float]], info: Info) -> str:
    """``"rank 1: the cg solve diverged"``; ranks with the same sentence are listed together."""
    solver = _report(info)[2]
    groups: dict[str, list[int]] = {}
    for rank in sorted(failed):
        failure, residual = failed[rank]
        groups.setdefault(_describe(failure, solver, residual), []).append(rank)
    return "; ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {text}"
        for text, ranks in groups.items()
    )
