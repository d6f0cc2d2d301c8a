"""Command-line pieces the example scripts share (imported as ``_cli``: ``python examples/x.py``
puts this folder on the import path, and so does ``tests/conftest.py``)."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

import torch


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
        "--warm-start", action="store_true",
        help="start each CG solve from the previous hypergradient's adjoint",
    )  # fmt: skip
    ap.add_argument(
        "--precond", choices=["none", "hutchinson"], default="none",
        help="CG preconditioner: Jacobi from a Hutchinson diagonal estimate (default none)",
    )  # fmt: skip
    ap.add_argument("--probes", type=int, default=16, help="Hutchinson probes per solve")
