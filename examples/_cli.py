"""Command-line pieces the example scripts share (imported as ``_cli``: ``python examples/x.py``
puts this folder on the import path, and so does ``tests/conftest.py``)."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from typing import Any

import torch

import hypergrad as hg


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` torch threads, restoring the previous count afterwards."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def add_adjoint_options(ap: argparse.ArgumentParser) -> None:
    """``--warm-start`` and ``--precond``/``--probes``: how the CG adjoint solves start and are
    preconditioned (see ``hg.CG`` and ``hg.implicit_grad``'s ``x0``)."""
    ap.add_argument(
        "--warm-start", nargs="?", const="previous", default=None,
        choices=["previous", "extrapolate"],
        help="start each CG solve from the previous hypergradient's adjoint (previous, the "
        "default when given alone) or from 2 x_k - x_(k-1), the extrapolation of the last two",
    )  # fmt: skip
    ap.add_argument(
        "--precond", choices=["none", "hutchinson", "dense"], default="none",
        help="CG preconditioner: Jacobi from a Hutchinson diagonal estimate, or the dense "
        "Hessian factor of an earlier step kept across steps (hg.DensePreconditioner; rebuilt "
        "when it has cost as many products as a build) (default none)",
    )  # fmt: skip
    ap.add_argument("--probes", type=int, default=16, help="Hutchinson probes per solve")


def preconditioner(name: str) -> Any:
    """``hg.CG``'s ``preconditioner`` for ``--precond NAME``. A ``"dense"`` one holds its factor:
    make it once per run and keep it across outer steps."""
    if name == "dense":
        return hg.DensePreconditioner()
    return None if name == "none" else name


def adjoint_starts(kind: str | None) -> hg.WarmStart | None:
    """The warm-start rule for ``--warm-start KIND`` (None: off): ``hg.WarmStart``, the rule
    ``hg.HyperStep`` applies, for ``hg.implicit_grad``'s ``x0``."""
    return None if kind is None else hg.WarmStart(kind)
