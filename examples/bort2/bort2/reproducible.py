"""``reproducible=true``: the same numbers on every x86-64 CPU, whatever its vector units.

A run's float arithmetic depends on which kernels do it, and torch picks them from the CPU it
finds: ATen's vectorised kernels (default / AVX2 / AVX-512), oneDNN's convolutions (up to
AVX-512 and AMX), MKL's GEMM (one code path per instruction set) and the thread count that
splits their sums. Different rounding changes the trajectory of thousands of SGD steps, and a
single seed's accuracy moves by points (docs/bort2.md, "Reproducibility" and "Reproducible
numbers across machines"). This mode pins every one of them to the level every x86-64 CPU has:

* ``ATEN_CPU_CAPABILITY=default``: ATen's baseline kernels, not its AVX2 / AVX-512 ones;
* ``ONEDNN_MAX_CPU_ISA=SSE41``: oneDNN's SSE4.1 kernels (its lowest level);
* ``MKL_CBWR=COMPATIBLE``: MKL's conditional numerical reproducibility, the code path that gives
  the same bits on every CPU MKL runs on (same MKL version, same thread count);
* ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` = ``threads`` and ``MKL_DYNAMIC=FALSE``: a fixed
  thread count (``threads=0``, "as many as the machine has", is refused);
* ``torch.use_deterministic_algorithms(True)`` (and cuDNN's deterministic flags, with
  ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` as CUDA asks for it).

The environment variables are read once, when torch (or MKL, or oneDNN) first needs them, so
they are set before ``import torch``: :func:`pin` runs right after the config is read, which in
``run.py`` / the ``bort2`` script is before anything imports torch. Where torch was imported
earlier (a ``sitecustomize``, or ``python -c "import torch; ..."`` calling ``main()``), the
process starts itself again with the variables set (``os.execv``; :data:`MARKER` stops a
loop). :func:`main` called from Python with torch already imported refuses the mode instead.

What it cannot pin: other CPU architectures (ARM's baseline kernels are NEON ones), another
torch or MKL version, and GPUs (deterministic algorithms make a GPU run repeat itself, not match
another GPU model or the CPU).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from .config import ConfigError

__all__ = ["MARKER", "apply", "pin", "pinned_env", "record"]

#: set (to ``"1"``) in the environment of a process that re-executed itself to pin the variables
MARKER = "BORT2_REPRODUCIBLE_PINNED"

#: the CPU levels of the pin, as ``torch.backends.cpu.get_cpu_capability()`` names them
ATEN_LEVEL = "default"


def pinned_env(threads: int) -> dict[str, str]:
    """The environment variables ``reproducible=true`` sets (``threads``: the config's, >= 1)."""
    n = str(threads)
    return {
        "ATEN_CPU_CAPABILITY": ATEN_LEVEL,
        "ONEDNN_MAX_CPU_ISA": "SSE41",
        "MKL_CBWR": "COMPATIBLE",
        "MKL_DYNAMIC": "FALSE",
        "MKL_NUM_THREADS": n,
        "OMP_NUM_THREADS": n,
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    }


def _missing(threads: int) -> dict[str, str]:
    return {k: v for k, v in pinned_env(threads).items() if os.environ.get(k) != v}


def pin(threads: int, *, entry: bool) -> None:
    """Set :func:`pinned_env` in this process's environment before torch reads it.

    ``entry``: this call is the process's own command line (``main()`` without arguments), so
    it may start the process again when torch is already imported. Raises :class:`ConfigError`
    for ``threads=0``, and when torch is imported and the process cannot be restarted.
    """
    if threads < 1:
        raise ConfigError(
            "reproducible=true needs a fixed thread count: threads=0 takes as many as the "
            "machine has, which changes the numbers from one machine to the next; use threads=1 "
            "(the default) or another number"
        )
    missing = _missing(threads)
    if not missing:
        return
    if "torch" not in sys.modules:  # torch reads them when it loads or first needs them
        os.environ.update(missing)
        return
    if entry and os.environ.get(MARKER) != "1":
        os.environ.update(missing)
        os.environ[MARKER] = "1"
        sys.stdout.flush()
        sys.stderr.flush()
        argv = list(getattr(sys, "orig_argv", [])[1:]) or list(sys.argv)
        os.execv(sys.executable, [sys.executable, *argv])
    raise ConfigError(
        "reproducible=true must pin "
        + ", ".join(f"{k}={v}" for k, v in missing.items())
        + " before torch is imported, and torch is already imported in this process; run the "
        "command in a fresh process (python examples/bort2/run.py ... reproducible=true), or "
        "set those variables before starting Python"
    )


def apply(device: str) -> dict[str, Any]:
    """After ``import torch``: deterministic algorithms, and a check that the pins took effect.

    Returns the record written to results.json (``environment``). Raises :class:`ConfigError`
    when torch runs kernels other than the pinned ones (it chose them before the pin).
    """
    import torch

    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    capability = torch.backends.cpu.get_cpu_capability()
    if capability.lower() != ATEN_LEVEL:
        raise ConfigError(
            f"reproducible=true pins ATEN_CPU_CAPABILITY={ATEN_LEVEL}, but torch already runs "
            f"its {capability} kernels (it chose them before the pin was set); run the command "
            "in a fresh process"
        )
    return record(True, device)


def record(reproducible: bool, device: str) -> dict[str, Any]:
    """What decided this process's arithmetic: the mode, the pinned variables as set, the
    kernels torch runs and its thread count (results.json ``environment``)."""
    import torch

    names = tuple(pinned_env(1))
    return {
        "reproducible": reproducible,
        "variables": {k: os.environ.get(k) for k in names},
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "threads": torch.get_num_threads(),
        "device": str(device),
    }


def add_to_results(out_dir: Any, environment: dict[str, Any]) -> None:
    """Add ``environment`` to results.json and one line naming the mode to results.md."""
    import json
    from pathlib import Path

    from .checkpoint import atomic_write_text

    out = Path(out_dir)
    path = out / "results.json"
    payload = json.loads(path.read_text())
    payload["environment"] = environment
    atomic_write_text(json.dumps(payload, indent=2), path)
    md = out / "results.md"
    if environment["reproducible"]:
        line = (
            "Mode: reproducible=true (baseline CPU kernels, MKL_CBWR=COMPATIBLE, "
            f"{environment['threads']} thread(s)): the same numbers on every x86-64 CPU.\n"
        )
    else:
        line = (
            "Mode: reproducible=false (the kernels of this CPU); reproducible=true gives the "
            "same numbers on every x86-64 CPU.\n"
        )
    atomic_write_text(md.read_text() + line, md)
