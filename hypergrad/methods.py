"""How :class:`~hypergrad.HyperStep` differentiates, as objects, and the warm-start rule.

* :class:`Implicit` (``solver``, ``engine``, ``warm_start``): the implicit function theorem at the
  current inner parameters, one linear solve per hypergradient.
* :class:`Unrolled` (``optimizer``, ``steps``, ``truncate``): reverse mode through ``steps``
  look-ahead optimizer updates.
* :class:`FirstOrder` (``alpha`` or ``optimizer``, ``terms``, ``fd_step``): no second-order
  graph; ``H⁻¹`` replaced by a diagonal (or the inner optimizer's update derivative), products by
  central differences of ordinary gradients.
* :class:`SingleLoop` (``step``, ``engine``): the adjoint a state across outer steps, advanced
  by one product per step (SOBA's recursion).
* :class:`WarmStart`: the start of each adjoint solve from the previous ones (``"previous"`` or
  ``"extrapolate"``), the rule ``HyperStep`` applies, public for loops over
  :func:`~hypergrad.implicit_grad`::

      starts = hg.WarmStart("extrapolate")
      for batch in batches:
          g, info = hg.implicit_grad(inner, outer, w, lam, x0=starts.x0())
          starts.update(info)

Each method object validates its own settings when it is made (optimistix passes its
``adjoint=`` the same way), on the library's one settings system (:mod:`hypergrad.settings`:
each setting declared with its check, validated when built, then frozen; assigning one raises
:class:`~hypergrad.FrozenSettingError`, also a :class:`dataclasses.FrozenInstanceError`): change
one with ``method.replace(...)`` (:func:`dataclasses.replace`). They compare by value, field by
field (the solver by its settings, as solvers compare; an optimizer by ``==``, which for a
function is identity), and their hash is consistent with that equality: it is built from the
settings that equal objects share and that are always hashable (the class, the solver's class,
``engine``, ``warm_start``; ``steps``, ``truncate``), so a method object can be a dict key or a
set member although a solver cannot.
A method object never equals a string.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

import torch

from .errors import FrozenSettingError, HypergradTypeError, HypergradValueError
from .operators import ENGINES
from .report import HypergradInfo, check_solver
from .settings import FrozenSettings, choice, count, number, setting
from .solvers import Solver
from .tree import PyTree, tree_all_finite, tree_flatten, tree_unflatten
from .unrolled import OptimizerArg, check_optimizer

#: The kinds of :class:`WarmStart`.
WARM_START_KINDS = ("previous", "extrapolate")


def warm_start_kind(value: object) -> str | None:
    """``value`` as a :data:`WARM_START_KINDS` entry (None: off): ``False`` is off, a kind is
    itself; anything else raises (``True`` too: the kind is named, ``"previous"``)."""
    if value is False:
        return None
    if isinstance(value, str) and value in WARM_START_KINDS:
        return value
    hint = " (warm_start=True: pass the kind, warm_start='previous')" if value is True else ""
    raise HypergradValueError(
        f"warm_start must be one of {(False, *WARM_START_KINDS)}, got {value!r}{hint}"
    )


class WarmStart:
    """The warm start of successive adjoint solves: from zero, then from the last good adjoint
    (``kind="previous"``), or from ``2 x_k - x_{k-1}``, the linear extrapolation of the last two
    (``kind="extrapolate"``; the last one alone until two are kept).

    Across outer steps the inner parameters and the hyperparameters move little, so the previous
    adjoint is close to the next one and the solver needs fewer iterations; the converged answer
    is the same (a solve is judged on its recomputed residual). The adjoint of a failed solve
    (:attr:`SolveInfo.failure <hypergrad.SolveInfo.failure>` set) or one with NaN/Inf entries is
    never kept: :meth:`update` forgets everything instead, so the next solve starts from zero.

    This is the rule :class:`~hypergrad.HyperStep` applies for ``hg.Implicit(warm_start=...)``;
    with :func:`~hypergrad.implicit_grad` a loop applies it itself.

    Args:
        kind: ``"previous"`` (default) or ``"extrapolate"``.

    Example:
        >>> import torch, hypergrad as hg
        >>> X = torch.randn(20, 3, dtype=torch.float64)
        >>> inner = lambda w, lam: 0.5 * ((X @ w - 1.0) ** 2).sum() + 0.5 * lam * (w ** 2).sum()
        >>> outer = lambda w, lam: (w ** 2).sum()
        >>> starts = hg.WarmStart("extrapolate")
        >>> for lam in (0.5, 0.51, 0.52):
        ...     lam = torch.tensor(lam, dtype=torch.float64)
        ...     A = X.T @ X + lam * torch.eye(3, dtype=torch.float64)
        ...     w = torch.linalg.solve(A, X.sum(0))
        ...     g, info = hg.implicit_grad(inner, outer, w, lam, solver=hg.CG(tol=1e-10),
        ...                                x0=starts.x0())
        ...     kept = starts.update(info)
        >>> kept, starts.kept
        (True, 2)
    """

    def __init__(self, kind: str = "previous") -> None:
        if kind not in WARM_START_KINDS:
            raise HypergradValueError(
                f"WarmStart kind must be one of {WARM_START_KINDS}, got {kind!r}"
            )
        self._kind = kind
        self.last: PyTree | None = None
        self.previous: PyTree | None = None

    @property
    def kind(self) -> str:
        """``"previous"`` or ``"extrapolate"``: a setting, fixed at construction (a new
        ``WarmStart`` takes another)."""
        return self._kind

    @kind.setter
    def kind(self, value: object) -> None:
        raise FrozenSettingError(
            f"WarmStart.kind is fixed at construction (it is {self._kind!r}): build a new "
            f"hg.WarmStart({value!r}) instead"
        )

    def __repr__(self) -> str:
        return f"WarmStart({self.kind!r}, kept={self.kept})"

    @property
    def kept(self) -> int:
        """How many adjoints are kept (0, 1 or 2)."""
        return (self.last is not None) + (self.previous is not None)

    def x0(self) -> PyTree | None:
        """The start of the next solve (None: from zero), shaped like the kept adjoints."""
        if self.last is None:
            return None
        if self.kind != "extrapolate" or self.previous is None:
            return self.last
        last, spec = tree_flatten(self.last, "adjoint")
        previous, _ = tree_flatten(self.previous, "adjoint")
        return tree_unflatten(spec, [2 * a - b for a, b in zip(last, previous)])

    def update(self, info: HypergradInfo | None) -> bool:
        """Keep ``info.adjoint`` when its solve succeeded; otherwise forget every kept adjoint.

        Args:
            info: the report of the solve just made (:func:`~hypergrad.implicit_grad`'s,
                ``fit.last_info`` of ``@hg.implicit``, ...), or None to forget (e.g. a solve the
                caller does not trust).

        Returns:
            Whether the adjoint was kept.

        Raises:
            HypergradTypeError: ``info`` is not a :class:`~hypergrad.HypergradInfo` (e.g. the
                adjoint itself, or ``info.solve``: the adjoint is ``info.adjoint``).
        """
        if info is None:
            self.reset()
            return False
        if not isinstance(info, HypergradInfo):
            raise HypergradTypeError(
                "WarmStart.update takes the HypergradInfo of the solve (e.g. implicit_grad's "
                f"info), or None to forget, got {type(info).__name__}; the adjoint it keeps is "
                "info.adjoint"
            )
        adjoint = info.adjoint
        good = (
            info.solve.failure is None
            and adjoint is not None
            and tree_all_finite(tuple(tree_flatten(adjoint, "adjoint")[0]))
        )
        if not good:
            self.reset()
            return False
        self.previous, self.last = self.last, adjoint
        return True

    def reset(self) -> None:
        """Forget the kept adjoints: the next solve starts from zero (e.g. when the model or the
        batch changes completely)."""
        self.last = self.previous = None


def _check_warm_start(_: str, value: object) -> bool | str:
    """``Implicit``'s ``warm_start``: ``False`` or a :data:`WARM_START_KINDS` entry, as is."""
    if isinstance(value, WarmStart):
        raise HypergradTypeError(
            f"Implicit(warm_start=...) takes the kind, e.g. warm_start={value.kind!r}"
            " (each HyperStep keeps its own WarmStart), not a WarmStart object"
        )
    kind = warm_start_kind(value)
    return False if kind is None else kind


def _check_optimizer(_: str, value: OptimizerArg) -> OptimizerArg:
    """``Unrolled``'s ``optimizer``: required, a functional optimizer or a function returning
    one."""
    if value is None:
        raise HypergradValueError(
            "Unrolled needs optimizer=..., e.g. hg.optim.sgd(lr=0.1) (the look-ahead update; "
            "use the model's own learning rate for a Meta-Weight-Net step)"
        )
    check_optimizer(value)
    return value


@dataclass
class Implicit(FrozenSettings):
    """The implicit method of :class:`~hypergrad.HyperStep`: the inner parameters at their
    current values are taken as an approximate inner solution and the adjoint system
    ``H x = dL_out/dpsi`` is solved.

    Args:
        solver: the linear solver (default ``hg.CG()``).
        engine: ``"reuse"`` (one gradient graph, fastest) or ``"recompute"`` (lowest memory).
        warm_start: ``False`` (default), ``"previous"`` or ``"extrapolate"``: start each solve
            from the previous call's adjoint, by :class:`WarmStart`'s rule (the ``HyperStep``
            keeps its own :class:`WarmStart`, ``step.warm``).

    Equality is by value (``hg.Implicit(solver=hg.CG(tol=1e-8)) == hg.Implicit(solver=hg.CG(
    tol=1e-8))``), with a hash consistent with it (:mod:`hypergrad.methods`).

    Example:
        >>> import hypergrad as hg
        >>> hg.Implicit(solver=hg.CG(maxiter=20), warm_start="extrapolate").warm_start
        'extrapolate'
    """

    solver: Solver | None = setting(None, lambda _, value: check_solver(value))
    engine: str = choice("reuse", ENGINES)
    warm_start: bool | str = setting(False, _check_warm_start)

    _instance_name = "method"
    _read_by = "every hypergradient step"

    def __hash__(self) -> int:
        # consistent with the dataclass __eq__: equal objects share these (a solver is unhashable)
        return hash((Implicit, type(self.solver), self.engine, self.warm_start))

    @property
    def warm_start_kind(self) -> str | None:
        """``warm_start`` as a :data:`WARM_START_KINDS` entry (None: off)."""
        return warm_start_kind(self.warm_start)

    def check_distributed(self, distributed: str | None) -> None:
        """Every ``distributed`` mode runs the implicit method (None, ``"exact"``, ``"local"``)."""


@dataclass
class Unrolled(FrozenSettings):
    """The unrolled method of :class:`~hypergrad.HyperStep`: reverse mode through ``steps``
    look-ahead updates ``psi_{t+1} = psi_t + optimizer.update(grad inner_loss)`` from the current
    parameters (one step: the look-ahead of Meta-Weight-Net and second-order DARTS), then through
    ``outer_loss`` at ``psi_steps``; the model's own parameters are not changed.

    Args:
        optimizer: a functional optimizer (``hg.optim.sgd(lr=0.1)``, torchopt's), or a function
            of the hyper tensors (a tuple, in ``hyper``'s parameter order) returning one, to learn
            its settings.
        steps: look-ahead updates (default 1).
        truncate: differentiate through the last ``truncate`` steps only (None: all of them).

    Under ``distributed=...`` only ``"local"`` (the average of the per-process hypergradients) is
    supported.

    Equality is by value (the optimizer by ``==``: the same object, or equal settings for an
    optimizer that compares them), with a hash consistent with it (:mod:`hypergrad.methods`).

    Example:
        >>> import hypergrad as hg
        >>> hg.Unrolled(hg.optim.sgd(lr=0.1), steps=3).truncate
        3
    """

    optimizer: OptimizerArg = setting(None, _check_optimizer)
    steps: int = count(1, minimum=1, allow_none=False)
    truncate: int | None = None  # None: resolved to steps when made, by check()

    _instance_name = "method"
    _read_by = "every hypergradient step"

    def __hash__(self) -> int:
        # consistent with the dataclass __eq__; the optimizer may be unhashable, so it is left out
        return hash((Unrolled, self.steps, self.truncate))

    def check(self) -> None:
        """``truncate``: an int in ``[1, steps]`` (None: ``steps``)."""
        steps, truncate = self.steps, self.truncate
        if truncate is None:
            truncate = steps
        if (
            isinstance(truncate, bool)
            or not isinstance(truncate, numbers.Integral)
            or not 1 <= truncate <= steps
        ):
            raise HypergradValueError(
                f"Unrolled truncate must be an int in [1, steps={steps}], got {self.truncate!r}"
            )
        object.__setattr__(self, "truncate", int(truncate))

    def check_distributed(self, distributed: str | None) -> None:
        """Raise for ``distributed="exact"`` (None and ``"local"`` run)."""
        if distributed == "exact":
            raise HypergradValueError(
                "the unrolled method supports distributed=None or 'local'; 'exact' all-reduces "
                "the implicit method's products (wrap the inner model in DDP to reduce look-ahead "
                "gradients instead)"
            )


def _check_inner_optimizer(_: str, value: object) -> object:
    """``FirstOrder``'s ``optimizer``: None or a ``torch.optim`` optimizer (which class it
    adapts to is checked at each step, by :func:`~hypergrad.first_order.update_derivative`)."""
    if value is not None and not isinstance(value, torch.optim.Optimizer):
        raise HypergradTypeError(
            "FirstOrder optimizer must be the inner model's torch.optim optimizer (SGD, Adam, "
            f"AdamW) or None, got {type(value).__name__}"
        )
    return value


@dataclass
class FirstOrder(FrozenSettings):
    """The first-order method of :class:`~hypergrad.HyperStep`: no Hessian-vector product and
    no second-order graph, only ordinary gradient passes (:mod:`hypergrad.first_order`).

    ``H⁻¹`` is replaced by a diagonal ``P``: ``alpha·I``, or the derivative of ``optimizer``'s
    next update with respect to the gradient (SGD with or without momentum, Adam, AdamW; read
    from its settings and state at each step: :func:`~hypergrad.first_order.update_derivative`),
    refined by ``terms`` preconditioned Richardson steps ``v ← v + P (g − H v)``; the mixed
    product ``M v`` (and each ``H v``) is a central difference of two gradients of the inner loss
    at ``ψ ± ε v``. A meta step costs ``3 + 2·terms`` forward+backward passes. The result is
    biased (``M (H⁻¹ − P_terms) ∇_ψ L_out``): ``docs/modules.md`` measures the bias against the
    exact hypergradient.

    Args:
        alpha: ``H⁻¹ ≈ alpha·I`` (give this or ``optimizer``).
        optimizer: the inner model's ``torch.optim`` optimizer, to adapt ``P`` to (SAMA's
            "algorithmic adaptation", Choe et al., NeurIPS 2023).
        terms: Richardson terms (0: the base Jacobian alone, 3 passes per step).
        fd_step: relative finite-difference step: the perturbation ``ε v`` has norm
            ``fd_step · max(1, ||ψ||)``; None: ``eps^{1/3}`` of the parameters' dtype.

    Under ``distributed="exact"`` the outer gradient is all-reduced before the perturbation (one
    parameter-sized collective; one more per term) and the result once (hyper-sized);
    ``"local"`` averages the per-process results.

    Example:
        >>> import hypergrad as hg
        >>> hg.FirstOrder(alpha=0.1, terms=2).terms
        2
    """

    alpha: float | None = number(None, strict=True, allow_none=True)
    optimizer: Any = setting(None, _check_inner_optimizer)
    terms: int = count(0, minimum=0, allow_none=False)
    fd_step: float | None = number(None, strict=True, allow_none=True)

    _instance_name = "method"
    _read_by = "every hypergradient step"

    def __hash__(self) -> int:
        # consistent with the dataclass __eq__; the optimizer compares by identity, left out
        return hash((FirstOrder, self.alpha, self.terms, self.fd_step))

    def check(self) -> None:
        """Exactly one of ``alpha`` and ``optimizer``; ``fd_step`` below 1."""
        if (self.alpha is None) == (self.optimizer is None):
            raise HypergradValueError(
                "FirstOrder needs exactly one of alpha=... (H⁻¹ ≈ alpha·I) and optimizer=... "
                "(the inner model's torch.optim optimizer, whose update derivative is used)"
            )
        if self.fd_step is not None and not self.fd_step < 1:
            raise HypergradValueError(f"FirstOrder fd_step must be in (0, 1), got {self.fd_step}")

    def check_distributed(self, distributed: str | None) -> None:
        """Every ``distributed`` mode runs (None, ``"exact"``, ``"local"``)."""


@dataclass
class SingleLoop(FrozenSettings):
    """The single-loop method of :class:`~hypergrad.HyperStep`: the adjoint is a state kept
    across outer steps and advanced by one product per step (SOBA's recursion:
    :mod:`hypergrad.single_loop`), ``v ← v + step (∇_ψ L_out − H v)``; the hypergradient is
    ``∇_θ L_out − M v`` with the kept ``v``. ``H v`` and ``M v`` come from one backward pass
    through the inner gradient's graph.

    How it differs from ``hg.Implicit(solver=hg.Neumann(maxiter=1, alpha=step),
    warm_start="previous")``, which runs the same Richardson recursion: that one spends two
    Hessian-vector products per outer step (``info.solve.matvecs == 2`` from the second step on:
    the warm start's residual and the series term, two Richardson steps) and a third backward
    pass for the mixed product, and :class:`WarmStart` drops the adjoint whenever a solve is
    reported failed. Here an outer step is one Richardson step for one backward pass (``H v``
    and ``M v`` together), and the state is dropped only when it has NaN/Inf entries; per
    product the two contract alike. ``info.adjoint_residual`` reports how far the kept adjoint
    is from solving the current system.

    Args:
        step: the adjoint's step size ``ρ``; the recursion contracts for ``0 < ρ < 2/λ_max(H)``
            with ``H`` positive definite.
        engine: ``"reuse"`` or ``"recompute"`` (:mod:`hypergrad.operators`).

    Example:
        >>> import hypergrad as hg
        >>> hg.SingleLoop(step=0.1).step
        0.1
    """

    step: float = number(None, strict=True)
    engine: str = choice("reuse", ENGINES)

    _instance_name = "method"
    _read_by = "every hypergradient step"

    def __hash__(self) -> int:
        return hash((SingleLoop, self.step, self.engine))

    def check_distributed(self, distributed: str | None) -> None:
        """Every ``distributed`` mode runs (None, ``"exact"``, ``"local"``)."""


Method = Implicit | Unrolled | FirstOrder | SingleLoop
