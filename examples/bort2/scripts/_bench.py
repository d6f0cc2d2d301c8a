"""What the measuring scripts of this folder share: one pinned thread, an interleaved timer, and
results written as JSON (with a machine block) plus a markdown table rendered from that JSON."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parents[1] / "results"


def add_run_options(p: argparse.ArgumentParser) -> None:
    """The options every script here takes: ``--threads``, ``--quick``, ``--report``, ``--out``."""
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: pinned to one CPU)")
    p.add_argument("--quick", action="store_true", help="reduced settings, into results/quick/")
    p.add_argument("--report", action="store_true", help="only render the .md from the .json")
    p.add_argument("--out", type=Path, default=None, help="results folder")


def out_dir(a: argparse.Namespace) -> Path:
    """``--out``, else ``results/`` (``results/quick/`` for ``--quick``)."""
    return a.out or (RESULTS / "quick" if a.quick else RESULTS)


def set_threads(n: int) -> None:
    """``n`` torch threads; with ``n = 1`` the process is also pinned to one CPU."""
    if n == 1 and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    torch.set_num_threads(n)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def machine() -> dict[str, Any]:
    """The machine block of a results file: the same code as the repository's
    ``benchmarks.kit.machine``, so the two kinds of results describe machines alike.

    A copy, not an import: ``examples/bort2`` installs and runs on its own, where the repository's
    ``benchmarks`` package is not importable, and the library (``hypergrad``), which both could
    import, holds no benchmarking code. ``tests/benchmarks/test_benchmarks.py`` fails when the
    copies differ.
    """
    cpu, mem = platform.processor() or "unknown", None
    try:
        cpu = next(ln for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
        cpu = cpu.split(":", 1)[1].strip()
        mem = round(int(open("/proc/meminfo").readline().split()[1]) / 2**20, 1)
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    out = dict(cpu=cpu, cores=os.cpu_count(), mem_gib=mem, gpu=gpu)
    out.update(python=platform.python_version(), platform=platform.platform())
    out.update(torch=torch.__version__, torch_threads=torch.get_num_threads())
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {**out, "cpus_allowed": allowed, "loadavg": os.getloadavg()}


def timeit(fns: dict[str, Callable[[], Any]], reps: int, warmup: int) -> dict[str, float]:
    """Median wall time of every callable: ``warmup`` untimed rounds, then ``reps`` timed ones,
    the callables interleaved in alternating order, ``torch.manual_seed(0)`` before each call."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(-warmup, reps):
        for k in list(fns) if (r + warmup) % 2 == 0 else list(fns)[::-1]:
            torch.manual_seed(0)
            t0 = time.perf_counter()
            fns[k]()
            if r >= 0:
                times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(t) for k, t in times.items()}


def table(head: list[str], rows: list[list], align: str = "") -> str:
    """A markdown table; ``align`` has one letter per column, ``r`` for right-aligned."""
    line = lambda r: "| " + " | ".join(map(str, r)) + " |"
    sep = "|" + "|".join("---:" if a == "r" else "---" for a in (align or "l" * len(head))) + "|"
    return "\n".join([line(head), sep, *map(line, rows)])


def save(out: Path, name: str, payload: dict[str, Any]) -> None:
    """``<name>.json`` in ``out``, with the machine and the time."""
    out.mkdir(parents=True, exist_ok=True)
    payload = {"machine": machine(), "created": time.strftime("%Y-%m-%d %H:%M:%S"), **payload}
    (out / f"{name}.json").write_text(json.dumps(payload, indent=1))


def render(out: Path, name: str, script: str, to_md: Callable[[dict], str]) -> str:
    """``<name>.md`` in ``out`` from ``<name>.json`` (``to_md`` makes the table); the table."""
    md = to_md(json.loads((out / f"{name}.json").read_text()))
    head = f"<!-- generated from {name}.json by examples/bort2/scripts/{script} -->"
    (out / f"{name}.md").write_text(f"{head}\n\n{md}\n")
    return md
