"""Adapters of the ``roots`` suite (benchmarks/suites/roots.py): hypergradients through a lasso
solution (proximal gradient) and through a deep-equilibrium fixed point, one module per library.

Every ``benchmarks/peers/roots/<lib>.py`` has ``DISTS`` (distributions whose versions the results
record), ``IMPORTS`` (modules it needs), ``METHODS`` (``{"lasso": [...], "deq": [...]}``: forward
solver ``+`` backward linear solver) and ``build(P, method, kf, kb, ftol, btol)``. ``build`` does
once what a user does once (building the solver objects, ``jax.jit``) and returns a callable that
runs the inner solve from zero (at most ``kf`` forward iterations, stopping earlier only at the
library's own tolerance ``ftol``) and the implicit backward (at most ``kb`` iterations or products
of its linear solver, tolerance ``btol``) and returns the hypergradient as one flat float64 array:
``dL_val/dλ`` (lasso) or ``dL/d(W, U, b)`` flattened in that order (DEQ).
"""

from __future__ import annotations

import importlib
from importlib import metadata
from types import ModuleType

from benchmarks.peers import Unsupported, flat  # noqa: F401 - re-exported for the adapters

LIBS = ("hypergrad", "jaxopt", "torchopt", "torchdeq")


def module(lib: str) -> ModuleType:
    return importlib.import_module(f"benchmarks.peers.roots.{lib}")


def missing(lib: str) -> str | None:
    """Why ``lib`` cannot run here (``None``: it can)."""
    for name in module(lib).IMPORTS:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001
            return f"{name} is not installed/importable ({type(e).__name__}: {e})"
    return None


def methods(lib: str, kind: str) -> list[str]:
    return list(module(lib).METHODS.get(kind, []))


def build(lib: str, P, method: str, kf: int, kb: int, ftol: float, btol: float):
    reason = missing(lib)
    if reason:
        raise Unsupported(reason)
    return module(lib).build(P, method, kf, kb, ftol, btol)


def versions() -> dict[str, str]:
    """The peer suite's versions (hypergrad with its commit, jax, jaxopt, torchopt, ...) and
    torchdeq's."""
    from benchmarks.peers import versions as peer_versions

    out = peer_versions()
    for d in ("torchdeq",):
        try:
            out[d] = metadata.version(d)
        except metadata.PackageNotFoundError:
            out[d] = "not installed"
    return out
