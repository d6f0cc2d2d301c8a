"""The linearization of an optimality condition at a point ``(x, θ)``: the products the
adjoint solves need (``Aᵀ u``, ``A w``, ``Bᵀ u``, ``B t`` with ``A = ∂F/∂x``, ``B = ∂F/∂θ``,
batched forms for the column-building solvers), the stationarity of the point and the symmetry
probe. Two implementations of one protocol: :class:`ConditionLinearization` (any ``F``, through
``F``'s own graph) and :class:`GradientLinearization` (``F = ∇_x L`` of an inner loss, through
:class:`~hypergrad.operators.InnerOperator`: the engines and the replay of random draws)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ..conditions import Condition, relative_residual
from ..errors import (
    HypergradError,
    HypergradTypeError,
    HypergradValueError,
)
from ..operators import InnerOperator
from ..report import Loss, Reduce, fresh
from ..tree import (
    PyTree,
    Tensors,
    tree_all_finite,
    tree_flatten,
    tree_norm,
    tree_sub,
    tree_unflatten,
)

Map = Callable[[PyTree, PyTree], PyTree]


def symmetry_rtol(dtype: torch.dtype) -> float:
    return 10.0 * math.sqrt(torch.finfo(dtype).eps)


#: The symmetry probe refuses a symmetric-only solver when ``||A r − Aᵀ r|| / max(||A r||,
#: ||Aᵀ r||)`` exceeds ``SYMMETRY_RTOL[dtype]`` = 10·sqrt(eps): 1.5e-7 in float64, 3.5e-3 in
#: float32 (rounding of the two products stays far below; a non-symmetric Jacobian is far above).
SYMMETRY_RTOL = {
    dt: symmetry_rtol(dt) for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64)
}


class Product:
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


class ConditionLinearization:
    """``F`` at ``(x, θ)`` over flat leaves, with its products ``Aᵀ u``, ``A w``, ``Bᵀ u``, ``B t``.

    ``F`` is evaluated once on fresh leaves; ``Aᵀ u`` and ``Bᵀ u`` are ``retain_graph`` vjps of
    that graph; ``A w`` and ``B t`` are vjps of the vjp ``u0 ↦ (Aᵀ u0, Bᵀ u0)`` (built once, with
    ``create_graph``, on first use).
    """

    #: a non-stationary point is warned (:class:`~hypergrad.NonStationaryWarning`)
    warn_stationarity = True
    #: what a NaN/Inf solution's message suggests
    hint = "check the condition, or use another solver"

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

    def _forward_product(
        self, part: tuple[torch.Tensor | None, ...], t: Tensors, batched: bool
    ) -> Tensors:
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
        return self._forward_product(dual[: len(self.xs)], w, False)

    def matvec_batched(self, ws: Tensors) -> Tensors | None:
        _, dual = self._duals()
        self._check_x_used(dual[: len(self.xs)])
        try:
            out = self._forward_product(dual[: len(self.xs)], ws, True)
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
        return self._forward_product(sel, tt, False)

    # -- diagnostics ------------------------------------------------------------------------
    def stationarity(self) -> float:
        """``info.stationarity`` (the scales of :mod:`hypergrad.conditions`)."""
        x = tuple(t.detach() for t in self.xs)
        if self.cond.kind == "fixed_point":
            return relative_residual(self.value, x)
        if float(tree_norm(self.value)) == 0.0:
            return 0.0
        jx = self.rmatvec(x) if self.cond.symmetric else self.matvec(x)
        return relative_residual(self.value, jx, tree_sub(self.value, jx))

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


class GradientLinearization:
    """The condition ``F = ∇_x L(x, θ)`` of an inner loss at ``(x, θ)``, through an
    :class:`~hypergrad.operators.InnerOperator` (its engines: one gradient graph reused by every
    product, or a fresh one per product with the random draws replayed): ``Aᵀ u = A u = H u``,
    ``Bᵀ u`` its mixed product. Reverse mode only. The one linearization of an inner loss:
    ``@hg.implicit`` (:meth:`of_loss`), :func:`~hypergrad.implicit_grad` and
    :class:`~hypergrad.HyperStep` (through
    :func:`~hypergrad.implicit.adjoint.hypergradient_core`) all solve through it.

    Its products and reports are those of :class:`ConditionLinearization` on
    ``hg.conditions.stationary(L)`` (the same autograd calls), with ``loss_value`` and the
    engines on top.

    Args:
        cond: the condition (``hg.conditions.stationary`` of the loss: how messages name it).
        op: the inner loss's operator at the point; its ``theta`` is θ's leaves, then
            ``captured``.
        p_spec, h_spec: the structures of x and θ (None for flat leaves).
        h_names: how messages name θ's leaves.
        measure: whether :meth:`stationarity` measures (one product) or reports NaN.
        warn: whether the solve warns a measured non-stationary point
            (:class:`~hypergrad.NonStationaryWarning`); False where the caller decides.
        captured: tensors the loss reaches by closure, differentiated beside θ.
        reduce: a collective (e.g. :func:`~hypergrad.distributed.all_reduce_mean`) applied to
            every product, to the right-hand side with the gradient (:meth:`reduce_rhs`) and to
            ``H x`` with the caller's direct term (:meth:`reduce_with_scale`), so the
            stationarity is that of the global inner loss at no extra collective.
    """

    def __init__(
        self,
        cond: Condition,
        op: InnerOperator,
        p_spec: Any,
        h_spec: Any,
        h_names: list[str],
        *,
        measure: bool,
        warn: bool = True,
        captured: Tensors = (),
        reduce: Reduce | None = None,
    ):
        self.cond, self.op, self.p_names, self.h_names = cond, op, op.psi_names, h_names
        self.p_spec, self.h_spec, self.captured = p_spec, h_spec, captured
        self.measure, self.warn_stationarity, self.reduce = measure, warn and measure, reduce
        self.xs, self.ts = op.psi, op.theta[: len(op.theta) - len(captured)]
        self.loss_value = op.loss_value
        # F, detached: free with the reuse engine; only when measured (its one use)
        self.value: Tensors = inner_gradient(op) if measure else ()
        self.products = 0
        self._scale: Tensors | None = None  # H x, when reduce defers the measure

    @classmethod
    def of_loss(
        cls,
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
    ) -> GradientLinearization:
        """``@hg.implicit``'s: ``inner_loss`` over pytrees at fresh leaves of ``x`` and ``θ``."""
        xs, ts = fresh(x), fresh(theta)
        n_h = len(theta)

        def loss(ps: Tensors, hs: Tensors) -> torch.Tensor:
            # hs: θ's leaves, then the captured tensors (which the loss reaches by closure)
            return inner_loss(tree_unflatten(p_spec, ps), tree_unflatten(h_spec, hs[:n_h]))

        op = InnerOperator(loss, xs, ts + captured, engine=engine, psi_names=p_names)
        return cls(cond, op, p_spec, h_spec, h_names, measure=measure, captured=captured)

    def reduce_rhs(self, rhs: Tensors) -> Tensors:
        """The right-hand side reduced (as is without ``reduce``), in one collective with the
        gradient ``F`` when it is measured (``F`` is then the global one)."""
        if self.reduce is None:
            return rhs
        if not self.value:
            return self.reduce(rhs)
        both = self.reduce(tuple(rhs) + tuple(self.value))
        self.value = both[len(rhs) :]
        return both[: len(rhs)]

    def stationarity(self) -> float:
        """:func:`gradient_stationarity` (one product ``H x``, before the solve: the mixed
        product releases the reuse engine's graph); NaN unless measured, and NaN under
        ``reduce``, where ``H x`` waits for the caller's collective (:meth:`reduce_with_scale`)."""
        if not self.measure:
            return math.nan
        h_x = stationarity_product(self.op, self.value)
        self.products = int(h_x is not None)
        if self.reduce is not None:
            self._scale = h_x
            return math.nan
        return gradient_stationarity(self.value, h_x)

    def reduce_with_scale(self, other: Tensors) -> tuple[Tensors, float]:
        """Under ``reduce``: ``other`` reduced in one collective with the deferred ``H x``, and
        the global stationarity (NaN unless measured)."""
        if self.reduce is None:
            raise HypergradError("reduce_with_scale needs a linearization with reduce")
        if self._scale is None:
            out = self.reduce(other)
            return out, (0.0 if self.measure else math.nan)
        both = self.reduce(tuple(other) + tuple(self._scale))
        return both[: len(other)], gradient_stationarity(self.value, both[len(other) :])

    def rmatvec(self, u: Tensors) -> Tensors:
        h = self.op.hvp(u)
        return h if self.reduce is None else self.reduce(h)

    def rmatvec_batched(self, us: Tensors) -> Tensors | None:
        return self.op.hvp_batched(us) if self.reduce is None else None

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

    #: what a NaN/Inf solution's message suggests
    hint = "check the inner loss, add damping, or use another solver"


Linearization = ConditionLinearization | GradientLinearization


def inner_gradient(op: InnerOperator) -> Tensors:
    """``F = ∇_psi L_in`` at the operator's point, detached: the condition whose stationarity
    the implicit entry points report.

    Free with the ``"reuse"`` engine (the gradient graph every product differentiates is that
    gradient); one more gradient pass (with the same random draws) with ``"recompute"``.
    """
    # InnerOperator keeps its gradient graph private; it is read here, inside the package.
    grads = op._grads if op._grads is not None else op._gradient_graph()[1]
    return tuple(torch.zeros_like(p) if g is None else g.detach() for g, p in zip(grads, op.psi))


def stationarity_product(op: InnerOperator, gradient: Tensors) -> Tensors | None:
    """``H psi``, the product that scales :func:`gradient_stationarity` (one Hessian-vector
    product), or None when ``gradient`` is exactly zero (stationarity 0 needs no scale).

    Call it before the operator's graph is released (``op.mixed``).
    """
    if float(tree_norm(gradient)) == 0.0:
        return None
    return op.hvp(tuple(p.detach() for p in op.psi))


def gradient_stationarity(gradient: Tensors, h_psi: Tensors | None) -> float:
    """``||F|| / max(||H psi||, ||F − H psi||)`` for ``F = ∇_psi L_in``
    (:func:`hypergrad.conditions.relative_residual` with the scales of a root): the two terms of the
    gradient's linearisation ``F(psi) − H psi + H y`` at ``psi``, so the ratio is dimensionless,
    invariant to rescaling the loss or the parameters, and exactly 0 at an exact stationary point
    (``h_psi`` None: ``F`` is exactly zero). For a quadratic ``L_in = ½ yᵀ H y − cᵀ y`` it is
    the relative residual ``||H psi − c|| / max(||H psi||, ||c||)`` of the normal equations.
    """
    if h_psi is None:
        return 0.0
    return relative_residual(gradient, h_psi, tree_sub(gradient, h_psi))
