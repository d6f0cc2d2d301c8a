"""Implicit differentiation of any optimality condition: :func:`custom_root`,
:func:`custom_fixed_point`, :func:`root_vjp` and :func:`root_jvp`.

At a root ``x*(θ)`` of ``F(x, θ) = 0`` (a pytree like ``x``), the implicit function theorem gives
``dx*/dθ = −A⁻¹ B`` with ``A = ∂F/∂x`` and ``B = ∂F/∂θ``. Reverse mode (a cotangent ``v`` like
``x``) solves the **transposed** system ``Aᵀ u = v``, whose products ``u ↦ Aᵀ u`` are
vector-Jacobian products of ``F``, and returns ``vᵀ dx*/dθ = −Bᵀ u``. Forward mode (a tangent
``t`` like ``θ``) solves ``A w = −B t``, whose products ``w ↦ A w`` come from the
"double-vjp" trick (the vjp ``u ↦ Aᵀ u`` is linear in ``u``; its own vjp is ``A``), so ``F``
needs only ordinary (twice differentiable) autograd. A fixed point ``x = T(x, θ)`` is the root of
``F = x − T(x, θ)``, i.e. the system ``(I − ∂T/∂x)ᵀ u = v``. ``@hg.implicit(inner_loss)`` is the
special case ``F = ∇_x inner_loss`` (:func:`hypergrad.conditions.stationary`), whose ``A`` is a
symmetric Hessian.

``A`` is not symmetric in general, so the default solver is GMRES. A symmetric-only solver (CG,
MINRES, Nystrom, Neumann with ``alpha=None``, whose step comes from a symmetric power
iteration) given a condition that is not known to be symmetric runs a **symmetry probe** first:
``||A r − Aᵀ r|| / max(||A r||, ||Aᵀ r||)`` for one random ``r`` (two products, drawn from a
private generator: the caller's RNG stream is untouched); above :data:`SYMMETRY_RTOL` the call
raises :class:`~hypergrad.HypergradValueError` instead of converging to a wrong answer.
Conditions from :func:`hypergrad.conditions.stationary` are known to be symmetric and skip it.
Neumann with an explicit ``alpha`` is accepted for any condition: the series only needs the
spectral radius of ``I − alpha A`` below 1 (``alpha=1`` on the fixed point of a contraction is
the classic adjoint fixed-point iteration).

Every entry point reports ``info.stationarity`` (see :mod:`hypergrad.conditions`; one extra
Jacobian-vector product for a root, none for a fixed point) and warns with
:class:`~hypergrad.NonStationaryWarning` above
:data:`~hypergrad.conditions.STATIONARITY_THRESHOLD`.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ._core import (
    HypergradInfo,
    Loss,
    bind_hparams,
    check_leaves,
    check_solver,
    closure_leaves,
    explain_dtype_errors,
    fresh,
    gradient_stationarity,
    inner_gradient,
    outside_transforms,
    refuse_differentiable_constants,
    stationarity_product,
    warn_unwarned_failure,
)
from .conditions import Condition, as_condition, stationarity, warn_if_nonstationary
from .conditions import fixed_point as _fixed_point
from .errors import (
    HypergradError,
    HypergradTypeError,
    HypergradValueError,
    NonDifferentiableWarning,
    warn,
)
from .operators import InnerOperator
from .solvers import CG, GMRES, SolveInfo, Solver
from .solvers.base import DISPLAY_NAMES
from .tree import (
    PyTree,
    Tensors,
    leaf_paths,
    tree_all_finite,
    tree_flatten,
    tree_norm,
    tree_sub,
    tree_unflatten,
)

__all__ = ["custom_fixed_point", "custom_root", "root_jvp", "root_vjp"]

Map = Callable[[PyTree, PyTree], PyTree]


def _symmetry_rtol(dtype: torch.dtype) -> float:
    return 10.0 * math.sqrt(torch.finfo(dtype).eps)


#: The symmetry probe refuses a symmetric-only solver when ``||A r − Aᵀ r|| / max(||A r||,
#: ||Aᵀ r||)`` exceeds ``SYMMETRY_RTOL[dtype]`` = 10·sqrt(eps): 1.5e-7 in float64, 3.5e-3 in
#: float32 (rounding of the two products stays far below; a non-symmetric Jacobian is far above).
SYMMETRY_RTOL = {
    dt: _symmetry_rtol(dt) for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64)
}


#: The old name of the report of :func:`root_vjp` / :func:`root_jvp` and of the decorators'
#: ``last_info``: :class:`~hypergrad.HypergradInfo` itself now carries ``stationarity``. Read for
#: a root, ``solve`` is the linear solve (``Aᵀ u = v`` in reverse mode, ``A w = −B t`` in forward
#: mode), ``outer_grad_norm`` the norm of its right-hand side, ``indirect_norm`` and
#: ``hypergrad_norm`` the norm of the returned derivative; ``inner_loss``, ``outer_loss`` and
#: ``direct_norm`` are NaN (there is no loss). ``extras``: ``"adjoint"`` (reverse mode: ``u``,
#: shaped like params) or ``"tangent"`` (forward mode: ``w``); ``"stationarity"`` (the same number
#: as the field); ``"condition_products"`` (products of ``F`` spent outside the solver:
#: stationarity scale and symmetry probe); ``"asymmetry"`` (the probe's ratio, when it ran).
RootInfo = HypergradInfo


def _default_solver(cond: Condition) -> Solver:
    """CG for a symmetric condition (what ``@hg.implicit`` uses), else GMRES."""
    return CG() if cond.symmetric else GMRES()


def _pick_solver(solver: Any, cond: Condition) -> Solver:
    return _default_solver(cond) if solver is None else check_solver(solver)


def _symmetric_only(solver: Solver) -> str | None:
    """How messages name ``solver`` when it assumes a symmetric operator, else None: the solver
    says so itself (:meth:`~hypergrad.solvers.base.Solver.assumes_symmetric`); a solver object
    that is not hypergrad's is taken at its word (``symmetric_only`` attribute, default False)."""
    assumes = getattr(solver, "assumes_symmetric", None)
    if callable(assumes):
        named = assumes()
        return named if isinstance(named, str) else None
    return type(solver).__name__ if getattr(solver, "symmetric_only", False) else None


class _Product:
    """A matvec for the solvers, with ``batched`` for the column-building ones (Exact)."""

    def __init__(
        self,
        one: Callable[[Tensors], Tensors],
        many: Callable[[Tensors], Tensors | None],
        symmetric: bool,
    ):
        # symmetric: what the solvers' advice reads (Neumann never suggests alpha=None or MINRES
        # for a non-symmetric system)
        self.one, self.many, self.symmetric = one, many, symmetric

    def __call__(self, v: Tensors) -> Tensors:
        return self.one(v)

    def batched(self, vs: Tensors) -> Tensors | None:
        return self.many(vs)


class _Linearization:
    """``F`` at ``(x, θ)`` over flat leaves, with its products ``Aᵀ u``, ``A w``, ``Bᵀ u``, ``B t``.

    ``F`` is evaluated once on fresh leaves; ``Aᵀ u`` and ``Bᵀ u`` are ``retain_graph`` vjps of
    that graph; ``A w`` and ``B t`` are vjps of the vjp ``u0 ↦ (Aᵀ u0, Bᵀ u0)`` (built once, with
    ``create_graph``, on first use).
    """

    def __init__(
        self,
        cond: Condition,
        x: Tensors,
        theta: Tensors,
        p_spec: Any,
        h_spec: Any,
        p_names: list[str],
        h_names: list[str],
        captured: Tensors = (),
    ):
        if not tree_all_finite(tuple(t.detach() for t in x)):
            bad = [n for n, t in zip(p_names, x) if not bool(torch.isfinite(t).all())]
            raise HypergradValueError(f"{', '.join(bad)} contains NaN or Inf (the point x)")
        self.cond, self.p_names, self.h_names = cond, p_names, h_names
        self.p_spec, self.h_spec = p_spec, h_spec
        self.loss_value = math.nan  # a condition has no loss
        self.xs, self.ts = fresh(x), fresh(theta)
        # tensors F reaches by closure (the originals: F's graph holds them), differentiated in
        # reverse mode beside θ
        self.captured = captured
        self.products = 0
        with torch.enable_grad():
            out = cond(tree_unflatten(p_spec, list(self.xs)), tree_unflatten(h_spec, list(self.ts)))
        leaves, spec = tree_flatten(out, f"result of {cond.name}")
        if spec != p_spec or any(a.shape != b.shape for a, b in zip(leaves, self.xs)):
            raise HypergradValueError(
                f"{cond.name} must return a pytree with the structure and shapes of params: got "
                f"{spec!r} with shapes {[tuple(a.shape) for a in leaves]}, expected {p_spec!r} "
                f"with shapes {[tuple(a.shape) for a in self.xs]}"
            )
        for o, p, n in zip(leaves, self.xs, p_names):
            if o.dtype != p.dtype:
                raise HypergradTypeError(
                    f"{cond.name} returned dtype {o.dtype} for {n}, which has dtype {p.dtype}"
                )
            if not o.requires_grad:
                raise HypergradValueError(
                    f"the entry of {cond.name} for {n} depends on neither params nor hparams: "
                    "its rows of ∂F/∂params are zero, so the system is singular"
                )
        self.value = tuple(o.detach() for o in leaves)
        if not tree_all_finite(self.value):
            raise HypergradValueError(f"{cond.name} is not finite at the given point (NaN/Inf)")
        self.out = tuple(leaves)
        self._u0: Tensors | None = None
        self._dual: tuple[torch.Tensor | None, ...] = ()

    # -- reverse products -------------------------------------------------------------------
    def _vjp(self, u: Tensors, inputs: Tensors, batched: bool = False) -> tuple[Any, ...]:
        cots = tuple(c.to(o.dtype) for c, o in zip(u, self.out))
        return torch.autograd.grad(
            self.out,
            inputs,
            cots,
            retain_graph=True,
            allow_unused=True,
            is_grads_batched=batched,
        )

    def _check_x_used(self, grads: tuple[torch.Tensor | None, ...]) -> None:
        unused = [n for n, g in zip(self.p_names, grads) if g is None]
        if unused:
            raise HypergradValueError(
                f"{self.cond.name} does not depend on {', '.join(unused)}: ∂F/∂params has zero "
                "columns there, so the system is singular; remove those parameters or make the "
                "condition use them"
            )

    def rmatvec(self, u: Tensors) -> Tensors:
        """``Aᵀ u`` (one vjp)."""
        self.products += 1
        grads = self._vjp(u, self.xs)
        self._check_x_used(grads)
        return tuple(g.detach() for g in grads)

    def rmatvec_batched(self, us: Tensors) -> Tensors | None:
        try:
            grads = self._vjp(us, self.xs, batched=True)
        except RuntimeError:  # an operation without a batching rule: one product per column
            return None
        self._check_x_used(grads)
        self.products += us[0].shape[0]
        return tuple(g.detach() for g in grads)

    def mixed_t(self, u: Tensors) -> list[torch.Tensor | None]:
        """``Bᵀ u`` over the leaves of θ, then over the captured tensors; None for a leaf that
        ``F`` does not depend on."""
        grads = self._vjp(u, self.ts + self.captured)
        return [None if g is None else g.detach() for g in grads]

    # -- forward products (double vjp) ------------------------------------------------------
    def _duals(self) -> tuple[Tensors, tuple[torch.Tensor | None, ...]]:
        if self._u0 is None:
            self._u0 = tuple(torch.zeros_like(v).requires_grad_(True) for v in self.value)
            with torch.enable_grad():
                self._dual = tuple(
                    torch.autograd.grad(
                        self.out,
                        self.xs + self.ts,
                        self._u0,
                        create_graph=True,
                        allow_unused=True,
                    )
                )
        return self._u0, self._dual

    def _forward(self, part: tuple[torch.Tensor | None, ...], t: Tensors, batched: bool) -> Tensors:
        u0, _ = self._duals()
        outs, cots = [], []
        for g, ti in zip(part, t):
            if g is not None and g.requires_grad:
                outs.append(g)
                cots.append(ti.to(g.dtype))
        if not outs:
            zeros = tuple(torch.zeros_like(v) for v in self.value)
            return tuple(z.expand(t[0].shape[0], *z.shape) for z in zeros) if batched else zeros
        grads = torch.autograd.grad(
            outs, u0, cots, retain_graph=True, allow_unused=True, is_grads_batched=batched
        )
        k = t[0].shape[0] if batched else None
        return tuple(
            (torch.zeros_like(v) if k is None else v.new_zeros((k, *v.shape)))
            if g is None
            else g.detach()
            for g, v in zip(grads, self.value)
        )

    def matvec(self, w: Tensors) -> Tensors:
        """``A w`` (one vjp of the vjp graph)."""
        _, dual = self._duals()
        self._check_x_used(dual[: len(self.xs)])
        self.products += 1
        return self._forward(dual[: len(self.xs)], w, False)

    def matvec_batched(self, ws: Tensors) -> Tensors | None:
        _, dual = self._duals()
        self._check_x_used(dual[: len(self.xs)])
        try:
            out = self._forward(dual[: len(self.xs)], ws, True)
        except RuntimeError:
            return None
        self.products += ws[0].shape[0]
        return out

    def mixed(self, t: tuple[torch.Tensor | None, ...]) -> Tensors:
        """``B t`` over the leaves of θ with a tangent (None: no tangent).

        Raises:
            HypergradError: a leaf with a tangent that ``F`` does not depend on.
        """
        _, dual = self._duals()
        part = dual[len(self.xs) :]
        unused = [n for n, g, ti in zip(self.h_names, part, t) if ti is not None and g is None]
        if unused:
            raise HypergradError(
                f"{self.cond.name} does not depend on {', '.join(unused)}: the derivative of the "
                "solution along it would be silently zero. Check that the condition uses these "
                "hyperparameters without detaching them"
            )
        sel = tuple(g if ti is not None else None for g, ti in zip(part, t))
        tt = tuple(torch.zeros_like(th) if ti is None else ti for ti, th in zip(t, self.ts))
        return self._forward(sel, tt, False)

    # -- diagnostics ------------------------------------------------------------------------
    def stationarity(self) -> float:
        """``info.stationarity`` (the scales of :mod:`hypergrad.conditions`)."""
        x = tuple(t.detach() for t in self.xs)
        if self.cond.kind == "fixed_point":
            return stationarity(self.value, x)
        if float(tree_norm(self.value)) == 0.0:
            return 0.0
        jx = self.rmatvec(x) if self.cond.symmetric else self.matvec(x)
        return stationarity(self.value, jx, tree_sub(self.value, jx))

    def asymmetry(self) -> float:
        """``||A r − Aᵀ r|| / max(||A r||, ||Aᵀ r||)`` for one random ``r`` (two products)."""
        gen = torch.Generator().manual_seed(0)
        r = tuple(
            torch.randn(v.shape, generator=gen, dtype=torch.float64).to(v.device, v.dtype)
            for v in self.value
        )
        a, at = self.matvec(r), self.rmatvec(r)
        scale = max(float(tree_norm(a)), float(tree_norm(at)))
        return float(tree_norm(tree_sub(a, at))) / scale if scale > 0 else 0.0


class _GradientLinearization:
    """The condition ``F = ∇_x L(x, θ)`` of an inner loss at ``(x, θ)``, through
    :class:`~hypergrad.operators.InnerOperator` (its engines: one gradient graph reused by every
    product, or a fresh one per product with the random draws replayed): ``Aᵀ u = A u = H u``,
    ``Bᵀ u`` its mixed product. What ``@hg.implicit`` linearizes; reverse mode only.

    Its products and reports are those of :class:`_Linearization` on
    ``hg.conditions.stationary(L)`` (the same autograd calls), with ``loss_value`` and the
    engines on top.
    """

    def __init__(
        self,
        cond: Condition,
        inner_loss: Loss,
        engine: str,
        measure: bool,
        x: Tensors,
        theta: Tensors,
        p_spec: Any,
        h_spec: Any,
        p_names: list[str],
        h_names: list[str],
        captured: Tensors = (),
    ):
        self.cond, self.p_names, self.h_names = cond, p_names, h_names
        self.p_spec, self.h_spec, self.measure = p_spec, h_spec, measure
        self.xs, self.ts, self.captured = fresh(x), fresh(theta), captured
        n_h = len(theta)

        def loss(ps: Tensors, hs: Tensors) -> torch.Tensor:
            # hs: θ's leaves, then the captured tensors (which the loss reaches by closure)
            return inner_loss(tree_unflatten(p_spec, ps), tree_unflatten(h_spec, hs[:n_h]))

        self.op = InnerOperator(loss, self.xs, self.ts + captured, engine=engine, psi_names=p_names)
        self.loss_value = self.op.loss_value
        self.value = inner_gradient(self.op)
        self.products = 0

    def stationarity(self) -> float:
        """:func:`~hypergrad._core.gradient_stationarity` (one product), NaN unless measured."""
        if not self.measure:
            return math.nan
        h_psi = stationarity_product(self.op, self.value)
        self.products = int(h_psi is not None)
        return gradient_stationarity(self.value, h_psi)

    def rmatvec(self, u: Tensors) -> Tensors:
        return self.op.hvp(u)

    def rmatvec_batched(self, us: Tensors) -> Tensors | None:
        return self.op.hvp_batched(us)

    def mixed_t(self, u: Tensors) -> list[torch.Tensor | None]:
        """``Bᵀ u`` (the last product: the reuse engine's graph is released)."""
        return self.op.mixed(u)

    def mixed(self, t: tuple[torch.Tensor | None, ...]) -> Tensors:
        raise HypergradError(
            "@hg.implicit differentiates in reverse mode only (.backward(), torch.func.grad, "
            "vjp, jacrev); for forward mode (jvp, jacfwd) use "
            "hg.custom_root(hg.conditions.stationary(inner_loss))"
        )

    # a Hessian is symmetric: A w = Aᵀ w (forward mode stops at mixed above)
    matvec, matvec_batched = rmatvec, rmatvec_batched

    def asymmetry(self) -> float:
        return 0.0


Linearization = _Linearization | _GradientLinearization


def _check_symmetry(lin: Linearization, solver: Solver, extras: dict[str, Any]) -> None:
    """Run the symmetry probe when ``solver`` assumes a symmetric operator and the condition is
    not known to be symmetric; raise when it is clearly not."""
    name = _symmetric_only(solver)
    if name is None or lin.cond.symmetric:
        return
    asym = lin.asymmetry()
    extras["asymmetry"] = asym
    rtol = _symmetry_rtol(lin.value[0].dtype)
    if not asym <= rtol:
        raise HypergradValueError(
            f"{name} assumes a symmetric system, but ∂{lin.cond.name}/∂params is not symmetric "
            f"(||A r - A^T r|| / ||A r|| = {asym:.2g} > {rtol:.1g} for a random r): it would "
            "converge to a wrong answer. Use hg.GMRES(), hg.BiCGStab() or hg.Exact(); or, for "
            "a gradient condition, hg.conditions.stationary(inner_loss)"
        )


def _check_kinks(lin: Linearization, stat: float, extras: dict[str, Any]) -> None:
    """``extras["kinks"]``: for a condition on a prox/projection operator, the coordinates of
    the operator's input at one of its kinks (within ``max(sqrt(eps), stationarity)`` relative:
    the point's own accuracy); a :class:`~hypergrad.NonDifferentiableWarning` when there are."""
    if lin.cond.kinks is None:
        return
    rtol = math.sqrt(torch.finfo(lin.value[0].dtype).eps)
    if math.isfinite(stat):
        rtol = max(rtol, stat)
    x = tree_unflatten(lin.p_spec, [t.detach() for t in lin.xs])
    theta = tree_unflatten(lin.h_spec, [t.detach() for t in lin.ts])
    count = lin.cond.kinks(x, theta, rtol)
    extras["kinks"] = count
    if count:
        warn(
            f"{count} coordinate(s) of the solution sit at a kink of the proximal/projection "
            f"operator (its input within {rtol:.1g} relative of a threshold or bound): the "
            "solution map is not differentiable there, and the derivative returned is "
            "autograd's choice at the kink (a one-sided limit, or at an exact tie an average "
            "of them), not a derivative: a small change of the hyperparameters moves those "
            "coordinates across the kink. The count is in info.extras['kinks']",
            NonDifferentiableWarning,
        )


def _reverse(
    lin: Linearization, cot: Tensors, solver: Solver, needs: tuple[bool, ...]
) -> tuple[Tensors, HypergradInfo]:
    """``−Bᵀ u`` with ``Aᵀ u = cot`` and the info of the solve."""
    t0 = time.perf_counter()
    stat = lin.stationarity()
    if not isinstance(lin, _GradientLinearization) or lin.measure:
        warn_if_nonstationary(stat, lin.cond.name)
    extras: dict[str, Any] = {}
    _check_kinks(lin, stat, extras)
    _check_symmetry(lin, solver, extras)
    extras["condition_products"] = lin.products  # the solver's products are in sinfo
    u, sinfo = solver.solve(
        _Product(lin.rmatvec, lin.rmatvec_batched, lin.cond.symmetric), cot, None
    )
    warn_unwarned_failure(solver, sinfo)
    _check_solution(u, sinfo)
    mixed = lin.mixed_t(u)
    # θ's leaves, then the captured tensors (their needs are not checked: one that F reaches
    # only outside x's dependence has a zero derivative, which is the true one)
    unused = [n for n, m, need in zip(lin.h_names, mixed, needs) if m is None and need]
    if unused:
        raise HypergradError(
            f"{lin.cond.name} does not depend on {', '.join(unused)}: the gradient through the "
            "solution would be silently zero. Check that the condition uses these "
            "hyperparameters without detaching them"
        )
    out = tuple(
        torch.zeros_like(t) if m is None else -m for m, t in zip(mixed, lin.ts + lin.captured)
    )
    if not tree_all_finite(out):
        raise HypergradValueError("the derivative through the root contains NaN/Inf")
    norm = float(tree_norm(out))
    extras.update(adjoint=u, stationarity=stat)
    info = HypergradInfo(
        solve=sinfo,
        inner_loss=lin.loss_value,
        # the norm the solver measured when it did (the same number: b is cot)
        outer_grad_norm=float(sinfo.extras.get("b_norm", tree_norm(cot))),
        indirect_norm=norm,
        hypergrad_norm=norm,
        time_s=time.perf_counter() - t0,
        extras=extras,
        stationarity=stat,
    )
    return out, info


def _forward(
    lin: Linearization, tangents: tuple[torch.Tensor | None, ...], solver: Solver
) -> tuple[Tensors, HypergradInfo]:
    """``w`` with ``A w = −B t`` and the info of the solve."""
    t0 = time.perf_counter()
    rhs = tuple(-b for b in lin.mixed(tangents))
    stat = lin.stationarity()
    warn_if_nonstationary(stat, lin.cond.name)
    extras: dict[str, Any] = {}
    _check_kinks(lin, stat, extras)
    _check_symmetry(lin, solver, extras)
    extras["condition_products"] = lin.products  # the solver's products are in sinfo
    w, sinfo = solver.solve(_Product(lin.matvec, lin.matvec_batched, lin.cond.symmetric), rhs, None)
    warn_unwarned_failure(solver, sinfo)
    _check_solution(w, sinfo)
    norm = float(tree_norm(w))
    extras.update(tangent=w, stationarity=stat)
    info = HypergradInfo(
        solve=sinfo,
        outer_grad_norm=float(tree_norm(rhs)),
        indirect_norm=norm,
        hypergrad_norm=norm,
        time_s=time.perf_counter() - t0,
        extras=extras,
        stationarity=stat,
    )
    return w, info


def _check_solution(x: Tensors, sinfo: SolveInfo) -> None:
    if not tree_all_finite(x):
        raise HypergradValueError(
            f"the {DISPLAY_NAMES.get(sinfo.solver, sinfo.solver)} solve produced NaN/Inf "
            f"(residual {sinfo.residual:.3g}); check the condition, or use another solver"
        )


def _check_like(
    tree: PyTree, what: str, leaves: list[torch.Tensor], spec: Any, names: list[str]
) -> Tensors:
    """The leaves of ``tree`` (detached), checked against ``leaves`` (structure, shape, dtype,
    device) and for NaN/Inf."""
    t_leaves, t_spec = tree_flatten(tree, what)
    if t_spec != spec or any(a.shape != b.shape for a, b in zip(t_leaves, leaves)):
        raise HypergradValueError(
            f"{what} must have the structure and shapes of {names[0].split('[')[0]}: got "
            f"{t_spec!r} with shapes {[tuple(a.shape) for a in t_leaves]}, expected {spec!r} "
            f"with shapes {[tuple(a.shape) for a in leaves]}"
        )
    for a, b, n in zip(t_leaves, leaves, names):
        if a.dtype != b.dtype:
            raise HypergradTypeError(f"{what} has dtype {a.dtype} where {n} has {b.dtype}")
        if a.device != b.device:
            raise HypergradValueError(f"{what} is on {a.device} where {n} is on {b.device}")
    out = tuple(a.detach() for a in t_leaves)
    if not tree_all_finite(out):
        raise HypergradValueError(f"{what} contains NaN or Inf")
    return out


def _setup(
    optimality_fn: Map | Condition, params: PyTree, hparams: PyTree
) -> tuple[Condition, list[torch.Tensor], Any, list[str], list[torch.Tensor], Any, list[str]]:
    cond = as_condition(optimality_fn)
    p_leaves, p_spec = tree_flatten(params, "params")
    h_leaves, h_spec = tree_flatten(hparams, "hparams")
    p_names, h_names = leaf_paths(p_spec, "params"), leaf_paths(h_spec, "hparams")
    check_leaves(p_leaves, p_names, "params")
    check_leaves(h_leaves, h_names, "hparams")
    return cond, p_leaves, p_spec, p_names, h_leaves, h_spec, h_names


def root_vjp(
    optimality_fn: Map | Condition,
    params: PyTree,
    hparams: PyTree,
    cotangent: PyTree,
    *,
    solver: Solver | None = None,
) -> tuple[PyTree, HypergradInfo]:
    """Reverse mode: ``vᵀ dx*/dθ`` at a root ``params`` of ``optimality_fn``.

    Solves ``(∂F/∂params)ᵀ u = cotangent`` and returns ``−(∂F/∂hparams)ᵀ u``: the gradient that
    a loss with ``∂loss/∂params = cotangent`` passes to ``hparams`` through the solution map.

    Args:
        optimality_fn: ``F(params, hparams)``, a pytree like ``params``, zero at the solution;
            a plain callable or a :class:`hypergrad.conditions.Condition` (e.g.
            ``hg.conditions.fixed_point(T)`` for a fixed point ``params = T(params, hparams)``).
        params: the root (a pytree of float tensors, detached).
        hparams: the hyperparameters (a pytree of float tensors, detached).
        cotangent: ``v``, a pytree like ``params``.
        solver: linear solver for the transposed system (default: ``hg.GMRES()``; ``hg.CG()``
            for a symmetric condition such as ``hg.conditions.stationary(loss)``). Symmetric-only
            solvers are refused for a condition whose Jacobian is not symmetric (module docs).

    Returns:
        ``(vjp, info)``: ``vjp`` has the structure of ``hparams``; ``info`` is a
        :class:`~hypergrad.HypergradInfo` (``info.solve``, ``info.stationarity``,
        ``info.extras["adjoint"]``).

    Raises:
        HypergradError: bad inputs (integer, non-leaf or non-finite tensors, a cotangent unlike
            params, ``F`` returning a pytree unlike params or NaN/Inf), ``F`` not depending on a
            leaf of params (singular system) or of hparams (a silently zero derivative), a
            symmetric-only solver on a non-symmetric condition.

    Warns:
        NonStationaryWarning: ``info.stationarity`` is above
            :data:`hypergrad.conditions.STATIONARITY_THRESHOLD`.

    Example (the root of ``F(x, θ) = A x − θ`` is ``A⁻¹ θ``, so ``vᵀ dx*/dθ = A⁻ᵀ v``):
        >>> import hypergrad as hg
        >>> A = torch.tensor([[2.0, 1.0], [0.0, 4.0]], dtype=torch.float64)
        >>> F = lambda x, th: A @ x - th
        >>> th = torch.tensor([1.0, 2.0], dtype=torch.float64)
        >>> x = torch.linalg.solve(A, th)
        >>> v = torch.tensor([1.0, 1.0], dtype=torch.float64)
        >>> g, info = hg.root_vjp(F, x, th, v, solver=hg.Exact())
        >>> torch.allclose(g, torch.linalg.solve(A.T, v)), info.stationarity
        (True, 0.0)
    """
    cond, p_leaves, p_spec, p_names, h_leaves, h_spec, h_names = _setup(
        optimality_fn, params, hparams
    )
    cot = _check_like(cotangent, "cotangent", p_leaves, p_spec, p_names)
    slv = _pick_solver(solver, cond)
    lin = _Linearization(cond, tuple(p_leaves), tuple(h_leaves), p_spec, h_spec, p_names, h_names)
    out, info = _reverse(lin, cot, slv, (True,) * len(h_leaves))
    info.extras["adjoint"] = tree_unflatten(p_spec, list(info.extras["adjoint"]))
    return tree_unflatten(h_spec, list(out)), info


def root_jvp(
    optimality_fn: Map | Condition,
    params: PyTree,
    hparams: PyTree,
    tangents: PyTree,
    *,
    solver: Solver | None = None,
) -> tuple[PyTree, HypergradInfo]:
    """Forward mode: ``dx*/dθ · t`` at a root ``params`` of ``optimality_fn``.

    Solves ``(∂F/∂params) w = −(∂F/∂hparams) t`` and returns ``w``. The products with
    ``∂F/∂params`` are vjps of ``F``'s vjp (``F`` must be twice differentiable by autograd).

    Args:
        optimality_fn: ``F(params, hparams)`` as in :func:`root_vjp`.
        params: the root (a pytree of float tensors, detached).
        hparams: the hyperparameters (a pytree of float tensors, detached).
        tangents: ``t``, a pytree like ``hparams``.
        solver: as in :func:`root_vjp` (the system is ``∂F/∂params``, not its transpose).

    Returns:
        ``(jvp, info)``: ``jvp`` has the structure of ``params``; ``info`` is a
        :class:`~hypergrad.HypergradInfo` (``info.extras["tangent"]`` is ``jvp`` itself).

    Raises:
        HypergradError: as :func:`root_vjp` (tangents unlike hparams).

    Warns:
        NonStationaryWarning: as :func:`root_vjp`.

    Example:
        >>> import hypergrad as hg
        >>> A = torch.tensor([[2.0, 1.0], [0.0, 4.0]], dtype=torch.float64)
        >>> F = lambda x, th: A @ x - th
        >>> th = torch.tensor([1.0, 2.0], dtype=torch.float64)
        >>> t = torch.tensor([1.0, 0.0], dtype=torch.float64)
        >>> w, info = hg.root_jvp(F, torch.linalg.solve(A, th), th, t, solver=hg.Exact())
        >>> torch.allclose(w, torch.linalg.solve(A, t))
        True
    """
    cond, p_leaves, p_spec, p_names, h_leaves, h_spec, h_names = _setup(
        optimality_fn, params, hparams
    )
    tan = _check_like(tangents, "tangents", h_leaves, h_spec, h_names)
    slv = _pick_solver(solver, cond)
    lin = _Linearization(cond, tuple(p_leaves), tuple(h_leaves), p_spec, h_spec, p_names, h_names)
    w, info = _forward(lin, tan, slv)
    w_tree = tree_unflatten(p_spec, list(w))
    info.extras["tangent"] = w_tree
    return w_tree, info


# -- the decorators ----------------------------------------------------------------------------


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
    #: :class:`_GradientLinearization` with this engine (None: the condition itself)
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
            return _GradientLinearization(
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
        return _Linearization(
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


class _RootVJP(torch.autograd.Function):
    """``(v, x, θ) -> −Bᵀ u`` with ``Aᵀ u = v``: the reverse-mode solve."""

    @staticmethod
    def forward(
        prob: _RootProblem, needs: tuple[bool, ...], n_out: int, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        v = tuple(t.detach() for t in tensors[:n_out])
        x, theta = tensors[n_out : 2 * n_out], tensors[2 * n_out :]
        with prob.explain(x, theta):
            out, info = _reverse(prob.linearize(x, theta), v, prob.solver, needs)
        info.extras["adjoint"] = tree_unflatten(prob.out_spec, list(info.extras["adjoint"]))
        prob.report(info)
        return out

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, ...]:
        _first_order_only()
        return ()  # pragma: no cover

    @staticmethod
    def vmap(
        info: Any,
        in_dims: tuple[Any, ...],
        prob: _RootProblem,
        needs: tuple[bool, ...],
        n_out: int,
        *tensors: torch.Tensor,
    ) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:
        rows = [
            _RootVJP.apply(prob, needs, n_out, *_unbatch(tensors, in_dims[3:], i))
            for i in range(info.batch_size)
        ]
        outs = _stack(rows)
        return outs, (0,) * len(outs)


class _RootJVP(torch.autograd.Function):
    """``(t, x, θ) -> w`` with ``A w = −B t``: the forward-mode solve."""

    @staticmethod
    def forward(
        prob: _RootProblem, given: tuple[bool, ...], n_out: int, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        n_h = len(given)
        t = tuple(a.detach() if g else None for a, g in zip(tensors[:n_h], given))
        lin = prob.linearize(tensors[n_h : n_h + n_out], tensors[n_h + n_out :])
        w, info = _forward(lin, t, prob.solver)
        info.extras["tangent"] = tree_unflatten(prob.out_spec, list(w))
        prob.report(info)
        return w

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, ...]:
        _first_order_only()
        return ()  # pragma: no cover

    @staticmethod
    def vmap(
        info: Any,
        in_dims: tuple[Any, ...],
        prob: _RootProblem,
        given: tuple[bool, ...],
        n_out: int,
        *tensors: torch.Tensor,
    ) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:
        rows = [
            _RootJVP.apply(prob, given, n_out, *_unbatch(tensors, in_dims[3:], i))
            for i in range(info.batch_size)
        ]
        outs = _stack(rows)
        return outs, (0,) * len(outs)


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
    slv = _pick_solver(solver, cond)

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
