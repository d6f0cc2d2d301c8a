"""The shared kit: machine and versions, the one timer, the one memory probe, JSON files.

``timeit`` runs zero-argument callables interleaved (rep 1 of each, rep 2 of each, ... in
alternating order), after ``warmup`` untimed calls, CUDA-synchronised when CUDA is in use, with
more repetitions for cheap callables (each timed for at least ``min_time`` s, at most
``max_reps`` times) and failures recorded instead of raised. ``probe`` measures peak memory in a
fresh process: peak RSS growth (``VmHWM`` after ``clear_refs``, minus the ``VmRSS`` baseline;
``MALLOC_MMAP_THRESHOLD_=65536`` so freed buffers go back to the OS), or the CUDA peak above
the allocated baseline when the process used CUDA.
"""

from __future__ import annotations

import gc
import importlib
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
median = statistics.median


def set_threads(n: int) -> None:
    """``n`` threads for torch and (set before jax is imported) XLA; ``n = 1`` also pins the
    process to one CPU, because XLA in jax 0.10 ignores ``--xla_cpu_multi_thread_eigen=false``
    (jaxopt's MLP hypergradient used 0.26 s of CPU in 0.14 s of wall time with the flag alone)."""
    if n == 1:
        os.environ.setdefault(
            "XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
        )
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    torch.set_num_threads(n)


def machine() -> dict[str, Any]:
    cpu = platform.processor() or "unknown"
    mem = None
    try:
        cpu = next(ln for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
        cpu = cpu.split(":", 1)[1].strip()
        mem = round(int(open("/proc/meminfo").readline().split()[1]) / 2**20, 1)
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "mem_gib": mem,
        "gpu": gpu,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpus_allowed": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "loadavg": os.getloadavg(),
    }


def versions(dists: list[str]) -> dict[str, str]:
    """Installed versions of the distributions (``not installed``); hypergrad with its commit."""
    out = {}
    for d in dists:
        try:
            out[d] = version(d)
        except PackageNotFoundError:
            out[d] = "not installed"
    git = ["git", "-C", str(ROOT)]
    head = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(git + ["status", "--porcelain", "hypergrad"], capture_output=True)
    if "hypergrad" in out and head.stdout.strip():
        mod = ", modified" if dirty.stdout.strip() else ""
        out["hypergrad"] += f" (git {head.stdout.strip()}{mod})"
    return out


def err_text(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:400] if lines else ''}"


def save(path: Path, payload: dict[str, Any]) -> Path:
    """Write ``payload`` (with the machine and the time) as JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"machine": machine(), "created": time.strftime("%Y-%m-%d %H:%M:%S"), **payload}
    path.write_text(json.dumps(payload, indent=1, default=_jsonable))
    return path


def _jsonable(o: Any) -> Any:
    if isinstance(o, torch.Tensor):
        return o.tolist()
    return str(o)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------ timer


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timeit(
    fns: dict[Any, Callable[[], Any]],
    reps: int,
    warmup: int = 1,
    min_time: float = 0.0,
    max_reps: int | None = None,
    seed: int = 0,
) -> dict[Any, dict[str, list]]:
    """Wall (``times_s``) and process CPU (``cpu_s``) times of every callable, interleaved.

    ``torch.manual_seed(seed)`` precedes every call (dropout draws agree across callables). A
    callable that raises gets the message in ``errors`` and is not called again.
    """
    out: dict[Any, dict[str, list]] = {k: {"times_s": [], "cpu_s": [], "errors": []} for k in fns}
    want = dict.fromkeys(fns, reps)
    for r in range(-warmup, max(reps, max_reps or reps)):
        if r == 1:  # the first timed repetition decides how many each callable gets
            for k, rec in out.items():
                t1 = max(min(rec["times_s"] or [1.0]), 1e-6)
                want[k] = int(min(max(reps, math.ceil(min_time / t1)), max_reps or reps))
        keys = list(fns) if (r + warmup) % 2 == 0 else list(fns)[::-1]
        for k in [k for k in keys if r < want[k] and not out[k]["errors"]]:
            torch.manual_seed(seed)
            _sync()
            c0, t0 = time.process_time(), time.perf_counter()
            try:
                fns[k]()
                _sync()
            except Exception as e:  # noqa: BLE001 - a failing callable is a result
                out[k]["errors"].append(err_text(e))
                continue
            if r >= 0:
                out[k]["times_s"].append(time.perf_counter() - t0)
                out[k]["cpu_s"].append(time.process_time() - c0)
    return out


# ------------------------------------------------------------------------------------ memory


def _status_kb(field: str) -> int | None:
    try:
        return next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith(field))
    except (OSError, StopIteration):
        return None


def _start_peak() -> tuple[str, float]:
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return "CUDA max_memory_allocated minus allocated baseline", torch.cuda.memory_allocated()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return "VmHWM after clear_refs reset minus VmRSS baseline", _status_kb("VmRSS") * 1024
    except (OSError, TypeError):
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return "ru_maxrss minus baseline (clear_refs unavailable)", maxrss


def _peak_mib(how: str, base: float) -> float:
    if how.startswith("CUDA"):
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    if how.startswith("VmHWM"):
        return (_status_kb("VmHWM") * 1024 - base) / 2**20
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base) / 2**20


def probe(
    target: str,
    configs: list[dict],
    calls: int = 1,
    warmup: bool = True,
    threads: int = 1,
    timeout: float = 3600.0,
) -> list[dict]:
    """Peak memory of one call per config, all in one fresh process.

    ``target`` is ``"module:function"``; ``function(**config)`` builds a zero-argument callable
    (whatever it allocates is in the baseline); after a warm-up call (``warmup``) the callable
    runs ``calls`` times and the largest peak is reported (the kernel occasionally under-counts
    one call under memory pressure from other jobs).
    """
    spec = json.dumps({"target": target, "configs": configs, "calls": calls, "warmup": warmup})
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", BENCH_THREADS=str(threads))
    cmd = [sys.executable, "-m", "benchmarks.kit", spec]
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        return json.loads(p.stdout.strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        return [{"peak_mib": None, "memory_error": f"timed out after {timeout:.0f}s"}] * len(
            configs
        )
    except (IndexError, json.JSONDecodeError):
        tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["?"]
        return [{"peak_mib": None, "memory_error": tail[0][:300]}] * len(configs)


def allocation(mib: float):
    """A callable allocating ``mib`` MiB (the probe's self-test)."""
    return lambda: torch.ones(int(mib * 2**18))


def _probe_child(spec: dict) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    set_threads(int(os.environ.get("BENCH_THREADS", "1")))
    module, name = spec["target"].split(":")
    build = getattr(importlib.import_module(module), name)
    out = []
    for cfg in spec["configs"]:
        try:
            fn = build(**cfg)
            if spec["warmup"]:
                fn()
            peaks = []
            for _ in range(spec["calls"]):
                how, base = _start_peak()
                t0 = time.perf_counter()
                fn()
                peaks.append(_peak_mib(how, base))
            out.append({"peak_mib": max(peaks), "peak_mib_calls": peaks, "how": how})
            out[-1].update(baseline_mib=base / 2**20, time_s=time.perf_counter() - t0)
            del fn
        except Exception as e:  # noqa: BLE001
            out.append({"peak_mib": None, "memory_error": err_text(e)})
    print(json.dumps(out))


if __name__ == "__main__":
    _probe_child(json.loads(sys.argv[1]))
