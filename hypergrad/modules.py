"""``HyperStep``: hypergradients over ``nn.Module`` parameters (what BORT2 uses).

The inner model's parameters play ``psi`` and the hyper module's parameters play ``theta``. Two
methods: ``"implicit"`` (default) takes ``psi`` at its current values as an approximate inner
solution and solves the implicit-function linear system; ``"unrolled"`` differentiates through
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
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
from torch import nn

from ._core import HypergradInfo, average_if_local, check_solver, hypergradient_core
from .distributed import all_gather_status, check_mode, make_reducer
from .errors import HypergradError, HypergradTypeError, HypergradValueError, HypergradWarning
from .operators import check_engine, check_scalar_loss
from .solvers import Solver
from .tree import Tensors, tree_all_finite, tree_norm
from .unrolled import OptimizerArg, UnrolledInfo, check_optimizer, unroll, unused_error

BUFFER_POLICIES = ("freeze", "update")
METHODS = ("implicit", "unrolled")
DIVERGED_POLICIES = ("skip", "write", "raise")
#: Values of ``HyperStep(warm_start=...)``: off, the previous adjoint, or extrapolated.
WARM_STARTS = (False, True, "previous", "extrapolate")


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

    Args:
        inner: the inner model ``psi`` (its trainable parameters, at their current values).
        hyper: the hyper module ``theta`` (or a list of leaf tensors requiring grad).
        inner_loss: ``(inner, batch) -> scalar``; may call ``hyper`` (e.g. a label network).
        outer_loss: ``(inner, batch) -> scalar``.
        solver: the implicit method's linear solver (default ``hg.CG()``); leave it None for
            ``method="unrolled"``, which solves no linear system.
        buffers: ``"freeze"`` (running statistics untouched) or ``"update"``.
        engine: ``"reuse"`` or ``"recompute"`` (implicit method).
        clip_norm: if set, rescale the hypergradient to at most this global norm.
        accumulate: add to ``.grad`` instead of overwriting it.
        distributed: None, ``"exact"`` or ``"local"`` (see :mod:`hypergrad.distributed`; any
            other value raises here, at construction); the unrolled method supports ``"local"``
            (average of the per-process hypergradients).
        method: ``"implicit"`` (default) or ``"unrolled"``: differentiate through ``steps``
            look-ahead updates ``psi_{t+1} = psi_t + optimizer.update(grad inner_loss)`` from the
            current parameters, then through ``outer_loss`` at ``psi_steps`` (the model's own
            parameters are not changed). Every inner step uses ``batch``.
        steps: look-ahead updates of the unrolled method (default 1).
        optimizer: the unrolled method's functional optimizer (e.g. ``hg.optim.sgd(lr=0.1)``),
            or a function of the hyper tensors (a tuple, in ``hyper``'s parameter order)
            returning one, to learn its settings.
        truncate: the unrolled method differentiates through the last ``truncate`` steps only.
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
        warm_start: ``False``, ``True`` (or ``"previous"``): start each implicit solve from the
            previous call's adjoint ``x`` (kept in ``self.adjoint``) instead of zero; or
            ``"extrapolate"``: from ``2 x_k - x_{k-1}``, the linear extrapolation of the last two
            adjoints (the previous one alone until two are kept). Across outer steps the inner
            parameters and the hyperparameters move little and smoothly, so the previous adjoint
            is close (and its extrapolation closer) and the solver needs fewer iterations; the
            converged answer is the same (the solve is still judged on its recomputed residual,
            and a start that already meets ``tol`` costs one product). The adjoint of a failed
            solve (``SolveInfo.failure`` set, or NaN/Inf) is not kept (and the kept ones are
            forgotten). Call
            :meth:`reset_adjoint` when the model or the batch changes completely.

    Attributes:
        last_info: the diagnostics returned by the most recent ``__call__`` (None before the
            first): a :class:`~hypergrad.HypergradInfo`, or an :class:`~hypergrad.UnrolledInfo`
            for ``method="unrolled"``.
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
        >>> step = hg.HyperStep(model, labeler, inner, outer, solver=hg.CG(maxiter=20))
        >>> info = step(x)
        >>> labeler.weight.grad.shape
        torch.Size([3, 4])
    """

    def __init__(
        self,
        inner: nn.Module,
        hyper: nn.Module | Sequence[torch.Tensor],
        inner_loss: Callable[[nn.Module, Any], torch.Tensor],
        outer_loss: Callable[[nn.Module, Any], torch.Tensor],
        *,
        solver: Solver | None = None,
        buffers: str = "freeze",
        engine: str = "reuse",
        clip_norm: float | None = None,
        accumulate: bool = False,
        distributed: str | None = None,
        method: str = "implicit",
        steps: int | None = None,
        optimizer: OptimizerArg = None,
        truncate: int | None = None,
        on_diverged: str = "skip",
        warm_start: bool | str = False,
    ):
        if not isinstance(inner, nn.Module):
            raise HypergradTypeError(f"inner must be an nn.Module, got {type(inner).__name__}")
        if not callable(inner_loss) or not callable(outer_loss):
            raise HypergradTypeError("inner_loss and outer_loss must be callables (model, batch)")
        if buffers not in BUFFER_POLICIES:
            raise HypergradValueError(f"buffers must be one of {BUFFER_POLICIES}, got {buffers!r}")
        check_engine(engine)
        check_mode(distributed)
        if clip_norm is not None and not clip_norm > 0:
            raise HypergradValueError(f"clip_norm must be > 0 or None, got {clip_norm!r}")
        self.inner, self.hyper = inner, hyper
        self.inner_loss, self.outer_loss = inner_loss, outer_loss
        if on_diverged not in DIVERGED_POLICIES:
            raise HypergradValueError(
                f"on_diverged must be one of {DIVERGED_POLICIES}, got {on_diverged!r}"
            )
        self.on_diverged = on_diverged
        if warm_start not in WARM_STARTS or not isinstance(warm_start, (bool, str)):
            raise HypergradValueError(
                f"warm_start must be one of {WARM_STARTS}, got {warm_start!r}"
            )
        if warm_start and method != "implicit":
            raise HypergradValueError("warm_start applies to method='implicit' (it has a solve)")
        self.warm_start: bool | str = warm_start
        self.adjoint: Tensors | None = None
        self._previous_adjoint: Tensors | None = None  # for warm_start="extrapolate"
        self.method = method
        self._check_method(solver, distributed, steps, optimizer, truncate)
        self.steps = 1 if steps is None else steps
        self.truncate = self.steps if truncate is None else truncate
        self.optimizer = optimizer
        self.solver = check_solver(solver) if method == "implicit" else None
        self.buffers, self.engine = buffers, engine
        self.clip_norm, self.accumulate, self.distributed = clip_norm, accumulate, distributed
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
        self.last_info: HypergradInfo | UnrolledInfo | None = None
        self.measure_stationarity = True

    def _check_method(
        self,
        solver: Solver | None,
        distributed: str | None,
        steps: int | None,
        optimizer: OptimizerArg,
        truncate: int | None,
    ) -> None:
        if self.method not in METHODS:
            raise HypergradValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.method == "implicit":
            given = [n for n, v in (("steps", steps), ("optimizer", optimizer),
                                    ("truncate", truncate)) if v is not None]  # fmt: skip
            if given:
                raise HypergradValueError(
                    f"{', '.join(given)} belong to method='unrolled'; the implicit method uses "
                    "solver=..."
                )
            return
        if solver is not None:
            raise HypergradValueError("method='unrolled' takes no solver (it solves no system)")
        if optimizer is None:
            raise HypergradValueError(
                "method='unrolled' needs optimizer=..., e.g. hg.optim.sgd(lr=0.1) (the look-ahead "
                "update; use the model's own learning rate for a Meta-Weight-Net step)"
            )
        check_optimizer(optimizer)
        if steps is not None and (
            isinstance(steps, bool) or not isinstance(steps, int) or steps < 1
        ):
            raise HypergradValueError(f"steps must be a positive int, got {steps!r}")
        n = 1 if steps is None else steps
        if truncate is not None and (
            isinstance(truncate, bool) or not isinstance(truncate, int) or not 1 <= truncate <= n
        ):
            raise HypergradValueError(
                f"truncate must be an int in [1, steps={n}], got {truncate!r}"
            )
        if distributed == "exact":
            raise HypergradValueError(
                "method='unrolled' supports distributed=None or 'local'; 'exact' all-reduces the "
                "implicit method's products (wrap the inner model in DDP to reduce look-ahead "
                "gradients instead)"
            )

    def _buffer_context(self) -> contextlib.AbstractContextManager[None]:
        modules = [self.inner] + ([self.hyper] if isinstance(self.hyper, nn.Module) else [])
        return frozen_buffers(modules) if self.buffers == "freeze" else contextlib.nullcontext()

    def _unrolled(self, batch: Any, outer_batch: Any) -> tuple[Tensors, UnrolledInfo]:
        info = UnrolledInfo(steps=self.steps, truncate=self.truncate)
        ids = [id(p) for p in self.psi]

        def f_in(ps: Tensors, hs: Tensors) -> torch.Tensor:
            with swapped_parameters(self.inner, dict(zip(ids, ps))):
                return check_scalar_loss(self.inner_loss(self.inner, batch), "inner_loss")

        with self._buffer_context(), torch.enable_grad():
            psi = unroll(
                f_in, self.psi, self.theta, self.steps, self.optimizer, self.truncate,
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

    def _local(self, batch: Any, outer_batch: Any) -> tuple[Tensors, HypergradInfo | UnrolledInfo]:
        """This process's hypergradient and report, before any averaging over ranks."""
        outer_batch = batch if outer_batch is None else outer_batch
        if self.method == "unrolled":
            return self._unrolled(batch, outer_batch)
        with self._buffer_context():
            hyper, info = hypergradient_core(
                lambda ps, hs: self.inner_loss(self.inner, batch),
                lambda ps, hs: self.outer_loss(self.inner, outer_batch),
                self.psi,
                self.theta,
                cast(Solver, self.solver),  # method == "implicit": __init__ set it
                engine=self.engine,
                x0=self._start(),
                psi_names=self.psi_names,
                theta_names=self.theta_names,
                reduce=make_reducer(self.distributed),
                nonfinite="return",  # NaN/Inf is on_diverged's business, not an error here
                stationarity=bool(self.measure_stationarity),
            )
        if self.warm_start:
            adjoint = info.extras.get("adjoint")
            good = info.solve.failure is None and adjoint is not None and tree_all_finite(adjoint)
            self._previous_adjoint = self.adjoint if good else None
            self.adjoint = adjoint if good else None
        return hyper, info

    def compute(
        self, batch: Any, outer_batch: Any = None
    ) -> tuple[Tensors, HypergradInfo | UnrolledInfo]:
        """Return the hypergradient (one tensor per hyper parameter) without touching ``.grad``.

        No ``on_diverged`` policy applies here: the result is returned whatever its report says
        (a failed solve has been warned about), averaged over ranks under
        ``distributed="local"``. :meth:`__call__` decides, collectively, what to write.
        """
        hyper, info = self._local(batch, outer_batch)
        return average_if_local(hyper, self.distributed), info

    def _start(self) -> Tensors | None:
        """The warm start of the next solve (None: from zero)."""
        if not self.warm_start or self.adjoint is None:
            return None
        if self.warm_start != "extrapolate" or self._previous_adjoint is None:
            return self.adjoint
        return tuple(2 * a - b for a, b in zip(self.adjoint, self._previous_adjoint))

    def reset_adjoint(self) -> None:
        """Forget the kept adjoints: the next ``warm_start`` solve starts from zero."""
        self.adjoint = self._previous_adjoint = None

    def __call__(self, batch: Any, outer_batch: Any = None) -> HypergradInfo | UnrolledInfo:
        """Compute the hypergradient on ``batch`` and write it to the hyper ``.grad``.

        Args:
            batch: passed to ``inner_loss`` (and to ``outer_loss`` unless ``outer_batch`` is set).
            outer_batch: optional separate batch for the outer loss (e.g. a validation split).

        Returns:
            :class:`~hypergrad.HypergradInfo` (solver diagnostics, norms, clipping, time); for
            ``method="unrolled"`` an :class:`~hypergrad.UnrolledInfo`. The same object is kept
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
            warnings.warn(
                "HyperStep skipped a result that is not a hypergradient (a solve that diverged, "
                "is singular, stalled, or has a relative residual NaN/Inf or above 1, or NaN/Inf "
                "entries; under torch.distributed on any rank): .grad was not written and the "
                "hyper parameters will not move this step (on_diverged='skip'; info.skipped is "
                "True and info.skip_reason says why)",
                HypergradWarning,
                stacklevel=2,
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
            warnings.warn(
                "HyperStep wrote a result that is not a hypergradient (NaN/Inf entries, or "
                "averaged over ranks with another rank's failed solve) because "
                "on_diverged='write'",
                HypergradWarning,
                stacklevel=2,
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


def _failure(hyper: Tensors, info: HypergradInfo | UnrolledInfo) -> str | None:
    """Which of :data:`FAILURES` makes ``hyper`` not a hypergradient (None when it is one)."""
    solve = info.solve if isinstance(info, HypergradInfo) else None  # unrolled: none
    failure = None if solve is None else solve.failure
    if failure is not None:
        return failure
    if not all(bool(torch.isfinite(h).all()) for h in hyper):
        return "non-finite hypergradient"
    return None


def _residual_of(info: HypergradInfo | UnrolledInfo) -> float:
    """The relative residual of ``info``'s solve (NaN without one), for other ranks' messages."""
    solve = info.solve if isinstance(info, HypergradInfo) else None
    return float("nan") if solve is None else float(solve.residual)


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


def _not_a_hypergradient(hyper: Tensors, info: HypergradInfo | UnrolledInfo) -> str | None:
    """Why ``hyper`` is not a hypergradient (None when it is one).

    A failed solve (:attr:`SolveInfo.failure <hypergrad.SolveInfo.failure>`: diverged,
    singular, stalled, a relative residual that is NaN/Inf or above 1), or NaN/Inf entries.
    """
    failure = _failure(hyper, info)
    if failure is None:
        return None
    solve = info.solve if isinstance(info, HypergradInfo) else None
    return _describe(failure, "" if solve is None else solve.solver, _residual_of(info))


def _unwarned(local: str | None, info: HypergradInfo | UnrolledInfo) -> bool:
    """Whether this rank's problem ``local`` has not been warned about by a solver (NaN/Inf
    entries with a solve that reported no failure, or no solve at all)."""
    solve = info.solve if isinstance(info, HypergradInfo) else None
    return local is not None and (solve is None or solve.failure is None)


def _describe_ranks(
    failed: dict[int, tuple[str, float]], info: HypergradInfo | UnrolledInfo
) -> str:
    """``"rank 1: the cg solve diverged"``; ranks with the same sentence are listed together."""
    solve = info.solve if isinstance(info, HypergradInfo) else None
    solver = "" if solve is None else solve.solver
    groups: dict[str, list[int]] = {}
    for rank in sorted(failed):
        failure, residual = failed[rank]
        groups.setdefault(_describe(failure, solver, residual), []).append(rank)
    return "; ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {text}"
        for text, ranks in groups.items()
    )
