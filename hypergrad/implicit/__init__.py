"""Implicit differentiation: :func:`implicit_grad` and :func:`implicit` for argmin problems,
:func:`custom_root`, :func:`custom_fixed_point`, :func:`root_vjp` and :func:`root_jvp` for any
optimality condition; one engine under all of them.

At an inner solution ``psi*(theta) = argmin_psi L_in(psi, theta)`` the optimality condition
``dL_in/dpsi = 0`` gives, by the implicit function theorem,

    dL_out/dtheta = dL_out/dtheta|_direct - (d^2 L_in / dtheta dpsi) H^{-1} dL_out/dpsi,

with ``H = d^2 L_in / dpsi^2``. The linear system ``H x = dL_out/dpsi`` is solved by any solver
in :mod:`hypergrad.solvers`. The result is the gradient of the outer loss: put it in ``.grad`` and
step any optimizer that *minimises*.

The formula holds at a stationary point only, so both entry points report how far the given
point is from one, ``info.stationarity = ||g|| / max(||H psi||, ||g - H psi||)`` with
``g = dL_in/dpsi`` (:mod:`hypergrad.conditions`; one Hessian-vector product), and warn with
:class:`~hypergrad.NonStationaryWarning` above
:data:`~hypergrad.conditions.STATIONARITY_THRESHOLD`.

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
private generator: the caller's RNG stream is untouched); above
:data:`~hypergrad.implicit.linearization.SYMMETRY_RTOL` the call raises
:class:`~hypergrad.HypergradValueError` instead of converging to a wrong answer. Conditions
from :func:`hypergrad.conditions.stationary` are known to be symmetric and skip it. Neumann
with an explicit ``alpha`` is accepted for any condition: the series only needs the spectral
radius of ``I − alpha A`` below 1 (``alpha=1`` on the fixed point of a contraction is the
classic adjoint fixed-point iteration).

Every entry point reports ``info.stationarity`` (see :mod:`hypergrad.conditions`; one extra
Jacobian-vector product for a root, none for a fixed point) and warns with
:class:`~hypergrad.NonStationaryWarning` above
:data:`~hypergrad.conditions.STATIONARITY_THRESHOLD`.

The package: :mod:`.linearization` (the two linearizations of a condition), :mod:`.adjoint` (the
reverse and forward solves with their checks), :mod:`.decorator` (the autograd functions and the
three decorators) and :mod:`.functional` (``implicit_grad``, ``root_vjp``, ``root_jvp``).
"""

from .decorator import custom_fixed_point, custom_root, implicit
from .functional import check_warm_start, implicit_grad, root_jvp, root_vjp

__all__ = [
    "check_warm_start",
    "custom_fixed_point",
    "custom_root",
    "implicit",
    "implicit_grad",
    "root_jvp",
    "root_vjp",
]
