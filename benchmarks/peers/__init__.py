"""One adapter per library, each used the way its documentation shows.

Every ``benchmarks/peers/<lib>.py`` exposes the same small interface:

* ``DISTS``: the distributions whose versions the results record (or a ``version()`` function);
* ``missing() -> str | None``: why the library cannot run here (``None``: it can);
* ``solvers(P) -> list[str]``: its implicit solvers on problem ``P`` for the equal-K suite, and
  optionally ``tta_solvers(P)`` for the time-to-accuracy suite (default: ``solvers``);
* ``implicit(P, solver, K) -> () -> np.ndarray``: the hypergradient at ``P``'s stored inner
  solution with K solver iterations, flat float64. Whatever a user does once (building an engine,
  decorating a solver, ``jax.jit``) happens in ``implicit``; the callable does one hypergradient;
* ``unrolled(P, T, lr, params0) -> () -> np.ndarray`` (optional): reverse mode through T SGD
  steps from ``params0``.

A configuration a library cannot express raises ``Unsupported`` with the reason; a library that
is not installed is skipped with ``missing()``'s reason recorded.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import numpy as np
import torch

LIBS = ("hypergrad", "torchopt", "betty", "higher", "jaxopt", "optimistix", "hypertorch")
CG_TOL = 1e-10  # relative residual of every CG: a configuration stops early only once converged


class Unsupported(Exception):
    """The library cannot run this configuration (reason in the message)."""


def module(lib: str) -> ModuleType:
    return importlib.import_module(f"benchmarks.peers.{lib}")


def build(lib: str, mode: str, *args, **kw):
    """``<lib>.<mode>(*args)`` (mode ``implicit`` or ``unrolled``); ``Unsupported`` when the
    library is missing or has no such mode."""
    mod = module(lib)
    reason = mod.missing() or (None if hasattr(mod, mode) else f"{lib} has no {mode} mode")
    if reason:
        raise Unsupported(reason)
    return getattr(mod, mode)(*args, **kw)


def versions() -> dict[str, str]:
    from benchmarks.kit import versions as dist_versions

    mods = [module(lib) for lib in LIBS]
    dists = ["torch"] + [d for m in mods for d in m.DISTS] + ["numpy", "scikit-learn"]
    out = dist_versions(list(dict.fromkeys(dists)))
    out.update({lib: m.version() for lib, m in zip(LIBS, mods) if hasattr(m, "version")})
    return out


def flat(ts) -> np.ndarray:
    ts = [ts] if isinstance(ts, torch.Tensor) else ts
    return np.concatenate([np.asarray(t.detach().cpu(), dtype=np.float64).ravel() for t in ts])


def products(solver: str, K: int) -> int:
    """Hessian(-transpose)-vector products a configuration may spend."""
    return 2 * K + 1 if solver.startswith("normal_cg") else K


def quiet_import(name: str) -> str | None:
    """``None`` when ``name`` imports, else the reason."""
    try:
        importlib.import_module(name)
    except Exception as e:  # noqa: BLE001
        return f"{name} is not installed/importable ({type(e).__name__}: {e})"
    return None
