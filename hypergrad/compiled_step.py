"""``compile_outer_step``: one whole outer step of a small bilevel problem as one compiled graph.

An outer step of hyperparameter tuning is: solve the inner problem from the previous solution,
compute the hypergradient by implicit differentiation, update the hyperparameters. Eagerly each
of these is dozens of small tensor operations paying Python and dispatcher overhead; on a
problem with tens of unknowns that overhead is nearly all of the time. Here the whole step is
``torch.func`` code that ``torch.compile`` traces into one graph:

* damped Newton on the dense inner Hessian
  (:func:`~hypergrad.solvers.functional.dense_hessian`: one ``jacrev`` of the gradient per
  iteration, which also gives the gradient and the loss), the Cholesky factor and descent test
  of the Newton step shared with :class:`~hypergrad.inner.Newton`
  (:func:`hypergrad.inner.smooth.damped_cholesky`), a backtracking line search whose
  candidate steps are evaluated in one batch (``vmap``), the stopping test on the relative
  gradient norm of :class:`~hypergrad.inner.Newton`; the iterations are a
  ``torch._higher_order_ops.while_loop`` (its body compiled once, whatever ``maxiter``) that
  stops at the test;
* the adjoint solve ``H x = ∂_w outer`` with the Cholesky factor of the Hessian at the returned
  point, the mixed term ``(∂²_{θw} inner)ᵀ x`` (one ``vjp``) and the hypergradient
  ``∂_θ outer − (∂²_{θw} inner)ᵀ x``;
* optionally the hyperparameters' update (e.g. :func:`adam`), traced into the same graph.

The module reuses :mod:`hypergrad.compiled`'s compile options (``cpp_wrapper`` on the CPU, the
on-disk caches that keep a ``while_loop`` graph) and its per-instance code copies.
"""

from __future__ import annotations

import math
import numbers
import time
import warnings
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, ClassVar, NamedTuple, cast

import torch
from torch.func import grad, grad_and_value, vjp, vmap

from .compiled import DENSE_MAX, compile_options, own_code
from .errors import (
    FrozenSettingError,
    HypergradTypeError,
    HypergradValueError,
    SingularSystemWarning,
    SolverDivergedWarning,
    SolverStalledWarning,
    warn,
)
from .implicit import implicit_grad
from .inner.smooth import ARMIJO, cholesky_solve, damped_cholesky, descent
from .optim import adam_step
from .report import Loss
from .settings import FrozenSettings, check_number, count, number, setting
from .solvers import Exact
from .solvers.functional import dense_hessian, loop
from .tree import PyTree, Tensors, tree_flatten, tree_unflatten

__all__ = ["Adam", "CompiledOuterStep", "OuterStepResult", "adam", "compile_outer_step"]

#: The relative residual ``||H x − ∂_w outer|| / ||∂_w outer||`` the adjoint's Cholesky solve
#: must reach (as the compiled ``Exact``'s LU solve); above it the Hessian is numerically
#: singular and the step reports ``failure="adjoint"``.
ADJOINT_TOL = 1e-6

#: An update of the hyperparameters inside the graph: ``(theta, hypergrad, state) -> (theta,
#: state)``, pure ``torch`` code over pytrees of tensors (no in-place updates).
Update = Callable[[PyTree, PyTree, PyTree], tuple[PyTree, PyTree]]


class OuterStepResult(NamedTuple):
    """What one call of a :class:`CompiledOuterStep` returns.

    Attributes:
        w: the inner solution (the last Newton iterate), with the structure of the ``w`` given.
        theta: the hyperparameters after the update (the given ones without ``update``, or when
            the step failed with ``"indefinite"`` or ``"update"``: see ``failure``).
        opt_state: the update's state after the step (``None`` without ``update``).
        hypergrad: ``d outer / d theta`` at ``w``, with the structure of ``theta`` (NaN where
            ``failure`` is ``"indefinite"``).
        outer_loss: ``outer_loss(w, theta)`` at the returned ``w`` (before the update).
        inner_loss: ``inner_loss(w, theta)`` there.
        iterations: Newton steps taken (0 when the warm start met ``tol``).
        residual: ``||∇_w inner(w)|| / ||∇_w inner(0)||`` at the returned ``w`` (the reference
            is ``||∇_w inner(w0)||`` where the gradient at the origin is zero), as
            :class:`~hypergrad.inner.Newton` measures it.
        converged: ``failure is None``: ``residual <= tol``, the Hessian there positive definite,
            the adjoint solve accurate and everything finite (the updated ``theta`` too).
        adjoint_residual: ``||H x − ∂_w outer|| / ||∂_w outer||`` of the adjoint solve.
        failure: ``None``, or why the step is not trustworthy: ``"maxiter"`` (``tol`` not met
            within ``maxiter`` steps), ``"line_search"`` (no step of the line search decreased
            the loss), ``"indefinite"`` (the Hessian at ``w`` is not positive definite: not a
            strict local minimum, no implicit derivative), ``"adjoint"`` (the Hessian is
            numerically singular: the adjoint solve missed :data:`ADJOINT_TOL`), ``"update"``
            (``update`` returned NaN/Inf hyperparameters or state: neither was changed).
        first_call: whether this call compiled (or, uncompiled, ran first for its signature).
        time_s: wall time of the call.
        compiled: whether this call ran the compiled graph (``compile="auto"``: False until
            the switch).
    """

    w: PyTree
    theta: PyTree
    opt_state: PyTree
    hypergrad: PyTree
    outer_loss: float
    inner_loss: float
    iterations: int
    residual: float
    converged: bool
    adjoint_residual: float
    failure: str | None
    first_call: bool
    time_s: float
    compiled: bool


class _Stats(NamedTuple):
    """The scalars the graph returns as one float64 vector (one host sync), in this order."""

    outer_loss: float
    inner_loss: float
    iterations: float
    residual: float
    line_search_failed: float
    positive_definite: float
    finite: float
    adjoint_residual: float
    update_finite: float


def _constant(label: str, value: Any) -> Any:
    """A one-element floating-point tensor that does not require grad, as the number it holds
    (the graph uses a setting as a constant); anything else as it is."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.numel() != 1 or not value.is_floating_point():
        raise HypergradTypeError(
            f"{label} must be a real number, got a tensor of shape {tuple(value.shape)} and "
            f"dtype {value.dtype}"
        )
    if value.requires_grad:
        raise HypergradTypeError(
            f"{label} is a tensor that requires grad, but the compiled step uses it as a "
            "constant (it is not differentiated); pass a number, or learn it with "
            "hg.unrolled_grad and hg.optim.adam"
        )
    return float(value.detach())


def _positive(label: str, value: Any) -> float:
    """A finite real number > 0 (a one-element tensor as its value)."""
    return check_number(label, _constant(label, value), minimum=0.0, strict=True)


def _betas(label: str, value: Any) -> tuple[float, float]:
    """A pair of finite real numbers in [0, 1)."""
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise HypergradTypeError(f"{label} must be a pair (b1, b2), got {value!r}")
    out = []
    for i, b in enumerate(value):
        x = _constant(f"{label}[{i}]", b)
        if isinstance(x, bool) or not isinstance(x, numbers.Real):
            raise HypergradValueError(f"{label}[{i}] must be a number in [0, 1), got {b!r}")
        xf = float(x)
        if not (math.isfinite(xf) and 0.0 <= xf < 1.0):
            raise HypergradValueError(f"{label}[{i}] must be in [0, 1) and finite, got {b!r}")
        out.append(xf)
    return out[0], out[1]


def _frozen_error(cls: str, name: str, how: str) -> FrozenSettingError:
    return FrozenSettingError(
        f"{cls}.{name} cannot be changed after construction: the settings are validated when "
        "it is built and traced into the compiled graphs (a later change would be seen by the "
        f"eager step and not by a graph already compiled). {how}"
    )


@dataclass(eq=False)
class Adam(FrozenSettings):
    """Adam (Kingma and Ba 2015) as a pure function, for ``compile_outer_step(update=...)``.

    ``state = opt.init(theta)``; ``theta, state = opt(theta, grad, state)`` computes ``m = b1 m +
    (1 − b1) g``, ``v = b2 v + (1 − b2) g²``, ``theta − lr m̂ / (sqrt(v̂) + eps)`` with the
    bias-corrected ``m̂ = m / (1 − b1^t)``, ``v̂ = v / (1 − b2^t)``, over pytrees of tensors:
    the library's one Adam, :func:`hypergrad.optim.adam_step` (``torch.optim.Adam``'s
    arithmetic, without its in-place updates). The step count ``t`` is a float64 tensor in the
    state, so every step runs the same compiled graph.

    The settings are validated when it is built (as :func:`hypergrad.optim.adam`'s, and
    stricter where a value cannot give a useful step: ``lr`` and ``eps`` must be > 0) and frozen
    afterwards (assigning one raises :class:`~hypergrad.FrozenSettingError`;
    ``opt.replace(lr=...)`` builds a validated copy). A step that still leaves NaN/Inf in theta
    (e.g. an ``lr`` that overflows float32) is reported by the step as ``failure="update"``.

    Args:
        lr: the learning rate, a finite number > 0 (a one-element tensor that does not require
            grad is taken as its value).
        betas: ``(b1, b2)``, each in ``[0, 1)``.
        eps: added to ``sqrt(v̂)``, a finite number > 0.

    Raises:
        HypergradValueError: a setting out of range or not finite.
        HypergradTypeError: ``betas`` not a pair; a tensor setting that requires grad.
    """

    display: ClassVar[str] = "compiled_step.adam"

    lr: float = setting(1e-3, _positive)
    betas: tuple[float, float] = setting((0.9, 0.999), _betas)
    eps: float = setting(1e-8, _positive)

    def _frozen_error(self, name: str) -> FrozenSettingError:
        return _frozen_error(
            "Adam", name, f"Build a new one: hg.compiled_step.adam({name}=...) or "
            f"opt.replace({name}=...)."
        )  # fmt: skip

    def init(self, theta: PyTree) -> dict[str, Any]:
        """The state before the first step: zero moments, ``t = 0``."""
        leaves, spec = tree_flatten(theta, "theta")
        zeros = [torch.zeros_like(t) for t in leaves]
        t0 = torch.zeros((), dtype=torch.float64, device=leaves[0].device)
        return {"m": tree_unflatten(spec, zeros), "v": tree_unflatten(spec, list(zeros)), "t": t0}

    def __call__(
        self, theta: PyTree, g: PyTree, state: dict[str, Any]
    ) -> tuple[PyTree, dict[str, Any]]:
        b1, b2 = self.betas
        th, spec = tree_flatten(theta, "theta")
        gs, _ = tree_flatten(g, "hypergrad")
        ms, _ = tree_flatten(state["m"], "m")
        vs, _ = tree_flatten(state["v"], "v")
        t = state["t"] + 1
        updates, new_m, new_v = adam_step(
            tuple(gs), tuple(ms), tuple(vs), t, lr=self.lr, b1=b1, b2=b2, eps=self.eps
        )
        new_t = [x + u for x, u in zip(th, updates)]
        new_state = {"m": tree_unflatten(spec, new_m), "v": tree_unflatten(spec, new_v), "t": t}
        return tree_unflatten(spec, new_t), new_state


def adam(lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> Adam:
    """An :class:`Adam` update for :func:`compile_outer_step` (see there; the settings are
    validated: ``lr`` and ``eps`` finite and > 0, ``betas`` in ``[0, 1)``)."""
    return Adam(lr, betas, eps)


class _NewtonState(NamedTuple):
    z: torch.Tensor  # the iterate (flat)
    f: torch.Tensor  # the loss there
    g: torch.Tensor  # the gradient there
    hess: torch.Tensor  # the Hessian there (symmetrised)
    chol: torch.Tensor  # its Cholesky factor, or the factor of a shifted H where H is not PD
    pd: torch.Tensor  # bool: chol is the factor of H itself
    res: torch.Tensor  # ||g|| / reference
    done: torch.Tensor  # bool
    ls_failed: torch.Tensor  # bool: no candidate step decreased the loss
    iterations: torch.Tensor  # int64


class _Graph:
    """The step of one signature, as a function of flat tensors (compiled or not)."""

    def __init__(
        self,
        owner: CompiledOuterStep,
        inner: Callable[[Tensors, Tensors], torch.Tensor],
        outer: Callable[[Tensors, Tensors], torch.Tensor],
        update: Callable[..., Any] | None,
        shapes: list[torch.Size],
    ) -> None:
        self.owner, self.inner, self.outer, self.update = owner, inner, outer, update
        self.sizes = [math.prod(s) for s in shapes]
        self.shapes = shapes

    def unflat(self, z: torch.Tensor) -> Tensors:
        parts = z.split(self.sizes)  # type: ignore[no-untyped-call]
        return tuple(c.reshape(s) for c, s in zip(parts, self.shapes))

    def run(self, ws: Tensors, hs: Tensors, opt: Tensors, budget: torch.Tensor) -> tuple[Any, ...]:
        o = self.owner
        dtype = ws[0].dtype

        def f(z: torch.Tensor) -> torch.Tensor:
            return self.inner(self.unflat(z), hs)

        def evaluate(z: torch.Tensor) -> tuple[torch.Tensor, ...]:
            hess, g, value = dense_hessian(f, z)
            hess = 0.5 * (hess + hess.T)
            chol, _, pd = damped_cholesky(hess, "gershgorin")
            return value, g, hess, chol, pd

        z0 = torch.cat([t.reshape(-1) for t in ws])
        f0, g0, hess0, chol0, pd0 = evaluate(z0)
        g_origin = grad(f)(torch.zeros_like(z0))
        ref0 = torch.linalg.vector_norm(g_origin)
        ref = torch.where(torch.isfinite(ref0) & (ref0 > 0), ref0, torch.linalg.vector_norm(g0))

        def rel(g: torch.Tensor) -> torch.Tensor:
            gn = torch.linalg.vector_norm(g)
            return torch.where(ref > 0, gn / ref, torch.where(gn > 0, math.inf, 0.0))

        steps = 0.5 ** torch.arange(o.max_backtracks + 1, dtype=dtype, device=z0.device)
        noise = 4.0 * torch.finfo(dtype).eps
        res0 = rel(g0)
        false = torch.zeros((), dtype=torch.bool, device=z0.device)
        state = _NewtonState(
            z=z0, f=f0, g=g0, hess=hess0, chol=chol0, pd=pd0, res=res0,
            done=(res0 <= o.tol) | ~torch.isfinite(res0), ls_failed=false,
            iterations=torch.zeros((), dtype=torch.int64, device=z0.device),
        )  # fmt: skip

        def body(st: _NewtonState) -> _NewtonState:
            d, slope = descent(st.g, -cholesky_solve(st.chol, st.g))
            trial = vmap(f)(st.z + steps.unsqueeze(1) * d)
            ok = torch.isfinite(trial) & (trial <= st.f + ARMIJO * steps * slope)
            # near the minimiser the decrease falls below the rounding of f: the full step
            first = torch.isfinite(trial[0]) & ((trial[0] - st.f).abs() <= noise * st.f.abs())
            ok = torch.cat([ok[:1] | first, ok[1:]])
            found = ok.any()
            pick = ok & (torch.cumsum(ok.to(torch.int64), 0) == 1)  # the first passing step
            a = (steps * pick.to(steps.dtype)).sum()
            z = torch.where(found, st.z + a * d, st.z)
            value, g, hess, chol, pd = evaluate(z)
            res = rel(g)
            its = st.iterations + 1
            done = (res <= o.tol) | ~found | ~torch.isfinite(res)
            return _NewtonState(
                z=z, f=value, g=g, hess=hess, chol=chol, pd=pd, res=res, done=done,
                ls_failed=st.ls_failed | ~found, iterations=its,
            )  # fmt: skip

        state = loop(lambda st: ~st.done & (st.iterations < budget), body, state)

        return self.finish(state, hs, opt)

    def finish(self, state: _NewtonState, hs: Tensors, opt: Tensors) -> tuple[Any, ...]:
        """The adjoint solve with the factor at the returned point, the mixed term, the update
        and the statistics (:class:`_Stats`)."""
        dtype, device = state.z.dtype, state.z.device
        ws_new = self.unflat(state.z)
        (b, g_hs), lo = grad_and_value(self.outer, argnums=(0, 1))(ws_new, hs)
        bf = torch.cat([t.reshape(-1) for t in b])
        x = cholesky_solve(state.chol, bf)
        b_norm = torch.linalg.vector_norm(bf)
        adj = torch.linalg.vector_norm(state.hess @ x - bf)
        adj = torch.where(b_norm > 0, adj / b_norm, adj)
        linearised = vjp(lambda h: grad(self.inner)(ws_new, h), hs)
        pullback = cast("Callable[[Tensors], tuple[Tensors]]", linearised[1])
        (mixed,) = pullback(self.unflat(x))
        hyper = tuple(a - m for a, m in zip(g_hs, mixed))
        finite = torch.stack(
            [torch.isfinite(h).all() for h in hyper] + [torch.isfinite(state.z).all()]
        ).all()
        # no implicit derivative where the Hessian is not positive definite: NaN, reported
        nan = torch.full((), math.nan, dtype=dtype, device=device)
        hyper = tuple(torch.where(state.pd, h, nan.to(h.dtype)) for h in hyper)
        new_hs, new_opt = hs, opt
        upd_ok = torch.ones((), dtype=torch.bool, device=device)
        if self.update is not None:
            upd_hs, upd_opt = self.update(hs, hyper, opt)
            out = [torch.isfinite(t).all() for t in (*upd_hs, *upd_opt)]
            if out:  # NaN/Inf from the update itself (an overflowing step): reported
                upd_ok = torch.stack(out).all()
            # a failed step leaves theta and the state unchanged
            keep = state.pd & finite & upd_ok
            new_hs = tuple(torch.where(keep, u, h) for u, h in zip(upd_hs, hs))
            new_opt = tuple(torch.where(keep, u, s) for u, s in zip(upd_opt, opt))
        stats = torch.stack(
            [
                lo.double(),
                state.f.double(),
                state.iterations.double(),
                state.res.double(),
                state.ls_failed.double(),
                state.pd.double(),
                finite.double(),
                adj.double(),
                upd_ok.double(),
            ]
        )
        return ws_new, new_hs, new_opt, hyper, stats


def _callable(label: str, value: Any) -> Any:
    if not callable(value):
        raise HypergradTypeError(f"{label} must be callable, got {type(value).__name__}")
    return value


def _update(label: str, value: Any) -> Any:
    return None if value is None else _callable(label, value)


def _compile(label: str, value: Any) -> bool | str:
    if value is True or value is False or (isinstance(value, str) and value == "auto"):
        return value
    raise HypergradValueError(f"{label} (compile) must be True, False or 'auto', got {value!r}")


def _mode(label: str, value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise HypergradTypeError(f"{label} must be None or a str, got {value!r}")


def _options(label: str, value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise HypergradTypeError(f"{label} must be None or a dict, got {type(value).__name__}")
    return dict(value)  # a copy: the caller's dict changing later does not reach the graphs


@dataclass(eq=False)
class CompiledOuterStep(FrozenSettings):
    """The callable returned by :func:`compile_outer_step` (see there).

    When it pays: for problems whose unknowns number at most
    :data:`~hypergrad.compiled.DENSE_MAX` (256) in total, called many times (an outer loop of a
    thousand steps or more). Measured on the
    whole-loop benchmark (100 Adam steps, tol 1e-8, one CPU core, float64;
    ``benchmarks/results/whole_loop_compiled.md``): a step took 0.93 ms on a 31-unknown logistic
    regression and 0.50 ms on a 30-feature ridge, against 1.10 and 1.25 ms for jaxopt's jitted
    step and 6.7 and 4.0 ms for :class:`~hypergrad.inner.Newton` with ``reuse_hessian=True``,
    with the same trajectory (the validation loss after 100 steps agreed to 4e-9). The first
    call for given shapes and dtypes compiles (``torch.compile``, ``fullgraph=True``, the
    options of :func:`~hypergrad.compiled.compile_options`): 30-45 s of CPU on a cold inductor
    cache, 6-8 s on a warm one (a second run of the program; jaxopt's first ``jit``: 5-6 s), so
    compiling pays off against the eager Newton after about 1,000-1,500 steps warm and
    7,000-9,000 cold; ``compile=False`` runs the same step eagerly. The losses must be
    traceable by ``torch.func`` and ``torch.compile`` (pure functions of their arguments: no
    ``.item()``, no data-dependent Python control flow), and ``inner_loss`` must work under
    ``vmap`` over ``w`` (the line search).

    Failures are reported, never silent: ``result.failure`` is ``"maxiter"`` or
    ``"line_search"`` (a :class:`~hypergrad.SolverStalledWarning`; the hypergradient is taken
    at the last iterate and is approximate), ``"adjoint"`` (a numerically singular Hessian: the
    adjoint solve missed :data:`ADJOINT_TOL`; a :class:`~hypergrad.SingularSystemWarning`) or
    ``"indefinite"`` (the Hessian at ``w`` is not positive definite; a
    :class:`~hypergrad.SolverDivergedWarning`, the hypergradient is NaN and ``update`` is not
    applied) or ``"update"`` (``update`` returned NaN/Inf hyperparameters or state; a
    :class:`~hypergrad.SolverDivergedWarning`, neither is changed); NaN/Inf in the solution or
    the hypergradient raise :class:`~hypergrad.HypergradValueError`.

    Where the Hessian along the way is not positive definite the Newton step uses ``H + s I``
    with ``s`` a Gershgorin bound (the
    ``"gershgorin"`` rule of :func:`hypergrad.inner.smooth.damped_cholesky`, branch-free;
    :class:`~hypergrad.inner.Newton` searches the smallest Levenberg-Marquardt ``μ`` instead,
    so the two differ only away from a strict local minimum).

    The settings are validated when the step is built and cannot change afterwards: assigning
    or deleting one raises :class:`~hypergrad.FrozenSettingError` (a setting changed later would
    not be validated, ``tol = inf`` would report ``converged`` after no Newton step, and a graph
    already compiled would keep the old value while the eager step read the new one). Build a
    new step instead: ``step.replace(tol=1e-10)`` (``dataclasses.replace``) returns one,
    validated like a new step, with its own (empty) graph cache. Only ``compile_after``, which
    decides when ``compile="auto"`` compiles and never what a step computes, may be assigned
    (validated: a number >= 0).

    Attributes:
        inner_loss, outer_loss: the losses.
        maxiter, tol, max_backtracks: the Newton solve's settings.
        update: the hyperparameters' update in the graph, or None.
        compiled: True, False or ``"auto"`` (see :func:`compile_outer_step`).
        mode, options: ``torch.compile``'s mode and options.
        compile_after: with ``compiled="auto"``, the seconds of eager calls per signature
            after which the next call compiles.
    """

    display: ClassVar[str] = "compile_outer_step"

    inner_loss: Loss = field(metadata={"check": _callable})
    outer_loss: Loss = field(metadata={"check": _callable})
    _: KW_ONLY
    maxiter: int = count(50, minimum=1, allow_none=False)
    tol: float = number(1e-8)
    max_backtracks: int = count(30, minimum=0, allow_none=False)
    update: Update | None = setting(None, _update)
    compiled: bool | str = setting(True, _compile)
    mode: str | None = setting(None, _mode)
    options: dict[str, Any] | None = setting(None, _options)
    compile_after: float = number(10.0)
    _graphs: dict[Any, Callable[..., Any]] = field(default_factory=dict, init=False, repr=False)
    # "auto": the eager step and the eager calls' time per signature
    _eager: dict[Any, Callable[..., Any]] = field(default_factory=dict, init=False, repr=False)
    _eager_s: dict[Any, float] = field(default_factory=dict, init=False, repr=False)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "compile_after" and self._frozen:  # a schedule, not a setting: validated
            value = check_number(f"{self.display} compile_after", value)
            object.__setattr__(self, name, value)
            return
        super().__setattr__(name, value)

    def _frozen_error(self, name: str) -> FrozenSettingError:
        return _frozen_error(
            "CompiledOuterStep", name, f"Build a new step: hg.compile_outer_step(..., "
            f"{name}=...) or step.replace({name}=...)."
        )  # fmt: skip

    def _check(self, w: PyTree, theta: PyTree, ws: list[torch.Tensor]) -> None:
        """The input checks of the first call of a signature."""
        n = sum(t.numel() for t in ws)
        if n > DENSE_MAX:
            raise HypergradValueError(
                f"compile_outer_step builds the dense inner Hessian: at most DENSE_MAX = "
                f"{DENSE_MAX} unknowns, got {n}; use hg.inner.Newton / hg.inner.LBFGS with "
                "hg.implicit_grad or hg.compile_implicit_grad"
            )
        for name, fn in (("inner_loss", self.inner_loss), ("outer_loss", self.outer_loss)):
            with torch.no_grad():
                value = fn(w, theta)
            if not isinstance(value, torch.Tensor) or value.numel() != 1 or value.ndim > 1:
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value)
                raise HypergradValueError(f"{name} must return a scalar tensor, got {shape}")
        # implicit_grad's checks (dtypes, NaN/Inf, hyperparameters that influence nothing)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            implicit_grad(self.inner_loss, self.outer_loss, w, theta, solver=Exact())

    def _build(
        self, w_spec: Any, h_spec: Any, o_spec: Any, ws: list[torch.Tensor], compiled: bool
    ) -> Any:
        def inner(ps: Tensors, hs: Tensors) -> torch.Tensor:
            return self.inner_loss(tree_unflatten(w_spec, ps), tree_unflatten(h_spec, hs))

        def outer(ps: Tensors, hs: Tensors) -> torch.Tensor:
            return self.outer_loss(tree_unflatten(w_spec, ps), tree_unflatten(h_spec, hs))

        update = None
        if self.update is not None:
            user = self.update

            def update(hs: Tensors, gs: Tensors, opt: Tensors) -> tuple[Tensors, Tensors]:
                th, st = user(
                    tree_unflatten(h_spec, hs),
                    tree_unflatten(h_spec, gs),
                    tree_unflatten(o_spec, opt),
                )
                th_leaves, _ = tree_flatten(th, "theta")
                st_leaves, _ = tree_flatten(st, "opt_state")
                return tuple(th_leaves), tuple(st_leaves)

        graph = _Graph(self, inner, outer, update, [t.shape for t in ws])
        fn: Callable[..., Any] = graph.run
        if compiled:
            opts = compile_options(self.mode, self.options, ws[0].device.type)
            fn = torch.compile(own_code(fn), fullgraph=True, dynamic=False, options=opts)
        return fn

    def _failure(self, st: _Stats) -> str | None:
        """Why the step's result is not trustworthy (``OuterStepResult.failure``), warned."""
        failure = None
        if not st.positive_definite:
            failure = "indefinite"
            warn(
                "compile_outer_step: the inner Hessian at the returned w is not positive "
                "definite (not a strict local minimum), so the implicit derivative does not "
                "exist there; the hypergradient is NaN and theta was not updated.",
                SolverDivergedWarning,
            )
        elif not st.update_finite:
            failure = "update"
            warn(
                "compile_outer_step: the update returned NaN/Inf hyperparameters or state from "
                "a finite hypergradient (e.g. a step that overflows theta's dtype, or an update "
                "function producing NaN); theta and opt_state were not updated.",
                SolverDivergedWarning,
            )
        elif st.line_search_failed:
            failure = "line_search"
            warn(
                f"compile_outer_step: no step of the Newton line search decreased the inner "
                f"loss ({self.max_backtracks} halvings); the solve stopped at relative gradient "
                f"{st.residual:.3g} > tol {self.tol:g}, so the hypergradient is approximate.",
                SolverStalledWarning,
            )
        elif st.adjoint_residual > ADJOINT_TOL:
            failure = "adjoint"
            warn(
                f"compile_outer_step: the inner Hessian at w is numerically singular: the "
                f"adjoint solve's relative residual is {st.adjoint_residual:.3g} > "
                f"{ADJOINT_TOL:g}, so the hypergradient is not reliable (add a strictly convex "
                "term to the inner loss, or use hg.implicit_grad with hg.Exact, whose "
                "pseudo-inverse handles singular systems).",
                SingularSystemWarning,
            )
        elif st.residual > self.tol:
            failure = "maxiter"
            warn(
                f"compile_outer_step: the inner Newton solve did not reach tol {self.tol:g} in "
                f"maxiter={self.maxiter} steps (relative gradient {st.residual:.3g}), so the "
                "hypergradient is approximate; raise maxiter or warm-start closer.",
                SolverStalledWarning,
            )
        return failure

    def __call__(self, w: PyTree, theta: PyTree, opt_state: PyTree = None) -> OuterStepResult:
        """One outer step from the warm start ``w`` at the hyperparameters ``theta`` (and, with
        ``update``, the update's state ``opt_state``, e.g. ``update.init(theta)``)."""
        t0 = time.perf_counter()
        ws, w_spec = tree_flatten(w, "w")
        hs, h_spec = tree_flatten(theta, "theta")
        if self.update is not None and opt_state is None:
            raise HypergradValueError(
                "compile_outer_step(update=...) needs opt_state: pass update.init(theta) on the "
                "first step and the returned opt_state afterwards"
            )
        os_, o_spec = ([], None) if self.update is None else tree_flatten(opt_state, "opt_state")
        key = (w_spec, h_spec, o_spec) + tuple((t.shape, t.dtype, t.device) for t in ws + hs + os_)
        first = key not in self._graphs
        eager = (
            first and self.compiled == "auto" and self._eager_s.get(key, 0.0) < self.compile_after
        )
        if eager:  # "auto" before the switch: the same step without torch.compile
            if key not in self._eager:
                self._check(w, theta, ws)
                self._eager[key] = self._build(w_spec, h_spec, o_spec, ws, False)
            first = key not in self._eager_s  # the first eager call of this signature
        elif first:
            if key not in self._eager:
                self._check(w, theta, ws)
            self._graphs[key] = self._build(w_spec, h_spec, o_spec, ws, bool(self.compiled))
        fn = self._eager[key] if eager else self._graphs[key]

        def detach(ts: list[torch.Tensor]) -> Tensors:
            return tuple(t.detach() for t in ts)

        budget = torch.tensor(self.maxiter, device=ws[0].device)
        w_new, h_new, o_new, hyper, stats = fn(detach(ws), detach(hs), detach(os_), budget)
        st = _Stats(*stats.tolist())
        if eager:
            self._eager_s[key] = self._eager_s.get(key, 0.0) + time.perf_counter() - t0
        if not st.finite:
            raise HypergradValueError(
                "the inner solution or the hypergradient contains NaN/Inf (the inner loss or "
                "its derivatives are not finite along the Newton iterates)"
            )
        failure = self._failure(st)
        return OuterStepResult(
            w=tree_unflatten(w_spec, list(w_new)),
            theta=tree_unflatten(h_spec, list(h_new)),
            opt_state=None if o_spec is None else tree_unflatten(o_spec, list(o_new)),
            hypergrad=tree_unflatten(h_spec, list(hyper)),
            outer_loss=st.outer_loss,
            inner_loss=st.inner_loss,
            iterations=int(st.iterations),
            residual=st.residual,
            converged=failure is None,
            adjoint_residual=st.adjoint_residual,
            failure=failure,
            first_call=first,
            time_s=time.perf_counter() - t0,
            compiled=bool(self.compiled) and not eager,
        )


def compile_outer_step(
    inner_loss: Loss,
    outer_loss: Loss,
    *,
    maxiter: int = 50,
    tol: float = 1e-8,
    max_backtracks: int = 30,
    update: Update | None = None,
    compile: bool | str = True,
    mode: str | None = None,
    options: dict[str, Any] | None = None,
    compile_after: float = 10.0,
) -> CompiledOuterStep:
    """One outer step of a small bilevel problem (inner solve, hypergradient, update), compiled.

    Returns ``step(w, theta, opt_state=None) -> OuterStepResult``: from the warm start ``w`` it
    minimises ``inner_loss(., theta)`` by damped Newton on the dense Hessian (at most
    ``maxiter`` steps, stopping at ``||∇_w inner(w)|| <= tol ||∇_w inner(0)||``, the test of
    :class:`~hypergrad.inner.Newton`; Armijo backtracking by halving, the candidate steps
    evaluated in one batch), then computes the hypergradient ``d outer/d theta = ∂_θ outer −
    (∂²_{θw} inner)ᵀ H⁻¹ ∂_w outer`` with the Cholesky factor of the Hessian ``H`` at the
    returned ``w``, and with ``update`` (e.g. :func:`hypergrad.compiled_step.adam`) applies it to
    ``theta`` in the same graph. One host synchronisation per call reads the diagnostics. For
    problems of at most :data:`~hypergrad.compiled.DENSE_MAX` (256) unknowns called many times;
    when it pays, what it requires of the losses, the failures it reports and its rule for a
    non-positive-definite Hessian: :class:`CompiledOuterStep`.

    Args:
        inner_loss: ``(w, theta) -> scalar``, twice differentiable in ``w``.
        outer_loss: ``(w, theta) -> scalar``.
        maxiter: at most this many Newton steps per call (>= 1).
        tol: tolerance on the relative gradient norm (finite, >= 0).
        max_backtracks: step halvings of the line search (>= 0; all ``max_backtracks + 1``
            candidate steps are evaluated at every Newton step).
        update: ``(theta, hypergrad, opt_state) -> (theta, opt_state)``, pure ``torch`` code
            traced into the graph (e.g. ``hg.compiled_step.adam(lr=0.1)``); ``None``: the
            step returns the hypergradient and ``theta`` unchanged.
        compile: True compiles on the first call of each signature (structures, shapes,
            dtypes, devices); False runs the same functional code eagerly (for debugging, for
            tests, or for few calls); ``"auto"`` runs it eagerly until the calls of a signature
            have taken ``compile_after`` seconds, then compiles (the same numbers either way).
        mode: ``torch.compile``'s ``mode`` (passed as its options).
        options: ``torch.compile`` options, over :data:`~hypergrad.compiled.DEFAULT_OPTIONS`
            (and ``cpp_wrapper`` on the CPU) and ``mode``'s.
        compile_after: seconds of eager calls per signature before ``compile="auto"``
            compiles (>= 0; ignored otherwise; 10 s, about a warm-cache compile, suits them).

    Raises:
        HypergradValueError: more than ``DENSE_MAX`` unknowns, a non-scalar loss, settings out
            of range, ``update`` without ``opt_state``, NaN/Inf (see above).
        HypergradTypeError: a loss or ``update`` that is not callable, ``options`` not a dict.

    Example:
        Ridge regression with one log-decay per feature; ``update`` applies Adam in the graph
        (a quadratic inner problem takes one Newton step per call; ``compile=True``, the
        default, runs the same step as one compiled graph):

        >>> import torch, hypergrad as hg
        >>> g = torch.Generator().manual_seed(0)
        >>> X, Xv = torch.randn(40, 5, generator=g, dtype=torch.float64), torch.randn(
        ...     40, 5, generator=g, dtype=torch.float64)
        >>> y, yv = X @ torch.ones(5, dtype=torch.float64), Xv @ torch.ones(5, dtype=torch.float64)
        >>> inner = lambda w, th: 0.5 * ((X @ w - y) ** 2).mean() + 0.5 * (th.exp() * w**2).sum()
        >>> outer = lambda w, th: ((Xv @ w - yv) ** 2).mean()
        >>> opt = hg.compiled_step.adam(lr=0.1)
        >>> step = hg.compile_outer_step(inner, outer, update=opt, compile=False)
        >>> w, theta = torch.zeros(5, dtype=torch.float64), torch.zeros(5, dtype=torch.float64)
        >>> state = opt.init(theta)
        >>> losses = []
        >>> for _ in range(20):
        ...     r = step(w, theta, state)
        ...     w, theta, state = r.w, r.theta, r.opt_state
        ...     losses.append(r.outer_loss)
        >>> r.converged, r.iterations, round(losses[0], 3), round(losses[-1], 3)
        (True, 1, 1.839, 0.192)
    """
    return CompiledOuterStep(
        inner_loss, outer_loss, maxiter=maxiter, tol=tol, max_backtracks=max_backtracks,
        update=update, compiled=compile, mode=mode, options=options, compile_after=compile_after,
    )  # fmt: skip
