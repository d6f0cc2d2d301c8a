"""The check for :class:`~hypergrad.HyperStep` users: modules instead of pytrees."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import nn

from ..errors import HypergradTypeError, HypergradValueError
from ..methods import Implicit
from ..modules import HyperStep, frozen_buffers
from ..report import HypergradInfo, check_leaves
from ..solvers import MINRES
from ..tree import Tensors
from ._directions import flatten_like
from ._pytree import raise_if_failed
from ._report import HypergradCheckReport
from ._run import Point, Problem, quietly, run_check
from ._settings import CheckSettings, grads, scalar, seeded, warn_low_precision, zeros_for_none
from ._verdict import RETRAIN


class _ModuleSnapshot:
    """Everything :func:`check_hyperstep` may change: parameter and buffer objects and values,
    ``.grad``, train/eval flags, and free hyper tensors; :meth:`restore` puts it all back."""

    def __init__(self, modules: Sequence[nn.Module], tensors: Sequence[torch.Tensor]):
        self.slots: list[tuple[nn.Module, str, str, torch.Tensor]] = []
        self.values: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        self.flags: list[tuple[nn.Module, bool]] = []
        seen_mod: set[int] = set()
        seen_t: set[int] = set()

        def keep(t: torch.Tensor) -> None:
            if id(t) not in seen_t:
                seen_t.add(id(t))
                g = t.grad.detach().clone() if t.grad is not None else None
                self.values.append((t, t.detach().clone(), g))

        for root in modules:
            for mod in root.modules():
                if id(mod) in seen_mod:
                    continue
                seen_mod.add(id(mod))
                self.flags.append((mod, mod.training))
                for kind in ("_parameters", "_buffers"):
                    for name, t in getattr(mod, kind).items():
                        if t is not None:
                            self.slots.append((mod, kind, name, t))
                            keep(t)
        for t in tensors:
            keep(t)

    def restore(self) -> None:
        for mod, kind, name, t in self.slots:
            getattr(mod, kind)[name] = t
        with torch.no_grad():
            for t, value, g in self.values:
                t.copy_(value)
                t.grad = g
        for mod, flag in self.flags:
            mod.training = flag


def _as_tensor_list(x: Any, what: str) -> list[Any]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return list(x)
    raise HypergradTypeError(
        f"{what} must be a tensor or a list/tuple of tensors (one per hyper parameter, in the "
        f"order of step.theta), got {type(x).__name__}"
    )


def _check_step(step: Any, retrain: Any) -> None:
    if not isinstance(step, HyperStep):
        raise HypergradTypeError(f"step must be a hg.HyperStep, got {type(step).__name__}")
    if not isinstance(step.method, Implicit):
        raise HypergradValueError(
            f"check_hyperstep checks implicit hypergradients (the inner model retrained at "
            f"theta +- eps d); this step uses method={step.method!r}, whose hypergradient is "
            "that of the look-ahead steps: difference the look-ahead itself instead (written as "
            "a procedure hparams -> params, hypergrad.testing.check_unrolled does)"
        )
    if not callable(retrain):
        raise HypergradTypeError(f"retrain must be callable, got {type(retrain).__name__}")


class _StepProblem:
    """A :class:`~hypergrad.HyperStep` seen as a check problem: ``step.theta`` moved in place,
    the inner model retrained by ``retrain`` and its losses evaluated, all seeded."""

    def __init__(self, step: HyperStep, batch: Any, outer_batch: Any, retrain: Any, seed: int):
        self.step, self.batch, self.outer_batch = step, batch, outer_batch
        self.retrain: Callable[[Any], None] = retrain
        self.seed = seed
        hyper_modules = [step.hyper] if isinstance(step.hyper, nn.Module) else []
        self.modules = [step.inner] + hyper_modules
        self.theta_t, self.psi_t = list(step.theta), list(step.psi)
        self.names = list(step.theta_names)
        self.theta0 = [t.detach().clone() for t in self.theta_t]

    def check_inputs(self, eps: float) -> None:
        check_leaves(self.theta0, self.names, "the hyper parameters")
        warn_low_precision(self.theta0, "the hyper parameters", eps)
        warn_low_precision(self.psi_t, "the inner model's parameters", eps)

    def resolve(self, theta: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for t, v in zip(self.theta_t, theta):
                t.copy_(v)
        with seeded(self.seed):
            self.retrain(self.step.hyper)
        live = {id(p) for p in self.step.inner.parameters()}
        if any(id(p) not in live for p in self.psi_t):
            raise HypergradValueError(
                "retrain replaced Parameters of the inner model: the HyperStep holds the original "
                "Parameter objects, so update them in place (optimizer steps, load_state_dict, or "
                "p.copy_(...) under torch.no_grad())"
            )

    def point(self) -> Point:
        step = self.step
        with frozen_buffers(self.modules), seeded(self.seed):
            lo = scalar(step.outer_loss(step.inner, self.outer_batch), "outer_loss")
            with torch.enable_grad():
                li = scalar(step.inner_loss(step.inner, self.batch), "inner_loss")
                g = zeros_for_none(grads(li, self.psi_t), self.psi_t)
        return Point(float(lo.detach()), float(li.detach()), g, lo.dtype)

    def evaluate(self, theta: list[torch.Tensor]) -> Point:
        self.resolve(theta)
        return self.point()

    def like_theta(self, tree: Any, what: str) -> list[torch.Tensor]:
        return flatten_like(
            tree, self.theta0, None, what, lambda t: (_as_tensor_list(t, what), None)
        )

    def adjoint(self, solver: Any) -> Tensors:
        """The adjoint of an implicit ``compute`` at the current point (with ``solver``)."""
        s = self.step
        method = cast(Implicit, s.method)  # an implicit step (checked on entry)
        probe = HyperStep(
            s.inner,
            s.hyper,
            s.inner_loss,
            s.outer_loss,
            method=Implicit(solver=solver, engine=method.engine),
            buffers=s.buffers,
        )
        with seeded(self.seed):
            # an implicit step (checked on entry): its info is a HypergradInfo
            info = cast(HypergradInfo, probe.compute(self.batch, self.outer_batch)[1])
        return tuple(info.extras["adjoint"])

    def build(self, grad: torch.Tensor | Sequence[torch.Tensor] | None) -> Problem:
        self.resolve(self.theta0)
        center = self.point()
        adjoint: Tensors | None
        if grad is None:
            with seeded(self.seed):
                hyper, info = self.step.compute(self.batch, self.outer_batch)
            grad_leaves = [h.detach() for h in hyper]
            adjoint = tuple(cast(HypergradInfo, info).extras["adjoint"])
        else:
            grad_leaves = self.like_theta(grad, "grad")
            found = quietly(lambda: (self.adjoint(MINRES()),))
            adjoint = None if found is None else found[0]
        with frozen_buffers(self.modules), seeded(self.seed), torch.enable_grad():
            lo = scalar(self.step.outer_loss(self.step.inner, self.outer_batch), "outer_loss")
            direct = zeros_for_none(grads(lo, self.theta_t), self.theta_t)
        return Problem(
            theta=self.theta0,
            names=self.names,
            evaluate=self.evaluate,
            center=center,
            grad=grad_leaves,
            adjoint=adjoint,
            direct=direct,
            flatten_given=lambda d, k: self.like_theta(d, f"directions[{k}]"),
            param_dtypes=[p.dtype for p in self.psi_t],
            source=RETRAIN,
        )


def check_hyperstep(
    step: HyperStep,
    batch: Any,
    retrain: Callable[[Any], None],
    outer_batch: Any = None,
    grad: torch.Tensor | Sequence[torch.Tensor] | None = None,
    *,
    directions: int | str | Sequence[Sequence[torch.Tensor]] | None = None,
    eps: float = 1e-4,
    rtol: float = 1e-4,
    atol: float = 1e-8,
    seed: int = 0,
    inner_tol: float | None = None,
) -> HypergradCheckReport:
    """Check a :class:`~hypergrad.HyperStep`'s hypergradient against finite differences.

    The hyper parameters ``step.theta`` are moved in place to ``theta +- eps d``, the inner
    model is retrained there by ``retrain(step.hyper)``, and the outer loss
    ``step.outer_loss(step.inner, outer_batch)`` is differenced. The analytic side is
    ``step.compute(batch, outer_batch)`` after ``retrain`` at ``theta`` (the hypergradient before
    any ``clip_norm``), or ``grad``. Afterwards every parameter, buffer, ``.grad`` and
    train/eval flag of ``step.inner`` and ``step.hyper`` is what it was before, even if the
    check raises. ``retrain(hyper) -> None`` resets the inner model to a *fixed* starting state
    and trains it to convergence, updating its Parameters *in place*; it runs with the RNG
    seeded to ``seed`` (see ``docs/testing.md``, "HyperStep users").

    Args:
        step: the :class:`~hypergrad.HyperStep` to check.
        batch: the inner batch (passed to ``step.inner_loss``).
        retrain: ``hyper -> None``, retrains ``step.inner`` in place; receives ``step.hyper``.
        outer_batch: the outer batch (default ``batch``), as in ``step(batch, outer_batch)``.
        grad: the hypergradient to check, one tensor per entry of ``step.theta`` (None:
            ``step.compute(batch, outer_batch)``).
        directions: as in :func:`check_hypergrad`; given directions are sequences of tensors
            shaped like ``step.theta``.
        eps: finite-difference step.
        rtol: relative tolerance.
        atol: absolute tolerance.
        seed: seed of the random directions and of the RNG around each retrain and evaluation.
        inner_tol: as in :func:`check_hypergrad` (gradient of ``step.inner_loss`` with respect to
            the inner model's trainable parameters).

    Returns:
        A :class:`HypergradCheckReport`.

    Raises:
        HypergradError: bad arguments, or ``retrain`` replacing the inner model's Parameters.
        HypergradValueError: ``step`` uses ``hg.Unrolled``: its hypergradient is that of
            the look-ahead procedure, not of a re-solved problem (see :func:`check_unrolled`).

    Example:
        >>> import hypergrad as hg, hypergrad.testing as hgt
        >>> X, y = torch.randn(32, 3).double(), torch.randn(32, 1).double()
        >>> model = nn.Linear(3, 1, bias=False).double()
        >>> decay = nn.Linear(1, 1, bias=False).double()  # weight = log penalty
        >>> inner = lambda m, b: ((m(b[0]) - b[1]) ** 2).mean() + decay.weight.exp().sum() * (
        ...     m.weight ** 2).sum()
        >>> outer = lambda m, b: ((m(b[0]) - 1.0) ** 2).mean()
        >>> def retrain(hyper):  # closed form: (X^T X / n + exp(w) I) W^T = X^T y / n
        ...     A = X.T @ X / 32 + hyper.weight.exp().sum() * torch.eye(3).double()
        ...     with torch.no_grad():
        ...         model.weight.copy_(torch.linalg.solve(A, X.T @ y / 32).T)
        >>> step = hg.HyperStep(model, decay, inner, outer, solver=hg.CG(tol=1e-12))
        >>> report = hgt.check_hyperstep(step, (X, y), retrain)
        >>> report.passed, report.rows[0].direction
        (True, 'hyper.weight[0, 0]')
    """
    _check_step(step, retrain)
    settings = CheckSettings(
        directions=directions, eps=eps, rtol=rtol, atol=atol, seed=seed, inner_tol=inner_tol
    )
    outer = batch if outer_batch is None else outer_batch
    problem = _StepProblem(step, batch, outer, retrain, seed)
    snapshot = _ModuleSnapshot(problem.modules, problem.theta_t)
    problem.check_inputs(eps)
    try:
        return run_check(problem=problem.build(grad), settings=settings)
    finally:
        snapshot.restore()


def assert_hyperstep_close(
    step: HyperStep,
    batch: Any,
    retrain: Callable[[Any], None],
    outer_batch: Any = None,
    grad: torch.Tensor | Sequence[torch.Tensor] | None = None,
    *,
    directions: int | str | Sequence[Sequence[torch.Tensor]] | None = None,
    eps: float = 1e-4,
    rtol: float = 1e-4,
    atol: float = 1e-8,
    seed: int = 0,
    inner_tol: float | None = None,
) -> HypergradCheckReport:
    """:func:`check_hyperstep`, raising ``AssertionError`` (message: the table) on failure.

    Args:
        step: as in :func:`check_hyperstep`.
        batch: as in :func:`check_hyperstep`.
        retrain: as in :func:`check_hyperstep`.
        outer_batch: as in :func:`check_hyperstep`.
        grad: as in :func:`check_hyperstep`.
        directions: as in :func:`check_hyperstep`.
        eps: as in :func:`check_hyperstep`.
        rtol: as in :func:`check_hyperstep`.
        atol: as in :func:`check_hyperstep`.
        seed: as in :func:`check_hyperstep`.
        inner_tol: as in :func:`check_hyperstep`.

    Returns:
        The :class:`HypergradCheckReport` when the check passed.

    Raises:
        AssertionError: the check failed; the message is ``str(report)``.

    Example:
        >>> import hypergrad as hg, hypergrad.testing as hgt
        >>> X = torch.randn(32, 2).double()
        >>> model, lam = nn.Linear(2, 1, bias=False).double(), nn.Linear(1, 1).double()
        >>> inner = lambda m, x: ((m(x) - x.sum(1, keepdim=True)) ** 2).mean() + (
        ...     lam.weight.exp().sum() * (m.weight ** 2).sum())
        >>> outer = lambda m, x: (m.weight ** 2).sum() + (lam.bias ** 2).sum()
        >>> def retrain(hyper):
        ...     A = X.T @ X / 32 + hyper.weight.exp().sum() * torch.eye(2).double()
        ...     with torch.no_grad():
        ...         model.weight.copy_(torch.linalg.solve(A, X.T @ X.sum(1) / 32))
        >>> step = hg.HyperStep(model, lam, inner, outer, solver=hg.CG(tol=1e-12))
        >>> _ = hgt.assert_hyperstep_close(step, X, retrain)  # passes silently
        >>> before = model.weight.clone()
        >>> hgt.assert_hyperstep_close(step, X, retrain, grad=[torch.ones(1, 1), torch.ones(1)])
        Traceback (most recent call last):
        ...
        AssertionError: hypergradient check: 2 coordinate directions, ...
        >>> torch.equal(model.weight, before)  # the modules are left as they were
        True
    """
    report = check_hyperstep(
        step,
        batch,
        retrain,
        outer_batch,
        grad,
        directions=directions,
        eps=eps,
        rtol=rtol,
        atol=atol,
        seed=seed,
        inner_tol=inner_tol,
    )
    return raise_if_failed(report)
