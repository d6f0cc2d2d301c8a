"""One adapter per library, each used the way its documentation shows. Every
``benchmarks/peers/<lib>.py`` has ``DISTS`` (the distributions whose versions the results record;
or a ``version()`` function), ``IMPORTS`` (the modules it needs; or a ``missing()`` function
giving why it cannot run), ``SOLVERS`` (its implicit solvers; or ``solvers(P)``, and optionally
``tta_solvers(P)`` for the time-to-accuracy suite), ``implicit(P, solver, K)`` and optionally
``unrolled(P, T, lr, params0)``. Those two do once what a user does once (building an engine,
``jax.jit``) and return a callable doing one hypergradient (flat float64): at ``P``'s stored inner
solution with K solver iterations, or by reverse mode through T SGD steps from ``params0``. A
configuration a library cannot express raises ``Unsupported`` with the reason.
"""

from __future__ import annotations

import importlib
import subprocess
from importlib import metadata
from types import ModuleType

import numpy as np
import torch

from benchmarks.kit import ROOT

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
    reason = missing(lib) or (None if hasattr(mod, mode) else f"{lib} has no {mode} mode")
    if reason:
        raise Unsupported(reason)
    return getattr(mod, mode)(*args, **kw)


def versions() -> dict[str, str]:
    """Installed versions of torch, the libraries and numpy / scikit-learn; hypergrad with its
    commit."""
    mods = [module(lib) for lib in LIBS]
    dists = ["torch"] + [d for m in mods for d in m.DISTS] + ["numpy", "scikit-learn"]
    out = {}
    for d in dict.fromkeys(dists):
        try:
            out[d] = metadata.version(d)
        except metadata.PackageNotFoundError:
            out[d] = "not installed"
    git = ["git", "-C", str(ROOT)]
    head = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(git + ["status", "--porcelain", "hypergrad"], capture_output=True)
    if "hypergrad" in out and head.stdout.strip():
        mod = ", modified" if dirty.stdout.strip() else ""
        out["hypergrad"] += f" (git {head.stdout.strip()}{mod})"
    out.update({lib: m.version() for lib, m in zip(LIBS, mods) if hasattr(m, "version")})
    return out


def flat(ts) -> np.ndarray:
    ts = [ts] if isinstance(ts, torch.Tensor) else ts
    return np.concatenate([np.asarray(t.detach().cpu(), dtype=np.float64).ravel() for t in ts])


def products(solver: str, K: int) -> int:
    """Hessian(-transpose)-vector products a configuration may spend."""
    return 2 * K + 1 if solver.startswith("normal_cg") else K


def missing(lib: str) -> str | None:
    """Why ``lib`` cannot run here (``None``: it can)."""
    mod = module(lib)
    if hasattr(mod, "missing"):
        return mod.missing()
    for name in getattr(mod, "IMPORTS", ()):
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001
            return f"{name} is not installed/importable ({type(e).__name__}: {e})"
    return None


def solvers(lib: str, P, tta: bool = False) -> list[str]:
    """``lib``'s implicit solvers on ``P`` (``tta``: in the time-to-accuracy suite)."""
    mod = module(lib)
    f = getattr(mod, "tta_solvers", None) if tta else None
    return list((f or getattr(mod, "solvers", lambda P: mod.SOLVERS))(P))
